"""TensorFlow Serving's REST API on the real daemon's --rest_api_port, called with a plain HTTP client (urllib)
against TensorFlow Serving's own test models: status, metadata (compared with TensorFlow Serving's own expected
answer), predict in row and columnar format, classify and regress, version and label paths, base64 strings, gzip
bodies, and every kind of bad request (each gets its status and a message naming what was wrong; the daemon
keeps serving)."""

from __future__ import annotations

import base64
import gzip
import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import EXPECTED, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2, TESTDATA
from tests.support.daemon import Daemon, metric

TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"
LIMIT = 1 << 20  # --max_message_bytes of the daemon under test


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, string_model):
    config = tmp_path_factory.mktemp("config") / "models.config"
    config.write_text(
        "model_config_list {\n"
        f'  config {{ name: "tf1" base_path: "{HALF_PLUS_TWO_TF1}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "tf2" base_path: "{HALF_PLUS_TWO_TF2}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "strings" base_path: "{string_model}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "two" base_path: "{TWO_VERSIONS}" model_platform: "tensorflow"\n'
        "           model_version_policy { all {} }\n"
        '           version_labels { key: "stable" value: 123 } version_labels { key: "canary" value: 124 } }\n'
        "}\n"
    )
    daemon = Daemon(
        [f"--model_config_file={config}", f"--max_message_bytes={LIMIT}"], tmp_path_factory.mktemp("servex"), rest=True
    )
    yield daemon.wait_serving()
    assert daemon.stop() == 0, daemon.log()  # SIGTERM: REST and gRPC drain, exit 0


def call(daemon, path: str, body=None, method=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON answer) of one REST call; ``body`` is sent as JSON, ``raw`` as is."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(daemon.rest_url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        assert e.headers["Content-Type"].startswith("application/json"), text
        return e.code, json.loads(text)


def ok(daemon, path, body=None, **kw):
    status, answer = call(daemon, path, body, **kw)
    assert status == 200, answer
    return answer


# -- status and metadata ----------------------------------------------------------------------------------

OK_STATUS = {"error_code": "OK", "error_message": ""}


def test_model_status_as_tensorflow_serving_answers(daemon):
    assert ok(daemon, "/v1/models/tf1") == {
        "model_version_status": [{"version": "123", "state": "AVAILABLE", "status": OK_STATUS}]
    }
    both = ok(daemon, "/v1/models/two")["model_version_status"]
    assert [(s["version"], s["state"]) for s in both] == [("124", "AVAILABLE"), ("123", "AVAILABLE")]  # newest first
    assert [s["version"] for s in ok(daemon, "/v1/models/two/versions/124")["model_version_status"]] == ["124"]
    assert [s["version"] for s in ok(daemon, "/v1/models/two/labels/stable")["model_version_status"]] == ["123"]
    # TensorFlow Serving matches paths case-insensitively
    assert ok(daemon, "/V1/Models/tf1")["model_version_status"][0]["version"] == "123"


def test_metadata_equals_tensorflow_serving_expected_answer(daemon):
    expected = json.loads((EXPECTED / "half_plus_two_model_metadata.json").read_text())
    expected["model_spec"]["name"] = "tf1"
    assert ok(daemon, "/v1/models/tf1/metadata") == expected
    assert ok(daemon, "/v1/models/tf1/versions/123/metadata") == expected
    assert ok(daemon, "/v1/models/two/labels/canary/metadata")["model_spec"]["version"] == "124"


# -- predict ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tf1", "tf2"])
def test_predict_row_and_columnar(daemon, model):
    # TF1's half_plus_two declares x [-1,1], TF2's [1] (a batch of scalars)
    row = (lambda v: [v]) if model == "tf1" else (lambda v: v)
    path = f"/v1/models/{model}:predict"
    assert ok(daemon, path, {"instances": [row(1.0), row(2.0), row(5.0)]}) == {
        "predictions": [row(2.5), row(3.0), row(4.5)]
    }
    assert ok(daemon, path, {"inputs": [row(1.0), row(2)]}) == {"outputs": [row(2.5), row(3.0)]}
    assert ok(daemon, path, {"inputs": {"x": [row(4)]}}) == {"outputs": [row(4.0)]}
    named = {"signature_name": "serving_default", "instances": [{"x": row(1.0)}, {"x": row(3.0)}]}
    assert ok(daemon, path, named) == {"predictions": [row(2.5), row(3.5)]}


@pytest.mark.parametrize("model", ["tf1", "tf2"])
def test_tensorflow_serving_readme_example(daemon, model):
    # TensorFlow Serving's own example, word for word: x is [-1,1] in TF1's export, yet a flat list serves
    answer = ok(daemon, f"/v1/models/{model}:predict", {"instances": [1.0, 2.0, 5.0]})
    assert answer == {"predictions": [2.5, 3.0, 4.5]}


def test_large_answers_are_gzipped_when_the_caller_accepts_it(daemon):
    body = json.dumps({"instances": [[float(i)] for i in range(400)]}).encode()
    request = urllib.request.Request(daemon.rest_url + "/v1/models/tf1:predict", data=body,
                                     headers={"Accept-Encoding": "gzip"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        answer = json.loads(gzip.decompress(response.read()))
    assert answer == {"predictions": [[0.5 * i + 2] for i in range(400)]}


def test_predict_by_version_and_label(daemon):
    body = {"instances": [[2.0]]}
    assert ok(daemon, "/v1/models/two/versions/123:predict", body) == {"predictions": [[3.0]]}
    assert ok(daemon, "/v1/models/two/labels/canary:predict", body) == {"predictions": [[3.0]]}
    assert ok(daemon, "/v1/models/tf1/versions/123:predict", body) == {"predictions": [[3.0]]}


def test_predict_other_signature(daemon):
    # TF1 half_plus_two's regress_x2_to_y3 takes x2 and answers y3 = 0.5 x2 + 3... through predict, by alias
    answer = ok(daemon, "/v1/models/tf1:predict", {"signature_name": "regress_x2_to_y3", "inputs": [[2.0]]})
    assert answer == {"outputs": [[4.0]]}


def test_nan_and_infinity_in_and_out(daemon):
    answer = ok(daemon, "/v1/models/tf1:predict", raw=b'{"instances": [[NaN], [Infinity], [-Infinity], [1.0]]}')
    assert answer["predictions"][3] == [2.5]
    x = answer["predictions"]
    assert x[0][0] != x[0][0] and x[1] == [float("inf")] and x[2] == [float("-inf")]
    # rapidjson's other spellings, which TensorFlow Serving reads as well
    answer = ok(daemon, "/v1/models/tf1:predict", raw=b'{"instances": [[Inf], [-Inf], [-NaN]]}')
    x = answer["predictions"]
    assert x[0] == [float("inf")] and x[1] == [float("-inf")] and x[2][0] != x[2][0]


def test_strings_and_base64(daemon):
    hello = base64.b64encode(b"hello").decode()
    raw = bytes(range(256))
    answer = ok(daemon, "/v1/models/strings:predict", {"instances": [{"b64": hello}, "abc", {"b64": ""}]})
    assert answer["predictions"] == [
        {"upper": "HELLO", "echo_bytes": {"b64": hello}, "length": 5},
        {"upper": "ABC", "echo_bytes": {"b64": base64.b64encode(b"abc").decode()}, "length": 3},
        {"upper": "", "echo_bytes": {"b64": ""}, "length": 0},
    ]
    columnar = ok(daemon, "/v1/models/strings:predict", {"inputs": {"text": [{"b64": base64.b64encode(raw).decode()}]}})
    assert base64.b64decode(columnar["outputs"]["echo_bytes"][0]["b64"]) == raw
    assert columnar["outputs"]["length"] == [256]


def test_gzip_and_deflate_bodies(daemon):
    body = json.dumps({"instances": [[1.0], [2.0]]}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", __import__("zlib").compress(body))):
        answer = ok(daemon, "/v1/models/tf1:predict", raw=data, headers={"Content-Encoding": encoding})
        assert answer == {"predictions": [[2.5], [3.0]]}


def test_float32_answers_read_as_the_numbers_tensorflow_serving_writes(daemon):
    """TensorFlow Serving writes float32 with six significant digits where they read back as the same float32,
    else nine: 0.5 * 1.2345678 + 2 is 2.61728382 from it (the shortest decimal, 2.6172838, would parse as another
    double), in predict, classify and regress answers alike."""
    x = 1.2345678
    status, raw = call_raw(daemon, "/v1/models/tf1:predict", {"instances": [[x], [1.0]]})
    assert status == 200 and raw == b'{"predictions":[[2.61728382],[2.5]]}'
    body = {"signature_name": "classify_x_to_y", "examples": [{"x": x}]}
    assert ok(daemon, "/v1/models/tf1:classify", body) == {"results": [[["", 2.61728382]]]}
    body["signature_name"] = "regress_x_to_y"
    assert ok(daemon, "/v1/models/tf1:regress", body) == {"results": [2.61728382]}


def call_raw(daemon, path: str, body) -> tuple[int, bytes]:
    request = urllib.request.Request(daemon.rest_url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read()


# -- classify / regress -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tf1", "tf2"])
def test_classify_and_regress(daemon, model):
    examples = [{"x": 1.0}, {"x": 2.0}]
    answer = ok(daemon, f"/v1/models/{model}:classify", {"signature_name": "classify_x_to_y", "examples": examples})
    assert answer == {"results": [[["", 2.5]], [["", 3.0]]]}
    answer = ok(daemon, f"/v1/models/{model}:regress", {"signature_name": "regress_x_to_y", "examples": examples})
    assert answer == {"results": [2.5, 3.0]}


def test_regress_with_context(daemon):
    # The context's x fills in for an example without one; an example's own x wins over it
    body = {"signature_name": "regress_x_to_y", "context": {"x": 4.0}, "examples": [{"x": 1.0}, {}]}
    assert ok(daemon, "/v1/models/tf1/versions/123:regress", body) == {"results": [2.5, 4.0]}


# -- bad requests -----------------------------------------------------------------------------------------

PREDICT = "/v1/models/tf1:predict"
BAD = [
    # (path, raw body, headers, status, words the message must contain)
    (PREDICT, b'{"instances": [1.0', {}, 400, ["JSON parse error"]),
    (PREDICT, b"", {}, 400, ["empty"]),
    (PREDICT, b"[1, 2]", {}, 400, ["array", "expected an object"]),
    (PREDICT, b'{"instances": [[1]], "inputs": [[1]]}', {}, 400, ["both 'instances' and 'inputs'"]),
    (PREDICT, b'{"x": [[1]]}', {}, 400, ["Missing 'inputs' or 'instances'"]),
    (PREDICT, b'{"instances": []}', {}, 400, ["No values in 'instances'"]),
    (PREDICT, b'{"instances": [["a"]]}', {}, 400, ["input 'x'", "DT_FLOAT", 'instances[0][0] is "a"', "number"]),
    (PREDICT, b'{"instances": [[1.0], [2.0, 3.0]]}', {}, 400, ["ragged", "instances[1] has 2 elements"]),
    (PREDICT, b'{"instances": [{"x": [1.0]}, [2.0]]}', {}, 400, ["instances[1]", "object"]),
    (PREDICT, b'{"instances": [{"y": [1.0]}]}', {}, 400, ["missing ['x']", "unknown ['y']"]),
    (PREDICT, b'{"inputs": {"y": [[1.0]]}}', {}, 400, ["Missing named input(s) ['x']"]),
    (PREDICT, b'{"instances": [[1.0, 2.0]]}', {}, 400, ["input 'x' expects shape [-1,1], got [1, 2]"]),
    (PREDICT, b'{"instances": [[16777217]]}', {}, 400, ["without loss of precision"]),
    (PREDICT, b'{"instances": [[1.0], [true]]}', {}, 400, ["instances[1][0] is true", "expected a number"]),
    (PREDICT, b'{"instances": [[1.0]]}', {"x-servex-priority": "1000000"}, 400, ["from -100 to 100"]),
    (PREDICT, b'{"instances": ' + b"[" * 1000 + b"1.0" + b"]" * 1000 + b"}", {}, 400, ["nested 1000 levels deep"]),
    (PREDICT, b'{"signature_name": 5, "instances": [[1.0]]}', {}, 400, ["'signature_name' must be a string"]),
    (PREDICT, b'{"signature_name": "nope", "instances": [[1.0]]}', {}, 400, ["no signature 'nope'", "serving_default"]),
    # TensorFlow Serving's words first (api_rest.md's example: "Servable not found for request: Latest(half)")
    ("/v1/models/nope:predict", b'{"instances": [[1.0]]}', {}, 404,
     ["Servable not found for request: Latest(nope); 'nope' is not served", "tf1"]),
    ("/v1/models/tf1/versions/7:predict", b'{"instances": [[1.0]]}', {}, 404,
     ["Servable not found for request: Specific(tf1, 7); ", "no version 7", "123"]),
    ("/v1/models/nope:regress", b'{"examples": [{"x": 1.0}]}', {}, 404,
     ["Servable not found for request: Latest(nope)"]),
    ("/v1/models/nope/metadata", None, {}, 404, ["Servable not found for request: Latest(nope)"]),
    ("/v1/models/two/labels/beta:predict", b'{"instances": [[1.0]]}', {}, 400,
     ["Unrecognized servable version label: beta; ", "no version label 'beta'", "canary"]),
    ("/v1/models/strings:predict", b'{"instances": [{"b64": "a$b"}]}', {}, 400, ["not valid base64", "instances[0]"]),
    ("/v1/models/strings:predict", b'{"instances": [5]}', {}, 400, ["instances[0] is 5", "string or"]),
    (PREDICT, b'{"instances": [[1.0]]}', {"x-servex-priority": "high"}, 400, ["x-servex-priority", "integer"]),
    (PREDICT, b'{"instances": [[1.0]]}', {"Content-Encoding": "br"}, 415, ["Content-Encoding 'br'", "gzip"]),
    (PREDICT, b"not gzip at all", {"Content-Encoding": "gzip"}, 400, ["not valid gzip"]),
    (PREDICT, gzip.compress(b'{"instances": [[1.0]]}')[:-12], {"Content-Encoding": "gzip"}, 400, ["truncated"]),
    ("/v1/models/tf1:classify", b'{"signature_name": "nope", "examples": [{"x": 1.0}]}', {}, 400,
     ["no signature 'nope'", "available signatures"]),
    ("/v1/models/tf1:classify", b'{"examples": [{"x": 1.0}]}', {}, 400, ["Classify needs", "'inputs'"]),
    ("/v1/models/tf1:classify", b'{"signature_name": "classify_x_to_y"}', {}, 400, ["'examples'"]),
    ("/v1/models/tf1:regress", b'{"signature_name": "regress_x_to_y", "examples": [{"x": [1.0, "a"]}]}', {}, 400,
     ["examples[0]['x']", "bytes", "float"]),
    ("/v1/models/tf1:regress", b'{"signature_name": "regress_x_to_y", "examples": [5]}', {}, 400,
     ["examples[0] must be a JSON object"]),
    ("/v1/models/tf1:explain", b"{}", {}, 400, ["Malformed request: POST /v1/models/tf1:explain"]),
    ("/v1/models", None, {}, 400, ["Missing model name"]),
    ("/v1/models/nope", None, {}, 404, ["Could not find any versions of model nope; 'nope' is not served"]),
    ("/v1/models/tf1/versions/9", None, {}, 404, ["Could not find version 9 of model tf1; ", "no version 9"]),
    ("/v1/models/tf1/versions/99999999999999999999/metadata", None, {}, 400, ["exceeds int64"]),
    ("/v1/models/tf1/versions/1" + "0" * 5000, None, {}, 400, ["Failed to convert version: 1000", "(5001 digits)"]),
    ("/v1/models/tf1/versions/1" + "0" * 5000 + ":predict", b'{"instances": [[1.0]]}', {}, 400, ["5001 digits"]),
    ("/v1/models/strings:predict", b'{"instances": ["a", "\\ud800"]}', {}, 400,
     ["the string at instances[1] is not valid Unicode", "U+D800"]),
    ("/v1/models/tf1:regress", b'{"signature_name": "regress_x_to_y", "examples": [{"x": "\\udfff"}]}', {}, 400,
     ["the string at examples[0].x is not valid Unicode"]),
    ("/v1/models/tf1:regress", b'{"signature_name": "regress_x_to_y", "examples": [{"\\ud800": 1.0}]}', {}, 400,
     ["the key '\\ud800' of examples[0] is not valid Unicode"]),
    (PREDICT, b'{"instances": [[1.0], [1e400]]}', {}, 400, ["the number 1e400 is beyond the range of a 64-bit float"]),
    (PREDICT, b'{"instances": [[-1], [18446744073709551615]]}', {}, 400,
     ["cannot convert instances[1][0] = 18446744073709551615 to float32 without loss of precision"]),
    (PREDICT, b'{"instances": ' + b"[" * 100 + b"1.0" + b"]" * 100 + b"}", {}, 400,
     ["instances is nested 100 levels deep; a tensor has at most 64 dimensions"]),
    ("/elsewhere", None, {}, 404, ["no such endpoint", "/v1/", "/v2/"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "headers", "status", "words"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests(daemon, path, raw, headers, status, words):
    got, answer = call(daemon, path, raw=raw, headers=headers, method="POST" if raw is not None else "GET")
    assert got == status, answer
    assert set(answer) == {"error"}
    for word in words:
        assert word in answer["error"]


def test_body_limits(daemon):
    # A /v1 body is JSON: at most a quarter of --max_message_bytes, on the wire and once inflated
    big = b'{"instances": [' + b"[1.0]," * (LIMIT // 6) + b"[1.0]]}"
    status, answer = call(daemon, PREDICT, raw=big)
    assert status == 413, answer
    assert f"the request body has {len(big)} bytes, more than the limit of {LIMIT // 4} bytes" in answer["error"]
    assert "a quarter of --max_message_bytes, for JSON" in answer["error"]
    # A gzip bomb: 64 KiB on the wire, 64 MiB inflated: refused having inflated no more than the limit
    bomb = gzip.compress(b"[" + b" " * (64 << 20) + b"]", 9)
    assert len(bomb) < LIMIT
    status, answer = call(daemon, PREDICT, raw=bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413 and f"inflates to more than the limit of {LIMIT // 4} bytes" in answer["error"], answer
    assert ok(daemon, PREDICT, {"instances": [[1.0]]}) == {"predictions": [[2.5]]}


def test_json_bodies_are_bounded_below_max_message_bytes(daemon):
    # Parsed, JSON takes many times its size in memory (about 16x for a list of small numbers): a small gzip body
    # inflating to under --max_message_bytes must not cost 16x that
    rows = b"[0]," * ((LIMIT // 4) // 4)
    over = gzip.compress(b'{"instances": [' + rows + b"[0]]}")
    status, answer = call(daemon, PREDICT, raw=over, headers={"Content-Encoding": "gzip"})
    assert status == 413 and len(over) < 4096, answer
    assert f"inflates to more than the limit of {LIMIT // 4} bytes (a quarter of --max_message_bytes" in answer["error"]
    under = gzip.compress(b'{"instances": [' + rows[: -40 * 4] + b"[0]]}")
    assert len(ok(daemon, PREDICT, raw=under, headers={"Content-Encoding": "gzip"})["predictions"]) > 60_000


@pytest.mark.parametrize(
    ("accept", "coding"),
    [("gzip;q=0", None), ("deflate;q=0, gzip", "gzip"), ("gzip;q=0.5, deflate;q=0.9", "deflate"), ("identity", None)],
)
def test_accept_encoding_q_values_are_honoured(daemon, accept, coding):
    body = json.dumps({"instances": [[float(i)] for i in range(400)]}).encode()
    request = urllib.request.Request(daemon.rest_url + PREDICT, data=body, headers={"Accept-Encoding": accept})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Encoding"] == coding
        data = response.read()
    undo = {None: bytes, "gzip": gzip.decompress, "deflate": __import__("zlib").decompress}[coding]
    assert json.loads(undo(data)) == {"predictions": [[0.5 * i + 2] for i in range(400)]}


def test_keeps_serving_and_counts_rest_calls(daemon):
    before_ok = metric(daemon, "servex_requests_total", method="rest:predict", model="tf1", code="OK")
    before_bad = metric(daemon, "servex_requests_total", method="rest:predict", model="tf1", code="INVALID_ARGUMENT")
    assert call(daemon, PREDICT, raw=b'{"instances": [["a"]]}')[0] == 400
    answer = ok(daemon, PREDICT, {"instances": [[1.0]]}, headers={"x-servex-priority": "5"})
    assert answer == {"predictions": [[2.5]]}
    assert metric(daemon, "servex_requests_total", method="rest:predict", model="tf1", code="OK") == before_ok + 1
    after_bad = metric(daemon, "servex_requests_total", method="rest:predict", model="tf1", code="INVALID_ARGUMENT")
    assert after_bad == before_bad + 1
    assert metric(daemon, "servex_requests_total", method="rest:predict", priority="5", code="OK") >= 1
    assert daemon.proc.poll() is None
