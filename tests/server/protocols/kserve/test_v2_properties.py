"""Property tests of KServe v2's tensor decoders (server/protocols/kserve/v2_types.py, rest_tensors.py): raw bytes
(fixed-size types and length-prefixed BYTES), typed InferTensorContents, whole ModelInferRequests (raw, typed and
shared memory inputs together) and REST's JSON inputs with binary data decode to what tritonclient's own decoders
make of them, or are refused with a ServingError naming the input; never another exception, and without memory
out of proportion to the request (tests/support/strategies.py)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from servex.server.protocols.kserve import rest_tensors, v2_types
from servex.server.protocols.kserve.shared_memory import SharedMemoryRegistry
from servex.server.transport import json_codec
from tests.support.strategies import JSON_SCALARS, MIB, bounded_memory, examples, json_tensors, outcome, refused, shapes

NAME = "in_put"
CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND")
DATATYPES = st.sampled_from(list(v2_types.DTYPES) * 4 + ["FP8", "fp32", "", "STRING", "TYPE_FP32"])
REGION = "region"  # registered over 256 bytes 0, 1, 2, ... (the fixture)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shm")
    (folder / "key").write_bytes(bytes(range(256)))
    registry = SharedMemoryRegistry(folder, max_read_bytes=MIB)
    registry.register(REGION, "/key", 0, 256)
    yield registry
    registry.unregister()


def _count(shape) -> int:
    return math.prod(shape) if all(d >= 0 for d in shape) and len(shape) <= 64 else -1


def _bytes_elements(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


@st.composite
def raw_data(draw, datatype: str, shape: list[int]) -> bytes:
    """Raw bytes for a tensor: the size it takes (a little off sometimes); BYTES elements with their 4-byte
    lengths, sometimes cut short, with bytes left over, or a length claiming more than follows."""
    count = _count(shape)
    if datatype != "BYTES":
        itemsize = v2_types.DTYPES[datatype].itemsize if datatype in v2_types.DTYPES else 4
        size = count * itemsize if 0 <= count <= 4096 else draw(st.integers(0, 32))
        size = max(0, size + draw(st.sampled_from([0] * 6 + [1, -1, itemsize, -itemsize])))
        data = draw(st.binary(min_size=size, max_size=size))
        if datatype == "BOOL" and draw(st.booleans()):  # mostly valid booleans
            data = bytes(b & 1 for b in data)
        return data
    n = count if 0 <= count <= 64 else draw(st.integers(0, 4))
    data = _bytes_elements(draw(st.lists(st.binary(max_size=6), min_size=n, max_size=n)))
    change = draw(st.sampled_from(["none"] * 4 + ["cut", "extra", "long", "short"]))
    if change == "cut":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif change == "extra":
        data += draw(st.binary(min_size=1, max_size=5))
    elif change == "long" and data:
        data = struct.pack("<I", draw(st.sampled_from([2**32 - 1, 2**31, len(data)]))) + data[4:]
    elif change == "short":
        data = _bytes_elements([b"x"] * max(0, n - 1))
    return data


@st.composite
def raw_tensors(draw) -> tuple[str, list[int], bytes]:
    datatype = draw(DATATYPES)
    shape = draw(shapes())
    return datatype, shape, draw(raw_data(datatype, shape))


def _check_raw(result, datatype: str, shape: list[int], raw: bytes) -> None:
    """``result`` of ``from_raw``: tritonclient's reading of ``raw``, or a ServingError naming the input."""
    if not isinstance(result, np.ndarray):
        refused(result, repr(NAME), codes=CODES)
        return
    assert result.shape == tuple(shape) and result.dtype == v2_types.DTYPES[datatype]
    if datatype == "BYTES":
        assert result.reshape(-1).tolist() == deserialize_bytes_tensor(raw).tolist()
    else:
        want = np.frombuffer(raw, dtype=triton_to_np_dtype(datatype)).reshape(shape)
        assert result.tobytes() == want.tobytes()
        if datatype == "BOOL":
            assert set(raw) <= {0, 1}


@given(raw_tensors())
@example(("BYTES", [2], _bytes_elements([b"ab"]) + struct.pack("<I", 2**32 - 1)))  # a length past the end
@example(("BYTES", [2**40], b"\x00" * 8))  # 2^40 elements claimed by 8 bytes
@example(("BYTES", [0], b"\x00"))
@example(("FP16", [3], b"\x00" * 5))
@example(("BF16", [2, 2], b"\x80\x7f" * 4))
@example(("BOOL", [2], b"\x01\x02"))
@example(("FP32", [2**62, 4], b""))
@examples(300)
def test_raw_contents_decode_as_tritonclient_reads_them_or_are_refused(tensor):
    datatype, shape, raw = tensor
    result, peak = outcome(lambda: v2_types.from_raw(raw, datatype, shape, NAME))
    bounded_memory(peak, len(raw) + 8 * len(shape))
    _check_raw(result, datatype, shape, raw)


_CONTENT_VALUES = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1) | st.integers(-200, 300),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1) | st.integers(0, 300),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=6),
}


@st.composite
def typed_tensors(draw) -> tuple[str, list[int], service_pb2.InferTensorContents]:
    """A datatype, a shape and InferTensorContents: the datatype's own field (or another one), with as many
    values as the shape takes, or a few more or fewer; sometimes a second field too."""
    datatype = draw(DATATYPES)
    shape = draw(shapes())
    count = _count(shape)
    fields = list(_CONTENT_VALUES)
    own = v2_types.CONTENTS_FIELDS.get(datatype)
    field = own if own and draw(st.integers(0, 4)) else draw(st.sampled_from(fields))
    n = draw(st.sampled_from([count] * 4 + [count + 1, count - 1, 0])) if 0 <= count <= 64 else draw(st.integers(0, 4))
    contents = service_pb2.InferTensorContents()
    getattr(contents, field).extend(draw(st.lists(_CONTENT_VALUES[field], min_size=max(n, 0), max_size=max(n, 0))))
    if draw(st.integers(0, 9)) == 0:
        other = draw(st.sampled_from(fields))
        getattr(contents, other).extend(draw(st.lists(_CONTENT_VALUES[other], min_size=1, max_size=2)))
    return datatype, shape, contents


@given(typed_tensors())
@example(("INT8", [2], service_pb2.InferTensorContents(int_contents=[1, 128])))
@example(("UINT16", [1], service_pb2.InferTensorContents(uint_contents=[65536])))
@example(("FP16", [1], service_pb2.InferTensorContents(fp32_contents=[1.0])))
@example(("FP32", [2**40], service_pb2.InferTensorContents(fp32_contents=[1.0])))
@examples(300)
def test_typed_contents_decode_to_their_values_or_are_refused(tensor):
    datatype, shape, contents = tensor
    result, peak = outcome(lambda: v2_types.from_contents(contents, datatype, shape, NAME))
    bounded_memory(peak, contents.ByteSize() + 8 * len(shape))
    if not isinstance(result, np.ndarray):
        refused(result, repr(NAME), codes=CODES)
        return
    dtype = v2_types.DTYPES[datatype]
    assert result.shape == tuple(shape) and result.dtype == dtype
    values = list(getattr(contents, v2_types.CONTENTS_FIELDS[datatype]))
    if dtype.kind == "O":
        assert result.reshape(-1).tolist() == values
    elif dtype.kind == "f":  # FP32 and FP64 values as they are
        assert np.array_equal(result.reshape(-1), np.array(values, dtype), equal_nan=True)
    else:  # every value fits the datatype exactly
        assert result.reshape(-1).tolist() == values


@st.composite
def infer_requests(draw) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest of 1-3 inputs, each raw, typed or in shared memory, with raw_input_contents one per
    raw input (sometimes one more or fewer), names sometimes missing or repeated."""
    request = service_pb2.ModelInferRequest(model_name="m")
    for i in range(draw(st.integers(1, 3))):
        datatype = draw(DATATYPES)
        shape = draw(st.lists(st.integers(0, 3), max_size=3) | shapes())
        name = draw(st.sampled_from([f"in{i}"] * 6 + ["in0", ""]))
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        how = draw(st.sampled_from(["raw", "raw", "typed", "shared"]))
        if how == "raw":
            request.raw_input_contents.append(draw(raw_data(datatype, shape)))
        elif how == "typed":
            tensor.contents.CopyFrom(draw(typed_tensors())[2])
        else:
            tensor.parameters["shared_memory_region"].string_param = draw(st.sampled_from([REGION, REGION, "gone"]))
            size = _count(shape) * (v2_types.DTYPES[datatype].itemsize if datatype in v2_types.DTYPES else 4)
            size = min(max(size, 0), 2**63 - 1)
            tensor.parameters["shared_memory_byte_size"].int64_param = draw(st.sampled_from([size, 8, 300]))
            tensor.parameters["shared_memory_offset"].int64_param = draw(st.sampled_from([0, 0, 8, 250, -1, 2**62]))
    if draw(st.integers(0, 9)) == 0:
        request.raw_input_contents.append(b"\x00" * 4)
    return request


@given(infer_requests())
@examples(200)
def test_a_model_infer_request_decodes_input_by_input_or_is_refused(shared, request):
    names = [t.name for t in request.inputs]
    v2_types.decode_cost(request.inputs, len(request.raw_input_contents))  # never raises: it only counts
    result, peak = outcome(
        lambda: v2_types.decode_infer_inputs(request.inputs, request.raw_input_contents, shared, "m")
    )
    bounded_memory(peak, request.ByteSize(), allowed=2 * MIB)  # a shared memory read: a copy, up to its limit
    if not isinstance(result, tuple):
        assert result.code in CODES, result.message
        named = any(repr(n) in result.message for n in names if n)
        assert named or "raw_input_contents" in result.message or "has no name" in result.message, result.message
        return
    arrays, _ = result
    assert list(arrays) == names
    for tensor in request.inputs:
        assert arrays[tensor.name].shape == tuple(tensor.shape)
        assert arrays[tensor.name].dtype == v2_types.DTYPES[tensor.datatype]


# -- REST: JSON inputs and binary data -----------------------------------------------------------------------


@st.composite
def rest_bodies(draw) -> tuple[bytes, bytes]:
    """A KServe v2 REST infer body: the JSON (inputs with data, or binary_data_size into the bytes after it)
    and the binary data."""
    inputs, binary = [], b""
    for i in range(draw(st.integers(1, 3))):
        datatype = draw(DATATYPES)
        shape = draw(st.lists(st.integers(0, 3), max_size=3) | shapes() | st.just([2**64]))
        entry = {"name": draw(st.sampled_from([f"in{i}"] * 5 + ["in0", "", 3])), "datatype": datatype, "shape": shape}
        if draw(st.booleans()):
            leaves = st.text(max_size=4) if datatype == "BYTES" and draw(st.booleans()) else JSON_SCALARS
            data = draw(st.builds(lambda s, v: _flat_or_nested(s, v), st.just(shape), leaves) | json_tensors())
            entry["data"] = data
        else:
            chunk = draw(raw_data(datatype, shape))
            entry["parameters"] = {"binary_data_size": draw(st.sampled_from([len(chunk)] * 4 + [len(chunk) + 1, -1]))}
            binary += chunk
        inputs.append(draw(st.sampled_from([entry] * 9 + [[entry], "x"])))
    doc = draw(st.sampled_from([{"inputs": inputs}] * 9 + [{"inputs": []}, {"inputs": {}}]))
    return json.dumps(doc).encode(), binary + draw(st.sampled_from([b""] * 9 + [b"\x00"]))


def _flat_or_nested(shape, leaf):
    count = _count(shape)
    if not 0 <= count <= 64:
        return [leaf]
    return [leaf] * count


# data nested 1019 levels deep beside a scalar: the deepest a document parses (1024 levels in all)
DEEP = b'{"inputs": [{"name": "a", "datatype": "%s", "shape": [2], "data": [1, ' + b"[" * 1019 + b"]" * 1019 + b"]}]}"


@given(rest_bodies())
@example((DEEP % b"BYTES", b""))  # was RecursionError (a recursive walk of the data)
@example((DEEP % b"FP32", b""))  # was RecursionError, and memory quadratic in the depth
@example((b'{"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": [null]}]}', b""))  # AttributeError
@examples(200)
def test_a_rest_body_decodes_to_its_inputs_or_is_refused(shared, body):
    text, binary = body
    doc = json_codec.parse(text)
    result, peak = outcome(lambda: rest_tensors.decode_inputs(doc, memoryview(binary), shared))
    bounded_memory(peak, len(text) + len(binary))
    if not isinstance(result, dict):
        refused(result, codes=CODES)
        return
    for entry in doc["inputs"]:
        array = result[entry["name"]]
        assert array.shape == tuple(entry["shape"]) and array.dtype == v2_types.DTYPES[entry["datatype"]]
        if "data" in entry and array.dtype.kind in "fV":  # each number rounded to the datatype (BF16: 257 is 256)
            want = np.array(_leaves(entry["data"]), np.float64).astype(array.dtype)
            assert np.array_equal(array.reshape(-1), want, equal_nan=True)
        elif "data" in entry and array.dtype.kind != "O":  # integers and booleans exactly
            assert array.reshape(-1).tolist() == _leaves(entry["data"])


def _leaves(value) -> list:
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, list) else [value]
