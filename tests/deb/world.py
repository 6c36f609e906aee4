"""What a packaged gpushared needs around it inside a systemd-nspawn container, served from the host.

The container shares the host's network, so a fake API server on the host's loopback (with the Node) is
its API server; the fake kubelet's sockets are created in the container's /var/lib/kubelet (a unix socket
works across the mount namespace); the fake libnvidia-ml.so.1 and its GPUs go to /opt/fake-nvml, the real
nvidia-cuda-mps-control to /opt/mps. Writes the node's kubeconfig to /root/gpushared.kubeconfig (the test
moves it into place when the node is meant to have one), prints the API server's URL, then one line per
second: whether the Node has the inventory, how many registrations the kubelet has seen, and, once the
GPUs are published, what Allocate through the installed package gave a pod placed on GPU 1
(``allocated=<UUID>`` next to ``expected=<UUID>``, or why it failed). That answer's env and device specs
are also written to /root/allocate-response.json, for the daemon-reload check to build a container from.

    python -m tests.deb.world CHROOT NODE
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import yaml

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import GPU_MEM, pod
from tests.e2e.cluster import CACHE
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kubelet import AdmissionError, ContainerSpec, FakeKubelet, PodRef
from tests.fakes.nvml import FakeNvml, build_library
from tests.harness import node_body
from tests.mps_binary import fetch_mps_control


def main(root: Path, node: str) -> None:
    api = FakeApiServer().start()
    api.create(node_body(node))
    kubelet = FakeKubelet(root / "var" / "lib" / "kubelet").start()
    library = build_library(root / "opt" / "fake-nvml")
    FakeNvml.with_sizes(root / "opt" / "fake-nvml" / "gpus.json", library, 16384, 8192)
    mps = root / "opt" / "mps"
    mps.mkdir(parents=True, exist_ok=True)
    shutil.copy2(fetch_mps_control(CACHE / "mps"), mps / "nvidia-cuda-mps-control")
    kubeconfig = root / "root" / "gpushared.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    kubeconfig.chmod(0o600)
    print(api.url, flush=True)
    allocated = ""
    while True:
        time.sleep(1)
        annotations = (api.get("nodes", node) or {}).get("metadata", {}).get("annotations") or {}
        published = contract.NODE_INVENTORY in annotations
        if published and not allocated.startswith("allocated="):
            allocated = allocate_on_gpu1(api, kubelet, node, annotations[contract.NODE_INVENTORY], root)
        print(f"inventory={published} registrations={len(kubelet.registrations)} {allocated}", flush=True)


def allocate_on_gpu1(api: FakeApiServer, kubelet: FakeKubelet, node: str, inventory_text: str, root: Path) -> str:
    """A 3-unit pod bound to GPU 1 as the extender binds it, admitted by the kubelet: the env it got."""
    inventory = contract.parse_inventory(inventory_text)
    if len(inventory.gpus) < 2:
        return "allocate=waiting for 2 GPUs"
    body = api.get("pods", "deb-test") or api.create(_placed(node, inventory))
    containers = [ContainerSpec("c0", 3)]
    try:
        [allocation] = kubelet.admit(PodRef(body["metadata"]["uid"], "deb-test"), GPU_MEM, containers)
    except AdmissionError as exc:
        kubelet.remove_pod(body["metadata"]["uid"])
        return f"allocate=failed: {str(exc).replace(' ', '_')}"
    response = allocation.response
    given = response.envs.get(contract.ENV_NVIDIA_VISIBLE_DEVICES, "")
    answer = {
        "envs": dict(response.envs),
        "devices": [
            {"containerPath": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
            for d in response.devices
        ],
    }
    (root / "root" / "allocate-response.json").write_text(json.dumps(answer, indent=1))
    return f"allocated={given} expected={inventory.gpus[1].uuid}"


def _placed(node: str, inventory: contract.GpuInventory) -> dict[str, object]:
    body = pod("deb-test", 3, node=node)
    body["metadata"]["annotations"].update(
        bind_annotations(pod_request(body), [inventory.gpus[1]], unit=inventory.unit, now_ns=time.time_ns())
    )
    return body


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
