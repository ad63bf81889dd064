"""server/config/batching.py: TensorFlow Serving's BatchingParameters as it writes them."""

from __future__ import annotations

from servex.executor.batching import BatchingOptions
from servex.server.config.batching import parse_batching_parameters


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
    assert options == BatchingOptions(max_batch_size=8, allowed_batch_sizes=(4, 8), pad_variable_length_inputs=True)
    assert "pad_variable_length_inputs" not in caplog.text  # applied, not refused
    for field in ("batch_timeout_micros", "num_batch_threads", "max_enqueued_batches", "thread_pool_name",
                  "enable_large_batch_splitting", "max_execution_batch_size"):  # fmt: skip
        assert f"the file: {field} has no effect in servex: " in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="servex"):
        parse_batching_parameters("max_batch_size { value: 8 }\nallowed_batch_sizes: 8\n", "the file")
    assert caplog.text == ""  # what servex applies is not logged
    assert not parse_batching_parameters("pad_variable_length_inputs: false\n", "f").pad_variable_length_inputs
    assert not parse_batching_parameters("", "f").pad_variable_length_inputs
