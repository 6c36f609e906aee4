"""The device-plugin gRPC server: speaks kubelet's v1beta1 protocol and nothing else.

What devices exist, which to prefer and what a container gets are decided by a :class:`DeviceManager`;
this module turns its answers into protocol messages and its refusals into gRPC statuses, serves them on
a unix socket only root can open, and registers that socket with the kubelet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from gpushared.core.node.allocate import ContainerAllocation
from gpushared.core.node.devices import Device
from gpushared.kubelet.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushared.kubelet.sockets import serve_root_only

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: kubelet's default gRPC receive limit; a bigger ListAndWatch message is dropped by the kubelet.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class RegistrationFailed(Exception):
    """The kubelet did not take the registration; the message carries the gRPC status."""


class AllocationRefused(Exception):
    """The manager will not give these devices to a container; ``message`` says why, for the pod's events.

    ``retryable`` marks a passing condition (the API server is unreachable) as UNAVAILABLE rather than
    FAILED_PRECONDITION.
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


#: How long an open ListAndWatch stream waits for a change before it looks whether it should end anyway.
WATCH_RECHECK_SECONDS = 30.0


class DeviceManager(Protocol):
    resource_name: str

    def devices(self) -> tuple[int, list[Device]]:
        """(version, devices); the version changes whenever the list does."""
        ...

    def wait_for_change(self, version: int, timeout: float) -> None: ...

    def wake(self) -> None:
        """Return every :meth:`wait_for_change` now."""
        ...

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]: ...

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation: ...


def list_message(devices: Sequence[Device]) -> api_pb2.ListAndWatchResponse:
    """The device list; a device whose GPU's NUMA node is known carries it (kubelet 1.17+ reads it for the
    Topology Manager; older kubelets skip the field)."""
    return api_pb2.ListAndWatchResponse(
        devices=[
            api_pb2.Device(
                ID=d.id,
                health=HEALTHY if d.healthy else UNHEALTHY,
                topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]) if d.numa is not None else None,
            )
            for d in devices
        ]
    )


class _Servicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, manager: DeviceManager, stopping: list[bool]) -> None:
        self.manager = manager
        self.stopping = stopping
        #: Open ListAndWatch streams. Registration alone does not let the kubelet admit pods: it does once it
        #: has read the device list from a stream, so "kubelet is watching" is the readiness that matters.
        self.watchers = 0
        self._lock = threading.Lock()

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        version, devices = self.manager.devices()
        with self._lock:
            self.watchers += 1
        # The stream waits for a change of the device list, and is woken when the kubelet hangs up or the
        # server stops; the timeout is only a safety net (a wake-up every second cost an idle node's CPU).
        context.add_callback(self.manager.wake)
        try:
            yield list_message(devices)
            while context.is_active() and not self.stopping[0]:
                self.manager.wait_for_change(version, timeout=WATCH_RECHECK_SECONDS)
                current, devices = self.manager.devices()
                if current != version:
                    version = current
                    yield list_message(devices)
        finally:
            with self._lock:
                self.watchers -= 1

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        responses = [
            api_pb2.ContainerPreferredAllocationResponse(
                deviceIDs=self.manager.preferred(
                    list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size
                )
            )
            for r in request.container_requests
        ]
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        responses = []
        for container in request.container_requests:
            try:
                given = self.manager.allocate(list(container.devices_ids))
            except AllocationRefused as exc:
                code = grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.FAILED_PRECONDITION
                context.abort(code, exc.message)
            responses.append(
                api_pb2.ContainerAllocateResponse(
                    envs=given.envs,
                    mounts=[
                        api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                        for m in given.mounts
                    ],
                    annotations=given.annotations,
                    devices=[
                        api_pb2.DeviceSpec(
                            container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
                        )
                        for d in given.devices
                    ],
                    cdi_devices=[api_pb2.CDIDevice(name=name) for name in given.cdi_devices],
                )
            )
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class PluginServer:
    """One device plugin on ``plugin_dir/endpoint``; :meth:`start` serves, :meth:`register` tells kubelet."""

    def __init__(self, manager: DeviceManager, *, plugin_dir: Path, endpoint: str) -> None:
        self.manager = manager
        self.plugin_dir = plugin_dir
        self.endpoint = endpoint
        self._server: grpc.Server | None = None
        self._servicer: _Servicer | None = None
        self._stopping = [False]

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def watched(self) -> bool:
        """Whether the kubelet holds a ListAndWatch stream open, i.e. has our devices and can admit pods."""
        return self._servicer is not None and self._servicer.watchers > 0

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        self._stopping = [False]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="device-plugin"),
            options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
        )
        self._servicer = _Servicer(self.manager, self._stopping)
        api_pb2_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        serve_root_only(server, self.socket)  # Allocate hands out GPUs
        self._server = server

    def register(self, *, timeout: float = 5.0) -> None:
        """Register with the kubelet; raises :class:`RegistrationFailed` when it is not there or refuses."""
        request = api_pb2.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.manager.resource_name, options=OPTIONS
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise RegistrationFailed(f"{exc.code()} {exc.details() or ''}".strip()) from exc

    def stop(self) -> None:
        self._stopping[0] = True
        self.manager.wake()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(2.0)
            self._server = None
        self.socket.unlink(missing_ok=True)
