"""server/app.py: batching parameters as TensorFlow Serving writes them, per-model ones read from the version folder,
and the start-up heap freeze."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest

from executor.run_handler import BatchingOptions
from loader.config import ModelSpec
from loader.manager import END
from server.app import PER_MODEL_BATCHING_FILE, make_manager, parse_batching_parameters, settle_heap
from server.settings import ServerSettings
from tests.conftest import HALF_PLUS_TWO_TF1


@pytest.fixture
def base(tmp_path):
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", tmp_path / "m" / "1")
    return tmp_path / "m"


def _load(base, **settings):
    manager = make_manager(ServerSettings(**settings))
    problems = manager.apply_config([ModelSpec("m", str(base))])
    return manager, problems


def test_a_version_s_batching_params_file_is_its_batching(base):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\nallowed_batch_sizes: [2, 4]\n")
    manager, problems = _load(base, enable_batching=True, enable_per_model_batching_params=True)
    try:
        assert problems == []
        assert manager.get("m").servable.batching == BatchingOptions(max_batch_size=4, allowed_batch_sizes=(2, 4))
    finally:
        manager.unload_all()


@pytest.mark.parametrize("flags", [{"enable_batching": True}, {"enable_per_model_batching_params": True}])
def test_the_file_is_read_only_with_both_flags(base, flags):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\n")
    manager, problems = _load(base, **flags)
    try:
        assert problems == [] and manager.get("m").servable.batching is None
    finally:
        manager.unload_all()


def test_a_bad_batching_params_file_fails_the_load_naming_it(base):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\nallowed_batch_sizes: [2, 3]\n")
    manager, problems = _load(base, enable_batching=True, enable_per_model_batching_params=True)
    try:
        assert len(problems) == 1
        assert PER_MODEL_BATCHING_FILE in problems[0] and "must increase and end with max_batch_size 4" in problems[0]
        assert [sv.state for sv in manager.statuses("m")] == [END]
    finally:
        manager.unload_all()


def test_batching_parameters_in_tensorflow_serving_s_own_spelling_of_every_field(caplog):
    """Every field of TensorFlow Serving's BatchingParameters, typed as it types them (pad_variable_length_inputs a
    plain bool, enable_large_batch_splitting and the sizes wrapped), as its tests and docs write them."""
    text = """max_batch_size { value: 8 }
batch_timeout_micros { value: 1000 }
max_enqueued_batches { value: 100 }
num_batch_threads { value: 4 }
thread_pool_name { value: "model_server_batch_threads" }
allowed_batch_sizes: 4
allowed_batch_sizes: 8
pad_variable_length_inputs: true
enable_large_batch_splitting { value: true }
max_execution_batch_size { value: 4 }
"""
    with caplog.at_level("WARNING", logger="servex"):
        options = parse_batching_parameters(text, "the file")
    assert options == BatchingOptions(max_batch_size=8, allowed_batch_sizes=(4, 8))
    assert "the file: pad_variable_length_inputs is not supported" in caplog.text
    caplog.clear()
    parse_batching_parameters("max_batch_size { value: 8 }\npad_variable_length_inputs: false\n", "the file")
    assert "pad_variable_length_inputs" not in caplog.text


class _Node:
    pass


def test_settle_heap_collects_start_up_garbage_then_freezes_what_survives():
    survivor = _Node()
    survivor.me = survivor  # a cycle, as TensorFlow's graphs are full of
    garbage = _Node()
    garbage.me = garbage
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = settle_heap()
        assert gone() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is survivor for o in gc.get_objects())  # out of every generation the collector scans
    finally:
        gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())
