"""Triton's trace settings (server/observability/trace_settings.py): --trace_config's syntax, the global and per
model settings the trace extension reads and changes, and the sampling by rate and count."""

from __future__ import annotations

import pytest

from servex.loader.errors import InvalidArgument, Unimplemented
from servex.server.observability.trace_settings import TraceConfig, TraceSettings, TraceValues, parse_trace_config


def test_trace_config_takes_tritons_global_and_mode_settings():
    config = parse_trace_config([
        "level=TIMESTAMPS", "rate=100", "count=5", "mode=opentelemetry", "triton,file=/tmp/t.json",
        "triton,log-frequency=50", "opentelemetry,url=collector:4317", "opentelemetry,resource=service.name=a=b",
        "opentelemetry,bsp_schedule_delay=200",
    ])  # fmt: skip
    assert config.values == TraceValues(level="TIMESTAMPS", rate=100, count=5, log_frequency=50)
    assert config.mode == "opentelemetry" and config.file == "/tmp/t.json"
    assert config.opentelemetry == {"url": "collector:4317", "bsp_schedule_delay": "200"}
    assert config.resource == {"service.name": "a=b"}
    assert parse_trace_config([]) == TraceConfig()  # off: level OFF, rate 1000, count -1


@pytest.mark.parametrize(
    "entry, says",
    [
        ("level", "expected [MODE,]SETTING=VALUE"),
        ("speed=3", "unknown global setting 'speed'"),
        ("mode=jaeger", "mode must be one of ['triton', 'opentelemetry']"),
        ("zipkin,url=x", "unknown mode 'zipkin'"),
        ("triton,url=x", "unknown triton setting 'url'"),
        ("opentelemetry,file=x", "unknown opentelemetry setting 'file'"),
        ("opentelemetry,resource=novalue", "expected opentelemetry,resource=KEY=VALUE"),
        ("opentelemetry,bsp_max_queue_size=0", "expected a positive integer"),
        ("rate=0", "out of range [ 1, 4294967295 ]"),
        ("rate=often", "Unable to parse 'trace_rate', got: often"),
        ("count=-2", "out of range [ -1, 2147483647 ]"),
        ("level=LOUD", "unknown trace_level ['LOUD']"),
    ],
)
def test_a_bad_trace_config_entry_is_named_with_what_is_accepted(entry, says):
    with pytest.raises(ValueError) as info:
        parse_trace_config([entry])
    assert says in str(info.value), str(info.value)


def test_settings_read_as_triton_answers_them_per_mode():
    triton = TraceSettings(parse_trace_config(["triton,file=/tmp/t.json"]))
    assert triton.read("") == {
        "trace_level": ["OFF"], "trace_rate": ["1000"], "trace_count": ["-1"], "log_frequency": ["0"],
        "trace_file": ["/tmp/t.json"], "trace_mode": ["triton"],
    }  # fmt: skip
    otel = TraceSettings(parse_trace_config(["mode=opentelemetry"]))
    assert otel.read("") == {"trace_level": ["OFF"], "trace_rate": ["1000"], "trace_count": ["-1"],
                             "trace_mode": ["opentelemetry"]}  # fmt: skip


def test_a_models_settings_fall_back_to_the_global_ones_until_set_and_again_once_cleared():
    settings = TraceSettings()
    settings.update("m", {"trace_rate": ["10"]})
    assert settings.read("m")["trace_rate"] == ["10"] and settings.read("")["trace_rate"] == ["1000"]
    settings.update("", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["7"]})
    assert settings.read("m")["trace_level"] == ["TIMESTAMPS"]  # not set on m: the global one of the moment
    assert settings.read("m")["trace_rate"] == ["10"]  # set on m: its own
    settings.update("m", {"trace_rate": []})  # cleared: the global one again
    assert settings.read("m")["trace_rate"] == ["7"]
    settings.update("", {"trace_rate": []})  # a cleared global setting: its start value
    assert settings.read("")["trace_rate"] == ["1000"]


@pytest.mark.parametrize(
    "changes, error, says",
    [
        ({"trace_file": ["/x"]}, Unimplemented, "trace file location can not be updated through network protocol"),
        ({"trace_mode": ["triton"]}, Unimplemented, "set it at start"),
        ({"trace_speed": ["1"]}, InvalidArgument, "unknown trace setting 'trace_speed'"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, InvalidArgument, "Expect only one trace level 'OFF' is specified"),
        ({"trace_level": ["TENSORS"]}, Unimplemented, "TENSORS is not supported"),
        ({"trace_rate": ["1", "2"]}, InvalidArgument, "expect only 1 value for 'trace_rate'"),
        ({"trace_count": ["-5"]}, InvalidArgument, "out of range [ -1, 2147483647 ]"),
        ({"log_frequency": ["x"]}, InvalidArgument, "Unable to parse 'log_frequency', got: x"),
    ],
)
def test_a_bad_change_is_refused_whole(changes, error, says):
    settings = TraceSettings()
    with pytest.raises(error) as info:
        settings.update("m", {"trace_level": ["TIMESTAMPS"], **changes})
    assert says in info.value.message
    assert settings.read("m")["trace_level"] == ["OFF"]  # nothing applied, not even the good part


def test_sampling_takes_one_request_in_rate_counts_down_and_stops_at_zero():
    settings = TraceSettings(parse_trace_config(["level=TIMESTAMPS", "rate=3", "count=2"]))
    taken = [settings.sample("m") for _ in range(9)]
    assert taken == [False, False, True, False, False, True, False, False, False]  # 2 traces, then none
    assert settings.read("")["trace_count"] == ["0"]


def test_a_sampled_caller_is_traced_whatever_the_rate_but_not_while_the_level_is_off():
    settings = TraceSettings(parse_trace_config(["level=TIMESTAMPS", "rate=1000"]))
    assert settings.sample("m", parent_sampled=True)
    assert not settings.sample("m")
    settings.update("", {"trace_level": ["OFF"]})
    assert not settings.sample("m", parent_sampled=True)


def test_a_model_with_its_own_rate_and_count_samples_on_its_own():
    settings = TraceSettings(parse_trace_config(["level=TIMESTAMPS", "rate=1000"]))
    settings.update("m", {"trace_rate": ["1"], "trace_count": ["1"]})
    assert settings.sample("m") and not settings.sample("m")  # its own count ran out
    assert settings.read("m")["trace_count"] == ["0"] and settings.read("")["trace_count"] == ["-1"]
    assert not settings.sample("other")  # the global rate of 1000
    settings.update("n", {"trace_level": ["OFF"]})
    assert settings.any_on()  # the global level is on
    settings.update("", {"trace_level": ["OFF"]})
    assert not settings.any_on()
