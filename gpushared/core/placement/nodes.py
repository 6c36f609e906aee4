"""A node as the extender counts it: its GPUs and their ledger, its CPU, its pods; and whether a pod may be
placed there at all.

Pure data, kept by the extender's ``state.ClusterState`` and read by its filter index through
:class:`ClusterView`; here, below both, so that neither reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gpushared.contract import GpuInventory, ResourceNames
from gpushared.core.placement.fragmentation import RequestMix
from gpushared.core.placement.nodefit import NodeTraits
from gpushared.core.placement.pricing import NodeCpu
from gpushared.core.shared.bodies import PodBody
from gpushared.core.shared.ledger import Ledger


@dataclass(frozen=True)
class Rejected:
    """Why a node is no place for the pod: what kube-scheduler shows in the pod's events."""

    reason: str


@dataclass
class NodeState:
    name: str
    inventory: GpuInventory | None = None
    problem: str | None = None  # why the node's GPUs cannot be read
    #: whether the node's device plugin puts a container on several GPUs: ours does (it writes the inventory
    #: annotation); Aliyun's, whose nodes only advertise capacity, gives a container one GPU
    several_gpus: bool = False
    address: str = ""
    #: the value of the cluster's GPU-model label on the node (None: no such label)
    model: str | None = None
    pods: dict[str, PodBody] = field(default_factory=dict)  # uid -> pod bound here
    ledger: Ledger | None = None
    #: milli-CPU pods may request here (None: the node does not say) and that the pods bound here request
    cpu_allocatable: int | None = None
    cpu_requested: int = 0
    #: counts changes of the two: ranks that read CPU are kept per (ledger version, CPU version)
    cpu_version: int = 0
    #: bytes of memory pods may request here (None: the node does not say) and that the pods bound here
    #: request: the claim allocator's tie-break (``core.placement.claims.choice.kube_resource_score``)
    memory_allocatable: int | None = None
    memory_requested: int = 0
    #: its labels, filtering taints and cordon (None: deleted): which pods may go there (``nodefit.admits``)
    facts: NodeTraits | None = None

    @property
    def cpu(self) -> NodeCpu | None:
        if self.cpu_allocatable is None:
            return None
        return NodeCpu(allocatable=self.cpu_allocatable, requested=self.cpu_requested)


def usable(
    node: NodeState | None, name: str, *, gpus: int, resources: ResourceNames
) -> tuple[NodeState, Ledger] | Rejected:
    """The node and its ledger, or why it is no candidate at all for a pod on ``gpus`` GPUs (``node`` None:
    the extender does not know the name)."""
    if node is None:
        return Rejected(f"node {name} is not in the extender's cache (unknown node)")
    if node.problem:
        return Rejected(f"node {name} is not usable: {node.problem}")
    if node.ledger is None:
        return Rejected(f"node {name} is not a gpushared node (no GPU inventory and no {resources.gpu_mem} capacity)")
    if gpus > 1 and not node.several_gpus:
        return Rejected(f"node {name} runs Aliyun's device plugin, which gives a container one GPU, not {gpus}")
    return node, node.ledger


class ClusterView(Protocol):
    """What the extender's readers (its filter index) see of the cluster: the nodes as counted, and the mix
    of what pods ask for. ``state.ClusterState`` is the one implementation; its owner applies every change."""

    nodes: dict[str, NodeState]
    #: the node label naming GPU models ("": not weighed)
    model_label: str

    @property
    def mix_generation(self) -> int:
        """Counts the mixes taken: a rank that reads the mix is kept per mix."""

    @property
    def pressure_generation(self) -> int:
        """Counts the mixes whose pressures moved: a rank that reads only those is kept per these."""

    def usable(self, name: str, *, gpus: int = 1) -> tuple[NodeState, Ledger] | Rejected: ...

    def request_mix(self) -> RequestMix: ...
