"""The DRA driver, in one place: the kubelet's DRA service (``kubelet``), the node's ResourceSlice
(``slices``), the claims it prepares (``driver``) and its records on disk (``book``). Its decisions are
``core.dra``; the kubelet's wire formats, generated, are ``kubelet.dra``."""
