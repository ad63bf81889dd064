"""JSON <-> NumPy for the REST adapters (TensorFlow Serving's REST API and KServe v2 REST), through orjson.

Parsing: orjson, with a fallback to the standard library only when orjson refuses the document, so that the
``NaN``, ``Infinity`` and ``-Infinity`` literals TensorFlow Serving reads and writes are accepted too, and the
other spellings its rapidjson reads (``Inf``, ``-Inf``, ``-NaN``). What orjson
refuses for good reasons stays refused on that path: numbers beyond a double's range (``1e400``, which the
standard library would read as infinity; integers too) and strings holding a lone surrogate (``"\\ud800"``, not
Unicode text). Integers beyond 64 bits are doubles on both paths, as rapidjson reads them.

Values to arrays: a JSON list (nested to any depth) becomes an array of the dtype the signature or the v2
datatype asks for, in one vectorized ``np.asarray``. The checks are TensorFlow Serving's: numbers for float
tensors (integers too, when the float holds them exactly), integers for integer tensors (in range), booleans for
bool tensors; ragged lists and lists nested deeper than NumPy's 64 dimensions are refused. Every float dtype
(float16 and bfloat16 too) refuses integers beyond its mantissa (float16: 2047, bfloat16: 255, float32: 2^24 - 1,
TensorFlow Serving's rule for float) and finite values beyond its range. The slow walk that finds *which* value
or list is wrong runs only when a check fails, so that the message can name its position (``instances[1][0]``).

Arrays to JSON: orjson serializes NumPy arrays itself (``OPT_SERIALIZE_NUMPY``: float32 is written with the
shortest decimal that reads back as the same float32). TensorFlow Serving's REST API writes other decimals for
float32 (six significant digits where they read back as the same float32, else nine): ``tf_serving_floats`` gives
the float64 values of those decimals, so that a client's JSON parser reads the same numbers from servex as from
TensorFlow Serving. Outputs holding NaN or infinities go through the standard library, which writes
``NaN``/``Infinity`` like TensorFlow Serving.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import struct
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from servex.loader.errors import InvalidArgument
from servex.server.transport.tensors import MAX_DIMS

OPTIONS = orjson.OPT_SERIALIZE_NUMPY
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# A JSON escape of a UTF-16 surrogate (U+D800..U+DFFF): a lone one is no Unicode text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


# A JSON string (left as it is), or a non-finite number as rapidjson's kParseNanAndInfFlag reads them (NaN, Inf,
# Infinity, each with a minus too) and TensorFlow Serving with it; the standard library reads NaN, Infinity and
# -Infinity only.
_NON_FINITE = re.compile(rb'"(?:[^"\\]|\\.)*"|-?NaN|-?Infinity|-?Inf')
_UNPARSED = object()


def _standard_spelling(match: re.Match) -> bytes:
    token = match.group(0)
    if token.startswith(b'"'):
        return token
    if token.endswith(b"NaN"):
        return b"NaN"
    return b"-Infinity" if token.startswith(b"-") else b"Infinity"


def parse(data: bytes | memoryview, what: str = "request body") -> Any:
    """The JSON document in ``data``; INVALID_ARGUMENT with the parser's reason and position when it is not JSON."""
    if not len(data):
        raise InvalidArgument(f"JSON parse error: the {what} is empty; send a JSON object")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        error = e

    def finite_float(text: str) -> float:
        value = float(text)
        if math.isinf(value):
            raise InvalidArgument(
                f"JSON parse error in the {what}: the number {text[:40]} is beyond the range of a 64-bit float "
                f"(about 1.8e308); write Infinity or -Infinity for an infinity"
            )
        return value

    def int64_or_float(text: str) -> int | float:  # as orjson and rapidjson read it: past 64 bits, a double
        if len(text) <= 20 and -(2**63) <= (value := int(text)) < 2**64:
            return value
        return finite_float(text)

    raw = bytes(data)
    try:  # NaN / Infinity literals (TensorFlow Serving accepts them): the standard library reads them
        doc = json.loads(raw, parse_float=finite_float, parse_int=int64_or_float)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        doc = _UNPARSED
        if b"Inf" in raw or b"-NaN" in raw:  # rapidjson's other spellings, which TensorFlow Serving reads too
            try:
                doc = json.loads(_NON_FINITE.sub(_standard_spelling, raw), parse_float=finite_float,
                                 parse_int=int64_or_float)  # fmt: skip
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
        if doc is _UNPARSED:
            raise InvalidArgument(f"JSON parse error in the {what}: {error}") from None
    if _SURROGATE_ESCAPE.search(raw):  # orjson refuses lone surrogates; the standard library lets them in
        found = lone_surrogate(doc)
        if found is not None:
            raise InvalidArgument(
                f"JSON parse error in the {what}: {found[0]} is not valid Unicode: it holds a lone surrogate "
                f"(U+{ord(found[1]):04X}); JSON strings must be Unicode text (send bytes as base64)"
            )
    return doc


def lone_surrogate(doc: Any) -> tuple[str, str] | None:
    """Where the first string (a value or an object's key) holding a lone surrogate is in a parsed document, in
    words, and that surrogate; None when there is none. Positions are spelled out for the string found only."""
    stack: list[tuple[Any, tuple | None]] = [(doc, None)]  # (value, (parent's position, step)), None: the top
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            bad = _surrogate(value)
            if bad is not None:
                return f"the string at {_spelled(at) or 'the top level'}", bad
        elif isinstance(value, list):
            stack.extend((item, (at, i)) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                bad = _surrogate(key)
                if bad is not None:
                    return f"the key {key!r} of {_spelled(at) or 'the top-level object'}", bad
                stack.append((item, (at, key)))
    return None


def _spelled(at: tuple | None) -> str:
    """A position ``lone_surrogate`` kept (links to the parent's position) in words: ``inputs[0].data``."""
    steps = []
    while at is not None:
        at, step = at
        steps.append(f"[{step}]" if isinstance(step, int) else _member("_", step)[1:])  # .key or ['a key']
    return "".join(reversed(steps)).removeprefix(".")


def _member(at: str, key: str) -> str:
    """The path of an object's member: ``inputs[0].data``, ``examples[0]['a key']``."""
    if key.isidentifier():
        return f"{at}.{key}" if at else key
    return f"{at}[{key!r}]"


def _surrogate(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return text[e.start]
    return None


def type_name(value: Any) -> str:
    """JSON's name for a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def show(value: Any, limit: int = 80) -> str:
    """A parsed value as JSON text for an error message, cut at ``limit`` characters; a float that is not finite
    as the request spelled it (NaN, Infinity, -Infinity; orjson would write null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    try:
        text = orjson.dumps(value).decode()
    except TypeError:  # not JSON (a NumPy value), or nested past orjson's 254 levels: repr, to a few levels
        text = reprlib.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- values -> arrays -------------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def dtype_kind(dtype: np.dtype) -> str:
    """``float``, ``int``, ``bool``, ``string`` or ``complex``: which JSON values a dtype takes."""
    if dtype == BFLOAT16 or dtype.kind == "f":
        return "float"
    if dtype.kind in "iu":
        return "int"
    if dtype.kind == "b":
        return "bool"
    if dtype.kind in "OSU":
        return "string"
    return "complex"


_EXPECTED = {
    "float": ("a number", _is_number),
    "int": ("an integer", _is_integer),
    "bool": ("true or false", _is_bool),
}


def first_mismatch(value: Any, accept: Callable[[Any], bool], where: str) -> tuple[str, Any] | None:
    """The position and value of the first leaf of nested lists that ``accept`` refuses, or None; with a stack of
    its own (documents nest 1024 levels deep), the position spelled out for the leaf found only."""
    if not isinstance(value, list):
        return None if accept(value) else (where, value)
    path: list[int] = []  # the index taken at each level above the list walked
    stack = [enumerate(value)]
    while stack:
        for i, item in stack[-1]:
            if isinstance(item, list):
                path.append(i)
                stack.append(enumerate(item))
                break
            if not accept(item):
                return where + "".join(f"[{j}]" for j in path) + f"[{i}]", item
        else:
            stack.pop()
            del path[-1:]
    return None


def shape_of(value: Any) -> list[int]:
    """The dense shape of nested lists, following the first element at every level (TensorFlow Serving's rule)."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def ragged_at(value: Any, where: str) -> str | None:
    """Where nested lists stop being rectangular, in words, or None when they are rectangular."""
    expected = shape_of(value)

    def walk(v: Any, level: int, at: str) -> str | None:
        if level == len(expected):
            if isinstance(v, list):
                return f"{at} is a list of {len(v)} where the first element at that depth is a scalar"
            return None
        if not isinstance(v, list):
            return (
                f"{at} is a scalar ({show(v, 40)}) where the first element at that depth is a list of {expected[level]}"
            )
        if len(v) != expected[level]:
            return f"{at} has {len(v)} elements where the first list at that depth has {expected[level]}"
        for i, item in enumerate(v):
            found = walk(item, level + 1, f"{at}[{i}]")
            if found:
                return found
        return None

    return walk(value, 0, where)


def to_array(value: Any, dtype: np.dtype, where: str, expects: str) -> np.ndarray:
    """``value`` (a JSON scalar or nested lists of numbers/booleans) as an array of ``dtype``.

    ``where`` names the value's position in the request (``instances``, ``inputs['x']``) and ``expects`` what the
    tensor is (``input 'x' (DT_FLOAT [-1,3])``); both go into the INVALID_ARGUMENT messages."""
    kind = dtype_kind(dtype)
    if kind not in _EXPECTED:
        raise InvalidArgument(f"{expects}: {np.dtype(dtype).name} values cannot be given in JSON")
    wanted, accept = _EXPECTED[kind]
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):
        array = None
        depth = len(shape_of(value))
        if depth > MAX_DIMS:
            raise InvalidArgument(
                f"{expects}: {where} is nested {depth} levels deep; a tensor has at most {MAX_DIMS} dimensions"
            ) from None
    if array is None or array.dtype.kind == "O":
        bad = first_mismatch(value, accept, where)
        if bad is not None:
            raise InvalidArgument(
                f"{expects}: {bad[0]} is {show(bad[1])} ({type_name(bad[1])}), expected {wanted}"
            ) from None
        ragged = ragged_at(value, where)
        if ragged:
            raise InvalidArgument(f"{expects}: the lists are ragged: {ragged}; a tensor's lists must be rectangular")
        if array is None or array.size:  # integers beyond 64 bits
            big = first_mismatch(value, lambda v: not _is_integer(v) or -(2**63) <= v < 2**64, where)
            at, shown = (big[0], show(big[1], 40)) if big else (where, "an integer")
            if kind == "float":
                raise InvalidArgument(
                    f"{expects}: cannot convert {at} = {shown} to {np.dtype(dtype).name} without loss of precision"
                )
            raise InvalidArgument(f"{expects}: {at} = {shown} is an integer too large for {np.dtype(dtype).name}")
    if array.size == 0:
        return np.zeros(array.shape, dtype=dtype)
    if not _kind_fits(array.dtype.kind, kind):
        bad = first_mismatch(value, accept, where)
        if bad is None:  # integers of mixed sign beyond int64: NumPy made them floats
            raise InvalidArgument(f"{expects}: {where} holds integers out of range for {np.dtype(dtype).name}")
        raise InvalidArgument(f"{expects}: {bad[0]} is {show(bad[1])} ({type_name(bad[1])}), expected {wanted}")
    if kind != "bool" and array.dtype.kind in "iuf" and isinstance(value, list):
        # a boolean among numbers: NumPy made it 0 or 1; integers among floats (or beyond int64 and of both
        # signs): NumPy made them float64, so the float dtype's integer check below cannot see them
        exact = _exact_integers(dtype) if kind == "float" and array.dtype.kind == "f" else None
        check = accept if exact is None else lambda v: _is_number(v) and not (_is_integer(v) and abs(v) > exact)
        bad = first_mismatch(value, check, where)
        if bad is not None:
            if _is_integer(bad[1]):
                raise InvalidArgument(
                    f"{expects}: cannot convert {bad[0]} = {bad[1]} to {np.dtype(dtype).name} without loss of precision"
                )
            raise InvalidArgument(f"{expects}: {bad[0]} is {show(bad[1])} ({type_name(bad[1])}), expected {wanted}")
    if kind == "int":
        return _to_int(array, dtype, value, where, expects)
    if kind == "float":
        return _to_float(array, dtype, value, where, expects)
    return array


def _kind_fits(got: str, kind: str) -> bool:
    if kind == "float":
        return got in "iuf"
    if kind == "int":
        return got in "iu"
    return got == "b"


def _to_int(array: np.ndarray, dtype: np.dtype, value, where: str, expects: str) -> np.ndarray:
    info = np.iinfo(dtype)
    low, high = array.min(), array.max()
    if low < info.min or high > info.max:
        out = low if low < info.min else high
        bad = first_mismatch(value, lambda v: v != out, where)
        at = bad[0] if bad else where
        raise InvalidArgument(
            f"{expects}: {at} is {int(out)}, out of range for {np.dtype(dtype).name} ({info.min}..{info.max})"
        )
    return array.astype(dtype, copy=False)


def _exact_integers(dtype: np.dtype) -> int:
    """The largest integer a float dtype takes as TensorFlow Serving does: every integer up to it is exact
    (2^24 - 1 for float32; 2047 for float16, 255 for bfloat16)."""
    return 2 ** (ml_dtypes.finfo(dtype).nmant + 1) - 1


def _to_float(array: np.ndarray, dtype: np.dtype, value, where: str, expects: str) -> np.ndarray:
    if array.dtype.kind in "iu":  # integers beyond the mantissa would change
        exact = _exact_integers(dtype)
        big = np.abs(array.astype(np.float64)).max()
        if big > exact:
            bad = first_mismatch(value, lambda v: abs(v) <= exact, where)
            at, shown = bad if bad else (where, big)
            raise InvalidArgument(
                f"{expects}: cannot convert {at} = {shown} to {np.dtype(dtype).name} without loss of precision"
            )
    with np.errstate(over="ignore"):
        converted = array.astype(dtype)
    if array.dtype.kind == "f" and dtype.itemsize < array.dtype.itemsize:  # bfloat16 too (its kind is "V")
        overflow = np.isinf(converted) & np.isfinite(array)
        if overflow.any():
            top = float(ml_dtypes.finfo(dtype).max)
            at = first_mismatch(value, lambda v: not (math.isfinite(v) and abs(v) > top), where)
            raise InvalidArgument(
                f"{expects}: cannot convert {at[0] if at else where} = {array[overflow].flat[0]} to "
                f"{np.dtype(dtype).name} without loss of precision (out of its range)"
            )
    return converted


# -- arrays -> JSON ---------------------------------------------------------------------------------------


def jsonable(array: np.ndarray) -> Any:
    """An output array in the form orjson serializes natively: C-contiguous, bfloat16 widened to float32, 0-d
    arrays as NumPy scalars. Object (string) arrays are the caller's business."""
    if array.dtype == BFLOAT16:
        array = array.astype(np.float32)
    elif array.dtype.kind == "c":
        raise InvalidArgument(f"output dtype {array.dtype.name} cannot be written as JSON")
    if array.ndim == 0:
        return array[()]
    return np.ascontiguousarray(array)


_FLOAT32 = struct.Struct("f")  # packing rounds a double to the nearest float32
_POW10 = 10.0 ** np.arange(23)  # the powers of ten a double holds exactly
_VECTORIZED_FROM = 48  # values; below, formatting each one costs less than the vectorized steps' overhead


def tf_decimal(value: float) -> float:
    """The decimal TensorFlow Serving writes for a float32 ``value`` (its json_tensor.cc ``WriteDecimal``:
    ``absl::StrCat``'s six significant digits when they read back as the same float32, else ``%.9g``), read as a
    double: what a client's JSON parser gets from TensorFlow Serving. NaN and infinities come back as they are."""
    text = f"{value:.6g}"
    if _FLOAT32.unpack(_FLOAT32.pack(float(text)))[0] != value:  # ``value`` holds a float32 already
        text = f"{value:.9g}"
    return float(text)


def tf_serving_floats(array: np.ndarray) -> np.ndarray:
    """A float32 (or narrower float) array as float64 holding, value by value, ``tf_decimal``: orjson then writes
    each with the digits TensorFlow Serving writes (a whole number as ``9000000.0`` where TensorFlow Serving
    writes ``9e+06``: the same number once parsed). NaN and infinities stay.

    Vectorized: the value scaled by an exact power of ten to 9 (and 6) digits before the point is exact or within
    1e-7 of exact, rounded half to even as printf rounds, and divided back (correctly rounded: the double nearest
    the decimal). Values near a rounding tie, and those whose scale is no exact double (below 1e-14, from 1e9 on),
    are formatted one by one. Checked against ``tf_decimal`` on millions of values, random bit patterns included
    (tests/server/transport/test_json_codec.py)."""
    with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN
        x = np.ascontiguousarray(np.asarray(array, np.float32), np.float64)  # C order: reshape(-1) below is a view
    if x.size < _VECTORIZED_FROM:
        flat = [tf_decimal(v) for v in x.reshape(-1).tolist()]
        return np.array(flat, np.float64).reshape(x.shape)
    magnitude = np.abs(x)
    usable = np.isfinite(x) & (magnitude != 0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exponent = np.floor(np.log10(np.where(usable, magnitude, 1.0))).astype(np.int64)
        p9 = 8 - exponent  # magnitude * 10**p9 has 9 digits before the point
        scaled = magnitude * _POW10[np.clip(p9, 0, 22)]
        p9 += (scaled < 1e8).astype(np.int64) - (scaled >= 1e9)  # log10's floor is one off near powers of ten
        fast = usable & (p9 >= 0) & (p9 <= 22)
        scale9 = _POW10[np.clip(p9, 0, 22)]
        t9 = magnitude * scale9
        p6 = p9 - 3
        scale6 = _POW10[np.clip(np.abs(p6), 0, 22)]
        up = p6 >= 0
        t6 = np.where(up, magnitude * scale6, magnitude / scale6)
        fast &= (np.abs(t9 - np.floor(t9) - 0.5) > 1e-5) & (np.abs(t6 - np.floor(t6) - 0.5) > 1e-5)
        m6 = np.rint(t6)
        six = np.where(up, m6 / scale6, m6 * scale6)
        nine = np.rint(t9) / scale9
        decimals = np.where(six.astype(np.float32) == magnitude.astype(np.float32), six, nine)
        out = np.where(fast, np.copysign(decimals, x), x)
    slow = np.flatnonzero(usable & ~fast)
    if slow.size:
        flat = out.reshape(-1)
        flat[slow] = [tf_decimal(v) for v in x.reshape(-1)[slow].tolist()]
    return out


def is_narrow_float(array: np.ndarray) -> bool:
    """float32, float16 or bfloat16: written with float32's decimals."""
    return (array.dtype.kind == "f" and array.dtype.itemsize <= 4) or array.dtype == BFLOAT16


def finite(array: np.ndarray) -> bool:
    """Whether orjson can write ``array`` as TensorFlow Serving would (it writes NaN and infinities as null)."""
    if array.dtype.kind == "f" or array.dtype == BFLOAT16:
        return bool(np.isfinite(array).all())
    return True


def plain(value: Any) -> Any:
    """``value`` (arrays, NumPy scalars, lists and dicts of them) as plain Python values for the standard library,
    floats written with their own dtype's shortest decimal (float32 0.2 stays 0.2)."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.kind == "f" or array.dtype == BFLOAT16:
            return (
                array.astype(np.float32 if array.dtype.itemsize <= 4 else np.float64)
                .astype(str)
                .astype(np.float64)
                .tolist()
            )
        return array.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def dumps(value: Any, all_finite: bool = True) -> bytes:
    """``value`` as JSON bytes; with ``all_finite`` false, NaN and infinities are written as TensorFlow Serving
    writes them (``NaN``, ``Infinity``, ``-Infinity``)."""
    if all_finite:
        return orjson.dumps(value, option=OPTIONS)
    return json.dumps(plain(value), separators=(",", ":")).encode()
