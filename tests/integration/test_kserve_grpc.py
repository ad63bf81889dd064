"""The KServe v2 gRPC API through the real daemon, called with tritonclient.grpc (and its raw stub for requests the
client would not build): health, metadata, inference on TensorFlow Serving's half_plus_two models, the benchmark
MLP and models exported here (every datatype, strings), priorities, every malformed request, and the repository
extension on the admin port only (streams: tests/integration/test_kserve_grpc_streams.py). Answers are compared
with the SavedModels run by TensorFlow."""

from __future__ import annotations

import grpc
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, triton_to_np_dtype

from tests.conftest import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2
from tests.support.clients import infer_input
from tests.support.daemon import free_port, metric, model_config_file
from tests.support.models import export_strings
from tests.support.v2_requests import fp32_request

# datatype -> (TensorFlow dtype, example values): the echo model takes one input of each and returns it
TYPED = {
    "BOOL": (tf.bool, np.array([True, False])),
    "UINT8": (tf.uint8, np.array([0, 255], np.uint8)),
    "UINT16": (tf.uint16, np.array([0, 65535], np.uint16)),
    "UINT32": (tf.uint32, np.array([0, 2**32 - 1], np.uint32)),
    "UINT64": (tf.uint64, np.array([0, 2**64 - 1], np.uint64)),
    "INT8": (tf.int8, np.array([-128, 127], np.int8)),
    "INT16": (tf.int16, np.array([-32768, 32767], np.int16)),
    "INT32": (tf.int32, np.array([-(2**31), 2**31 - 1], np.int32)),
    "INT64": (tf.int64, np.array([-(2**63), 2**63 - 1], np.int64)),
    "FP32": (tf.float32, np.array([0.5, -1e30], np.float32)),
    "FP64": (tf.float64, np.array([0.5, -1e300], np.float64)),
    "BYTES": (tf.string, np.array([b"", b"a\x00\xff"], dtype=object)),
}
HALVES = {
    "FP16": (tf.float16, np.array([0.5, -65504], np.float16)),
    "BF16": (tf.bfloat16, np.array([0.5, -2.0], ml_dtypes.bfloat16)),
}


def export_echo(path, types):
    specs = [tf.TensorSpec([None], dtype, name=name.lower()) for name, (dtype, _) in types.items()]

    class Echo(tf.Module):
        @tf.function(input_signature=specs)
        def serve(self, *args):
            return {f"{spec.name}_out": tf.identity(arg) for spec, arg in zip(specs, args, strict=True)}

    module = Echo()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


def export_add(path):
    class Add(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name=n) for n in ("a", "b")])
        def serve(self, a, b):
            return {"sum": a + b}

    module = Add()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def models(tmp_path_factory, mlp_model):
    base = tmp_path_factory.mktemp("kserve_models")
    export_echo(base / "echo", TYPED)
    export_add(base / "add")
    export_echo(base / "halves", HALVES)
    export_strings(base / "strings")
    return {
        "tf1": HALF_PLUS_TWO_TF1,
        "tf2": HALF_PLUS_TWO_TF2,
        "mlp": mlp_model,
        "echo": base / "echo",
        "halves": base / "halves",
        "strings": base / "strings",
        "add": base / "add",
    }


@pytest.fixture(scope="module")
def served(models, start_daemon, tmp_path_factory):
    config = model_config_file(tmp_path_factory.mktemp("kserve_config"), models)
    admin = free_port()
    daemon = start_daemon(f"--model_config_file={config}", f"--admin_port={admin}")
    return daemon, admin


@pytest.fixture(scope="module")
def client(served):
    with triton.InferenceServerClient(served[0].address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(served):
    return service_pb2_grpc.GRPCInferenceServiceStub(served[0].channel)


def tf_run(path, version_dir, **inputs):
    """The SavedModel's serving_default, run by TensorFlow itself."""
    loaded = tf.saved_model.load(str(path / version_dir))
    outputs = loaded.signatures["serving_default"](**{k: tf.constant(v) for k, v in inputs.items()})
    return {k: v.numpy() for k, v in outputs.items()}


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30, **kwargs)
    return info.value


# -- health and metadata -------------------------------------------------------------------------------


def test_server_live_ready_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "servex"
    assert meta.version
    # the extensions served, named as Triton names them (the same list as REST's)
    assert list(meta.extensions) == ["classification", "model_configuration", "system_shared_memory",
                                     "binary_tensor_data", "parameters", "statistics", "logging"]  # fmt: skip
    assert "model_repository" not in meta.extensions  # served on the admin port, which lists it


def test_model_ready(client):
    assert client.is_model_ready("tf1")
    assert client.is_model_ready("tf2", "123")
    assert not client.is_model_ready("tf2", "7")
    assert not client.is_model_ready("no_such_model")


def test_model_ready_without_a_name_is_not_ready_as_triton_answers(stub):
    assert stub.ModelReady(service_pb2.ModelReadyRequest(name=""), timeout=10).ready is False


def test_model_ready_with_a_version_that_is_not_a_number(stub):
    error = rpc_error(stub.ModelReady, service_pb2.ModelReadyRequest(name="tf1", version="abc"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'abc' is not a version number" in error.details()


def test_model_metadata(client):
    meta = client.get_model_metadata("mlp")
    assert meta.name == "mlp"
    assert list(meta.versions) == ["1"]
    assert meta.platform == "tensorflow_savedmodel"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("features", "FP32", [-1, 64])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("score", "FP32", [-1, 1])]
    meta = client.get_model_metadata("strings", "1")
    assert [(t.name, t.datatype) for t in meta.inputs] == [("text", "BYTES")]
    assert sorted((t.name, t.datatype) for t in meta.outputs) == [("length", "INT32"), ("upper", "BYTES")]
    assert list(client.get_model_metadata("tf2").versions) == ["123"]


@pytest.mark.parametrize(("name", "version", "code"), [("nope", "", "NOT_FOUND"), ("tf1", "99", "NOT_FOUND")])
def test_model_metadata_of_unknown_model_or_version(client, name, version, code):
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata(name, version)
    assert info.value.status() == f"StatusCode.{code}"
    assert name in info.value.message() or version in info.value.message()


# -- inference -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "shape"), [("tf1", (3, 1)), ("tf2", (3,))])
def test_half_plus_two(client, models, model, shape):
    x = np.array([1.0, 2.0, 5.0], np.float32).reshape(shape)
    result = client.infer(model, [infer_input("x", x)])
    expected = tf_run(models[model], "00000123", x=x)["y"]
    np.testing.assert_allclose(result.as_numpy("y"), expected)
    np.testing.assert_allclose(result.as_numpy("y").ravel(), [2.5, 3.0, 4.5])
    response = result.get_response()
    assert response.model_name == model and response.model_version == "123"
    assert len(response.raw_output_contents) == 1  # raw in, raw out


def test_mlp_matches_tensorflow(client, models):
    features = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    result = client.infer("mlp", [infer_input("features", features)], model_version="1", request_id="r-17")
    expected = tf_run(models["mlp"], "1", features=features)["score"]
    np.testing.assert_allclose(result.as_numpy("score"), expected, rtol=1e-5, atol=1e-6)
    assert result.get_response().id == "r-17"


def test_every_datatype_round_trips_raw(client):
    for model, types in (("echo", TYPED), ("halves", HALVES)):
        inputs = [infer_input(name.lower(), values, name) for name, (_, values) in types.items()]
        result = client.infer(model, inputs)
        for name, (_, values) in types.items():
            out = result.get_output(f"{name.lower()}_out")
            assert out.datatype == name
            got = result.as_numpy(f"{name.lower()}_out")
            if name == "BF16":  # whether tritonclient hands BF16 back as float32 or bfloat16
                got = got.astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got, values)


def test_every_typed_datatype_round_trips_in_typed_contents_answered_raw(stub):
    request = service_pb2.ModelInferRequest(model_name="echo")
    for name, (_, values) in TYPED.items():
        tensor = request.inputs.add(name=name.lower(), datatype=name, shape=[2])
        field = {"BOOL": "bool", "INT64": "int64", "UINT64": "uint64", "FP32": "fp32", "FP64": "fp64"}.get(name)
        field = field or ("bytes" if name == "BYTES" else "uint" if name.startswith("UINT") else "int")
        getattr(tensor.contents, f"{field}_contents").extend(values.tolist())
    response = stub.ModelInfer(request, timeout=30)
    # typed in, raw out, as Triton answers: one raw_output_contents entry per output, in order, no typed contents
    assert len(response.raw_output_contents) == len(response.outputs) == len(TYPED)
    for out, data in zip(response.outputs, response.raw_output_contents, strict=True):
        name = out.datatype
        assert out.name == f"{name.lower()}_out" and list(out.shape) == [2] and not out.contents.ListFields()
        got = deserialize_bytes_tensor(data) if name == "BYTES" else np.frombuffer(data, triton_to_np_dtype(name))
        np.testing.assert_array_equal(got, TYPED[name][1])


def test_triton_s_explicit_content_examples_read_raw_answers_and_find_triton_s_words(stub):
    # Triton's grpc_explicit_{int,int8,byte}_content_client.py: typed contents in, raw_output_contents[i] read back
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    request = service_pb2.ModelInferRequest(model_name="add")
    for name, values in (("a", a), ("b", b)):
        request.inputs.add(name=name, datatype="FP32", shape=[2, 3]).contents.fp32_contents.extend(values.ravel())
    response = stub.ModelInfer(request, timeout=30)
    assert [o.name for o in response.outputs] == ["sum"]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 3), a + b)
    # ... then one raw entry beside the typed contents: refused in Triton's words, before the entries are counted
    mixed = service_pb2.ModelInferRequest()
    mixed.CopyFrom(request)
    mixed.raw_input_contents.append(a.tobytes())
    error = rpc_error(stub.ModelInfer, mixed)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(
        "contents field must not be specified when using raw_input_contents for 'a' for model 'add'"
    )
    # ... and a version string that is no version
    request.model_version = "wrong_specification"
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failed to get model version from specified version string 'wrong_specification'" in error.details()


def test_strings_and_requested_outputs(client):
    text = np.array([b"abc", "héllo".encode()], dtype=object)
    result = client.infer("strings", [infer_input("text", text)], outputs=[triton.InferRequestedOutput("upper")])
    assert [o.name for o in result.get_response().outputs] == ["upper"]
    assert result.as_numpy("length") is None
    assert result.as_numpy("upper").tolist() == [b"ABC", "HéLLO".encode()]
    both = [triton.InferRequestedOutput("length"), triton.InferRequestedOutput("upper")]
    result = client.infer("strings", [infer_input("text", text)], outputs=both)
    assert result.as_numpy("length").tolist() == [3, 6]


def test_priority_parameter_is_the_request_priority(client, served, stub):
    daemon = served[0]
    before = metric(daemon, "servex_requests_total", method="ModelInfer", priority="5", code="OK")
    x = np.array([[1.0]], np.float32)
    client.infer("tf1", [infer_input("x", x)], priority=5)  # tritonclient sends uint64_param
    request = service_pb2.ModelInferRequest(model_name="tf1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
    request.parameters["priority"].int64_param = 5
    stub.ModelInfer(request, timeout=30, metadata=[("x-servex-priority", "1")])  # the parameter wins
    assert metric(daemon, "servex_requests_total", method="ModelInfer", priority="5", code="OK") == before + 2
    request.parameters["priority"].string_param = "high"
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'priority' must be an integer" in error.details()
    request.parameters["priority"].int64_param = 10**6
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter 'priority' must be an integer from" in error.details()


def test_reflection_lists_the_service(served):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert "inference.GRPCInferenceService" in ProtoReflectionDescriptorDatabase(served[0].channel).get_services()


# -- malformed requests --------------------------------------------------------------------------------


def _both(request):
    request.inputs[0].contents.fp32_contents.append(1.0)
    return request


def _extra_raw(request):
    request.raw_input_contents.append(b"\0\0\0\0")
    return request


def _version(request, version):
    request.model_version = version
    return request


def _output(request, name):
    request.outputs.add(name=name)
    return request


def _parameter(request, name, **value):
    request.parameters[name].MergeFrom(service_pb2.InferParameter(**value))
    return request


def _fp64_request():
    request = service_pb2.ModelInferRequest(model_name="tf1")
    request.inputs.add(name="x", datatype="FP64", shape=[1, 1]).contents.fp64_contents.append(1.0)
    return request


BAD_REQUESTS = {
    "unknown datatype": (fp32_request(datatype="FP33"), "INVALID_ARGUMENT", "'x': unknown datatype 'FP33'"),
    "raw size": (fp32_request(values=(1.0, 2.0), raw=True), "INVALID_ARGUMENT", "'x': 8 raw bytes do not fit"),
    "raw and typed": (
        _both(fp32_request(raw=True)),
        "INVALID_ARGUMENT",
        "contents field must not be specified when using raw_input_contents for 'x' for model 'tf1'",
    ),
    "raw count": (_extra_raw(fp32_request(raw=True)), "INVALID_ARGUMENT", "raw_input_contents holds 2 entries"),
    "typed count": (fp32_request(values=(1.0, 2.0)), "INVALID_ARGUMENT", "fp32_contents holds 2 values, but"),
    "no values": (fp32_request(values=()), "INVALID_ARGUMENT", "fp32_contents holds 0 values, but"),
    "wrong field": (fp32_request(datatype="INT32"), "INVALID_ARGUMENT", "takes its values in int_contents"),
    "output": (_output(fp32_request(), "z"), "INVALID_ARGUMENT", "outputs names unknown output(s) ['z']; outputs"),
    "version": (_version(fp32_request(), "v1"), "INVALID_ARGUMENT", "'v1' is not a version number"),
    "unknown version": (
        _version(fp32_request(), "99"),
        "NOT_FOUND",
        "Request for unknown model: 'tf1' version 99 is not found; model 'tf1' has no version 99",
    ),
    "unknown model": (fp32_request(model="nope"), "NOT_FOUND", "'nope' is not served"),
    "no model": (fp32_request(model=""), "INVALID_ARGUMENT", "model_name is empty"),
    "unknown input": (fp32_request(name="q"), "INVALID_ARGUMENT", "unknown input(s) ['q']"),
    "shape": (fp32_request(values=(1.0, 2.0), shape=(1, 2)), "INVALID_ARGUMENT", "'x' expects shape [-1,1]"),
    "dtype": (_fp64_request(), "INVALID_ARGUMENT", "'x' expects dtype DT_FLOAT"),
    # Triton's timeout parameter, in microseconds: 1 has passed before the run could start
    "timeout": (_parameter(fp32_request(), "timeout", int64_param=1), "DEADLINE_EXCEEDED", "the run did not happen"),
    "timeout type": (_parameter(fp32_request(), "timeout", string_param="1s"), "INVALID_ARGUMENT", "'timeout' must be"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_answered_with_what_was_wrong(stub, client, case):
    request, code, message = BAD_REQUESTS[case]
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == getattr(grpc.StatusCode, code), error.details()
    assert message in error.details()
    assert client.infer("tf1", [infer_input("x", np.array([[2.0]], np.float32))]).as_numpy("y")[0, 0] == 3.0


def test_tensorflow_s_own_run_error_names_the_model_version_and_signature(stub, client):
    # Both inputs fit the signature ([-1,3]), but their batches differ: TensorFlow's Add refuses them.
    inputs = [infer_input("a", np.ones((2, 3), np.float32)), infer_input("b", np.ones((3, 3), np.float32))]
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", inputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = info.value.message()
    assert message.startswith("model 'add' version 1 signature 'serving_default': running ")
    assert "Incompatible shapes" in message
    inputs = [infer_input("a", np.ones((2, 3), np.float32)), infer_input("b", np.ones((2, 3), np.float32))]
    assert client.infer("add", inputs).as_numpy("sum").tolist() == [[2.0] * 3] * 2


def test_malformed_bytes_input(stub):
    request = service_pb2.ModelInferRequest(model_name="strings")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x09\0\0\0abc")
    error = rpc_error(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'text': BYTES element 0 claims 9 bytes past the data's end" in error.details()


# -- the repository extension: admin port only ---------------------------------------------------------


def test_repository_is_not_on_the_main_port(client):
    for call in (
        client.get_model_repository_index,
        lambda: client.load_model("tf1"),
        lambda: client.unload_model("tf1"),
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "admin port" in info.value.message()


def test_the_admin_port_answers_what_a_control_plane_client_asks_first(served):
    daemon, admin_port = served
    with triton.InferenceServerClient(f"127.0.0.1:{admin_port}") as admin:
        assert admin.is_server_live() and admin.is_server_ready()
        assert list(admin.get_server_metadata().extensions) == ["model_repository"]
        # what Triton's simple_grpc_model_control.py asks with the client it loads models with: read-only, served
        assert admin.is_model_ready("tf1") and not admin.is_model_ready("nope")
        assert admin.get_model_metadata("tf1").name == "tf1"
        assert admin.get_model_config("tf1").config.name == "tf1"
        with pytest.raises(InferenceServerException) as info:
            admin.infer("tf1", [infer_input("x", np.array([[1.0]], np.float32))])
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "served on the main gRPC port (--port)" in info.value.message()
    assert "NotImplementedError" not in daemon.log() and "Traceback" not in daemon.log()
    assert metric(daemon, "servex_requests_total", method="ModelInfer", code="UNIMPLEMENTED") == 1  # its own name


def test_repository_index_load_and_unload(served, client, models):
    daemon, admin_port = served
    admin_stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{admin_port}"))
    with triton.InferenceServerClient(f"127.0.0.1:{admin_port}") as admin:
        index = admin.get_model_repository_index()
        assert {(m.name, m.version, m.state) for m in index.models} >= {("tf1", "123", "READY"), ("mlp", "1", "READY")}

        admin.unload_model("tf1")
        assert not client.is_model_ready("tf1")
        with pytest.raises(InferenceServerException, match="'tf1' is not served"):
            client.infer("tf1", [infer_input("x", np.array([[1.0]], np.float32))])
        assert ("tf1", "", "UNAVAILABLE") in {
            (m.name, m.version, m.state) for m in admin.get_model_repository_index().models
        }
        ready_only = admin_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=30)
        assert "tf1" not in {m.name for m in ready_only.models} and "mlp" in {m.name for m in ready_only.models}

        admin.load_model("tf1")
        assert client.is_model_ready("tf1")
        assert client.infer("tf1", [infer_input("x", np.array([[4.0]], np.float32))]).as_numpy("y")[0, 0] == 4.0

        with pytest.raises(InferenceServerException) as info:
            admin.load_model("never_heard_of")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        # Triton's words first: its simple_grpc_model_control.py looks for "failed to load"
        assert info.value.message().startswith("failed to load 'never_heard_of': ")
        assert "send parameter 'base_path'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            admin.load_model("tf1", config='{"max_batch_size":"16"}')  # Triton's config override: not served
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message().startswith("failed to load 'tf1': parameter(s) ['config'] are not supported")
        with pytest.raises(InferenceServerException) as info:
            admin.unload_model("never_heard_of")
        assert info.value.status() == "StatusCode.NOT_FOUND"

        # a model not in the config: loaded from a folder of version folders
        load = service_pb2.RepositoryModelLoadRequest(model_name="mlp2")
        load.parameters["base_path"].string_param = str(models["mlp"])
        admin_stub.RepositoryModelLoad(load, timeout=120)
        features = np.ones((1, 64), np.float32)
        np.testing.assert_allclose(
            client.infer("mlp2", [infer_input("features", features)]).as_numpy("score"),
            client.infer("mlp", [infer_input("features", features)]).as_numpy("score"),
        )
        admin.unload_model("mlp2")
        assert not client.is_model_ready("mlp2")

        bad = service_pb2.RepositoryModelLoadRequest(model_name="broken")
        bad.parameters["base_path"].string_param = "/nonexistent/folder"
        error = rpc_error(admin_stub.RepositoryModelLoad, bad)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'broken'" in error.details() and "/nonexistent/folder" in error.details()
        admin.unload_model("broken")
        assert client.is_server_ready() and client.is_model_ready("mlp")
