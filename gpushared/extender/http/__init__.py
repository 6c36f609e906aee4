"""The extender's transport: HTTP/1.1 (aiohttp), HTTP/2 (h2), TLS and client certificates, the limits every
caller is held to, forwarding to the leader, and the JSON of kube-scheduler's extender API.

It knows nothing of GPUs: a request becomes a :class:`calls.Call`, a guarded handler (``guard.Guard``)
turns it into an :class:`calls.Answer`, and ``wire`` decodes the bodies into typed arguments. What the
verbs decide is ``extender.scheduler``'s; which path is which verb is ``extender.routes``'.
"""
