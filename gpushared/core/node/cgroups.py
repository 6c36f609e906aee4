"""Which pod and container a process belongs to, from its ``/proc/<pid>/cgroup``.

The kubelet puts every container in a cgroup under its pod's, and names the pod's by its UID; the runtime
names the container's by its ID. The forms differ by cgroup version, by the kubelet's cgroup driver and by
the runtime, and a kubelet may sit under another slice (kind, `--cgroup-root`):

=========================  =====================================================================================
cgroupfs driver            ``/kubepods/burstable/pod<uid>/<id>`` (``/kubepods/pod<uid>/<id>`` when Guaranteed);
                           CRI-O: ``.../pod<uid>/crio-<id>``
systemd driver             ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/``
                           ``cri-containerd-<id>.scope`` (``crio-<id>.scope``, ``docker-<id>.scope``); the UID's
                           dashes are underscores there
cgroup v1                  one line per hierarchy, ``<n>:<controllers>:<path>``; they name the same cgroup
cgroup v2                  one line, ``0::<path>``
=========================  =====================================================================================

CRI-O's ``crio-conmon-<id>.scope`` is its monitor process, not the container: it belongs to the pod but to no
container. A process in no pod's cgroup (a host job, the MPS server, the daemon itself) belongs to none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The pod's cgroup: ``pod<uid>`` (cgroupfs) or ``...-pod<uid_with_underscores>.slice`` (systemd).
_UID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
_POD = re.compile(rf"(?:^|-)pod({_UID})(?:\.slice)?$")
#: The container's cgroup below the pod's: a bare ID (cgroupfs, containerd and Docker), or the runtime's
#: prefix and, with the systemd driver, ``.scope``.
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker|containerd)-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class CgroupOwner:
    """The pod (by UID, with dashes) and the container (by runtime ID, None for the pod's own processes,
    such as CRI-O's conmon) a process runs in."""

    pod_uid: str
    container_id: str | None


def owner_of(cgroup: str) -> CgroupOwner | None:
    """The pod and container of the process whose ``/proc/<pid>/cgroup`` reads ``cgroup``; None when the
    process is in no pod's cgroup."""
    for line in cgroup.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        owner = _owner_of_path(path)
        if owner is not None:
            return owner
    return None


def _owner_of_path(path: str) -> CgroupOwner | None:
    parts = [part for part in path.split("/") if part]
    for position, part in enumerate(parts):
        pod = _POD.search(part)
        if pod is None:
            continue
        uid = pod.group(1).replace("_", "-").lower()
        below = parts[position + 1 : position + 2]
        container = _CONTAINER.match(below[0]) if below else None
        return CgroupOwner(pod_uid=uid, container_id=container.group(2) if container else None)
    return None


def container_id_of(status_id: str) -> str:
    """The runtime's ID from a container status's ``containerID`` (``containerd://<id>``, ``cri-o://<id>``,
    ``docker://<id>``)."""
    return status_id.rpartition("://")[2]
