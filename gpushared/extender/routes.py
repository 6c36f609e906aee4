"""Which path is which verb, and what each verb answers: the extender's endpoints.

The transport (``extender.http``) turns each request into a :class:`Call` and guards it (authentication,
readiness, the body's limits, forwarding to the leader: ``http.guard.Guard``); here each verb decodes its
body into typed arguments (``http.wire``), asks the scheduler, the webhook or the cache, and encodes the
typed answer. 404 and 405 are decided here too, once for both HTTP versions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpushared import __version__
from gpushared.core.placement.admission import SchedulerRoute, scheduler_route
from gpushared.core.placement.claims.gate import claim_gate
from gpushared.core.placement.claims.pods import PodClaimRef
from gpushared.core.placement.report import node_report
from gpushared.core.placement.steering import steer_gate
from gpushared.core.shared.bodies import PodBody, meta_of
from gpushared.extender.http import wire
from gpushared.extender.http.calls import TEXT, Answer, Call, Handler, json_answer
from gpushared.extender.http.config import MAX_REVIEW_BYTES
from gpushared.extender.http.guard import Guard
from gpushared.extender.metrics import ExtenderMetrics
from gpushared.extender.preempting import Preempter
from gpushared.extender.scheduler import BindError, Scheduler

log = logging.getLogger(__name__)

#: Admission reviews decoded at once, on a worker thread (``Routes.mutate``).
WEBHOOK_THREADS = 1


class Routes:
    """The extender's endpoints. :meth:`answer` is the one entry both HTTP versions call."""

    def __init__(
        self,
        scheduler: Scheduler,
        guard: Guard,
        *,
        metrics: ExtenderMetrics,
        prefix: str,
        webhook_scheduler: str,
        public_pod_names: bool = False,
        max_nodes: int = wire.MAX_NODES,
        claim_gating: Callable[[PodBody, str], dict[PodClaimRef, bool | None]] | None = None,
        steer_gating: Callable[[], bool] | None = None,
        claims_problem: Callable[[], str | None] | None = None,
        preempter: Preempter | None = None,
    ) -> None:
        """``webhook_scheduler``: where ``<prefix>/mutate`` sends new pods that ask for GPU memory
        (``core.placement.admission``); ``public_pod_names``: /inspect names pods to callers without a client
        certificate too; ``claim_gating``: with the claim allocator, which claims and templates a new pod
        names gate it (``claims.cache.ClaimCache.gating_of``), else None: no pod is gated; ``steer_gating``: with the
        steerer, whether a leader is there to steer (``<prefix>/mutate-steer`` gates CPU-only pods only then),
        else None: that route gates nothing; ``claims_problem``: with the claim allocator, what stops it now (a
        permission the API server refuses it), else None: ``/readyz/claim-allocator`` answers 503 with it, and
        ``/readyz``, which decides whether this replica gets verbs, names it and stays ready (the gpu-mem verbs
        do not depend on it)."""
        self.claim_gating = claim_gating
        self.steer_gating = steer_gating
        self.claims_problem = claims_problem
        self.preempter = preempter
        self.scheduler = scheduler
        self.guard = guard
        self.metrics = metrics
        self.webhook_scheduler = webhook_scheduler
        self.public_pod_names = public_pod_names
        self.max_nodes = max_nodes
        self._webhook_slots = asyncio.Semaphore(WEBHOOK_THREADS)
        prefix = prefix.rstrip("/")
        self._inspect = f"{prefix}/inspect/"
        verb = guard.verb
        self._table: dict[str, dict[str, Handler]] = {
            f"{prefix}/filter": {"POST": verb("filter", self.filter)},
            f"{prefix}/prioritize": {"POST": verb("prioritize", self.prioritize)},
            f"{prefix}/prioritize-no-gpu": {"POST": verb("prioritize-no-gpu", self.prioritize_no_gpu)},
            f"{prefix}/bind": {"POST": verb("bind", self.bind)},
            f"{prefix}/preempt": {"POST": verb("preempt", self.preempt)},
            f"{prefix}/mutate": {"POST": verb("mutate", self.mutate, stateless=True)},
            f"{prefix}/mutate-steer": {"POST": verb("mutate-steer", self.mutate_steer, stateless=True)},
            f"{prefix}/inspect": {"GET": self.inspect_all},
            "/healthz": {"GET": self.healthz},
            "/readyz": {"GET": self.readyz},
            "/readyz/claim-allocator": {"GET": self.readyz_claims},
            "/metrics": {"GET": self.prometheus},
            "/version": {"GET": self.version},
        }

    async def answer(self, call: Call) -> Answer:
        methods = self._table.get(call.path)
        if methods is None and call.path.startswith(self._inspect):
            methods = {"GET": self.inspect_node}
        if methods is None:
            return Answer(404, b"404: Not Found", TEXT)
        handler = methods.get(call.method)
        if handler is None:
            return Answer(405, f"405: {call.method} is not allowed here; {', '.join(methods)} is".encode(), TEXT)
        return await handler(call)

    async def close(self) -> None:
        await self.scheduler.close()
        await self.guard.close()

    async def filter(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="filter", max_nodes=self.max_nodes)
        filtered = await self.scheduler.paced(self.scheduler.filter, args)
        return json_answer(
            wire.filter_result(args, passed=filtered.passed, failed=filtered.failed, error=filtered.error)
        )

    async def prioritize(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="prioritize", max_nodes=self.max_nodes)
        return json_answer(wire.priority_list(await self.scheduler.paced(self.scheduler.prioritize, args)))

    async def prioritize_no_gpu(self, raw: bytes) -> Answer:
        args = wire.parse_args(raw, verb="prioritize-no-gpu", max_nodes=self.max_nodes)
        return json_answer(wire.priority_list(self.scheduler.prioritize_no_gpu(args)))

    async def bind(self, raw: bytes) -> Answer:
        args = wire.parse_binding(raw)
        try:
            await self.scheduler.bind(args)
        except BindError as exc:
            self.metrics.errors.labels(verb="bind").inc()
            log.warning("bind refused: %s", exc)
            return json_answer(wire.binding_result(str(exc)))
        return json_answer(wire.binding_result())

    async def preempt(self, raw: bytes) -> Answer:
        """kube-scheduler's proposed victims, revised so that they free a GPU for the pod (``preempting``)."""
        args = wire.parse_preemption(raw, max_nodes=self.max_nodes)
        if self.preempter is None:
            return json_answer(wire.preemption_result({}))
        return json_answer(wire.preemption_result(await self.preempter.preempt(args)))

    async def mutate(self, raw: bytes) -> Answer:
        """The mutating admission webhook: the API server calls it for every pod created in the namespaces
        its configuration selects. Stateless (``verb``): the answer depends on the pod alone. No client
        certificate is asked for, because the API server presents none unless configured to; a caller gets
        only a patch for the object it sent, and nothing changes here.

        Anyone who reaches the port may send it reviews: one is read only up to ``MAX_REVIEW_BYTES`` (what
        the API server can send), and decoding it (and freeing it) is done on a worker thread, one review
        at a time, so the event loop waits at most for one decode (a C call that holds the interpreter)
        and answers the other routes between them. 16 clients sending 5.9 MiB reviews of small objects
        held the loop 171 ms and /healthz about a second when every decode ran on the loop."""
        return await self._review(raw, self._mutate)

    async def mutate_steer(self, raw: bytes) -> Answer:
        """The steering webhook (``core.placement.steering``): the API server calls it for pods created in the
        namespaces an operator opted in. Read as ``mutate`` reads its reviews."""
        return await self._review(raw, self._mutate_steer)

    async def _review(self, raw: bytes, answer: Callable[[bytes], Answer]) -> Answer:
        if len(raw) > MAX_REVIEW_BYTES:
            return json_answer(
                {"Error": f"mutate: an admission review of {len(raw)} bytes; the API server sends at most 3 MiB"},
                status=413,
            )
        async with self._webhook_slots:
            return await asyncio.to_thread(answer, raw)

    def _mutate(self, raw: bytes) -> Answer:
        review = wire.parse_admission_review(raw)
        routes: list[SchedulerRoute] = []
        if review.pod is not None and review.operation == "CREATE":
            routes = [scheduler_route(review.pod, scheduler=self.webhook_scheduler, resources=self.scheduler.resources)]
            if self.claim_gating is not None:
                ours = self.claim_gating(review.pod, review.namespace or meta_of(review.pod).get("namespace") or "")
                routes.append(claim_gate(review.pod, ours=ours))
        return self._patched(review, routes)

    def _mutate_steer(self, raw: bytes) -> Answer:
        review = wire.parse_admission_review(raw)
        routes: list[SchedulerRoute] = []
        if review.pod is not None and review.operation == "CREATE":
            if self.steer_gating is None:
                routes = [SchedulerRoute((), "not gated: the extender runs without --steer-cpu-pods")]
            elif not self.steer_gating():
                routes = [SchedulerRoute((), "not gated: no leader holds the Lease to steer it")]
            else:
                routes = [steer_gate(review.pod, resources=self.scheduler.resources)]
        return self._patched(review, routes)

    def _patched(self, review: wire.AdmissionRequest, routes: list[SchedulerRoute]) -> Answer:
        patch: tuple[dict[str, Any], ...] = ()
        if review.pod is not None:
            for route in routes:
                if route.patch:
                    patch += route.patch
                    meta = meta_of(review.pod)
                    name = meta.get("name") or meta.get("generateName", "") + "*"
                    log.info("new pod %s/%s %s", review.namespace, name, route.reason)
        return json_answer(wire.admission_response(review, patch))

    def _report(self, name: str, call: Call) -> dict[str, Any] | None:
        snapshot = self.scheduler.cache.state.snapshot(name)
        if snapshot is None:
            return None
        inventory, holdings, address = snapshot
        report = node_report(name=name, address=address, inventory=inventory, holdings=holdings)
        if not self._may_see_pods(call):
            _hide_pods(report)
        return report

    def _may_see_pods(self, call: Call) -> bool:
        """Pod names (and so which tenants run where) only to authenticated callers, unless the flag says."""
        return self.public_pod_names or self.guard.authenticated(call)

    async def inspect_all(self, call: Call) -> Answer:
        nodes = [r for r in (self._report(n, call) for n in self.scheduler.cache.state.node_names()) if r is not None]
        self.metrics.nodes.set(len(nodes))
        if not self._may_see_pods(call):
            for number, report in enumerate(nodes):  # the cluster's layout is not a stranger's to list
                report["name"] = f"{HIDDEN} {number}"
        return json_answer({"nodes": nodes})

    async def inspect_node(self, call: Call) -> Answer:
        name = call.path.removeprefix(self._inspect)
        found = self._report(name, call) if name and "/" not in name else None
        if found is None:
            return json_answer(
                {"nodes": [], "error": f"node {name} is not a gpushared node known to the extender"}, status=404
            )
        return json_answer({"nodes": [found]})

    async def healthz(self, call: Call) -> Answer:
        return Answer(200, b"ok\n", TEXT)

    async def readyz(self, call: Call) -> Answer:
        ok, why = self.guard.ready()
        problem = None if self.claims_problem is None else self.claims_problem()
        text = ("ok" if ok else why) + ("" if problem is None else f"\nclaim-allocator: {problem}")
        return Answer(200 if ok else 503, (text + "\n").encode(), TEXT)

    async def readyz_claims(self, call: Call) -> Answer:
        """The claim allocator's own readiness: 503 with the reason while the API server refuses it a write."""
        if self.claims_problem is None:
            return Answer(404, b"no claim allocator runs here (--claim-allocator)\n", TEXT)
        problem = self.claims_problem()
        return Answer(200 if problem is None else 503, ("ok" if problem is None else problem).encode() + b"\n", TEXT)

    async def prometheus(self, call: Call) -> Answer:
        return Answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)

    async def version(self, call: Call) -> Answer:
        return Answer(200, (__version__ + "\n").encode(), TEXT)


def _hide_pods(report: dict[str, Any]) -> None:
    """Amounts stay (they are the node's state); who holds them goes, and so do the node's address and its
    GPUs' UUIDs (a stranger maps the cluster with them)."""
    for holder in [*(p for dev in report["devs"] for p in dev["pods"]), *report["pending"]]:
        holder["name"] = holder["namespace"] = HIDDEN
    report["address"] = HIDDEN
    for dev in report["devs"]:
        dev["uuid"] = HIDDEN


#: What an unauthenticated caller sees in place of a pod's name and namespace.
HIDDEN = "(hidden)"
