"""The node's ResourceSlice: published from the GPUs as they are, and withdrawn when the driver leaves a
node (the DRA driver's slice publisher)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpushared.contract import GpuInventory, dra
from gpushared.core.dra.slices import pool_generation, slice_body, slice_devices, slice_name
from gpushared.kube.errors import Conflict, KubeError, NotFound
from gpushared.kube.resources import ResourceApi

log = logging.getLogger(__name__)

#: After a failed publication, the next try waits this long (the loop ticks every second).
RETRY_SECONDS = 5.0
#: How often the published slice is looked at (and written again if it is gone or not ours any more).
VERIFY_SECONDS = 30.0

#: How long one NodePrepareResources call may spend reading its claims, retries included: the kubelet gives
#: the whole call 45 s, and what is left after the reads decides, writes and answers.


class SlicePublisher:
    """The node's one ResourceSlice, kept equal to its healthy GPUs."""

    def __init__(
        self, api: ResourceApi, *, node: str, node_uid: Callable[[], str | None], driver: str = dra.DRIVER
    ) -> None:
        self.api = api
        self.node = node
        self.node_uid = node_uid
        self.driver = driver
        self._published: list[dict[str, Any]] | None = None
        self._retry_at = 0.0
        self._verify_at = 0.0
        self._inventory: GpuInventory | None = None
        self._devices: list[dict[str, Any]] = []
        self.generation = 0

    @property
    def published(self) -> bool:
        return self._published is not None

    def verify_soon(self) -> None:
        """Look at the slice at the next publish: the kubelet deletes the slices of a driver it has no plugin
        for (on its restart, or a while after a plugin's socket went away), and registers the plugin again."""
        self._verify_at = 0.0

    def publish(self, inventory: GpuInventory) -> None:
        """Write the slice when the devices differ from what was last written, and look at it every
        ``VERIFY_SECONDS`` (one list call) to write it again where someone deleted or changed it; errors
        are retried later."""
        if inventory != self._inventory:  # the devices are worked out again only when the GPUs changed
            self._inventory, self._devices = inventory, slice_devices(inventory)
        devices = self._devices
        now = time.monotonic()
        if (devices == self._published and now < self._verify_at) or now < self._retry_at:
            return
        try:
            self._write(devices)
        except KubeError as exc:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            log.warning("ResourceSlice of node %s not published (%s); trying again", self.node, exc)
            return
        self._published = devices
        self._verify_at = now + VERIFY_SECONDS

    def _write(self, devices: list[dict[str, Any]]) -> None:
        existing = self.api.list_slices(node=self.node, driver=self.driver)
        generation, changed = pool_generation(existing, devices)
        name = slice_name(self.node, self.driver)
        if changed:
            body = slice_body(
                node=self.node, node_uid=self.node_uid(), generation=generation, devices=devices, driver=self.driver
            )
            mine = next((s for s in existing if s["metadata"]["name"] == name), None)
            if mine is None:
                self.api.create_slice(body)
            else:
                body["metadata"]["resourceVersion"] = mine["metadata"].get("resourceVersion")
                try:
                    self.api.replace_slice(body)
                except (Conflict, NotFound):
                    self._published = None
                    raise
            log.info("published ResourceSlice %s: %d GPUs, pool generation %d", name, len(devices), generation)
        # Slices of this node and driver under other names are from an older layout: the pool is one slice.
        for other in existing:
            if other["metadata"]["name"] != name:
                self.api.delete_slice(other["metadata"]["name"])
        self.generation = generation


def withdraw_stale(api: ResourceApi, *, node: str, driver: str) -> None:
    """A node in device-plugin mode deletes the slice it published in DRA mode, if any: a slice left behind
    would have the scheduler allocate claims that nothing on the node prepares. Best effort, once at start:
    clusters without DRA (404) and identities without its RBAC (403) have none to delete."""
    try:
        stale = api.list_slices(node=node, driver=driver)
        for body in stale:
            api.delete_slice(body["metadata"]["name"])
            log.warning("deleted ResourceSlice %s: this node is in device-plugin mode now", body["metadata"]["name"])
    except KubeError as exc:
        log.debug("no stale ResourceSlice looked for: %s", exc)
