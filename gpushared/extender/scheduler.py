"""Filter, prioritize and bind: the extender's three verbs over the cache, the core's policies and the API.

Filter and prioritize only read the cache. Bind is the one writer: it judges the node again, counts the
pod there in the cache, and creates the pod's Binding with the GPU choice as its annotations. If the API
server refuses the Binding, the reservation is released, so the pod is free to be scheduled elsewhere; if
its answer is lost, the memory stays reserved until the pod is read back (``reservations``), which
:meth:`Scheduler.settle_binds` does in the background.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement.nodes import Rejected
from gpushared.core.placement.policies import NodeRank, Policy, best_nodes, node_scores
from gpushared.core.placement.reservations import Assumed
from gpushared.core.shared.bodies import PodBody, key_of, node_of, uid_of
from gpushared.core.shared.ledger import Ledger
from gpushared.core.shared.requests import pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.http.wire import BindingArgs, ExtenderArgs
from gpushared.extender.index import PRICES_PER_TURN
from gpushared.extender.nominations import Nominations
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.api import KubeError, NotFound

log = logging.getLogger(__name__)


class BindError(Exception):
    pass


class Filtered(NamedTuple):
    """What filter answers: the nodes that pass, why each other one failed (only when none passes), or an
    error for the whole pod (its request cannot be read)."""

    passed: list[str]
    failed: dict[str, str]
    error: str = ""


#: Times a paced verb asks again after pricing over several turns, at most: each round prices only what
#: changed while the round before yielded (a bind, a new mix). The last prices what is left in its turn.
PACED_ROUNDS = 4

Answered = TypeVar("Answered")

#: Why a node that has room does not pass: the room is held for a preemptor that outranks the pod.
HELD = "the free room on its GPUs is held for a pod that preempted others for it"

#: A Kubernetes UID as the API server writes them.
_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class Scheduler:
    def __init__(
        self,
        *,
        cache: ClusterCache,
        api: AsyncApi,
        policy: Policy,
        resources: ResourceNames,
        clock: Callable[[], int] = time.time_ns,
        rank_in_filter: bool,
        may_bind: Callable[[], bool] = lambda: True,
        ledger_of: Callable[[str], Ledger | None] | None = None,
    ) -> None:
        """``ledger_of``: a node's GPUs with what holds them, for ``prioritize_no_gpu`` (with DRA the claims on a
        DRA node, which the gpu-mem ledgers do not hold: ``steering.idle_ledger``); None: the cache's."""
        self.cache = cache
        self.ledger_of = ledger_of
        #: asked again right before a Binding is written: a leader that lost its Lease while the bind read
        #: the pod writes nothing (its successor may be counting that memory already)
        self.may_bind = may_bind
        self.api = api
        self.policy = policy
        self.resources = resources
        self.clock = clock
        #: filter keeps only the nodes the policy ranks best (``best_nodes``), for a kube-scheduler wired
        #: without prioritizeVerb: one HTTP call per pod fewer, and kube-scheduler scores a few nodes, not
        #: hundreds (docs/benchmarks.md, "The scheduler with the extender")
        self.rank_in_filter = rank_in_filter
        #: the GPUs freed by preemption, held for their preemptors (``nominations``)
        self.nominations = Nominations(cache.pending.values, cache.state.nodes, time.monotonic)

    async def close(self) -> None:
        await self.api.close()

    async def paced(self, verb: Callable[..., Answered], args: ExtenderArgs) -> Answered:
        """``verb`` (:meth:`filter` or :meth:`prioritize`) answered in one turn of the event loop from the
        nodes' memos, their ranks priced before over as many turns as they need, PRICES_PER_TURN nodes
        each. The first call of a pod size, or the first after a new mix, priced a thousand nodes in one
        turn: 0.2-0.5 s under an expected mix of 2,000 kinds, with every other verb, ``/healthz``
        included, waiting. The answer is the one ``verb`` gives in one go at the moment it
        answers: every rank it reads is of the node's ledger, CPU and mix as they are then."""
        for _ in range(PACED_ROUNDS - 1):
            cold: list[str] = []
            answer = verb(args, cold=cold)
            if not cold:
                return answer
            request = pod_request(args.pod, resources=self.resources)  # it was read: a pod is ranked
            for start in range(0, len(cold), PRICES_PER_TURN):
                await asyncio.sleep(0)
                self.cache.index.node_ranks(cold[start : start + PRICES_PER_TURN], args.pod, request, self.policy)
            await asyncio.sleep(0)
        return verb(args)

    def filter(self, args: ExtenderArgs, *, cold: list[str] | None = None) -> Filtered:
        """The nodes that pass, why each other one failed, or an error for the whole pod.

        The reasons go back only when no node passes. kube-scheduler reads an extender's failed nodes only to
        say why a pod fits nowhere (its FitError, the pod's FailedScheduling event, preemption's choice of
        nodes), and that happens only when nothing passes; otherwise it decodes them, in the serial part of
        its cycle, and drops them. With ranking in filter nearly every candidate is left out with a reason:
        400-500 of them a pod, 0.2-0.25 ms of Go's JSON decoding alone, and kube-scheduler spent 0.6 ms of
        CPU a pod less without them (docs/benchmarks.md, "The scheduler with the extender").

        ``cold``: see :meth:`FilterIndex.node_ranks`; the answer is not final when the call fills it."""
        self.cache.owner.check("filter")
        try:
            request = pod_request(args.pod, resources=self.resources)
        except ContractError as exc:
            return Filtered([], {}, f"pod {_pod_name(args.pod)}: {exc}")
        index = self.cache.index
        passed, failed = index.filter(args.names, request)
        if self.nominations.offers and passed:
            held = {name for name in passed if not self.nominations.fits(name, args.pod, request)}
            failed.update((name, HELD) for name in held)
            passed = [name for name in passed if name not in held]
        if not passed:
            return Filtered([], failed)
        if self.rank_in_filter and len(passed) > 1:
            best = best_nodes(index.node_ranks(passed, args.pod, request, self.policy, cold=cold))
            if best:  # none: every node filled since the filter above; prioritize would score them all 0
                passed = [passed[i] for i in best]
        return Filtered(passed, {})

    def prioritize(self, args: ExtenderArgs, *, cold: list[str] | None = None) -> list[tuple[str, int]]:
        self.cache.owner.check("prioritize")
        try:
            request = pod_request(args.pod, resources=self.resources)
        except ContractError:
            return [(name, 0) for name in args.names]
        keys = self.cache.index.node_ranks(args.names, args.pod, request, self.policy, cold=cold)
        return list(zip(args.names, node_scores(keys), strict=True))

    def prioritize_no_gpu(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """Scores for a pod that asks for no GPU memory: the nodes where it strands the least free GPU memory
        score highest. kube-scheduler calls this for every pod (a second extender entry, without managed
        resources), so pods that do ask for GPU memory get 0 everywhere: ``prioritize`` scores those."""
        self.cache.owner.check("prioritize-no-gpu")
        try:
            asks_gpu = pod_request(args.pod, resources=self.resources).total > 0
        except ContractError:
            asks_gpu = True  # malformed: filter says why; here it is simply not ours to score
        if asks_gpu:
            return [(name, 0) for name in args.names]
        keys = [NodeRank(cost) for cost in self.cache.index.idle_prices(args.names, ledger_of=self.ledger_of)]
        return list(zip(args.names, node_scores(keys), strict=True))

    async def bind(self, args: BindingArgs) -> None:
        """Raises :class:`BindError` with a message for the pod's events, with no UID in it but the one the
        caller gave (the API server's own messages name the UIDs they compared).

        One API write: the Binding carries the GPU choice as annotations, which kube-apiserver copies onto
        the pod in the same update that sets its node. So no one ever sees the pod bound without its GPUs or
        annotated but unbound, and a Binding that fails leaves nothing on the pod to take back. The choice is
        counted in the cache before the write, on the loop that owns the cache, so two binds to one node see each
        other; a write the API server refused releases it at once, one whose answer was lost keeps it.
        """
        try:
            await self._bind(args)
        except BindError as exc:
            raise BindError(_UID.sub(lambda m: m[0] if m[0] == args.pod_uid else "<uid>", str(exc))) from None

    async def _bind(self, args: BindingArgs) -> None:
        where = f"pod {args.pod_namespace}/{args.pod_name}"
        pod = await self._read(args)
        bound_to = node_of(pod)
        if bound_to:
            raise BindError(f"{where} is already bound to node {bound_to}")
        try:
            request = pod_request(pod, resources=self.resources)
        except ContractError as exc:
            raise BindError(f"{where}: {exc}") from None
        fence = self.cache.reservations.fenced(args.pod_uid)
        if fence is not None:
            raise BindError(f"{where}: {fence}")
        if not self.may_bind():
            raise BindError(f"{where}: this extender stopped leading before it could bind; kube-scheduler retries")
        reserved = self.cache.reserve(
            args.node,
            pod,
            request,
            policy=self.policy,
            now_ns=self.clock(),
            held=lambda verdicts: self.nominations.verdicts(args.node, pod, verdicts, request),
        )
        if isinstance(reserved, Rejected):
            raise BindError(f"{where}: {reserved.reason}")
        gpus, annotations, unit = reserved
        try:
            await self.api.bind_pod(
                args.pod_namespace, args.pod_name, uid=args.pod_uid, node=args.node, annotations=annotations
            )
        except KubeError as exc:
            if not _refused(exc):
                self.cache.unanswered(pod, args.node)
                raise BindError(
                    f"{where}: the Binding to node {args.node} got no answer ({exc}); it may still land, so its "
                    "GPU memory stays reserved there until the pod is read back"
                ) from None
            self.cache.forget(pod, args.node)
            raise BindError(f"{where}: binding to node {args.node} failed: {exc}") from None
        except BaseException:  # cancelled with the request: the Binding may have been sent
            self.cache.unanswered(pod, args.node)
            raise
        log.info(
            "bound %s to node %s GPU %s (%d %s)",
            where,
            args.node,
            ",".join(str(gpu.index) for gpu in gpus),
            request.total,
            unit.value,
        )

    async def settle_binds(self, *, limit: int = 64) -> int:
        """Read back the pods of binds the watch has not confirmed and of unanswered Bindings, and count
        each where the API server shows it; a read that fails settles nothing. Returns how many were read."""
        due = self.cache.due(limit=limit)

        async def read_back(assumed: Assumed) -> None:
            try:
                read: PodBody | None = await self.api.get_pod(assumed.namespace, assumed.name)
            except NotFound:
                read = None
            except KubeError as exc:
                log.info("%s: cannot read the pod back yet (%s)", assumed.describe(), exc)
                return
            self.cache.settle(assumed, read)

        await asyncio.gather(*(read_back(assumed) for assumed in due))
        return len(due)

    async def _read(self, args: BindingArgs) -> PodBody:
        pod = self.cache.pending.get((args.pod_namespace, args.pod_name))
        if pod is None or uid_of(pod) != args.pod_uid:
            try:
                pod = await self.api.get_pod(args.pod_namespace, args.pod_name)
            except KubeError as exc:
                raise BindError(f"pod {args.pod_namespace}/{args.pod_name} cannot be read: {exc}") from None
        if uid_of(pod) != args.pod_uid:
            # Never the UID it has: a UID is what a Binding needs, and the caller may not know it.
            raise BindError(
                f"pod {args.pod_namespace}/{args.pod_name} does not have UID {args.pod_uid}: it was re-created"
            )
        return pod


def _refused(exc: KubeError) -> bool:
    """Whether the API server answered that it did not create the Binding. No answer (timeout, cut
    connection) and a 5xx (kube-apiserver's 504 says the request may still complete) are not refusals."""
    return exc.status is not None and exc.status < 500


def _pod_name(pod: PodBody) -> str:
    namespace, name = key_of(pod)
    return f"{namespace}/{name}"
