"""The DRA driver's books and calls against a broken world (daemon.dra.book, daemon.dra.DraDriver): damaged
checkpoint files, hostile UIDs, a second driver on the node, a hanging API server, and unprepare by a UID
under another name. Real files in a temporary directory; the API server is a stand-in that hangs or fails
on cue."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpushared.core.dra.allocated import ClaimRef
from gpushared.core.dra.prepare import PreparedClaim, decide
from gpushared.core.node.allocate import NodeFacts
from gpushared.core.shared.ledger import Ledger
from gpushared.daemon.dra import driver as dra_module
from gpushared.daemon.dra.book import CDI_PREFIX, MAX_RECORD_BYTES, ClaimBook, DriverLock
from gpushared.daemon.dra.driver import DraDriver
from gpushared.kube.errors import KubeError, NotFound
from tests.unit.test_dra_prepare import G0, G1, NODE, claim, result


def ref(name: str) -> ClaimRef:
    return ClaimRef("team", name, f"uid-{name}")


def body(r: ClaimRef, *results: dict[str, Any]) -> dict[str, Any]:
    made = claim(*results, uid=r.uid)
    made["metadata"]["name"] = r.name
    return made


def prepared(r: ClaimRef, memory: str = "4Gi", device: str = G0) -> PreparedClaim:
    outcome = decide(r, body(r, result(device, memory)), NODE)
    assert isinstance(outcome, PreparedClaim), outcome
    return outcome


def book_at(tmp_path: Path) -> ClaimBook:
    return ClaimBook(directory=tmp_path / "claims", cdi_root=tmp_path / "cdi", legacy=tmp_path / "checkpoint.json")


def spec(tmp_path: Path, uid: str) -> Path:
    return tmp_path / "cdi" / f"{CDI_PREFIX}{uid}.json"


# --- damaged checkpoint files: set aside, reported, the daemon starts -----------------------------------------


def _damage_utf8(path: Path) -> None:
    path.write_bytes(b'{"version": 1, "claims": [{"namespace": "\xff\xfe"}]}')


def _damage_nested(path: Path) -> None:
    path.write_text('{"version": 1, "claims": ' + "[" * 50_000 + "]" * 50_000 + "}")


def _damage_env_list(path: Path) -> None:
    record = json.loads(path.read_text())
    record["claims"][0]["cdi"][0]["env"] = ["A=1"]
    path.write_text(json.dumps(record))


def _damage_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _damage_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _damage_link(path: Path) -> None:
    path.unlink()
    path.symlink_to("/etc/passwd")


def _damage_huge(path: Path) -> None:
    path.write_text(" " * (MAX_RECORD_BYTES + 1))


def _damage_other_uid(path: Path) -> None:
    path.write_text(path.read_text().replace('"uid-bad"', '"uid-good"'))


DAMAGE = {
    "invalid UTF-8": _damage_utf8,
    "JSON nested 50,000 deep": _damage_nested,
    "env as a list": _damage_env_list,
    "a directory": _damage_directory,
    "a FIFO": _damage_fifo,
    "a symbolic link": _damage_link,
    "past its size limit": _damage_huge,
    "another claim's UID in its body": _damage_other_uid,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_record_is_set_aside_and_its_neighbours_and_its_spec_are_kept(tmp_path: Path, damage: Any) -> None:
    book = book_at(tmp_path)
    book.load()
    good, bad = ref("good"), ref("bad")
    book.record(prepared(good))
    book.record(prepared(bad, "2Gi"))
    damage(tmp_path / "claims" / f"{bad.uid}.json")
    again = book_at(tmp_path)
    started = time.monotonic()
    damaged = again.load()
    assert time.monotonic() - started < 2, "bounded work"
    assert [c.ref for c in again.claims()] == [good]
    assert len(damaged) == 1 and f"{bad.uid}.json" in damaged[0] and "kept as" in damaged[0]
    assert os.path.lexists(tmp_path / "claims" / f"{bad.uid}.json.unreadable")
    assert spec(tmp_path, bad.uid).exists(), "a running pod's container may need its spec again"
    assert book_at(tmp_path).load() == [], "set aside once"


def test_a_uid_that_is_a_path_is_never_written_or_read(tmp_path: Path) -> None:
    book = book_at(tmp_path)
    book.load()
    hostile = ClaimRef("team", "x", "../../../../tmp/x")
    with pytest.raises(ValueError, match="not a Kubernetes UID"):
        book.record(PreparedClaim(hostile, ()))
    with pytest.raises(ValueError, match="not a Kubernetes UID"):
        book.cdi_path("a/b")
    # a checkpoint record naming a traversal UID in its body: set aside, nothing written outside
    (tmp_path / "claims" / "uid-z.json").write_text(
        json.dumps(
            {"version": 1, "claims": [{"namespace": "n", "name": "z", "uid": "../../z", "devices": [], "cdi": []}]}
        )
    )
    assert len(book_at(tmp_path).load()) == 1
    assert not (tmp_path.parent / "z").exists()
    assert not (tmp_path / "cdi").exists() or not list((tmp_path / "cdi").iterdir())


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b"\xff\xfe\x00"),
        lambda p: p.write_text("[" * 50_000),
        lambda p: p.mkdir(),
        lambda p: p.write_text(
            '{"version": 1, "claims": [{"namespace": "n", "name": "c", "uid": "u", "devices": {}}]}'
        ),
    ],
    ids=["invalid UTF-8", "nested", "a directory", "devices an object"],
)
def test_a_damaged_single_file_checkpoint_is_set_aside(tmp_path: Path, damage: Any) -> None:
    damage(tmp_path / "checkpoint.json")
    book = book_at(tmp_path)
    (damaged,) = book.load()
    assert "checkpoint.json" in damaged and (tmp_path / "checkpoint.json.unreadable").exists()
    assert book.claims() == []


def test_the_single_file_checkpoint_is_split_into_records_once(tmp_path: Path) -> None:
    from gpushared.core.dra.checkpoint import format_checkpoint

    claims = [prepared(ref("a")), prepared(ref("b"), "2Gi", G1)]
    (tmp_path / "checkpoint.json").write_text(format_checkpoint(claims))
    book = book_at(tmp_path)
    assert book.load() == []
    assert sorted(c.ref for c in book.claims()) == [ref("a"), ref("b")]
    assert not (tmp_path / "checkpoint.json").exists()
    assert spec(tmp_path, "uid-a").exists() and spec(tmp_path, "uid-b").exists()
    assert sorted(c.ref for c in book_at_loaded(tmp_path).claims()) == [ref("a"), ref("b")], "from the records"


def book_at_loaded(tmp_path: Path) -> ClaimBook:
    book = book_at(tmp_path)
    book.load()
    return book


def test_a_spec_no_record_names_is_removed_and_a_lost_spec_rewritten(tmp_path: Path) -> None:
    book = book_at_loaded(tmp_path)
    book.record(prepared(ref("a")))
    spec(tmp_path, "uid-a").unlink()
    spec(tmp_path, "orphan").write_text("{}")
    book_at_loaded(tmp_path)
    assert spec(tmp_path, "uid-a").exists() and not spec(tmp_path, "orphan").exists()


# --- one driver per node ----------------------------------------------------------------------------------


def test_a_second_driver_is_refused_until_the_first_lets_go(tmp_path: Path) -> None:
    first, second = DriverLock(tmp_path / "driver.lock"), DriverLock(tmp_path / "driver.lock")
    assert first.acquire() is None
    assert second.acquire() == f"process {os.getpid()}"
    first.release()
    assert second.acquire() is None
    second.release()


# --- the driver's calls with a hanging or failing API server ---------------------------------------------


class SlowApi:
    """``get_claim`` answers from ``claims``; names in ``hang`` wait until released (or their timeout)."""

    def __init__(self, claims: Mapping[str, dict[str, Any]]) -> None:
        self.claims = dict(claims)
        self.hang: set[str] = set()
        self.fail: dict[str, list[KubeError]] = {}
        self.reads = 0
        self.release = threading.Event()
        self.hanging = threading.Event()
        self.pauses: list[float] = []

    def get_claim(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
        self.reads += 1
        if name in self.hang:
            self.hanging.set()
            self.release.wait(timeout)
            raise KubeError(f"get ResourceClaim {namespace}/{name}: read timed out", status=None)
        failures = self.fail.get(name)
        if failures:
            raise failures.pop(0)
        if name not in self.claims:
            raise NotFound(f"get ResourceClaim {namespace}/{name}: 404", status=404)
        return self.claims[name]


def node_facts() -> NodeFacts:
    """The test node's facts as the driver reads them, with an empty ledger."""
    return NodeFacts(
        name="n1",
        inventory=NODE.inventory,
        ledger=Ledger(NODE.inventory),
        minors=NODE.minors,
        present_devices=NODE.present_devices,
        mps=NODE.mps,
    )


def driver_with(tmp_path: Path, api: SlowApi) -> DraDriver:
    facts = node_facts()
    return DraDriver(
        node="n1",
        api=api,  # type: ignore[arg-type]
        book=book_at_loaded(tmp_path),
        facts=lambda: facts,
        sleep=api.pauses.append,
    )


def test_calls_the_checkpoint_answers_do_not_wait_on_a_hanging_read(tmp_path: Path) -> None:
    a, b, slow = ref("a"), ref("b"), ref("slow")
    api = SlowApi({r.name: body(r, result(G0, "2Gi")) for r in (a, b, slow)})
    driver = driver_with(tmp_path, api)
    assert isinstance(driver.prepare([a, b])[a.uid], PreparedClaim)
    api.hang.add("slow")
    hanging = threading.Thread(target=driver.prepare, args=([slow],))
    hanging.start()
    try:
        assert api.hanging.wait(5)
        started = time.monotonic()
        again = driver.prepare([a])
        assert isinstance(again[a.uid], PreparedClaim)
        assert driver.unprepare([b]) == {b.uid: ""}
        assert time.monotonic() - started < 1.0
    finally:
        api.hang.clear()
        api.release.set()
        hanging.join()


def test_a_call_spends_its_deadline_at_most_and_answers_each_claim_for_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dra_module, "PREPARE_BUDGET_SECONDS", 1.5)
    names = ["a", "b", "c", "d"]
    api = SlowApi({n: body(ref(n), result(G0, "1Gi")) for n in names})
    api.hang.update({"b", "d"})
    driver = driver_with(tmp_path, api)
    started = time.monotonic()
    answers = driver.prepare([ref(n) for n in names], deadline=time.monotonic() + 10)
    spent = time.monotonic() - started
    api.release.set()
    assert spent < 2.0, f"{spent:.1f} s for a 1.5 s budget"
    assert isinstance(answers["uid-a"], PreparedClaim) and isinstance(answers["uid-c"], PreparedClaim)
    for name in ("b", "d"):
        message = answers[f"uid-{name}"]
        assert isinstance(message, str) and f"team/{name}" in message


def test_a_transient_failure_is_tried_again_within_the_deadline(tmp_path: Path) -> None:
    a = ref("a")
    api = SlowApi({"a": body(a, result(G0, "1Gi"))})
    api.fail["a"] = [KubeError("503", status=503), KubeError("connection reset", status=None)]
    answer = driver_with(tmp_path, api).prepare([a])[a.uid]
    assert isinstance(answer, PreparedClaim) and api.reads == 3 and api.pauses == [0.5, 0.5]


def test_the_kubelets_deadline_bounds_the_call(tmp_path: Path) -> None:
    api = SlowApi({})
    api.hang.add("a")
    started = time.monotonic()
    (answer,) = driver_with(tmp_path, api).prepare([ref("a")], deadline=time.monotonic() + 0.5).values()
    api.release.set()
    assert time.monotonic() - started < 1.0
    assert "team/a" in str(answer) and ("in time" in str(answer) or "timed out" in str(answer))


def test_two_calls_at_once_never_take_the_same_room(tmp_path: Path) -> None:
    claims = [ref(f"c{i}") for i in range(8)]
    api = SlowApi({r.name: body(r, result(G0, "4Gi")) for r in claims})  # GPU 0 has 15 GiB: three fit
    driver = driver_with(tmp_path, api)
    answers: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda r=r: answers.update(driver.prepare([r]))) for r in claims]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(a, PreparedClaim) for a in answers.values()) == 3
    assert sum(d.memory for c in driver.book.claims() for d in c.devices) == 12


# --- unprepare names the claim whole -------------------------------------------------------------------------


def test_unprepare_by_a_uid_under_another_name_removes_nothing(tmp_path: Path) -> None:
    a = ref("a")
    api = SlowApi({"a": body(a, result(G0, "2Gi"))})
    driver = driver_with(tmp_path, api)
    assert isinstance(driver.prepare([a])[a.uid], PreparedClaim)
    forged = ClaimRef("other", "b", a.uid)
    (error,) = driver.unprepare([forged]).values()
    assert "prepared here as team/a, not as other/b" in error
    assert spec(tmp_path, a.uid).exists() and driver.book.get(a.uid) is not None
    (refused,) = driver.prepare([forged]).values()
    assert isinstance(refused, str) and "prepared here as team/a" in refused
    assert driver.unprepare([a]) == {a.uid: ""} and not spec(tmp_path, a.uid).exists()
