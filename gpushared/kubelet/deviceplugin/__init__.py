"""The kubelet device-plugin protocol (v1beta1): the .proto, its generated stubs, and the plugin's server."""
