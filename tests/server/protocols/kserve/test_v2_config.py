"""A Triton repository model's config.pbtxt against its SavedModel (server/protocols/kserve/v2_config.py): what a load
checks, the
answer completed from the signature, the outputs it narrows the signature to, and its batching."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from servex.executor.batching import NO_BATCHING, BatchingOptions
from servex.loader.errors import LoadError
from servex.loader.saved_model import Signature, TensorSpec
from servex.protos.inference import model_config_module
from servex.server.protocols.kserve import v2_config

FLOAT, INT64 = 1, 9  # TensorFlow's DataType numbers


def spec(name, shape, dtype=np.float32, enum=FLOAT):
    return TensorSpec(name, enum, np.dtype(dtype), shape)


SIG = Signature(
    "serving_default",
    "tensorflow/serving/predict",
    inputs={"x": spec("x:0", (None, 3)), "ids": spec("ids:0", (None,), np.int64, INT64)},
    outputs={"y": spec("y:0", (None, 2)), "total": spec("total:0", ())},
    output_aliases=("y", "total"),
    output_names=("y:0", "total:0"),
    defaults={"ids": np.zeros([1], np.int64)},  # an input a request (and a config) may leave out
)


def config(text: str):
    return text_format.Parse(text, model_config_module().ModelConfig())


class Model:
    def __init__(self):
        self.signatures = {"serving_default": SIG}


@pytest.mark.parametrize(
    "text",
    [
        "",
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]',
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 5, 3 ] } ]',  # a fixed size where the SavedModel takes any
        'max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]',
        'max_batch_size: 4 output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]',
        'output [ { name: "total" data_type: TYPE_FP32 dims: [ ] } ]',
    ],
)
def test_configs_that_describe_the_savedmodel_load(text):
    v2_config.check_config("m", config(text), config(text).max_batch_size, SIG)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('input [ { name: "z" data_type: TYPE_FP32 dims: [ 3 ] } ]', "input 'z' is not an input of the SavedModel"),
        ('output [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]', "output 'x' is not an output"),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] }, { name: "ids" data_type: TYPE_INT32 dims: '
            "[ -1 ] } ]",
            "is TYPE_INT32, but the SavedModel's is TYPE_INT64",
        ),
        ('input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] } ]', "signature needs 1: ['x'] missing"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 0, 3 ] } ]', "each must be -1 (any size) or at least 1"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -2, 3 ] } ]', "each must be -1"),
        ('output [ { name: "y" data_type: TYPE_FP32 dims: [ 5, 2 ] } ]', "has dims [5, 2]"),  # outputs: exactly
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]', "has dims [3], which the SavedModel's"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]', "has dims [-1, 4]"),
        ('max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]', "after the batch dimension"),
        ('max_batch_size: 4 output [ { name: "total" data_type: TYPE_FP32 dims: [ ] } ]', "after the batch dimension"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape { shape: [ 3 ] } } ]', "reshape"),
    ],
)
def test_configs_that_do_not_describe_the_savedmodel_fail_the_load_naming_what_differs(text, words):
    with pytest.raises(LoadError) as e:
        v2_config.check_config("m", config(text), config(text).max_batch_size, SIG)
    assert e.value.message.startswith("model 'm': config.pbtxt: ") and words in e.value.message


def test_batching_needs_a_batch_dimension_on_every_input():
    fixed = Signature("serving_default", "", inputs={"x": spec("x:0", (2, 3))}, outputs={}, output_aliases=())
    with pytest.raises(LoadError, match=r"unknown 0th dimension .*x DT_FLOAT \[2,3\] do\(es\) not"):
        v2_config.check_config("m", config("max_batch_size: 4"), 4, fixed)
    v2_config.check_config("m", config("max_batch_size: 0"), 0, fixed)


def test_a_savedmodel_without_serving_default_takes_no_listed_tensors():
    v2_config.check_config("m", config("max_batch_size: 0"), 0, None)
    with pytest.raises(LoadError, match="no 'serving_default' signature"):
        v2_config.check_config("m", config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]'), 0, None)


def test_the_answer_is_the_file_completed_from_the_signature_with_numbers_as_numbers():
    text = """
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 250 }
        parameters { key: "k" value: { string_value: "v" } }
    """
    answer = v2_config.as_dict(v2_config.completed_config(config(text), "m", SIG))
    assert (answer["name"], answer["platform"], answer["backend"]) == ("m", "tensorflow_savedmodel", "tensorflow")
    assert answer["default_model_filename"] == "model.savedmodel"
    assert answer["version_policy"] == {"latest": {"num_versions": 1}}
    assert [(i["name"], i["data_type"], i["dims"]) for i in answer["input"]] == [
        ("x", "TYPE_FP32", [3]),  # as written
        ("ids", "TYPE_INT64", []),  # added: [None] less its batch dimension
    ]
    assert [(o["name"], o["dims"]) for o in answer["output"]] == [("y", [2]), ("total", [])]  # none listed: all
    assert answer["dynamic_batching"]["max_queue_delay_microseconds"] == 250  # int64: a number, not "250"
    assert answer["parameters"] == {"k": {"string_value": "v"}}
    listed = v2_config.completed_config(
        config('output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]'), "m", SIG
    )
    assert [o.name for o in listed.output] == ["y"]  # the file's outputs are the model's


BATCHING_SIG = Signature(
    "serving_default",
    "",
    inputs={"x": spec("x:0", (None, 3))},
    outputs={"y": spec("y:0", (None, 2))},
    output_aliases=("y",),
    output_names=("y:0",),
)


@pytest.mark.parametrize(
    ("text", "auto", "default", "expected"),
    [
        ("", True, 4, (4, True)),  # Triton's auto-complete: the SavedModel batches
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]', True, 4, (4, True)),  # dims leave the batch out
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]', True, 4, (0, False)),  # they do not
        ("", False, 4, (0, False)),  # --disable-auto-complete-config
        ("", True, 1, (1, False)),  # a default of 1: no dynamic batching
        ("", True, 0, (0, False)),
        ("max_batch_size: 2", True, 4, (2, False)),  # the file's own, no scheduler added
    ],
)
def test_auto_complete_fills_max_batch_size_as_triton_does(text, auto, default, expected):
    answer = v2_config.completed_config(config(text), "m", BATCHING_SIG, auto, default)
    assert (answer.max_batch_size, answer.HasField("dynamic_batching")) == expected
    assert v2_config.completed_config(config(""), "m", SIG, auto, default).max_batch_size == 0  # 'total' is a scalar


def test_the_listed_tensors_become_the_signature_s():
    model = Model()
    v2_config.narrow_signature(model, config("max_batch_size: 4"), 4)
    assert model.signatures["serving_default"] is SIG  # none listed: unchanged
    text = """
        max_batch_size: 4
        input [ { name: "ids" data_type: TYPE_INT64 dims: [ ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    v2_config.narrow_signature(model, config(text), 4)
    narrowed = model.signatures["serving_default"]
    assert (narrowed.output_aliases, narrowed.output_names, list(narrowed.outputs)) == (("y",), ("y:0",), ["y"])
    assert narrowed.outputs["y"].shape == (None, 2)
    assert narrowed.inputs["x"] is SIG.inputs["x"]  # not listed: as the SavedModel has it
    model = Model()
    v2_config.narrow_signature(model, config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 5, -1 ] } ]'), 0)
    narrowed = model.signatures["serving_default"]
    assert narrowed.inputs["x"].shape == (5, 3)  # the file's 5 where the SavedModel takes any, its own 3
    assert narrowed.output_aliases == SIG.output_aliases  # no output listed: all of them


def test_dynamic_batching_turns_batching_on_with_max_batch_size():
    assert v2_config.batching(config("max_batch_size: 8")) == NO_BATCHING  # not the server's automatic batching
    assert v2_config.batching(config("max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] }")) == (
        BatchingOptions(max_batch_size=8)
    )
