"""TensorProto <-> NumPy, as TensorFlow Serving reads and writes them.

Decoding: ``tensor_content`` becomes an array over the message's bytes with no further copy; the typed ``*_val``
fields are read per dtype, and fewer values than the shape holds are padded with the last value, as TensorFlow's
``Tensor::FromProto`` does (so one value broadcasts). No values at all for a non-empty shape, more values than
the shape holds, or ``tensor_content`` of the wrong length are INVALID_ARGUMENT naming the tensor.

Encoding: typed ``*_val`` fields by default, which is what TensorFlow Serving answers with and what clients that
read ``float_val`` directly expect; ``tensor_content`` when asked for (smaller and faster for big outputs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import math
import os

import ml_dtypes
import numpy as np
from tensorflow.core.framework import tensor_pb2, types_pb2

from servex.loader.errors import InvalidArgument, ResourceExhausted

DT = types_pb2.DataType

# DataType -> (NumPy dtype, typed field, NumPy dtype of the field's values)
_CODECS: dict[int, tuple[np.dtype, str, np.dtype]] = {
    types_pb2.DT_FLOAT: (np.dtype(np.float32), "float_val", np.dtype(np.float32)),
    types_pb2.DT_DOUBLE: (np.dtype(np.float64), "double_val", np.dtype(np.float64)),
    types_pb2.DT_INT8: (np.dtype(np.int8), "int_val", np.dtype(np.int32)),
    types_pb2.DT_INT16: (np.dtype(np.int16), "int_val", np.dtype(np.int32)),
    types_pb2.DT_INT32: (np.dtype(np.int32), "int_val", np.dtype(np.int32)),
    types_pb2.DT_INT64: (np.dtype(np.int64), "int64_val", np.dtype(np.int64)),
    types_pb2.DT_UINT8: (np.dtype(np.uint8), "int_val", np.dtype(np.int32)),
    types_pb2.DT_UINT16: (np.dtype(np.uint16), "int_val", np.dtype(np.int32)),
    types_pb2.DT_UINT32: (np.dtype(np.uint32), "uint32_val", np.dtype(np.uint32)),
    types_pb2.DT_UINT64: (np.dtype(np.uint64), "uint64_val", np.dtype(np.uint64)),
    types_pb2.DT_BOOL: (np.dtype(np.bool_), "bool_val", np.dtype(np.bool_)),
    types_pb2.DT_HALF: (np.dtype(np.float16), "half_val", np.dtype(np.uint16)),
    types_pb2.DT_BFLOAT16: (np.dtype(ml_dtypes.bfloat16), "half_val", np.dtype(np.uint16)),
    types_pb2.DT_COMPLEX64: (np.dtype(np.complex64), "scomplex_val", np.dtype(np.float32)),
    types_pb2.DT_COMPLEX128: (np.dtype(np.complex128), "dcomplex_val", np.dtype(np.float64)),
    types_pb2.DT_STRING: (np.dtype(object), "string_val", np.dtype(object)),
}
_ENUM_OF: dict[np.dtype, int] = {codec[0]: enum for enum, codec in _CODECS.items()}
MAX_DIMS = 64  # NumPy's limit on an array's rank
_MAX_BYTES = 2**63 - 1  # NumPy indexes bytes with int64: even a zero-size shape must describe fewer
# TensorFlow keeps each element of a string tensor as a tstring (32 bytes) besides its bytes: what a string
# tensor costs once fed, counted against --max_message_bytes when a few values are broadcast over a shape.
STRING_ELEMENT_BYTES = 32
OUTPUT_CHUNK = 1 << 20  # output elements turned into Python values at a time when writing typed fields
# Typed values (not raw bytes) past this many elements in a request or an answer are decoded or encoded on a
# worker thread: ~20-50 ns each, a large one would hold the event loop, and every other caller, for seconds.
OFF_LOOP_ELEMENTS = 1 << 16


# Requests' large decodes and encodes, every protocol's: a pool of their own, one thread per CPU. At most that
# many run at once (so many large requests at once queue here rather than each holding its decoded copy in
# memory together), and they never take the default executor's threads, which model polling and config reloads
# use.
REQUEST_WORK = concurrent.futures.ThreadPoolExecutor(
    max_workers=max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2),
    thread_name_prefix="servex-request-work",
)


async def off_loop(elements: int, fn, *args, threshold: int = OFF_LOOP_ELEMENTS):
    """``fn(*args)``: inline for small work, on the ``REQUEST_WORK`` pool when ``elements`` reach ``threshold``
    (with the call's context, as ``asyncio.to_thread`` would)."""
    if elements < threshold:
        return fn(*args)
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(REQUEST_WORK, call)


async def decode_all(protos, limit: int | None = None, check=None) -> dict[str, np.ndarray]:
    """Request tensors by name (a map of TensorProtos), decoded with ``to_ndarray``; on the requests' pool when
    they take many elements to fill: many typed values, or a few broadcast over a large shape.

    ``limit`` bounds each decoded tensor, and the broadcast ones *together* (RESOURCE_EXHAUSTED beyond it): a few
    typed values broadcast over a huge shape make a small message decode large, and a request can carry many such
    inputs. ``check`` (say, resolving the model) is called before a large decode, so that a request for a model
    that is not served is answered before anything is copied.
    """
    typed = sum(typed_elements(proto) for proto in protos.values())
    if typed < OFF_LOOP_ELEMENTS:  # the hot path: tensor_content, or a few typed values
        try:
            return _decode_all(protos, limit, inline=True)
        except _LargeBroadcast:  # found while decoding: nothing large was made yet
            pass
    if check is not None:
        check()
    return await off_loop(OFF_LOOP_ELEMENTS, _decode_all, protos, limit)


class _LargeBroadcast(Exception):
    """A tensor decoded on the event loop would fill ``OFF_LOOP_ELEMENTS`` or more elements from a few values."""


def _decode_all(protos, limit: int | None, inline: bool = False) -> dict[str, np.ndarray]:
    arrays = {}
    broadcast = 0  # bytes the request's broadcast tensors decoded so far take
    # Inline (on the event loop): elements the request's broadcasts may still fill before the decode moves off it,
    # counted over all its tensors (many small broadcasts add up).
    left = OFF_LOOP_ELEMENTS if inline else None
    for name, proto in protos.items():
        arrays[name], grown, filled = _to_ndarray(proto, name, limit, broadcast, left)
        broadcast += grown
        if left is not None:
            left -= filled
    return arrays


async def fill_all(pairs: list[tuple[tensor_pb2.TensorProto, np.ndarray]], tensor_content: bool = False) -> None:
    """``fill_proto`` each (fresh TensorProto, array) pair; on the requests' pool when that turns many values into
    Python ones."""
    elements = output_elements([array for _, array in pairs], tensor_content)
    await off_loop(elements, _fill_all, pairs, tensor_content)


def _fill_all(pairs, tensor_content: bool) -> None:
    for proto, array in pairs:
        fill_proto(proto, array, tensor_content)


def typed_elements(proto: tensor_pb2.TensorProto) -> int:
    """How many values a request tensor carries in its typed field: what decoding walks one by one (0 for
    ``tensor_content``, read in place). Counted, not multiplied out of the shape: the shape is not checked yet,
    and a message can hold tens of thousands of huge dimensions; nor is ``tensor_content`` touched, which would
    copy it. (A few values broadcast over a large shape are found while decoding: see ``decode_all``.)"""
    codec = _CODECS.get(proto.dtype)
    return len(getattr(proto, codec[1])) if codec is not None else 0


TYPED_BYTES_PER_ELEMENT = 10  # the most a typed value takes in a message (a varint; a float takes 4)
STRING_SAMPLE = 1024  # string elements whose lengths are summed exactly; beyond, the answer's size is unknown


def answer_bound(arrays) -> int | None:
    """An upper bound on the bytes ``arrays`` take in an answer, typed or raw, from their sizes alone; None
    when it cannot be had cheaply (many strings). Lets the adapters skip serializing an answer a second time
    just to learn that it is under --max_message_bytes."""
    total = 0
    for array in arrays:
        if array.dtype.kind in "OSU":
            if array.size > STRING_SAMPLE:
                return None
            total += sum(len(v) + 16 for v in array.ravel().tolist())
        else:
            total += array.size * max(TYPED_BYTES_PER_ELEMENT, array.dtype.itemsize) + 16 * array.ndim
        total += 64  # the tensor's name, dtype and shape fields
    return total


def output_elements(arrays, tensor_content: bool = False) -> int:
    """How many elements encoding ``arrays`` turns into Python values (strings always; numbers unless written
    as ``tensor_content``)."""
    return sum(a.size for a in arrays if not tensor_content or a.dtype.kind in "OSU")


def dtype_enum(dtype: np.dtype) -> int:
    """TensorFlow's DataType for a NumPy dtype (DT_STRING for object, bytes and str arrays)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "SU":
        return types_pb2.DT_STRING
    enum = _ENUM_OF.get(dtype)
    if enum is None:
        raise InvalidArgument(f"dtype {dtype.name} has no TensorFlow equivalent")
    return enum


def _shape(proto: tensor_pb2.TensorProto, name: str) -> tuple[int, ...]:
    if proto.tensor_shape.unknown_rank:
        raise InvalidArgument(f"input {name!r}: tensor_shape has unknown_rank set; a request tensor needs its shape")
    shape = tuple([d.size for d in proto.tensor_shape.dim])
    check_shape(shape, name)
    return shape


def check_shape(shape, name: str, itemsize: int = 16) -> None:
    """INVALID_ARGUMENT naming input ``name`` for a shape no array can have: a negative dimension, more than 64
    dimensions (NumPy's limit), or dimensions whose product (the zero ones taken as 1: what NumPy must index,
    even for an empty tensor) times ``itemsize`` is past 2^63 bytes."""
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"input {name!r}: shape has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    described = itemsize
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"input {name!r}: shape {list(shape)} has a negative dimension")
        described *= max(dim, 1)
    if described > _MAX_BYTES:
        raise InvalidArgument(f"input {name!r}: shape {list(shape)} is too large to describe (past 2^63 bytes)")


def to_ndarray(proto: tensor_pb2.TensorProto, name: str, max_bytes: int | None = None) -> np.ndarray:
    """Decode a request TensorProto; ``name`` (the input alias) is used in error messages.

    ``max_bytes`` bounds the decoded tensor, so that a few typed values broadcast over a huge shape cannot make
    a small message allocate without limit (RESOURCE_EXHAUSTED beyond it).
    """
    return _to_ndarray(proto, name, max_bytes)[0]


def _check_bools(name: str, content: bytes) -> None:
    """A DT_BOOL tensor_content holds one byte per element, 0 or 1 (TensorFlow's Tensor::FromProto refuses others)."""
    octets = np.frombuffer(content, np.uint8)
    if octets.max() > 1:
        bad = int(np.flatnonzero(octets > 1)[0])
        raise InvalidArgument(
            f"input {name!r}: DT_BOOL tensor_content holds byte {octets[bad]} at element {bad}; each element is one "
            f"byte, 0 or 1"
        )


def _to_ndarray(
    proto: tensor_pb2.TensorProto, name: str, max_bytes: int | None, broadcast: int = 0, left: int | None = None
) -> tuple[np.ndarray, int, int]:
    """``to_ndarray``, the bytes the tensor takes once decoded when it is broadcast (fewer typed values than
    elements; else 0: the message bounds what was sent), and the elements its broadcast fills. ``broadcast``:
    what the request's other broadcast tensors decoded so far take of ``max_bytes``. ``left`` (on the event loop):
    _LargeBroadcast instead of filling that many elements or more from a few values."""
    codec = _CODECS.get(proto.dtype)
    if codec is None:
        known = ", ".join(DT.Name(e) for e in _CODECS)
        raise InvalidArgument(
            f"input {name!r}: dtype {DT.Name(proto.dtype) if proto.dtype in DT.values() else proto.dtype} "
            f"is not supported; supported dtypes: {known}"
        )
    dtype, field, field_dtype = codec
    shape = _shape(proto, name)
    count = math.prod(shape)  # Python ints: no silent int64 wrap-around
    content = proto.tensor_content
    if content:
        if proto.dtype == types_pb2.DT_STRING:
            raise InvalidArgument(
                f"input {name!r}: DT_STRING tensors carry their values in string_val, not tensor_content"
            )
        if len(content) != count * dtype.itemsize:
            raise InvalidArgument(
                f"input {name!r}: tensor_content holds {len(content)} bytes, but {DT.Name(proto.dtype)} of shape "
                f"{list(shape)} needs {count * dtype.itemsize} ({count} x {dtype.itemsize} bytes)"
            )
        if proto.dtype == types_pb2.DT_BOOL and count:
            _check_bools(name, content)
        return np.frombuffer(content, dtype=dtype).reshape(shape), 0, 0
    values = getattr(proto, field)
    per_element = 2 if field in ("scomplex_val", "dcomplex_val") else 1
    have = len(values) // per_element
    if count == 0:
        if have:
            raise InvalidArgument(f"input {name!r}: shape {list(shape)} holds no element but {have} values were sent")
        return np.empty(shape, dtype=dtype), 0, 0
    if have == 0:
        raise InvalidArgument(
            f"input {name!r}: no values: shape {list(shape)} needs {count} values in {field} or in tensor_content"
        )
    if len(values) % per_element:
        raise InvalidArgument(
            f"input {name!r}: {field} holds {len(values)} numbers, not a whole number of (real, imaginary) pairs"
        )
    if have > count:
        raise InvalidArgument(
            f"input {name!r}: {field} holds {have} values, more than the {count} of shape {list(shape)}"
        )
    if left is not None and count - have >= left:  # a large broadcast: not on the event loop
        raise _LargeBroadcast
    grown = 0
    if max_bytes is not None:
        decoded = _decoded_bytes(proto, count, dtype)
        if decoded > max_bytes:
            raise ResourceExhausted(
                f"input {name!r}: shape {list(shape)} of {DT.Name(proto.dtype)} decodes to {decoded} bytes, more "
                f"than the limit of {max_bytes} (--max_message_bytes)"
            )
        if have < count:  # broadcast: bounded with the request's other broadcast tensors
            grown = decoded
            if broadcast + grown > max_bytes:
                raise ResourceExhausted(
                    f"input {name!r}: shape {list(shape)} of {DT.Name(proto.dtype)} decodes to {grown} bytes from "
                    f"{have} value(s); with the request's other broadcast inputs ({broadcast} bytes) that is more "
                    f"than the limit of {max_bytes} (--max_message_bytes)"
                )
    if field_dtype.kind == "O":
        flat = np.empty(have, dtype=object)
        flat[:] = list(values)
    elif field == "half_val":  # 16-bit patterns carried in int32s
        flat = np.array(values, dtype=np.int32).astype(np.uint16).view(dtype)
    else:
        flat = np.array(values, dtype=field_dtype)
        if field_dtype != dtype:
            flat = flat.view(dtype) if per_element == 2 else flat.astype(dtype)
    if have < count:  # TensorFlow pads with the last value: a single value broadcasts
        flat = np.concatenate([flat, np.full(count - have, flat[-1], dtype=dtype)])
    return flat.reshape(shape), grown, count - have


def _decoded_bytes(proto: tensor_pb2.TensorProto, count: int, dtype: np.dtype) -> int:
    """What the tensor costs once decoded and fed: its elements' bytes; for strings, each element's own bytes
    plus TensorFlow's per-element overhead (a broadcast string is copied into every element)."""
    if proto.dtype != types_pb2.DT_STRING:
        return count * dtype.itemsize
    values = proto.string_val
    if not values or count <= len(values):  # every element sent: the message itself bounds them
        return count * dtype.itemsize
    sent = sum(map(len, values))
    return sent + len(values) * STRING_ELEMENT_BYTES + (count - len(values)) * (len(values[-1]) + STRING_ELEMENT_BYTES)


def fill_proto(proto: tensor_pb2.TensorProto, array: np.ndarray, tensor_content: bool = False) -> None:
    """Write ``array`` into ``proto`` (a fresh TensorProto, e.g. a response map entry)."""
    dtype = array.dtype
    enum = _ENUM_OF.get(dtype)
    if enum is None:
        if dtype.kind not in "SU":
            raise InvalidArgument(f"output dtype {dtype.name} has no TensorFlow equivalent")
        enum = types_pb2.DT_STRING
    proto.dtype = enum
    add_dim = proto.tensor_shape.dim.add
    for size in array.shape:
        add_dim(size=size)
    if enum == types_pb2.DT_STRING:
        proto.string_val.extend(v.encode() if isinstance(v, str) else v for v in array.ravel())
        return
    if tensor_content:
        proto.tensor_content = np.ascontiguousarray(array).tobytes()
        return
    _, field, field_dtype = _CODECS[enum]
    if field == "half_val" or field in ("scomplex_val", "dcomplex_val"):
        array = np.ascontiguousarray(array).view(field_dtype)
    extend_in_chunks(getattr(proto, field), array.ravel())


def extend_in_chunks(field, flat: np.ndarray) -> None:
    """``field.extend(flat.tolist())``, a million elements at a time: a large output never exists as one list
    of Python numbers (32 bytes each) besides the array and the message."""
    if flat.size <= OUTPUT_CHUNK:
        field.extend(flat.tolist())
        return
    for start in range(0, flat.size, OUTPUT_CHUNK):
        field.extend(flat[start : start + OUTPUT_CHUNK].tolist())


def from_ndarray(array: np.ndarray, tensor_content: bool = False) -> tensor_pb2.TensorProto:
    proto = tensor_pb2.TensorProto()
    fill_proto(proto, np.asarray(array), tensor_content)
    return proto
