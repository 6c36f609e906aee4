"""The claim allocator's decisions, pure: where each is made.

- ``asks``: what a pending ResourceClaim asks of gpushared's GPUs (``read_pending``), or why it is handed
  over to kube-scheduler (``Handover``).
- ``pods``: a pod's claim references (``pod_claims``) and what the allocator makes of a gated pod's claims
  (``read_pod``: the asks, the node an allocated claim fixes, or why it waits).
- ``gate``: the scheduling gate (``CLAIM_GATE``) and whether the webhook adds it to a new pod (``claim_gate``).
- ``choice``: the node and each request's GPUs, ranked by the extender's policy (``choose``, over
  ``place_on`` on each node).
- ``room``: the room kept free on each GPU for pods kube-scheduler may allocate first fit (``could_take``,
  ``kept_room``).
- ``preemption``: the pods to evict so that a gated pod's claims fit (``claim_victims``: groups of pods that
  share claims go together), and the pod's claims as one request (``claims_request``).

The components that gather the inputs and write the outcomes are in ``gpushared.extender.claims``.
"""
