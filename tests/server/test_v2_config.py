"""A Triton repository model's config.pbtxt against its SavedModel (server/v2_config.py): what a load checks, the
answer completed from the signature, the outputs it narrows the signature to, and its batching."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from executor.run_handler import BatchingOptions
from loader.errors import LoadError
from loader.saved_model import Signature, TensorSpec
from protos.inference import model_config_module
from server import v2_config

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
    v2_config.check_config("m", config(text), SIG)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('input [ { name: "z" data_type: TYPE_FP32 dims: [ 3 ] } ]', "input 'z' is not an input of the SavedModel"),
        ('output [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]', "output 'x' is not an output"),
        (
            'input [ { name: "ids" data_type: TYPE_INT32 dims: [ -1 ] } ]',
            "is TYPE_INT32, but the SavedModel's is TYPE_INT64",
        ),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]', "has dims [3], which the SavedModel's"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]', "has dims [-1, 4]"),
        ('max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]', "after the batch dimension"),
        ('max_batch_size: 4 output [ { name: "total" data_type: TYPE_FP32 dims: [ ] } ]', "after the batch dimension"),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape { shape: [ 3 ] } } ]', "reshape"),
    ],
)
def test_configs_that_do_not_fail_the_load_naming_what_differs(text, words):
    with pytest.raises(LoadError) as e:
        v2_config.check_config("m", config(text), SIG)
    assert e.value.message.startswith("model 'm': config.pbtxt: ") and words in e.value.message


def test_batching_needs_a_batch_dimension_on_every_input():
    fixed = Signature("serving_default", "", inputs={"x": spec("x:0", (2, 3))}, outputs={}, output_aliases=())
    with pytest.raises(LoadError, match=r"unknown 0th dimension .*x DT_FLOAT \[2,3\] do\(es\) not"):
        v2_config.check_config("m", config("max_batch_size: 4"), fixed)
    v2_config.check_config("m", config("max_batch_size: 0"), fixed)


def test_a_savedmodel_without_serving_default_takes_no_listed_tensors():
    v2_config.check_config("m", config("max_batch_size: 0"), None)
    with pytest.raises(LoadError, match="no 'serving_default' signature"):
        v2_config.check_config("m", config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]'), None)


def test_the_answer_is_the_file_completed_from_the_signature_with_numbers_as_numbers():
    text = """
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 250 }
        parameters { key: "k" value: { string_value: "v" } }
    """
    answer = v2_config.completed_config(config(text), "m", SIG)
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
    assert [o["name"] for o in listed["output"]] == ["y"]  # the file's outputs are the model's


def test_the_listed_tensors_become_the_signature_s():
    model = Model()
    v2_config.narrow_signature(model, config("max_batch_size: 4"))
    assert model.signatures["serving_default"] is SIG  # none listed: unchanged
    text = """
        max_batch_size: 4
        input [ { name: "ids" data_type: TYPE_INT64 dims: [ ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    v2_config.narrow_signature(model, config(text))
    narrowed = model.signatures["serving_default"]
    assert (narrowed.output_aliases, narrowed.output_names, list(narrowed.outputs)) == (("y",), ("y:0",), ["y"])
    assert narrowed.outputs["y"].shape == (None, 2)
    assert narrowed.inputs["x"] is SIG.inputs["x"]  # not listed: as the SavedModel has it
    model = Model()
    v2_config.narrow_signature(model, config('input [ { name: "x" data_type: TYPE_FP32 dims: [ 5, -1 ] } ]'))
    narrowed = model.signatures["serving_default"]
    assert narrowed.inputs["x"].shape == (5, 3)  # the file's 5 where the SavedModel takes any, its own 3
    assert narrowed.output_aliases == SIG.output_aliases  # no output listed: all of them


def test_dynamic_batching_turns_batching_on_with_max_batch_size():
    assert v2_config.batching(config("max_batch_size: 8")) is None
    assert v2_config.batching(config("max_batch_size: 8 dynamic_batching { preferred_batch_size: [4] }")) == (
        BatchingOptions(max_batch_size=8)
    )
