"""A process's pod and container from its /proc/<pid>/cgroup, in every form kubelets and runtimes write."""

from __future__ import annotations

import pytest

from gpushared.core.node.cgroups import CgroupOwner, container_id_of, owner_of

UID = "3f2a9c1e-7b4d-4e8f-9a0b-1c2d3e4f5a6b"
SYSTEMD_UID = UID.replace("-", "_")
ID = "a" * 40 + "0123456789abcdef01234567"

V1_SYSTEMD = "\n".join(
    f"{n}:{controllers}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
    f"cri-containerd-{ID}.scope"
    for n, controllers in ((12, "memory"), (11, "cpu,cpuacct"), (1, "name=systemd"))
)


@pytest.mark.parametrize(
    ("cgroup", "owner"),
    [
        pytest.param(f"0::/kubepods/burstable/pod{UID}/{ID}\n", CgroupOwner(UID, ID), id="v2 cgroupfs containerd"),
        pytest.param(f"0::/kubepods/pod{UID}/{ID}\n", CgroupOwner(UID, ID), id="v2 cgroupfs Guaranteed"),
        pytest.param(f"0::/kubepods/besteffort/pod{UID}/crio-{ID}\n", CgroupOwner(UID, ID), id="v2 cgroupfs CRI-O"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
            f"cri-containerd-{ID}.scope\n",
            CgroupOwner(UID, ID),
            id="v2 systemd containerd",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{ID}.scope\n",
            CgroupOwner(UID, ID),
            id="v2 systemd CRI-O Guaranteed",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
            f"crio-conmon-{ID}.scope\n",
            CgroupOwner(UID, None),
            id="CRI-O conmon: the pod's, no container's",
        ),
        pytest.param(V1_SYSTEMD, CgroupOwner(UID, ID), id="v1 systemd, every hierarchy"),
        pytest.param(
            f"12:memory:/kubepods/burstable/pod{UID}/{ID}\n11:pids:/kubepods/burstable/pod{UID}/{ID}\n",
            CgroupOwner(UID, ID),
            id="v1 cgroupfs",
        ),
        pytest.param(
            f"1:name=systemd:/system.slice/containerd.service\n0::/kubepods/burstable/pod{UID}/docker-{ID}.scope\n",
            CgroupOwner(UID, ID),
            id="v1 hybrid: the first line that names a pod",
        ),
        pytest.param(
            f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{SYSTEMD_UID}.slice/"
            f"cri-containerd-{ID}.scope\n",
            CgroupOwner(UID, ID),
            id="a kubelet under its own slice (kind)",
        ),
        pytest.param(f"0::/kubepods/burstable/pod{UID.upper()}/{ID}\n", CgroupOwner(UID, ID), id="UID in capitals"),
        pytest.param("0::/system.slice/gpushared.service\n", None, id="the daemon: a host process"),
        pytest.param("0::/system.slice/nvidia-mps.service\n", None, id="an MPS server: a host process"),
        pytest.param("0::/user.slice/user-1000.slice/session-3.scope\n", None, id="a user's job"),
        pytest.param("0::/\n", None, id="the root cgroup"),
        pytest.param("", None, id="empty: the process exited while being read"),
        pytest.param("0::/kubepods/burstable/podnot-a-uid/x\n", None, id="not a UID"),
        pytest.param("0::/kubepods/burstable/mypod12345/x\n", None, id="a name ending in pod"),
    ],
)
def test_the_owner_of_a_process(cgroup: str, owner: CgroupOwner | None) -> None:
    assert owner_of(cgroup) == owner


@pytest.mark.parametrize("prefix", ["containerd://", "cri-o://", "docker://", ""])
def test_a_container_status_id_is_the_runtimes_id(prefix: str) -> None:
    assert container_id_of(prefix + ID) == ID
