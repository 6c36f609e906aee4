"""The DRA driver's checkpoint: the claims prepared on the node, as a versioned JSON document.

The kubelet prepares a claim once per pod and unprepares it once; in between the daemon may restart, and
a container of the pod may restart and need the claim's CDI spec again. So every prepared claim is written
here before the kubelet hears of it, with everything its CDI spec is made from: a restarted daemon rewrites
the specs from the checkpoint alone, answers a repeated prepare with what it answered before, and counts
the claims' memory without asking the API server. Pure: the daemon reads and writes the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpushared.contract import ContractError, dra
from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.prepare import CdiDevice, PreparedClaim, PreparedDevice
from gpushared.core.node.allocate import Mount
from gpushared.core.node.exposure import DeviceFile

VERSION: Final = 1
KEY: Final = "DRA checkpoint"


def format_checkpoint(claims: Sequence[PreparedClaim]) -> str:
    return json.dumps(
        {"version": VERSION, "claims": [_claim(c) for c in sorted(claims, key=lambda c: c.ref)]},
        indent=1,
        sort_keys=True,
    )


def parse_checkpoint(text: str) -> list[PreparedClaim]:
    """The claims of a checkpoint (or of one claim's record); any damage is a ContractError, never another
    exception: JSON nested past the parser's depth, a field of the wrong type, a UID that is not one."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ContractError(key=KEY, value=text[:80], reason=f"not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise ContractError(key=KEY, value=_head(body), reason=f"expected version {VERSION}")
    try:
        return [_parse_claim(entry) for entry in body["claims"]]
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise ContractError(key=KEY, value=_head(body), reason=f"malformed: {str(exc)[:200]!r}") from None


def _head(body: object) -> str:
    try:
        return str(body)[:80]
    except RecursionError:  # a nested list's repr can go past the depth the parser reached
        return f"a {type(body).__name__}"


def _claim(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.ref.namespace,
        "name": claim.ref.name,
        "uid": claim.ref.uid,
        "devices": [
            {
                "request": d.request,
                "pool": d.pool,
                "device": d.device,
                "uuid": d.uuid,
                "index": d.index,
                "memory": d.memory,
                "memoryMiB": d.memory_mib,
                "compute": d.compute,
                "mpsThreads": d.mps_threads,
                "cdiDeviceIDs": list(d.cdi_device_ids),
                "sharers": d.sharers,
            }
            for d in claim.devices
        ],
        "cdi": [
            {
                "name": c.name,
                "env": dict(c.env),
                "deviceNodes": [[f.container_path, f.host_path, f.permissions] for f in c.device_nodes],
                "mounts": [[m.container_path, m.host_path, m.read_only] for m in c.mounts],
                "companions": list(c.companions),
            }
            for c in claim.cdi
        ],
    }


def _parse_claim(entry: Mapping[str, Any]) -> PreparedClaim:
    ref = ClaimRef(namespace=_str(entry["namespace"]), name=_str(entry["name"]), uid=_str(entry["uid"]))
    if not dra.is_claim_uid(ref.uid):  # it names files: never a path
        raise ValueError(f"claim UID {ref.uid[:80]!r} is not a Kubernetes UID")
    devices = tuple(
        PreparedDevice(
            request=_str(d["request"]),
            pool=_str(d["pool"]),
            device=_str(d["device"]),
            uuid=_str(d["uuid"]),
            index=_int(d["index"]),
            memory=_int(d["memory"]),
            memory_mib=_int(d["memoryMiB"]),
            compute=_int(d["compute"]),
            mps_threads=None if d.get("mpsThreads") is None else _int(d["mpsThreads"]),
            cdi_device_ids=tuple(_str(i) for i in d["cdiDeviceIDs"]),
            sharers=_positive(d.get("sharers", 1)),  # records from before claims were split: one container
        )
        for d in entry["devices"]
    )
    cdi = tuple(
        CdiDevice(
            name=_str(c["name"]),
            env={_str(k): _str(v) for k, v in _dict(c["env"]).items()},
            device_nodes=tuple(DeviceFile(_str(a), _str(b), _str(p)) for a, b, p in c["deviceNodes"]),
            mounts=tuple(Mount(_str(a), _str(b), bool(ro)) for a, b, ro in c["mounts"]),
            # records written before companions were: each device alone, as its spec was written
            companions=tuple(_str(n) for n in _list(c.get("companions", []))),
        )
        for c in entry["cdi"]
    )
    return PreparedClaim(ref=ref, devices=devices, cdi=cdi)


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _positive(value: object) -> int:
    number = _int(value)
    if number < 1:
        raise ValueError(f"expected at least 1, got {number}")
    return number


def _dict(value: object) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {str(value)[:80]}")
    return value


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {str(value)[:80]}")
    return value


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
