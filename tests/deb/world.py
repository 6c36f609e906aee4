"""What a packaged gpushared needs around it inside a systemd-nspawn container, served from the host.

The container shares the host's network, so a fake API server on the host's loopback (with the Node) is
its API server; the fake kubelet's sockets are created in the container's /var/lib/kubelet (a unix socket
works across the mount namespace); the fake libnvidia-ml.so.1 and its GPUs go to /opt/fake-nvml, the real
nvidia-cuda-mps-control to /opt/mps. Writes the node's kubeconfig to /root/gpushared.kubeconfig (the test
moves it into place when the node is meant to have one), prints the API server's URL, then one line per
second: whether the Node has the inventory, and how many registrations the kubelet has seen.

    python -m tests.deb.world CHROOT NODE
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import yaml

from gpushared import contract
from tests.e2e.cluster import CACHE
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.kubelet import FakeKubelet
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
    while True:
        time.sleep(1)
        annotations = (api.get("nodes", node) or {}).get("metadata", {}).get("annotations") or {}
        published = contract.NODE_INVENTORY in annotations
        print(f"inventory={published} registrations={len(kubelet.registrations)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
