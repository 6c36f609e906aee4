"""The annotation contract: exact formats, round trips, and precise errors for every malformed value."""

from __future__ import annotations

import json

import pytest

from gpushared import contract
from gpushared.contract import (
    Allocation,
    ContainerShares,
    ContractError,
    GpuInfo,
    GpuInventory,
    GpuShare,
    MemoryUnit,
    ResourceNames,
)


def test_aliyun_keys_are_byte_compatible() -> None:
    assert contract.ALIYUN_GPU_MEM_IDX == "ALIYUN_COM_GPU_MEM_IDX"
    assert contract.ALIYUN_GPU_MEM_DEV == "ALIYUN_COM_GPU_MEM_DEV"
    assert contract.ALIYUN_GPU_MEM_POD == "ALIYUN_COM_GPU_MEM_POD"
    assert contract.ALIYUN_GPU_MEM_ASSIGNED == "ALIYUN_COM_GPU_MEM_ASSIGNED"
    assert contract.ALIYUN_GPU_MEM_ASSUME_TIME == "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
    assert contract.ENV_GPU_MEM_CONTAINER == "ALIYUN_COM_GPU_MEM_CONTAINER"


def test_resource_names_follow_the_configured_domain() -> None:
    assert contract.DEFAULT_RESOURCES.gpu_mem == "aliyun.com/gpu-mem"
    assert contract.DEFAULT_RESOURCES.gpu_count == "aliyun.com/gpu-count"
    names = ResourceNames(domain="example.com")
    assert (names.gpu_mem, names.gpu_count) == ("example.com/gpu-mem", "example.com/gpu-count")


@pytest.mark.parametrize(
    ("unit", "mib", "units"),
    [(MemoryUnit.GIB, 16280, 15), (MemoryUnit.MIB, 16280, 16280), (MemoryUnit.GIB, 1023, 0)],
)
def test_units_round_down_from_mib(unit: MemoryUnit, mib: int, units: int) -> None:
    assert unit.from_mib(mib) == units


def test_unit_conversion_never_undercounts() -> None:
    assert MemoryUnit.GIB.convert(3, to=MemoryUnit.MIB) == 3072
    assert MemoryUnit.MIB.convert(1025, to=MemoryUnit.GIB) == 2
    assert MemoryUnit.MIB.convert(1024, to=MemoryUnit.GIB) == 1


def test_unit_parse_names_the_key() -> None:
    with pytest.raises(ContractError, match=r"unit: 'unit' must be 'MiB' or 'GiB' \(got 'GB'\)"):
        MemoryUnit.parse("GB")


@pytest.mark.parametrize("text", ["", "1.5", "abc", " 1", "1 ", "١", None, "0x1"])
def test_parse_int_rejects_what_go_atoi_rejects(text: object) -> None:
    with pytest.raises(ContractError) as info:
        contract.parse_int(contract.ALIYUN_GPU_MEM_IDX, text)
    assert info.value.key == "ALIYUN_COM_GPU_MEM_IDX"
    assert "expected a decimal integer" in str(info.value)


def test_parse_int_bounds() -> None:
    assert contract.parse_int("k", "1698000000000000000") == 1698000000000000000
    with pytest.raises(ContractError, match="must be >= 0"):
        contract.parse_int(contract.ALIYUN_GPU_MEM_IDX, "-1")
    assert contract.parse_thread_percentage("100") == 100
    with pytest.raises(ContractError, match=r"gpushared.io/mps-active-thread-percentage: must be <= 100"):
        contract.parse_thread_percentage("101")
    with pytest.raises(ContractError, match="must be >= 1"):
        contract.parse_thread_percentage("0")


def test_bool_is_exactly_true_or_false() -> None:
    assert contract.parse_bool("k", "true") is True
    assert contract.parse_bool("k", "false") is False
    assert contract.format_bool(True) == "true"
    with pytest.raises(ContractError, match="expected 'true' or 'false'"):
        contract.parse_bool(contract.ALIYUN_GPU_MEM_ASSIGNED, "True")


INVENTORY = GpuInventory(
    unit=MemoryUnit.GIB,
    gpus=(
        GpuInfo(index=0, uuid="GPU-a", model="Tesla T4", memory=14, memory_mib=15360, mps_capable=True),
        GpuInfo(index=1, uuid="GPU-b", model="A100-SXM4-40GB", memory=39, memory_mib=40960, healthy=False),
    ),
)


def test_inventory_round_trips_and_is_versioned() -> None:
    text = contract.format_inventory(INVENTORY)
    body = json.loads(text)
    assert body["version"] == contract.CONTRACT_VERSION
    assert body["unit"] == "GiB"
    assert body["gpus"][1] == {
        "index": 1,
        "uuid": "GPU-b",
        "model": "A100-SXM4-40GB",
        "memory": 39,
        "memoryMiB": 40960,
        "healthy": False,
        "mps": False,
    }
    assert contract.parse_inventory(text) == INVENTORY


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.update(version=2), "version 2 is newer than this gpushared reads"),
        (lambda b: b.pop("version"), "'version' must be a positive integer"),
        (lambda b: b.update(unit="GB"), "'unit' must be 'MiB' or 'GiB'"),
        (lambda b: b.update(gpus={}), "'gpus' must be a list"),
        (lambda b: b["gpus"][1].update(memory="39Gi"), r"gpus\[1\].memory must be a non-negative integer"),
        (lambda b: b["gpus"][0].update(healthy="yes"), r"gpus\[0\].healthy must be true or false"),
        (lambda b: b["gpus"][1].update(index=0), "GPU indices must be unique"),
        (lambda b: b["gpus"][1].update(uuid="GPU-a"), "GPU UUIDs must be unique"),
    ],
)
def test_inventory_errors_say_where(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    body = json.loads(contract.format_inventory(INVENTORY))
    mutate(body)
    with pytest.raises(ContractError, match=message) as info:
        contract.parse_inventory(json.dumps(body))
    assert info.value.key == contract.NODE_INVENTORY


def test_inventory_rejects_non_json() -> None:
    with pytest.raises(ContractError, match=r"gpushared\.io/gpu-inventory: not valid JSON"):
        contract.parse_inventory("{gpus:")


ALLOCATION = Allocation(
    unit=MemoryUnit.MIB,
    containers=(
        ContainerShares(name="fetch", gpus=(GpuShare(index=2, uuid="GPU-c", amount=512),), init=True),
        ContainerShares(name="proxy", gpus=(GpuShare(index=2, uuid="GPU-c", amount=256),), init=True, sidecar=True),
        ContainerShares(name="main", gpus=(GpuShare(index=2, uuid="GPU-c", amount=4096),)),
        ContainerShares(name="side", gpus=(GpuShare(index=2, uuid="GPU-c", amount=1024),)),
    ),
)


def test_allocation_round_trips_keeping_order_and_kinds() -> None:
    text = contract.format_allocation(ALLOCATION)
    body = json.loads(text)
    assert body["version"] == 1
    assert [c["name"] for c in body["initContainers"]] == ["fetch", "proxy"]
    assert body["containers"][0] == {"name": "main", "gpus": [{"index": 2, "uuid": "GPU-c", "amount": 4096}]}
    assert contract.parse_allocation(text) == ALLOCATION
    assert ALLOCATION.for_container("side") == ALLOCATION.containers[3]
    assert ALLOCATION.for_container("nope") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"version":1,"unit":"MiB"}', "no container holds GPU memory"),
        ('{"version":1,"unit":"MiB","containers":{}}', "'containers' must be a list"),
        (
            '{"version":1,"unit":"MiB","containers":[{"name":"a","gpus":[]}]}',
            r"containers\[0\].gpus must list",
        ),
        (
            '{"version":1,"unit":"MiB","containers":[{"name":"a","gpus":[{"index":-1,"uuid":"x","amount":1}]}]}',
            r"containers\[0\].gpus\[0\].index must be a non-negative integer",
        ),
        (
            '{"version":1,"unit":"MiB","containers":[{"name":"a","gpus":[{"index":0,"uuid":"x","amount":1}]},'
            '{"name":"a","gpus":[{"index":0,"uuid":"x","amount":1}]}]}',
            "container names must be unique",
        ),
        ("[]", "expected a JSON object"),
    ],
)
def test_allocation_errors_say_where(text: str, message: str) -> None:
    with pytest.raises(ContractError, match=message) as info:
        contract.parse_allocation(text)
    assert info.value.key == contract.POD_ALLOCATION


def test_framework_allocation_of_alibabas_closed_scheduler() -> None:
    assert contract.parse_framework_allocation('{"0":{"1":4},"1":{"1":2}}') == {0: {1: 4}, 1: {1: 2}}
    with pytest.raises(ContractError, match=r"scheduler\.framework\.gpushare\.allocation"):
        contract.parse_framework_allocation('{"0":3}')


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("1" * 5000, "at most 19 digits"),  # past CPython's 4,300 digits int() raises ValueError, not ours
        ("9" * 21, "at most 19 digits"),
        ("9223372036854775808", "64-bit"),
        ("²", "expected a decimal integer"),  # str.isdigit() says yes, int() says no
        ("-", "expected a decimal integer"),
        ("--1", "expected a decimal integer"),
    ],
)
def test_parse_int_is_bounded_before_it_converts(text: str, reason: str) -> None:
    with pytest.raises(ContractError, match=reason) as info:
        contract.parse_int(contract.ALIYUN_GPU_MEM_IDX, text, minimum=-(2**64))
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 16"),
        ('{"version":' + "1" * 5000 + "}", "not a valid number"),
        ('{"version":1e' + "9" * 40 + "}", "not a valid number"),
        ('"' + "x" * (256 * 1024) + '"', "longer than 262144"),
        ('{"a":"[[[[[[[[[[[[[[[[[[[[[[[[[["}', "'version' must be a positive integer"),  # brackets in strings
    ],
)
def test_json_annotations_are_bounded(text: str, reason: str) -> None:
    with pytest.raises(ContractError, match=reason):
        contract.parse_allocation(text)


def test_an_error_names_a_value_it_cannot_print() -> None:
    """repr() of an integer past 4,300 digits raises; the error says what it was instead."""
    error = ContractError(key="k", value=10**5000, reason="too big")
    assert str(error) == "k: too big (got an integer of 16610 bits)"
