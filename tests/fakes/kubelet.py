"""A fake kubelet device manager: the other end of the device-plugin protocol, over real unix sockets.

It behaves as kubelet's device manager does (v1.20 through current):

- serves ``Registration`` on ``<plugin dir>/kubelet.sock``; refuses versions other than v1beta1; after a
  successful Register it dials ``<plugin dir>/<endpoint>`` and consumes ``ListAndWatch`` for that resource,
  replacing an earlier endpoint of the same resource;
- admits a pod container by container, init containers first: devices of init containers are reused by
  the containers after them; the rest comes from healthy unallocated devices, steered by
  ``GetPreferredAllocation`` when the plugin offers it (and only where the answer is usable), else taken
  in arbitrary order, as Go's map iteration takes them; then one ``Allocate`` per container and, when the
  plugin asks for it, ``PreStartContainer``;
- on :meth:`restart` deletes every socket in the plugin directory and serves a fresh ``kubelet.sock``,
  keeping its allocations (the real one keeps them in a checkpoint);
- serves the PodResources ``List`` on ``<root>/pod-resources/kubelet.sock`` from its pod manager, which,
  as in kubelet's HandlePodAdditions, gets each pod just before that pod's admission: during a pod's
  Allocate calls it lists the pods admitted before it, with their devices, and that pod, without devices
  for the containers not yet allocated. Rejected pods stay listed, as they do in the real pod manager.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpushared.kubelet.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushared.kubelet.podresources.v1 import api_pb2 as podresources_pb2
from gpushared.kubelet.podresources.v1 import api_pb2_grpc as podresources_grpc

VERSION = "v1beta1"
HEALTHY = "Healthy"


class AdmissionError(Exception):
    """The pod cannot be admitted (kubelet reports UnexpectedAdmissionError on the pod)."""


@dataclass
class Endpoint:
    resource: str
    socket: Path
    options: api_pb2.DevicePluginOptions
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    #: ID -> the NUMA nodes its TopologyInfo names (what the Topology Manager would align CPUs with)
    numa: dict[str, tuple[int, ...]] = field(default_factory=dict)
    updates: int = 0
    connected: bool = True
    #: the healthy devices after each update, in order: what allocatable went through
    healthy_counts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PodRef:
    uid: str
    name: str
    namespace: str = "default"


@dataclass
class ManagedPod:
    """A pod in the kubelet's pod manager: its app containers and the devices each got, per resource."""

    ref: PodRef
    app_containers: list[str]
    devices: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # container -> resource -> IDs
    rejected: bool = False


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    count: int
    init: bool = False
    #: a restartable init container (KEP-753): it keeps its devices, and kubelets >= 1.29 list it
    sidecar: bool = False


@dataclass
class ContainerAllocation:
    name: str
    device_ids: list[str]
    response: api_pb2.ContainerAllocateResponse


class FakeKubelet:
    """``root`` plays /var/lib/kubelet: plugins in ``root/device-plugins``, PodResources beside it."""

    def __init__(self, root: Path, *, seed: int | None = None, lists_sidecars: bool = False) -> None:
        self.root = root
        #: PodResources List shows restartable init containers with their devices, as kubelet >= 1.29 does
        self.lists_sidecars = lists_sidecars
        self.plugin_dir = root / "device-plugins"
        self.pods: dict[str, ManagedPod] = {}  # the pod manager, by pod UID
        self.endpoints: dict[str, Endpoint] = {}
        self.allocated: dict[str, dict[str, set[str]]] = {}  # resource -> pod uid -> device IDs
        self.registrations: list[api_pb2.RegisterRequest] = []
        self.calls: list[tuple[str, object]] = []  # (rpc name, request) in the order made
        self.timings: list[tuple[str, float]] = []  # (rpc name, seconds the plugin took to answer)
        self._rng = random.Random(seed)
        self._lock = threading.Condition()
        self._server: grpc.Server | None = None
        self._pod_resources: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    @property
    def pod_resources_socket(self) -> Path:
        return self.root / "pod-resources" / "kubelet.sock"

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> FakeKubelet:
        self._server = _serve(
            self.socket, lambda server: api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        )
        if self._pod_resources is None:
            self._pod_resources = _serve(
                self.pod_resources_socket,
                lambda server: podresources_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server),
            )
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self._pod_resources is not None:
            self._pod_resources.stop(grace=None)
            self._pod_resources = None
        with self._lock:
            for endpoint in self.endpoints.values():
                endpoint.channel.close()
            self.endpoints.clear()

    def restart(self) -> None:
        """As a kubelet restart looks to a plugin: its socket is deleted and kubelet.sock comes back."""
        self.stop()
        for path in self.plugin_dir.iterdir():
            if path.is_socket():
                path.unlink()
        self.start()

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- registration and device lists -------------------------------------------------------------------

    def _register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        self.registrations.append(request)
        if request.version != VERSION:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Unsupported plugin API version: {request.version}; supported versions are [{VERSION}]",
            )
        socket = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{socket}")
        endpoint = Endpoint(
            resource=request.resource_name,
            socket=socket,
            options=request.options,
            channel=channel,
            stub=api_pb2_grpc.DevicePluginStub(channel),
        )
        with self._lock:
            old = self.endpoints.get(request.resource_name)
            self.endpoints[request.resource_name] = endpoint
        if old is not None:
            old.channel.close()
        threading.Thread(target=self._list_and_watch, args=(endpoint,), daemon=True).start()
        return api_pb2.Empty()

    def _list_and_watch(self, endpoint: Endpoint) -> None:
        try:
            for response in endpoint.stub.ListAndWatch(api_pb2.Empty()):
                with self._lock:
                    endpoint.devices = {d.ID: d.health for d in response.devices}
                    endpoint.numa = {d.ID: tuple(n.ID for n in d.topology.nodes) for d in response.devices}
                    endpoint.updates += 1
                    endpoint.healthy_counts.append(sum(1 for d in response.devices if d.health == HEALTHY))
                    self._lock.notify_all()
        except grpc.RpcError:
            pass
        with self._lock:
            endpoint.connected = False
            self._lock.notify_all()

    def devices(self, resource: str) -> dict[str, str]:
        with self._lock:
            endpoint = self.endpoints.get(resource)
            return dict(endpoint.devices) if endpoint else {}

    def numa(self, resource: str) -> dict[str, tuple[int, ...]]:
        with self._lock:
            endpoint = self.endpoints.get(resource)
            return dict(endpoint.numa) if endpoint else {}

    def capacities(self, resource: str) -> list[int]:
        """Every capacity the endpoint's updates have shown, in order."""
        with self._lock:
            endpoint = self.endpoints.get(resource)
            return list(endpoint.healthy_counts) if endpoint else []

    def capacity(self, resource: str) -> int:
        """What the node's allocatable would say: healthy devices of a connected endpoint."""
        with self._lock:
            endpoint = self.endpoints.get(resource)
            if endpoint is None or not endpoint.connected:
                return 0
            return sum(1 for health in endpoint.devices.values() if health == HEALTHY)

    def wait_for(self, resource: str, *, capacity: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.capacity(resource) != capacity:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{resource}: capacity {self.capacity(resource)}, waited for {capacity}")
                self._lock.wait(remaining)

    def wait_for_update(self, resource: str, *, after: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while (endpoint := self.endpoints.get(resource)) is None or endpoint.updates <= after:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{resource}: no ListAndWatch update after {after}")
                self._lock.wait(remaining)

    # --- admission ---------------------------------------------------------------------------------------

    def admit(
        self,
        pod: PodRef,
        resource: str,
        containers: Sequence[ContainerSpec],
        *,
        between: Callable[[str], None] | None = None,
    ) -> list[ContainerAllocation]:
        """Admit one pod: into the pod manager first, then init containers, then app containers; ``between``
        is called with each container's name once it has its devices (a test restarts the plugin there).

        A failure leaves the pod in the pod manager as rejected, with whatever it was given so far."""
        listed = [c.name for c in containers if c.sidecar and self.lists_sidecars]
        managed = ManagedPod(ref=pod, app_containers=listed + [c.name for c in containers if not c.init])
        with self._lock:
            self.pods[pod.uid] = managed
        try:
            return self._admit(managed, resource, containers, between)
        except AdmissionError:
            managed.rejected = True
            raise

    def _admit(
        self,
        managed: ManagedPod,
        resource: str,
        containers: Sequence[ContainerSpec],
        between: Callable[[str], None] | None,
    ) -> list[ContainerAllocation]:
        pod_uid = managed.ref.uid
        ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
        reusable: set[str] = set()
        results = []
        for container in ordered:
            if container.count == 0:
                continue
            with self._lock:  # per container: the plugin may have registered again in between
                endpoint = self.endpoints.get(resource)  # type: ignore[assignment]
            if endpoint is None or not endpoint.connected:
                raise AdmissionError(f"no endpoint for resource {resource}")
            chosen = self._devices_for(endpoint, pod_uid, container.count, reusable)
            request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)])
            self.calls.append(("Allocate", request))
            started = time.perf_counter()
            try:
                response = endpoint.stub.Allocate(request, timeout=10)
                self.timings.append(("Allocate", time.perf_counter() - started))
            except grpc.RpcError as exc:
                self._release(resource, pod_uid, set(chosen) - reusable)
                raise AdmissionError(f"Allocate failed: {exc.code().name}: {exc.details()}") from exc
            if len(response.container_responses) != 1:
                raise AdmissionError(f"Allocate returned {len(response.container_responses)} responses for 1 container")
            with self._lock:  # kubelet records the devices only once Allocate has answered
                managed.devices.setdefault(container.name, {})[resource] = list(chosen)
            if endpoint.options.pre_start_required:
                pre_start = api_pb2.PreStartContainerRequest(devices_ids=chosen)
                self.calls.append(("PreStartContainer", pre_start))
                endpoint.stub.PreStartContainer(pre_start, timeout=10)
            if container.init and not container.sidecar:  # a sidecar keeps running, and its devices
                reusable |= set(chosen)
            else:
                reusable -= set(chosen)
            results.append(ContainerAllocation(container.name, chosen, response.container_responses[0]))
            if between is not None:
                between(container.name)
        return results

    def list_pod_resources(self) -> podresources_pb2.ListPodResourcesResponse:
        with self._lock:
            return podresources_pb2.ListPodResourcesResponse(
                pod_resources=[
                    podresources_pb2.PodResources(
                        name=pod.ref.name,
                        namespace=pod.ref.namespace,
                        containers=[
                            podresources_pb2.ContainerResources(
                                name=name,
                                devices=[
                                    podresources_pb2.ContainerDevices(resource_name=r, device_ids=ids)
                                    for r, ids in sorted(pod.devices.get(name, {}).items())
                                ],
                            )
                            for name in pod.app_containers
                        ],
                    )
                    for pod in self.pods.values()
                ]
            )

    def _devices_for(self, endpoint: Endpoint, pod_uid: str, count: int, reusable: set[str]) -> list[str]:
        resource = endpoint.resource
        with self._lock:
            taken = set().union(*self.allocated.get(resource, {}).values()) if self.allocated.get(resource) else set()
            healthy = {d for d, health in endpoint.devices.items() if health == HEALTHY}
            available = healthy - taken
        chosen = sorted(reusable)[:count]
        needed = count - len(chosen)
        if needed > len(available):
            raise AdmissionError(
                f"requested number of devices unavailable for {resource}. Requested: {count}, "
                f"Available: {len(available) + len(chosen)}"
            )
        if needed and endpoint.options.get_preferred_allocation_available:
            request = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=sorted(available | set(chosen)),
                        must_include_deviceIDs=chosen,
                        allocation_size=count,
                    )
                ]
            )
            self.calls.append(("GetPreferredAllocation", request))
            started = time.perf_counter()
            response = endpoint.stub.GetPreferredAllocation(request, timeout=10)
            self.timings.append(("GetPreferredAllocation", time.perf_counter() - started))
            preferred = [d for d in response.container_responses[0].deviceIDs if d in available and d not in chosen]
            taking = preferred[:needed]
            chosen += taking
            needed -= len(taking)
        if needed:
            pool = sorted(available - set(chosen))
            self._rng.shuffle(pool)
            chosen += pool[:needed]
        with self._lock:
            self.allocated.setdefault(resource, {}).setdefault(pod_uid, set()).update(chosen)
        return chosen

    def _release(self, resource: str, pod_uid: str, devices: set[str]) -> None:
        with self._lock:
            self.allocated.get(resource, {}).get(pod_uid, set()).difference_update(devices)

    def remove_pod(self, pod_uid: str) -> None:
        with self._lock:
            self.pods.pop(pod_uid, None)
            for pods in self.allocated.values():
                pods.pop(pod_uid, None)


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        return self.kubelet._register(request, context)


class _PodResources(podresources_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(
        self, request: podresources_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> podresources_pb2.ListPodResourcesResponse:
        return self.kubelet.list_pod_resources()


def _serve(socket: Path, add: Callable[[grpc.Server], None]) -> grpc.Server:
    """A gRPC server on a fresh unix socket at ``socket``, with the servicer ``add`` registers."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return server
