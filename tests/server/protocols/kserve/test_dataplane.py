"""The KServe v2 data plane (server/protocols/kserve/dataplane.py, dataplane_rules.py) in process, against a
ServingCore serving TensorFlow Serving's half_plus_two: what both adapters call. The gRPC adapter's plain values
(``v2_types.infer_fields`` over tritonclient's own request messages, as in
tests/server/protocols/kserve/test_grpc_api.py) and REST's
JSON (``rest_api.infer_request``) make the same request, checked by the same rules in the same words.

servex's generated `inference.*` modules are not imported here (see tests/server/protocols/kserve/test_grpc_api.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from servex.loader.errors import FailedPrecondition, InvalidArgument, NotFound, ServingError, Unimplemented
from servex.server.core import RequestInfo
from servex.server.protocols.kserve import dataplane, rest_api, v2_types
from servex.server.protocols.kserve import dataplane_rules as rules
from servex.server.protocols.kserve.shared_memory import SharedMemoryRegistry
from tests.support.in_process import serving_core
from tests.support.v2_requests import raw_request

Request = service_pb2.ModelInferRequest


@pytest.fixture(scope="module")
def plane():
    with serving_core("hp") as core:
        yield dataplane.DataPlane(core)


def grpc_request(**parameters) -> Request:
    """A ModelInferRequest for hp as tritonclient builds one, ``parameters`` set as its custom parameters are."""
    request = raw_request({"x": np.array([[1.0], [4.0]], np.float32)})
    request.model_name = "hp"
    for key, value in parameters.items():
        field = {str: "string_param", float: "double_param", bool: "bool_param", int: "int64_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


def from_grpc(request: Request, info: RequestInfo | None = None) -> rules.InferRequest:
    """The gRPC adapter's conversion: the message's plain values to the data plane."""
    parameters, outputs = v2_types.infer_fields(request)
    call = dataplane.DataPlane.infer_request(
        request.model_name, request.model_version, request.id, parameters, outputs, info or RequestInfo()
    )
    if request.raw_input_contents:
        call.inputs, _ = v2_types.decode_infer_inputs(
            request.inputs, request.raw_input_contents, SharedMemoryRegistry()
        )
    return call


def from_rest(doc: dict, version: str = "", info: RequestInfo | None = None) -> rules.InferRequest:
    return rest_api.infer_request("hp", version, doc, info or RequestInfo())


def refusals(grpc_call, rest_call) -> str:
    """Both calls fail with the same ServingError class and message; the message."""
    with pytest.raises(ServingError) as g:
        grpc_call()
    with pytest.raises(ServingError) as r:
        rest_call()
    assert (type(g.value), g.value.message) == (type(r.value), r.value.message)
    return g.value.message


def test_server_metadata_and_version_fallback(plane, monkeypatch):
    meta = plane.server_metadata()
    assert meta.name == "servex" and meta.extensions == v2_types.EXTENSIONS and meta.version
    assert plane.server_metadata(dataplane.ADMIN_EXTENSIONS).extensions == ("model_repository",)
    plane.repository = object()  # the inference ports serve the repository extension too
    try:
        assert plane.server_metadata().extensions[-1] == "model_repository"
    finally:
        plane.repository = None

    def missing(name):
        raise rules.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(rules.metadata, "version", missing)
    rules.server_version.cache_clear()
    try:
        assert plane.server_metadata().as_dict()["version"] == "0.0.0"  # Triton's answer is a version number
    finally:
        monkeypatch.undo()
        rules.server_version.cache_clear()


def test_model_ready_and_metadata(plane):
    assert plane.server_ready()
    assert plane.model_ready("hp").ready and plane.model_ready("hp", "123").ready
    not_ready = plane.model_ready("nope")
    assert not not_ready.ready and isinstance(not_ready.error, NotFound)
    assert not plane.model_ready("hp", "7").ready and not plane.model_ready("").ready
    with pytest.raises(InvalidArgument, match="'x' is not a version number"):
        plane.model_ready("hp", "x")
    meta = plane.model_metadata("hp", "123")
    assert meta.as_dict() == {
        "name": "hp",
        "versions": ["123"],
        "platform": "tensorflow_savedmodel",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
    }
    served = plane.core.resolve("hp")
    cached = plane._tensors[served]
    assert plane.model_metadata("hp") == meta and plane._tensors[served] is cached  # cached per served version
    with pytest.raises(InvalidArgument, match="name is empty"):
        plane.model_metadata("")
    with pytest.raises(NotFound, match="Request for unknown model: 'nope'"):
        plane.model_metadata("nope")


def test_a_dtype_without_a_v2_datatype_is_named_in_v2s_case():
    assert dataplane.metadata_datatype(np.complex64) == "COMPLEX64"
    assert dataplane.metadata_datatype(np.dtype(object)) == "BYTES"
    with pytest.raises(FailedPrecondition, match="output 'z' has dtype complex128, which the KServe v2 protocol"):
        v2_types.carried_datatype("z", np.complex128)


def test_model_config_and_statistics(plane):
    assert plane.model_config("hp")["name"] == "hp"
    with pytest.raises(InvalidArgument, match="name is empty"):
        plane.model_config("", "1")
    assert [s["name"] for s in plane.model_statistics("hp")["model_stats"]] == ["hp"]
    with pytest.raises(InvalidArgument, match="version 1 was given without a model name"):
        plane.model_statistics("", "1")


@pytest.mark.parametrize(
    ("text", "version"), [("0", 0), ("0042", 42), ("0" * 30 + "7", 7), ("9223372036854775807", 2**63 - 1)]
)
def test_versions_up_to_int64_with_leading_zeros(text, version):
    assert rules.parse_version(text) == version


@pytest.mark.parametrize("text", ["9223372036854775808", "1" + "0" * 5000, "\u00b9", "\u0661", "+1", "1 "])
def test_versions_beyond_int64_or_not_ascii_digits_are_refused(text):
    with pytest.raises(InvalidArgument, match="is not a version number") as e:
        rules.parse_version(text)
    assert len(e.value.message) < 300  # thousands of digits are cut, never int()


def test_grpc_and_rest_requests_become_the_same_data_plane_request():
    info_g, info_r = RequestInfo(deadline=None), RequestInfo(deadline=None)
    request = grpc_request(priority=9, timeout=5_000_000, signature_name="serving_default")
    request.id = "r"
    request.outputs.add(name="y").parameters["classification"].int64_param = 1
    doc = {
        "id": "r",
        "parameters": {"priority": 9, "timeout": 5_000_000, "signature_name": "serving_default"},
        "outputs": [{"name": "y", "parameters": {"classification": 1}}],
    }
    g, r = from_grpc(request, info_g), from_rest(doc, info=info_r)
    g.inputs = {}
    assert g == r
    assert r.classes() == {"y": 1} and r.signature == "serving_default" and r.id == "r"
    assert info_g.priority == info_r.priority == 9 and info_g.deadline and info_r.deadline


def test_infer_runs_classifies_and_echoes_the_id(plane):
    request = grpc_request()
    request.id = "r-1"
    call = from_grpc(request)
    answer = asyncio.run(plane.infer(call))
    assert (answer.model_name, answer.model_version, answer.id) == ("hp", "123", "r-1")
    assert answer.outputs["y"].tolist() == [[2.5], [4.0]]
    request.outputs.add(name="y").parameters["classification"].int64_param = 3
    answer = asyncio.run(plane.infer(from_grpc(request)))
    assert answer.outputs["y"].tolist() == [[b"2.500000:0"], [b"4.000000:0"]]  # top N, at most the classes there are


def test_a_timeout_shortens_the_deadline_and_never_lengthens_it():
    info = RequestInfo(deadline=time.monotonic() + 1)
    rules.apply_parameters({"timeout": 60_000_000}, info)
    assert info.deadline < time.monotonic() + 2
    rules.apply_parameters({"timeout": 1000}, info)
    assert info.deadline < time.monotonic() + 0.01
    info = RequestInfo()
    rules.apply_parameters({"timeout": 0}, info)  # Triton's default: none
    assert info.deadline is None


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("priority", "high", "parameter 'priority' must be an integer (larger runs first), got \"high\""),
        ("priority", 1.5, "parameter 'priority' must be an integer (larger runs first), got 1.5"),
        ("priority", True, "parameter 'priority' must be an integer (larger runs first), got true"),
        ("priority", 101, "parameter 'priority' must be an integer from -100 to 100, got 101"),
        ("timeout", "soon", "parameter 'timeout' must be an integer (microseconds), got \"soon\""),
        ("binary_data_output", 1, "parameter 'binary_data_output' must be true or false, got 1"),
        ("signature_name", 3, "parameter 'signature_name' must be a string (a signature's name), got 3"),
    ],
)
def test_bad_request_parameters_are_refused_in_the_same_words(name, value, words):
    message = refusals(
        lambda: from_grpc(grpc_request(**{name: value})), lambda: from_rest({"parameters": {name: value}})
    )
    assert message == words


def out_param(request: Request, output: str, **parameters) -> Request:
    out = request.outputs.add(name=output)
    for key, value in parameters.items():
        field = {str: "string_param", float: "double_param", bool: "bool_param", int: "int64_param"}[type(value)]
        setattr(out.parameters[key], field, value)
    return request


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"classification": 0}, "output 'y': parameter 'classification' is 0; ask for at least 1 class"),
        ({"classification": "2"}, "output 'y': parameter 'classification' must be an integer (top N), got \"2\""),
        ({"shared_memory_region": 3}, "output 'y': parameter 'shared_memory_region' must be a string naming a"),
        ({"shared_memory_region": "r"}, "output 'y': a shared memory region needs parameter 'shared_memory_byte_"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": "8"}, "'shared_memory_byte_size' must be an int"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 1.0}, "offset' must be"),
        ({"binary_data": "yes"}, "output 'y': parameter 'binary_data' must be true or false, got \"yes\""),
    ],
)
def test_bad_output_parameters_are_refused_in_the_same_words(parameters, words):
    message = refusals(
        lambda: from_grpc(out_param(grpc_request(), "y", **parameters)),
        lambda: from_rest({"outputs": [{"name": "y", "parameters": parameters}]}),
    )
    assert words in message


def test_outputs_named_twice_or_without_a_name_and_places_in_shared_memory():
    twice = refusals(
        lambda: from_grpc(out_param(out_param(grpc_request(), "y"), "y")),
        lambda: from_rest({"outputs": [{"name": "y"}, {"name": "y"}]}),
    )
    assert twice == "output 'y' is requested twice"
    nameless = refusals(lambda: from_grpc(out_param(grpc_request(), "")), lambda: from_rest({"outputs": [{}]}))
    assert nameless == "outputs[0] has no 'name' (a string naming the output)"
    place = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 8}
    g = from_grpc(out_param(grpc_request(), "y", **place))
    assert g.places() == from_rest({"outputs": [{"name": "y", "parameters": place}]}).places() == {"y": ("r", 8, 64)}


@pytest.mark.parametrize(
    ("version", "model", "words"),
    [
        ("abc", "hp", "failed to get model version from specified version string 'abc'"),
        ("", "", "model_name is empty: name the model to call"),
    ],
)
def test_version_and_model_are_checked_first(version, model, words):
    request = grpc_request(priority="bad")
    request.model_name, request.model_version = model, version
    with pytest.raises(InvalidArgument, match=words):
        from_grpc(request)
    with pytest.raises(InvalidArgument, match=words):
        dataplane.DataPlane.infer_request(model, version, "", {"priority": "bad"})


def test_unknown_output_and_model_answer_from_the_core(plane):
    with pytest.raises(InvalidArgument, match=r"unknown output\(s\) \['nope'\]"):
        asyncio.run(plane.infer(from_grpc(out_param(grpc_request(), "nope"))))
    call = from_grpc(grpc_request())
    call.model = "nope"
    with pytest.raises(NotFound, match="Request for unknown model: 'nope' is not served"):
        asyncio.run(plane.infer(call))


def test_shared_memory_registration_is_checked_once(plane, tmp_path):
    with pytest.raises(InvalidArgument, match="'key' must be a string naming the shared memory"):
        plane.register_shared_memory("r", 5, 0, 8)
    with pytest.raises(InvalidArgument, match=r"offset must be an integer \(bytes into the shared memory\), got"):
        plane.register_shared_memory("r", "/k", "0", 8)
    with pytest.raises(InvalidArgument, match=r"byte_size must be an integer \(the region's size in bytes\), got"):
        plane.register_shared_memory("r", "/k", 0, None)
    (tmp_path / "mem").write_bytes(bytes(16))
    own = dataplane.DataPlane(plane.core, shared_memory=SharedMemoryRegistry(tmp_path))
    own.register_shared_memory("r", "/mem", 0, 16)
    assert own.shared_memory_status() == [{"name": "r", "key": "/mem", "offset": 0, "byte_size": 16}]
    assert plane.shared_memory_status() == []  # each plane its own regions: none of them is the core's
    own.unregister_shared_memory()
    assert own.shared_memory_status() == [] and own.cuda_shared_memory_status() == []
    with pytest.raises(Unimplemented, match="CUDA shared memory is not supported"):
        own.register_cuda_shared_memory()


def test_repository_load_takes_base_path_as_a_string():
    assert rules.base_path("m", {}) is None
    assert rules.base_path("m", {"base_path": "/models/m"}) == "/models/m"
    for value in ("", 3, None, True):
        with pytest.raises(InvalidArgument, match="failed to load 'm': parameter 'base_path' must be a string naming"):
            rules.base_path("m", {"base_path": value})


def test_log_and_trace_settings_are_the_planes(plane):
    assert plane.update_log_settings({}) == plane.log_settings.values()
    with pytest.raises(InvalidArgument, match="log setting 'log_info' must be a boolean"):
        plane.update_log_settings({"log_info": 1})
    assert plane.trace_settings("hp", {"trace_rate": ["5"]})["trace_rate"] == ["5"]  # hp's own
    assert plane.trace_settings("", {})["trace_rate"] == ["1000"]  # the global one is untouched
    assert plane.trace_settings("hp", {"trace_rate": []})["trace_rate"] == ["1000"]  # cleared: the global one
    with pytest.raises(Unimplemented, match="TENSORS is not supported"):
        plane.trace_settings("", {"trace_level": ["TENSORS"]})
