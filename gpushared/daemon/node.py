"""The daemon's two links outward, kept up by the service loop: its registration with the kubelet, and the
node's GPU inventory on its Node object."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpushared import contract
from gpushared.contract import GpuInventory, ResourceNames
from gpushared.core.shared.bodies import NodeBody, annotations_of, version_of
from gpushared.daemon.errors import FatalError
from gpushared.daemon.metrics import DaemonMetrics
from gpushared.kube.api import Api, KubeError, NotFound
from gpushared.kube.informer import Informer
from gpushared.kubelet.deviceplugin.server import PluginServer, RegistrationFailed

log = logging.getLogger(__name__)


class KubeletLink:
    """Registers the plugin with the kubelet, and again whenever kubelet.sock is new (the kubelet restarted)
    or the plugin's socket is gone (the kubelet deleted it)."""

    def __init__(self, plugin: PluginServer, *, metrics: DaemonMetrics) -> None:
        self.plugin = plugin
        self.metrics = metrics
        self.registered = False
        self._kubelet_inode: int | None = None
        # Looked at every tick: plain strings for os.stat, not a pathlib join each time.
        self._kubelet_path, self._ours_path = str(plugin.kubelet_socket), str(plugin.socket)

    def keep(self) -> None:
        kubelet = self._kubelet_path
        try:
            inode: int | None = os.stat(kubelet).st_ino
        except FileNotFoundError:
            inode = None
        ours_gone = self.registered and not os.path.exists(self._ours_path)
        if self.registered and inode == self._kubelet_inode and not ours_gone:
            return
        if inode is None:
            if self.registered:
                log.warning("kubelet socket %s is gone; waiting for the kubelet", kubelet)
            self.registered = False
            return
        if self.registered:
            log.info("kubelet restarted or our socket vanished: registering again")
        self.plugin.stop()
        self.plugin.start()
        try:
            self.plugin.register()
        except RegistrationFailed as exc:
            log.warning("registration with the kubelet failed: %s", exc)
            self.registered = False
            return
        self.registered = True
        self._kubelet_inode = inode
        self.metrics.registrations.inc()
        log.info("registered %s with the kubelet at %s", self.plugin.manager.resource_name, kubelet)

    @property
    def watched(self) -> bool:
        return self.plugin.watched

    def stop(self) -> None:
        self.plugin.stop()


class NodePublisher:
    """Checks once that the configured node exists, then keeps its inventory annotation and Aliyun's
    gpu-count capacity current, patching only what changed.

    The GPUs' used memory rides in the same annotation, but a change of use alone is written at most once
    per ``usage_seconds`` and only when some GPU's use moved by more than one unit of the node's memory unit:
    on 5,000 nodes that is at most 83 patches a second, and far fewer when use is steady (docs/design.md)."""

    def __init__(
        self,
        api: Api,
        node: str,
        *,
        resources: ResourceNames,
        usage_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: DaemonMetrics | None = None,
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.node = node
        self.resources = resources
        self.usage_seconds = usage_seconds
        self.clock = clock
        self.checked = False
        #: foreign edits of the inventory annotation undone
        self.restored = 0
        self._published: str | None = None
        #: the Node's resourceVersion after this daemon's last write: older events are not news
        self._published_version = 0
        #: set by the watch when someone else changed the annotation since
        self._foreign = threading.Event()
        self._published_count: int | None = None
        #: the use that went out last, GPU index -> MiB, and when
        self._usage: dict[int, int] = {}
        self._usage_at: float | None = None
        #: the last inventory and use written out, and their annotation text
        self._formatted: tuple[tuple[GpuInventory, tuple[tuple[int, int], ...]] | None, str] = (None, "")

    @property
    def published(self) -> bool:
        """Whether the inventory went out and was not refused since."""
        return self._published is not None

    def seen(self, old: NodeBody | None, new: NodeBody | None) -> None:
        """The node as its watch shows it (on the watch's thread). An inventory annotation that is not the
        one this daemon wrote is someone else's edit: the next tick writes ours again. An inflated GPU once
        stayed until the daemon's own next change, and the extender bound a pod there that Allocate then
        refused."""
        published = self._published
        if new is None or published is None or version_of(new) <= self._published_version:
            return  # nothing written yet, or the Node as it was before this daemon's last write
        if annotations_of(new).get(contract.NODE_INVENTORY) != published:
            log.warning(
                "node %s: its GPU inventory annotation was changed by someone else; writing the daemon's again",
                self.node,
            )
            self.restored += 1
            if self.metrics is not None:
                self.metrics.inventory_restored.inc()
            # A flag, not _published = None: a write of the tick's under way would set _published after this
            # and the edit would stay. The next tick writes the inventory again whatever it last wrote.
            self._foreign.set()

    def check(self) -> None:
        """Raises :class:`FatalError` when the node does not exist: the configuration names another machine."""
        if self.checked:
            return
        try:
            self.api.get_node(self.node)
        except NotFound:
            raise FatalError(
                f"node {self.node!r} does not exist in the cluster: set nodeName in the config "
                "to this machine's Node name"
            ) from None
        except KubeError as exc:
            log.warning("cannot check node %s yet: %s", self.node, exc)
            return
        self.checked = True

    def publish(self, inventory: GpuInventory, usage: Mapping[int, int] | None = None) -> None:
        """``usage``: GPU index -> MiB its processes use now (None: not watched)."""
        if not self.checked:
            return
        usage_now = self._usage_due(inventory, usage)
        shown = self._usage if usage_now is None else usage_now
        key = (inventory, tuple(sorted(shown.items())))
        if key != self._formatted[0]:  # written out only when the GPUs or the use shown changed
            published = dataclasses.replace(
                inventory,
                gpus=tuple(dataclasses.replace(gpu, used_mib=shown.get(gpu.index)) for gpu in inventory.gpus),
            )
            self._formatted = (key, contract.format_inventory(published))
        text = self._formatted[1]
        count = len(inventory.gpus)
        patch: dict[str, Any] = {}
        foreign = self._foreign.is_set()
        self._foreign.clear()
        if text != self._published or foreign:
            patch["metadata"] = {"annotations": {contract.NODE_INVENTORY: text}}
        if count != self._published_count:
            patch["status"] = {"capacity": {self.resources.gpu_count: str(count)}}
        if not patch:
            return
        try:
            written = self.api.patch_node_status(self.node, patch)
        except KubeError as exc:
            log.warning("publishing the GPU inventory failed: %s; retrying", exc)
            self._published = None
            return
        self._published, self._published_count = text, count
        self._published_version = version_of(written) if isinstance(written, dict) else 0
        if usage_now is not None:
            self._usage, self._usage_at = usage_now, self.clock()

    def _usage_due(self, inventory: GpuInventory, usage: Mapping[int, int] | None) -> dict[int, int] | None:
        """The use to write now, or None to keep what was written last."""
        if usage is None:
            return None
        if self._usage_at is not None and self.clock() - self._usage_at < self.usage_seconds:
            return None
        step = inventory.unit.mib
        moved = set(usage) != set(self._usage) or any(
            abs(mib - self._usage.get(index, 0)) > step for index, mib in usage.items()
        )
        return dict(usage) if moved else None


def node_watch(api: Api, node: str, publisher: NodePublisher, *, watch_seconds: int = 300) -> Informer[NodeBody]:
    """A watch of this daemon's own Node (``metadata.name``): one object, events only when it changes."""
    return Informer(
        api.rest.lister("/api/v1/nodes", what=f"node {node}"),
        name=f"node {node}",
        handler=publisher.seen,
        field_selector=f"metadata.name={node}",
        watch_seconds=watch_seconds,
    )
