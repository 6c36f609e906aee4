"""CDI for real: a GPU named in a CDI spec reaches the container through containerd (issue #44).

Kubelet 1.20 predates the CRI's CDI field (1.28), but it passes the device plugin's container annotations to
the runtime, and containerd 1.7 (Debian 13's; `make e2e-cdi` puts it beside the 1.20 kubelet) applies the
CDI devices a `cdi.k8s.io/...` annotation names. So with `deviceListStrategy: [cdi-annotations]` and
`deviceNodes: false`, the container gets its GPU from the CDI spec alone: the spec's device file and env,
nothing from gpushared's own device specs or variables. The spec plays NVIDIA toolkit's
(`nvidia-ctk cdi generate`: kind nvidia.com/gpu, a device per GPU UUID), written for the simulated GPUs.
Skipped, saying why, where the harness's containerd has no CDI (1.6, Debian 12's: `make e2e`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from gpushared import contract
from gpushared.core.dra.prepare import CdiDevice, cdi_document
from gpushared.core.node.allocate import Mount
from gpushared.core.node.exposure import CDI_KIND, DeviceFile
from tests.e2e.cluster import LocalCluster, cached_version
from tests.e2e.kube import PRINT_ENV, Kube, gpu_pod
from tests.e2e.versions import Version

CONTAINERD = cached_version("containerd")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        CONTAINERD is None or Version(1, 7) > CONTAINERD,
        reason=f"CDI needs containerd >= 1.7; the harness's is {CONTAINERD} (make e2e-cdi brings Debian 13's)",
    ),
]


MARKER = "written-by-the-cdi-spec"


@pytest.fixture(scope="module")
def cdi_node(cluster: LocalCluster, kube: Kube) -> Iterator[LocalCluster]:
    """NVIDIA toolkit's CDI spec for the simulated GPUs, written by gpushared's own CDI writer (the one that
    writes each DRA claim's spec: core.dra.prepare.cdi_document) so that containerd's reading of it is tested
    too, with a bind mount; and the daemon naming GPUs by CDI alone."""
    shared = cluster.state / "cdi-shared"
    shared.mkdir(exist_ok=True)
    (shared / "marker").write_text(MARKER)
    dev = cluster.gpus.dev_root / "dev"
    devices = [
        CdiDevice(
            name=gpu.uuid,
            env={"NVIDIA_CDI_GPU": gpu.uuid},
            device_nodes=(
                DeviceFile(f"/dev/nvidia{gpu.index}", str(dev / f"nvidia{gpu.index}")),
                DeviceFile("/dev/nvidiactl", str(dev / "nvidiactl")),
            ),
            mounts=(Mount(container_path="/cdi-mounted", host_path=str(shared), read_only=True),),
        )
        for gpu in kube.inventory().gpus
    ]
    spec = cdi_document(devices, kind=CDI_KIND)
    (cluster.cdi_root / "nvidia.json").write_text(json.dumps(spec))
    cluster.node.restart_daemon(deviceListStrategy=["cdi-annotations"], deviceNodes=False)
    cluster.node.wait_serving()
    cluster.node.wait_ready()
    yield cluster
    (cluster.cdi_root / "nvidia.json").unlink()
    shutil.rmtree(shared)
    cluster.node.restart_daemon()
    cluster.node.wait_serving()
    cluster.node.wait_ready()


def test_a_gpu_named_in_the_cdi_annotation_is_given_by_containerd(
    cdi_node: LocalCluster, kube: Kube, namespace: str
) -> None:
    body = gpu_pod("cdi", 6)
    container = body["spec"]["containers"][0]
    container["command"] = ["sh", "-c", f"echo NVIDIA_MOUNTED=$(cat /cdi-mounted/marker); {PRINT_ENV}"]
    kube.create(namespace, body)
    (pod,) = kube.wait_running(namespace, "cdi")
    index = int(pod["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_IDX])
    uuid = kube.inventory().gpus[index].uuid
    env = kube.env_of(namespace, "cdi")
    assert env["NVIDIA_CDI_GPU"] == uuid  # the spec's edit: containerd applied the device the annotation named
    assert env["DEVICES"].split() == sorted([f"nvidia{index}", "nvidiactl"])  # its device file and no other GPU's
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # nothing from envvar: CDI alone
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == str(index)
    assert env["NVIDIA_MOUNTED"] == MARKER  # the spec's bind mount
