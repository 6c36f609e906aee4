"""Generated from ``api.proto`` by ``make protos``; ``make lint`` fails if regenerating changes them."""
