"""KServe v2 REST on the real daemon's --rest_api_port, called with tritonclient.http (and raw HTTP for the
malformed requests a client library would never send): health, metadata, inference on the benchmark MLP
(compared with running the SavedModel in TensorFlow here) with JSON and binary tensors in and out, gzip and
deflate request bodies and responses, priorities, BYTES tensors, and bad requests (each answered with its status
and a message naming what was wrong; the daemon keeps serving)."""

from __future__ import annotations

import gzip
import json
import struct
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest
import tensorflow as tf
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.support.daemon import Daemon, metric

LIMIT = 8 << 20  # --max_message_bytes of the daemon under test: JSON up to a quarter of it, 2 MiB


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, mlp_model, string_model):
    config = tmp_path_factory.mktemp("config") / "models.config"
    config.write_text(
        "model_config_list {\n"
        f'  config {{ name: "mlp" base_path: "{mlp_model}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "hp2" base_path: "{HALF_PLUS_TWO_TF1}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "strings" base_path: "{string_model}" model_platform: "tensorflow" }}\n'
        "}\n"
    )
    args = [f"--model_config_file={config}", f"--max_message_bytes={LIMIT}"]
    daemon = Daemon(args, tmp_path_factory.mktemp("servex"), rest=True)
    yield daemon.wait_serving()
    daemon.stop()


@pytest.fixture(scope="module")
def client(daemon):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}", network_timeout=30)
    yield client
    client.close()


@pytest.fixture(scope="module")
def mlp(mlp_model):
    """The MLP run directly in TensorFlow: features [N,64] float32 -> score [N,1]."""
    fn = tf.saved_model.load(str(mlp_model / "1")).signatures["serving_default"]
    return lambda x: fn(features=tf.constant(x))["score"].numpy()


def features(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64), dtype=np.float32)


def tensor(name, array, datatype, binary=True):
    t = httpclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array, binary_data=binary)
    return t


# -- health and metadata ----------------------------------------------------------------------------------


def test_health(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "7")
    assert not client.is_model_ready("nope")


def test_metadata(client):
    server = client.get_server_metadata()
    assert server["name"] == "servex" and server["extensions"] == [
        "classification", "model_configuration", "system_shared_memory", "binary_tensor_data", "parameters",
        "statistics", "logging",
    ]  # fmt: skip
    assert client.get_model_metadata("mlp") == {
        "name": "mlp",
        "versions": ["1"],
        "platform": "tensorflow_savedmodel",
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}],
    }
    assert client.get_model_metadata("hp2", "123")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}]
    # In name order, as gRPC's ModelMetadata lists them (the signature's own order is the export's)
    outputs = [o["name"] for o in client.get_model_metadata("strings")["outputs"]]
    assert outputs == ["echo_bytes", "length", "upper"]
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("nope")
    assert e.value.status() == "404" and "Request for unknown model: 'nope' is not served" in e.value.message()


@pytest.mark.parametrize(
    "call",
    [lambda c: c.get_model_repository_index(), lambda c: c.load_model("mlp"), lambda c: c.unload_model("mlp")],
    ids=["index", "load", "unload"],
)
def test_the_repository_extension_points_to_the_admin_port(client, call):
    with pytest.raises(InferenceServerException) as e:
        call(client)
    assert e.value.status() == "501" and "on the admin port (--admin_port)" in e.value.message()
    assert client.is_model_ready("mlp")  # nothing was unloaded


# -- inference --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_mlp_matches_tensorflow(client, mlp, binary_in, binary_out):
    x = features(7, seed=int(binary_in) * 2 + int(binary_out))
    outputs = [httpclient.InferRequestedOutput("score", binary_data=binary_out)]
    result = client.infer("mlp", [tensor("features", x, "FP32", binary_in)], outputs=outputs)
    np.testing.assert_allclose(result.as_numpy("score"), mlp(x), rtol=1e-5, atol=1e-6)
    out = result.get_output("score")
    assert out["datatype"] == "FP32" and out["shape"] == [7, 1]
    assert ("parameters" in out and out["parameters"]["binary_data_size"] == 7 * 4) == binary_out
    assert result.get_response()["model_name"] == "mlp" and result.get_response()["model_version"] == "1"


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_requests(client, mlp, compression):
    x = features(64, seed=9)
    result = client.infer(
        "mlp", [tensor("features", x, "FP32")], model_version="1", request_compression_algorithm=compression
    )
    np.testing.assert_allclose(result.as_numpy("score"), mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
@pytest.mark.parametrize("binary_out", [True, False])
def test_compressed_responses_reach_tritonclient(client, mlp, compression, binary_out):
    x = features(600, seed=11)  # 2.4 KB of scores: large enough to be compressed
    outputs = [httpclient.InferRequestedOutput("score", binary_data=binary_out)]
    result = client.infer(
        "mlp", [tensor("features", x, "FP32")], outputs=outputs, response_compression_algorithm=compression
    )
    np.testing.assert_allclose(result.as_numpy("score"), mlp(x), rtol=1e-5, atol=1e-6)


def fetch(daemon, path: str, body: bytes | None, headers: dict) -> tuple[dict, bytes]:
    request = urllib.request.Request(daemon.rest_url + path, data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:  # urllib leaves the body as sent
        return dict(response.headers), response.read()


@pytest.mark.parametrize(("accept", "coding", "undo"), [("gzip", "gzip", gzip.decompress),
                                                        ("gzip, deflate", "deflate", zlib.decompress)])  # fmt: skip
def test_responses_are_compressed_as_accept_encoding_allows(daemon, mlp, accept, coding, undo):
    x = features(600, seed=12)
    doc = {"inputs": [{"name": "features", "shape": [600, 64], "datatype": "FP32", "data": x.ravel().tolist()}]}
    headers, body = fetch(daemon, "/v2/models/mlp/infer", json.dumps(doc).encode(), {"Accept-Encoding": accept})
    assert headers.get("Content-Encoding") == coding
    answer = json.loads(undo(body))
    score = np.array(answer["outputs"][0]["data"], np.float32).reshape(600, 1)
    np.testing.assert_allclose(score, mlp(x), rtol=1e-5, atol=1e-6)
    # Asked for nothing, sent as it is; small answers are never compressed.
    headers, body = fetch(daemon, "/v2/models/mlp/infer", json.dumps(doc).encode(), {})
    assert "Content-Encoding" not in headers and json.loads(body) == answer
    headers, body = fetch(daemon, "/v2/models/mlp", None, {"Accept-Encoding": accept})
    assert "Content-Encoding" not in headers and json.loads(body)["name"] == "mlp"


def test_large_json_request(client, mlp):
    # ~2 MB of JSON: decoded on a worker thread (server/transport/http.py OFFLOAD_BYTES), answered the same
    x = features(1500, seed=5)
    result = client.infer("mlp", [tensor("features", x, "FP32", binary=False)])
    np.testing.assert_allclose(result.as_numpy("score"), mlp(x), rtol=1e-5, atol=1e-6)


def test_no_outputs_named_answers_all_binary(client):
    # tritonclient asks binary_data_output when it names no outputs
    result = client.infer("hp2", [tensor("x", np.array([[1.0], [3.0]], np.float32), "FP32", binary=False)])
    assert result.get_output("y")["parameters"]["binary_data_size"] == 8
    np.testing.assert_array_equal(result.as_numpy("y"), [[2.5], [3.5]])


def test_binary_data_output_covers_the_outputs_the_request_does_not_name(daemon):
    """Triton's rule: a named output is JSON unless it asks for binary itself."""
    x = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [2.0]}
    for outputs, binary in (([{"name": "y"}], False), ([{"name": "y", "parameters": {"binary_data": True}}], True),
                            ([], True)):  # fmt: skip
        body = json.dumps({"inputs": [x], "outputs": outputs, "parameters": {"binary_data_output": True}}).encode()
        request = urllib.request.Request(daemon.rest_url + "/v2/models/hp2/infer", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            raw, header = response.read(), response.headers.get("Inference-Header-Content-Length")
        if binary:
            head = json.loads(raw[: int(header)])
            assert head["outputs"][0]["parameters"]["binary_data_size"] == 4 and raw[int(header) :] == b"\x00\x00@@"
        else:
            assert header is None and json.loads(raw)["outputs"][0]["data"] == [3.0], outputs
        assert "id" not in json.loads(raw[: int(header)] if header else raw)  # no id asked: none echoed


def test_request_id_and_priority(client, daemon):
    x = tensor("x", np.array([[2.0]], np.float32), "FP32")
    result = client.infer("hp2", [x], request_id="req-1", priority=7)
    assert result.get_response()["id"] == "req-1"
    np.testing.assert_array_equal(result.as_numpy("y"), [[3.0]])
    assert metric(daemon, "servex_requests_total", method="rest:v2_infer", model="hp2", priority="7", code="OK") == 1


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client, binary):
    text = np.array([b"abc", "h\u00e9llo".encode(), b""], dtype=object)
    outputs = [
        httpclient.InferRequestedOutput("upper", binary_data=binary),
        httpclient.InferRequestedOutput("length", binary_data=False),
    ]
    result = client.infer("strings", [tensor("text", text, "BYTES", binary)], outputs=outputs)
    # tritonclient gives JSON BYTES back as str, binary ones as bytes
    upper = [v.encode() if isinstance(v, str) else v for v in result.as_numpy("upper").tolist()]
    assert upper == [b"ABC", "H\u00e9LLO".encode(), b""]
    assert result.as_numpy("length").tolist() == [3, 6, 0]
    assert result.get_output("upper")["datatype"] == "BYTES"


def test_non_utf8_bytes_round_trip_binary(client):
    raw = np.array([bytes(range(256))], dtype=object)
    outputs = [httpclient.InferRequestedOutput("echo_bytes", binary_data=True)]
    result = client.infer("strings", [tensor("text", raw, "BYTES")], outputs=outputs)
    assert result.as_numpy("echo_bytes").tolist() == [bytes(range(256))]


# -- bad requests -----------------------------------------------------------------------------------------


def post(daemon, path: str, body: bytes, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(daemon.rest_url + path, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def infer_json(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


X1 = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}
HP2 = "/v2/models/hp2/infer"


def binary_body(inputs, raw: bytes, **extra) -> tuple[bytes, dict]:
    head = infer_json(inputs, **extra)
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def _bin(shape, size, datatype="FP32"):
    return {"name": "x", "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": size}}


FOUR = struct.pack("<f", 1.0)
BAD = [
    # (path, body, headers, status, words the message must contain)
    (HP2, b'{"inputs": [', {}, 400, ["JSON parse error"]),
    (HP2, b"[]", {}, 400, ["array", "expected an object"]),
    (HP2, b"{}", {}, 400, ["no 'inputs'"]),
    (HP2, infer_json([{**X1, "datatype": "FP8"}]), {}, 400, ["unknown datatype 'FP8'", "FP32"]),
    (HP2, infer_json([{**X1, "datatype": "FP64"}]), {}, 400, ["input 'x' expects dtype DT_FLOAT", "DT_DOUBLE"]),
    (HP2, infer_json([{**X1, "shape": [1, 2], "data": [1.0, 2.0]}]), {}, 400, ["expects shape [-1,1], got [1, 2]"]),
    (HP2, infer_json([{**X1, "shape": [2, 1]}]), {}, 400, ["holds 1 values, but shape [2, 1] takes 2"]),
    (HP2, infer_json([{**X1, "shape": [1, -1]}]), {}, 400, ["negative dimension"]),
    (HP2, infer_json([{**X1, "shape": "1"}]), {}, 400, ["'shape' must be a list of integers"]),
    (HP2, infer_json([{**X1, "data": ["a"]}]), {}, 400, ["input 'x'", 'inputs[0].data[0] is "a"', "number"]),
    (HP2, infer_json([{**X1, "shape": [2, 1], "data": [[1.0], [2.0, 3.0]]}]), {}, 400, ["ragged"]),
    (HP2, infer_json([X1, X1]), {}, 400, ["input 'x' is sent twice"]),
    (HP2, infer_json([{**X1, "name": "y"}]), {}, 400, ["missing input(s) ['x']", "unknown input(s) ['y']"]),
    (HP2, infer_json([X1], outputs=[{"name": "nope"}]), {}, 400, ["unknown output(s) ['nope']", "y"]),
    (HP2, infer_json([X1], outputs=[{"name": "y", "parameters": {"classification": 0}}]), {}, 400,
     ["output 'y': parameter 'classification' is 0"]),
    (HP2, infer_json([X1], outputs=[{"name": "y", "parameters": {"classification": "2"}}]), {}, 400,
     ["output 'y': parameter 'classification' must be an integer"]),  # the data plane's words (as gRPC's)
    (HP2, infer_json([X1], parameters={"priority": "high"}), {}, 400, ["parameter 'priority' must be an integer"]),
    (HP2, infer_json([X1], parameters={"binary_data_output": 1}), {}, 400, ["'binary_data_output' must be true or"]),
    (HP2, infer_json([X1], parameters={"timeout": 1}), {}, 504, ["deadline"]),
    (HP2, infer_json([X1], parameters={"priority": 101}), {}, 400, ["parameter 'priority'", "from -100 to 100"]),
    (HP2, infer_json([{**X1, "shape": [0, 2**62, 2**62], "data": []}]), {}, 400, ["too large"]),
    (HP2, infer_json([{**X1, "shape": [2, 1], "data": [1.0, True]}]), {}, 400, ["true", "expected a number"]),
    (HP2, infer_json([X1]), {"Inference-Header-Content-Length": "\u00b9"}, 400, ["Inference-Header-Content-Length"]),
    (HP2, infer_json([X1], parameters={"signature_name": "nope"}), {}, 400, ["no signature 'nope'"]),
    (HP2, *binary_body([_bin([1, 1], 8)], FOUR), 400, ["binary_data_size 8 runs past the binary data", "4 bytes"]),
    (HP2, *binary_body([_bin([1, 1], 4)], FOUR + b"xx"), 400, ["2 bytes of binary data are left"]),
    (HP2, *binary_body([_bin([2, 1], 4)], FOUR), 400, ["4 raw bytes do not fit", "8 bytes"]),
    (HP2, *binary_body([{**_bin([1, 1], 4), "data": [1.0]}], FOUR), 400, ["both 'data' and binary_data_size"]),
    (HP2, infer_json([X1]) + FOUR, {"Inference-Header-Content-Length": "9999"}, 400,
     ["Inference-Header-Content-Length", "at most"]),
    (HP2, infer_json([X1]), {"Inference-Header-Content-Length": "ten"}, 400, ["Inference-Header-Content-Length"]),
    ("/v2/models/strings/infer", *binary_body([_bin([3], 4, "BYTES") | {"name": "text"}], b"\0\0\0\0"), 400,
     ["4 bytes cannot hold the 3 BYTES elements"]),
    ("/v2/models/strings/infer",
     infer_json([{"name": "text", "shape": [1], "datatype": "BYTES", "data": [5]}]), {}, 400,
     ["holds 5", "expected strings for BYTES"]),
    ("/v2/models/nope/infer", infer_json([X1]), {}, 404, ["Request for unknown model: 'nope' is not served", "hp2"]),
    ("/v2/models/hp2/versions/7/infer", infer_json([X1]), {}, 404, ["no version 7", "123"]),
    ("/v2/models/hp2/versions/latest/infer", infer_json([X1]), {}, 400, ["'latest' is not a version number"]),
    ("/v2/models/hp2/versions/1" + "0" * 5000 + "/infer", infer_json([X1]), {}, 400,
     ["'1000000000", "(5001 characters)' is not a version number"]),
    (HP2, infer_json([X1]), {"Inference-Header-Content-Length": "1" * 5000}, 400,
     ["Inference-Header-Content-Length is '1111111111", "(5000 characters)'"]),
    (HP2, b'{"id": "\\ud800", "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}', {}, 400,
     ["the string at id is not valid Unicode", "U+D800"]),
    ("/v2/models/strings/infer",
     b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}', {}, 400,
     ["the string at inputs[0].data[0] is not valid Unicode"]),
    (HP2, infer_json([{**X1, "shape": [2, 1], "data": [-1, 2**64 - 1]}]), {}, 400,
     ["inputs[0].data[1] = 18446744073709551615 to float32 without loss"]),
    (HP2, infer_json([{**X1, "shape": [1], "data": json.loads("[" * 70 + "1.0" + "]" * 70)}]), {}, 400,
     ["nested 70 levels deep; a tensor has at most 64 dimensions"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "headers", "status", "words"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests(daemon, path, body, headers, status, words):
    got, answer = post(daemon, path, body, headers)
    assert got == status, answer
    assert set(answer) == {"error"}
    for word in words:
        assert word in answer["error"]


def test_non_utf8_bytes_as_json_is_refused_with_the_way_out(daemon):
    head = infer_json(
        [_bin([1], 8, "BYTES") | {"name": "text"}],
        outputs=[{"name": "echo_bytes", "parameters": {"binary_data": False}}],
    )
    status, answer = post(
        daemon,
        "/v2/models/strings/infer",
        head + struct.pack("<I", 4) + b"\xff\xfe\x00\x80",
        {"Inference-Header-Content-Length": str(len(head))},
    )
    assert status == 400 and "not UTF-8" in answer["error"] and '"binary_data": true' in answer["error"]


def test_body_limits(daemon, client):
    big = infer_json([{"name": "x", "shape": [LIMIT // 4, 1], "datatype": "FP32", "data": [1.0] * (LIMIT // 4)}])
    status, answer = post(daemon, HP2, big)
    assert status == 413 and f"has {len(big)} bytes, more than the limit of {LIMIT} bytes" in answer["error"]
    bomb = gzip.compress(infer_json([X1]) + b" " * (64 << 20), 9)
    status, answer = post(daemon, HP2, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "inflates to more than the limit" in answer["error"]
    x = tensor("x", np.array([[1.0]], np.float32), "FP32")
    np.testing.assert_array_equal(client.infer("hp2", [x]).as_numpy("y"), [[2.5]])


def test_json_is_bounded_below_max_message_bytes_binary_is_not(daemon, client, mlp):
    # Parsed, JSON takes many times its size in memory: the JSON of a v2 body may have a quarter of the limit
    rows = 3 * (LIMIT // 4) // (64 * 20) // 2  # ~20 characters a value: 1.5 times the 2 MiB for JSON
    x = features(rows, seed=3)
    doc = infer_json([{"name": "features", "shape": [rows, 64], "datatype": "FP32", "data": x.ravel().tolist()}])
    assert LIMIT // 4 < len(doc) < LIMIT
    status, answer = post(daemon, "/v2/models/mlp/infer", doc)
    assert status == 413, answer
    assert f"the request's JSON has {len(doc)} bytes, more than the limit of {LIMIT // 4}" in answer["error"]
    status, answer = post(daemon, "/v2/models/mlp/infer", gzip.compress(doc), {"Content-Encoding": "gzip"})
    assert status == 413 and "a quarter of --max_message_bytes, for JSON" in answer["error"]
    # the same tensor in binary: its bytes are no JSON
    result = client.infer("mlp", [tensor("features", x, "FP32", binary=True)])
    np.testing.assert_allclose(result.as_numpy("score"), mlp(x), rtol=1e-5, atol=1e-6)


def request_of(daemon, method: str, path: str) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(daemon.rest_url + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("PUT", "/v2/models/hp2/infer", "POST"), ("GET", "/v2/models/hp2/infer", "POST"),
     ("DELETE", "/v2/models/hp2", "GET, HEAD"), ("POST", "/v2/health/live", "GET, HEAD"),
     ("PUT", "/v2/systemsharedmemory/region/r/register", "POST")],
)  # fmt: skip
def test_a_method_an_endpoint_does_not_take_is_405_with_allow(daemon, method, path, allow):
    status, headers, body = request_of(daemon, method, path)
    assert status == 405 and headers["Allow"] == allow, (status, headers)
    assert json.loads(body) == {"error": f"method {method} is not allowed on {path}: it takes {allow}"}
    assert request_of(daemon, method, "/v2/nowhere")[0] == 404


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/v2/models/hp2", "/v2/models/hp2/ready",
                                  "/v2", "/v1/models/hp2"])  # fmt: skip
def test_head_on_get_endpoints(daemon, path):
    status, headers, body = request_of(daemon, "HEAD", path)
    assert status == 200 and body == b"", (status, headers, body)
    assert request_of(daemon, "GET", path)[0] == 200


@pytest.mark.parametrize(
    ("path", "answer"),
    [("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
     ("/v2/models/hp2/ready", {"name": "hp2", "ready": True}),
     ("/v2/models/hp2/versions/123/ready", {"name": "hp2", "ready": True})],
)  # fmt: skip
def test_health_answers_carry_kserves_json(daemon, path, answer):
    """kserve's InferenceRESTClient (protocol v2) reads ``response.json().get("live")`` / ``.get("ready")``: an
    empty body (Triton's) raised JSONDecodeError in is_server_live and is_server_ready."""
    status, headers, body = request_of(daemon, "GET", path)
    assert status == 200 and headers["Content-Type"].startswith("application/json"), (status, headers)
    assert json.loads(body) == answer


def test_null_optional_fields_are_absent_as_kserve_writes_them(daemon):
    """KServe's pydantic request and response models write ``"parameters": null`` (and ``"outputs": null``) for
    none: a request in KServe's JSON was 400 "'parameters' must be a JSON object, got null"."""
    x = {**X1, "parameters": None}
    status, answer = post(daemon, HP2, infer_json([x], id=None, parameters=None, outputs=None))
    assert status == 200, answer
    outputs = [{"name": "y", "parameters": None}]
    assert post(daemon, HP2, infer_json([X1], parameters=None, outputs=outputs)) == (200, {})
    head, headers = binary_body([_bin([1, 1], 4)], struct.pack("<f", 1.0), parameters=None, outputs=None)
    assert post(daemon, HP2, head, headers) == (200, {})
    status, answer = post(daemon, HP2, infer_json([X1], parameters=[]))  # not null: still refused
    assert status == 400 and answer["error"] == "'parameters' must be a JSON object, got array"


def test_errors_reach_tritonclient_and_daemon_keeps_serving(client, daemon):
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp", [tensor("features", features(2)[:, :63].copy(), "FP32")])
    assert e.value.status() == "400" and "expects shape [-1,64], got [2, 63]" in e.value.message()
    bad = metric(daemon, "servex_requests_total", method="rest:v2_infer", model="mlp", code="INVALID_ARGUMENT")
    assert bad >= 1
    assert client.is_server_ready() and client.is_model_ready("mlp")
    assert daemon.proc.poll() is None


def test_a_timeout_of_zero_means_none_as_in_triton(daemon):
    status, _ = post(daemon, HP2, infer_json([X1], parameters={"timeout": 0}))
    assert status == 200
