"""The kubelet's PodResources API: which devices the kubelet gave to which pod's containers."""
