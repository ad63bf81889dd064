"""The KServe v2 gRPC codec (server/protocols/kserve/v2_types.py's message functions) on tritonclient's own request and
response
messages: what the client sends is what servex decodes, and what servex encodes is what the client reads.

servex's generated `inference.*` modules are not imported here: they and tritonclient's share full names and one
process cannot hold both (tests/protos/test_generated.py checks the two are wire-compatible, in a subprocess)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from servex.loader.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from servex.server.protocols.kserve import dataplane_rules as rules
from servex.server.protocols.kserve import v2_types
from servex.server.protocols.kserve.shared_memory import SharedMemoryRegistry
from servex.server.transport import tensors
from tests.support.v2_requests import Request, raw_request

EXAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], np.uint8),
    "UINT16": np.array([[0, 7, 65535]], np.uint16),
    "UINT32": np.array([[0, 7, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 7, 2**64 - 1]], np.uint64),
    "INT8": np.array([[-128, 7, 127]], np.int8),
    "INT16": np.array([[-32768, 7, 32767]], np.int16),
    "INT32": np.array([[-(2**31), 7, 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 7, 2**63 - 1]], np.int64),
    "FP16": np.array([[0.5, -2.0, 65504]], np.float16),
    "BF16": np.array([[0.5, -2.0, 3.0e38]], ml_dtypes.bfloat16),
    "FP32": np.array([[0.5, -2.0, 1e30]], np.float32),
    "FP64": np.array([[0.5, -2.0, 1e300]], np.float64),
    "BYTES": np.array([[b"", b"a\x00b", "é".encode()]], dtype=object),
}


def typed_input(request: Request, name: str, datatype: str, shape, **contents) -> None:
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)


def decode(request: Request):
    return v2_types.decode_infer_inputs(request.inputs, request.raw_input_contents, SharedMemoryRegistry())


# -- versions and parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "version"), [("", None), ("7", 7), ("00123", 123)])
def test_version_is_latest_or_a_number(text, version):
    assert rules.parse_version(text) == version


@pytest.mark.parametrize("text", ["abc", "-1", "1.5", " 1", "latest"])
def test_version_that_is_not_a_number_is_invalid(text):
    # Triton's words first: its grpc_explicit_int8_content_client.py looks for them
    triton_s = f"^failed to get model version from specified version string '{text}': .* is not a version number"
    with pytest.raises(InvalidArgument, match=triton_s):
        rules.parse_version(text)


def priority_parameter(param) -> int:
    """The gRPC adapter's way: the InferParameter's value, then the data plane's one rule."""
    return rules.priority(v2_types.parameter_value(param))


def test_priority_from_int64_or_uint64_param():
    assert priority_parameter(service_pb2.InferParameter(int64_param=-3)) == -3
    assert priority_parameter(service_pb2.InferParameter(uint64_param=5)) == 5


@pytest.mark.parametrize(
    "param",
    [
        service_pb2.InferParameter(string_param="5"),
        service_pb2.InferParameter(double_param=1.0),
        service_pb2.InferParameter(bool_param=True),
        service_pb2.InferParameter(),
    ],
)
def test_priority_that_is_not_an_integer_is_invalid(param):
    with pytest.raises(InvalidArgument, match="'priority' must be an integer"):
        priority_parameter(param)


def test_priority_beyond_int64_is_invalid():
    with pytest.raises(InvalidArgument, match="more than the largest int64"):
        priority_parameter(service_pb2.InferParameter(uint64_param=2**63))


# -- raw inputs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(EXAMPLES))
def test_every_datatype_decodes_from_tritonclient_raw_data(datatype):
    array = EXAMPLES[datatype]
    inputs, raw = decode(raw_request({"t": array}))
    assert raw
    assert inputs["t"].dtype == v2_types.DTYPES[datatype]
    assert inputs["t"].shape == array.shape
    np.testing.assert_array_equal(inputs["t"], array)


def test_raw_fixed_size_input_is_a_view_over_the_request_bytes():
    inputs, _ = decode(raw_request({"t": np.arange(64, dtype=np.float32).reshape(1, 64)}))
    view = inputs["t"]
    assert not view.flags.owndata  # np.frombuffer over the message's bytes, not a copy
    assert not view.flags.writeable
    assert isinstance(view.base, bytes | memoryview) or isinstance(view.base.base, bytes | memoryview)


def test_raw_count_must_match_inputs():
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.raw_input_contents.append(b"")
    with pytest.raises(InvalidArgument, match=r"raw_input_contents holds 2 entries but the request has 1 input"):
        decode(request)


def test_raw_size_must_match_shape_and_datatype():
    request = raw_request({"a": np.zeros((2, 3), np.float32)})
    request.raw_input_contents[0] = b"\0" * 20
    with pytest.raises(InvalidArgument, match=r"'a': 20 raw bytes do not fit datatype FP32 shape \[2, 3\].*24 bytes"):
        decode(request)


def test_raw_and_typed_contents_together_are_invalid():
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidArgument, match=r"^contents field must not be specified when using raw_input_contents "
                       r"for 'a' for model '': input 'a' has typed contents"):  # fmt: skip
        decode(request)


def test_typed_contents_beside_raw_are_refused_before_the_raw_entries_are_counted():
    # Triton's grpc_explicit_int_content_client.py: one raw entry for two inputs, the first also typed
    request = raw_request({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})
    del request.raw_input_contents[1]
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidArgument, match="must not be specified when using raw_input_contents for 'a' for model"):
        v2_types.decode_infer_inputs(request.inputs, request.raw_input_contents, SharedMemoryRegistry(), "m")


def test_unknown_datatype_names_the_known_ones():
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs[0].datatype = "FP33"
    with pytest.raises(InvalidArgument, match=r"'a': unknown datatype 'FP33'; expected one of BOOL, .*BYTES"):
        decode(request)


def test_negative_dimension_is_invalid():
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs[0].shape[:] = [-1, 2]
    with pytest.raises(InvalidArgument, match="negative dimension"):
        decode(request)


@pytest.mark.parametrize("shape", [[0, 2**61], [0, 2**40, 2**40], [1] * 65], ids=["0x2^61", "0x2^40x2^40", "rank-65"])
def test_shape_no_array_can_have_is_invalid(shape):
    # Zero elements but dimensions NumPy cannot index, or more dimensions than NumPy supports: INVALID_ARGUMENT,
    # not the ValueError from reshape that the server would answer INTERNAL.
    request = raw_request({"a": np.zeros(0, np.float32)})
    request.inputs[0].shape[:] = shape
    if len(shape) == 65:
        request.raw_input_contents[0] = np.zeros(1, np.float32).tobytes()
    with pytest.raises(InvalidArgument, match="'a': shape .*(too large|65 dimensions)"):
        decode(request)


def test_decode_cost_counts_what_decoding_walks():
    raw = raw_request({"a": np.zeros((4, 3), np.float32)})
    assert v2_types.decode_cost(raw.inputs) == 0  # an array over the request's bytes
    strings = raw_request({"s": np.array([b"ab"] * 5, dtype=object)})
    assert v2_types.decode_cost(strings.inputs) == 5  # BYTES: element by element
    typed = Request(model_name="m")
    typed_input(typed, "t", "FP32", [2**62] * 50_000, fp32_contents=[1.0, 2.0])  # the shape is not multiplied out
    typed_input(typed, "u", "BYTES", [1] * 65, bytes_contents=[b"x"])
    assert v2_types.decode_cost(typed.inputs) == 3
    shared = Request(model_name="m")
    tensor = shared.inputs.add(name="m", datatype="FP32", shape=[1])
    tensor.parameters[v2_types.SHARED_MEMORY_REGION].string_param = "region"
    assert v2_types.decode_cost(shared.inputs) >= tensors.OFF_LOOP_ELEMENTS  # a copy of the region
    # one raw entry per input: nothing typed or in shared memory is read (decoding refuses those first)
    assert v2_types.decode_cost(raw.inputs, len(raw.raw_input_contents)) == 0
    assert v2_types.decode_cost(strings.inputs, len(strings.raw_input_contents)) == 5
    assert v2_types.decode_cost(shared.inputs, 1) == 0


def test_raw_requests_the_one_pass_decode_leaves_get_the_general_answer():
    request = raw_request({"a": np.zeros(2, np.float32), "b": np.ones(3, np.int32)})
    arrays, raw = decode(request)
    assert raw and arrays["a"].tolist() == [0.0, 0.0] and arrays["b"].tolist() == [1, 1, 1]
    request.inputs[1].name = ""
    with pytest.raises(InvalidArgument, match="input 1 has no name"):
        decode(request)
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs[0].parameters["shared_memory_region"].string_param = "region"
    with pytest.raises(InvalidArgument, match="raw_input_contents holds 1 entries but the request has 0 input"):
        decode(request)
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs[0].contents.SetInParent()  # present but empty: no typed values, so the raw entry is its data
    arrays, _ = decode(request)
    assert arrays["a"].tolist() == [0.0, 0.0]


def test_bool_bytes_other_than_0_and_1_are_invalid():
    request = raw_request({"z": np.array([True, False, True])})
    request.raw_input_contents[0] = b"\x01\x00\x07"
    with pytest.raises(InvalidArgument, match="'z': BOOL byte 7 at element 2; each element is one byte, 0 or 1"):
        decode(request)
    request.raw_input_contents[0] = b"\x01\x00\x01"
    np.testing.assert_array_equal(decode(request)[0]["z"], [True, False, True])


def test_malformed_bytes_are_invalid():
    request = raw_request({"s": np.array([b"abc", b"de"], dtype=object)})
    request.raw_input_contents[0] = request.raw_input_contents[0][:-1]
    with pytest.raises(InvalidArgument, match="'s': BYTES element 1 claims 2 bytes past the data's end"):
        decode(request)


def test_huge_bytes_shape_over_little_data_fails_without_allocating():
    request = raw_request({"s": np.array([b"abc"], dtype=object)})
    request.inputs[0].shape[:] = [10**12]
    with pytest.raises(InvalidArgument, match="cannot hold the 1000000000000 BYTES elements"):
        decode(request)


def test_duplicate_and_nameless_inputs_are_invalid():
    request = raw_request({"a": np.zeros(2, np.float32)})
    request.inputs.append(request.inputs[0])
    request.raw_input_contents.append(request.raw_input_contents[0])
    with pytest.raises(InvalidArgument, match="'a' is sent twice"):
        decode(request)
    request = Request()
    typed_input(request, "", "FP32", [1], fp32_contents=[1.0])
    with pytest.raises(InvalidArgument, match="input 0 has no name"):
        decode(request)


def test_an_input_in_a_region_never_registered_is_not_found():
    request = raw_request({"a": np.zeros(2, np.float32)})
    del request.raw_input_contents[:]  # its data is in the region
    request.inputs[0].parameters["shared_memory_region"].string_param = "region"
    request.inputs[0].parameters["shared_memory_byte_size"].int64_param = 8
    with pytest.raises(NotFound, match="input 'a': shared memory region 'region' is not registered"):
        decode(request)


def test_inputs_read_from_shared_memory_are_bounded_together(tmp_path):
    # Each input reads 24 bytes of one region, within the limit of 32; the second would make 48 together.
    (tmp_path / "mem").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    registry = SharedMemoryRegistry(tmp_path, max_read_bytes=32)
    registry.register("region", "/mem", 0, 24)
    request = raw_request({"a": np.zeros(6, np.float32), "b": np.zeros(6, np.float32)})
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        tensor.parameters["shared_memory_region"].string_param = "region"
        tensor.parameters["shared_memory_byte_size"].int64_param = 24
    one = service_pb2.ModelInferRequest(inputs=request.inputs[:1])
    arrays, _ = v2_types.decode_infer_inputs(one.inputs, [], registry)
    assert arrays["a"].tolist() == list(range(6))
    with pytest.raises(ResourceExhausted, match=r"input 'b': .*with the request's other inputs \(24 bytes\)"):
        v2_types.decode_infer_inputs(request.inputs, [], registry)


# -- typed inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", [d for d in EXAMPLES if d in v2_types.CONTENTS_FIELDS])
def test_typed_contents_round_trip_every_datatype_that_has_a_field(datatype):
    array = EXAMPLES[datatype]
    request = Request()
    tensor = request.inputs.add(name="t", datatype=datatype, shape=array.shape)
    v2_types.fill_contents(tensor.contents, array)
    inputs, raw = decode(request)
    assert not raw
    assert inputs["t"].dtype == v2_types.DTYPES[datatype]
    np.testing.assert_array_equal(inputs["t"], array)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_has_no_typed_field(datatype):
    request = Request()
    typed_input(request, "h", datatype, [1], fp32_contents=[1.0])
    with pytest.raises(InvalidArgument, match=f"'h': datatype {datatype} has no typed contents field; send it in raw"):
        decode(request)


def test_typed_values_in_the_wrong_field_are_invalid():
    request = Request()
    typed_input(request, "x", "FP32", [2], int_contents=[1, 2])
    with pytest.raises(InvalidArgument, match=r"'x': datatype FP32 takes its values in fp32_contents, got \['int_"):
        decode(request)


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0, 4.0], []])
def test_typed_value_count_must_match_the_shape(values):
    request = Request()
    typed_input(request, "x", "FP32", [1, 3], fp32_contents=values)
    with pytest.raises(InvalidArgument, match=rf"'x': fp32_contents holds {len(values)} values, but .* takes 3"):
        decode(request)


def test_typed_value_out_of_range_for_narrow_integers():
    request = Request()
    typed_input(request, "x", "INT8", [2], int_contents=[1, 300])
    with pytest.raises(InvalidArgument, match=r"'x': value 300 in int_contents is out of range for INT8 \(-128..127\)"):
        decode(request)
    request = Request()
    typed_input(request, "u", "UINT16", [1], uint_contents=[70000])
    with pytest.raises(InvalidArgument, match="out of range for UINT16"):
        decode(request)


def test_empty_tensor_decodes_typed_and_raw():
    request = Request()
    typed_input(request, "x", "FP32", [0, 3])
    inputs, _ = decode(request)
    assert inputs["x"].shape == (0, 3)
    inputs, _ = decode(raw_request({"x": np.zeros((0, 3), np.int64)}))
    assert inputs["x"].shape == (0, 3)


# -- outputs -------------------------------------------------------------------------------------------


def read_outputs(response) -> dict[str, np.ndarray]:
    """What a client reads: typed contents, or raw_output_contents in output order (tritonclient's decoding)."""
    out = {}
    for i, tensor in enumerate(response.outputs):
        dtype = v2_types.DTYPES[tensor.datatype]
        if response.raw_output_contents:
            data = response.raw_output_contents[i]
            if tensor.datatype == "BYTES":
                out[tensor.name] = deserialize_bytes_tensor(data).reshape(tensor.shape)
            else:
                out[tensor.name] = np.frombuffer(data, dtype).reshape(tensor.shape)
        else:
            out[tensor.name] = v2_types.from_contents(tensor.contents, tensor.datatype, tensor.shape, tensor.name)
    return out


def test_outputs_raw_when_the_request_was_raw():
    response = service_pb2.ModelInferResponse()
    outputs = {"y": EXAMPLES["FP32"], "s": EXAMPLES["BYTES"]}
    v2_types.fill_infer_outputs(response, outputs, raw=True)
    assert len(response.raw_output_contents) == 2
    assert not response.outputs[0].HasField("contents")
    assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
        ("y", "FP32", [1, 3]),
        ("s", "BYTES", [1, 3]),
    ]
    got = read_outputs(response)
    np.testing.assert_array_equal(got["y"], outputs["y"])
    np.testing.assert_array_equal(got["s"], outputs["s"])


def test_outputs_typed_when_the_request_was_typed():
    response = service_pb2.ModelInferResponse()
    outputs = {d: EXAMPLES[d] for d in EXAMPLES if d in v2_types.CONTENTS_FIELDS}
    v2_types.fill_infer_outputs(response, outputs, raw=False)
    assert not response.raw_output_contents
    for name, got in read_outputs(response).items():
        np.testing.assert_array_equal(got, outputs[name])


def test_a_half_precision_output_makes_every_output_raw():
    response = service_pb2.ModelInferResponse()
    v2_types.fill_infer_outputs(response, {"y": EXAMPLES["FP32"], "h": EXAMPLES["FP16"]}, raw=False)
    assert len(response.raw_output_contents) == 2
    np.testing.assert_array_equal(read_outputs(response)["h"], EXAMPLES["FP16"])


def test_an_output_v2_cannot_carry_is_named():
    response = service_pb2.ModelInferResponse()
    with pytest.raises(FailedPrecondition, match="output 'z' has dtype complex64"):
        v2_types.fill_infer_outputs(response, {"z": np.zeros(2, np.complex64)}, raw=True)


def test_decode_bytes_refuses_a_count_the_data_cannot_hold_before_allocating():
    from servex.server.protocols.kserve.v2_types import decode_bytes

    with pytest.raises(InvalidArgument, match="7 bytes cannot hold the 10000000000 BYTES elements"):
        decode_bytes(b"\x03\x00\x00\x00abc", 10**10, "s")
