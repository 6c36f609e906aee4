"""A pod's GPU memory request, per container and at its peak, as Kubernetes counts it."""

from __future__ import annotations

import pytest

from gpushared import contract
from gpushared.contract import ContractError, ResourceNames
from gpushared.core.placement.cpu import allocatable_cpu, allocatable_memory, cpu_request, memory_request
from gpushared.core.shared.quantity import parse_milli_quantity, parse_whole_quantity
from gpushared.core.shared.requests import ContainerRequest, PodRequest, peak, pod_request
from tests.builders import GPU_MEM, container, on_gpus, pod


@pytest.mark.parametrize(
    ("text", "value"),
    [("4", 4), ("4k", 4000), ("1Ki", 1024), ("2e3", 2000), ("1.5k", 1500), ("0", 0), (7, 7), ("2000m", 2)],
)
def test_quantities(text: object, value: int) -> None:
    assert parse_whole_quantity("q", text) == value
    assert parse_milli_quantity("q", text) == 1000 * value


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("1.5", "whole numbers"),
        ("500m", "whole numbers"),
        ("4GB", "not a Kubernetes quantity"),
        ("", "not a"),
        ("-1", "must not be negative"),
        (True, "expected a quantity"),
        (None, "expected a quantity"),
    ],
)
def test_bad_quantities(text: object, reason: str) -> None:
    with pytest.raises(ContractError, match=reason):
        parse_whole_quantity("limits[aliyun.com/gpu-mem]", text)


def test_sum_of_app_containers_skipping_those_without_gpu_mem() -> None:
    body = pod("p", 3, 5)
    body["spec"]["containers"].append(container("sidecar"))
    request = pod_request(body)
    assert request.total == 8
    assert [c.name for c in request.containers] == ["c0", "c1"]
    assert request.app_sum == 8


def test_init_container_larger_than_apps_sets_the_peak() -> None:
    """Aliyun ignores init containers; Kubernetes takes max(init, sum(apps))."""
    body = pod("p", 2, 2, init=[container("warmup", 6), container("small", 1)])
    request = pod_request(body)
    assert request.total == 6
    assert request.app_sum == 4
    assert request.containers[0] == ContainerRequest(name="warmup", amount=6, init=True)


def test_sidecars_run_beside_later_init_containers_and_apps() -> None:
    """KEP-753: restartable init containers add to everything started after them."""
    body = pod("p", 4, init=[container("log", 1, restartPolicy="Always"), container("fetch", 5)])
    assert pod_request(body).total == 6  # max(1 + 5, 1 + 4)
    assert peak([ContainerRequest("s", 2, init=True, sidecar=True)]) == 2


def test_request_without_limit_and_equal_request() -> None:
    body = pod("p")
    body["spec"]["containers"] = [
        {"name": "a", "resources": {"requests": {GPU_MEM: "2"}}},
        {"name": "b", "resources": {"requests": {GPU_MEM: "3"}, "limits": {GPU_MEM: "3"}}},
    ]
    assert pod_request(body).total == 5


def test_request_different_from_limit_is_refused_with_the_container_named() -> None:
    body = pod("p")
    body["spec"]["containers"] = [{"name": "main", "resources": {"requests": {GPU_MEM: "2"}, "limits": {GPU_MEM: "3"}}}]
    with pytest.raises(ContractError, match=r"spec.containers\[0\]\(main\).resources\[aliyun.com/gpu-mem\]"):
        pod_request(body)


def test_fractional_limit_names_the_field() -> None:
    body = pod("p")
    body["spec"]["containers"] = [{"name": "main", "resources": {"limits": {GPU_MEM: "1.5"}}}]
    with pytest.raises(ContractError, match=r"spec.containers\[0\]\(main\).resources.limits\[aliyun.com/gpu-mem\]"):
        pod_request(body)


def test_other_domain() -> None:
    body = pod("p")
    body["spec"]["containers"] = [{"name": "main", "resources": {"limits": {"example.com/gpu-mem": "9"}}}]
    assert pod_request(body).total == 0
    assert pod_request(body, resources=ResourceNames(domain="example.com")).total == 9


def test_mps_opt_in_and_thread_percentage() -> None:
    body = pod("p", 2, annotations={contract.POD_MPS: "true", contract.POD_MPS_THREAD_PERCENTAGE: "30"})
    assert pod_request(body) == PodRequest(containers=(ContainerRequest("c0", 2),), mps=True, thread_percentage=30)
    body["metadata"]["annotations"][contract.POD_MPS] = "yes"
    with pytest.raises(ContractError, match=r"gpushared\.io/mps: expected 'true' or 'false'"):
        pod_request(body)


def test_empty_pod() -> None:
    assert pod_request({}).total == 0


def test_cpu_request_counts_as_node_resources_fit_does() -> None:
    """The larger of the init phase and what runs after it (sidecars through both), plus the overhead; an
    unset request counts 0, and quantities round up to the milli-CPU."""
    body = pod("p", cpu="1.5")
    body["spec"]["containers"].append(container("c1", resources={"requests": {"cpu": "250m"}}))
    body["spec"]["containers"].append(container("no-request"))
    assert cpu_request(body) == 1750
    body["spec"]["initContainers"] = [container("setup", resources={"requests": {"cpu": "2"}})]
    assert cpu_request(body) == 2000
    body["spec"]["initContainers"][0]["resources"]["requests"]["cpu"] = "1"
    body["spec"]["initContainers"].append(
        container("proxy", restartPolicy="Always", resources={"requests": {"cpu": "100m"}})
    )
    assert cpu_request(body) == 1850  # the sidecar runs beside the apps; the setup (1 CPU) ran before them
    body["spec"]["overhead"] = {"cpu": "1u"}
    assert cpu_request(body) == 1851
    body["spec"]["containers"][1]["resources"]["requests"]["cpu"] = "lots"
    with pytest.raises(ContractError, match=r"spec.containers\[1\]\(c1\).resources.requests\[cpu\].*not a Kubernetes"):
        cpu_request(body)


def test_allocatable_cpu_is_what_the_node_says_or_nothing() -> None:
    assert allocatable_cpu({"status": {"allocatable": {"cpu": "7800m"}}}) == 7800
    assert allocatable_cpu({"status": {"allocatable": {"cpu": "96"}}}) == 96000
    assert allocatable_cpu({"status": {"capacity": {"cpu": "96"}}}) is None
    assert allocatable_cpu({"status": {"allocatable": {"cpu": "many"}}}) is None


def test_memory_request_counts_as_node_resources_fit_does() -> None:
    """Bytes, the peak of the init phase and what runs after it, plus the overhead; unreadable: 0 (the claim
    allocator's tie-break only)."""
    body = pod("p")
    body["spec"]["containers"] = [container("c0", resources={"requests": {"memory": "1Gi"}})]
    body["spec"]["containers"].append(container("c1", resources={"requests": {"memory": "512Mi"}}))
    assert memory_request(body) == 3 * 2**29
    body["spec"]["initContainers"] = [container("setup", resources={"requests": {"memory": "4Gi"}})]
    assert memory_request(body) == 4 * 2**30
    body["spec"]["overhead"] = {"memory": "1k"}
    assert memory_request(body) == 4 * 2**30 + 1000
    body["spec"]["containers"][1]["resources"]["requests"]["memory"] = "lots"
    assert memory_request(body) == 0
    assert allocatable_memory({"status": {"allocatable": {"memory": "64Gi"}}}) == 64 * 2**30
    assert allocatable_memory({"status": {"allocatable": {"memory": "1.5"}}}) == 2  # rounded up to a byte
    assert allocatable_memory({"status": {}}) is None
    assert allocatable_memory({"status": {"allocatable": {"memory": "much"}}}) is None


def test_gpu_count_spreads_the_memory_evenly_over_that_many_gpus() -> None:
    request = pod_request(on_gpus(pod("train", 32), 4))
    assert (request.total, request.gpus, request.per_gpu) == (32, 4, 8)
    assert request.containers == (ContainerRequest("c0", 32, gpus=4),)
    one = pod_request(on_gpus(pod("one", 6), 1))  # Aliyun's users sometimes ask for one: the same as none
    assert (one.total, one.gpus, one.per_gpu) == (6, 1, 6)
    assert pod_request(pod("plain", 6)).gpus == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (on_gpus(pod("no-memory", 0), 2), "GPUs are given with GPU memory: ask for aliyun.com/gpu-mem too"),
        (on_gpus(pod("uneven", 10), 4), "must be a multiple of 4"),
        (on_gpus(pod("two", 8, 2), 2), "must be the pod's only container with GPU memory"),
        (
            on_gpus(pod("mps", 8, annotations={contract.POD_MPS: "true"}), 2),
            "an MPS pod gets exactly one GPU",
        ),
    ],
)
def test_pods_on_several_gpus_that_cannot_be_served_exactly_are_refused(body: dict[str, object], reason: str) -> None:
    with pytest.raises(ContractError, match=reason):
        pod_request(body)  # type: ignore[arg-type]
