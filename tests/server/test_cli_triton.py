"""Triton's command line starts servex on a Triton model repository (server/config/triton_flags.py): Triton's ports and
defaults, its model control modes, TLS and log flags mapped onto servex's settings, the flags that change nothing
noted, and what cannot be honoured refused."""

from __future__ import annotations

import pytest

from servex.server.cli import parse_settings
from servex.server.config.triton_flags import NO_EFFECT_FLAGS


def settings(*argv: str):
    return parse_settings(["--model-repository=/models", *argv])


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_settings(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_repository_gets_tritons_ports_and_defaults():
    s, log_level, notes = settings()
    assert s.model_repositories == ("/models",)
    assert (s.port, s.rest_api_port, s.metrics_port) == (8001, 8000, 8002)
    assert s.model_control_mode == "none" and s.file_system_poll_wait_seconds == 0
    assert s.exit_on_error and s.strict_readiness
    assert s.drain_seconds == 30
    assert notes == ()


def test_without_a_repository_nothing_changes():
    s, _, _ = parse_settings([])
    assert (s.port, s.rest_api_port, s.metrics_port) == (8500, 8501, 8502)
    assert s.model_repositories == () and not s.exit_on_error and not s.strict_readiness
    assert s.file_system_poll_wait_seconds == 1.0 and s.drain_seconds == 20


def test_tritons_port_flags_and_tensorflow_servings():
    s, _, _ = settings("--grpc-port=9001", "--http-port", "9000", "--metrics-port=9002")
    assert (s.port, s.rest_api_port, s.metrics_port) == (9001, 9000, 9002)
    s, _, _ = settings("--port=7001", "--rest_api_port=7000")  # TensorFlow Serving's, where Triton's are not given
    assert (s.port, s.rest_api_port, s.metrics_port) == (7001, 7000, 8002)
    s, _, _ = settings("--port=7001", "--grpc-port=9001")
    assert s.port == 9001
    s, _, _ = settings("--allow-http=false", "--allow-metrics=false")
    assert (s.rest_api_port, s.metrics_port) == (0, 0)
    s, _, _ = settings("--grpc-address=127.0.0.1", "--http-address=127.0.0.1")
    assert s.bind_address == "127.0.0.1"


def test_several_repositories_and_the_old_spelling():
    s, _, _ = parse_settings(["--model-repository=/a", "--model-store=/b"])
    assert s.model_repositories == ("/a", "/b")


def test_model_control_modes():
    s, _, _ = settings("--model-control-mode=poll")
    assert s.model_control_mode == "poll" and s.file_system_poll_wait_seconds == 15
    s, _, _ = settings("--model-control-mode=poll", "--repository-poll-secs=2.5")
    assert s.file_system_poll_wait_seconds == 2.5
    s, _, _ = settings("--model-control-mode=EXPLICIT", "--load-model=a", "--load-model", "b")
    assert s.model_control_mode == "explicit" and s.load_models == ("a", "b")
    assert s.file_system_poll_wait_seconds == 0
    _, _, notes = settings("--repository-poll-secs=5")
    assert any("--repository-poll-secs has no effect without --model-control-mode=poll" in n for n in notes)
    s, _, notes = settings("--load-model=a")  # ignored outside explicit mode, as in Triton
    assert s.load_models == () and any("--load-model has no effect" in n for n in notes)


def test_the_repository_extension_can_be_restricted_as_in_triton():
    s, _, _ = settings("--grpc-restricted-protocol=model-repository:Admin-Key=s3cret",
                       "--http-restricted-api=model-repository:admin-key=other")  # fmt: skip
    assert s.repository_restrictions == {"grpc": ("admin-key", "s3cret"), "http": ("admin-key", "other")}
    assert settings()[0].repository_restrictions == {}


def test_auto_complete_settings_and_retries():
    s, _, _ = settings()
    assert s.triton_auto_complete and s.triton_default_max_batch_size == 4
    assert not settings("--disable-auto-complete-config")[0].triton_auto_complete
    assert not settings("--strict-model-config=true")[0].triton_auto_complete
    assert settings("--strict-model-config=false")[0].triton_auto_complete
    assert settings("--backend-config=tensorflow,default-max-batch-size=16")[0].triton_default_max_batch_size == 16
    assert settings("--backend-config=default-max-batch-size=0")[0].triton_default_max_batch_size == 0
    _, _, notes = settings("--backend-config=onnxruntime,enable-global-threadpool=1")
    assert any("--backend-config=onnxruntime,enable-global-threadpool=1 has no effect" in n for n in notes)
    assert settings("--model-load-retry-count=2")[0].max_num_load_retries == 2
    assert settings("--model-repository=/models")[0].model_repositories == ("/models",)  # a path twice is once


def test_exit_on_error_readiness_drain_and_logging():
    s, log_level, _ = settings("--exit-on-error=false", "--strict-readiness=false", "--exit-timeout-secs=5")
    assert not s.exit_on_error and not s.strict_readiness and s.drain_seconds == 5
    assert settings("--log-verbose=1")[1] == "debug"
    assert settings("--log-verbose=true")[1] == "debug"
    assert settings("--log-verbose=0")[1] == "INFO"
    assert settings("--log-info=false")[1] == "warning"
    assert settings("--log-info=false", "--log-warning=false")[1] == "error"
    assert settings("--drain_seconds=3")[0].drain_seconds == 3


def test_tritons_tls_flags_set_tls_from_pem_files(tmp_path):
    from tests.certificates import Authority

    ca = Authority()
    server = ca.server()
    (tmp_path / "tls.crt").write_text(server.cert)
    (tmp_path / "tls.key").write_text(server.key)
    (tmp_path / "ca.crt").write_text(ca.cert)
    pem = [f"--grpc-server-cert={tmp_path / 'tls.crt'}", f"--grpc-server-key={tmp_path / 'tls.key'}"]
    s, _, _ = settings("--grpc-use-ssl=true", *pem)
    assert s.grpc_tls is not None and s.grpc_tls.server_cert == server.cert and not s.grpc_tls.client_verify
    s, _, _ = settings("--grpc-use-ssl-mutual=true", *pem, f"--grpc-root-cert={tmp_path / 'ca.crt'}")
    assert s.grpc_tls is not None and s.grpc_tls.client_verify and s.grpc_tls.custom_ca == ca.cert
    s, _, _ = settings(*pem)  # the files alone, as in Triton: no TLS
    assert s.grpc_tls is None


def test_flags_that_change_nothing_are_noted_with_the_reason():
    argv = [f"--{flag}=x" for flag in NO_EFFECT_FLAGS]
    _, _, notes = settings(*argv)
    for flag, why in NO_EFFECT_FLAGS.items():
        assert f"--{flag}=x has no effect in servex: {why}" in notes
    _, _, notes = settings("--allow-gpu-metrics")  # a flag given without a value
    assert any(note.startswith("--allow-gpu-metrics=true has no effect") for note in notes)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--grpc-port=9001"], "--grpc-port: Triton's flags need --model-repository"),
        (["--model-repository=/m", "--model_base_path=/x"], "without --model_config_file and --model_base_path"),
        (["--model-repository=/m", "--model_config_file=/c"], "without --model_config_file and --model_base_path"),
        (["--model-repository=/m", "--enable_batching"], "batching is set per model by each config.pbtxt"),
        (["--model-repository=/m", "--allow-grpc=false"], "servex always serves gRPC"),
        (
            [
                "--model-repository=/m",
                "--model-control-mode=explicit",
                "--load-model=*",
                "--load-model=a",
            ],
            "--load-model=* loads every model: give it alone",
        ),
        (["--model-repository=/m", "--log-verbose=loud"], "expected an integer, true or false"),
        (
            ["--model-repository=/m", "--model-control-mode=explicit", "--serving_processes=2"],
            "explicit needs --serving_processes=1",
        ),
        (
            ["--model-repository=/m", "--grpc-restricted-protocol=inference,model-repository:k=v"],
            "restricts only the model-repository category; ['inference'] would be served open",
        ),
        (
            ["--model-repository=/m", "--http-restricted-api=model-repository"],
            "expected CATEGORY[,CATEGORY...]:KEY=VALUE",
        ),
        (["--model-repository=/m", "--backend-config=default-max-batch-size=x"], "must be an integer"),
        (["--model-repository=/m", "--model-control-mode=sometimes"], "invalid choice: 'sometimes'"),
        (["--model-repository=/m", "--model-control-mode=poll", "--repository-poll-secs=0"], "more than 0"),
        (["--model-repository=/m", "--grpc-address=a", "--http-address=b"], "binds every port to one address"),
        (["--model-repository=/m", "--grpc-use-ssl", "--ssl_config_file=/s"], "two ways to give one TLS"),
    ],
)
def test_what_cannot_be_honoured_is_refused(capsys, argv, words):
    assert words in refused(argv, capsys)
