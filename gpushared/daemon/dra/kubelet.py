"""The DRA kubelet plugin's gRPC side: plugin registration and the DRA service, v1 and v1beta1.

How the kubelet finds a DRA driver (kubelet >= 1.34 for v1; 1.32-1.33 speak v1beta1): its plugin watcher
sees a socket appear in ``<kubelet dir>/plugins_registry``, calls ``GetInfo`` there, reads the driver's
name, the DRA service's socket and the service versions offered, picks the newest it speaks and says so
with ``NotifyRegistrationStatus``. It then calls ``NodePrepareResources`` before a pod's containers start
and ``NodeUnprepareResources`` once they have stopped, on ``<kubelet dir>/plugins/<driver>/dra.sock``.

What a claim gets is decided by a :class:`ClaimPreparer`; this module turns its answers into protocol
messages, serves both versions of the service from it (their messages are the same, field for field), and
keeps the two sockets, which only root can open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc

from gpushared.contract import dra
from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.prepare import PreparedClaim
from gpushared.kubelet.dra.v1 import api_pb2 as v1
from gpushared.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpushared.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from gpushared.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpushared.kubelet.pluginregistration.v1 import api_pb2 as registration
from gpushared.kubelet.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from gpushared.kubelet.sockets import serve_root_only

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
#: The services offered, newest first, as the kubelet names them (``<version>.DRAPlugin``).
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
#: The most claims one call may name: the kubelet sends a pod's claims, a pod has at most a few dozen.
MAX_CLAIMS = 256


class ClaimPreparer(Protocol):
    def prepare(
        self, claims: Sequence[ClaimRef], *, deadline: float | None = None
    ) -> Mapping[str, PreparedClaim | str]:
        """Claim UID -> the claim as prepared, or why it cannot be (a message for the pod's events);
        ``deadline``: the caller's, on the monotonic clock (None: it set none)."""
        ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Claim UID -> "" when unprepared (also when it never was), else why not."""
        ...


def _refs(claims: Sequence[Any], context: grpc.ServicerContext) -> list[ClaimRef]:
    """The request's claims, each with namespace, name and UID (the kubelet always sends all three)."""
    if len(claims) > MAX_CLAIMS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(claims)} claims in one call; at most {MAX_CLAIMS}")
    refs = []
    for claim in claims:
        if not (claim.namespace and claim.name and claim.uid):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"claim {claim.namespace!r}/{claim.name!r} (UID {claim.uid!r}): namespace, name and UID are required",
            )
        if not dra.is_claim_uid(claim.uid):  # it names the claim's CDI spec file: never a path
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"claim UID {claim.uid[:80]!r} is not a Kubernetes UID")
        refs.append(ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid))
    return refs


class _Service:
    """Both versions' servicer: ``pb`` is the version's message module."""

    def __init__(self, preparer: ClaimPreparer, pb: Any) -> None:
        self.preparer = preparer
        self.pb = pb

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _refs(request.claims, context)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        answers = self.preparer.prepare(refs, deadline=deadline)
        claims = {}
        for ref in refs:
            answer = answers.get(ref.uid, f"claim {ref.key} was not prepared")
            if isinstance(answer, str):
                claims[ref.uid] = self.pb.NodePrepareResourceResponse(error=answer)
                continue
            claims[ref.uid] = self.pb.NodePrepareResourceResponse(
                devices=[
                    self.pb.Device(
                        request_names=[d.request],
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_device_ids),
                    )
                    for d in answer.devices
                ]
            )
        return self.pb.NodePrepareResourcesResponse(claims=claims)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        refs = _refs(request.claims, context)
        errors = self.preparer.unprepare(refs)
        return self.pb.NodeUnprepareResourcesResponse(
            claims={ref.uid: self.pb.NodeUnprepareResourceResponse(error=errors.get(ref.uid, "")) for ref in refs}
        )


class _V1(_Service, v1_grpc.DRAPluginServicer):
    pass


class _V1beta1(_Service, v1beta1_grpc.DRAPluginServicer):
    pass


class _Registration(registration_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPluginServer) -> None:
        self.plugin = plugin

    def GetInfo(self, request: registration.InfoRequest, context: grpc.ServicerContext) -> registration.PluginInfo:
        return registration.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.plugin.driver,
            endpoint=str(self.plugin.socket),
            supported_versions=list(SUPPORTED_SERVICES),
        )

    def NotifyRegistrationStatus(
        self, request: registration.RegistrationStatus, context: grpc.ServicerContext
    ) -> registration.RegistrationStatusResponse:
        self.plugin.notified(request.plugin_registered, request.error)
        return registration.RegistrationStatusResponse()


class DraPluginServer:
    """The driver's two sockets under ``kubelet_dir``; :meth:`start` serves both, :meth:`keep` re-creates
    them where someone removed them."""

    def __init__(self, preparer: ClaimPreparer, *, driver: str, kubelet_dir: Path) -> None:
        self.preparer = preparer
        self.driver = driver
        self.kubelet_dir = kubelet_dir
        self._servers: list[grpc.Server] = []
        self._lock = threading.Lock()
        self._registered = False
        #: how often the kubelet said it took the plugin (it does again after its own restart)
        self.registrations = 0

    @property
    def socket(self) -> Path:
        """The DRA service's socket, as the kubelet dials it."""
        return self.kubelet_dir / "plugins" / self.driver / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.driver}-reg.sock"

    @property
    def registered(self) -> bool:
        """Whether the kubelet said it took the plugin, and its socket is still there to be found."""
        return self._registered and self.registration_socket.exists()

    def notified(self, registered: bool, error: str) -> None:
        with self._lock:
            self._registered = registered
            self.registrations += registered
        if registered:
            log.info("the kubelet registered DRA driver %s", self.driver)
        else:
            log.error("the kubelet refused DRA driver %s: %s", self.driver, error)

    def start(self) -> None:
        service = _serve(self.socket, workers=8, name="dra")
        v1_grpc.add_DRAPluginServicer_to_server(_V1(self.preparer, v1), service)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_V1beta1(self.preparer, v1beta1), service)
        # The registration socket last: the kubelet dials the service as soon as it has read GetInfo.
        registrar = _serve(self.registration_socket, workers=2, name="dra-registration")
        registration_grpc.add_RegistrationServicer_to_server(_Registration(self), registrar)
        for server, path in ((service, self.socket), (registrar, self.registration_socket)):
            serve_root_only(server, path)
        self._servers = [service, registrar]

    def keep(self) -> None:
        """Serve again when a socket was removed (a kubelet's cleanup, an operator): without its
        registration socket the kubelet cannot find the driver again after its own restart."""
        if self._servers and self.socket.exists() and self.registration_socket.exists():
            return
        log.warning("DRA plugin sockets missing; serving them again")
        self.stop()
        self._registered = False
        self.start()

    def stop(self) -> None:
        for server in self._servers:
            server.stop(grace=1.0).wait(2.0)
        self._servers = []
        self.registration_socket.unlink(missing_ok=True)
        self.socket.unlink(missing_ok=True)


def _serve(path: Path, *, workers: int, name: str) -> grpc.Server:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name))
