"""Hypothesis strategies and checks the decoders' property tests share (tests/**/test_*_properties.py), and the
settings profile they run under: deterministic (``derandomize``: CI sees the same examples every run), no deadline
(the first call of a TensorFlow op takes a second), no example database. ``HYPOTHESIS_PROFILE=servex-thorough``
runs ten times the examples, with random seeds, when hunting for bugs by hand.

The property every decoder test checks: a generated input decodes to the reference decoder's array or is refused
with servex's ServingError naming what was wrong, never another exception, and without memory out of proportion
to the input (``bounded_memory``)."""

from __future__ import annotations

import math
import os
import tracemalloc
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor as _descriptor
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from tensorflow.core.framework import tensor_pb2, types_pb2

from servex.loader.errors import ServingError

settings.register_profile(
    "servex",
    deadline=None,
    derandomize=True,
    database=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("servex-thorough", settings.get_profile("servex"), derandomize=False, max_examples=1500)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "servex")
settings.load_profile(PROFILE)


def examples(count: int) -> settings:
    """A test's own example count (ten times it under ``servex-thorough``)."""
    return settings(max_examples=count * (10 if PROFILE == "servex-thorough" else 1))


MIB = 1 << 20


# -- outcomes -----------------------------------------------------------------------------------------------


def outcome(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result, or the ServingError it raised (any other exception propagates: the test fails), and the
    peak of memory traced while it ran (NumPy's buffers included: NumPy reports them to tracemalloc)."""
    tracing = tracemalloc.is_tracing()  # started by someone else (python -X tracemalloc): left running
    if tracing:
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        try:
            result = fn()
        except ServingError as e:
            result = e
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    if currently_in_test_context():  # what the examples came to: --hypothesis-show-statistics lists them
        event(f"refused: {result.code}" if isinstance(result, ServingError) else "decoded")
    return result, peak


def bounded_memory(peak: int, input_bytes: int, allowed: int = 0) -> None:
    """No more than 64 times the input, plus 1 MiB and ``allowed`` (what the decoder may make from a few bytes
    on purpose: a broadcast under --max_message_bytes)."""
    limit = 64 * input_bytes + MIB + allowed
    assert peak < limit, f"decoding {input_bytes} bytes peaked at {peak} bytes of memory (limit {limit})"


def refused(error: Any, *names: str, codes: tuple[str, ...] = ("INVALID_ARGUMENT",)) -> None:
    """``error`` is a ServingError of one of ``codes`` whose message names each of ``names``."""
    assert isinstance(error, ServingError), error
    assert error.code in codes, (error.code, error.message)
    assert error.message and error.message == str(error), error
    for name in names:
        assert name in error.message, (name, error.message)


# -- TensorProtos ---------------------------------------------------------------------------------------------

DT = types_pb2.DataType
# dtype -> the typed field carrying its values, and a strategy for one value of that field
TYPED_FIELDS: dict[int, tuple[str, st.SearchStrategy]] = {
    DT.Value("DT_FLOAT"): ("float_val", st.floats(width=32)),
    DT.Value("DT_DOUBLE"): ("double_val", st.floats()),
    DT.Value("DT_INT8"): ("int_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_INT16"): ("int_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_INT32"): ("int_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_UINT8"): ("int_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_UINT16"): ("int_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_INT64"): ("int64_val", st.integers(-(2**63), 2**63 - 1)),
    DT.Value("DT_UINT32"): ("uint32_val", st.integers(0, 2**32 - 1)),
    DT.Value("DT_UINT64"): ("uint64_val", st.integers(0, 2**64 - 1)),
    DT.Value("DT_BOOL"): ("bool_val", st.booleans()),
    DT.Value("DT_HALF"): ("half_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_BFLOAT16"): ("half_val", st.integers(-(2**31), 2**31 - 1)),
    DT.Value("DT_COMPLEX64"): ("scomplex_val", st.floats(width=32)),
    DT.Value("DT_COMPLEX128"): ("dcomplex_val", st.floats()),
    DT.Value("DT_STRING"): ("string_val", st.binary(max_size=12)),
}
ITEMSIZE = {DT.Value(n): s for n, s in [("DT_FLOAT", 4), ("DT_DOUBLE", 8), ("DT_INT8", 1), ("DT_INT16", 2),
    ("DT_INT32", 4), ("DT_UINT8", 1), ("DT_UINT16", 2), ("DT_INT64", 8), ("DT_UINT32", 4), ("DT_UINT64", 8),
    ("DT_BOOL", 1), ("DT_HALF", 2), ("DT_BFLOAT16", 2), ("DT_COMPLEX64", 8), ("DT_COMPLEX128", 16)]}  # fmt: skip
# dtypes servex does not decode: TensorFlow's others, a reference type, an unset one and numbers no DataType has
OTHER_DTYPES = [0, DT.Value("DT_RESOURCE"), DT.Value("DT_VARIANT"), DT.Value("DT_QINT8"), DT.Value("DT_FLOAT_REF"),
                DT.Value("DT_FLOAT8_E5M2"), DT.Value("DT_INT4"), 999, 2**31 - 1]  # fmt: skip
HUGE_DIMS = [2**31, 2**40, 2**62, 2**63 - 1]
NEGATIVE_DIMS = [-1, -2, -(2**40), -(2**63)]
REFERENCE_ELEMENTS = 4096  # shapes up to this many elements are decoded by TensorFlow too, for comparison


def dims() -> st.SearchStrategy[int]:
    """One dimension: mostly small, sometimes zero, huge or negative."""
    small = st.integers(1, 4)
    return st.one_of(small, small, small, small, st.just(0), st.sampled_from(HUGE_DIMS + NEGATIVE_DIMS))


def shapes() -> st.SearchStrategy[list[int]]:
    """A shape: up to 4 dimensions mostly, sometimes past NumPy's 64."""
    fair = st.lists(dims(), max_size=4)
    long = st.lists(st.sampled_from([1, 1, 2]), min_size=63, max_size=66)
    return st.sampled_from([fair] * 9 + [long]).flatmap(lambda strategy: strategy)


def elements(shape: list[int]) -> int:
    return math.prod(shape) if all(d >= 0 for d in shape) else -1


def _counts(count: int) -> st.SearchStrategy[int]:
    """How many values to send for ``count`` elements: none, one (a broadcast), all, one short, one too many."""
    near = [c for c in (0, 1, 1, count - 1, count, count, count, count + 1) if 0 <= c <= REFERENCE_ELEMENTS]
    return st.sampled_from(near or [0, 1]) | st.integers(0, 6) if near else st.integers(0, 6)


@st.composite
def _well_formed(draw) -> tensor_pb2.TensorProto:
    """A TensorProto as clients send them: a decodable dtype, a small shape, every value (typed or in
    tensor_content) or one broadcast."""
    dtype = draw(st.sampled_from(list(TYPED_FIELDS)))
    shape = draw(st.lists(st.integers(1, 4), max_size=3))
    proto = tensor_pb2.TensorProto(dtype=dtype)
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    count = math.prod(shape)
    if dtype != DT.Value("DT_STRING") and draw(st.booleans()):
        size = count * ITEMSIZE[dtype]
        proto.tensor_content = draw(st.binary(min_size=size, max_size=size))
        return proto
    field, value = TYPED_FIELDS[dtype]
    n = draw(st.sampled_from([count, count, 1])) * (2 if field in ("scomplex_val", "dcomplex_val") else 1)
    getattr(proto, field).extend(draw(st.lists(value, min_size=n, max_size=n)))
    return proto


def tensor_protos() -> st.SearchStrategy[tensor_pb2.TensorProto]:
    """Request TensorProtos: half as clients send them, half adversarial (``_adversarial``)."""
    return st.one_of(_well_formed(), _adversarial())


@st.composite
def _adversarial(draw) -> tensor_pb2.TensorProto:
    """A request TensorProto: a dtype (decodable or not), a shape (unknown rank, negative or huge dimensions
    sometimes), and its values in tensor_content (its length right, off a little, or random) or in typed fields
    (the dtype's own, or another's), sometimes both."""
    dtype = draw(st.sampled_from(list(TYPED_FIELDS) * 8 + OTHER_DTYPES))
    proto = tensor_pb2.TensorProto(dtype=dtype)
    shape = draw(shapes())
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    if draw(st.sampled_from([False] * 29 + [True])):
        proto.tensor_shape.unknown_rank = True
    count = elements(shape)
    how = draw(st.sampled_from(["typed"] * 4 + ["content"] * 3 + ["other_field", "both"]))
    if how in ("content", "both"):
        itemsize = ITEMSIZE.get(dtype, 4)
        size = count * itemsize if 0 <= count <= REFERENCE_ELEMENTS else draw(st.integers(0, 64))
        size = max(0, size + draw(st.sampled_from([0] * 6 + [1, -1, itemsize, -itemsize])))
        proto.tensor_content = draw(st.binary(min_size=size, max_size=size))
    if how in ("typed", "both", "other_field"):
        key = dtype if how != "other_field" or dtype not in TYPED_FIELDS else draw(st.sampled_from(list(TYPED_FIELDS)))
        field, value = TYPED_FIELDS.get(key, TYPED_FIELDS[DT.Value("DT_FLOAT")])
        per_element = 2 if field in ("scomplex_val", "dcomplex_val") else 1
        n = draw(_counts(count)) * per_element + (draw(st.integers(0, 1)) if per_element == 2 else 0)
        getattr(proto, field).extend(draw(st.lists(value, min_size=n, max_size=n)))
    return proto


# -- JSON values ---------------------------------------------------------------------------------------------

# Numbers as a JSON document may spell them: floats, integers beyond 64 bits, the non-finite literals
JSON_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-300, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, -0.0, 1e38, 3.5e38, 65504.0, 65520.0, 2.0**24 + 1]),
)
JSON_SCALARS = st.one_of(JSON_NUMBERS, st.booleans(), st.none(), st.text(max_size=6), st.just({"b64": "AAE="}))


def json_tensors(leaves: st.SearchStrategy = JSON_SCALARS) -> st.SearchStrategy:
    """A JSON tensor value: a scalar, or nested lists (rectangular or ragged, of any depth up to 6 mostly; or
    nested past NumPy's 64 dimensions, and to hundreds of levels where the document still parses)."""
    nested = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4), max_leaves=24)
    rectangular = st.builds(_rectangle, st.lists(st.integers(0, 3), max_size=4), leaves)
    deep = st.builds(_deep, st.sampled_from([63, 64, 65, 200, 900]), leaves, st.booleans())
    return st.one_of(rectangular, rectangular, nested, deep)


def _rectangle(shape: list[int], leaf) -> Any:
    if not shape:
        return leaf
    return [_rectangle(shape[1:], leaf) for _ in range(shape[0])]


def _deep(depth: int, leaf, beside: bool) -> Any:
    """``leaf`` nested ``depth`` levels deep; ``beside``: after a scalar sibling (ragged at the top)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return [1, value] if beside else value


NON_FINITE = ["NaN", "-NaN", "Infinity", "-Infinity", "Inf", "-Inf", "nan", "inf", "1e400", "-1e400"]


# -- descriptor-driven messages (the text-format configs) ------------------------------------------------------

FD = _descriptor.FieldDescriptor
_SCALARS = {
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FD.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FD.TYPE_INT32: st.integers(-(2**31), 2**31 - 1) | st.integers(-3, 3),
    FD.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FD.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: st.text(max_size=8) | st.sampled_from(["", "m", "tensorflow", "tfrecord", "/tmp/x", "a/b", ".."]),
    FD.TYPE_BYTES: st.binary(max_size=8),
}


def _field_value(field, depth: int, strings: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth - 1, strings)
    if field.type == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    if field.type == FD.TYPE_STRING and field.name in strings:
        return strings[field.name]
    return _SCALARS[field.type]


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf 7: label is deprecated
    return repeated if isinstance(repeated, bool) else field.label == FD.LABEL_REPEATED


@st.composite
def _message(draw, descriptor, depth: int, strings: dict[str, st.SearchStrategy]):
    from google.protobuf import message_factory

    message = message_factory.GetMessageClass(descriptor)()
    fields = [f for f in descriptor.fields if f.type != FD.TYPE_GROUP]
    if depth <= 0:
        fields = [f for f in fields if f.type != FD.TYPE_MESSAGE]
    for field in draw(st.lists(st.sampled_from(fields), max_size=5, unique_by=lambda f: f.number)) if fields else []:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_field_value(key, depth, strings), _field_value(value, depth, strings),
                                           max_size=2))  # fmt: skip
            target = getattr(message, field.name)
            for k, v in entries.items():
                if value.type == FD.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif _is_repeated(field):
            values = draw(st.lists(_field_value(field, depth, strings), max_size=3))
            if field.type == FD.TYPE_MESSAGE:
                getattr(message, field.name).extend(values)
            else:
                getattr(message, field.name).extend(values)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(draw(_field_value(field, depth, strings)))
        else:
            setattr(message, field.name, draw(_field_value(field, depth, strings)))
    return message


def messages(descriptor, depth: int = 3, strings: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    """Random messages of ``descriptor``'s type: any of its fields set (enums to their values, messages nested
    ``depth`` levels deep), ``strings`` overriding the strategy of the string fields they name."""
    return _message(descriptor, depth, strings or {})


@st.composite
def mangled(draw, text: str) -> str:
    """``text`` (a message in text format) with a random edit: a span cut, a token or a junk string put in."""
    tokens = ["{", "}", ":", "<", ">", "[", "]", "'", '"', "\\", "#", "\n", "-", "nan", "1e999", "0x", "\x00",
              "\udc80", "é", "name", "config", "true", "99999999999999999999999"]  # fmt: skip
    at = draw(st.integers(0, len(text)))
    kind = draw(st.sampled_from(["cut", "insert", "insert", "junk"]))
    if kind == "cut":
        return text[:at] + text[at + draw(st.integers(1, 12)) :]
    if kind == "insert":
        return text[:at] + draw(st.sampled_from(tokens)) + text[at:]
    return text[:at] + draw(st.text(max_size=10)) + text[at:]


# -- tf.Examples ---------------------------------------------------------------------------------------------


@st.composite
def features(draw):
    """A tf.train.Feature: floats, int64s or bytes (none to a few), or no kind at all."""
    from tensorflow.core.example import feature_pb2

    feature = feature_pb2.Feature()
    kind = draw(st.sampled_from(["float_list"] * 6 + ["int64_list", "bytes_list", None]))
    if kind is not None:
        values = {"float_list": st.floats(width=32), "int64_list": st.integers(-(2**63), 2**63 - 1),
                  "bytes_list": st.binary(max_size=4)}[kind]  # fmt: skip
        count = draw(st.sampled_from([1] * 6 + [0, 2]))
        getattr(feature, kind).value.extend(draw(st.lists(values, min_size=count, max_size=count)))
    return feature


@st.composite
def tf_examples(draw, names: tuple[str, ...] = ("x", "x", "x", "x2", "y", "")):
    """A tf.train.Example of a few of ``names``' features, or one parsed from random bytes (unknown fields kept)."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example()
    if draw(st.integers(0, 19)) == 0:
        try:
            example.ParseFromString(draw(st.binary(max_size=24)))
        except DecodeError:
            pass
        return example
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        example.features.feature[name].CopyFrom(draw(features()))
    return example
