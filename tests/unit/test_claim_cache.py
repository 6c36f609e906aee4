"""The claim allocator's cache (``extender.claims.cache``): claims as the watch and the allocator's own writes show
them, each DRA node's ledger of claims (allocated and assumed, never both), the devices nodes publish, and
what the webhook reads."""

from __future__ import annotations

from typing import Any

from gpushared.contract import dra
from gpushared.core.dra.slices import slice_body, slice_devices
from gpushared.core.placement.claims.pods import PodClaimRef
from gpushared.core.shared.ledger import Holding
from gpushared.extender.claims.cache import ClaimCache
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


def used(claim_cache: ClaimCache) -> list[int]:
    ledger = claim_cache.ledger("n1", INV)
    return [ledger.used(gpu.index) for gpu in INV.gpus]


def test_a_write_of_ours_is_not_undone_by_the_watch_showing_an_older_version() -> None:
    claim_cache = ClaimCache()
    pending = claim("c", "5")
    claim_cache.on_claim(None, pending)
    claim_cache.written(claim("c", "7", on=0))  # what our status write returned
    assert used(claim_cache) == [4, 0]
    claim_cache.on_claim(None, claim("c", "6"))  # the watch catching up with a change from before our write
    assert used(claim_cache) == [4, 0]
    claim_cache.on_claim(None, claim("c", "7", on=0))
    claim_cache.on_claim(claim("c", "7", on=0), None)  # deleted
    assert used(claim_cache) == [0, 0]
    claim_cache.on_claim(None, claim("c", "3", uid="u2"))  # made again: a new claim, whatever its version
    assert claim_cache.claim("ns", "c") is not None and used(claim_cache) == [0, 0]


def test_an_assumed_allocation_counts_until_the_claim_shows_it_and_never_twice() -> None:
    claim_cache = ClaimCache()
    claim_cache.on_claim(None, claim("c", "5"))
    claim_cache.assume(
        "u1", "n1", [Holding(uid="u1/gpu", namespace="ns", name="resourceclaim/c", gpus={1: 4}, assigned=True)]
    )
    assert used(claim_cache) == [0, 4]
    claim_cache.on_claim(None, claim("c", "6", on=1))
    assert used(claim_cache) == [0, 4] and not claim_cache.assumed
    claim_cache.assume(
        "u9", "n1", [Holding(uid="u9/gpu", namespace="ns", name="resourceclaim/d", gpus={0: 2}, assigned=True)]
    )
    claim_cache.forget("u9")
    assert used(claim_cache) == [0, 4]


def test_nodes_publish_the_devices_of_their_slices_of_this_driver_only() -> None:
    claim_cache = ClaimCache()
    ours = slice_body(node="n1", node_uid=None, generation=1, devices=slice_devices(INV))
    theirs = {"metadata": {"name": "nic"}, "spec": {"driver": "nic.example.com", "nodeName": "n1", "devices": []}}
    claim_cache.on_slice(None, ours)
    claim_cache.on_slice(None, theirs)
    assert claim_cache.published() == {"n1": frozenset(dra.device_name(g.uuid) for g in INV.gpus)}
    assert claim_cache.published() is claim_cache.published()  # kept until a slice changes
    claim_cache.on_slice(ours, None)
    assert claim_cache.published() == {}


def test_the_webhook_reads_a_snapshot_taken_after_each_drain() -> None:
    claim_cache = ClaimCache()
    claim_cache.on_claim(None, claim("c", "1"))
    claim_cache.on_claim(None, claim("n", "1", uid="u2", cls="nic.example.com"))
    claim_cache.on_template(
        None, {"metadata": {"namespace": "ns", "name": "t"}, "spec": {"spec": claim("x", "1")["spec"]}}
    )
    pod = {"spec": {"resourceClaims": [
        {"name": "a", "resourceClaimName": "c"},
        {"name": "b", "resourceClaimName": "n"},
        {"name": "c", "resourceClaimTemplateName": "t"},
        {"name": "d", "resourceClaimName": "unknown"},
    ]}}  # fmt: skip
    refs = [PodClaimRef(False, "c"), PodClaimRef(False, "n"), PodClaimRef(True, "t"), PodClaimRef(False, "unknown")]
    assert list(claim_cache.gating_of(pod, "ns").values()) == [None] * 4  # type: ignore[arg-type]
    claim_cache.drain()
    assert claim_cache.gating_of(pod, "ns") == dict(zip(refs, [True, False, True, None], strict=True))  # type: ignore[arg-type]
    claim_cache.on_claim(None, claim("c", "2", on=0))  # allocated: a pod naming it now needs no allocation
    claim_cache.drain()
    assert claim_cache.gating_of(pod, "ns")[PodClaimRef(False, "c")] is False  # type: ignore[arg-type]
