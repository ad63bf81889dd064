"""KServe v2 / Open Inference Protocol datatypes <-> NumPy, shared by the v2 gRPC and REST adapters.

A v2 tensor's ``datatype`` is a string (``FP32``, ``BYTES``, ...). Fixed-size types travel as little-endian bytes
(``raw_input_contents``, the binary tensor extension) or typed values; BYTES elements travel raw as a 4-byte
little-endian length then the bytes, one after another, and become NumPy object arrays of ``bytes`` (what
TensorFlow string tensors take).
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np

from loader.errors import InvalidArgument

BYTES = "BYTES"

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


def element_count(shape, tensor: str) -> int:
    count = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"input {tensor!r}: shape {list(shape)} has a negative dimension")
        count *= dim
    return count


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
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)


def decode_bytes(raw: bytes | memoryview, count: int, tensor: str) -> np.ndarray:
    """``count`` length-prefixed BYTES elements from ``raw`` as an object array of bytes."""
    view = memoryview(raw)
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
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
