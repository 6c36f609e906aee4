"""The fault suite (``make chaos``, scripts/chaos.py): the harness, the scenarios one per module, the counting."""
