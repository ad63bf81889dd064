"""KServe v2 REST's tensors (server/protocols/kserve/rest_api.py): a request's JSON inputs (``data`` flat or nested),
binary inputs (the binary tensor extension: ``parameters.binary_data_size`` bytes each after the JSON, as arrays
over the body, no copy) and inputs in shared memory into arrays; an answer's outputs into JSON entries, raw chunks
after the JSON, or shared memory writes."""

from __future__ import annotations

from typing import Any

import numpy as np

from servex.loader.errors import InvalidArgument
from servex.server.protocols.kserve import v2_types
from servex.server.protocols.kserve.dataplane_rules import SHARED_MEMORY_BYTE_SIZE, SHARED_MEMORY_REGION, place
from servex.server.transport import json_codec as codec


def shared_bytes(doc) -> int:
    """The bytes a request's inputs read from shared memory (each a copy): with the body's, what decides whether
    they decode on a worker thread. A few hundred bytes of JSON may name a region of hundreds of MiB."""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    total = 0
    for tensor in inputs if isinstance(inputs, list) else ():
        params = tensor.get("parameters") if isinstance(tensor, dict) else None
        if isinstance(params, dict) and SHARED_MEMORY_REGION in params:
            size = params.get(SHARED_MEMORY_BYTE_SIZE)
            total += size if isinstance(size, int) and size > 0 else 0
    return total


def given(doc: dict, key: str, default: Any) -> Any:
    """``doc[key]``, ``default`` when it is absent or null: KServe's own JSON (its pydantic models, answers passed
    on as requests) writes ``"parameters": null`` for no parameters."""
    value = doc.get(key)
    return default if value is None else value


def as_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"'{where}' must be a JSON object, got {codec.type_name(value)}")
    return value


def decode_inputs(doc: dict, binary: memoryview, shared) -> dict[str, np.ndarray]:
    """The request's inputs by name: JSON ``data``, ``binary_data_size`` bytes of ``binary`` each, in order, or
    bytes of a shared memory region (``shared``, a SharedMemoryRegistry) read without a copy."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument(
            'the request has no \'inputs\': send a list of {"name", "shape", "datatype", "data"} objects'
        )
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        tensor = as_dict(tensor, f"inputs[{i}]")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{i}] has no 'name' (a string naming the input)")
        if name in arrays:
            raise InvalidArgument(f"input {name!r} is sent twice")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str):
            raise InvalidArgument(f"input {name!r} has no 'datatype'; expected one of {', '.join(v2_types.DTYPES)}")
        dtype = v2_types.numpy_dtype(datatype, name)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"input {name!r}: 'shape' must be a list of integers, got {codec.show(shape)}")
        count = v2_types.element_count(shape, name)
        params = as_dict(given(tensor, "parameters", {}), f"inputs[{i}].parameters")
        if SHARED_MEMORY_REGION in params:
            if "data" in tensor or "binary_data_size" in params:
                raise InvalidArgument(f"input {name!r} has data and a shared memory region: send one of them")
            region, start, size = place(params, f"input {name!r}")
            raw = shared.read(region, start, size, name)
        elif "binary_data_size" in params:
            size = params["binary_data_size"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input {name!r}: binary_data_size must be a byte count, got {codec.show(size)}")
            if "data" in tensor:
                raise InvalidArgument(f"input {name!r} has both 'data' and binary_data_size: send one of them")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"input {name!r}: binary_data_size {size} runs past the binary data: {len(binary) - offset} "
                    f"bytes are left after the earlier inputs ({len(binary)} after the JSON in all)"
                )
            raw = binary[offset : offset + size]
            offset += size
        elif "data" in tensor:
            arrays[name] = _from_data(tensor["data"], datatype, dtype, shape, count, name, i)
            continue
        else:
            raise InvalidArgument(f"input {name!r} has no 'data' and no parameters.binary_data_size")
        arrays[name] = v2_types.from_raw(raw, datatype, shape, name)
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data are left after the inputs' binary_data_size "
            f"({offset} bytes in all): every byte after the JSON must belong to an input"
        )
    return arrays


def _from_data(data: Any, datatype: str, dtype: np.dtype, shape: list, count: int, name: str, i: int) -> np.ndarray:
    expects = f"input {name!r} ({datatype} {shape})"
    where = f"inputs[{i}].data"
    if dtype.kind == "O":
        leaves: list = []
        _leaves(data, leaves)
        bad = next((i for i, v in enumerate(leaves) if not isinstance(v, str)), None)  # null is no string either
        if bad is not None:
            raise InvalidArgument(f"{expects}: {where} holds {codec.show(leaves[bad])}, expected strings for BYTES")
        array = np.empty(len(leaves), dtype=object)
        array[:] = [v.encode() for v in leaves]
    else:
        array = codec.to_array(data, dtype, where, expects)
    if array.size != count:
        raise InvalidArgument(f"{expects}: {where} holds {array.size} values, but shape {shape} takes {count}")
    return array.reshape(shape)


def _leaves(value: Any, out: list) -> None:
    """The leaves of nested lists, in order, into ``out``; with a stack of its own, so that lists nested as deep
    as a document may hold them (1023 levels) take no Python stack."""
    stack = [iter([value])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()


def encode_outputs(
    outputs: dict[str, np.ndarray],
    filters: dict[str, bool],
    binary_output: bool,
    chunks: list,
    shared=None,
    places: dict | None = None,
) -> tuple[list[dict], bool]:
    """The answer's ``outputs`` entries; raw data of binary outputs is appended to ``chunks`` in order, that of
    outputs with a place in shared memory (``places``) written there (``shared``) and left out of the answer."""
    entries = []
    all_finite = True
    for name, array in outputs.items():
        datatype = v2_types.carried_datatype(name, array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if places and name in places:
            region, offset, size = places[name]
            data = v2_types.to_raw(array)
            shared.write(region, offset, data, size, name)
            entry["parameters"] = {SHARED_MEMORY_REGION: region, "shared_memory_byte_size": len(data)}
        elif filters.get(name, binary_output):
            raw = raw_view(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif datatype == v2_types.BYTES:
            entry["data"] = [_text(v, name) for v in array.reshape(-1).tolist()]
        else:
            all_finite = all_finite and codec.finite(array)
            entry["data"] = codec.jsonable(array.reshape(-1))
        entries.append(entry)
    return entries, all_finite


def _text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(
            f"output {name!r} holds bytes that are not UTF-8 text, which JSON cannot carry: ask for it with "
            f'"parameters": {{"binary_data": true}}'
        ) from None


def raw_view(array: np.ndarray) -> bytes | memoryview:
    """An output's raw v2 bytes: a view over the array when it is little-endian and contiguous already."""
    if array.dtype.kind in "OSU":
        return v2_types.encode_bytes(array)
    flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1)
    return memoryview(flat.view(np.uint8))
