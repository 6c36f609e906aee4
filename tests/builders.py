"""Small builders for the Kubernetes bodies tests feed the core and the fakes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gpushared import contract
from gpushared.contract import GpuInfo, GpuInventory, MemoryUnit

GPU_MEM = contract.DEFAULT_RESOURCES.gpu_mem
GPU_COUNT = contract.DEFAULT_RESOURCES.gpu_count
#: The pod annotations that record a GPU choice: a Binding writes them (Alibaba's closed scheduler the last).
CHOICE_KEYS = (
    contract.POD_ALLOCATION,
    contract.ALIYUN_GPU_MEM_IDX,
    contract.ALIYUN_GPU_MEM_POD,
    contract.ALIYUN_GPU_MEM_DEV,
    contract.ALIYUN_GPU_MEM_ASSIGNED,
    contract.ALIYUN_GPU_MEM_ASSUME_TIME,
    contract.ALIYUN_FRAMEWORK_ALLOCATION,
)
#: The pod annotations its owner may set: the MPS opt-in, its thread share, memory enforcement.
OPT_IN_KEYS = (contract.POD_MPS, contract.POD_MPS_THREAD_PERCENTAGE, contract.POD_MEMORY_ENFORCEMENT)


def inventory(*sizes: int, unit: MemoryUnit = MemoryUnit.GIB, mps: bool = False) -> GpuInventory:
    return GpuInventory(
        unit=unit,
        gpus=tuple(
            GpuInfo(
                index=i,
                uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                model="Fake GPU",
                memory=size,
                memory_mib=unit.to_mib(size),
                mps_capable=mps,
            )
            for i, size in enumerate(sizes)
        ),
    )


def container(name: str, amount: int | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "image": "busybox", **extra}
    if amount is not None:
        body["resources"] = {"limits": {GPU_MEM: str(amount)}}
    return body


def pod(
    name: str,
    *amounts: int,
    namespace: str = "default",
    node: str | None = None,
    annotations: dict[str, str] | None = None,
    init: list[dict[str, Any]] | None = None,
    phase: str = "Pending",
    uid: str | None = None,
    cpu: str | None = None,
) -> dict[str, Any]:
    """A pod whose containers c0, c1, ... ask for ``amounts`` units of gpu-mem (and c0 for ``cpu``)."""
    spec: dict[str, Any] = {"containers": [container(f"c{i}", amount) for i, amount in enumerate(amounts)]}
    if cpu is not None:
        spec["containers"] = spec["containers"] or [container("c0")]
        spec["containers"][0].setdefault("resources", {})["requests"] = {"cpu": cpu}
    if init:
        spec["initContainers"] = init
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def on_gpus(body: dict[str, Any], count: int) -> dict[str, Any]:
    """``body`` with its first container asking for ``count`` GPUs (gpu-count) to spread its gpu-mem over."""
    body["spec"]["containers"][0].setdefault("resources", {}).setdefault("limits", {})[GPU_COUNT] = str(count)
    return body


def scheduler_config(path: Path, *, no_gpu_scoring: bool = False) -> dict[str, Any]:
    """A shipped kube-scheduler configuration, with its commented prioritize-no-gpu entry uncommented as its
    comment tells an operator to (the '#' after the first two spaces of each line) when ``no_gpu_scoring``."""
    text = path.read_text()
    if no_gpu_scoring:
        text = re.sub(r"^  #(-|  )", r"  \1", text, flags=re.MULTILINE)
    return yaml.safe_load(text)  # type: ignore[no-any-return]


def admission_review(
    body: dict[str, Any], *, version: str = "admission.k8s.io/v1", operation: str = "CREATE", uid: str = "review-1"
) -> dict[str, Any]:
    """What the API server sends a mutating webhook when ``body`` (a pod) is created."""
    return {
        "apiVersion": version,
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": body.get("kind", "Pod")},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": body.get("metadata", {}).get("namespace", "default"),
            "operation": operation,
            "userInfo": {"username": "someone"},
            "object": body,
            "dryRun": False,
        },
    }
