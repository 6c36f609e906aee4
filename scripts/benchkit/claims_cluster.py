"""scripts/bench_claims_cluster.py's cluster: the API as its admin, simulated DRA nodes kept alive, each run's
namespace, its pods and claims created at a rate, and a watch of when each pod was ungated, bound and running.

A simulated node is what kube-scheduler, the node lifecycle controller and the extender see of a gpushared
node in DRA mode, with no kubelet behind it: a Node (Ready, allocatable CPU, memory and pods, the GPU
inventory annotation the extender reads), its ResourceSlice (``core.dra.slices``: the slice the daemon
publishes) and its Lease in kube-node-lease. The kubelet's two heartbeats are kept: the Lease renewed and the
Ready condition posted, each often enough that the node lifecycle controller (``--node-monitor-grace-period``)
never finds the node silent, so it never taints it nor evicts its pods. Pods bound to it never run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import urllib3

from gpushared import contract
from gpushared.contract import GpuInventory, dra
from gpushared.core.dra.slices import slice_body, slice_devices
from gpushared.core.shared.quantity import parse_whole_quantity
from tests.builders import inventory
from tests.e2e.cluster import LocalCluster, wait_for

#: Concurrent requests while creating and deleting objects (and creating the measured pods).
CREATORS = 16
#: Every call's bound: no request may hang the benchmark.
TIMEOUT = urllib3.Timeout(connect=5, read=30)
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
#: The label on everything the benchmark creates cluster-wide, so that it can all be found and removed.
SIMULATED = "bench.gpushared.io/simulated"


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, data: bytes) -> None:
        super().__init__(f"{method} {path}: {status} {data[:300]!r}")
        self.status = status


class Api:
    """Just what the benchmark asks of the API server, as the cluster's admin, on pooled connections."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.server = cluster.server
        self.http = urllib3.PoolManager(maxsize=CREATORS + 4, ca_certs=str(cluster.state / "pki" / "ca.crt"))
        self.headers = {"Authorization": f"Bearer {cluster.tokens['admin']}", "Content-Type": "application/json"}

    def request(self, method: str, path: str, body: Any = None, *, content: str = "", **kw: Any) -> Any:
        headers = {**self.headers, **({"Content-Type": content} if content else {})}
        data = None if body is None else json.dumps(body)
        kw.setdefault("timeout", TIMEOUT)
        answer = self.http.request(method, self.server + path, body=data, headers=headers, **kw)
        if answer.status >= 300:
            raise ApiError(method, path, answer.status, answer.data)
        return answer

    def json(self, method: str, path: str, body: Any = None, *, content: str = "") -> dict[str, Any]:
        return json.loads(self.request(method, path, body, content=content).data)  # type: ignore[no-any-return]

    def gone(self, method: str, path: str) -> None:
        """``method`` (DELETE) on ``path``, a 404 taken as done."""
        try:
            self.request(method, path)
        except ApiError as error:
            if error.status != 404:
                raise

    def each(self, call: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        with ThreadPoolExecutor(CREATORS) as pool:
            return list(pool.map(call, items))


def micro_now() -> str:
    """The API's MicroTime, now (a Lease's ``renewTime``)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_inventory(number: int, gpus: int, gib: int) -> GpuInventory:
    """``gpus`` GPUs of ``gib`` GiB, with UUIDs of their own (every physical GPU's is unique)."""
    base = inventory(*[gib] * gpus)
    return dataclasses.replace(
        base,
        gpus=tuple(
            dataclasses.replace(gpu, uuid=f"GPU-{number:08x}-{gpu.index:04x}-0000-0000-000000000000", model="Bench GPU")
            for gpu in base.gpus
        ),
    )


def node_body(name: str, inv: GpuInventory, kubelet_version: str) -> dict[str, Any]:
    """A Node as a DRA-mode gpushared node's kubelet and daemon leave it: Ready, room for far more pods than a
    run places, the inventory annotation; no gpu-mem capacity (in DRA mode no device plugin runs)."""
    capacity = {"cpu": "96", "memory": "768Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    stamp = now()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", SIMULATED: "true"},
            "annotations": {contract.NODE_INVENTORY: contract.format_inventory(inv)},
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "simulated",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                },
            ],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            "nodeInfo": {"kubeletVersion": kubelet_version, "operatingSystem": "linux", "architecture": "amd64"},
        },
    }


def lease_body(name: str, uid: str, seconds: int) -> dict[str, Any]:
    """The node's Lease, owned by it, as the kubelet writes it."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": "kube-node-lease",
            "labels": {SIMULATED: "true"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}],
        },
        "spec": {"holderIdentity": name, "leaseDurationSeconds": seconds, "renewTime": micro_now()},
    }


class SimulatedNodes:
    """``count`` DRA nodes of ``gpus`` GPUs of ``gib`` GiB, alive from :meth:`create` to :meth:`delete`."""

    def __init__(self, api: Api, *, count: int, gpus: int, gib: int, grace: float, kubelet_version: str) -> None:
        self.api = api
        self.names = [f"sim-{i:04d}" for i in range(count)]
        self.gpus, self.gib = gpus, gib
        self.kubelet_version = kubelet_version
        #: The kubelet renews its Lease every quarter of its 40 s duration; here a quarter of the controller's
        #: grace period (at most 10 s) and the Ready condition posted twice per grace period: a missed beat
        #: or two under load still leaves the node healthy.
        self.renew_every = min(10.0, grace / 4)
        self.status_every = grace / 2
        self.lease_seconds = max(40, round(grace * 2))
        self.beats = {"leases": 0, "statuses": 0, "failed": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def create(self) -> None:
        """Nodes, slices and Leases, then the heartbeats; returns once the node lifecycle controller has lifted
        the not-ready taint the API server puts on every new Node (TaintNodesByCondition)."""
        path = "/api/v1/nodes"
        inventories = {name: node_inventory(i, self.gpus, self.gib) for i, name in enumerate(self.names)}
        created = self.api.each(
            lambda name: self.api.json("POST", path, node_body(name, inventories[name], self.kubelet_version)),
            self.names,
        )
        uids = {body["metadata"]["name"]: body["metadata"]["uid"] for body in created}
        slices = "/apis/resource.k8s.io/v1/resourceslices"

        def publish(name: str) -> None:
            body = slice_body(node=name, node_uid=uids[name], generation=1, devices=slice_devices(inventories[name]))
            body["metadata"]["labels"] = {SIMULATED: "true"}
            self.api.json("POST", slices, body)
            lease = lease_body(name, uids[name], self.lease_seconds)
            self.api.json("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

        self.api.each(publish, self.names)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeats")
        self._thread.start()
        wait_for(lambda: not self.unwell(), timeout=90, what="the simulated nodes Ready and untainted", interval=1)

    def _beat(self) -> None:
        """Each node's Lease every ``renew_every`` and its Ready condition every ``status_every``, the nodes
        spread evenly over the interval (as independent kubelets would be), not all at once."""
        last_status = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            post_status = started - last_status >= self.status_every
            if post_status:
                last_status = started
            for index, name in enumerate(self.names):
                if self._stop.wait(max(0.0, started + index * self.renew_every / len(self.names) - time.monotonic())):
                    return
                try:
                    self.api.request(
                        "PATCH", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
                        {"spec": {"renewTime": micro_now()}}, content=MERGE,
                    )  # fmt: skip
                    self.beats["leases"] += 1
                    if post_status:
                        ready = {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "lastHeartbeatTime": now(),
                        }
                        body = {"status": {"conditions": [ready]}}
                        self.api.request("PATCH", f"/api/v1/nodes/{name}/status", body, content=STRATEGIC)
                        self.beats["statuses"] += 1
                except (ApiError, urllib3.exceptions.HTTPError):
                    self.beats["failed"] += 1  # counted; the next beat tries again
            self._stop.wait(max(0.0, started + self.renew_every - time.monotonic()))

    def unwell(self) -> list[str]:
        """The simulated nodes that are not Ready or carry a taint (the node lifecycle controller's doing)."""
        listed = self.api.json("GET", f"/api/v1/nodes?labelSelector={SIMULATED}%3Dtrue")["items"]
        found = []
        for node in listed:
            ready = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}.get("Ready")
            taints = [t["key"] for t in node["spec"].get("taints") or []]
            if ready != "True" or taints:
                found.append(f"{node['metadata']['name']}: Ready={ready} taints={taints}")
        return found + [f"{name}: missing" for name in set(self.names) - {n["metadata"]["name"] for n in listed}]

    def delete(self) -> None:
        """Heartbeats stopped, then every Lease, slice and Node the benchmark made (found by label, so a run
        that failed half-way is cleaned too), waited for."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        selector = f"labelSelector={SIMULATED}%3Dtrue"
        self.api.gone("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases?{selector}")
        self.api.gone("DELETE", f"/apis/resource.k8s.io/v1/resourceslices?{selector}")
        self.api.gone("DELETE", f"/api/v1/nodes?{selector}")

        def all_gone() -> bool:
            return not any(
                self.api.json("GET", f"{path}?{selector}&limit=1")["items"]
                for path in (
                    "/api/v1/nodes",
                    "/apis/resource.k8s.io/v1/resourceslices",
                    "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                )
            )

        wait_for(all_gone, timeout=60, what="the simulated nodes, slices and Leases deleted", interval=1)


class PodWatch:
    """When each pod of a namespace was first seen ungated, bound (``spec.nodeName``) and running, by this
    process's monotonic clock, from a watch opened before the first pod is created."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.ungated: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.errors = 0
        self._stop = threading.Event()
        listed = api.json("GET", f"/api/v1/namespaces/{namespace}/pods?limit=1")
        self._version = listed["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"watch-{namespace}")
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            path = (
                f"/api/v1/namespaces/{self.namespace}/pods?watch=1&resourceVersion={self._version}"
                "&allowWatchBookmarks=true&timeoutSeconds=60"
            )
            try:
                answer = self.api.request(
                    "GET", path, preload_content=False, timeout=urllib3.Timeout(connect=5, read=90)
                )
                buffer = b""
                for chunk in answer.stream(65536):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    seen = time.monotonic()
                    for line in lines:
                        self._event(json.loads(line), seen)
                    if self._stop.is_set():
                        break
                answer.release_conn()
            except (ApiError, urllib3.exceptions.HTTPError, ValueError):
                self.errors += 1  # opened again from the last version seen
                self._stop.wait(0.5)

    def _event(self, event: dict[str, Any], seen: float) -> None:
        body = event["object"]
        if event["type"] == "ERROR":  # the version is too old: go on from now (times seen later are late)
            self._version = self.api.json("GET", f"/api/v1/namespaces/{self.namespace}/pods?limit=1")["metadata"][
                "resourceVersion"
            ]
            self.errors += 1
            return
        self._version = body["metadata"].get("resourceVersion", self._version)
        if event["type"] not in ("ADDED", "MODIFIED"):
            return
        name = body["metadata"]["name"]
        spec, status = body["spec"], body.get("status") or {}
        if not spec.get("schedulingGates"):
            self.ungated.setdefault(name, seen)
        if spec.get("nodeName"):
            self.bound.setdefault(name, seen)
        if status.get("phase") == "Running":
            self.running.setdefault(name, seen)

    def stop(self) -> None:
        self._stop.set()


#: Keeps the container alive until deleted, leaving at once on SIGTERM.
SLEEP = "trap 'exit 0' TERM; sleep 3600 & wait"


def claim_body(name: str, gib: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": dra.claim_spec(capacity={"memory": f"{gib}Gi"}),
    }


def pod_body(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", SLEEP],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def namespace(api: Api, name: str) -> None:
    api.json("POST", "/api/v1/namespaces", {"metadata": {"name": name}})

    def account() -> bool:
        try:
            api.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except ApiError:
            return False
        return True

    wait_for(account, timeout=30, what=f"the default ServiceAccount of {name}", interval=0.2)


def remove_namespace(api: Api, cluster: LocalCluster, name: str, *, real: bool) -> None:
    """Pods, claims and the namespace gone, waited for. Pods on simulated nodes are deleted at once (no
    kubelet would ever confirm a graceful deletion); the real node's are stopped by its kubelet, and their
    claims unprepared by the daemon, before the next run."""
    base = f"/api/v1/namespaces/{name}"
    api.gone("DELETE", f"{base}/pods?gracePeriodSeconds={1 if real else 0}")
    wait_for(lambda: not api.json("GET", f"{base}/pods?limit=1")["items"], timeout=120, what=f"{name}'s pods gone")
    if real:
        wait_for(lambda: not cluster.node.daemon_status().get("claims"), timeout=60, what="the claims unprepared")
    api.gone("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{name}/resourceclaims")
    api.gone("DELETE", base)
    wait_for(lambda: not exists(api, base), timeout=180, what=f"namespace {name} deleted", interval=0.5)


def exists(api: Api, path: str) -> bool:
    try:
        api.request("GET", path)
    except ApiError as error:
        if error.status == 404:
            return False
        raise
    return True


class Creation:
    """The pods of a run created from ``CREATORS`` threads: at ``rate`` per second, each right after its claim;
    or all at once (``rate`` 0), every claim made first so that the burst is the pods alone. When each pod's
    create was sent (its creation, the admission webhook's time included) and how long the API server took
    to answer it."""

    def __init__(self, api: Api, ns: str, sizes: list[int], rate: float) -> None:
        self.sent: dict[str, float] = {}
        self.admission: list[float] = []
        self.errors: list[str] = []

        def claim(index: int) -> None:
            path = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
            api.json("POST", path, claim_body(f"p{index:05d}", sizes[index]))

        def pod(index: int) -> None:
            name = f"p{index:05d}"
            sent = time.monotonic()
            api.json("POST", f"/api/v1/namespaces/{ns}/pods", pod_body(name, name))
            self.admission.append(time.monotonic() - sent)
            self.sent[name] = sent

        def both(index: int) -> None:
            claim(index)
            pod(index)

        with ThreadPoolExecutor(CREATORS) as pool:
            if not rate:
                self._all([pool.submit(claim, index) for index in range(len(sizes))])
            started = time.monotonic()
            futures = []
            for index in range(len(sizes)):
                if rate:
                    time.sleep(max(0.0, started + index / rate - time.monotonic()))
                futures.append(pool.submit(both if rate else pod, index))
            self._all(futures)
        self.seconds = time.monotonic() - started

    def _all(self, futures: list[Future[None]]) -> None:
        for future in futures:
            try:
                future.result(timeout=60)
            except Exception as error:  # a pod that could not be created is a result, not the end
                self.errors.append(str(error))


def wait_done(times: dict[str, float], want: int, *, timeout: float, stall: float) -> str | None:
    """Until ``want`` pods are in ``times``; the reason if they are not within ``timeout``, or none is added
    for ``stall`` seconds."""
    deadline, seen, last = time.monotonic() + timeout, -1, time.monotonic()
    while len(times) < want:
        now = time.monotonic()
        if len(times) != seen:
            seen, last = len(times), now
        if now > deadline:
            return f"{want - len(times)} of {want} pods not done after {timeout:.0f} s"
        if now - last > stall:
            return f"{want - len(times)} of {want} pods not done, none for {stall:.0f} s"
        time.sleep(0.2)
    return None


def over_capacity(api: Api, ns: str) -> list[str]:
    """Every device whose claims in ``ns`` consume more memory than its slice publishes (none, ever)."""
    sizes = {
        (s["spec"]["pool"]["name"], d["name"]): parse_whole_quantity("memory", d["capacity"]["memory"]["value"])
        for s in api.json("GET", "/apis/resource.k8s.io/v1/resourceslices")["items"]
        for d in s["spec"]["devices"]
    }
    used: dict[tuple[str, str], int] = defaultdict(int)
    for claim in api.json("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")["items"]:
        for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []:
            memory = (result.get("consumedCapacity") or {}).get("memory", "0")
            used[(result["pool"], result["device"])] += parse_whole_quantity("memory", memory)
    return [f"{pool}/{device}: {n} of {sizes.get((pool, device))}" for (pool, device), n in used.items()
            if n > sizes.get((pool, device), 0)]  # fmt: skip
