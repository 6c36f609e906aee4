"""The claim allocator's book (``extender.claimbook``): claims as the watch and the allocator's own writes show
them, each DRA node's ledger of claims (allocated and assumed, never both), the devices nodes publish, and
what the webhook reads."""

from __future__ import annotations

from typing import Any

from gpushared.contract import dra
from gpushared.core.dra.slices import slice_body, slice_devices
from gpushared.core.placement.claims.pods import ClaimRef
from gpushared.core.shared.ledger import Holding
from gpushared.extender.claims.book import ClaimBook
from tests.builders import inventory

INV = inventory(16, 8)
GI = 2**30


def claim(name: str, rv: str, *, on: int | None = None, uid: str = "u1", cls: str = dra.DEVICE_CLASS) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"namespace": "ns", "name": name, "uid": uid, "resourceVersion": rv},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": cls}}]}},
    }
    if on is not None:
        result = {
            "request": "gpu",
            "driver": dra.DRIVER,
            "pool": "n1",
            "device": dra.device_name(INV.gpus[on].uuid),
            "consumedCapacity": {"memory": str(4 * GI)},
        }
        selector = {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
        }
        body["status"] = {"allocation": {"devices": {"results": [result]}, "nodeSelector": selector}}
    return body


def used(book: ClaimBook) -> list[int]:
    ledger = book.ledger("n1", INV)
    return [ledger.used(gpu.index) for gpu in INV.gpus]


def test_a_write_of_ours_is_not_undone_by_the_watch_showing_an_older_version() -> None:
    book = ClaimBook()
    pending = claim("c", "5")
    book.on_claim(None, pending)
    book.written(claim("c", "7", on=0))  # what our status write returned
    assert used(book) == [4, 0]
    book.on_claim(None, claim("c", "6"))  # the watch catching up with a change from before our write
    assert used(book) == [4, 0]
    book.on_claim(None, claim("c", "7", on=0))
    book.on_claim(claim("c", "7", on=0), None)  # deleted
    assert used(book) == [0, 0]
    book.on_claim(None, claim("c", "3", uid="u2"))  # made again: a new claim, whatever its version
    assert book.claim("ns", "c") is not None and used(book) == [0, 0]


def test_an_assumed_allocation_counts_until_the_claim_shows_it_and_never_twice() -> None:
    book = ClaimBook()
    book.on_claim(None, claim("c", "5"))
    book.assume("u1", "n1", [Holding(uid="u1/gpu", namespace="ns", name="resourceclaim/c", gpus={1: 4}, assigned=True)])
    assert used(book) == [0, 4]
    book.on_claim(None, claim("c", "6", on=1))
    assert used(book) == [0, 4] and not book.assumed
    book.assume("u9", "n1", [Holding(uid="u9/gpu", namespace="ns", name="resourceclaim/d", gpus={0: 2}, assigned=True)])
    book.forget("u9")
    assert used(book) == [0, 4]


def test_nodes_publish_the_devices_of_their_slices_of_this_driver_only() -> None:
    book = ClaimBook()
    ours = slice_body(node="n1", node_uid=None, generation=1, devices=slice_devices(INV))
    theirs = {"metadata": {"name": "nic"}, "spec": {"driver": "nic.example.com", "nodeName": "n1", "devices": []}}
    book.on_slice(None, ours)
    book.on_slice(None, theirs)
    assert book.published() == {"n1": frozenset(dra.device_name(g.uuid) for g in INV.gpus)}
    assert book.published() is book.published()  # kept until a slice changes
    book.on_slice(ours, None)
    assert book.published() == {}


def test_the_webhook_reads_a_snapshot_taken_after_each_drain() -> None:
    book = ClaimBook()
    book.on_claim(None, claim("c", "1"))
    book.on_claim(None, claim("n", "1", uid="u2", cls="nic.example.com"))
    book.on_template(None, {"metadata": {"namespace": "ns", "name": "t"}, "spec": {"spec": claim("x", "1")["spec"]}})
    pod = {"spec": {"resourceClaims": [
        {"name": "a", "resourceClaimName": "c"},
        {"name": "b", "resourceClaimName": "n"},
        {"name": "c", "resourceClaimTemplateName": "t"},
        {"name": "d", "resourceClaimName": "unknown"},
    ]}}  # fmt: skip
    refs = [ClaimRef(False, "c"), ClaimRef(False, "n"), ClaimRef(True, "t"), ClaimRef(False, "unknown")]
    assert list(book.gating_of(pod, "ns").values()) == [None] * 4  # type: ignore[arg-type]
    book.drain()
    assert book.gating_of(pod, "ns") == dict(zip(refs, [True, False, True, None], strict=True))  # type: ignore[arg-type]
    book.on_claim(None, claim("c", "2", on=0))  # allocated: a pod naming it now needs no allocation
    book.drain()
    assert book.gating_of(pod, "ns")[ClaimRef(False, "c")] is False  # type: ignore[arg-type]
