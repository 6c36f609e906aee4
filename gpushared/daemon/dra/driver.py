"""gpushared as a DRA driver: the node's slice out, the kubelet's claims in (docs/dra.md).

Two parts, both fed by the manager's GPU inventory:

- :class:`SlicePublisher` keeps the node's ResourceSlice equal to its healthy GPUs (``core.dra.slices``),
  changing the pool's generation only when the devices change;
- :class:`DraDriver` answers the kubelet's NodePrepareResources / NodeUnprepareResources: it reads each
  claim's allocation and the pods it is reserved for from the API server, lets ``core.dra.prepare.decide_all``
  check the call's claims together against those already prepared here (a container given several claims is
  told all their GPUs by each), records each claim (CDI spec, then checkpoint: ``daemon.dra.book``) and
  answers with the CDI devices. Both calls are idempotent: a claim already prepared gets the same answer
  without another read, and unpreparing a claim that is not prepared succeeds.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

from gpushared.contract import GpuInventory
from gpushared.core.dra.allocated import ClaimRef, reserved_pods
from gpushared.core.dra.prepare import ClaimRead, DraNode, PreparedClaim, PrepareRefusal, decide_all
from gpushared.core.node.allocate import NodeFacts
from gpushared.core.shared.bodies import PodBody, uid_of
from gpushared.daemon.devfiles import CharLinks
from gpushared.daemon.dra.book import BookFull, ClaimBook, ClaimMismatch, DriverLock
from gpushared.daemon.dra.kubelet import DraPluginServer
from gpushared.daemon.dra.slices import SlicePublisher
from gpushared.daemon.metrics import PodShare
from gpushared.kube.errors import KubeError, NotFound
from gpushared.kube.resources import ResourceApi

log = logging.getLogger(__name__)

#: How long one NodePrepareResources call may spend reading its claims, retries included: the kubelet gives
#: the whole call 45 s, and what is left after the reads decides, writes and answers.
PREPARE_BUDGET_SECONDS = 30.0
#: How long one try of one claim's read may take.
CLAIM_READ_SECONDS = 10.0
#: The pause before a read is tried again after a broken connection, a 429 or a 5xx.
RETRY_PAUSE_SECONDS = 0.5
#: Claims of one call read at once: a pod names a few; one slow read does not hold back the others.
READERS = 8

#: A claim as read, and the pods it is reserved for (None: not read; one container, given no other claim).
Read = tuple[Mapping[str, Any], "list[PodBody] | None"]


def _other_claim(ref: ClaimRef, done: PreparedClaim) -> str:
    return f"claim UID {ref.uid} is prepared here as {done.ref.key}, not as {ref.key}"


class DraDriver:
    """The kubelet plugin's decisions, for ``daemon.dra.kubelet``.

    No lock is held across API I/O: a call reads its claims first, in parallel and within one deadline,
    then decides each under a short lock (the claims prepared and those being written count, so two calls
    cannot both take the same room), and writes its files outside the lock. A claim the checkpoint
    answers, and every unprepare, never waits on the API server or on another call's reads.
    """

    def __init__(
        self,
        *,
        node: str,
        api: ResourceApi,
        book: ClaimBook,
        facts: Callable[[], NodeFacts],
        read_pod: Callable[[str, str, float], PodBody] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.node = node
        #: reads a pod the claim is reserved for, once per try (namespace, name, timeout): its containers
        #: share the claim's memory (``core.dra.claimusers``); None: every claim is one container's
        self.read_pod = read_pod
        self.sleep = sleep
        #: reads claims once per try (no retries of its own: ``_read`` retries within the call's deadline)
        self.api = api
        self.book = book
        self.facts = facts
        self.char_links = CharLinks()
        self._lock = threading.Lock()
        #: claims decided and being written, by UID: counted by every other decision until in the book
        self._deciding: dict[str, PreparedClaim] = {}
        #: the node's one-driver lock (``daemon.dra.book.DriverLock``), held while this driver serves
        self.lock: DriverLock | None = None

    def prepare(
        self, claims: Sequence[ClaimRef], *, deadline: float | None = None
    ) -> Mapping[str, PreparedClaim | str]:
        """Each claim prepared, or why not. ``deadline`` (monotonic): the kubelet's for the call; the API
        reads end ``PREPARE_BUDGET_SECONDS`` after the call came at the latest, and a claim not read by then
        gets its own error while the others are answered."""
        start = time.monotonic()
        deadline = min(deadline if deadline is not None else math.inf, start + PREPARE_BUDGET_SECONDS)
        answers: dict[str, PreparedClaim | str] = {}
        wanted: list[ClaimRef] = []
        for ref in claims:
            done = self.book.get(ref.uid)
            if done is None:
                wanted.append(ref)
            else:
                answers[ref.uid] = done if done.ref == ref else _other_claim(ref, done)
        bodies = self._read_all(wanted, deadline)
        if not wanted:
            return answers
        reads: list[ClaimRead] = []
        for ref in wanted:
            read = bodies[ref.uid]
            if isinstance(read, str):
                answers[ref.uid] = read
            else:
                reads.append(ClaimRead(ref, read[0], read[1]))
        unread = [ref for ref in wanted if ref.uid in answers]
        answers.update(self._prepare(reads, unread, self.facts()))
        return answers

    def _read_all(self, refs: Sequence[ClaimRef], deadline: float) -> dict[str, Read | str]:
        """Each claim as the API server has it, or why it could not be read by ``deadline``."""
        if not refs:
            return {}
        pool = futures.ThreadPoolExecutor(max_workers=min(len(refs), READERS), thread_name_prefix="dra-read")
        try:
            reads = {pool.submit(self._read, ref, deadline): ref for ref in refs}
            done, _ = futures.wait(reads, timeout=max(0.0, deadline - time.monotonic()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        answers: dict[str, Read | str] = {}
        for read, ref in reads.items():
            answers[ref.uid] = (
                read.result()
                if read in done
                else f"claim {ref.key}: not read from the API server in time (it is slow or unreachable); "
                "the kubelet asks again"
            )
        return answers

    def _read(self, ref: ClaimRef, deadline: float) -> Read | str:
        """One claim, and the pods it is reserved for (whose containers share it, and say which claims each
        uses with it); why not, in words."""
        claim = self._tried(
            f"claim {ref.key}", lambda t: self.api.get_claim(ref.namespace, ref.name, timeout=t), deadline
        )
        if isinstance(claim, str) or claim is None:
            return claim or f"claim {ref.key} does not exist"
        if self.read_pod is None:
            return claim, None
        pods: list[PodBody] = []
        read_pod = self.read_pod
        for pod_ref in reserved_pods(claim):
            pod = self._tried(
                f"claim {ref.key}: pod {pod_ref.name}",
                functools.partial(read_pod, ref.namespace, pod_ref.name),
                deadline,
            )
            if isinstance(pod, str):
                return pod
            if pod is not None and uid_of(pod) == pod_ref.uid:  # gone or re-created: not using it any more
                pods.append(pod)
        return claim, pods

    def _tried(self, what: str, read: Callable[[float], Any], deadline: float) -> Any:
        """``read`` once per try, again after a broken connection, a 429 or a 5xx while the deadline allows;
        None for a 404, why not for the rest."""
        while True:
            left = deadline - time.monotonic()
            try:
                return read(max(0.1, min(CLAIM_READ_SECONDS, left)))
            except NotFound:
                return None
            except KubeError as exc:
                transient = exc.status is None or exc.status == 429 or exc.status >= 500
                if not transient or deadline - time.monotonic() < RETRY_PAUSE_SECONDS + 0.1:
                    return f"{what}: {exc}"
            self.sleep(RETRY_PAUSE_SECONDS)

    def _prepare(
        self, reads: Sequence[ClaimRead], unread: Sequence[ClaimRef], facts: NodeFacts
    ) -> dict[str, PreparedClaim | str]:
        """The call's claims decided together, against the claims in the book and those being written (no
        I/O under the lock), then each written; ``unread``: claims of the call not read, which no claim used
        beside them is prepared without."""
        answers: dict[str, PreparedClaim | str] = {}
        with self._lock:
            wanted: list[ClaimRead] = []
            for read in reads:
                ref = read.ref
                done = self.book.get(ref.uid)
                if ref.uid in self._deciding:
                    answers[ref.uid] = f"claim {ref.key} is being prepared by another call; the kubelet asks again"
                elif done is not None:  # another call prepared it while this one read it
                    answers[ref.uid] = done if done.ref == ref else _other_claim(ref, done)
                else:
                    wanted.append(read)
            node = DraNode(
                name=self.node,
                inventory=facts.inventory,
                prepared=[*self.book.claims(), *self._deciding.values()],
                exposure=facts.exposure,
                minors=facts.minors,
                present_devices=facts.present_devices,
                mps=facts.mps,
            )
            outcomes = decide_all(wanted, node, unread=unread)
            for uid, outcome in outcomes.items():
                if isinstance(outcome, PrepareRefusal):
                    # The kubelet puts the message in the pod's FailedPrepareDynamicResources event.
                    log.warning("NodePrepareResources refused: %s", outcome.message)
                    answers[uid] = outcome.message
                else:
                    self._deciding[uid] = outcome
        for uid, outcome in outcomes.items():
            if isinstance(outcome, PreparedClaim):
                answers[uid] = self._record(outcome, facts)
        return answers

    def _record(self, outcome: PreparedClaim, facts: NodeFacts) -> PreparedClaim | str:
        ref = outcome.ref
        try:
            self.book.record(outcome)
        except (OSError, BookFull) as exc:
            return f"claim {ref.key}: cannot write its CDI spec or checkpoint record: {exc}"
        finally:
            with self._lock:
                self._deciding.pop(ref.uid, None)
        self.char_links.ensure([f for cdi in outcome.cdi for f in cdi.device_nodes])
        placed = ", ".join(
            f"{d.request}: GPU {d.index} ({d.memory} {facts.inventory.unit.value})" for d in outcome.devices
        )
        log.info("prepared claim %s: %s", ref.key, placed or "no devices of this driver")
        return outcome

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Each claim's record, then its spec, removed; never waits on the API server or a prepare's reads.
        The kubelet's namespace, name and UID must all be the claim's as prepared."""
        errors: dict[str, str] = {}
        for ref in claims:
            with self._lock:
                busy = ref.uid in self._deciding
            if busy:
                errors[ref.uid] = f"claim {ref.key} is being prepared; the kubelet asks again"
                continue
            try:
                if self.book.forget(ref):
                    log.info("unprepared claim %s", ref.key)
                errors[ref.uid] = ""
            except ClaimMismatch as exc:
                log.warning("NodeUnprepareResources refused: %s", exc)
                errors[ref.uid] = str(exc)
            except OSError as exc:
                errors[ref.uid] = f"claim {ref.key}: cannot update the checkpoint: {exc}"
        return errors

    def claimed(self) -> dict[int, tuple[int, int]]:
        """GPU index -> (memory in the node's unit, compute percent) the prepared claims hold there."""
        held: dict[int, tuple[int, int]] = {}
        for claim in self.book.claims():
            for device in claim.devices:
                memory, compute = held.get(device.index, (0, 0))
                held[device.index] = (memory + device.memory, compute + device.compute)
        return held

    def shares(self, inventory: GpuInventory) -> list[PodShare]:
        """Each prepared claim's memory on each of its GPUs, for ``gpushared_claim_gpu_memory_bytes``."""
        return [
            PodShare(c.ref.namespace, c.ref.name, d.index, d.uuid, inventory.unit.to_bytes(d.memory))
            for c in sorted(self.book.claims(), key=lambda c: c.ref)
            for d in c.devices
        ]

    def status(self) -> list[dict[str, Any]]:
        """The prepared claims, for `gpushared status` and the inspect tool."""
        return [
            {
                "namespace": c.ref.namespace,
                "name": c.ref.name,
                "uid": c.ref.uid,
                "devices": [
                    {
                        "request": d.request,
                        "gpu": d.index,
                        "uuid": d.uuid,
                        "memory": d.memory,
                        "compute": d.compute,
                        "mps": d.mps,
                    }
                    for d in c.devices
                ],
            }
            for c in sorted(self.book.claims(), key=lambda c: c.ref)
        ]


class DraLink:
    """The DRA mode's link to the kubelet and the scheduler, kept up by the service loop: the plugin's
    sockets served, and the node's slice equal to its GPUs."""

    def __init__(self, plugin: DraPluginServer, slices: SlicePublisher, inventory: Callable[[], GpuInventory]) -> None:
        self.plugin = plugin
        self.slices = slices
        self.inventory = inventory
        self._registrations = 0

    def keep(self) -> None:
        self.plugin.keep()
        registrations = self.plugin.registrations
        if registrations != self._registrations:  # the kubelet (re)started or found the plugin again
            self._registrations = registrations
            self.slices.verify_soon()
        self.slices.publish(self.inventory())

    @property
    def registered(self) -> bool:
        return self.plugin.registered

    @property
    def watched(self) -> bool:
        """Claims can be allocated here and prepared: the slice is out and the kubelet has the plugin."""
        return self.plugin.registered and self.slices.published

    def stop(self) -> None:
        self.plugin.stop()
