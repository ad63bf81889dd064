"""REST requests a careless or hostile client sends, against the real daemon with a real HTTP client (urllib and
raw sockets): a small compressed classify/regress body that expands to a million tf.Examples holds no other call,
a client that goes away mid-body is counted CANCELLED (not logged as an internal error), malformed HTTP leaves no
ERROR traceback in the log, FP16/BF16 inputs refuse what they cannot hold, and v2 metadata of a model without
``serving_default`` is an answer, not an error."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import tensorflow as tf

from tests.conftest import COUNTER, HALF_PLUS_TWO_TF1
from tests.support.daemon import Daemon, metric, model_config_file


@pytest.fixture(scope="session")
def dtypes_model(tmp_path_factory):
    """A model whose ``serving_default`` echoes an FP16 ``h``, a BF16 ``b`` and a DT_STRING ``s`` input."""

    class Echo(tf.Module):
        @tf.function(
            input_signature=[
                tf.TensorSpec([None], tf.float16, name="h"),
                tf.TensorSpec([None], tf.bfloat16, name="b"),
                tf.TensorSpec([None], tf.string, name="s"),
            ]
        )
        def serve(self, h, b, s):
            return {"h": tf.identity(h), "b": tf.identity(b), "s": tf.identity(s)}

    base = tmp_path_factory.mktemp("dtypes")
    module = Echo()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, dtypes_model):
    models = {"half": HALF_PLUS_TWO_TF1, "counter": COUNTER, "dt": dtypes_model}
    config = model_config_file(tmp_path_factory.mktemp("config"), models)
    # Two run workers: the good calls of the stall test never queue behind the large run itself.
    args = [f"--model_config_file={config}", "--num_run_workers=2"]
    daemon = Daemon(args, tmp_path_factory.mktemp("servex"), rest=True)
    yield daemon.wait_serving()
    assert daemon.stop() == 0, daemon.log()


def call(daemon, path: str, body=None, method=None, headers=None, raw: bytes | None = None, timeout: float = 30):
    """(status, parsed JSON answer or b"") of one REST call; ``body`` is sent as JSON, ``raw`` as is."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(daemon.rest_url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
            return response.status, json.loads(text) if text else b""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_exchange(daemon, data: bytes, timeout: float = 5) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``timeout``)."""
    out = b""
    with socket.create_connection(("127.0.0.1", daemon.rest_port), timeout=timeout) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def wait_for(condition, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- a large classify/regress body ------------------------------------------------------------------------


def test_a_million_examples_hold_no_other_call(daemon):
    # 10 MB of JSON, about 20 KB gzipped: a million tf.Examples to build and serialize. Built on the event loop,
    # they held every other call for seconds; on a worker thread, the other calls go on.
    count = 1_000_000
    raw = b'{"signature_name": "regress_x_to_y", "examples": [' + b",".join([b'{"x": 1.0}'] * count) + b"]}"
    body = gzip.compress(raw, 6)
    calls: list[tuple[float, float]] = []  # (sent, answered) of each small predict
    errors: list = []
    stop = threading.Event()

    def small_predicts():
        while not stop.is_set():
            sent = time.monotonic()
            answer = call(daemon, "/v1/models/half:predict", {"instances": [1.0]}, timeout=120)
            if answer != (200, {"predictions": [2.5]}):
                errors.append(answer)
            calls.append((sent, time.monotonic()))
            time.sleep(0.02)

    thread = threading.Thread(target=small_predicts)
    thread.start()
    try:
        assert wait_for(lambda: len(calls) >= 3)
        start = time.monotonic()
        status, answer = call(
            daemon, "/v1/models/half:regress", raw=body, headers={"Content-Encoding": "gzip"}, timeout=300
        )
        end = time.monotonic()
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
    assert status == 200, answer
    assert len(answer["results"]) == count and answer["results"][0] == answer["results"][-1] == 2.5
    assert not errors
    during = [(sent, answered) for sent, answered in calls if answered > start and sent < end]
    # Small calls were answered while the large one was processed, before it was answered, and none waited
    # for most of it (a relative bound: this holds on a slow machine as on a fast one).
    assert sum(answered < end for _, answered in during) >= 3, (during, start, end)
    worst = max(answered - sent for sent, answered in during)
    assert worst < (end - start) / 3, f"a small call waited {worst:.2f}s of the large call's {end - start:.2f}s"


# -- clients that go away, and malformed HTTP -------------------------------------------------------------


def test_a_client_gone_mid_body_is_cancelled_not_an_internal_error(daemon):
    def count(code):
        return metric(daemon, "servex_requests_total", method="rest:predict", code=code)

    cancelled, internal = count("CANCELLED"), count("INTERNAL")
    mark = len(daemon.log())
    with socket.create_connection(("127.0.0.1", daemon.rest_port)) as s:  # 100 bytes announced, 19 sent
        s.sendall(b'POST /v1/models/half:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"instances":[1.0]}')
        time.sleep(0.2)
    assert wait_for(lambda: count("CANCELLED") == cancelled + 1), daemon.log()[mark:]
    assert count("INTERNAL") == internal
    log = daemon.log()[mark:]
    assert "Traceback" not in log and "ERROR" not in log, log
    assert call(daemon, "/v1/models/half:predict", {"instances": [1.0]}) == (200, {"predictions": [2.5]})


MALFORMED = [
    b"POST /v1/models/half:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 10000 + b"\r\n\r\n",
    b"POST /v1/models/half:predict HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /v2/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
]


@pytest.mark.parametrize("data", MALFORMED, ids=["chunk-size", "long-header", "negative-length", "raw-bytes-path"])
def test_malformed_http_is_400_without_an_error_in_the_log(daemon, data):
    mark = len(daemon.log())
    answer = raw_exchange(daemon, data)
    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer[:200]
    time.sleep(0.2)
    log = daemon.log()[mark:]
    assert "Traceback" not in log and "ERROR" not in log, log
    assert call(daemon, "/v2/health/live")[0] == 200


# -- dtypes and metadata ----------------------------------------------------------------------------------

ECHO = {"h": [1.5], "b": [2.0], "s": ["a"]}


@pytest.mark.parametrize(
    ("inputs", "words"),
    [
        ({"h": [100000]}, "cannot convert inputs['h'][0] = 100000 to float16 without loss of precision"),
        ({"h": [2049]}, "inputs['h'][0] = 2049 to float16 without loss of precision"),
        ({"b": [1.0, 1e39]}, "inputs['b'][1] = 1e+39 to bfloat16 without loss of precision (out of its range)"),
        ({"b": [16777217]}, "inputs['b'][0] = 16777217 to bfloat16 without loss of precision"),
    ],
)
def test_half_precision_inputs_refuse_what_they_cannot_hold(daemon, inputs, words):
    status, answer = call(daemon, "/v1/models/dt:predict", {"inputs": {**ECHO, **inputs}})
    assert status == 400 and words in answer["error"], answer
    v2 = {"inputs": [{"name": n, "shape": [len(v)], "datatype": {"h": "FP16", "b": "BF16", "s": "BYTES"}[n], "data": v}
                     for n, v in {**ECHO, **inputs}.items()]}  # fmt: skip
    status, answer = call(daemon, "/v2/models/dt/infer", v2)
    assert status == 400 and words.split("] = ")[1] in answer["error"], answer


def test_half_precision_inputs_take_what_they_hold(daemon):
    status, answer = call(daemon, "/v1/models/dt:predict", {"inputs": {"h": [2047, 0.5], "b": [255, -1.5], "s": ["é"]}})
    assert status == 200, answer
    assert answer["outputs"] == {"h": [2047.0, 0.5], "b": [255.0, -1.5], "s": ["é"]}


def test_lone_surrogates_are_400_naming_the_string(daemon):
    body = b'{"inputs": {"h": [NaN], "b": [1.0], "s": ["ok", "\\ud800"]}}'  # NaN: parsed by the standard library
    status, answer = call(daemon, "/v1/models/dt:predict", raw=body)
    assert status == 400 and "the string at inputs.s[1] is not valid Unicode" in answer["error"], answer
    body = b'{"signature_name": "regress_x_to_y", "examples": [{"x": 1.0}, {"\\udc00": 1.0}]}'
    status, answer = call(daemon, "/v1/models/half:regress", raw=body)
    assert status == 400 and "the key '\\udc00' of examples[1]" in answer["error"], answer


def test_v2_metadata_of_a_model_without_serving_default(daemon):
    assert call(daemon, "/v2/models/counter/ready")[0] == 200
    status, answer = call(daemon, "/v2/models/counter")
    assert status == 200, answer
    assert answer == {
        "name": "counter",
        "versions": ["123"],
        "platform": "tensorflow_savedmodel",
        "inputs": [],
        "outputs": [],
    }


def test_rest_api_timeout_bounds_the_whole_call_as_in_tensorflow_serving(tmp_path, slow_model):
    # A run of about 3 s against a 300 ms timeout: the run starts at once (nothing queued) and the call is
    # answered 504 at the timeout, as TensorFlow Serving's RunOptions timeout answers; the run finishes on its
    # worker. Another worker serves the next call meanwhile.
    args = [f"--model_base_path={slow_model}", "--model_name=slow", "--num_run_workers=2",
            "--rest_api_timeout_in_ms=300", "--xla=false"]  # fmt: skip
    daemon = Daemon(args, tmp_path, rest=True).wait_serving()
    try:
        status, answer = call(daemon, "/v1/models/slow:predict", {"inputs": {"iterations": 1_200_000}})
        assert status == 504, answer
        assert "no answer within --rest_api_timeout_in_ms (300 ms)" in answer["error"]
        status, answer = call(daemon, "/v1/models/slow:predict", {"inputs": {"iterations": 3}})
        assert (status, answer) == (200, {"outputs": 3})
        assert metric(daemon, "servex_requests_total", method="rest:predict", code="DEADLINE_EXCEEDED") == 1
    finally:
        assert daemon.stop() == 0, daemon.log()
