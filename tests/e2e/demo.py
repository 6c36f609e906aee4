"""``make demo``: the local cluster, Aliyun's sample and a few pods sharing GPUs, then how to look around."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.e2e.cluster import ROOT, ClusterError, LocalCluster, wait_for


def main() -> int:
    cluster = LocalCluster()
    try:
        print("starting etcd, kube-apiserver, controller-manager, containerd, kubelet, gpushared, extender, scheduler")
        started = time.monotonic()
        cluster.up()
        print(f"cluster ready in {time.monotonic() - started:.0f} s; applying the samples")
        for manifest in ("binpack-1.yaml", "demo.yaml"):
            cluster.kubectl("apply", "-f", ROOT / "deploy" / manifest)
        wait_for(lambda: _all_running(cluster, 8), timeout=120, what="the sample pods to run", interval=1)
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
  kubectl apply -f deploy/demo.yaml   # edit the amounts, apply again, watch the placement
  gpushared status --config {cluster.state}/gpushared.yaml   # the node daemon's view
  ls {cluster.logs}   # every component's log

Tear it down (processes, containers, mounts, cgroups; logs stay): make demo-down"""
    )
    return 0


def _all_running(cluster: LocalCluster, count: int) -> bool:
    pods = json.loads(cluster.kubectl("get", "pods", "-o", "json").stdout)["items"]
    return len(pods) >= count and all(p["status"].get("phase") == "Running" for p in pods)


if __name__ == "__main__":
    sys.exit(main())
