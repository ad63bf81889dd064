"""KServe v2 over both transports of one real daemon gives the same answers: the same requests sent with
tritonclient.grpc and tritonclient.http (the KServe data plane, server/protocols/kserve/dataplane.py, answers both),
compared up to each transport's encoding: server and model metadata, model config, readiness, inference with every
v2 datatype, priority and timeout parameters, classification, and each error (the same status class, gRPC's code
as servex's HTTP mapping has it, and the same message text)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from servex.server.transport.http import HTTP_STATUS
from tests.conftest import HALF_PLUS_TWO_TF1

# v2 datatype -> (the echo model's TensorFlow dtype, a sample [2, 2] array)
SAMPLES = {
    "BOOL": (tf.bool, np.array([[True, False], [False, True]])),
    "UINT8": (tf.uint8, np.array([[0, 255], [1, 7]], np.uint8)),
    "UINT16": (tf.uint16, np.array([[0, 65535], [1, 7]], np.uint16)),
    "UINT32": (tf.uint32, np.array([[0, 2**32 - 1], [1, 7]], np.uint32)),
    "UINT64": (tf.uint64, np.array([[0, 2**64 - 1], [1, 7]], np.uint64)),
    "INT8": (tf.int8, np.array([[-128, 127], [0, -1]], np.int8)),
    "INT16": (tf.int16, np.array([[-32768, 32767], [0, -1]], np.int16)),
    "INT32": (tf.int32, np.array([[-(2**31), 2**31 - 1], [0, -1]], np.int32)),
    "INT64": (tf.int64, np.array([[-(2**63), 2**63 - 1], [0, -1]], np.int64)),
    "FP16": (tf.float16, np.array([[0.5, -2.0], [65504, 0.0]], np.float16)),
    "BF16": (tf.bfloat16, np.array([[0.5, -2.0], [3.0e38, 0.0]], ml_dtypes.bfloat16)),
    "FP32": (tf.float32, np.array([[0.25, 0.5], [0.125, -1.0]], np.float32)),
    "FP64": (tf.float64, np.array([[0.5, -2.0], [1e300, 0.0]], np.float64)),
    "BYTES": (tf.string, np.array([[b"a", b"bc"], [b"", "\u00e9".encode()]], dtype=object)),
}
HP2 = "hp2"  # TensorFlow Serving's half_plus_two: x [-1,1] FP32 -> y = x / 2 + 2


def export_echo(path) -> None:
    """Every v2 datatype's input echoed (tf.identity) as the output of the same name, [None, 2] each."""
    specs = [tf.TensorSpec([None, 2], dtype, name=name.lower()) for name, (dtype, _) in SAMPLES.items()]

    class Echo(tf.Module):
        @tf.function(input_signature=specs)
        def serve(self, *inputs):
            return {name.lower(): tf.identity(x) for name, x in zip(SAMPLES, inputs, strict=True)}

    module = Echo()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


def export_complex(path) -> None:
    """x [None, 2] FP32 -> z, complex64: an output no v2 datatype carries."""

    class Complex(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def serve(self, x):
            return {"z": tf.complex(x, x)}

    module = Complex()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, start_daemon):
    base = tmp_path_factory.mktemp("transports")
    export_echo(base / "echo")
    export_complex(base / "cplx")
    models = {"echo": base / "echo", "cplx": base / "cplx", HP2: HALF_PLUS_TWO_TF1}
    config = base / "models.config"
    config.write_text(
        "model_config_list {\n"
        + "".join(
            f'  config {{ name: "{n}" base_path: "{p}" model_platform: "tensorflow" }}\n' for n, p in models.items()
        )
        + "}\n"
    )
    return start_daemon(f"--model_config_file={config}", rest=True)


@pytest.fixture(scope="module")
def clients(daemon):
    g = grpcclient.InferenceServerClient(daemon.address)
    h = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}", network_timeout=30)
    yield g, h
    g.close()
    h.close()


def both(clients, call):
    """``call(module, client)`` over gRPC and over REST: (gRPC's answer, REST's)."""
    g, h = clients
    return call(grpcclient, g), call(httpclient, h)


def failures(clients, call) -> tuple[str, str]:
    """``call`` fails over both transports with the same status class and message; (gRPC's code, the message)."""
    errors = []
    for module, client in ((grpcclient, clients[0]), (httpclient, clients[1])):
        with pytest.raises(InferenceServerException) as info:
            call(module, client)
        errors.append(info.value)
    g, h = errors
    code = g.status().removeprefix("StatusCode.")
    assert HTTP_STATUS[code] == int(h.status()), (g, h)
    assert g.message() == h.message(), (g.message(), h.message())
    return code, g.message()


def parsed(answer: dict, message):
    """REST's JSON answer read into gRPC's message: what each transport's encoding of one answer has in common."""
    return json_format.ParseDict(answer, message, ignore_unknown_fields=False)


# -- metadata, config, readiness ----------------------------------------------------------------------------------


def test_server_metadata_and_health_are_the_same(clients):
    g, h = both(clients, lambda m, c: c.get_server_metadata())
    assert g == parsed(h, service_pb2.ServerMetadataResponse())
    assert g.name == "servex" and g.version and "classification" in g.extensions
    assert both(clients, lambda m, c: (c.is_server_live(), c.is_server_ready())) == ((True, True), (True, True))


@pytest.mark.parametrize("model", ["echo", "cplx", HP2])
def test_model_metadata_and_config_are_the_same(clients, model):
    g, h = both(clients, lambda m, c: c.get_model_metadata(model))
    assert g == parsed(h, service_pb2.ModelMetadataResponse())
    g, h = both(clients, lambda m, c: c.get_model_metadata(model, "1" if model != HP2 else "123"))
    assert g == parsed(h, service_pb2.ModelMetadataResponse())
    g, h = both(clients, lambda m, c: c.get_model_config(model))
    assert g.config == parsed(h, model_config_pb2.ModelConfig())


def test_metadata_lists_each_datatype_and_names_the_one_v2_lacks(clients):
    g, h = both(clients, lambda m, c: c.get_model_metadata("echo"))
    assert sorted(t.datatype for t in g.inputs) == sorted(SAMPLES)
    assert [(t["name"], t["datatype"]) for t in h["outputs"]] == [(t.name, t.datatype) for t in g.outputs]
    g, h = both(clients, lambda m, c: c.get_model_metadata("cplx"))
    assert g.outputs[0].datatype == h["outputs"][0]["datatype"] == "COMPLEX64"


@pytest.mark.parametrize(
    ("model", "version", "ready"),
    [("echo", "", True), ("echo", "1", True), ("echo", "7", False), ("nope", "", False), (HP2, "123", True)],
)
def test_model_ready_is_the_same(clients, model, version, ready):
    assert both(clients, lambda m, c: c.is_model_ready(model, version)) == (ready, ready)


# -- inference ------------------------------------------------------------------------------------------------


def inputs(module, arrays: dict[str, np.ndarray]):
    made = []
    for name, array in arrays.items():
        datatype = name.upper()
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def echo_arrays() -> dict[str, np.ndarray]:
    return {name.lower(): array for name, (_, array) in SAMPLES.items()}


def test_every_datatype_infers_the_same(clients):
    arrays = echo_arrays()
    g, h = both(clients, lambda m, c: c.infer("echo", inputs(m, arrays), request_id="same"))
    assert g.get_response().id == h.get_response()["id"] == "same"
    assert g.get_response().model_version == h.get_response()["model_version"] == "1"
    for name, array in arrays.items():
        got_g, got_h = g.as_numpy(name), h.as_numpy(name)
        assert got_g.dtype == got_h.dtype == array.dtype, name
        np.testing.assert_array_equal(got_g, array)
        np.testing.assert_array_equal(got_h, array)
        assert g.get_output(name).datatype == h.get_output(name)["datatype"] == name.upper()


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_each_datatype_in_json_over_rest_is_what_grpc_answers(clients, datatype):
    """REST's JSON tensors (no binary extension) decode and encode each datatype as gRPC's raw contents do; BF16 and
    FP16 travel binary (JSON has no such numbers: tritonclient refuses them in JSON)."""
    arrays = echo_arrays()
    # JSON's UINT64 here within int64's range: servex's JSON codec refuses [[0, 2**64 - 1], ...] (NumPy makes such
    # rows floats), a REST limit of its own; binary (above) carries the whole range
    arrays["uint64"] = np.array([[0, 2**63 - 1], [1, 7]], np.uint64)
    binary = datatype in ("BF16", "FP16")
    h_inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), name.upper())
        tensor.set_data_from_numpy(array, binary_data=binary or name != datatype.lower())
        h_inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(datatype.lower(), binary_data=binary)]
    h = clients[1].infer("echo", h_inputs, outputs=outputs)
    g = clients[0].infer(
        "echo", inputs(grpcclient, arrays), outputs=[grpcclient.InferRequestedOutput(datatype.lower())]
    )
    got = h.as_numpy(datatype.lower())
    if datatype == "BYTES" and not binary:  # tritonclient gives JSON BYTES back as str
        got = np.array([[v.encode() if isinstance(v, str) else v for v in row] for row in got.tolist()], dtype=object)
    np.testing.assert_array_equal(got, g.as_numpy(datatype.lower()))


def test_priority_and_timeout_parameters_are_the_same(clients):
    x = {"x": np.array([[2.0]], np.float32)}

    def call(m, c):
        tensor = m.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(x["x"])
        return c.infer(HP2, [tensor], priority=7, timeout=30_000_000).as_numpy("y")

    g, h = both(clients, call)
    np.testing.assert_array_equal(g, [[3.0]])
    np.testing.assert_array_equal(h, [[3.0]])


@pytest.mark.parametrize("count", [1, 2, 5])
def test_classification_is_the_same(clients, count):
    arrays = echo_arrays()

    def call(m, c):
        return c.infer("echo", inputs(m, arrays), outputs=[m.InferRequestedOutput("fp32", class_count=count)])

    g, h = both(clients, call)
    g_classes, h_classes = g.as_numpy("fp32"), h.as_numpy("fp32")
    h_classes = np.array([[v.encode() if isinstance(v, str) else v for v in row] for row in h_classes.tolist()])
    assert g_classes.tolist() == h_classes.tolist()
    assert g_classes.tolist()[0][0] == b"0.500000:1"
    assert g_classes.shape == (2, min(count, 2))


# -- errors ---------------------------------------------------------------------------------------------------


def hp2_input(m, array=None, datatype="FP32"):
    array = np.array([[1.0]], np.float32) if array is None else array
    tensor = m.InferInput("x", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return [tensor]


ERRORS = {
    "unknown model": (lambda m, c: c.infer("nope", hp2_input(m)), "NOT_FOUND", "Request for unknown model: 'nope'"),
    "unknown version": (lambda m, c: c.infer(HP2, hp2_input(m), model_version="7"), "NOT_FOUND", "no version 7"),
    "bad version string": (
        lambda m, c: c.infer(HP2, hp2_input(m), model_version="abc"),
        "INVALID_ARGUMENT",
        "failed to get model version from specified version string 'abc'",
    ),
    "version beyond int64": (
        lambda m, c: c.infer(HP2, hp2_input(m), model_version="9223372036854775808"),
        "INVALID_ARGUMENT",
        "is not a version number",
    ),
    "wrong datatype": (
        lambda m, c: c.infer(HP2, hp2_input(m, np.array([[1.0]]), "FP64")),
        "INVALID_ARGUMENT",
        "input 'x' expects dtype DT_FLOAT",
    ),
    "wrong shape": (
        lambda m, c: c.infer(HP2, hp2_input(m, np.array([[1.0, 2.0]], np.float32))),
        "INVALID_ARGUMENT",
        "expects shape [-1,1], got [1, 2]",
    ),
    "priority out of range": (
        lambda m, c: c.infer(HP2, hp2_input(m), priority=500),
        "INVALID_ARGUMENT",
        "parameter 'priority' must be an integer from -100 to 100, got 500",
    ),
    "unknown output": (
        lambda m, c: c.infer(HP2, hp2_input(m), outputs=[m.InferRequestedOutput("nope")]),
        "INVALID_ARGUMENT",
        "unknown output(s) ['nope']",
    ),
    "output asked twice": (
        lambda m, c: c.infer(HP2, hp2_input(m), outputs=[m.InferRequestedOutput("y"), m.InferRequestedOutput("y")]),
        "INVALID_ARGUMENT",
        "output 'y' is requested twice",
    ),
    "classification below 1": (
        lambda m, c: c.infer(HP2, hp2_input(m), outputs=[m.InferRequestedOutput("y", class_count=-1)]),
        "INVALID_ARGUMENT",
        "output 'y': parameter 'classification' is -1",
    ),
    "classification of strings": (
        lambda m, c: c.infer(
            "echo", inputs(m, echo_arrays()), outputs=[m.InferRequestedOutput("bytes", class_count=1)]
        ),
        "INVALID_ARGUMENT",
        "output 'bytes' cannot be classified",
    ),
    "output v2 cannot carry": (
        lambda m, c: c.infer("cplx", [_x2(m)]),
        "FAILED_PRECONDITION",
        "output 'z' has dtype complex64, which the KServe v2 protocol cannot carry",
    ),
    "metadata of an unknown model": (lambda m, c: c.get_model_metadata("nope"), "NOT_FOUND", "'nope' is not served"),
    "metadata with a bad version": (
        lambda m, c: c.get_model_metadata(HP2, "1.5"),
        "INVALID_ARGUMENT",
        "'1.5' is not a version number",
    ),
    "config of an unknown version": (lambda m, c: c.get_model_config(HP2, "7"), "NOT_FOUND", "no version 7"),
    "statistics of an unknown model": (
        lambda m, c: c.get_inference_statistics("nope"),
        "NOT_FOUND",
        "'nope' is not served",
    ),
    "trace settings asking for tensors": (
        lambda m, c: c.update_trace_settings(settings={"trace_level": ["TENSORS"]}),
        "UNIMPLEMENTED",
        "trace_level TENSORS is not supported",
    ),
    "trace settings with a bad rate": (
        lambda m, c: c.update_trace_settings(settings={"trace_rate": "0"}),
        "INVALID_ARGUMENT",
        "Unable to parse 'trace_rate', value is out of range [ 1, 4294967295 ], got: 0",
    ),
    "log settings of the wrong type": (
        lambda m, c: c.update_log_settings({"log_file": "servex.log"}),
        "INVALID_ARGUMENT",
        "log_file 'servex.log': servex logs to standard error only",
    ),
    "unregistered shared memory": (
        lambda m, c: c.get_system_shared_memory_status("nowhere"),
        "NOT_FOUND",
        "nowhere",
    ),
}


def _x2(m):
    tensor = m.InferInput("x", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0, 2.0]], np.float32))
    return tensor


@pytest.mark.parametrize("case", list(ERRORS))
def test_each_error_is_the_same(clients, case):
    call, code, words = ERRORS[case]
    got_code, message = failures(clients, call)
    assert got_code == code, message
    assert words in message


def post_json(daemon, path: str, doc: dict) -> tuple[int, str]:
    request = urllib.request.Request(daemon.rest_url + path, data=json.dumps(doc).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30):
            return 200, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("priority", "high", "parameter 'priority' must be an integer (larger runs first), got \"high\""),
        ("priority", 1.5, "parameter 'priority' must be an integer (larger runs first), got 1.5"),
        ("timeout", "soon", "parameter 'timeout' must be an integer (microseconds), got \"soon\""),
        ("timeout", True, "parameter 'timeout' must be an integer (microseconds), got true"),
        ("signature_name", 3, "parameter 'signature_name' must be a string (a signature's name), got 3"),
    ],
)
def test_bad_parameter_values_are_refused_in_the_same_words(daemon, name, value, words):
    """Values tritonclient will not send as these parameters: gRPC's InferParameter and REST's JSON made by hand."""
    request = service_pb2.ModelInferRequest(model_name=HP2)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[1.0]], np.float32).tobytes())
    field = {str: "string_param", float: "double_param", bool: "bool_param", int: "int64_param"}[type(value)]
    setattr(request.parameters[name], field, value)
    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    doc = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}], "parameters": {name: value}}
    status, message = post_json(daemon, f"/v2/models/{HP2}/infer", doc)
    assert status == 400
    assert info.value.details() == message
    assert words in message
