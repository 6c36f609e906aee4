"""An OCI bundle for the daemon-reload check, from what the installed daemon's Allocate answered.

Runs inside the systemd-nspawn container (its own python3, standard library only), after ``runc spec``
wrote a default ``config.json`` in BUNDLE. Each device spec of the answer becomes what containerd's CRI
makes of it (``WithDevices``): a ``linux.devices`` entry with the host file's type and numbers, and an
allow rule in ``linux.resources.devices``. One more device, UNRECORDED (``/dev/nvidia-unrecorded``,
character 195:254, no ``/dev/char`` link), is added the same way: runc cannot name it to systemd, as it
cannot name a device NVIDIA's hook adds, so it shows what a reload does to a device outside systemd's
record. The container runs ``sleep`` from a busybox rootfs in BUNDLE/rootfs, in the scope
``system.slice:gpushared-test:<name>``.

    python3 reload_bundle.py BUNDLE ANSWER_JSON NAME
"""

from __future__ import annotations

import json
import os
import stat
import sys

UNRECORDED = ("/dev/nvidia-unrecorded", 195, 254)


def device(path: str, host_path: str) -> tuple[dict[str, object], dict[str, object]]:
    info = os.stat(host_path)
    kind = "c" if stat.S_ISCHR(info.st_mode) else "b"
    major, minor = os.major(info.st_rdev), os.minor(info.st_rdev)
    spec = {"path": path, "type": kind, "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}
    return spec, {"allow": True, "type": kind, "major": major, "minor": minor, "access": "rwm"}


def main(bundle: str, answer_path: str, name: str) -> None:
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    with open(answer_path) as f:
        answer = json.load(f)
    linux = config["linux"]
    specs = linux.setdefault("devices", [])
    rules = linux.setdefault("resources", {}).setdefault("devices", [])
    for given in answer["devices"]:
        spec, rule = device(given["containerPath"], given["hostPath"])
        specs.append(spec)
        rules.append(rule)
    path, major, minor = UNRECORDED
    specs.append({"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0})
    rules.append({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})
    config["process"].update(terminal=False, args=["sleep", "3600"])
    config["process"]["env"] += [f"{k}={v}" for k, v in answer["envs"].items()]
    linux["cgroupsPath"] = f"system.slice:gpushared-test:{name}"
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(" ".join(s["path"] for s in specs))


if __name__ == "__main__":
    main(*sys.argv[1:4])
