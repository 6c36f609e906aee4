"""The extender's HTTP face: metrics, connections, bad and slow bodies, the webhook, TLS, client auth."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import admission_review, pod
from tests.extender_harness import Extender
from tests.fakes.apiserver import FakeApiServer, Fault
from tests.harness import wait_until


def test_metrics_and_version(api: FakeApiServer, extender: Extender) -> None:
    extender.filter(api.create(pod("p", 1)), "n1")
    status, text = extender.get("/metrics")
    assert status == 200
    assert b'gpushared_extender_request_seconds_count{verb="filter"} 1.0' in text
    assert extender.get("/version") == (200, b"0.1.0\n")
    status, body = extender.get("/gpushare-scheduler/inspect/ghost")
    assert status == 404
    assert b"not a gpushared node" in body


def test_connections_are_counted_once_each(extender: Extender) -> None:
    """The churn of kube-scheduler's connections shows: each accepted connection counts once, however many
    requests it carries."""
    import http.client
    import re

    def connections() -> float:
        text = extender.get("/metrics")[1].decode()  # a connection of its own
        return float(re.search(r'^gpushared_extender_connections_total{protocol="http/1.1"} (\S+)$', text, re.M)[1])  # type: ignore[index]

    before = connections()
    extender.get("/healthz"), extender.get("/version")
    kept = http.client.HTTPConnection("127.0.0.1", extender.port, timeout=10)
    for _ in range(3):
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() == b"ok\n"
    kept.close()
    assert connections() - before == 4  # the first read's, two single requests, one kept alive


@pytest.mark.parametrize(
    ("verb", "body", "message"),
    [
        ("filter", b"{", "filter: body is not JSON"),
        ("filter", b"[]", "filter: body must be a JSON object"),
        ("filter", {"Pod": "x", "NodeNames": []}, "'Pod' must be a Kubernetes Pod object"),
        ("filter", {"Pod": {"metadata": {}}}, "neither 'NodeNames' nor 'Nodes' given"),
        ("prioritize", {"Pod": {"metadata": {}}, "NodeNames": [1]}, "'NodeNames' must be a list of node names"),
        ("bind", {"PodName": "p", "PodNamespace": "d", "PodUID": "u"}, "'Node' must be a non-empty string"),
    ],
)
def test_malformed_bodies_get_400_with_the_reason(extender: Extender, verb: str, body: Any, message: str) -> None:
    status, result = extender.post(verb, body)
    assert status == 400
    assert message in result["Error"]


def test_a_body_over_the_limit_is_refused(api: FakeApiServer, spawn: Callable[..., Extender]) -> None:
    ext = spawn(api, args=["--max-body-mib", "1"])
    ext.wait_ready()
    status, result = ext.post("filter", b'{"Pod": "' + b"x" * (2 * 2**20) + b'"}')
    assert status == 413
    assert "body larger than 1048576 bytes" in result["Error"]
    ext.stop()


def test_a_body_slower_than_the_read_timeout_is_refused(extender: Extender) -> None:
    """A caller that stops half-way through its body must not hold a verb forever (the timeout is 10 s)."""
    with socket.create_connection(("127.0.0.1", extender.port), timeout=30) as conn:
        conn.sendall(
            b"POST /gpushare-scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"Pod": '
        )
        answer = conn.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"filter: request body too slow" in answer


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


go_keys = st.sampled_from(["Pod", "pod", "NodeNames", "Nodes", "PodName", "PodNamespace", "PodUID", "Node", "x"])


bodies = st.dictionaries(go_keys, json_values | st.fixed_dictionaries({"metadata": json_values, "spec": json_values}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(verb=st.sampled_from(["filter", "prioritize", "bind", "mutate"]), body=bodies)
def test_generated_malformed_bodies_never_crash_the_service(
    extender: Extender, verb: str, body: dict[str, Any]
) -> None:
    status, result = extender.post(verb, body)
    assert status in (200, 400), (status, result)
    assert isinstance(result, dict | list)
    if status == 400:
        assert result["Error"]


def test_the_webhook_sends_gpu_pods_to_the_second_scheduler_and_lets_others_be(
    api: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    """The AdmissionReview round trip over HTTP, served before the cache has synced (the answer depends on
    the pod alone), with the scheduler name the option gives."""
    api.inject(Fault(status=503, times=None))  # never synced while the test runs
    ext = spawn(api, args=["--webhook-scheduler", "gpu-scheduler"])
    wait_until(lambda: ext.get("/healthz")[0] == 200, timeout=30, message="extender up")
    assert ext.get("/readyz")[0] == 503
    status, answer = ext.post("mutate", admission_review(pod("gpu", 4)))
    assert status == 200, answer
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert patch == [{"op": "add", "path": "/spec/schedulerName", "value": "gpu-scheduler"}]
    status, answer = ext.post("mutate", admission_review(pod("cpu"), version="admission.k8s.io/v1beta1"))
    assert (status, answer) == (
        200,
        {
            "apiVersion": "admission.k8s.io/v1beta1",
            "kind": "AdmissionReview",
            "response": {"uid": "review-1", "allowed": True},
        },
    )
    status, answer = ext.post("mutate", admission_review(pod("gpu", 4), operation="UPDATE"))
    assert status == 200 and "patch" not in answer["response"]
    status, answer = ext.post("mutate", {"kind": "AdmissionReview"})
    assert status == 400 and "apiVersion" in answer["Error"]
    assert "new pod default/gpu asks for aliyun.com/gpu-mem: sent to gpu-scheduler" in ext.log()
    ext.stop()


def test_tls(api: FakeApiServer, tmp_path: Path, spawn: Callable[..., Extender]) -> None:
    import ssl
    import subprocess
    import urllib.request

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    ext = spawn(api, args=["--tls-cert", str(cert), "--tls-key", str(key)])
    context = ssl.create_default_context(cafile=str(cert))

    def https(path: str) -> int:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{ext.port}{path}", context=context, timeout=5) as r:
                return int(r.status)
        except OSError:
            return 0

    wait_until(lambda: https("/readyz") == 200, timeout=30, message="https ready")
    assert ext.get("/healthz")[0] == 0  # plain HTTP is not served
    ext.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_large_admission_reviews_do_not_hold_the_event_loop(
    api: FakeApiServer, spawn: Callable[..., Extender], tmp_path: Path, tls: bool
) -> None:
    """Defect (issue #39): 16 clients sending 5.4 MiB admission reviews to the webhook (which asks no
    certificate) held the event loop 0.72 s and /healthz 2-3 s. The reviews are now read off the loop."""
    import threading
    import time

    from tests.pki import Authority

    if tls:
        pki = Authority(tmp_path / "pki")
        server = pki.issue("extender", common_name="127.0.0.1", server=True)
        ext = spawn(api, ca=pki.cert, args=["--tls-cert", str(server.cert), "--tls-key", str(server.key)])
    else:
        ext = spawn(api)
    ext.wait_ready()
    big = pod("big", 4)
    big["spec"]["containers"][0]["env"] = [{"name": f"V{i}", "value": "1"} for i in range(90_000)]
    raw = json.dumps(admission_review(big)).encode()
    assert 2.5 * 2**20 < len(raw) < 3 * 2**20  # the largest pod the API server can send, of small objects
    oversized = json.dumps(admission_review({**big, "spec": {**big["spec"], "pad": "x" * 4 * 2**20}})).encode()
    status, answer = ext.post("mutate", oversized)
    assert status == 413 and f"body larger than {3 * 2**20 + 64 * 2**10} bytes" in answer["Error"]
    slowest = [0.0]
    answered = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            status, _ = ext.get("/healthz")
            slowest[0] = max(slowest[0], time.perf_counter() - started)
            assert status == 200
            time.sleep(0.01)

    def review() -> None:
        for _ in range(2):
            status, answer = ext.post("mutate", raw)
            answered.append(status == 200 and "patch" in answer["response"])

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)
    clients = [threading.Thread(target=review) for _ in range(16)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(120)
    stop.set()
    prober.join()
    assert answered == [True] * 32
    lag = next(
        float(line.split()[1])
        for line in ext.get("/metrics")[1].decode().splitlines()
        if line.startswith("gpushared_extender_event_loop_lag_max_seconds ")
    )
    print(
        f"32 reviews of {len(raw) / 2**20:.1f} MiB: slowest /healthz {slowest[0] * 1000:.0f} ms, "
        f"event loop held {lag * 1000:.0f} ms at most"
    )

    # What the defect was, with room for a loaded 2-core machine (not the figure, which docs/reliability.md
    # gives): the loop held 0.72 s and /healthz waited 2-3 s; now about 0.1 s and 0.5 s here. /healthz is
    # timed from this process, whose 16 senders compete with the probe for its own interpreter.
    assert lag < 0.4, f"the event loop was held {lag:.3f} s"
    assert slowest[0] < 1.5, f"/healthz took {slowest[0]:.3f} s"


def test_bind_without_client_authentication_is_refused_unless_insecure_bind_says_so(
    api: FakeApiServer, spawn: Callable[..., Extender]
) -> None:
    """Defect (issue #39): started without --client-ca, the extender bound any pod for anyone who knew its UID;
    only a startup warning said so. Now bind answers 403 unless --insecure-bind is given on purpose."""
    ext = spawn(api, args=["--no-insecure-bind"])
    ext.wait_ready()
    body = api.create(pod("p", 4))
    status, result = ext.bind(body, "n1")
    assert status == 403 and "--client-ca" in result["Error"]
    assert not (api.get("pods", "p", "default") or {}).get("spec", {}).get("nodeName")
    assert ext.filter(body, "n1")[1]["NodeNames"] == ["n1"]  # reading is no harm
    assert "bind answers 403 to everyone" in ext.log()
    ext.stop()
