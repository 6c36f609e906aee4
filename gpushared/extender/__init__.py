"""The scheduler extender, in short:

- the verbs kube-scheduler calls (``routes.py`` maps paths to them, ``scheduler.py`` answers): filter,
  prioritize, prioritize-no-gpu and bind; there is no preempt verb;
- the admission webhook's routes: ``mutate`` sends new GPU pods to gpushared's scheduler (and gates pods
  whose claims are the claim allocator's), ``mutate-steer`` gates CPU-only pods for the steerer;
- the cluster cache (``cache.py``: ``state.py``, ``index.py``, ``reserving.py``) and its one owner, the
  event loop: the informers only hand it their changes (``inbox.py``);
- the claim allocator (``claims/``), which places DRA claims with gpushared's policies, and the steerer
  (``steering.py``), which gives CPU-only pods a node where kube-scheduler calls no extender: both are the
  leader's workers on gated pods, and share what such a worker is (``gatedwork.py``);
- beside them: ``/inspect``, health and metrics; the transport (``http/``); the wiring (``app.py``).
"""
