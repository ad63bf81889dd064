"""Unit tests for server/protocols/tfserving/examples.py: Input -> serialized tf.Examples, signature checks, result
building, and
Classify/Regress/MultiInference on an in-process ServingCore (no daemon) over TensorFlow Serving's test models.

TensorFlow is the oracle for the context merge: ``tf.io.parse_example`` reads the bytes the way the model does.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import classification_pb2, inference_pb2, input_pb2, regression_pb2

from servex.executor import RunHandler, client_graph_key
from servex.loader.config import ModelSpec
from servex.loader.errors import InvalidArgument, ServingError
from servex.loader.saved_model import Signature, TensorSpec
from servex.server.app import make_manager
from servex.server.config.settings import ServerSettings
from servex.server.core import ServingCore
from servex.server.protocols.tfserving import examples
from tests.conftest import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2, TESTDATA

WHERE = "model 'm' version 1 signature 's'"


def example(**features) -> tf.train.Example:
    """A tf.Example of float features (a list value gives several floats)."""
    feature = {}
    for name, value in features.items():
        values = value if isinstance(value, list) else [value]
        feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature))


def parse(serialized: np.ndarray, *names: str) -> dict[str, list[float]]:
    """What the model sees: each named feature parsed from the serialized examples (default -1 when absent)."""
    spec = {n: tf.io.FixedLenFeature([], tf.float32, default_value=-1.0) for n in names}
    parsed = tf.io.parse_example(tf.constant(list(serialized)), spec)
    return {n: parsed[n].numpy().tolist() for n in names}


# -- serialized_examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "off"), [(examples.LARGE - 1, False), (examples.LARGE, True)])
def test_many_examples_are_handled_off_the_event_loop(count, off):
    # Serializing millions of examples (or filling their results) on the event loop would stall every other
    # caller; past LARGE examples the work runs on a worker thread.
    async def main():
        loop_thread = threading.get_ident()
        ran_on = await examples.off_loop(count, threading.get_ident)
        return ran_on != loop_thread

    assert asyncio.run(main()) is off


def test_example_list_serializes_each_example():
    given = [example(x=1.0), example(x=2.0, y=[3.0, 4.0])]
    input_proto = input_pb2.Input()
    input_proto.example_list.examples.extend(given)
    out = examples.serialized_examples(input_proto, "ClassificationRequest.input")
    assert out.dtype == object and out.shape == (2,)
    assert [tf.train.Example.FromString(b) for b in out] == given
    assert all(isinstance(b, bytes) for b in out)


def test_context_bytes_come_first_and_the_example_overrides_the_context():
    input_proto = input_pb2.Input()
    with_context = input_proto.example_list_with_context
    with_context.context.CopyFrom(example(x=10.0, c=7.0))
    with_context.examples.extend([example(x=2.0), example(z=5.0), example()])
    out = examples.serialized_examples(input_proto, "RegressionRequest.input")
    context = with_context.context.SerializeToString()
    assert list(out) == [context + e.SerializeToString() for e in with_context.examples]  # as util.cc builds them
    # Parsed, each entry is the example merged over the context: the example's x wins, the context fills the rest.
    assert parse(out, "x", "c", "z") == {"x": [2.0, 10.0, 10.0], "c": [7.0, 7.0, 7.0], "z": [-1.0, 5.0, -1.0]}


def test_context_left_unset_gives_the_examples_alone():
    input_proto = input_pb2.Input()
    input_proto.example_list_with_context.examples.extend([example(x=4.0)])
    out = examples.serialized_examples(input_proto, "where")
    assert list(out) == [example(x=4.0).SerializeToString()]


def _empty_list() -> input_pb2.Input:
    input_proto = input_pb2.Input()
    input_proto.example_list.SetInParent()
    return input_proto


def _context_only() -> input_pb2.Input:
    input_proto = input_pb2.Input()
    input_proto.example_list_with_context.context.CopyFrom(example(x=1.0))
    return input_proto


@pytest.mark.parametrize(
    "make, fragments",
    [
        (input_pb2.Input, ["MultiInferenceRequest.input is empty", "set example_list or example_list_with_context"]),
        (_empty_list, ["MultiInferenceRequest.input is empty", "example_list holds no tf.Example"]),
        (_context_only, ["MultiInferenceRequest.input is empty", "example_list_with_context holds no tf.Example"]),
    ],
)
def test_empty_input_is_invalid_argument(make, fragments):
    with pytest.raises(InvalidArgument) as info:
        examples.serialized_examples(make(), "MultiInferenceRequest.input")
    for fragment in fragments:
        assert fragment in info.value.message


# -- plan_task (PreProcessClassification / PreProcessRegression) --------------------------------------------


def spec(name: str, dtype=types_pb2.DT_FLOAT, shape=(None, 1)) -> TensorSpec:
    np_dtype = np.dtype(object) if dtype == types_pb2.DT_STRING else np.dtype(np.float32)
    return TensorSpec(name=name, dtype_enum=dtype, dtype=np_dtype, shape=shape)


def signature(inputs=None, outputs=None, method=examples.CLASSIFY_METHOD, name="s") -> Signature:
    inputs = {"inputs": spec("tf_example:0", types_pb2.DT_STRING, None)} if inputs is None else inputs
    outputs = {"scores": spec("y:0")} if outputs is None else outputs
    return Signature(name=name, method_name=method, inputs=inputs, outputs=outputs)


def test_plan_classify_fetches_classes_and_scores():
    sig = signature(outputs={"classes": spec("c:0", types_pb2.DT_STRING), "scores": spec("s:0")})
    plan = examples.plan_task(sig, examples.CLASSIFY_METHOD, WHERE)
    assert plan.input_name == "tf_example:0"
    assert plan.outputs == {"classes": "c:0", "scores": "s:0"}


def test_plan_classify_ignores_a_second_unrelated_output():
    sig = signature(outputs={"scores": spec("s:0"), "debug": spec("d:0")})
    assert examples.plan_task(sig, examples.CLASSIFY_METHOD, WHERE).outputs == {"scores": "s:0"}


def test_plan_regress():
    sig = signature(outputs={"outputs": spec("y2:0")}, method=examples.REGRESS_METHOD)
    plan = examples.plan_task(sig, examples.REGRESS_METHOD, WHERE)
    assert (plan.input_name, plan.outputs) == ("tf_example:0", {"outputs": "y2:0"})


@pytest.mark.parametrize(
    "sig, method, fragments",
    [
        (
            signature(inputs={"x": spec("x:0")}),
            examples.CLASSIFY_METHOD,
            ["Classify needs a signature with exactly one input, 'inputs'", "inputs are: x (DT_FLOAT [-1,1])"],
        ),
        (
            signature(inputs={"inputs": spec("a:0"), "other": spec("b:0")}),
            examples.REGRESS_METHOD,
            ["Regress needs a signature with exactly one input", "inputs (DT_FLOAT [-1,1]), other"],
        ),
        (
            signature(outputs={"outputs": spec("y:0")}),
            examples.CLASSIFY_METHOD,
            ["'classes'", "'scores'", "outputs are: outputs (DT_FLOAT [-1,1])"],
        ),
        (
            signature(outputs={"scores": spec("a:0"), "classes": spec("b:0"), "extra": spec("c:0")}),
            examples.CLASSIFY_METHOD,
            ["one or two outputs", "extra"],
        ),
        (
            signature(outputs={"scores": spec("y:0")}),
            examples.REGRESS_METHOD,
            ["Regress needs a signature with exactly one output, 'outputs'", "outputs are: scores"],
        ),
        (
            signature(outputs={"outputs": spec("y:0"), "more": spec("z:0")}),
            examples.REGRESS_METHOD,
            ["exactly one output", "more (DT_FLOAT"],
        ),
    ],
)
def test_plan_rejects_signatures_of_the_wrong_shape(sig, method, fragments):
    with pytest.raises(InvalidArgument) as info:
        examples.plan_task(sig, method, WHERE)
    assert info.value.message.startswith(WHERE)
    for fragment in fragments:
        assert fragment in info.value.message


def test_method_name_is_checked_only_when_asked():
    tf2_style = signature(method="tensorflow/serving/predict")  # what tf.saved_model.save writes
    assert examples.plan_task(tf2_style, examples.CLASSIFY_METHOD, WHERE).outputs == {"scores": "y:0"}
    with pytest.raises(InvalidArgument) as info:
        examples.plan_task(tf2_style, examples.CLASSIFY_METHOD, WHERE, check_method_name=True)
    assert "method_name 'tensorflow/serving/classify'" in info.value.message
    assert "'tensorflow/serving/predict'" in info.value.message
    tf1_style = signature(outputs={"outputs": spec("y:0")}, method=examples.REGRESS_METHOD)
    assert examples.plan_task(tf1_style, examples.REGRESS_METHOD, WHERE, check_method_name=True).outputs


# -- result building (PostProcessClassificationResult / PostProcessRegressionResult) --------------------------


def classification(outputs, n) -> classification_pb2.ClassificationResult:
    result = classification_pb2.ClassificationResult()
    examples.fill_classification_result(result, outputs, n, WHERE)
    return result


def rows(result: classification_pb2.ClassificationResult) -> list[list[tuple[str, float]]]:
    return [[(c.label, c.score) for c in row.classes] for row in result.classifications]


def test_scores_only_give_classes_with_scores():
    result = classification({"scores": np.array([[3.0], [4.5]], np.float32)}, 2)
    assert rows(result) == [[("", 3.0)], [("", 4.5)]]


def test_classes_only_give_labels_without_scores():
    classes = np.array([[b"cat", b"dog"], [b"emu", "gnu"]], dtype=object)  # bytes, as TensorFlow returns, or str
    assert rows(classification({"classes": classes}, 2)) == [[("cat", 0.0), ("dog", 0.0)], [("emu", 0.0), ("gnu", 0.0)]]


def test_classes_and_scores_pair_up_per_column():
    outputs = {
        "classes": np.array([[b"a", b"b", b"c"]], dtype=object),
        "scores": np.array([[0.25, 0.5, 0.25]], np.float32),
    }
    assert rows(classification(outputs, 1)) == [[("a", 0.25), ("b", 0.5), ("c", 0.25)]]


@pytest.mark.parametrize(
    "outputs, n, fragments",
    [
        ({"scores": np.ones(3, np.float32)}, 3, ["output 'scores' must have shape [batch_size, num_classes]", "[3]"]),
        ({"scores": np.ones((3, 1), np.float64)}, 3, ["output 'scores' must be DT_FLOAT, got DT_DOUBLE"]),
        ({"classes": np.ones((3, 1), np.int64)}, 3, ["output 'classes' must be DT_STRING, got DT_INT64"]),
        ({"scores": np.ones((2, 1), np.float32)}, 3, ["'scores' has batch size 2", "the request has 3 example(s)"]),
        (
            {"classes": np.full((3, 2), b"a", dtype=object), "scores": np.ones((3, 1), np.float32)},
            3,
            ["'classes' [3, 2] and 'scores' [3, 1] disagree on the number of classes"],
        ),
        ({"classes": np.array([[b"\xff\xfe"]], dtype=object)}, 1, ["'classes' [0, 0] is not UTF-8", "\\xff"]),
        ({}, 1, ["no 'classes' or 'scores' output"]),
    ],
)
def test_classification_output_errors(outputs, n, fragments):
    with pytest.raises(InvalidArgument) as info:
        classification(outputs, n)
    assert info.value.message.startswith(WHERE)
    for fragment in fragments:
        assert fragment in info.value.message


@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_regression_takes_batch_or_batch_by_one(shape):
    result = regression_pb2.RegressionResult()
    values = np.array([2.5, 3.0, 4.5], np.float32).reshape(shape)
    examples.fill_regression_result(result, {"outputs": values}, 3, WHERE)
    assert [r.value for r in result.regressions] == [2.5, 3.0, 4.5]


@pytest.mark.parametrize(
    "value, n, fragments",
    [
        (np.ones((3, 2), np.float32), 3, ["[batch_size] or [batch_size, 1], got [3, 2]"]),
        (np.ones((), np.float32), 1, ["[batch_size] or [batch_size, 1], got []"]),
        (np.ones((4, 1), np.float32), 3, ["'outputs' has batch size 4", "the request has 3 example(s)"]),
        (np.ones(3, np.int32), 3, ["'outputs' must be DT_FLOAT, got DT_INT32"]),
    ],
)
def test_regression_output_errors(value, n, fragments):
    with pytest.raises(InvalidArgument) as info:
        examples.fill_regression_result(regression_pb2.RegressionResult(), {"outputs": value}, n, WHERE)
    for fragment in fragments:
        assert fragment in info.value.message


# -- on an in-process ServingCore ---------------------------------------------------------------------------

HALF_PLUS_THREE = TESTDATA / "saved_model_half_plus_three"


@pytest.fixture(scope="module")
def core():
    manager = make_manager(ServerSettings(num_run_workers=2))
    problems = manager.apply_config(
        [
            ModelSpec("tf1", str(HALF_PLUS_TWO_TF1)),
            ModelSpec("tf2", str(HALF_PLUS_TWO_TF2)),
            ModelSpec("three", str(HALF_PLUS_THREE)),
        ]
    )
    assert not problems
    run_handler = RunHandler(2)
    yield ServingCore(manager, run_handler)
    run_handler.close()
    manager.unload_all()


def call(fn, *args, **kwargs):
    return asyncio.run(fn(*args, **kwargs))


def classify_request(model, signature_name, *xs) -> classification_pb2.ClassificationRequest:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    request.input.example_list.examples.extend(example(x=x) for x in xs)
    return request


def multi_request(model, tasks, *xs) -> inference_pb2.MultiInferenceRequest:
    request = inference_pb2.MultiInferenceRequest()
    for signature_name, method in tasks:
        task = request.tasks.add(method_name=method)
        task.model_spec.name = model
        task.model_spec.signature_name = signature_name
    request.input.example_list.examples.extend(example(x=x) for x in xs)
    return request


@pytest.mark.parametrize("model", ["tf1", "tf2"])
def test_classify_and_regress_in_process(core, model):
    response = call(examples.classify, core, classify_request(model, "classify_x_to_y", 2.0, 4.0))
    assert rows(response.result) == [[("", 3.0)], [("", 4.0)]]
    assert (response.model_spec.name, response.model_spec.version.value) == (model, 123)
    assert response.model_spec.signature_name == "classify_x_to_y"
    request = regression_pb2.RegressionRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = "regress_x_to_y2"
    request.input.example_list.examples.extend([example(x=2.0)])
    assert [r.value for r in call(examples.regress, core, request).result.regressions] == [4.0]


def test_method_name_check_rejects_tf2_signatures_and_accepts_tf1(core):
    call(examples.classify, core, classify_request("tf1", "classify_x_to_y", 1.0), check_method_name=True)
    with pytest.raises(InvalidArgument) as info:
        call(examples.classify, core, classify_request("tf2", "classify_x_to_y", 1.0), check_method_name=True)
    assert "has 'tensorflow/serving/predict'" in info.value.message


def test_regress_on_a_signature_declaring_its_example_input_float(core):
    # half_plus_three's regress signature declares tf_example:0 DT_FLOAT; the placeholder is a string and
    # TensorFlow Serving serves it (it feeds by tensor name), so servex does too.
    request = regression_pb2.RegressionRequest()
    request.model_spec.name = "three"
    request.model_spec.signature_name = "tensorflow/serving/regress"
    request.input.example_list.examples.extend(example(x=x) for x in (1.0, 2.0, 5.0))
    assert [r.value for r in call(examples.regress, core, request).result.regressions] == [3.5, 4.0, 5.5]


@pytest.mark.parametrize("model", ["tf1", "tf2"])
def test_multi_inference_runs_every_task_in_one_run(core, model):
    tasks = [
        ("regress_x_to_y", examples.REGRESS_METHOD),
        ("classify_x_to_y", examples.CLASSIFY_METHOD),
        ("regress_x_to_y2", examples.REGRESS_METHOD),
    ]
    response = call(examples.multi_inference, core, multi_request(model, tasks, 2.0, 6.0))
    assert [r.model_spec.signature_name for r in response.results] == [t[0] for t in tasks]
    assert [r.WhichOneof("result") for r in response.results] == [
        "regression_result",
        "classification_result",
        "regression_result",
    ]
    assert [v.value for v in response.results[0].regression_result.regressions] == [3.0, 5.0]
    assert rows(response.results[1].classification_result) == [[("", 3.0)], [("", 5.0)]]
    assert [v.value for v in response.results[2].regression_result.regressions] == [4.0, 6.0]
    # One client graph fed every task's input tensor and fetching every task's outputs.
    served = core.manager.get(model)
    sigs = served.servable.model.signatures
    feeds = {sigs[name].inputs["inputs"].name for name, _ in tasks}
    fetches = {tensor.name for name, _ in tasks for tensor in sigs[name].outputs.values()}
    assert len(feeds) == (1 if model == "tf1" else 3)
    assert client_graph_key(sorted(feeds), sorted(fetches)) in served.servable.cached_keys()


def test_multi_inference_task_errors(core):
    def error(tasks, model="tf1", xs=(1.0,)):
        with pytest.raises(ServingError) as info:
            call(examples.multi_inference, core, multi_request(model, tasks, *xs))
        return info.value

    e = error([("regress_x_to_y", examples.REGRESS_METHOD), ("serving_default", "tensorflow/serving/predict")])
    assert e.code == "UNIMPLEMENTED" and "tasks[1].method_name 'tensorflow/serving/predict'" in e.message
    e = error([("regress_x_to_y", examples.REGRESS_METHOD), ("regress_x_to_y", examples.REGRESS_METHOD)])
    assert e.code == "INVALID_ARGUMENT" and "signature 'regress_x_to_y' again (tasks[0]" in e.message
    e = error([("", examples.CLASSIFY_METHOD)])  # serving_default takes x, not serialized examples
    assert e.code == "INVALID_ARGUMENT" and "signature 'serving_default': Classify needs" in e.message
    e = error([("regress_x_to_y", examples.REGRESS_METHOD)], xs=())
    assert e.code == "INVALID_ARGUMENT" and "MultiInferenceRequest.input is empty" in e.message
    request = multi_request("tf1", [("regress_x_to_y", examples.REGRESS_METHOD)] * 2, 1.0)
    request.tasks[1].model_spec.name = "tf2"
    with pytest.raises(InvalidArgument) as info:
        call(examples.multi_inference, core, request)
    assert "tasks[0] names 'tf1', tasks[1] names 'tf2'" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        call(examples.multi_inference, core, inference_pb2.MultiInferenceRequest())
    assert "tasks is empty" in info.value.message
