"""Filter, prioritize and bind: the extender's three verbs over the cache, the core's policies and the API.

Filter and prioritize only read the cache. Bind is the one writer: under the node's lock it judges the node
again, writes the choice into the pod's annotations guarded by the pod's resourceVersion, creates the
Binding, and counts the pod in the cache at once; if the Binding fails, it takes the annotations back out
and releases the reservation, so the pod is free to be scheduled elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpushared import contract
from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement import Policy, bind_annotations, explain, node_scores
from gpushared.core.requests import pod_request
from gpushared.extender.cache import ClusterCache
from gpushared.extender.wire import BindingArgs, ExtenderArgs
from gpushared.kube.api import Api, KubeError
from gpushared.kube.informer import uid_of

log = logging.getLogger(__name__)

#: The annotation keys a bind writes, and a failed bind takes back.
BIND_KEYS = (
    contract.ALIYUN_GPU_MEM_IDX,
    contract.ALIYUN_GPU_MEM_DEV,
    contract.ALIYUN_GPU_MEM_POD,
    contract.ALIYUN_GPU_MEM_ASSIGNED,
    contract.ALIYUN_GPU_MEM_ASSUME_TIME,
    contract.POD_ALLOCATION,
)


class BindError(Exception):
    pass


class Scheduler:
    def __init__(
        self,
        *,
        cache: ClusterCache,
        api: Api,
        policy: Policy,
        resources: ResourceNames,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.cache = cache
        self.api = api
        self.policy = policy
        self.resources = resources
        self.clock = clock

    def filter(self, args: ExtenderArgs) -> tuple[list[str], dict[str, str], str]:
        """(nodes that pass, failed node -> reason, error for the whole pod)."""
        pod = _pod_name(args.pod)
        try:
            request = pod_request(args.pod, resources=self.resources)  # type: ignore[arg-type]
        except ContractError as exc:
            return [], {}, f"pod {pod}: {exc}"
        passed, failed = self.cache.filter(args.names, request)
        return passed, failed, ""

    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        try:
            request = pod_request(args.pod, resources=self.resources)  # type: ignore[arg-type]
        except ContractError:
            return [(name, 0) for name in args.names]
        keys = self.cache.node_keys(args.names, args.pod, request, self.policy)  # type: ignore[arg-type]
        return list(zip(args.names, node_scores(keys), strict=True))

    def prioritize_no_gpu(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """Scores for a pod that asks for no GPU memory: the nodes where it strands the least free GPU memory
        score highest. kube-scheduler calls this for every pod (a second extender entry, without managed
        resources), so pods that do ask for GPU memory get 0 everywhere: ``prioritize`` scores those."""
        try:
            asks_gpu = pod_request(args.pod, resources=self.resources).total > 0  # type: ignore[arg-type]
        except ContractError:
            asks_gpu = True  # malformed: filter says why; here it is simply not ours to score
        if asks_gpu:
            return [(name, 0) for name in args.names]
        keys = [(cost, 0.0) for cost in self.cache.idle_costs(args.names)]
        return list(zip(args.names, node_scores(keys), strict=True))

    def bind(self, args: BindingArgs) -> None:
        """Raises :class:`BindError` with a message for the pod's events."""
        where = f"pod {args.pod_namespace}/{args.pod_name}"
        with self.cache.binding(args.node) as state:
            if state is None:
                raise BindError(f"{where}: node {args.node} is not in the extender's cache")
            for _attempt in range(4):
                pod = self._read(args)
                bound_to = (pod.get("spec") or {}).get("nodeName")
                if bound_to:
                    raise BindError(f"{where} is already bound to node {bound_to}")
                try:
                    request = pod_request(pod, resources=self.resources)  # type: ignore[arg-type]
                except ContractError as exc:
                    raise BindError(f"{where}: {exc}") from None
                judged = self.cache.judge(args.node, pod, request)  # type: ignore[arg-type]
                if isinstance(judged, str):
                    raise BindError(f"{where}: {judged}")
                verdicts, setting = judged
                choice = self.policy.choose(verdicts, request, setting)
                if choice is None:
                    raise BindError(f"{where} does not fit node {args.node}: {explain(verdicts, gpus=request.gpus)}")
                unit = self.cache.unit_of(args.node)
                gpus = [verdict.gpu for verdict in choice]
                annotations = bind_annotations(request, gpus, unit=unit, now_ns=self.clock())
                try:
                    annotated = self.api.patch_pod(
                        args.pod_namespace,
                        args.pod_name,
                        {
                            "metadata": {
                                "resourceVersion": (pod.get("metadata") or {}).get("resourceVersion"),
                                "annotations": annotations,
                            }
                        },
                    )
                except KubeError as exc:
                    if exc.status == 409:
                        log.info("%s changed while binding; reading it again", where)
                        self.cache.pods.remember(self.api.get_pod(args.pod_namespace, args.pod_name))
                        continue
                    raise BindError(f"{where}: writing the GPU choice failed: {exc}") from None
                self.cache.assume(annotated, args.node)
                try:
                    self.api.bind_pod(args.pod_namespace, args.pod_name, uid=args.pod_uid, node=args.node)
                except KubeError as exc:
                    self.cache.forget(annotated, args.node)
                    self._roll_back(annotated, where)
                    raise BindError(f"{where}: binding to node {args.node} failed: {exc}") from None
                log.info(
                    "bound %s to node %s GPU %s (%d %s)",
                    where,
                    args.node,
                    ",".join(str(gpu.index) for gpu in gpus),
                    request.total,
                    unit.value,
                )
                return
            raise BindError(f"{where} kept changing while it was being bound; the scheduler will try again")

    def _read(self, args: BindingArgs) -> dict[str, Any]:
        pod = self.cache.pods.get(args.pod_namespace, args.pod_name)
        if pod is None or uid_of(pod) != args.pod_uid:
            try:
                pod = self.api.get_pod(args.pod_namespace, args.pod_name)
            except KubeError as exc:
                raise BindError(f"pod {args.pod_namespace}/{args.pod_name} cannot be read: {exc}") from None
        if uid_of(pod) != args.pod_uid:
            raise BindError(
                f"pod {args.pod_namespace}/{args.pod_name} is {uid_of(pod)}, not {args.pod_uid}: it was re-created"
            )
        return pod

    def _roll_back(self, annotated: dict[str, Any], where: str) -> None:
        """Take the GPU choice off a pod whose Binding failed, unless someone changed the pod since."""
        meta = annotated.get("metadata") or {}
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion"), "annotations": dict.fromkeys(BIND_KEYS)}}
        try:
            restored = self.api.patch_pod(meta.get("namespace", ""), meta.get("name", ""), patch)
        except KubeError as exc:
            log.warning(
                "%s: rolling back the GPU choice failed (%s); the pod is not bound, so it holds nothing", where, exc
            )
            return
        self.cache.pods.remember(restored)


def _pod_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
