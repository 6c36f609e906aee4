"""Which scheduler a new pod goes to (core/placement/admission.py), and the AdmissionReview around it (wire.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gpushared.contract import DEFAULT_RESOURCES, ResourceNames
from gpushared.core.placement.admission import GPUSHARED_SCHEDULER, asks_for_gpu, scheduler_route
from gpushared.extender.http import wire
from tests.builders import GPU_COUNT, GPU_MEM, admission_review, container, pod


def named(body: dict[str, Any], scheduler: str | None) -> dict[str, Any]:
    if scheduler is not None:
        body["spec"]["schedulerName"] = scheduler
    return body


def requested(body: dict[str, Any], resource: str, amount: str = "2") -> dict[str, Any]:
    body["spec"]["containers"][0]["resources"] = {"requests": {resource: amount}}
    return body


SET = ("replace", GPUSHARED_SCHEDULER)
ADD = ("add", GPUSHARED_SCHEDULER)

# case: pod, expected (op, value) or None for no patch, words of the reason
ROUTES = {
    "gpu-mem limit, default scheduler": (named(pod("a", 4), "default-scheduler"), SET, "asks for aliyun.com/gpu-mem"),
    "gpu-mem, no scheduler named yet": (named(pod("b", 4), None), ADD, "sent to gpushared-scheduler"),
    "gpu-mem, empty scheduler name": (named(pod("c", 4), ""), SET, "sent to"),
    "gpu-mem only in an init container": (
        named(pod("d", init=[container("setup", 2)]), "default-scheduler"),
        SET,
        "sent to",
    ),
    "gpu-count alone, as a request": (
        named(requested(pod("e", 0), GPU_COUNT), "default-scheduler"),
        SET,
        "sent to",
    ),
    "gpu-mem of 0 still names the resource": (named(pod("f", 0), "default-scheduler"), SET, "sent to"),
    "a malformed amount is the extender's to refuse": (
        named(requested(pod("g", 0), GPU_MEM, "lots"), "default-scheduler"),
        SET,
        "sent to",
    ),
    "no GPU": (named(pod("h"), "default-scheduler"), None, "asks for no GPU"),
    "another resource only": (
        named(requested(pod("i", 0), "nvidia.com/gpu"), "default-scheduler"),
        None,
        "asks for no GPU",
    ),
    "already ours": (named(pod("j", 4), GPUSHARED_SCHEDULER), None, "already names"),
    "another scheduler chosen on purpose": (named(pod("k", 4), "volcano"), None, "which is its choice"),
}


@pytest.mark.parametrize("case", ROUTES)
def test_scheduler_route(case: str) -> None:
    body, expected, reason = ROUTES[case]
    route = scheduler_route(body, scheduler=GPUSHARED_SCHEDULER, resources=DEFAULT_RESOURCES)
    if expected is None:
        assert route.patch == ()
    else:
        op, value = expected
        assert route.patch == ({"op": op, "path": "/spec/schedulerName", "value": value},)
    assert reason in route.reason


def test_another_resource_domain_is_looked_for_instead() -> None:
    ours = ResourceNames(domain="example.com")
    body = named(pod("a", 4), "default-scheduler")  # aliyun.com/gpu-mem
    assert not asks_for_gpu(body, ours)
    body["spec"]["containers"][0]["resources"] = {"limits": {"example.com/gpu-mem": "4"}}
    assert scheduler_route(body, scheduler="s", resources=ours).patch[0]["value"] == "s"


@pytest.mark.parametrize("version", wire.ADMISSION_VERSIONS)
def test_the_answer_is_in_the_version_asked_and_carries_the_patch(version: str) -> None:
    raw = json.dumps(admission_review(named(pod("a", 4), "default-scheduler"), version=version)).encode()
    review = wire.parse_admission_review(raw)
    assert (review.kind, review.operation, review.namespace, review.uid) == ("Pod", "CREATE", "default", "review-1")
    patch = scheduler_route(review.pod or {}, scheduler=GPUSHARED_SCHEDULER, resources=DEFAULT_RESOURCES).patch
    answer = wire.admission_response(review, patch)
    assert answer["apiVersion"] == version and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "review-1" and response["allowed"] is True and response["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(response["patch"])) == list(patch)


def test_no_patch_means_no_patch_fields() -> None:
    review = wire.parse_admission_review(json.dumps(admission_review(pod("a"))).encode())
    assert wire.admission_response(review, ())["response"] == {"uid": "review-1", "allowed": True}


def test_an_object_that_is_not_a_pod_is_let_through_unread() -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"spec": 1}}
    review = wire.parse_admission_review(json.dumps(admission_review(body)).encode())
    assert review.kind == "ConfigMap" and review.pod is None


def broken(**changes: Any) -> bytes:
    review = admission_review(pod("a", 4))
    for path, value in changes.items():
        target = review
        *parents, last = path.split("__")
        for key in parents:
            target = target[key]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return json.dumps(review).encode()


MALFORMED = {
    "not JSON": (b"{", "body is not JSON"),
    "a list": (b"[]", "must be an AdmissionReview"),
    "another kind": (broken(kind="Pod"), "must be an AdmissionReview"),
    "an unknown version": (broken(apiVersion="admission.k8s.io/v2"), "is not one of admission.k8s.io/v1"),
    "no request": (broken(request=...), "'request' must be an object"),
    "no uid": (broken(request__uid=...), "'request.uid' must be a non-empty string"),
    "a uid too long": (broken(request__uid="u" * 129), "'request.uid'"),
    "no operation": (broken(request__operation=7), "must be strings"),
    "a pod whose containers are not a list": (broken(request__object__spec={"containers": 3}), "must be a list"),
    "a scheduler name that is not a string": (
        broken(request__object__spec={"schedulerName": ["x"]}),
        "'Pod.spec.schedulerName' must be a string",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_reviews_are_refused_with_the_reason(case: str) -> None:
    raw, message = MALFORMED[case]
    with pytest.raises(wire.WireError, match="mutate: ") as caught:
        wire.parse_admission_review(raw)
    assert message in str(caught.value)
