"""KServe v2 / Open Inference Protocol datatypes <-> NumPy, shared by the v2 gRPC and REST adapters.

A v2 tensor's ``datatype`` is a string (``FP32``, ``BYTES``, ...). Fixed-size types travel as little-endian bytes
(``raw_input_contents``, the binary tensor extension) or typed values; BYTES elements travel raw as a 4-byte
little-endian length then the bytes, one after another, and become NumPy object arrays of ``bytes`` (what
TensorFlow string tensors take).
"""

from __future__ import annotations

import math
import struct
import sys

import ml_dtypes
import numpy as np

from servex.loader.errors import FailedPrecondition, InvalidArgument
from servex.server.protocols.kserve.dataplane_rules import SHARED_MEMORY_REGION, place
from servex.server.transport.tensors import MAX_DIMS, check_shape, extend_in_chunks

BYTES = "BYTES"
# What ServerMetadata lists (gRPC and REST alike, as Triton lists one set for both): the extensions the main port
# serves. The model repository extension is on the admin port, which lists it alone (and on the main port too, added
# to these, in explicit model control of a Triton model repository).
EXTENSIONS = (
    "classification",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "logging",
)

# v2 datatype -> NumPy dtype (BYTES -> object)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    BYTES: np.dtype(object),
}
_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_BIG_ENDIAN_HOST = sys.byteorder == "big"
# v2 datatype -> the little-endian NumPy dtype its raw bytes are read as (fixed-size types)
_WIRE_DTYPES: dict[str, np.dtype] = {name: d.newbyteorder("<") for name, d in DTYPES.items() if d.kind != "O"}


def numpy_dtype(datatype: str, tensor: str) -> np.dtype:
    """The NumPy dtype of a v2 datatype; INVALID_ARGUMENT names the tensor and the known datatypes."""
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise InvalidArgument(f"input {tensor!r}: unknown datatype {datatype!r}; expected one of {', '.join(DTYPES)}")
    return dtype


def datatype(dtype: np.dtype) -> str:
    """The v2 datatype of a NumPy dtype (BYTES for object, bytes and str arrays); ValueError when none fits."""
    dtype = np.dtype(dtype)
    if dtype.kind in "SUO":
        return BYTES
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"NumPy dtype {dtype.name} has no KServe v2 datatype")
    return name


def carried_datatype(output: str, dtype: np.dtype) -> str:
    """An output's v2 datatype; FAILED_PRECONDITION for a dtype v2 cannot carry (complex, ...)."""
    try:
        return datatype(dtype)
    except ValueError:
        raise FailedPrecondition(
            f"output {output!r} has dtype {np.dtype(dtype).name}, which the KServe v2 protocol cannot carry "
            f"(use TensorFlow Serving's REST or gRPC Predict for it)"
        ) from None


def element_count(shape, tensor: str) -> int:
    """The element count of a v2 shape; INVALID_ARGUMENT for a negative dimension, more than 64 dimensions or a
    shape too large for any array to describe (zero-size or not; see ``tensors.check_shape``)."""
    check_shape(shape, tensor)
    return math.prod(shape)


def from_raw(raw: bytes | memoryview, datatype_: str, shape, tensor: str) -> np.ndarray:
    """An array over ``raw`` (no copy for fixed-size types); INVALID_ARGUMENT when the size does not fit."""
    dtype = numpy_dtype(datatype_, tensor)
    count = element_count(shape, tensor)
    if dtype.kind == "O":
        return decode_bytes(raw, count, tensor).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"input {tensor!r}: {len(raw)} raw bytes do not fit datatype {datatype_} shape {list(shape)}, "
            f"which takes {expected} bytes"
        )
    array = np.frombuffer(raw, dtype=_WIRE_DTYPES[datatype_]).reshape(shape)
    if dtype.kind == "b" and count and np.frombuffer(raw, np.uint8).max() > 1:
        bad = int(np.flatnonzero(np.frombuffer(raw, np.uint8) > 1)[0])
        raise InvalidArgument(
            f"input {tensor!r}: BOOL byte {raw[bad]} at element {bad}; each element is one byte, 0 or 1"
        )
    return array


def decode_bytes(raw: bytes | memoryview, count: int, tensor: str) -> np.ndarray:
    """``count`` length-prefixed BYTES elements from ``raw`` as an object array of bytes."""
    view = memoryview(raw)
    if count > len(view) // 4:  # every element takes at least its 4-byte length: refuse before allocating
        raise InvalidArgument(
            f"input {tensor!r}: {len(view)} bytes cannot hold the {count} BYTES elements (each takes at least its "
            f"4-byte length)"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidArgument(f"input {tensor!r}: BYTES data ends after {i} of {count} elements")
        (size,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + size > len(view):
            raise InvalidArgument(f"input {tensor!r}: BYTES element {i} claims {size} bytes past the data's end")
        out[i] = bytes(view[offset : offset + size])
        offset += size
    if offset != len(view):
        raise InvalidArgument(f"input {tensor!r}: {len(view) - offset} bytes left after {count} BYTES elements")
    return out


def encode_bytes(array: np.ndarray) -> bytes:
    """An array of bytes/str elements as length-prefixed BYTES data (row-major order)."""
    parts = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def to_raw(array: np.ndarray) -> bytes:
    """An output array as raw v2 bytes (little-endian, row-major; BYTES length-prefixed)."""
    if array.dtype.kind in "SUO":
        return encode_bytes(array)
    if array.dtype.byteorder == ">" or (_BIG_ENDIAN_HOST and array.dtype.byteorder == "="):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()  # row-major, whatever the array's strides


# -- the gRPC messages' tensors (ModelInferRequest / ModelInferResponse, any class with Triton's field names) ----

# v2 datatype -> the InferTensorContents field that carries it typed; FP16 and BF16 have none (raw only).
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    BYTES: "bytes_contents",
}
# the NumPy dtype of each typed field's values
_FIELD_DTYPES: dict[str, np.dtype] = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}


def parameter_value(param):
    """An InferParameter's value as a plain Python value (what REST's JSON gives): bool, int, float or str; None
    when it holds none. The data plane checks it (server/protocols/kserve/dataplane_rules.py)."""
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def parameter_values(parameters) -> dict:
    """A message's ``parameters`` map (name -> InferParameter) as plain Python values."""
    return {key: parameter_value(param) for key, param in parameters.items()}


def infer_fields(request) -> tuple[dict, list[tuple[str, dict]]]:
    """A ModelInferRequest's parameters and requested outputs (name, parameters) as plain Python values: what the
    data plane's ``infer_request`` takes, as REST's JSON gives them."""
    parameters = parameter_values(request.parameters) if request.parameters else {}
    return parameters, [(out.name, parameter_values(out.parameters)) for out in request.outputs]


def classified(outputs: dict[str, np.ndarray], counts: dict[str, int]) -> dict[str, np.ndarray]:
    """Triton's classification extension: each output named in ``counts`` replaced by its top N classes, a BYTES
    tensor of ``"value:index"`` strings, largest value first (N at most the number of classes). Shape [classes]
    gives [N]; [batch, classes] gives [batch, N]."""
    if not counts:
        return outputs
    answer = dict(outputs)
    for name, count in counts.items():
        array = outputs[name]
        if array.ndim not in (1, 2) or array.dtype.kind not in "iuf":
            raise InvalidArgument(
                f"output {name!r} cannot be classified: it is {array.dtype.name} of shape {list(array.shape)}; "
                f"classification takes numbers of shape [classes] or [batch, classes]"
            )
        rows = array.reshape(1, -1) if array.ndim == 1 else array
        top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, : min(count, rows.shape[1])]
        values = np.take_along_axis(rows, top, axis=1)
        text = "{:f}:{}" if array.dtype.kind == "f" else "{}:{}"
        strings = np.array(
            [[text.format(v, i).encode() for v, i in zip(vs.tolist(), ix.tolist(), strict=True)]
             for vs, ix in zip(values, top, strict=True)],
            dtype=object,
        ).reshape(top.shape)  # fmt: skip
        answer[name] = strings[0] if array.ndim == 1 else strings
    return answer


def from_contents(contents, datatype_: str, shape, tensor: str) -> np.ndarray:
    """An array from typed InferTensorContents; INVALID_ARGUMENT names the tensor when the field, the value count
    or a value's range does not fit the datatype and shape (v2 sends every element: nothing is broadcast)."""
    dtype = numpy_dtype(datatype_, tensor)
    count = element_count(shape, tensor)
    field = CONTENTS_FIELDS.get(datatype_)
    if field is None:
        raise InvalidArgument(
            f"input {tensor!r}: datatype {datatype_} has no typed contents field; send it in raw_input_contents"
        )
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise InvalidArgument(f"input {tensor!r}: datatype {datatype_} takes its values in {field}, got {others}")
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input {tensor!r}: {field} holds {len(values)} values, but datatype {datatype_} shape {list(shape)} "
            f"takes {count}"
        )
    if dtype.kind == "O":
        flat = np.empty(count, dtype=object)
        flat[:] = list(values)
        return flat.reshape(shape)
    flat = np.array(values, dtype=_FIELD_DTYPES[field])
    if flat.dtype != dtype:  # INT8/16, UINT8/16 travel in 32-bit fields: they must fit
        info = np.iinfo(dtype)
        if count and (flat.min() < info.min or flat.max() > info.max):
            bad = flat[(flat < info.min) | (flat > info.max)][0]
            raise InvalidArgument(
                f"input {tensor!r}: value {bad} in {field} is out of range for {datatype_} ({info.min}..{info.max})"
            )
        flat = flat.astype(dtype)
    return flat.reshape(shape)


def shared_memory_place(parameters, tensor: str):
    """An input's or output's place in shared memory from its InferParameters (the data plane's rule)."""
    return place(parameter_values(parameters), tensor)


def _typed_count(tensor) -> int:
    """How many typed values an input carries in ``contents`` (0 when it has none: raw, the usual case)."""
    if not tensor.HasField("contents"):
        return 0
    return sum(len(values) for _, values in tensor.contents.ListFields())


def decode_cost(inputs, raw_count: int = 0) -> int:
    """What decoding a ModelInferRequest's ``inputs`` walks one element at a time, in elements: typed contents
    (the values sent) and BYTES (the elements of the shape); shared memory counts as large (a copy of the
    region). Raw fixed-size inputs cost nothing: they become arrays over the request's bytes. ``raw_count``: the
    request's ``raw_input_contents`` entries; when there is one per input, nothing typed or in shared memory is
    read (decoding refuses such a request first). Never multiplies out a shape of more than 64 dimensions (not
    checked yet: that product alone could take seconds)."""
    all_raw = raw_count == len(inputs)
    cost = 0
    for tensor in inputs:
        typed = 0 if all_raw else _typed_count(tensor)
        if typed:
            cost += typed
        elif not all_raw and SHARED_MEMORY_REGION in tensor.parameters:
            cost += 1 << 62
        elif tensor.datatype == BYTES:  # raw: length-prefixed elements, read one by one
            cost += math.prod(tensor.shape) if len(tensor.shape) <= MAX_DIMS else 0
    return cost


def _all_raw(inputs, raw_input_contents) -> dict[str, np.ndarray] | None:
    """The usual request decoded in one pass: every input in ``raw_input_contents``, in order, none typed or in
    shared memory. None when the request is not that (or repeats a name): the general path then decodes it or
    says what is wrong."""
    arrays: dict[str, np.ndarray] = {}
    for tensor, data in zip(inputs, raw_input_contents, strict=True):
        name = tensor.name
        if not name or name in arrays or tensor.HasField("contents") or SHARED_MEMORY_REGION in tensor.parameters:
            return None
        arrays[name] = from_raw(data, tensor.datatype, tensor.shape[:], name)
    return arrays


def decode_infer_inputs(inputs, raw_input_contents, shared, model: str = "") -> tuple[dict[str, np.ndarray], bool]:
    """A ModelInferRequest's inputs by name, and whether they came raw (or from shared memory, read from
    ``shared``, a SharedMemoryRegistry). Raw fixed-size inputs are arrays over the request's bytes or the shared
    memory (no copy). INVALID_ARGUMENT names the input (and ``model``, the request's) and what was expected."""
    if raw_input_contents and len(raw_input_contents) == len(inputs):
        arrays = _all_raw(inputs, raw_input_contents)
        if arrays is not None:
            return arrays, True
    if raw_input_contents:  # checked first, in Triton's words, which Triton's own client examples look for
        for tensor in inputs:
            if _typed_count(tensor):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for {tensor.name!r} for "
                    f"model {model!r}: input {tensor.name!r} has typed contents and the request has "
                    f"raw_input_contents; send its data in one of them"
                )
    in_memory = sum(SHARED_MEMORY_REGION in t.parameters for t in inputs)
    raw = len(raw_input_contents) > 0 or in_memory > 0
    if raw_input_contents and len(raw_input_contents) != len(inputs) - in_memory:
        raise InvalidArgument(
            f"raw_input_contents holds {len(raw_input_contents)} entries but the request has "
            f"{len(inputs) - in_memory} input(s) not in shared memory: send one per input, in the order of "
            f"inputs, or none"
        )
    arrays: dict[str, np.ndarray] = {}
    sent = 0  # raw_input_contents entries taken: one per input not in shared memory
    copied = 0  # bytes read from shared memory so far
    for i, tensor in enumerate(inputs):
        name = tensor.name
        if not name:
            raise InvalidArgument(f"input {i} has no name")
        if name in arrays:
            raise InvalidArgument(f"input {name!r} is sent twice")
        shape = tuple(tensor.shape)
        if SHARED_MEMORY_REGION in tensor.parameters:
            if _typed_count(tensor):
                raise InvalidArgument(f"input {name!r} has typed contents and a shared memory region: send one")
            region, offset, size = shared_memory_place(tensor.parameters, f"input {name!r}")
            data = shared.read(region, offset, size, name, copied)
            copied += size
        elif not raw_input_contents:
            arrays[name] = from_contents(tensor.contents, tensor.datatype, shape, name)
            continue
        else:  # typed contents beside raw_input_contents were refused above
            data = raw_input_contents[sent]
            sent += 1
        arrays[name] = from_raw(data, tensor.datatype, shape, name)
    return arrays, raw


def fill_contents(contents, array: np.ndarray) -> None:
    """Write ``array`` into typed InferTensorContents; ValueError when its datatype has no typed field."""
    field = CONTENTS_FIELDS.get(datatype(array.dtype))
    if field is None:
        raise ValueError(f"datatype {datatype(array.dtype)} has no typed contents field")
    flat = array.reshape(-1)
    if field == "bytes_contents":
        getattr(contents, field).extend(v.encode() if isinstance(v, str) else bytes(v) for v in flat)
    else:
        extend_in_chunks(getattr(contents, field), flat)


def fill_infer_outputs(response, outputs: dict[str, np.ndarray], raw: bool, shared=None, places=None) -> None:
    """Add ``outputs`` to a ModelInferResponse: in ``raw_output_contents`` when ``raw`` or when an output has no
    typed field (FP16, BF16), else in typed contents; those with a place in shared memory (``places``: name ->
    region, offset, byte size) are written there (``shared``, a SharedMemoryRegistry) and answered without data.
    FAILED_PRECONDITION for an output v2 cannot carry."""
    places = places or {}
    datatypes = {name: carried_datatype(name, array.dtype) for name, array in outputs.items()}
    raw = raw or any(d not in CONTENTS_FIELDS for d in datatypes.values())
    for name, array in outputs.items():
        out = response.outputs.add()
        out.name = name
        out.datatype = datatypes[name]
        out.shape.extend(array.shape)
        if name in places:
            region, offset, size = places[name]
            data = to_raw(array)
            shared.write(region, offset, data, size, name)
            out.parameters[SHARED_MEMORY_REGION].string_param = region
            out.parameters["shared_memory_byte_size"].int64_param = len(data)
            if raw:
                response.raw_output_contents.append(b"")  # clients find outputs' raw data by position
        elif raw:
            response.raw_output_contents.append(to_raw(array))
        else:
            fill_contents(out.contents, array)
