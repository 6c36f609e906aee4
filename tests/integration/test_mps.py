"""MPS with the real ``nvidia-cuda-mps-control`` (Debian non-free, no GPU needed for its control protocol):
one supervised daemon per GPU, adoption across gpushared restarts, operator stop/start, and what Allocate
gives MPS pods. Needs root (mount namespaces, tmpfs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpushared import contract
from gpushared.mps.control import GpuDirs, MpsControl
from tests.builders import pod
from tests.fakes.kubelet import AdmissionError
from tests.harness import GPU_MEM, NODE, Daemon, wait_until
from tests.integration.test_daemon import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="MPS daemons need root: mount namespaces and tmpfs")

MPS = {contract.POD_MPS: "true"}


@pytest.fixture
def mps(daemon: Daemon, mps_control: Path, kubelet_root: Path) -> Iterator[Daemon]:
    """The daemon with MPS on: 4 GPUs, 4 control daemons under a short root (unix socket paths)."""
    root = kubelet_root / "mps"
    daemon.config.update(
        {"mps": {"enabled": True, "root": str(root), "controlBinary": str(mps_control), "probeSeconds": 0.3}}
    )
    yield daemon
    if daemon.process is not None and daemon.process.poll() is None:
        daemon.stop()
    for process in control_daemons(root):
        process.kill()
    for uuid_dir in root.iterdir() if root.exists() else []:
        subprocess.run(["umount", str(uuid_dir / "shm")], capture_output=True, check=False)


def control_daemons(root: Path) -> list[psutil.Process]:
    """The MPS control daemons under ``root``; not the short-lived clients of the same binary that the
    supervisor's probes start (those run without ``-d`` and would be counted as a fifth daemon)."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            named = "nvidia-cuda-mps" in (process.info["name"] or "")
            daemon = "-d" in (process.info["cmdline"] or [])[1:]
            if named and daemon and process.environ().get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(str(root)):
                found.append(process)
    return found


def mps_status(daemon: Daemon) -> list[dict[str, Any]]:
    try:
        return list(daemon.status().get("mps") or [])
    except OSError:  # not listening yet
        return []


def all_running(daemon: Daemon) -> list[dict[str, Any]]:
    return wait_until(
        lambda: (rows := mps_status(daemon)) and all(r["state"] == "running" for r in rows) and rows,
        timeout=30,
        message="every MPS daemon running",
    )


def control_of(daemon: Daemon, row: dict[str, Any]) -> MpsControl:
    root = Path(daemon.config["mps"]["root"])
    binary = daemon.config["mps"]["controlBinary"]
    return MpsControl(binary=binary, uuid=row["uuid"], dirs=GpuDirs.of(root, row["uuid"]))


def gpu_healthy(daemon: Daemon, index: int) -> bool:
    return daemon.inventory().gpus[index].healthy


def test_one_daemon_per_gpu_with_its_own_env_directories_and_ceiling_limits(mps: Daemon) -> None:
    started(mps)
    rows = all_running(mps)
    assert [r["gpu"] for r in rows] == [0, 1, 2, 3]
    assert len({r["pid"] for r in rows}) == 4
    root = Path(mps.config["mps"]["root"])
    for row, size in zip(rows, (16384, 12288, 24576, 8192), strict=True):
        process = psutil.Process(row["pid"])
        env = process.environ()
        assert env["CUDA_VISIBLE_DEVICES"] == row["uuid"]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / row["uuid"] / "pipe")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(root / row["uuid"] / "log")
        # A mount namespace of its own, whose /dev/shm is the GPU's private tmpfs.
        assert os.readlink(f"/proc/{row['pid']}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert "tmpfs" in subprocess.run(["findmnt", "-n", "-o", "FSTYPE", str(root / row["uuid"] / "shm")],
                                         capture_output=True, text=True, check=False).stdout  # fmt: skip
        control = control_of(mps, row)
        assert control.command("get_default_active_thread_percentage") == "100.0"
        assert control.command("get_default_device_pinned_mem_limit 0") == f"{size // 1024}G"
        assert row["limits"] == {"threads": "100.0", "memory": f"{size // 1024}G"}
        assert "set_default_device_pinned_mem_limit" in (root / row["uuid"] / "log" / "control.log").read_text()
    assert all(gpu.mps_capable and gpu.healthy for gpu in mps.inventory().gpus)
    table = subprocess.run(
        [sys.executable, "-m", "gpushared.cli.daemon", "status", "--config", str(mps.config_path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "MPS" in table and "running" in table and "100.0% / 16G" in table


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_daemon_is_restarted_and_its_gpu_unhealthy_meanwhile(mps: Daemon, fault: int) -> None:
    started(mps)
    old = all_running(mps)[1]
    os.kill(old["pid"], fault)
    wait_until(lambda: not gpu_healthy(mps, 1), timeout=15, message="GPU 1 unhealthy")
    assert gpu_healthy(mps, 0) and gpu_healthy(mps, 2)  # one daemon's trouble is its GPU's alone
    assert "MPS control daemon" in (mps.status()["gpus"][1]["problem"] or "")
    wait_until(lambda: gpu_healthy(mps, 1), timeout=20, message="GPU 1 healthy again")
    new = mps_status(mps)[1]
    assert new["state"] == "running" and new["pid"] != old["pid"] and new["restarts"] == 1
    assert not psutil.pid_exists(old["pid"]) or psutil.Process(old["pid"]).status() == psutil.STATUS_ZOMBIE
    assert control_of(mps, new).command("get_default_active_thread_percentage") == "100.0"
    metrics = mps.metrics_text()
    from prometheus_client.parser import text_string_to_metric_families

    restarts = {
        (s.labels["gpu"], s.labels["uuid"], s.labels["UUID"]): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "gpushared_mps_daemon_restarts_total"
    }
    assert restarts == {("1", old["uuid"], old["uuid"]): 1.0}, restarts


def test_a_restarted_gpushared_adopts_the_running_daemons(mps: Daemon) -> None:
    started(mps)
    before = {r["uuid"]: r["pid"] for r in all_running(mps)}
    assert mps.stop() == 0
    assert all(psutil.pid_exists(pid) for pid in before.values())  # stopping gpushared leaves them running
    mps.start()
    rows = all_running(mps)
    assert {r["uuid"]: r["pid"] for r in rows} == before
    assert all(r["adopted"] and r["restarts"] == 0 for r in rows)
    assert len(control_daemons(Path(mps.config["mps"]["root"]))) == 4


def test_a_daemon_silent_when_gpushared_restarts_is_adopted_once_it_answers(mps: Daemon) -> None:
    """A control daemon that misses the first probes after a restart (busy: a CI run saw one) is asked again
    rather than replaced, which would cut off its clients."""
    started(mps)
    before = {r["uuid"]: r["pid"] for r in all_running(mps)}
    assert mps.stop() == 0
    silent = before[max(before)]
    os.kill(silent, signal.SIGSTOP)
    try:
        mps.start()
        time.sleep(6)  # one probe's whole timeout (5 s) without an answer
        assert psutil.pid_exists(silent)
    finally:
        os.kill(silent, signal.SIGCONT)
    rows = all_running(mps)
    assert {r["uuid"]: r["pid"] for r in rows} == before
    assert all(r["adopted"] and r["restarts"] == 0 for r in rows)
    assert "adopted the running control daemon" in mps.log()


def mps_cli(daemon: Daemon, *args: str) -> str:
    """`gpushared mps ...` against this daemon's config, as an operator runs it; its output."""
    command = [sys.executable, "-m", "gpushared.cli.daemon", "mps", *args, "--config", str(daemon.config_path)]
    result = subprocess.run(
        command, capture_output=True, text=True, check=False, env={**os.environ, **daemon.nvml.env()}
    )
    assert result.returncode == 0, f"{' '.join(args)} failed ({result.returncode}): {result.stdout}{result.stderr}"
    return result.stdout


def test_mps_stop_quits_daemons_on_purpose_and_start_lets_them_run_again(mps: Daemon) -> None:
    started(mps)
    rows = all_running(mps)
    out = mps_cli(mps, "stop", "--gpu", rows[2]["uuid"])
    assert f"MPS control daemon {rows[2]['pid']} stopped" in out
    wait_until(lambda: not psutil.pid_exists(rows[2]["pid"]) or psutil.Process(rows[2]["pid"]).status() == "zombie")
    wait_until(lambda: mps_status(mps)[2]["state"] == "stopped", message="stopped, not restarted")
    wait_until(lambda: not gpu_healthy(mps, 2), message="a GPU without its daemon is not offered")
    assert mps_status(mps)[2]["restarts"] == 0
    root = Path(mps.config["mps"]["root"])
    assert (
        subprocess.run(["findmnt", str(root / rows[2]["uuid"] / "shm")], capture_output=True, check=False).returncode
        != 0
    )
    mps_cli(mps, "start", "--gpu", "2")
    wait_until(lambda: mps_status(mps)[2]["state"] == "running", timeout=15, message="started again")
    assert gpu_healthy(mps, 2) or wait_until(lambda: gpu_healthy(mps, 2), timeout=5)
    assert mps_cli(mps, "stop").count("stopped") == 4
    assert not control_daemons(root)


def test_a_daemon_running_against_an_operators_stop_is_quit(mps: Daemon) -> None:
    """The supervisor decides to restart a daemon, the operator runs `gpushared mps stop`, the restart lands
    after it: a daemon runs although MPS was stopped. The marker says what the operator wants, so the
    supervisor quits it. Here the race's outcome is made directly: the marker, with the daemon still up."""
    started(mps)
    rows = all_running(mps)
    root = Path(mps.config["mps"]["root"])
    (GpuDirs.of(root, rows[1]["uuid"]).stopped).touch()
    wait_until(lambda: not psutil.pid_exists(rows[1]["pid"]) or psutil.Process(rows[1]["pid"]).status() == "zombie",
               message="the daemon quit")  # fmt: skip
    wait_until(lambda: mps_status(mps)[1]["state"] == "stopped", message="stopped")
    assert [r["state"] for r in mps_status(mps)] == ["running", "stopped", "running", "running"]
    assert "started as MPS was stopped" in mps.log()


def test_allocate_gives_an_mps_container_its_env_and_mounts(mps: Daemon) -> None:
    started(mps)
    all_running(mps)
    wait_until(lambda: all(g.healthy for g in mps.inventory().gpus), message="healthy")
    root = Path(mps.config["mps"]["root"])
    [given] = mps.admit(mps.place("mps-6", 6, gpu=2, annotations=MPS))
    uuid = mps.inventory().gpus[2].uuid
    envs = dict(given.response.envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # ceil(100 * 6 / 24)
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert "CUDA_VISIBLE_DEVICES" not in envs  # NVIDIA: never set it on an MPS client
    mounts = {(m.container_path, m.host_path, m.read_only) for m in given.response.mounts}
    assert mounts == {
        ("/tmp/nvidia-mps", str(root / uuid / "pipe"), False),
        ("/dev/shm", str(root / uuid / "shm"), False),
    }
    overridden = {**MPS, contract.POD_MPS_THREAD_PERCENTAGE: "60"}
    [given] = mps.admit(mps.place("mps-60", 2, gpu=2, annotations=overridden))
    assert given.response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    [plain] = mps.admit(mps.place("plain", 2, gpu=0))
    assert "CUDA_MPS_PIPE_DIRECTORY" not in plain.response.envs and not plain.response.mounts


def test_mps_requests_are_refused_without_mps_on_the_node(daemon: Daemon) -> None:
    started(daemon)
    with pytest.raises(AdmissionError, match=r"runs no MPS daemons: set mps\.enabled"):
        daemon.admit(daemon.place("wants-mps", 2, gpu=0, annotations=MPS))
    wait_until(lambda: any("runs no MPS daemons" in m for _, m in daemon.events("wants-mps")), message="event")


def test_mps_on_two_gpus_is_refused(mps: Daemon) -> None:
    started(mps)
    all_running(mps)
    inv = mps.inventory()
    allocation = contract.Allocation(
        unit=inv.unit,
        containers=(
            contract.ContainerShares("c0", (contract.GpuShare(0, inv.gpus[0].uuid, 2),)),
            contract.ContainerShares("c1", (contract.GpuShare(1, inv.gpus[1].uuid, 2),)),
        ),
    )
    body = pod(
        "split", 2, 2, node=NODE, annotations={**MPS, contract.POD_ALLOCATION: contract.format_allocation(allocation)}
    )
    mps.api.create(body)
    with pytest.raises(AdmissionError, match=r"asks for MPS on GPUs \[0, 1\]: an MPS client reaches one GPU"):
        mps.admit(body)


def test_the_49th_mps_client_of_a_gpu_is_refused(mps: Daemon) -> None:
    mps.config["memoryUnit"] = "MiB"
    started_mib(mps)
    all_running(mps)
    for i in range(48):
        mps.place(f"client-{i}", 100, gpu=2, annotations=MPS)
    with pytest.raises(AdmissionError, match="would be MPS client 49 of GPU 2; an MPS server takes 48"):
        mps.admit(mps.place("client-48", 100, gpu=2, annotations=MPS))


def test_an_mps_pod_is_refused_while_its_gpus_daemon_is_stopped(mps: Daemon) -> None:
    started(mps)
    rows = all_running(mps)
    control_of(mps, rows[3]).dirs.stopped.touch()
    control_of(mps, rows[3]).quit()
    wait_until(lambda: mps_status(mps)[3]["state"] == "stopped", message="stopped")
    with pytest.raises(AdmissionError, match="the MPS control daemon of GPU 3 is not running"):
        mps.admit(mps.place("orphan", 2, gpu=3, annotations=MPS))


def shm_mounts(root: Path) -> set[str]:
    """The MPS shm tmpfs mounts this (the host's) mount namespace has under ``root``."""
    with open("/proc/self/mountinfo") as mounts:
        fields = [line.split() for line in mounts]
    return {f[4] for f in fields if f[4].startswith(str(root)) and f[4].endswith("/shm") and "tmpfs" in f}


def test_in_a_sandbox_the_shm_mounts_come_from_mps_prepare_and_daemons_survive_restarts(mps: Daemon) -> None:
    """As under systemd: the daemon in a mount namespace of its own (a slave of the host's, as the unit's
    sandbox is) must not mount where the kubelet cannot see; `gpushared mps prepare` mounts for the host."""
    root = Path(mps.config["mps"]["root"])
    root.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)  # shared, as / is on a systemd host
    subprocess.run(["mount", "--make-shared", str(root)], check=True)
    try:
        sandboxed(mps, root)
    finally:
        for shm in shm_mounts(root):
            subprocess.run(["umount", shm], check=False)
        subprocess.run(["umount", str(root)], check=True)


def mps_prepare(mps: Daemon) -> str:
    """`gpushared mps prepare`, as the unit's ExecStartPre runs it: from the host's namespace."""
    return subprocess.run(
        [sys.executable, "-m", "gpushared.cli.daemon", "mps", "prepare", "--config", str(mps.config_path)],
        env={**os.environ, **mps.nvml.env()},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def sandboxed(mps: Daemon, root: Path) -> None:
    mps.launcher = ["unshare", "--mount", "--propagation", "slave"]
    mps.start()
    mps.notify.wait_for("READY=1")
    rows = wait_until(
        lambda: (rows := mps_status(mps)) and all(r["state"] == "failed" for r in rows) and rows,
        message="every daemon refused",
    )
    assert "a mount made here would be hidden from the kubelet" in rows[0]["problem"]
    assert not shm_mounts(root) and not control_daemons(root)
    assert not any(gpu["healthy"] for gpu in mps.status()["gpus"])  # no MPS pod lands meanwhile
    prepared = mps_prepare(mps)
    assert prepared.count(" mounted") == 4, prepared
    assert shm_mounts(root) == {str(root / r["uuid"] / "shm") for r in rows}  # in the host's namespace
    before = {r["uuid"]: r["pid"] for r in all_running(mps)}  # the supervisor's next try starts them
    mps.kubelet.wait_for(GPU_MEM, capacity=60)
    mps.stop()
    started(mps)  # a new namespace, as a restarted unit gets
    rows = all_running(mps)
    assert {r["uuid"]: r["pid"] for r in rows} == before and all(r["adopted"] for r in rows)
    assert mps_prepare(mps).count("already mounted") == 4


def started_mib(daemon: Daemon) -> None:
    daemon.start()
    daemon.notify.wait_for("READY=1")
    daemon.kubelet.wait_for(GPU_MEM, capacity=16384 + 12288 + 24576 + 8192)
    wait_until(lambda: contract.NODE_INVENTORY in (daemon.api.get("nodes", NODE) or {})["metadata"].get(
        "annotations", {}), message="inventory")  # fmt: skip


class RecordingBackend:
    """Only what MPS asks of NVML: the compute mode, recorded."""

    def __init__(self) -> None:
        self.modes: list[tuple[str, bool]] = []

    def start(self) -> None:
        pass

    def set_exclusive_process(self, uuid: str, exclusive: bool) -> None:
        self.modes.append((uuid, exclusive))


def test_exclusive_process_is_set_before_start_and_reset_when_stopped(mps_control: Path, kubelet_root: Path) -> None:
    from gpushared.daemon import mps as mps_module
    from gpushared.daemon.health import Health
    from gpushared.daemon.metrics import DaemonMetrics
    from gpushared.nvml.backend import GpuDevice

    settings = mps_module.MpsSettings(
        root=kubelet_root / "mps", binary=str(mps_control), exclusive_process=True, shm_size="64m", probe_seconds=1
    )
    backend = RecordingBackend()
    health = Health(ignored_xids=(), recover_after=1)
    supervisor = mps_module.MpsSupervisor(settings=settings, health=health, metrics=DaemonMetrics(), backend=backend)  # type: ignore[arg-type]
    gpu = GpuDevice(
        index=0, uuid="GPU-e2c0", model="T4", memory_mib=15360, mig_enabled=False, compute_capability=(7, 5)
    )
    supervisor.sync([gpu])
    assert health.problem("GPU-e2c0") == "MPS control daemon starting"  # no MPS pod before it answers
    try:
        supervisor.check()
        assert supervisor.running("GPU-e2c0") and health.problem("GPU-e2c0") is None
        assert backend.modes == [("GPU-e2c0", True)]
        [row] = supervisor.status()
        assert row["limits"] == {"threads": "100.0", "memory": "15G"} and row["clients"] == 0
        message = mps_module.stop_daemon(settings, "GPU-e2c0", backend=backend)  # type: ignore[arg-type]
        assert "stopped" in message and backend.modes[-1] == ("GPU-e2c0", False)
        supervisor.check()
        assert not supervisor.running("GPU-e2c0") and "gpushared mps stop" in (health.problem("GPU-e2c0") or "")
    finally:
        for process in control_daemons(settings.root):
            process.kill()
        subprocess.run(["umount", str(settings.root / "GPU-e2c0" / "shm")], capture_output=True, check=False)
