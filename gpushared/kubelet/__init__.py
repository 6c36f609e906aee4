"""The kubelet's gRPC APIs, as the node daemon speaks them: each a folder with its .proto and the stubs
``make protos`` generates from it (``make lint`` fails if regenerating changes them).

- ``deviceplugin``: the device-plugin protocol (v1beta1) and the plugin's server (``server``: ListAndWatch,
  Allocate, GetPreferredAllocation), which the daemon's ``manager`` answers from.
- ``dra``: the DRA plugin API (NodePrepareResources, NodeUnprepareResources), v1 and v1beta1, served by
  ``daemon.dra.kubelet``.
- ``pluginregistration``: how a DRA plugin makes itself known in the kubelet's plugins_registry.
- ``podresources``: which devices the kubelet gave to which pod's containers (``client``).
- ``sockets``: the Unix sockets all of them listen or dial on.
"""
