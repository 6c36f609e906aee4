"""The ValidatingAdmissionPolicies of deploy/admission-policy.yaml, evaluated: their CEL runs here (cel-python)
on admission requests as the API server builds them, since the 1.20 test cluster serves no such policies.

Each policy is applied as the API server applies it: its match constraints (operation, resource), its match
conditions, its variables in order, then its validations; a request is denied with the message of the first
validation that is false."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from gpushared import contract
from tests.builders import CHOICE_KEYS

POLICIES = {
    d["metadata"]["name"]: d["spec"]
    for d in yaml.safe_load_all((Path(__file__).parents[2] / "deploy" / "admission-policy.yaml").read_text())
    if d and d["kind"] == "ValidatingAdmissionPolicy"
}
NODE_SA = "system:serviceaccount:kube-system:gpushared-node-"


def _substring(text: celtypes.StringType, start: celtypes.IntType, end: celtypes.IntType | None = None) -> Any:
    """Kubernetes' CEL string library (cel-go's ext.Strings), which cel-python does not carry."""
    return celtypes.StringType(text[int(start) : None if end is None else int(end)])


#: The Kubernetes extensions the policies call.
EXTENSIONS = {"substring": _substring}


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression), functions=EXTENSIONS).evaluate(activation)


def admit(
    name: str,
    *,
    operation: str,
    obj: dict[str, Any],
    old: dict[str, Any] | None = None,
    user: str = "alice",
    resource: str = "pods",
) -> str | None:
    """None when the policy lets the request through (or does not apply to it), else the denial's message."""
    spec = POLICIES[name]
    if not any(
        operation in rule["operations"] and resource in rule["resources"]
        for rule in spec["matchConstraints"]["resourceRules"]
    ):
        return None
    request = {"operation": operation, "userInfo": {"username": user}, "resource": {"resource": resource}}
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(request),
    }
    for condition in spec.get("matchConditions", []):
        if not _evaluate(condition["expression"], activation):
            return None
    variables = celtypes.MapType({})
    activation["variables"] = variables
    for variable in spec.get("variables", []):
        variables[celtypes.StringType(variable["name"])] = _evaluate(variable["expression"], activation)
    for validation in spec["validations"]:
        if not _evaluate(validation["expression"], activation):
            if "messageExpression" in validation:
                return str(_evaluate(validation["messageExpression"], activation))
            return str(validation["message"])
    return None


def pod(annotations: dict[str, str] | None = None, *, node: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "p", "namespace": "t"}, "spec": {"containers": [{"name": "c"}]}}
    if annotations is not None:
        body["metadata"]["annotations"] = annotations
    if node:
        body["spec"]["nodeName"] = node
    return body


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_a_pod_is_never_created_with_what_its_binding_writes(key: str) -> None:
    message = admit("gpushared-tenant-annotations", operation="CREATE", obj=pod({key: "1" * 5000}, node="n1"))
    assert message is not None and "cannot be created with the annotations its Binding writes" in message
    # Aliyun's extender patches them onto a pending pod before its Binding (a cluster in migration): allowed
    assert admit("gpushared-tenant-annotations", operation="UPDATE", obj=pod({key: "1"}), old=pod({})) is None


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        (contract.POD_MPS, "true", True),
        (contract.POD_MPS, "false", True),
        (contract.POD_MPS, "True", False),
        (contract.POD_MPS_THREAD_PERCENTAGE, "1", True),
        (contract.POD_MPS_THREAD_PERCENTAGE, "55", True),
        (contract.POD_MPS_THREAD_PERCENTAGE, "100", True),
        (contract.POD_MPS_THREAD_PERCENTAGE, "0", False),
        (contract.POD_MPS_THREAD_PERCENTAGE, "101", False),
        (contract.POD_MPS_THREAD_PERCENTAGE, "050", False),
        (contract.POD_MPS_THREAD_PERCENTAGE, "9" * 9000, False),
        (contract.POD_MPS_THREAD_PERCENTAGE, "-5", False),
        (contract.POD_MEMORY_ENFORCEMENT, "kill", True),
        (contract.POD_MEMORY_ENFORCEMENT, " Report ", True),
        (contract.POD_MEMORY_ENFORCEMENT, "maybe", False),
    ],
)
def test_the_annotations_a_tenant_may_set_are_well_formed(key: str, value: str, allowed: bool) -> None:
    for operation, old in (("CREATE", None), ("UPDATE", pod({}))):
        message = admit("gpushared-tenant-annotations", operation=operation, obj=pod({key: value}), old=old)
        assert (message is None) is allowed, (operation, message)


def test_the_policy_and_the_daemon_agree_on_well_formed() -> None:
    """What the policy lets through, the contract reads; what it refuses, the contract refuses too."""
    for value in ("1", "55", "100", "0", "101", "050", "-5", "9" * 30):
        admitted = (
            admit(
                "gpushared-tenant-annotations",
                operation="CREATE",
                obj=pod({contract.POD_MPS_THREAD_PERCENTAGE: value}),
            )
            is None
        )
        try:
            contract.parse_thread_percentage(value)
            read = True
        except contract.ContractError:
            read = False
        assert admitted == read or (value == "050" and read), value  # the policy is the stricter on "050"


def test_a_pod_without_annotations_is_created() -> None:
    assert admit("gpushared-tenant-annotations", operation="CREATE", obj=pod()) is None
    assert admit("gpushared-tenant-annotations", operation="CREATE", obj=pod({"team": "a"})) is None


def test_a_bound_pods_allocation_is_frozen() -> None:
    bound = pod({contract.ALIYUN_GPU_MEM_IDX: "0", contract.ALIYUN_GPU_MEM_ASSIGNED: "false"}, node="n1")
    edited = pod({contract.ALIYUN_GPU_MEM_IDX: "1", contract.ALIYUN_GPU_MEM_ASSIGNED: "false"}, node="n1")
    message = admit("gpushared-frozen-allocation", operation="UPDATE", obj=edited, old=bound)
    assert message is not None and "cannot change" in message
    assigned = pod({contract.ALIYUN_GPU_MEM_IDX: "0", contract.ALIYUN_GPU_MEM_ASSIGNED: "true"}, node="n1")
    assert admit("gpushared-frozen-allocation", operation="UPDATE", obj=assigned, old=bound) is None
    # before bind, Aliyun's extender may write them
    assert admit("gpushared-frozen-allocation", operation="UPDATE", obj=edited, old=pod({})) is None


def test_a_bound_pods_compute_share_is_frozen() -> None:
    """Defect (issue #52, item 1): a tenant raised its bound pod's compute request from 50 to 100 and a
    neighbour on the same GPU was refused."""
    asked = {contract.POD_COMPUTE_REQUEST: "50", contract.POD_COMPUTE_LIMIT: "60"}
    bound = pod(asked, node="n1")
    for key, value in ((contract.POD_COMPUTE_REQUEST, "100"), (contract.POD_COMPUTE_LIMIT, "100")):
        edited = pod({**asked, key: value}, node="n1")
        message = admit("gpushared-frozen-allocation", operation="UPDATE", obj=edited, old=bound)
        assert message is not None and "compute" in message, key
        removed = pod({k: v for k, v in asked.items() if k != key}, node="n1")
        assert admit("gpushared-frozen-allocation", operation="UPDATE", obj=removed, old=bound) is not None
    # before bind, the owner may still change what it asks
    assert (
        admit(
            "gpushared-frozen-allocation",
            operation="UPDATE",
            obj=pod({**asked, contract.POD_COMPUTE_REQUEST: "100"}),
            old=pod(asked),
        )
        is None
    )


def test_a_node_identity_changes_only_its_own_pods_and_node() -> None:
    mine, other = pod({}, node="n1"), pod({}, node="n2")
    user = NODE_SA + "n1"
    assert admit("gpushared-node-scope-pods", operation="UPDATE", obj=mine, old=mine, user=user) is None
    message = admit("gpushared-node-scope-pods", operation="UPDATE", obj=other, old=other, user=user)
    assert message == "gpushared of node n1 may change only the pods bound to it"
    node = {"metadata": {"name": "n2"}}
    for resource in ("nodes", "nodes/status"):
        message = admit(
            "gpushared-node-scope-nodes", operation="UPDATE", obj=node, old=node, user=user, resource=resource
        )
        assert message == "gpushared of node n1 may change only its own Node"
    own = {"metadata": {"name": "n1"}}
    assert (
        admit("gpushared-node-scope-nodes", operation="UPDATE", obj=own, old=own, user=user, resource="nodes") is None
    )
    # other identities are not this policy's to limit
    assert admit("gpushared-node-scope-pods", operation="UPDATE", obj=other, old=other, user="alice") is None


def test_each_node_scope_policy_reads_only_fields_of_the_kind_it_matches() -> None:
    """The API server type-checks each expression against every kind its policy matches: a Node has no
    spec.nodeName (v1.36.2 warned so of the single policy these two replace)."""
    pods_policy = str(POLICIES["gpushared-node-scope-pods"])
    nodes_policy = POLICIES["gpushared-node-scope-nodes"]
    assert "nodeName" in pods_policy and "nodeName" not in str(nodes_policy)
    assert {r for rule in nodes_policy["matchConstraints"]["resourceRules"] for r in rule["resources"]} == {
        "nodes",
        "nodes/status",
    }


def test_only_gpushared_writes_a_nodes_gpu_inventory() -> None:
    """Defect (issue #39): GPU 3 inflated from 8 to 80 GiB in the inventory annotation stayed, and the extender
    bound a 40 GiB pod there that Allocate then refused."""
    before = {"metadata": {"name": "n1", "annotations": {contract.NODE_INVENTORY: '{"version":1,"gpus":[8]}'}}}
    after = {"metadata": {"name": "n1", "annotations": {contract.NODE_INVENTORY: '{"version":1,"gpus":[80]}'}}}
    for resource in ("nodes", "nodes/status"):
        message = admit("gpushared-node-inventory", operation="UPDATE", obj=after, old=before, resource=resource)
        assert message is not None and "written by the node's gpushared daemon alone" in message
        for user in (NODE_SA + "n1", "system:serviceaccount:kube-system:gpushared-node"):
            assert admit("gpushared-node-inventory", operation="UPDATE", obj=after, old=before, user=user) is None
    labelled = {"metadata": {**before["metadata"], "labels": {"team": "a"}}}
    assert admit("gpushared-node-inventory", operation="UPDATE", obj=labelled, old=before, resource="nodes") is None
    bare = {"metadata": {"name": "n1"}}
    assert admit("gpushared-node-inventory", operation="UPDATE", obj=after, old=bare, resource="nodes") is not None
