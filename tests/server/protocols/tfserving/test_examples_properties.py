"""Property tests of TensorFlow Serving's tf.Example inputs (server/protocols/tfserving/examples.py, and the JSON
form of server/protocols/tfserving/rest_api.py): any Input (example_list, example_list_with_context, none) becomes
the serialized examples TensorFlow Serving feeds, which Classify and Regress run through half_plus_two's own
ParseExample, giving what ``tf.io.parse_example`` (the reference) makes of them, or INVALID_ARGUMENT; any JSON
examples body becomes the tf.Examples TensorFlow Serving's JSON rules make, or INVALID_ARGUMENT naming where it is
wrong. Never another exception (tests/support/strategies.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from hypothesis import strategies as st
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import classification_pb2, input_pb2, regression_pb2

from servex.server.protocols.tfserving import examples, rest_api
from servex.server.transport import json_codec
from tests.support.in_process import serving_core
from tests.support.strategies import bounded_memory, outcome, refused, tf_examples
from tests.support.strategies import examples as example_count

# half_plus_two (TF1): one ParseExample of "x" (float [1], required) and "x2" (float [1], with a default)
PARSED = {"x": tf.io.FixedLenFeature([1], tf.float32), "x2": tf.io.FixedLenFeature([1], tf.float32, [0.0])}
SIGNATURES = {"classify_x_to_y": 2.0, "regress_x_to_y": 2.0, "regress_x_to_y2": 3.0}  # y = 0.5 x + this


@pytest.fixture(scope="module")
def core():
    with serving_core("hp") as core:
        yield core


@st.composite
def model_examples(draw) -> example_pb2.Example:
    """A tf.Example for half_plus_two: mostly its one float "x" and random other features (an "x" too, at times)."""
    example = draw(tf_examples(("x2", "y", "x")))
    if "x" not in example.features.feature and draw(st.integers(0, 4)):
        example.features.feature["x"].float_list.value.append(draw(st.floats(width=32)))
    return example


@st.composite
def inputs(draw, items: st.SearchStrategy | None = None) -> input_pb2.Input:
    """An Input: a list of examples, a list with a context, or neither; sometimes no examples."""
    proto, items = input_pb2.Input(), tf_examples() if items is None else items
    kind = draw(st.sampled_from(["example_list"] * 4 + ["example_list_with_context"] * 3 + [None]))
    if kind is None:
        return proto
    target = getattr(proto, kind)
    target.SetInParent()
    target.examples.extend(draw(st.lists(items, min_size=draw(st.sampled_from([1] * 9 + [0])), max_size=3)))
    if kind == "example_list_with_context" and draw(st.integers(0, 4)):
        target.context.CopyFrom(draw(items))
    return proto


def _merged(proto: input_pb2.Input) -> list[example_pb2.Example]:
    """The examples as TensorFlow parses their serialized form: each over the context, its features winning."""
    kind = proto.WhichOneof("kind")
    context = proto.example_list_with_context.context if kind == "example_list_with_context" else None
    merged = []
    for item in getattr(proto, kind).examples:
        one = example_pb2.Example()
        if context is not None:
            one.CopyFrom(context)
            for name, feature in item.features.feature.items():
                one.features.feature[name].CopyFrom(feature)  # the example's feature replaces the context's
            one.MergeFrom(_unknown_only(item))
        else:
            one.CopyFrom(item)
        merged.append(one)
    return merged


def _unknown_only(item: example_pb2.Example) -> example_pb2.Example:
    rest = example_pb2.Example()
    rest.CopyFrom(item)
    rest.ClearField("features")
    return rest


@given(inputs())
@example_count(200)
def test_an_input_becomes_its_examples_serialized_over_the_context(proto):
    result, peak = outcome(lambda: examples.serialized_examples(proto, "ClassificationRequest.input"))
    bounded_memory(peak, proto.ByteSize())
    kind = proto.WhichOneof("kind")
    if not isinstance(result, np.ndarray):
        refused(result, "ClassificationRequest.input", "empty")
        assert kind is None or not getattr(proto, kind).examples
        return
    parsed = [example_pb2.Example.FromString(entry) for entry in result.tolist()]
    want = _merged(proto)
    assert [dict(p.features.feature) for p in parsed] == [dict(w.features.feature) for w in want]


def _tensorflow_serving_s(proto: input_pb2.Input) -> list[bytes]:
    """The serialized examples TensorFlow Serving feeds for an Input (util.cc InputToSerializedExampleTensor): the
    context's bytes, then the example's."""
    kind = proto.WhichOneof("kind")
    if kind is None:
        return []
    with_context = kind == "example_list_with_context"
    context = proto.example_list_with_context.context.SerializeToString() if with_context else b""
    return [context + item.SerializeToString() for item in getattr(proto, kind).examples]


def _expected(serialized: list[bytes], signature: str) -> np.ndarray | None:
    """What half_plus_two answers for the serialized examples, by TensorFlow's own parser; None where it refuses
    them."""
    if not serialized:
        return None
    try:
        x = tf.io.parse_example(tf.constant(serialized), PARSED)["x"].numpy()[:, 0]
    except tf.errors.InvalidArgumentError:
        return None
    return np.float32(0.5) * x + np.float32(SIGNATURES[signature])


@given(inputs(model_examples()), st.sampled_from(list(SIGNATURES)))
@example(input_pb2.Input(example_list=input_pb2.ExampleList(examples=[example_pb2.Example()])), "regress_x_to_y")
@example_count(100)
def test_classify_and_regress_answer_as_the_model_s_parse_example_or_refuse(core, proto, signature):
    classify = signature.startswith("classify")
    request = (classification_pb2.ClassificationRequest if classify else regression_pb2.RegressionRequest)()
    request.model_spec.name, request.model_spec.signature_name = "hp", signature
    request.input.CopyFrom(proto)
    result, _ = outcome(lambda: asyncio.run((examples.classify if classify else examples.regress)(core, request)))
    want = _expected(_tensorflow_serving_s(proto), signature)
    if want is None:
        refused(result)
        return
    assert not hasattr(result, "code"), f"servex refuses what half_plus_two takes: {result.message}"
    if classify:
        got = [[c.score for c in row.classes] for row in result.result.classifications]
        assert all(len(row) == 1 for row in got)
        got = [row[0] for row in got]
    else:
        got = [r.value for r in result.result.regressions]
    np.testing.assert_array_equal(np.array(got, np.float32), want)


# -- the JSON form (REST :classify and :regress) ---------------------------------------------------------------

_FLOAT32_MAX = float(np.finfo(np.float32).max)
JSON_FEATURE_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.integers(-(2**64), 2**64), st.booleans(), st.floats(), st.just(3.5e38),
    st.text(max_size=4), st.binary(max_size=4).map(lambda b: {"b64": base64.b64encode(b).decode()}),
    st.sampled_from([None, {"b64": "!!"}, {}, {"b64": "AA", "x": 1}, [1], [[1]]]),
)  # fmt: skip
JSON_EXAMPLES = st.dictionaries(st.sampled_from(["x", "x2", "y", ""]), JSON_FEATURE_VALUES | st.lists(
    JSON_FEATURE_VALUES, max_size=3), max_size=3)  # fmt: skip


def _json_feature(content) -> tuple[str, list] | None:
    """TensorFlow Serving's reading of a feature's JSON value: its kind and values; None where it refuses it."""
    kind, values = None, []
    for value in content if isinstance(content, list) else [content]:
        if isinstance(value, bool) or isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                return None
            this, item = "int64_list", int(value)
        elif isinstance(value, float):
            if abs(value) > _FLOAT32_MAX and np.isfinite(value):
                return None
            this, item = "float_list", value
        elif isinstance(value, str):
            this, item = "bytes_list", value.encode()
        elif isinstance(value, dict) and len(value) == 1 and isinstance(value.get("b64"), str):
            try:
                this, item = "bytes_list", base64.b64decode(value["b64"], validate=True)
            except ValueError:
                return None
        else:
            return None
        if kind not in (None, this):
            return None
        kind = this
        values.append(item)
    return kind, values


def _json_example(value) -> example_pb2.Example | None:
    if not isinstance(value, dict):
        return None
    result = example_pb2.Example()
    for name, content in value.items():
        feature = _json_feature(content)
        if feature is None:
            return None
        entry = result.features.feature[name]
        if feature[0] is not None:
            getattr(entry, feature[0]).value.extend(feature[1])
    return result


@given(st.lists(JSON_EXAMPLES | st.sampled_from([[], "x"]), max_size=3), st.none() | JSON_EXAMPLES)
@example([{"x": [1, 2.5]}], None)
@example([{"x": 2**63}], {"x": {"b64": "AA=="}})
@example_count(200)
def test_a_json_examples_body_becomes_tensorflow_serving_s_examples_or_is_refused(items, context):
    doc = {"examples": items} if context is None else {"examples": items, "context": context}
    body = json.dumps(doc).encode()
    parsed = json_codec.parse(body)
    result, peak = outcome(lambda: rest_api.serialized_examples(parsed))
    bounded_memory(peak, len(body))
    # from the parsed body: integers past 64 bits are doubles there, as in TensorFlow Serving's rapidjson
    wanted = [_json_example(item) for item in parsed["examples"]]
    base = _json_example(parsed["context"]) if context is not None else example_pb2.Example()
    if not isinstance(result, np.ndarray):
        refused(result)
        assert "examples" in result.message or "context" in result.message, result.message
        assert not items or base is None or any(w is None for w in wanted), result.message
        return
    assert base is not None and all(w is not None for w in wanted)
    for entry, want in zip(result.tolist(), wanted, strict=True):
        merged = example_pb2.Example()
        merged.CopyFrom(base)
        for name, feature in want.features.feature.items():
            merged.features.feature[name].CopyFrom(feature)
        got = example_pb2.Example.FromString(entry)
        assert got.SerializeToString(deterministic=True) == merged.SerializeToString(deterministic=True)
