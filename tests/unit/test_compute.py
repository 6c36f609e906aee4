"""Compute shares: what a pod's compute annotations mean, what the bind records, what the ledger holds."""

from __future__ import annotations

from typing import Any

import pytest

from gpushared import contract
from gpushared.contract import ComputeShare, ContractError, GpuInfo, GpuInventory, MemoryUnit
from gpushared.core.placement.binding import bind_annotations, holding_for
from gpushared.core.shared.ledger import Ledger, holding_from_pod
from gpushared.core.shared.requests import pod_request
from gpushared.core.shared.verdicts import explain, judge
from tests.builders import pod

REQUEST, LIMIT = contract.POD_COMPUTE_REQUEST, contract.POD_COMPUTE_LIMIT


def asking(memory: int, **annotations: str) -> dict[str, Any]:
    body = pod("p", memory)
    body["metadata"]["annotations"].update(
        {REQUEST if k == "request" else LIMIT if k == "limit" else k: v for k, v in annotations.items()}
    )
    return body


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param({}, None, id="neither: compute not scheduled, as before compute shares"),
        pytest.param({"request": "30"}, ComputeShare(30, 100), id="a floor alone: no cap"),
        pytest.param({"limit": "60"}, ComputeShare(0, 60), id="a cap alone: nothing guaranteed"),
        pytest.param({"request": "30", "limit": "60"}, ComputeShare(30, 60), id="a floor and a cap"),
        pytest.param({"request": "0", "limit": "100"}, ComputeShare(0, 100), id="the bounds"),
        pytest.param({"request": "60", "limit": "60"}, ComputeShare(60, 60), id="floor equal to cap"),
    ],
)
def test_what_compute_annotations_mean(annotations: dict[str, str], expected: ComputeShare | None) -> None:
    assert pod_request(asking(4, **annotations)).compute == expected


@pytest.mark.parametrize(
    ("memory", "annotations", "message"),
    [
        (4, {"request": "70", "limit": "60"}, "is more than gpushared.io/gpu-compute-limit (60)"),
        (4, {"request": "101"}, "must be <= 100"),
        (4, {"request": "-1"}, "must be >= 0"),
        (4, {"limit": "0"}, "must be >= 1"),
        (4, {"request": "3.5"}, "expected a decimal integer"),
        (4, {"request": "30%"}, "expected a decimal integer"),
        (0, {"request": "30"}, "a compute share is a share of the pod's GPUs, and it asks for none"),
        (4, {"limit": "60", contract.POD_MPS_THREAD_PERCENTAGE: "50"}, "give one of the two"),
    ],
)
def test_compute_annotations_refused_with_the_key(memory: int, annotations: dict[str, str], message: str) -> None:
    with pytest.raises(ContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pod_request(asking(memory, **annotations))


def test_the_thread_percentage_may_repeat_the_limit() -> None:
    body = asking(4, limit="60", **{contract.POD_MPS_THREAD_PERCENTAGE: "60"})
    assert pod_request(body).compute == ComputeShare(0, 60)


INVENTORY = GpuInventory(
    unit=MemoryUnit.GIB,
    gpus=tuple(GpuInfo(index=i, uuid=f"GPU-{i}", model="m", memory=16, memory_mib=16384) for i in range(2)),
)


def test_the_bind_records_the_compute_share_and_the_ledger_reads_it_back() -> None:
    body = asking(4, request="30", limit="60")
    request = pod_request(body)
    body["metadata"]["annotations"].update(
        bind_annotations(request, [INVENTORY.gpus[1]], unit=MemoryUnit.GIB, now_ns=1)
    )
    recorded = contract.parse_allocation(body["metadata"]["annotations"][contract.POD_ALLOCATION])
    assert recorded.compute == ComputeShare(30, 60)
    holding = holding_from_pod(body, unit=MemoryUnit.GIB)
    assert holding is not None and (holding.gpus, holding.compute) == ({1: 4}, 30)
    # Its owner lowers the request after the bind: the GPU's share was given on the record, which stays.
    body["metadata"]["annotations"][REQUEST] = "0"
    lowered = holding_from_pod(body, unit=MemoryUnit.GIB)
    assert lowered is not None and lowered.compute == 30


def test_a_pod_without_compute_writes_no_compute_record() -> None:
    body = asking(4)
    annotations = bind_annotations(pod_request(body), [INVENTORY.gpus[0]], unit=MemoryUnit.GIB, now_ns=1)
    assert "compute" not in annotations[contract.POD_ALLOCATION]


def test_three_shares_fill_a_gpu_and_a_fourth_is_told_why() -> None:
    ledger = Ledger.build(INVENTORY)
    for i, share in enumerate(("30", "30", "40")):
        request = pod_request(asking(2, request=share))
        ledger.add(holding_for(request, [INVENTORY.gpus[0]], uid=f"u{i}", namespace="d", name=f"p{i}"))
    assert (ledger.compute_used(0), ledger.compute_free(0), ledger.compute_free(1)) == (100, 0, 100)
    fourth = pod_request(asking(2, request="10"))
    verdicts = judge(ledger, fourth)
    assert [v.fits for v in verdicts] == [False, True]
    assert verdicts[0].reason == "GPU 0 has 0 percent of its compute unrequested, pod requests 10 percent"
    # a pod asking for no compute still fits beside them: memory is all it needs
    assert [v.fits for v in judge(ledger, pod_request(asking(2)))] == [True, True]
    ledger.add(
        holding_for(pod_request(asking(2, request="95")), [INVENTORY.gpus[1]], uid="u9", namespace="d", name="p9")
    )
    assert explain(judge(ledger, fourth)) == (
        "GPU 0 has 0 percent of its compute unrequested, pod requests 10 percent; "
        "GPU 1 has 5 percent of its compute unrequested, pod requests 10 percent"
    )


def test_compute_of_a_pod_on_no_known_gpu_is_taken_from_every_gpu() -> None:
    body = asking(4, request="40")
    body["spec"]["nodeName"] = "n1"  # bound without a GPU choice (it bypassed the extender)
    holding = holding_from_pod(body, unit=MemoryUnit.GIB)
    assert holding is not None and (holding.pending, holding.compute) == (4, 40)
    ledger = Ledger.build(INVENTORY, [holding])
    assert [ledger.compute_free(g.index) for g in INVENTORY.gpus] == [60, 60]
    ledger.remove(holding.uid)
    assert [ledger.compute_free(g.index) for g in INVENTORY.gpus] == [100, 100]


def test_inspect_shows_each_pods_compute_request_and_each_gpus_sum() -> None:
    from gpushared.core.placement.report import node_report
    from gpushared.core.shared.ledger import Holding
    from gpushared.inspect.view import render_details

    holdings = [
        Holding(uid="a", namespace="d", name="a", gpus={0: 4}, compute=30),
        Holding(uid="b", namespace="d", name="b", gpus={0: 2}, compute=40),
        Holding(uid="c", namespace="d", name="c", gpus={1: 2}),
    ]
    report = node_report(name="n1", address="10.0.0.1", inventory=INVENTORY, holdings=holdings)
    assert [d.get("computeRequested") for d in report["devs"]] == [70, None]
    assert [p.get("computeRequest") for p in report["devs"][0]["pods"]] == [30, 40]
    table = render_details([report]).splitlines()
    assert table[3].split() == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)", "Compute(Requested", "%)"]
    assert [line.split() for line in table[4:8]] == [
        ["a", "d", "4", "0", "30"],
        ["b", "d", "2", "0", "40"],
        ["c", "d", "0", "2", "-"],
        ["(compute", "requested)", "70%", "0%"],
    ]
    # no compute anywhere: the report and the table are what they were before compute shares
    plain = node_report(name="n1", address="10.0.0.1", inventory=INVENTORY, holdings=holdings[2:])
    assert "computeRequested" not in str(plain) and "Compute" not in render_details([plain])


def test_decide_compute_sums_per_container_and_reports_beyond_the_tolerance() -> None:
    from gpushared.core.node.compute import TOLERANCE, decide_compute
    from gpushared.core.node.memory import ContainerRef

    a, b = ContainerRef("ua", "d", "a", "c0"), ContainerRef("ub", "d", "b", "c0")
    samples = [(0, a, 30), (0, a, 15), (0, b, 80), (0, b, 60), (1, a, 10), (0, None, 99)]
    decision = decide_compute(samples, {"ua": 40, "ub": 100})
    assert [(u.ref.pod, u.gpu, u.sm_percent, u.limit) for u in decision.uses] == [
        ("a", 0, 45, 40),  # 5 over: within the tolerance
        ("a", 1, 10, 40),
        ("b", 0, 100, 100),  # two processes' samples add up to more than the GPU: capped at all of it
    ]
    assert TOLERANCE == 5 and decision.reports == () and decision.over == frozenset()
    over = decide_compute([(0, a, 46)], {"ua": 40})
    assert [u.sm_percent for u in over.reports] == [46] and over.over == {("ua", "c0", 0)}
    again = decide_compute([(0, a, 90)], {"ua": 40}, over_before=over.over)
    assert again.reports == () and again.over == over.over  # the same episode
    assert decide_compute([(0, a, 90)], {}).reports == ()  # no limit: measured, never reported


def test_fgd_counts_memory_stranded_by_taken_compute_as_fragment() -> None:
    """fgd's second dimension: a GPU whose compute is all but taken strands its free memory, as a node
    whose CPU is taken strands its GPUs'. A small pod goes where its memory would be stranded anyway, and
    a ledger without compute prices memory alone, as before compute shares."""
    from gpushared.core.placement.fragmentation import RequestMix
    from gpushared.core.placement.policies import FGD
    from gpushared.core.placement.pricing import PricingContext

    mix = RequestMix([(1000, 4, 1)] * 10)  # the pods seen: 4 GiB on one GPU
    ledger = Ledger.build(INVENTORY)
    ledger.add(holding_for(pod_request(asking(4, request="90")), [INVENTORY.gpus[0]], uid="a", namespace="d", name="a"))
    ledger.add(holding_for(pod_request(asking(8, request="40")), [INVENTORY.gpus[1]], uid="b", namespace="d", name="b"))
    small = pod_request(asking(4, request="10"))
    context = PricingContext(ledger, mix=mix, pod_compute=small.compute_request)
    # GPU 0: 12 GiB free but 10 % of its compute: 1 GiB usable, fragment to a 4 GiB pod; GPU 1: 8 usable
    assert context._usable == [1, 8]
    choice = FGD.choose(judge(ledger, small), small, context)
    assert choice is not None and [v.gpu.index for v in choice] == [0]  # strands nothing more there
    # The same memory without compute requests: memory alone, the tighter GPU, as before compute shares
    plain = Ledger.build(INVENTORY)
    plain.add(holding_for(pod_request(asking(4)), [INVENTORY.gpus[0]], uid="a", namespace="d", name="a"))
    plain.add(holding_for(pod_request(asking(8)), [INVENTORY.gpus[1]], uid="b", namespace="d", name="b"))
    alone = PricingContext(plain, mix=mix)
    assert alone._usable == [12, 8]
    unaware = FGD.choose(judge(plain, pod_request(asking(4))), pod_request(asking(4)), alone)
    assert unaware is not None and [v.gpu.index for v in unaware] == [1]
