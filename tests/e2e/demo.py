"""``make demo``: the local cluster, Aliyun's sample and a few pods sharing GPUs, then how to look around.

The samples (deploy/examples/binpack-1.yaml, deploy/examples/demo.yaml) fit the local cluster whatever order
their pods arrive in (tests/unit/test_demo_samples.py); while they start, the demo says which pods it still
waits for and why, from their status and kube-scheduler's last word on them. The e2e suite runs the same
:func:`run_samples` ten times in a row, in shuffled orders.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

from tests.e2e.cluster import ROOT, ClusterError, LocalCluster

MANIFESTS = ("binpack-1.yaml", "demo.yaml")
#: How many pods the manifests make (Deployment replicas included).
SAMPLE_PODS = 9
REPORT_EVERY = 10.0


def main() -> int:
    cluster = LocalCluster()
    try:
        print("starting etcd, kube-apiserver, controller-manager, containerd, kubelet, gpushared, extender, scheduler")
        started = time.monotonic()
        cluster.up()
        print(f"cluster ready in {time.monotonic() - started:.0f} s; applying the samples")
        run_samples(cluster)
    except ClusterError as error:
        print(f"error: {error}\nlogs: {cluster.logs}", file=sys.stderr)
        return 1
    print(cluster.kubectl("get", "pods", "-o", "wide").stdout)
    plugin = [sys.executable, "-m", "gpushared.cli.inspect", "--kubeconfig", str(cluster.kubeconfig), "-d"]
    print(subprocess.run(plugin, capture_output=True, text=True, check=False).stdout)
    env = cluster.env()
    print(
        f"""The cluster keeps running. To look around:

  export KUBECONFIG={env["KUBECONFIG"]} PATH={cluster.bin}:{ROOT / ".venv" / "bin"}:$PATH
  kubectl get pods -o wide
  kubectl inspect gpushare -d         # who uses which GPU
  kubectl logs deploy/binpack-1       # the env Allocate gave the container
  kubectl logs mps-inference          # an MPS pod: CUDA_MPS_* limits from its gpu-mem
  kubectl apply -f deploy/examples/demo.yaml   # edit the amounts, apply again, watch the placement
  gpushared status --config {cluster.state}/gpushared.yaml   # the node daemon's view
  ls {cluster.logs}   # every component's log

Tear it down (processes, containers, mounts, cgroups; logs stay): make demo-down"""
    )
    return 0


def sample_documents() -> list[dict[str, Any]]:
    return [d for name in MANIFESTS for d in yaml.safe_load_all((ROOT / "deploy" / "examples" / name).read_text()) if d]


def run_samples(
    cluster: LocalCluster,
    *,
    namespace: str = "default",
    timeout: float = 180,
    shuffle: random.Random | None = None,
    report: Callable[[str], None] = print,
) -> float:
    """Apply the samples (their objects in ``shuffle``'s order, if given) and wait until all their pods run,
    saying every few seconds what is still missing; the seconds it took. Raises ClusterError naming every
    pod that is not running, and why, if they do not all run within ``timeout``."""
    documents = sample_documents()
    if shuffle is not None:
        shuffle.shuffle(documents)
    started = time.monotonic()
    for document in documents:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(document))
    last_report = started
    while True:
        waiting = not_running(cluster, namespace)
        if not waiting:
            return time.monotonic() - started
        now = time.monotonic()
        if now - started > timeout:
            raise ClusterError(
                f"after {timeout:.0f} s, {len(waiting)} sample pods are not running: " + "; ".join(waiting)
            )
        if now - last_report >= REPORT_EVERY:
            report(f"{now - started:.0f} s: waiting for {len(waiting)} pods: " + "; ".join(waiting))
            last_report = now
        time.sleep(1)


def not_running(cluster: LocalCluster, namespace: str) -> list[str]:
    """Each sample pod that does not run yet, with why: its phase, its containers' waiting reasons, and
    kube-scheduler's last FailedScheduling message; pods the controllers have not made yet count too."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    waiting = []
    for pod in live:
        if pod["status"].get("phase") == "Running":
            continue
        name = pod["metadata"]["name"]
        reasons = [
            s["state"]["waiting"].get("reason", "")
            for s in pod["status"].get("containerStatuses") or []
            if "waiting" in s.get("state", {})
        ]
        why = pod["status"].get("phase", "Unknown") + (f" ({', '.join(sorted(set(reasons)))})" if reasons else "")
        if not pod["spec"].get("nodeName"):
            message = _last_scheduling_failure(cluster, namespace, name)
            why = f"unscheduled: {message}" if message else "not scheduled yet"
        waiting.append(f"{name} {why}")
    if len(live) < SAMPLE_PODS:
        waiting.append(f"{SAMPLE_PODS - len(live)} pods not created yet")
    return waiting


def _last_scheduling_failure(cluster: LocalCluster, namespace: str, pod: str) -> str:
    selector = f"involvedObject.name={pod},reason=FailedScheduling"
    events = json.loads(
        cluster.kubectl("get", "events", "-n", namespace, "--field-selector", selector, "-o", "json").stdout
    )["items"]
    events.sort(key=lambda e: e.get("lastTimestamp") or e["metadata"].get("creationTimestamp") or "")
    return str(events[-1].get("message", "")).strip() if events else ""


def delete_samples(cluster: LocalCluster, *, namespace: str = "default") -> None:
    """Delete the samples, a Deployment's pods with it rather than left to the garbage collector (which took
    30-50 s on the local cluster to reach them). Returns at once: the kubelet takes its time over the pods."""
    for document in sample_documents():
        kind, name = document["kind"].lower(), document["metadata"]["name"]
        delete = ["delete", "-n", namespace, "--ignore-not-found", "--wait=false"]
        cluster.kubectl(*delete, kind, name)
        if kind == "deployment":
            labels = ",".join(f"{k}={v}" for k, v in document["spec"]["selector"]["matchLabels"].items())
            cluster.kubectl(*delete, "replicasets", "-l", labels)
            cluster.kubectl(*delete, "pods", "-l", labels, "--grace-period=2")


if __name__ == "__main__":
    sys.exit(main())
