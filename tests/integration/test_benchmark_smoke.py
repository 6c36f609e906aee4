"""Benchmarks run in CI only as smokes: they must work, their numbers are not judged here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_allocate_runs_and_reports() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_allocate.py"),
            "--pods",
            "4",
            "--background",
            "4",
            "--idle-seconds",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["Allocate"]["count"] == 4
    assert report["GetPreferredAllocation"]["count"] == 4
    assert report["Allocate"]["p99_ms"] > 0
    assert report["idle"]["rss_mib"] > 0 and report["idle"]["cpu_percent_of_one_core"] >= 0


def test_bench_dra_prepare_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_dra_prepare.py"), "--claims", "20"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["claims"] == 20 and report["bands"][0]["count"] == 10
    assert report["all"]["p99_ms"] > 0


def small_trace(data: Path, *, models: tuple[str, ...] = ("G2", "T4")) -> Path:
    """Twelve nodes of 2 and 4 GPUs (the models alternating), and five kinds of task, one on two GPUs; a
    ``multigpu20`` list with more of that one (the default trace's expected mix is made from it)."""
    data.mkdir()
    (data / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(f"n{i},32000,131072,{2 + 2 * (i % 2)},{models[i % len(models)]}\n" for i in range(12))
    )
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time"
    header += ",scheduled_time\n"
    rows = [(4000, 1, 1000, ""), (2000, 1, 500, ""), (1000, 1, 250, "T4"), (8000, 0, 0, ""), (8000, 2, 1000, "")]
    for trace, listed in (("default", rows), ("multigpu20", [*rows, *rows[-1:] * 3])):
        (data / f"openb_pod_list_{trace}.csv").write_text(
            header + "".join(f"p{i},{c},4096,{n},{g},{m},LS,Running,0,1,0\n" for i, (c, n, g, m) in enumerate(listed))
        )
    return data


def test_bench_openb_replays_a_small_trace_and_writes_json_and_plots(tmp_path: Path) -> None:
    data = small_trace(tmp_path / "trace")
    out = tmp_path / "results"
    script = str(ROOT / "scripts" / "bench_openb.py")
    subprocess.run(
        [sys.executable, script, "--data", str(data), "--seeds", "42", "43", "--jobs", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    summary = json.loads((out / "openb.json").read_text())
    assert set(summary) == {"default", "multigpu20"}
    assert set(summary["default"]) == {"binpack", "spread", "fgd", "balanced"}
    for numbers in summary["default"].values():
        assert set(numbers) == {"100", "130", "frag90", "curve"} and 0 < numbers["130"] <= 100
        assert list(numbers["curve"]) == ["50", "60", "70", "80", "90", "100", "110", "120", "130"]
        assert numbers["curve"]["130"] == numbers["130"]
    written = json.loads((out / "openb-details.json").read_text())
    [run] = written["runs"]  # the figures a policy reaches knowing the tasks placed and another trace's mix
    assert run["mix"] == "expected" and run["expectedMixFrom"] == {"default": "multigpu20", "multigpu20": "default"}
    details = written["traces"]["default"]["binpack"]
    assert len(details["allocation"]) == 131 and details["multiGpuTasks"] > 0
    assert (out / "openb-default.png").read_bytes()[:4] == b"\x89PNG"
    table = subprocess.run(
        [sys.executable, script, "--data", str(data), "--out", str(out), "--table"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "fgd worst vs binpack" in table.splitlines()[0] and table.splitlines()[2].startswith("| default |")
    # what else a policy may be given (issue #41): the tasks placed alone, or the oracle's whole workload,
    # each in its own files; and one policy run again merged into the figures
    again = [sys.executable, script, "--data", str(data), "--traces", "default", "--seeds", "42", "--out", str(out)]
    for mix in ("counted", "oracle"):
        subprocess.run([*again, "--mix", mix, "--policies", "fgd", "--no-plots"], check=True, timeout=300)
        figures = json.loads((out / f"openb-{mix}.json").read_text())
        assert set(figures) == {"default"} and set(figures["default"]) == {"fgd"}
    assert json.loads((out / "openb.json").read_text()) == summary  # the headline figures left as they were
    subprocess.run([*again, "--policies", "fgd", "--merge", "--no-plots"], check=True, timeout=300)
    merged = json.loads((out / "openb.json").read_text())
    assert merged["multigpu20"] == summary["multigpu20"] and merged["default"]["spread"] == summary["default"]["spread"]
    merged_details = json.loads((out / "openb-details.json").read_text())
    assert list(merged_details["traces"]["default"]["fgd"]["seeds"]) == ["42"]  # fgd run again, one seed
    assert list(merged_details["traces"]["default"]["binpack"]["seeds"]) == ["42", "43"]  # kept
    assert [r["command"].count("--merge") for r in merged_details["runs"]] == [0, 1]


def test_bench_links_replays_blind_and_seeing_and_scores_the_sets(tmp_path: Path) -> None:
    data = small_trace(tmp_path / "trace", models=("T4", "V100M16"))
    out = tmp_path / "results"
    script = str(ROOT / "scripts" / "bench_links.py")
    argv = ["--data", str(data), "--traces", "default", "--policies", "binpack", "balanced", "--seeds", "42"]
    printed = subprocess.run(
        [sys.executable, script, *argv, "--jobs", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    summary = json.loads((out / "links.json").read_text())["traces"]["default"]
    assert set(summary) == {"binpack", "balanced"}
    for modes in summary.values():
        assert set(modes) == {"blind", "seen"}
        assert modes["seen"]["scorePctOfBest"] == 100.0  # every set the best its node has
        assert modes["seen"]["multiGpuPlaced"] > 0 and 0 <= modes["blind"]["scorePctOfBest"] <= 100
    assert "| default | binpack | seen |" in printed


def test_bench_extender_runs_in_process_and_over_http() -> None:
    sizes = ["--nodes", "20", "--pods", "100", "--candidates", "20", "--requests", "10", "--seconds", "1"]
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--pin"] if len(cpus) >= 2 else []  # the extender alone on one CPU, through taskset
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_extender.py"),
            *sizes,
            "--rate-pods",
            "40",
            "--filter-alone-seconds",
            "0.5",
            "--lead",
            "2",
            *pin,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    for where in ("inProcess", "http"):
        assert report[where]["filter"]["count"] == 10 and report[where]["filter"]["p99_ms"] > 0
        assert report[where]["bind"]["count"] > 0
        assert 1 <= report[where]["prioritizeFirstOfSize"]["count"] <= 8  # pending pods ask 1-8 GiB
    assert report["http"]["rssMiBSynced"] > 0 and report["http"]["filterPlusBindPerSecond"] > 0
    # Pods created two rounds ahead: the extender's primer priced their sizes (at least the first's).
    assert report["lead"] == 2 and report["http"]["slotsPrimed"] >= 1
    assert report["extenderCpus"] == (cpus[:1] if pin else "any")
    # A smoke, not a measurement: in half a second the extender's CPU time may not tick (10 ms) at all.
    assert report["http"]["filtersAlone"] > 0 and report["http"]["extenderCpuMsPerFilterAlone"] >= 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the paired comparison pins the extender to a CPU")
def test_ab_extender_compares_two_trees_in_alternating_rounds(tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ROOT / "gpushared", other / "gpushared", ignore=shutil.ignore_patterns("__pycache__"))
    sizes = ["--nodes", "20", "--pods", "100", "--candidates", "20", "--seconds", "1", "--rate-pods", "40"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ab_extender.py"), str(ROOT), str(other), *sizes, "--rounds", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    assert set(report["runs"]) == {str(ROOT), str(other)}
    for rows in report["runs"].values():
        assert len(rows) == 2 and all(row["extenderCpuMs"] > 0 and row["extenderPerCallerCpu"] > 0 for row in rows)
    order = [line.split(":")[0] for line in out.stderr.splitlines() if line.startswith("round ")]
    assert order == [f"round 0 {ROOT}", f"round 0 {other}", f"round 1 {other}", f"round 1 {ROOT}"]


def test_bench_limits_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_limits.py"), "--repeat", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = out.stdout.strip().splitlines()[1:]
    assert len(rows) == 6 and rows[0].split()[1] == "15,000"


def test_tune_placement_replays_the_tuning_set_causally_and_chooses_a_candidate(tmp_path: Path) -> None:
    """The committed tuning harness (issue #41) on a small trace, against made-up published curves: every
    candidate's margins at every point, the best worst margin chosen per policy."""
    data = small_trace(tmp_path / "trace")
    paper = data / "fgd-expected-results"
    paper.mkdir()
    points = ",".join(str(k) for k in range(131))
    rows = [
        f"{policy},1.3,openb_pod_list_default,{','.join(str(min(k, 60)) for k in range(131))}"
        for policy in (
            "05-BestFit",
            "06-FGD",
        )
    ]
    (paper / "analysis_allo_discrete.csv").write_text(f"sc_policy,tune,workload,{points}\n" + "\n".join(rows) + "\n")
    out = tmp_path / "tuning.json"
    script = str(ROOT / "scripts" / "tune_placement.py")
    candidates = ["binpack:0:1000", "binpack:8:1000", "fgd:8:0", "fgd:8:1000"]
    tuning = ["--traces", "default", "--candidates", *candidates, "--seeds", "42", "--jobs", "2", "--out", str(out)]
    subprocess.run(
        [sys.executable, script, "--data", str(data), *tuning],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert set(report["chosen"]) == {"binpack", "fgd"} and report["tuningTraces"] == ["default"]
    assert report["expectedMixFrom"] == {"default": "multigpu20"}
    assert {policy: set(values) for policy, values in report["grid"].items()} == {
        "binpack": {"0:1000", "8:1000"},
        "fgd": {"8:0", "8:1000"},
    }
    for policy, values in report["grid"].items():
        for found in values.values():
            assert list(found["perTrace"]["default"]) == ["50", "60", "70", "80", "90", "100", "110", "120", "130"]
            assert found["worst"] == min(found["perTrace"]["default"].values())
        best = max(values, key=lambda v: sorted(m for p in values[v]["perTrace"].values() for m in p.values()))
        assert report["chosen"][policy] == best
    # the grid extended where its edge was best: the new candidate beside the others, chosen among them all
    extend = [
        *tuning[: tuning.index("--candidates")],
        "--candidates",
        "fgd:16:1000",
        *tuning[tuning.index("--seeds") :],
    ]
    subprocess.run([sys.executable, script, "--data", str(data), *extend, "--extend"], check=True, timeout=300)
    extended = json.loads(out.read_text())
    assert set(extended["grid"]["fgd"]) == {"8:0", "8:1000", "16:1000"} and len(extended["commands"]) == 2
    assert extended["grid"]["binpack"] == report["grid"]["binpack"]
    fgd = extended["grid"]["fgd"]
    assert extended["chosen"]["fgd"] == max(fgd, key=lambda v: sorted(fgd[v]["perTrace"]["default"].values()))


def test_the_claim_allocator_replays_as_the_extenders_policy(tmp_path: Path) -> None:
    """The replay's DRA placements (issue #54) on a small trace: the claim allocator with fgd places exactly
    where the extender's fgd does (same claims read, same ledgers, same ties), and kube-scheduler's first fit
    and the allocator without the extender's verbs run beside it."""
    data = small_trace(tmp_path / "trace")
    out = tmp_path / "results"
    placements = [
        "fgd",
        "dra-allocator-fgd",
        "dra-allocator-only-fgd",
        "dra-allocator-steered-fgd",
        "kube-scheduler-dra",
    ]
    script = str(ROOT / "scripts" / "bench_openb.py")
    options = ["--traces", "default", "--seeds", "42", "--no-plots", "--out", str(out), "--policies", *placements]
    subprocess.run(
        [sys.executable, script, "--data", str(data), *options],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    details = json.loads((out / "openb-details.json").read_text())["traces"]["default"]
    assert details["dra-allocator-fgd"]["allocation"] == details["fgd"]["allocation"]
    assert set(details) == set(placements)


def test_bench_claims_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_claims.py"), "--nodes", "2", "--pods", "6", "--rate", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["ungated"] == report["allocated"] == 6
    assert report["created_to_ungated"]["count"] == 6 and report["pods_per_second"] > 0


def test_bench_claims_fence_and_bench_steer_run_and_report() -> None:
    fence = subprocess.run(
        [
            *(sys.executable, str(ROOT / "scripts" / "bench_claims.py"), "--nodes", "2", "--pods", "10"),
            *("--rate", "0", "--ungated", "0.3", "--kube", "unschedulable"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(fence.stdout)
    assert report["ungated"] + report["ungated_at_creation"] == 10
    assert report["not_gated_counted"] == report["ungated_at_creation"] and report["fence_holds"] == 0
    steer = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_steer.py"), "--nodes", "2", "--pods", "6", "--rate", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(steer.stdout)
    assert report["steered"] == 6 and report["created_to_ungated"]["count"] == 6


def test_pinned_traces_derive_and_fgd_is_held_against_binpack(tmp_path: Path) -> None:
    """derive_pinned_traces: the default list's rows with only gpu_spec changed, the share pinned; tune_placement
    --against binpack holds fgd against it on a trace with no paper curve; compare_placement prints the margins."""
    data = small_trace(tmp_path / "trace")
    for name in ("gpuspec05", "gpuspec10", "gpuspec20"):  # the published lists the derivation learns from
        (data / f"openb_pod_list_{name}.csv").write_text((data / "openb_pod_list_default.csv").read_text())
    derived = tmp_path / "derived"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "derive_pinned_traces.py"), "--data", str(data), "--out", str(derived)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    default = (data / "openb_pod_list_default.csv").read_text().splitlines()
    fifty = (derived / "openb_pod_list_gpuspec50.csv").read_text().splitlines()
    assert len(fifty) == len(default)
    columns = default[0].split(",")
    spec = columns.index("gpu_spec")
    for before, after in zip(default[1:], fifty[1:], strict=True):
        a, b = before.split(","), after.split(",")
        assert a[:spec] + a[spec + 1 :] == b[:spec] + b[spec + 1 :]  # nothing but gpu_spec changed
        assert not b[spec] or b[spec] == "T4"  # the only value the published lists give
    gpu_pods = [line.split(",") for line in fifty[1:] if int(line.split(",")[columns.index("num_gpu")])]
    assert sum(1 for row in gpu_pods if row[spec]) == round(0.5 * len(gpu_pods))
    out = tmp_path / "tuning.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "tune_placement.py"),
            "--data",
            str(derived),
            "--traces",
            "gpuspec50",
            "--candidates",
            "fgd:8:1000",
            "--against",
            "binpack:512:1000",
            "--seeds",
            "42",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert report["against"] == "binpack:512:1000" and list(report["grid"]) == ["fgd"]  # the reference is no candidate
    assert list(report["grid"]["fgd"]["8:1000"]["perTrace"]) == ["gpuspec50"]  # held against binpack: no paper curve
    results = tmp_path / "results"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_openb.py"),
            "--data",
            str(derived),
            "--traces",
            "gpuspec50",
            "--policies",
            "fgd",
            "binpack",
            "--seeds",
            "42",
            "--jobs",
            "2",
            "--no-plots",
            "--out",
            str(results),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    table = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compare_placement.py"),
            "--results",
            str(results / "openb.json"),
            "--data",
            str(derived),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "| gpuspec50 |" in table and "—" in table  # no paper curve for a derived trace
