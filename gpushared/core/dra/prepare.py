"""NodePrepareResources for one claim, decided from what the node knows: which GPUs, and what each request's
containers get, as a CDI spec the runtime applies.

The scheduler allocated the claim against the slice the daemon published; ``decide`` checks the node can
still give it (each device is a GPU of this node, healthy; the claims prepared here, this one counted once,
stay within each GPU's memory and compute; an MPS claim has one GPU, a daemon that answers and room for a
client) and says what each request's containers get: the GPU in the form the node's runtime reads
(``core.node.exposure``, as for a device-plugin pod), Aliyun's env, and for MPS the daemon's pipe and limits
(``core.node.allocate.mps_client``). The claims of one call are decided together (``decide_all``): a
container given devices of several claims is told all their GPUs by each (``core.dra.companions``). Pure, a
table test per refusal (tests/unit/test_dra_prepare.py, tests/unit/test_dra_companions.py); the daemon's
driver gathers the facts, writes the CDI spec and the checkpoint, and answers the kubelet.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpushared import contract
from gpushared.contract import ContractError, GpuInfo, GpuInventory, dra
from gpushared.core.dra.allocated import AllocatedDevice, ClaimRef, allocated_devices, cdi_name
from gpushared.core.dra.claimusers import ClaimUse, claim_users, sharers
from gpushared.core.dra.companions import Combination, DriverClaim, companions
from gpushared.core.node.allocate import Mount, MpsDaemon, mps_client, thread_percentage
from gpushared.core.node.exposure import CannotExpose, DeviceFile, ExposedGpu, ExposurePolicy, exposure
from gpushared.core.shared.bodies import PodBody, uid_of
from gpushared.core.shared.verdicts import MAX_MPS_CLIENTS

#: The CDI spec version written: 0.5.0 has device nodes' host paths, and containerd 1.7 reads it.
CDI_VERSION: Final = "0.5.0"
#: Each CDI device's own variable, ``<prefix><claim UID>_<REQUEST>`` = its GPUs' UUIDs: no other device sets it.
CLAIM_VARIABLE_PREFIX: Final = "GPUSHARED_CLAIM_"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device as prepared: the GPU, what the claim holds of it, and the CDI devices its
    containers get (the request's own CDI device is listed with the request's first device only)."""

    request: str
    pool: str
    device: str
    uuid: str
    index: int
    #: memory held, in the node's unit (rounded up from the bytes consumed) and in MiB (for MPS)
    memory: int
    memory_mib: int
    compute: int
    #: the MPS thread percentage of its containers; None: not an MPS client
    mps_threads: int | None = None
    cdi_device_ids: tuple[str, ...] = ()
    #: the containers that share its memory (``core.dra.claimusers``): each is given and held to its part
    sharers: int = 1

    @property
    def mps(self) -> bool:
        return self.mps_threads is not None


@dataclass(frozen=True)
class CdiDevice:
    """One device of the claim's CDI spec: the edits every container of one request gets."""

    name: str
    env: Mapping[str, str]
    device_nodes: tuple[DeviceFile, ...] = ()
    mounts: tuple[Mount, ...] = ()
    #: the CDI devices every container given this one is given too, itself included, sorted: its shared
    #: variables name all their GPUs (``core.dra.companions``); empty: itself alone (records of releases before)
    companions: tuple[str, ...] = ()

    @property
    def combination(self) -> Combination:
        return frozenset(self.companions or (self.name,))


@dataclass(frozen=True)
class PreparedClaim:
    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    cdi: tuple[CdiDevice, ...] = field(default=())


@dataclass(frozen=True)
class DraNode:
    """What the node has when the kubelet calls, as the driver gathered it."""

    name: str
    inventory: GpuInventory
    #: the claims prepared on the node (the one being prepared may be among them already)
    prepared: Sequence[PreparedClaim] = ()
    exposure: ExposurePolicy = field(default_factory=ExposurePolicy)
    minors: Mapping[str, int | None] = field(default_factory=dict)
    present_devices: Collection[str] = ()
    #: GPU UUID -> its MPS control daemon, for those that answer; None when the node runs no MPS daemons
    mps: Mapping[str, MpsDaemon] | None = None


@dataclass(frozen=True)
class PrepareRefusal:
    message: str


@dataclass(frozen=True)
class ClaimRead:
    """A claim of one NodePrepareResources call, as read from the API server."""

    ref: ClaimRef
    claim: Mapping[str, Any]
    #: the pods it is reserved for, as read: their containers share its memory and say which claims each uses
    #: with it; None: not read (one container, given nothing else of this driver)
    pods: Sequence[PodBody] | None = None


def decide(
    ref: ClaimRef, claim: Mapping[str, Any], node: DraNode, *, users: Counter[ClaimUse] | None = None
) -> PreparedClaim | PrepareRefusal:
    """One claim as prepared on ``node``, its containers given nothing else of this driver; or why not, in
    words for the pod's events. ``users``: the containers of the pods it is reserved for
    (``core.dra.claimusers.claim_users``), among which each request's memory is split (None: one container)."""
    devices = _devices(ref, claim, node, users)
    if isinstance(devices, PrepareRefusal):
        return devices
    return _with_cdi(ref, devices, node, {}, _by_cdi_device(ref, devices))


def decide_all(
    reads: Sequence[ClaimRead], node: DraNode, *, unread: Collection[ClaimRef] = ()
) -> dict[str, PreparedClaim | PrepareRefusal]:
    """The claims of one call (the kubelet sends a pod's unprepared claims of this driver together), each as
    prepared or why not, by UID. Each is checked against ``node``'s claims and those decided before it; then
    every CDI device is told the GPUs of its companions (``core.dra.companions``), among the claims of the
    call and those prepared here. A claim is refused where a pod it is reserved for has containers that
    cannot each be told their own GPUs, and where it is used beside a claim that is refused or ``unread``
    (claims of the call not read in time): a claim is never prepared without the others its containers use."""
    decided: dict[str, list[PreparedDevice] | PrepareRefusal] = {}
    so_far: list[PreparedClaim] = []
    for read in reads:
        users = claim_users(read.pods) if read.pods is not None else None
        devices = _devices(read.ref, read.claim, dataclasses.replace(node, prepared=[*node.prepared, *so_far]), users)
        decided[read.ref.uid] = devices
        if not isinstance(devices, PrepareRefusal):
            so_far.append(PreparedClaim(read.ref, tuple(devices)))
    devices_of: dict[str, list[PreparedDevice]] = {}
    owners: dict[str, ClaimRef] = {}  # CDI device -> its claim
    for prepared in [*node.prepared, *so_far]:
        devices_of.update(_by_cdi_device(prepared.ref, prepared.devices))
        owners.update({cdi_name(prepared.ref, d.request): prepared.ref for d in prepared.devices})
    pods = {uid_of(pod): pod for read in reads for pod in read.pods or ()}
    mps = {name for name, members in devices_of.items() if any(d.mps for d in members)}
    found = companions(pods.values(), _driver_claims(reads, decided, node, unread), mps=mps)
    outcomes: dict[str, PreparedClaim | PrepareRefusal] = {}
    for read in reads:
        outcome = decided[read.ref.uid]
        problem = next((found.problems[uid_of(p)] for p in read.pods or () if uid_of(p) in found.problems), None)
        if isinstance(outcome, PrepareRefusal):
            outcomes[read.ref.uid] = outcome
        elif problem is not None:
            outcomes[read.ref.uid] = PrepareRefusal(f"claim {read.ref.key} cannot be prepared: {problem}")
        else:
            outcomes[read.ref.uid] = _with_cdi(read.ref, outcome, node, found.of, devices_of)
    _refuse_beside_refused(outcomes, owners, found.of)
    return outcomes


def _driver_claims(
    reads: Sequence[ClaimRead],
    decided: Mapping[str, list[PreparedDevice] | PrepareRefusal],
    node: DraNode,
    unread: Collection[ClaimRef],
) -> dict[tuple[str, str], DriverClaim]:
    """The driver's claims a container may name, by namespace and name: those prepared here (with the
    companions their specs were written for), the call's unread ones, and the call's (a refused one as one
    that cannot be prepared now)."""
    claims: dict[tuple[str, str], DriverClaim] = {}
    for prepared in node.prepared:
        written = {cdi.name: cdi.combination for cdi in prepared.cdi}
        claims[(prepared.ref.namespace, prepared.ref.name)] = DriverClaim(
            prepared.ref, _requests(prepared.devices), written
        )
    for ref in unread:
        claims[(ref.namespace, ref.name)] = DriverClaim(ref, None)
    for read in reads:
        outcome = decided[read.ref.uid]
        requests = None if isinstance(outcome, PrepareRefusal) else _requests(outcome)
        claims[(read.ref.namespace, read.ref.name)] = DriverClaim(read.ref, requests)
    return claims


def _refuse_beside_refused(
    outcomes: dict[str, PreparedClaim | PrepareRefusal], owners: Mapping[str, ClaimRef], of: Mapping[str, Combination]
) -> None:
    """Refuse every claim of ``outcomes`` used beside one refused (its CDI devices' companions, ``of``, name
    a device of that claim: ``owners``), and so on: none is prepared without the others its containers use,
    whose GPUs its spec would name."""
    changed = True
    while changed:
        changed = False
        refused = {uid for uid, outcome in outcomes.items() if isinstance(outcome, PrepareRefusal)}
        for uid, outcome in outcomes.items():
            if isinstance(outcome, PrepareRefusal):
                continue
            beside = sorted(
                owners[c]
                for cdi in outcome.cdi
                for c in of.get(cdi.name, ())
                if c in owners and owners[c].uid in refused - {uid}
            )
            if beside:
                outcomes[uid] = PrepareRefusal(
                    f"claim {outcome.ref.key} is used beside claim {beside[0].key}, which cannot be prepared now "
                    "(its own error says why): a claim used with others is prepared with them"
                )
                changed = True


def _requests(devices: Sequence[PreparedDevice]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(d.request for d in devices))


def _by_cdi_device(ref: ClaimRef, devices: Sequence[PreparedDevice]) -> dict[str, list[PreparedDevice]]:
    found: dict[str, list[PreparedDevice]] = {}
    for device in devices:
        found.setdefault(cdi_name(ref, device.request), []).append(device)
    return found


def _devices(
    ref: ClaimRef, claim: Mapping[str, Any], node: DraNode, users: Counter[ClaimUse] | None
) -> list[PreparedDevice] | PrepareRefusal:
    """The claim's devices as prepared on ``node``, each request's memory split among ``users``; or why not."""
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        return PrepareRefusal(
            f"claim {ref.key} is now another object (UID {uid}, the kubelet asked for {ref.uid}): "
            "it was deleted and created again"
        )
    try:
        allocated = allocated_devices(claim)
    except ContractError as exc:
        return PrepareRefusal(f"claim {ref.key}: {exc}")
    by_name = {dra.device_name(gpu.uuid): gpu for gpu in node.inventory.gpus}
    others = [p for p in node.prepared if p.ref.uid != ref.uid]
    devices: list[PreparedDevice] = []
    for device in allocated:
        prepared = _device(ref, device, by_name, [*others, PreparedClaim(ref, tuple(devices))], node)
        if isinstance(prepared, PrepareRefusal):
            return prepared
        devices.append(prepared)
    if users:
        devices = [dataclasses.replace(d, sharers=sharers(users, ref.namespace, ref.name, d.request)) for d in devices]
        thin = next((d for d in devices if d.memory_mib // d.sharers == 0), None)
        if thin is not None:
            return PrepareRefusal(
                f"claim {ref.key}: {thin.memory_mib} MiB of GPU {thin.index} shared by {thin.sharers} containers "
                "leaves each none: ask for more memory, or give fewer containers the claim"
            )
    if sum(d.mps for d in devices) > 1:
        gpus = sorted(d.index for d in devices if d.mps)
        return PrepareRefusal(
            f"claim {ref.key} asks for MPS on GPUs {gpus}: an MPS client reaches one GPU's daemon only; "
            "ask for one GPU per MPS claim"
        )
    return devices


def _device(
    ref: ClaimRef,
    device: AllocatedDevice,
    by_name: Mapping[str, GpuInfo],
    prepared: Sequence[PreparedClaim],
    node: DraNode,
) -> PreparedDevice | PrepareRefusal:
    key, inventory = ref.key, node.inventory
    if device.pool != node.name:
        return PrepareRefusal(
            f"claim {ref.key} was allocated {device.device} of pool {device.pool}, not of node {node.name}"
        )
    gpu = by_name.get(device.device)
    if gpu is None:
        return PrepareRefusal(
            f"claim {key} was allocated device {device.device}, which node {node.name} does not have "
            "(the GPUs changed since it was allocated): delete the pod"
        )
    if not gpu.healthy:
        return PrepareRefusal(f"claim {key} was allocated GPU {gpu.index} ({gpu.uuid}), which is unhealthy")
    unit_bytes = inventory.unit.to_bytes(1)
    if device.memory is not None and (device.memory < unit_bytes or device.memory % unit_bytes):
        # The slice's request policy: at least one unit, in whole units; a scheduler rounds every request
        # up to it, so less is an allocation no scheduler made (20 claims of 0 would fill nothing).
        return PrepareRefusal(
            f"claim {key} consumed {device.memory} bytes of GPU {gpu.index}'s memory: the slice asks for whole "
            f"units of {unit_bytes} bytes ({inventory.unit.value}), at least one"
        )
    memory = gpu.memory if device.memory is None else device.memory // unit_bytes
    memory_mib = gpu.memory_mib if device.memory is None else math.ceil(device.memory / 2**20)
    on_gpu = [d for claim in prepared for d in claim.devices if d.uuid == gpu.uuid]
    unit = inventory.unit.value
    used = sum(d.memory for d in on_gpu) + memory
    if used > gpu.memory:
        return PrepareRefusal(
            f"claim {key} would bring GPU {gpu.index} to {used} {unit} of {gpu.memory} {unit}: it does not fit; "
            "was it allocated by a scheduler without consumable capacity (DRAConsumableCapacity)?"
        )
    compute = sum(d.compute for d in on_gpu) + device.compute
    if compute > 100:
        return PrepareRefusal(f"claim {key} would bring the compute claimed on GPU {gpu.index} to {compute} percent")
    config = device.config
    threads = None
    if config.mps:
        if node.mps is None:
            return PrepareRefusal(
                f"claim {key} asks for MPS, but node {node.name} runs no MPS daemons: set mps.enabled in "
                "the gpushared configuration, or drop mps from the claim's configuration"
            )
        if node.mps.get(gpu.uuid) is None:
            return PrepareRefusal(f"claim {key}: the MPS control daemon of GPU {gpu.index} is not running")
        clients = sum(d.mps for d in on_gpu) + 1
        if clients > MAX_MPS_CLIENTS:
            return PrepareRefusal(
                f"claim {key} would be MPS client {clients} of GPU {gpu.index}; an MPS server takes {MAX_MPS_CLIENTS}"
            )
        if config.compute_limit is not None and config.compute_limit < device.compute:
            return PrepareRefusal(
                f"claim {key}: computeLimit {config.compute_limit} is below the {device.compute} percent of "
                f"GPU {gpu.index} it claimed"
            )
        # Its limit, else what it claimed, else its share of the GPU's memory (as for a device-plugin pod).
        threads = thread_percentage(
            amount=memory, gpu_memory=gpu.memory, override=config.compute_limit or device.compute or None
        )
    return PreparedDevice(
        request=device.request,
        pool=device.pool,
        device=device.device,
        uuid=gpu.uuid,
        index=gpu.index,
        memory=memory,
        memory_mib=memory_mib,
        compute=device.compute,
        mps_threads=threads,
    )


def _with_cdi(
    ref: ClaimRef,
    devices: list[PreparedDevice],
    node: DraNode,
    combinations: Mapping[str, Combination],
    devices_of: Mapping[str, Sequence[PreparedDevice]],
) -> PreparedClaim | PrepareRefusal:
    """One CDI device per request, named on the request's first device; each GPU's own CDI name from
    NVIDIA's toolkit (the ``cdi-cri`` or ``cdi-annotations`` strategy) on its device. Its device files, mounts
    and own variable are its GPUs'; the variables every device sets are its companions' (``combinations``:
    CDI device -> companions, itself alone where not named; ``devices_of``: every companion's devices)."""
    requests: dict[str, list[PreparedDevice]] = {}
    for device in devices:
        requests.setdefault(device.request, []).append(device)
    cdi: list[CdiDevice] = []
    first: dict[str, str] = {}
    nvidia: dict[str, tuple[str, ...]] = {}
    for request, members in requests.items():
        name = cdi_name(ref, request)
        together = sorted(combinations.get(name) or {name})
        try:
            given = exposure(
                node.exposure,
                [ExposedGpu(d.uuid, node.minors.get(d.uuid)) for d in members],
                present=node.present_devices,
            )
        except CannotExpose as exc:
            return PrepareRefusal(f"claim {ref.key}: {exc}")
        every = [d for companion in together for d in (members if companion == name else devices_of[companion])]
        env = {**_shared_variables(every, node), _claim_variable(ref, request): ",".join(d.uuid for d in members)}
        mounts = [Mount(container_path=inside, host_path=outside, read_only=True) for inside, outside in given.mounts]
        mps = [d for d in members if d.mps]
        if mps:  # alone: an MPS device with companions is refused (core.dra.companions)
            device, gpu = mps[0], node.inventory.by_index(mps[0].index)
            assert node.mps is not None, "checked in _device"
            assert gpu is not None, "checked in _device"
            assert device.mps_threads is not None, "checked in _device"
            mps_env, mps_mounts = mps_client(
                node.mps[device.uuid],
                amount_mib=device.memory_mib // device.sharers,  # one client's part of the claim
                gpu_memory_mib=gpu.memory_mib,
                percentage=device.mps_threads,
            )
            env.update(mps_env)
            mounts += mps_mounts
        companions = tuple(together) if len(together) > 1 else ()
        cdi.append(
            CdiDevice(name=name, env=env, device_nodes=given.devices, mounts=tuple(mounts), companions=companions)
        )
        first[request] = members[0].device
        for device, cdi_id in zip(members, given.cdi_names, strict=False):
            nvidia[device.device] = (cdi_id,)
    answered = tuple(
        dataclasses.replace(
            d,
            cdi_device_ids=((dra.cdi_device_id(cdi_name(ref, d.request)),) if first[d.request] == d.device else ())
            + nvidia.get(d.device, ()),
        )
        for d in devices
    )
    return PreparedClaim(ref=ref, devices=answered, cdi=tuple(cdi))


def _shared_variables(every: Sequence[PreparedDevice], node: DraNode) -> dict[str, str]:
    """The variables all the CDI devices of a container set, made from all of its devices (``every``): its
    GPUs in the form the node's runtime reads, once each by index, and Aliyun's: their indexes, the first
    one's size, and the container's part of every device's memory (two claims on one GPU: both parts)."""
    gpus = sorted({d.uuid: d for d in every}.values(), key=lambda d: d.index)
    # only the variables: each device's files and mounts are its own, and the runtime adds them all up
    told = exposure(
        dataclasses.replace(node.exposure, device_nodes=False), [ExposedGpu(d.uuid, None) for d in gpus], present=()
    )
    first = node.inventory.by_index(gpus[0].index)
    return {
        **told.envs,
        contract.ENV_GPU_MEM_IDX: ",".join(str(d.index) for d in gpus),
        # each container's part: each request's memory split among the containers that share it
        contract.ENV_GPU_MEM_CONTAINER: str(sum(d.memory // d.sharers for d in every)),
        contract.ENV_GPU_MEM_DEV: str(first.memory if first is not None else 0),
    }


def _claim_variable(ref: ClaimRef, request: str) -> str:
    """The CDI device's own variable: the claim's UID and the request, in the letters a variable name has."""
    suffix = request.upper().replace("-", "_").replace("/", "__")
    return f"{CLAIM_VARIABLE_PREFIX}{ref.uid.replace('-', '').upper()}_{suffix}"


def cdi_spec(claim: PreparedClaim) -> dict[str, Any]:
    """The claim's CDI spec (the runtime reads it from the CDI directory by its kind and device names)."""
    return cdi_document(claim.cdi, kind=dra.CDI_KIND)


def cdi_document(cdi: Sequence[CdiDevice], *, kind: str) -> dict[str, Any]:
    """A CDI spec of ``kind`` with these devices: env, device nodes by host path, bind mounts."""
    devices = []
    for device in cdi:
        edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(device.env.items())]}
        if device.device_nodes:
            edits["deviceNodes"] = [
                {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
                for d in device.device_nodes
            ]
        if device.mounts:
            edits["mounts"] = [
                {
                    "hostPath": m.host_path,
                    "containerPath": m.container_path,
                    "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "rbind"],
                }
                for m in device.mounts
            ]
        devices.append({"name": device.name, "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": devices}
