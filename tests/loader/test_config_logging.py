"""A model's logging_config in a model config file (TensorFlow Serving's text format): its LoggingSpec, and the
errors that refuse a config, each naming the field."""

from __future__ import annotations

import math
import os

import pytest
from tensorflow_serving.config import logging_config_pb2, model_server_config_pb2

from servex.loader.config import LoggingSpec, parse_model_config, specs_from_proto
from servex.loader.errors import InvalidArgument


def config(logging: str) -> str:
    return f"model_config_list {{ config {{ name: 'm' base_path: '/models/m' logging_config {{ {logging} }} }} }}"


def collector(prefix, kind: str = "tfrecord") -> str:
    return f"log_collector_config {{ type: '{kind}' filename_prefix: '{prefix}' }}"


def invalid(text: str) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_model_config(text, "test config")
    assert info.value.message.startswith("test config: model_config_list.config[0] ('m'): logging_config")
    return info.value.message


def test_logging_config_becomes_the_models_logging_spec(tmp_path):
    text = config(f"{collector(tmp_path / 'requests')} sampling_config {{ sampling_rate: 0.25 attributes: 1 }}")
    (spec,) = parse_model_config(text)
    sampling = logging_config_pb2.SamplingConfig(sampling_rate=0.25, attributes=1)
    assert spec.logging == LoggingSpec(str(tmp_path / "requests"), 0.25, "tfrecord", sampling.SerializeToString())
    assert logging_config_pb2.SamplingConfig.FromString(spec.logging.sampling_config) == sampling


def test_no_logging_config_no_logging():
    (spec,) = parse_model_config("model_config_list { config { name: 'm' base_path: '/models/m' } }")
    assert spec.logging is None


def test_a_missing_sampling_config_samples_nothing(tmp_path):
    (spec,) = parse_model_config(config(collector(tmp_path / "requests")))
    assert spec.logging.sampling_rate == 0.0  # TensorFlow Serving's default: log nothing


def test_a_relative_prefix_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (spec,) = parse_model_config(config(collector("requests") + " sampling_config { sampling_rate: 1 }"))
    assert spec.logging.filename_prefix == os.path.join(str(tmp_path), "requests")


def test_the_same_logging_config_gives_equal_specs(tmp_path):
    # a reload of an unchanged logging_config keeps its logger: equal specs
    text = config(f"{collector(tmp_path / 'r')} sampling_config {{ sampling_rate: 0.5 }}")
    assert parse_model_config(text) == parse_model_config(text)
    other = config(f"{collector(tmp_path / 'r')} sampling_config {{ sampling_rate: 0.6 }}")
    assert parse_model_config(text) != parse_model_config(other)


def test_a_reload_request_parses_logging_config_too(tmp_path):
    request = model_server_config_pb2.ModelServerConfig()
    model = request.model_config_list.config.add(name="m", base_path="/models/m")
    model.logging_config.log_collector_config.type = "tfrecord"
    model.logging_config.log_collector_config.filename_prefix = str(tmp_path / "r")
    model.logging_config.sampling_config.sampling_rate = 1.0
    (spec,) = specs_from_proto(request, "ReloadConfigRequest.config", replacing=True)
    assert spec.logging.filename_prefix == str(tmp_path / "r") and spec.logging.sampling_rate == 1.0
    model.logging_config.log_collector_config.type = "kafka"
    with pytest.raises(InvalidArgument, match=r"ReloadConfigRequest.config: .*log_collector_config.type 'kafka'"):
        specs_from_proto(request, "ReloadConfigRequest.config", replacing=True)


# -- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["", "file", "TFRecord"])
def test_an_unknown_collector_type_is_refused(tmp_path, kind):
    message = invalid(config(collector(tmp_path / "r", kind)))
    assert f"log_collector_config.type {kind!r}" in message and "'tfrecord'" in message


def test_no_log_collector_config_is_refused():
    assert "log_collector_config.type ''" in invalid(config("sampling_config { sampling_rate: 1 }"))


def test_an_empty_filename_prefix_is_refused():
    assert "log_collector_config.filename_prefix is empty" in invalid(
        config("log_collector_config { type: 'tfrecord' }")
    )


def test_a_prefix_in_a_missing_directory_is_refused(tmp_path):
    message = invalid(config(collector(tmp_path / "missing" / "r")))
    assert "filename_prefix" in message and str(tmp_path / "missing") in message and "does not exist" in message


def test_a_prefix_that_names_a_directory_is_refused(tmp_path):
    message = invalid(config(collector(f"{tmp_path}/")))
    assert "names a directory" in message and str(tmp_path / "requests") in message
    assert "names a directory" in invalid(config(collector(tmp_path)))


def test_a_prefix_in_a_directory_no_one_may_write_is_refused():
    # procfs: no file can be made there, not even by root (who writes anywhere permissions alone forbid)
    assert "is not a directory servex can write to" in invalid(config(collector("/proc/self/r")))


@pytest.mark.parametrize("rate", [-0.1, 1.5, math.inf, math.nan])
def test_a_sampling_rate_outside_zero_to_one_is_refused(tmp_path, rate):
    text = config(f"{collector(tmp_path / 'r')} sampling_config {{ sampling_rate: {rate} }}")
    assert "sampling_config.sampling_rate" in invalid(text) and "outside [0, 1]" in invalid(text)


def test_per_task_sampling_configs_are_refused(tmp_path):
    text = config(
        f"{collector(tmp_path / 'r')} sampling_config {{ sampling_rate: 1 "
        "per_task_sampling_configs { dc: 'aa' sampling_rate: 0.5 } }"
    )
    assert "sampling_config.per_task_sampling_configs is not supported" in invalid(text)


def test_a_custom_logging_config_is_refused(tmp_path):
    text = config(
        f"{collector(tmp_path / 'r')} custom_logging_config {{ type_url: 'type.googleapis.com/x.Y' value: '' }}"
    )
    assert "logging_config.custom_logging_config is not supported" in invalid(text)
