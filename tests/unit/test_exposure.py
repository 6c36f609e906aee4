"""What Allocate tells the runtime, per device list strategy: a table, as NVIDIA's plugin tests its own."""

from __future__ import annotations

import pytest

from gpushared.core.node.exposure import (
    CannotExpose,
    DeviceFile,
    ExposedGpu,
    Exposure,
    ExposurePolicy,
    Strategy,
    exposure,
    parse_strategies,
)

ENVVAR, VOLUMES, CDI = Strategy.ENVVAR, Strategy.VOLUME_MOUNTS, Strategy.CDI_CRI
GPU0 = ExposedGpu("GPU-aaaa", minor=0)
GPU3 = ExposedGpu("GPU-dddd", minor=3)
ALL_CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def files(*pairs: tuple[str, str]) -> tuple[DeviceFile, ...]:
    return tuple(DeviceFile(inside, outside) for inside, outside in pairs)


CASES = [
    pytest.param(
        ExposurePolicy(device_nodes=False),
        [GPU3],
        (),
        Exposure(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-dddd"}, mounts=(), devices=(), cdi_devices=()),
        id="envvar alone: the UUID for NVIDIA's hook",
    ),
    pytest.param(
        ExposurePolicy(device_nodes=False),
        [GPU0, GPU3],
        (),
        Exposure(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-dddd"}, mounts=(), devices=(), cdi_devices=()),
        id="envvar, two GPUs in placement order",
    ),
    pytest.param(
        ExposurePolicy(strategies=frozenset({VOLUMES}), device_nodes=False),
        [GPU0, GPU3],
        (),
        Exposure(
            envs={"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
            mounts=(
                ("/var/run/nvidia-container-devices/GPU-aaaa", "/dev/null"),
                ("/var/run/nvidia-container-devices/GPU-dddd", "/dev/null"),
            ),
            devices=(),
            cdi_devices=(),
        ),
        id="volume-mounts: the hook reads mounts a pod spec cannot forge",
    ),
    pytest.param(
        ExposurePolicy(strategies=frozenset({ENVVAR, VOLUMES}), device_nodes=False),
        [GPU3],
        (),
        Exposure(
            envs={"NVIDIA_VISIBLE_DEVICES": "GPU-dddd"},
            mounts=(("/var/run/nvidia-container-devices/GPU-dddd", "/dev/null"),),
            devices=(),
            cdi_devices=(),
        ),
        id="envvar and volume-mounts name the same GPU",
    ),
    pytest.param(
        ExposurePolicy(strategies=frozenset({CDI}), device_nodes=False),
        [GPU0, GPU3],
        (),
        Exposure(envs={}, mounts=(), devices=(), cdi_devices=("nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=GPU-dddd")),
        id="cdi-cri: CDI names only, no variable for a hook to read",
    ),
    pytest.param(
        ExposurePolicy(strategies=frozenset({CDI, ENVVAR}), device_nodes=False),
        [GPU3],
        (),
        Exposure(
            envs={"NVIDIA_VISIBLE_DEVICES": "GPU-dddd"}, mounts=(), devices=(), cdi_devices=("nvidia.com/gpu=GPU-dddd",)
        ),
        id="cdi-cri with envvar, for nodes mid-migration",
    ),
    pytest.param(
        ExposurePolicy(strategies=frozenset({Strategy.CDI_ANNOTATIONS}), device_nodes=False),
        [GPU0, GPU3],
        (),
        Exposure(
            envs={},
            mounts=(),
            devices=(),
            cdi_devices=(),
            annotations={"cdi.k8s.io/gpushared_gpus": "nvidia.com/gpu=GPU-aaaa,nvidia.com/gpu=GPU-dddd"},
        ),
        id="cdi-annotations: the same names in the annotation kubelets before 1.28 pass on",
    ),
    pytest.param(
        ExposurePolicy(),
        [GPU3],
        ("/dev/nvidia3", *ALL_CONTROL),
        Exposure(
            envs={"NVIDIA_VISIBLE_DEVICES": "GPU-dddd"},
            mounts=(),
            devices=files(
                ("/dev/nvidia3", "/dev/nvidia3"),
                ("/dev/nvidiactl", "/dev/nvidiactl"),
                ("/dev/nvidia-uvm", "/dev/nvidia-uvm"),
                ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools"),
                ("/dev/nvidia-modeset", "/dev/nvidia-modeset"),
            ),
            cdi_devices=(),
        ),
        id="the default: envvar, and deviceNodes with the GPU's file and every control device present",
    ),
    pytest.param(
        ExposurePolicy(device_nodes=True, dev_root="/run/nvidia/driver"),
        [GPU0, GPU3],
        ("/dev/nvidia0", "/dev/nvidia3", "/dev/nvidia1", "/dev/nvidiactl"),
        Exposure(
            envs={"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-dddd"},
            mounts=(),
            devices=files(
                ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0"),
                ("/dev/nvidia3", "/run/nvidia/driver/dev/nvidia3"),
                ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl"),
            ),
            cdi_devices=(),
        ),
        id="deviceNodes under a driver container's dev root; absent uvm files and other GPUs' files are not passed",
    ),
]


@pytest.mark.parametrize(("policy", "gpus", "present", "expected"), CASES)
def test_exposure(policy: ExposurePolicy, gpus: list[ExposedGpu], present: tuple[str, ...], expected: Exposure) -> None:
    assert exposure(policy, gpus, present=present) == expected


def test_device_nodes_need_a_minor_number() -> None:
    with pytest.raises(CannotExpose, match="GPU-x has no device minor number"):
        exposure(ExposurePolicy(), [ExposedGpu("GPU-x", None)], present=())


def test_device_nodes_need_the_gpus_file() -> None:
    """A GPU whose file is not under the dev root is refused with the path, not handed to a runtime that
    would fail the container with "no such file or directory"."""
    policy = ExposurePolicy(dev_root="/run/nvidia/driver")
    with pytest.raises(CannotExpose, match=r"GPU-dddd's device file /run/nvidia/driver/dev/nvidia3 does not exist"):
        exposure(policy, [GPU3], present=("/dev/nvidia0", "/dev/nvidiactl"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("envvar", {ENVVAR}),
        ("cdi-cri, envvar", {CDI, ENVVAR}),
        (["volume-mounts"], {VOLUMES}),
    ],
)
def test_parse_strategies(value: str | list[str], expected: set[Strategy]) -> None:
    assert parse_strategies(value) == frozenset(expected)


@pytest.mark.parametrize(("value", "message"), [("", "at least one"), ("cdi-magic", "unknown device list")])
def test_parse_strategies_refuses(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_strategies(value)
