"""The fake kubelet against a minimal device plugin over real unix sockets and the real grpc library."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpushared.kubelet.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushared.kubelet.podresources.v1 import api_pb2 as podresources_pb2
from gpushared.kubelet.podresources.v1 import api_pb2_grpc as podresources_grpc
from tests.fakes.kubelet import AdmissionError, ContainerSpec, FakeKubelet, PodRef

RESOURCE = "example.com/widget"


class ToyPlugin(api_pb2_grpc.DevicePluginServicer):
    """Just enough of a device plugin to exercise the kubelet side; prefers the lowest IDs."""

    def __init__(self, plugin_dir: Path, ids: list[str], *, preferred: bool = True, pre_start: bool = False) -> None:
        self.plugin_dir = plugin_dir
        self.health = dict.fromkeys(ids, "Healthy")
        self.options = api_pb2.DevicePluginOptions(
            get_preferred_allocation_available=preferred, pre_start_required=pre_start
        )
        self.updates: queue.Queue[None] = queue.Queue()
        self.allocations: list[list[str]] = []
        self.server: grpc.Server | None = None

    def serve(self, endpoint: str = "toy.sock") -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.plugin_dir / endpoint}")
        self.server.start()
        self.register(endpoint)

    def register(self, endpoint: str, version: str = "v1beta1") -> None:
        with grpc.insecure_channel(f"unix://{self.plugin_dir / 'kubelet.sock'}") as channel:
            api_pb2_grpc.RegistrationStub(channel).Register(
                api_pb2.RegisterRequest(
                    version=version, endpoint=endpoint, resource_name=RESOURCE, options=self.options
                ),
                timeout=5,
            )

    def set_health(self, device: str, health: str) -> None:
        self.health[device] = health
        self.updates.put(None)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)

    def GetDevicePluginOptions(self, request, context):  # type: ignore[no-untyped-def]
        return self.options

    def ListAndWatch(self, request, context) -> Iterator[api_pb2.ListAndWatchResponse]:  # type: ignore[no-untyped-def]
        while context.is_active():
            yield api_pb2.ListAndWatchResponse(
                devices=[api_pb2.Device(ID=i, health=h) for i, h in sorted(self.health.items())]
            )
            while context.is_active():
                try:
                    self.updates.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue

    def GetPreferredAllocation(self, request, context):  # type: ignore[no-untyped-def]
        responses = []
        for r in request.container_requests:
            picked = list(r.must_include_deviceIDs)
            picked += [d for d in sorted(r.available_deviceIDs) if d not in picked][: r.allocation_size - len(picked)]
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=picked))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request, context):  # type: ignore[no-untyped-def]
        responses = []
        for r in request.container_requests:
            self.allocations.append(list(r.devices_ids))
            responses.append(api_pb2.ContainerAllocateResponse(envs={"WIDGETS": ",".join(sorted(r.devices_ids))}))
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):  # type: ignore[no-untyped-def]
        return api_pb2.PreStartContainerResponse()


@pytest.fixture
def kubelet(kubelet_root: Path, plugin_dir: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(kubelet_root, seed=7) as k:
        yield k


def widgets(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def test_registration_dials_back_and_consumes_list_and_watch(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    plugin = ToyPlugin(plugin_dir, widgets(4))
    plugin.serve()
    kubelet.wait_for(RESOURCE, capacity=4)
    assert kubelet.registrations[0].endpoint == "toy.sock"
    assert kubelet.registrations[0].options.get_preferred_allocation_available
    before = kubelet.endpoints[RESOURCE].updates
    plugin.set_health("w1", "Unhealthy")
    kubelet.wait_for_update(RESOURCE, after=before)
    assert kubelet.capacity(RESOURCE) == 3
    assert kubelet.devices(RESOURCE)["w1"] == "Unhealthy"
    plugin.stop()


def test_wrong_version_is_refused(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    plugin = ToyPlugin(plugin_dir, widgets(1))
    with pytest.raises(grpc.RpcError) as info:
        plugin.register("toy.sock", version="v1alpha")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unsupported plugin API version" in (info.value.details() or "")


def test_one_allocate_per_container_steered_by_the_preferred_allocation(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    plugin = ToyPlugin(plugin_dir, widgets(8), pre_start=True)
    plugin.serve()
    kubelet.wait_for(RESOURCE, capacity=8)
    result = kubelet.admit(PodRef("pod-a", "pod-a"), RESOURCE, [ContainerSpec("a", 2), ContainerSpec("b", 3)])
    assert [(r.name, sorted(r.device_ids)) for r in result] == [
        ("a", ["w0", "w1"]),
        ("b", ["w2", "w3", "w4"]),
    ]
    assert result[1].response.envs["WIDGETS"] == "w2,w3,w4"
    names = [name for name, _ in kubelet.calls]
    assert names == ["GetPreferredAllocation", "Allocate", "PreStartContainer"] * 2
    assert plugin.allocations == [["w0", "w1"], ["w2", "w3", "w4"]]
    second = kubelet.admit(PodRef("pod-b", "pod-b"), RESOURCE, [ContainerSpec("c", 3)])
    assert sorted(second[0].device_ids) == ["w5", "w6", "w7"]
    with pytest.raises(AdmissionError, match="Requested: 1, Available: 0"):
        kubelet.admit(PodRef("pod-c", "pod-c"), RESOURCE, [ContainerSpec("d", 1)])
    kubelet.remove_pod("pod-a")
    assert len(kubelet.admit(PodRef("pod-c", "pod-c"), RESOURCE, [ContainerSpec("d", 5)])[0].device_ids) == 5
    plugin.stop()


def test_init_container_devices_are_reused(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    plugin = ToyPlugin(plugin_dir, widgets(4), preferred=False)
    plugin.serve()
    kubelet.wait_for(RESOURCE, capacity=4)
    result = kubelet.admit(PodRef("p", "p"), RESOURCE, [ContainerSpec("app", 3), ContainerSpec("init", 2, init=True)])
    init, app = result
    assert init.name == "init"
    assert set(init.device_ids) <= set(app.device_ids)
    assert len(kubelet.allocated[RESOURCE]["p"]) == 3
    plugin.stop()


def test_without_preference_devices_come_in_arbitrary_order(kubelet_root: Path, plugin_dir: Path) -> None:
    orders = set()
    for seed in range(5):
        with FakeKubelet(kubelet_root, seed=seed) as kubelet:
            plugin = ToyPlugin(plugin_dir, widgets(16), preferred=False)
            plugin.serve(f"toy{seed}.sock")
            kubelet.wait_for(RESOURCE, capacity=16)
            orders.add(tuple(kubelet.admit(PodRef("p", "p"), RESOURCE, [ContainerSpec("a", 4)])[0].device_ids))
            plugin.stop()
    assert len(orders) > 1


def test_restart_deletes_plugin_sockets_and_drops_capacity(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    plugin = ToyPlugin(plugin_dir, widgets(2))
    plugin.serve()
    kubelet.wait_for(RESOURCE, capacity=2)
    kubelet.admit(PodRef("p", "p"), RESOURCE, [ContainerSpec("a", 1)])
    kubelet.restart()
    assert not (plugin_dir / "toy.sock").exists()
    assert kubelet.socket.exists()
    assert kubelet.capacity(RESOURCE) == 0
    plugin.stop()
    plugin.serve()  # what a well-behaved plugin does when its socket vanished
    kubelet.wait_for(RESOURCE, capacity=2)
    assert kubelet.allocated[RESOURCE]["p"]  # allocations survive, as kubelet's checkpoint keeps them
    plugin.stop()


def list_pods(kubelet: FakeKubelet) -> dict[str, dict[str, list[str]]]:
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        response = podresources_grpc.PodResourcesListerStub(channel).List(podresources_pb2.ListPodResourcesRequest())
    return {
        f"{p.namespace}/{p.name}": {c.name: [i for d in c.devices for i in d.device_ids] for c in p.containers}
        for p in response.pod_resources
    }


def test_pod_resources_show_the_pod_under_admission_without_its_devices(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    """What the real kubelet's pod manager shows: each pod is added just before its own admission."""
    seen: list[dict[str, dict[str, list[str]]]] = []

    class Recording(ToyPlugin):
        def Allocate(self, request, context):  # type: ignore[no-untyped-def]
            seen.append(list_pods(kubelet))
            return super().Allocate(request, context)

    plugin = Recording(plugin_dir, widgets(6), preferred=False)
    plugin.serve()
    kubelet.wait_for(RESOURCE, capacity=6)
    kubelet.admit(PodRef("u1", "first"), RESOURCE, [ContainerSpec("a", 1), ContainerSpec("b", 2)])
    kubelet.admit(PodRef("u2", "second"), RESOURCE, [ContainerSpec("c", 1), ContainerSpec("i", 1, init=True)])
    first_a, first_b, second_i, second_c = seen
    assert first_a == {"default/first": {"a": [], "b": []}}
    assert len(first_b["default/first"]["a"]) == 1 and first_b["default/first"]["b"] == []
    assert second_i["default/second"] == {"c": []}  # init containers are not listed
    assert len(second_i["default/first"]["b"]) == 2
    assert second_c["default/second"] == {"c": []}
    assert len(list_pods(kubelet)["default/second"]["c"]) == 1
    with pytest.raises(AdmissionError):
        kubelet.admit(PodRef("u3", "third"), RESOURCE, [ContainerSpec("d", 9)])
    assert list_pods(kubelet)["default/third"] == {"d": []}  # rejected pods stay in the pod manager
    plugin.stop()
