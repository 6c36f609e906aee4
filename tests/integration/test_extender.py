"""The extender as a process: kube-scheduler's verbs over HTTP, the cache, bind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpushared import contract
from gpushared.core.placement.binding import bind_annotations
from gpushared.core.shared.requests import pod_request
from tests.builders import GPU_COUNT, GPU_MEM, container, on_gpus, pod
from tests.extender_harness import Extender, gpu_node, gpushared_cluster
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.fakes.topologies import layout_inventory
from tests.harness import wait_until


def created(api: FakeApiServer, name: str, *amounts: int, **kw: Any) -> dict[str, Any]:
    return api.create(pod(name, *amounts, **kw))


def container_state(**state: Any) -> dict[str, Any]:
    return {
        "containerStatuses": [
            {"name": "c0", "image": "busybox", "imageID": "", "ready": False, "restartCount": 0, "state": state}
        ]
    }


def test_filter_reasons_a_person_understands(api: FakeApiServer, extender: Extender) -> None:
    """A pod that fits nowhere gets each node's reason, which kube-scheduler puts in its FailedScheduling
    event; a pod that fits somewhere gets none (kube-scheduler would decode them and drop them)."""
    body = created(api, "p", 10)
    status, result = extender.filter(body, "n1", "aliyun-node", "cpu-node", "ghost")
    assert status == 200
    assert result["NodeNames"] == ["n1"]
    assert result["Nodes"] is None
    assert result["Error"] == ""
    assert result["FailedNodes"] == result["FailedAndUnresolvableNodes"] == {}
    status, result = extender.filter(body, "aliyun-node", "cpu-node", "ghost")
    assert status == 200
    assert result["NodeNames"] == []
    assert result["FailedAndUnresolvableNodes"] == {}
    assert result["FailedNodes"] == {
        "aliyun-node": "no usable GPU has 10 GiB free",
        "cpu-node": "node cpu-node is not a gpushared node (no GPU inventory and no aliyun.com/gpu-mem capacity)",
        "ghost": "node ghost is not in the extender's cache (unknown node)",
    }
    # A node with no GPU the pod may use at all says what is wrong with each.
    mps = created(api, "m", 4, annotations={contract.POD_MPS: "true"})
    _, result = extender.filter(mps, "n1")
    assert result["FailedNodes"] == {"n1": "GPU 0 runs no MPS server; GPU 1 runs no MPS server"}


def test_a_pod_on_several_gpus_is_filtered_prioritized_and_bound_as_one(
    api: FakeApiServer, binpack_extender: Extender
) -> None:
    """gpu-count: the pod needs its share free on each of that many GPUs of one node, on a node whose device
    plugin can give a container several GPUs (not Aliyun's), and is bound with all of them in its allocation."""
    extender = binpack_extender  # best fit is what these hold it to
    api.create(gpu_node("n4", 16, 16, 16, 16, address="10.0.0.4"))
    nodes = ("n1", "aliyun-node", "cpu-node", "n4")
    pair = api.create(on_gpus(pod("pair", 16), 2))  # 8 GiB on each of two GPUs
    # Both n1 and n4 fit; filter keeps the one best fit ranks first (on n1 the pair leaves 8 + 0 GiB, on n4
    # 8 + 8).
    wait_until(lambda: extender.filter(pair, "n4")[1]["NodeNames"] == ["n4"], message="n4 watched")
    _, result = extender.filter(pair, *nodes)
    assert result["NodeNames"] == ["n1"]
    assert result["FailedNodes"] == {}
    _, result = extender.filter(pair, "aliyun-node", "cpu-node")
    assert result["FailedNodes"] == {
        "aliyun-node": "node aliyun-node runs Aliyun's device plugin, which gives a container one GPU, not 2",
        "cpu-node": "node cpu-node is not a gpushared node (no GPU inventory and no aliyun.com/gpu-mem capacity)",
    }
    wide = api.create(on_gpus(pod("wide", 32), 2))  # 16 GiB on each of two GPUs: only n4 has two such
    _, result = extender.filter(wide, "n1", "n4")
    assert result["NodeNames"] == ["n4"]
    _, result = extender.filter(wide, "n1")
    assert result["FailedNodes"] == {"n1": "fewer than 2 usable GPUs have 16 GiB free each"}
    # Best fit: on n1 the pair leaves 8 + 0 GiB, on n4 8 + 8.
    _, scores = extender.post("prioritize", {"Pod": pair, "NodeNames": ["n1", "n4"]})
    assert scores == [{"Host": "n1", "Score": 10}, {"Host": "n4", "Score": 0}]
    assert extender.bind(pair, "n1") == (200, {"Error": ""})
    annotations = api.get("pods", "pair", "default")["metadata"]["annotations"]  # type: ignore[index]
    assert contract.ALIYUN_GPU_MEM_IDX not in annotations  # Aliyun's annotations name one GPU
    allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
    assert [(s.index, s.amount) for s in allocation.containers[0].gpus] == [(1, 8), (0, 8)]
    _, inspect = extender.inspect("n1")
    assert [d["usedGPU"] for d in inspect["nodes"][0]["devs"]] == [8, 8]
    # A pod that asks for GPUs without the memory on them gets the reason, not a node.
    bare = api.create(
        {**pod("bare"), "spec": {"containers": [{**container("c0"), "resources": {"limits": {GPU_COUNT: "2"}}}]}}
    )
    _, result = extender.filter(bare, "n4")
    assert (
        result["NodeNames"] == []
        and "GPUs are given with GPU memory: ask for aliyun.com/gpu-mem too" in result["Error"]
    )


def test_a_pod_on_several_gpus_goes_to_the_better_linked_node_and_its_best_linked_gpus(
    api: FakeApiServer, binpack_extender: Extender
) -> None:
    """Two nodes whose daemons published links: a DGX-1 with GPUs 1, 2, 5 and 6 full, and a 2-socket PCIe
    server with four GPUs at 12 of 16 GiB. Best fit alone would take the PCIe node, whose best pair meets at
    a PCIe switch (PIX); on the DGX-1 an NVLink pair is left (0-3: NV2), so prioritize puts the DGX-1 first
    and bind gives the pair GPUs 0 and 3."""
    extender = binpack_extender  # best fit is what these hold it to
    dgx = layout_inventory("dgx1")
    api.create(gpu_node("dgx", inv=dgx, address="10.0.0.8"))
    pcie = layout_inventory("pcie-2-socket")
    api.create(gpu_node("pcie", inv=pcie, address="10.0.0.9"))
    for i, gpu in enumerate((1, 2, 5, 6)):
        held = pod(f"full-{i}", 16, node="dgx")
        held["metadata"]["annotations"] = bind_annotations(
            pod_request(held), [dgx.gpus[gpu]], unit=contract.MemoryUnit.GIB, now_ns=1
        )
        api.create(held)
    for i, gpu in enumerate((0, 2, 3, 4)):  # the PCIe node fuller still: 12 of 16 GiB on four GPUs
        held = pod(f"pcie-{i}", 12, node="pcie")
        held["metadata"]["annotations"] = bind_annotations(
            pod_request(held), [pcie.gpus[gpu]], unit=contract.MemoryUnit.GIB, now_ns=1
        )
        api.create(held)
    pair = api.create(on_gpus(pod("pair", 8), 2))  # 4 GiB on each of two GPUs

    def used(node: str) -> int:
        nodes = extender.inspect(node)[1].get("nodes") or [{"devs": []}]  # none before the node is watched
        return sum(dev["usedGPU"] for dev in nodes[0]["devs"])

    wait_until(lambda: (used("dgx"), used("pcie")) == (64, 48), message="the held pods watched")
    assert extender.filter(pair, "dgx", "pcie")[1]["NodeNames"] == ["dgx"]  # the better-linked node alone
    _, scores = extender.post("prioritize", {"Pod": pair, "NodeNames": ["dgx", "pcie"]})
    assert scores == [{"Host": "dgx", "Score": 10}, {"Host": "pcie", "Score": 0}]
    assert extender.bind(pair, "dgx") == (200, {"Error": ""})
    annotations = api.get("pods", "pair", "default")["metadata"]["annotations"]  # type: ignore[index]
    allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
    assert sorted(s.index for s in allocation.containers[0].gpus) == [0, 3]
    # A one-GPU pod is placed by best fit alone, links or not: the PCIe node's 4 GiB left fits it exactly.
    one = api.create(pod("one", 4))
    _, scores = extender.post("prioritize", {"Pod": one, "NodeNames": ["dgx", "pcie"]})
    assert scores == [{"Host": "dgx", "Score": 0}, {"Host": "pcie", "Score": 10}]


def test_keys_in_any_case_and_full_nodes_come_back_as_nodes(api: FakeApiServer, extender: Extender) -> None:
    body = created(api, "p", 4)
    nodes = {"items": [api.get("nodes", "n1"), api.get("nodes", "cpu-node")]}
    status, result = extender.post("filter", {"pod": body, "nodes": nodes})
    assert status == 200
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1"]
    assert result["NodeNames"] is None
    assert set(result) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


def test_prioritize_scores_by_policy(api: FakeApiServer, binpack_extender: Extender) -> None:
    extender = binpack_extender  # best fit is what these hold it to
    body = created(api, "p", 8)
    status, result = extender.post("prioritize", {"Pod": body, "NodeNames": ["n1", "aliyun-node", "cpu-node"]})
    assert status == 200
    # binpack prices a node by what it would have left: aliyun-node (2 x 8 GiB) 8 GiB, one of its GPUs;
    # n1 (16 + 8 GiB) 16 GiB, more than one of its GPUs. The fuller node is the cheapest.
    assert result == [
        {"Host": "n1", "Score": 0},
        {"Host": "aliyun-node", "Score": 10},
        {"Host": "cpu-node", "Score": 0},
    ]
    small = created(api, "q", 4)
    _, result = extender.post("prioritize", {"Pod": small, "NodeNames": ["n1", "aliyun-node"]})
    assert result == [{"Host": "n1", "Score": 0}, {"Host": "aliyun-node", "Score": 10}]
    # 12 GiB fit only n1's 16 GiB GPU: n1 is the cheapest, nodes it does not fit get 0.
    big = created(api, "r", 12)
    _, result = extender.post("prioritize", {"Pod": big, "NodeNames": ["n1", "aliyun-node", "cpu-node"]})
    assert [r["Score"] for r in result] == [10, 0, 0]


@pytest.mark.parametrize("policy", ["binpack", "fgd", "spread"])
def test_rank_in_filter_keeps_exactly_the_nodes_prioritize_scores_highest(
    spawn: Callable[..., Extender], policy: str
) -> None:
    """With --rank-in-filter the filter keeps the nodes prioritize would give the top score, and only
    those, so a kube-scheduler wired without prioritizeVerb makes the same choice with one call fewer."""
    with FakeApiServer() as api:
        gpushared_cluster(api)
        api.create(gpu_node("n2", 16, 16))
        api.create(gpu_node("n3", 8, 8, 8, 8))
        api.create(pod("running", 12, node="n2", phase="Running"))
        extender = spawn(api, args=["--rank-in-filter", "--policy", policy])
        extender.wait_ready()
        names = ["n1", "n2", "n3", "aliyun-node", "cpu-node", "ghost"]
        for i, amount in enumerate((2, 4, 8, 12, 16)):
            body = created(api, f"p{i}", amount)
            status, result = extender.filter(body, *names)
            assert status == 200
            kept = result["NodeNames"]
            assert kept and result["FailedNodes"] == {}, (amount, result)
            fitting = [name for name in names if extender.filter(body, name)[1]["NodeNames"]]
            _, scores = extender.post("prioritize", {"Pod": body, "NodeNames": fitting})
            assert sorted(kept) == sorted(s["Host"] for s in scores if s["Score"] == 10), (amount, scores)
            _, result = extender.filter(body, "cpu-node", "ghost")
            assert result["FailedNodes"]["cpu-node"].startswith("node cpu-node is not a gpushared node")
            assert result["FailedNodes"]["ghost"].startswith("node ghost is not in the extender's cache")


def test_fgd_weighs_the_cpu_the_watch_shows_on_each_node(spawn: Callable[..., Extender]) -> None:
    """Two nodes where a 12 GiB pod leaves the same 4 GiB free; on "short" it also leaves too little CPU for
    the pods that run in this cluster (3 CPUs, 4 GiB), stranding those 4 GiB. The extender learns both
    from the watch: nodes' allocatable CPU and the running pods' requests."""
    with FakeApiServer() as api:
        api.create(gpu_node("short", 16, cpu="5"))
        api.create(gpu_node("ample", 16, cpu="16"))
        api.create(gpu_node("busy", 16, 16, cpu="64"))
        for i in range(3):
            api.create(pod(f"run-{i}", 4, node="busy", cpu="3", phase="Running"))
        fgd = spawn(api, args=["--policy", "fgd"])
        fgd.wait_ready()
        pending = created(api, "p", 12, cpu="3")
        status, result = fgd.post("prioritize", {"Pod": pending, "NodeNames": ["short", "ample"]})
        assert status == 200
        assert result == [{"Host": "short", "Score": 0}, {"Host": "ample", "Score": 10}]
        # A pod without GPU takes 12 of ample's CPUs: now the 12 GiB pod would strand the GPU memory there.
        api.create(pod("cpu-hog", node="ample", cpu="12", phase="Running"))
        wait_until(
            lambda: (
                [r["Score"] for r in fgd.post("prioritize", {"Pod": pending, "NodeNames": ["short", "ample"]})[1]]
                == [10, 9]
            ),
            message="prioritize sees ample's CPU taken",
        )
        assert fgd.bind(pending, "short") == (200, {"Error": ""})
        assert api.get("pods", "p", namespace="default")["spec"]["nodeName"] == "short"


def test_pods_without_gpu_are_steered_off_free_gpu_memory(api: FakeApiServer, extender: Extender) -> None:
    names = ["n1", "aliyun-node", "cpu-node", "ghost"]
    cpu_only = api.create({**pod("cpu-only"), "spec": {"containers": [container("c0")]}})
    status, result = extender.post("prioritize-no-gpu", {"Pod": cpu_only, "NodeNames": names})
    assert status == 200
    # Free GPU memory: n1 24 GiB, aliyun-node 16 GiB, none on the nodes without (known) GPUs.
    assert result == [
        {"Host": "n1", "Score": 0},
        {"Host": "aliyun-node", "Score": 3},
        {"Host": "cpu-node", "Score": 10},
        {"Host": "ghost", "Score": 10},
    ]
    status, result = extender.bind(created(api, "big", 16), "n1")
    assert (status, result) == (200, {"Error": ""})
    _, result = extender.post("prioritize-no-gpu", {"Pod": cpu_only, "NodeNames": names[:2]})
    assert result == [{"Host": "n1", "Score": 10}, {"Host": "aliyun-node", "Score": 0}]  # 8 GiB left vs 16
    # kube-scheduler sends every pod here; those that ask for GPU memory are prioritize's to score.
    _, result = extender.post("prioritize-no-gpu", {"Pod": created(api, "gpu", 4), "NodeNames": names})
    assert [r["Score"] for r in result] == [0, 0, 0, 0]
    status, result = extender.post("prioritize-no-gpu", {"Pod": {"metadata": {}}, "NodeNames": [1]})
    assert (status, result) == (400, {"Error": "prioritize-no-gpu: 'NodeNames' must be a list of node names"})


def test_bind_writes_the_annotations_and_the_binding(api: FakeApiServer, extender: Extender) -> None:
    init = [{"name": "warm", "image": "busybox", "resources": {"limits": {GPU_MEM: "6"}}}]
    body = created(api, "p", 3, 2, init=init)
    status, result = extender.bind(body, "n1")
    assert (status, result) == (200, {"Error": ""})
    bound = api.get("pods", "p", "default")
    assert bound["spec"]["nodeName"] == "n1"  # type: ignore[index]
    annotations = bound["metadata"]["annotations"]  # type: ignore[index]
    assert annotations[contract.ALIYUN_GPU_MEM_IDX] == "1"  # best fit: the 8 GiB GPU
    assert annotations[contract.ALIYUN_GPU_MEM_DEV] == "8"
    assert annotations[contract.ALIYUN_GPU_MEM_POD] == "6"
    assert annotations[contract.ALIYUN_GPU_MEM_ASSIGNED] == "false"
    allocation = contract.parse_allocation(annotations[contract.POD_ALLOCATION])
    assert [(c.name, c.gpus[0].index, c.gpus[0].amount) for c in allocation.containers] == [
        ("warm", 1, 6),
        ("c0", 1, 3),
        ("c1", 1, 2),
    ]
    _, inspect = extender.inspect("n1")
    assert inspect["nodes"][0]["devs"][1]["usedGPU"] == 6
    # The next pod sees the reservation at once, before any watch event could have carried it.
    status, result = extender.filter(created(api, "q", 3), "n1")
    assert result["NodeNames"] == ["n1"]
    status, result = extender.bind(api.get("pods", "q", "default"), "n1")  # type: ignore[arg-type]
    assert result == {"Error": ""}
    assert api.get("pods", "q", "default")["metadata"]["annotations"][contract.ALIYUN_GPU_MEM_IDX] == "0"  # type: ignore[index]


def test_bind_that_does_not_fit_is_refused_with_the_reason(api: FakeApiServer, extender: Extender) -> None:
    body = created(api, "big", 20)
    status, result = extender.bind(body, "n1")
    assert status == 200
    assert result["Error"] == (
        "pod default/big: it does not fit node n1: GPU 0 has 16 GiB free, pod needs 20 GiB; "
        "GPU 1 has 8 GiB free, pod needs 20 GiB"
    )
    assert api.get("pods", "big", "default")["spec"].get("nodeName") is None  # type: ignore[index]


def test_a_failed_binding_leaves_nothing_and_releases_the_reservation(api: FakeApiServer, extender: Extender) -> None:
    body = created(api, "p", 8)
    api.inject(Fault(method="POST", path=r"/pods/p/binding$", status=422, message="refused"))
    _, result = extender.bind(body, "n1")
    assert "binding to node n1 failed" in result["Error"]
    assert api.get("pods", "p", "default")["spec"].get("nodeName") is None  # type: ignore[index]
    annotations = api.get("pods", "p", "default")["metadata"]["annotations"]  # type: ignore[index]
    assert contract.POD_ALLOCATION not in annotations
    assert contract.ALIYUN_GPU_MEM_IDX not in annotations
    _, inspect = extender.inspect("n1")
    assert [d["usedGPU"] for d in inspect["nodes"][0]["devs"]] == [0, 0]
    _, result = extender.bind(api.get("pods", "p", "default"), "n1")  # type: ignore[arg-type]
    assert result == {"Error": ""}


def test_a_terminating_pod_holds_its_memory_until_its_containers_stop(api: FakeApiServer, extender: Extender) -> None:
    body = created(api, "old", 10)  # only GPU 0 (16 GiB) takes it
    assert extender.bind(body, "n1")[1] == {"Error": ""}
    big = created(api, "new", 16)
    from kubernetes import client

    core = client.CoreV1Api(api.client())
    core.patch_namespaced_pod_status("old", "default", {"status": {"phase": "Running", **container_state(running={})}})
    core.delete_namespaced_pod("old", "default")  # graceful: deletionTimestamp set, containers still running
    wait_until(lambda: api.get("pods", "old", "default")["metadata"].get("deletionTimestamp"), message="terminating")  # type: ignore[index]
    _, result = extender.filter(big, "n1")
    assert result["FailedNodes"]["n1"] == "no usable GPU has 16 GiB free"
    core.patch_namespaced_pod_status("old", "default", {"status": container_state(terminated={"exitCode": 0})})
    wait_until(lambda: extender.filter(big, "n1")[1]["NodeNames"] == ["n1"], message="freed once stopped")


def test_gpu_count_changes_are_picked_up(api: FakeApiServer, extender: Extender) -> None:
    from kubernetes import client

    core = client.CoreV1Api(api.client())
    new = gpu_node("n1", 16, 8, 40)
    core.patch_node("n1", {"metadata": {"annotations": new["metadata"]["annotations"]}})
    wait_until(lambda: len(extender.inspect("n1")[1]["nodes"][0]["devs"]) == 3, message="third GPU")
    _, result = extender.filter(created(api, "p", 30), "n1")
    assert result["NodeNames"] == ["n1"]


def test_a_restart_rebuilds_the_same_state_from_annotations(
    api: FakeApiServer, extender: Extender, spawn: Callable[..., Extender]
) -> None:
    for i, amount in enumerate((4, 6, 3)):
        assert extender.bind(created(api, f"p{i}", amount), "n1")[1] == {"Error": ""}
    _, before = extender.inspect()
    extender.stop()
    again = spawn(api, name="again")
    again.wait_ready()
    _, after = again.inspect()
    assert after == before
    again.stop()


def test_not_ready_until_synced_and_no_verbs_before(api: FakeApiServer, spawn: Callable[..., Extender]) -> None:
    outage = api.inject(Fault(status=503, times=None))
    ext = spawn(api)
    wait_until(lambda: ext.get("/healthz")[0] == 200, message="serving")
    assert ext.get("/readyz") == (503, b"the cache has not synced with the API server yet\n")
    status, result = ext.filter(pod("p", 1), "n1")
    assert status == 503
    assert "not synced" in result["Error"]
    api.faults.remove(outage)
    ext.wait_ready()
    assert ext.filter(api.create(pod("p", 1)), "n1")[1]["NodeNames"] == ["n1"]
    ext.stop()


def test_bind_is_one_write_the_binding_with_the_choice(api: FakeApiServer, extender: Extender) -> None:
    body = created(api, "p", 4)
    before = len(api.requests)
    assert extender.bind(body, "n1")[1] == {"Error": ""}
    writes = [(r.method, r.path) for r in api.requests[before:] if r.method != "GET"]
    assert writes == [("POST", "/api/v1/namespaces/default/pods/p/binding")]
    bound = api.get("pods", "p", "default")
    assert bound["spec"]["nodeName"] == "n1"  # type: ignore[index]
    assert contract.POD_ALLOCATION in bound["metadata"]["annotations"]  # type: ignore[index]


def test_the_synced_cache_is_kept_out_of_the_garbage_collectors_walks(extender: Extender) -> None:
    wait_until(lambda: "kept out of the garbage collector's walks" in extender.log(), timeout=10)


def test_poisoned_annotations_neither_fail_the_verbs_nor_free_memory(
    api: FakeApiServer, extender: Extender, spawn: Callable[..., Extender]
) -> None:
    """Defect (issue #39): a 9,000-digit mps-active-thread-percentage made filter and prioritize answer 500;
    a bound pod with a 5,000-digit ALIYUN_COM_GPU_MEM_IDX stopped a restarted extender's ledger rebuild at
    that pod, forgetting the pods after it, and other pods were bound onto full GPUs (20/16 GiB)."""
    poisoned = created(api, "poisoned", 4, annotations={contract.POD_MPS_THREAD_PERCENTAGE: "9" * 9000})
    for verb in ("filter", "prioritize"):
        status, result = extender.post(verb, {"Pod": poisoned, "NodeNames": ["n1"], "Nodes": None})
        assert status == 200, result
    assert "mps-active-thread-percentage" in extender.filter(poisoned, "n1")[1]["Error"]
    # n1's GPU 0 (16 GiB): 12 GiB bound by the extender, 4 by a pod created bound with a poisoned index.
    assert extender.bind(created(api, "fill", 12), "n1")[1] == {"Error": ""}
    _, inspected = extender.inspect("n1")
    gpu = next(d for d in inspected["nodes"][0]["devs"] if d["usedGPU"] == 12)
    bound = pod("bound-poison", 4, node="n1", annotations={contract.ALIYUN_GPU_MEM_IDX: "1" * 5000})
    api.create(bound)
    extender.stop()
    again = spawn(api, name="again")
    again.wait_ready()
    _, after = again.inspect("n1")
    assert next(d for d in after["nodes"][0]["devs"] if d["id"] == gpu["id"])["usedGPU"] == 12
    assert after["nodes"][0]["usedGPU"] == 16  # the poisoned pod's 4 GiB held on the node, on no GPU
    assert "gpushared_extender_unreadable_pods 1.0" in again.get("/metrics")[1].decode()
    again.stop()
