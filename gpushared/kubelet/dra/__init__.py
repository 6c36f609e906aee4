"""The kubelet's DRA plugin API (``NodePrepareResources``/``NodeUnprepareResources``), versions v1 and v1beta1."""
