"""Triton's log and trace settings (server/protocols/kserve/v2_settings.py) through the real daemon, with tritonclient
over gRPC and
REST."""

from __future__ import annotations

import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import HALF_PLUS_TWO_TF1


def test_log_settings_read_and_change_what_servex_logs_over_grpc_and_rest(start_daemon, tmp_path):
    """Triton's log settings: tritonclient reads them, and switching INFO off leaves the next model load unlogged
    while errors still are; over REST too. Tracing is off, and asking for tensors in traces says servex does not
    trace them."""
    import tritonclient.http as triton_http
    from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc
    from tensorflow_serving.config import model_server_config_pb2

    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=first", rest=True)
    client = triton.InferenceServerClient(daemon.address)
    rest = triton_http.InferenceServerClient(daemon.rest_url.removeprefix("http://"))
    start = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
             "log_format": "default"}  # fmt: skip
    assert client.get_log_settings(as_json=True)["settings"] == {
        "log_file": {"string_param": ""}, "log_info": {"bool_param": True}, "log_warning": {"bool_param": True},
        "log_error": {"bool_param": True}, "log_verbose_level": {"uint32_param": 0},
        "log_format": {"string_param": "default"},
    }  # fmt: skip
    assert rest.get_log_settings() == start

    def load(*names):
        config = model_server_config_pb2.ModelServerConfig()
        for name in names:
            config.model_config_list.config.add(name=name, base_path=str(HALF_PLUS_TWO_TF1))
        stub = model_service_pb2_grpc.ModelServiceStub(daemon.channel)
        stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60)

    client.update_log_settings({"log_info": False})
    load("first", "quiet")
    assert rest.update_log_settings({"log_info": True}) == start
    load("first", "quiet", "loud")
    log = daemon.log()
    assert "model 'loud' version 123: loading from" in log and "model 'quiet' version 123: loading from" not in log
    assert "log settings changed: log_info=True" in log
    # what cannot be set says why, and changes nothing
    for settings, words in (({"log_file": "/tmp/x"}, "standard error only"), ({"log_info": 1}, "must be a boolean"),
                            ({"log_level": True}, "unknown log setting(s) ['log_level']")):  # fmt: skip
        with pytest.raises(InferenceServerException) as info:
            rest.update_log_settings(settings)
        assert words in info.value.message()
    assert rest.get_log_settings() == start
    # tracing: off by default (tests/integration/test_tracing.py turns it on)
    assert client.get_trace_settings(as_json=True)["settings"]["trace_level"] == {"value": ["OFF"]}
    assert rest.get_trace_settings(model_name="first")["trace_level"] == ["OFF"]
    with pytest.raises(InferenceServerException) as info:
        client.update_trace_settings(settings={"trace_level": ["TENSORS"]})
    assert info.value.status() == "StatusCode.UNIMPLEMENTED" and "TENSORS is not supported" in info.value.message()
    client.close()
    rest.close()
