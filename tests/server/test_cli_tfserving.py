"""TensorFlow Serving's command line starts servex: every tensorflow_model_server flag is taken. Those servex
implements set their settings; those that change nothing here are noted (logged at start) with the reason; the one
asking for ALTS is refused rather than served in plaintext."""

from __future__ import annotations

import pytest

from servex.executor.run_handler import BatchingOptions
from servex.server.cli import parse_settings
from servex.server.config.settings import ServerSettings
from servex.server.config.tfserving_flags import DEFAULT_PROMETHEUS_PATH, NO_EFFECT_FLAGS, REFUSED_FLAGS
from servex.server.cores import usable_cores

# A tensorflow_model_server command line using every flag of TensorFlow Serving's main.cc (2.x) that servex does
# not implement itself, with the values such lines carry.
TFS_ONLY = [
    "--rest_api_num_threads=8",
    "--allow_version_labels_for_unavailable_models",
    "--num_load_threads=4",
    "--num_unload_threads=2",
    "--flush_filesystem_caches=false",
    "--grpc_max_threads=16",
    "--remove_unused_fields_from_bundle_metagraph=true",
    "--prefer_tflite_model=false",
    "--use_tflite_model=false",
    "--num_tflite_pools=2",
    "--num_tflite_interpreters_per_pool=1",
    "--enable_signature_method_name_check=false",
    "--xla_cpu_compilation_enabled=false",
    "--xla_gpu_compilation_enabled=false",
    "--thread_pool_factory_config_file=/etc/pools.config",
    "--mixed_precision=bfloat16",
    "--skip_initialize_tpu=true",
    "--enable_grpc_healthcheck_service=true",
    "--use_alts_credentials=false",
]


def test_every_tensorflow_serving_only_flag_is_taken_and_noted_with_its_reason():
    parsed = parse_settings(["--model_base_path=/models/m", *TFS_ONLY])
    assert parsed.settings.model_base_path == "/models/m"
    noted = {note.split("=")[0] for note in parsed.notes}
    assert noted == {f"--{flag}" for flag in NO_EFFECT_FLAGS}
    assert "--rest_api_num_threads=8 has no effect in servex: REST is served by the event loop" in parsed.notes[0]
    assert set(NO_EFFECT_FLAGS) | set(REFUSED_FLAGS) == {f.split("=")[0][2:] for f in TFS_ONLY}


def test_enable_profiler_is_taken_and_is_on_by_default():
    """TensorFlow Serving's --enable_profiler (default true) serves tensorflow.ProfilerService in servex too."""
    assert parse_settings([]).settings.enable_profiler is True
    assert parse_settings(["--enable_profiler=false"]).settings.enable_profiler is False
    assert not [note for note in parse_settings(["--enable_profiler=true"]).notes if "enable_profiler" in note]


def test_pem_file_flags_are_the_other_way_to_give_tls(tmp_path, capsys):
    from tests.certificates import Authority, ssl_config

    authority = Authority()
    server = authority.server()
    for name, text in (("tls.crt", server.cert), ("tls.key", server.key), ("ca.crt", authority.cert)):
        (tmp_path / name).write_text(text)
    (tmp_path / "ssl.config").write_text(ssl_config(server))
    pem = [f"--ssl_server_cert_file={tmp_path / 'tls.crt'}", f"--ssl_server_key_file={tmp_path / 'tls.key'}"]
    tls = parse_settings([*pem, f"--ssl_custom_ca_file={tmp_path / 'ca.crt'}", "--ssl_client_verify"]).settings.grpc_tls
    assert (tls.server_key, tls.server_cert, tls.custom_ca, tls.client_verify) == (
        server.key,
        server.cert,
        authority.cert,
        True,
    )
    for argv, message in [
        ([*pem, f"--ssl_config_file={tmp_path / 'ssl.config'}"], "are two ways to give one TLS configuration"),
        (["--ssl_client_verify", f"--ssl_config_file={tmp_path / 'ssl.config'}"], "give one of them"),
        (pem[:1], "needs both --ssl_server_cert_file and --ssl_server_key_file"),
        ([*pem, "--ssl_client_verify"], "client_verify is true but --ssl_custom_ca_file ('') is empty"),
    ]:
        with pytest.raises(SystemExit) as info:
            parse_settings(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_grpc_socket_path_and_its_length(capsys):
    assert parse_settings([]).settings.grpc_socket_path == ""
    assert parse_settings(["--grpc_socket_path=/run/tfs.sock"]).settings.grpc_socket_path == "/run/tfs.sock"
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--grpc_socket_path=/run/{'s' * 104}"])
    assert info.value.code == 2
    assert "--grpc_socket_path is 109 bytes long: a UNIX socket's path takes at most 107" in capsys.readouterr().err


def test_alts_is_refused_rather_than_served_in_plaintext(capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(["--use_alts_credentials"])
    assert info.value.code == 2
    assert "without ALTS" in capsys.readouterr().err


def test_ssl_config_file_turns_tls_on_for_the_grpc_ports(tmp_path, capsys):
    from tests.certificates import Authority, ssl_config

    authority = Authority()
    server = authority.server()
    path = tmp_path / "ssl.config"
    path.write_text(ssl_config(server, authority.cert, client_verify=True))
    tls = parse_settings([f"--ssl_config_file={path}"]).settings.grpc_tls
    assert (tls.server_key, tls.server_cert, tls.custom_ca, tls.client_verify) == (
        server.key,
        server.cert,
        authority.cert,
        True,
    )
    assert parse_settings([]).settings.grpc_tls is None
    path.write_text("server_key: 'x'")
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--ssl_config_file={path}"])
    assert info.value.code == 2
    assert f"--ssl_config_file: {str(path)!r}: server_cert is empty" in capsys.readouterr().err


def test_an_unknown_flag_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(["--no_such_flag=1"])
    assert info.value.code == 2 and "--no_such_flag" in capsys.readouterr().err


def test_tensorflow_serving_spellings_of_servex_settings():
    settings = parse_settings(
        ["--enable_per_model_batching_parameters", "--enable_serialization_as_tensor_content=true"]
    ).settings
    assert settings.enable_per_model_batching_params and settings.tensor_content_outputs
    settings = parse_settings(["--enable_per_model_batching_params=true", "--tensor_content_outputs"]).settings
    assert settings.enable_per_model_batching_params and settings.tensor_content_outputs
    assert not parse_settings([]).settings.tensor_content_outputs


def test_model_config_file_wins_over_model_name_and_base_path_as_in_tensorflow_serving():
    parsed = parse_settings(["--model_config_file=/etc/models.config", "--model_name=m", "--model_base_path=/m"])
    assert parsed.settings.model_config_file == "/etc/models.config"
    assert parsed.settings.model_base_path == ""
    assert any("--model_name and --model_base_path are ignored" in note for note in parsed.notes)


def test_thread_pools_from_their_flags_session_parallelism_or_servex_defaults():
    d = ServerSettings()
    settings = parse_settings([]).settings
    assert (settings.tensorflow_intra_op_parallelism, settings.tensorflow_inter_op_parallelism) == (
        d.tensorflow_intra_op_parallelism,
        d.tensorflow_inter_op_parallelism,
    )
    settings = parse_settings(["--tensorflow_session_parallelism=6"]).settings
    assert (settings.tensorflow_intra_op_parallelism, settings.tensorflow_inter_op_parallelism) == (6, 6)
    settings = parse_settings(["--tensorflow_session_parallelism=6", "--tensorflow_intra_op_parallelism=2"]).settings
    assert (settings.tensorflow_intra_op_parallelism, settings.tensorflow_inter_op_parallelism) == (2, 6)
    settings = parse_settings(["--tensorflow_inter_op_parallelism=0"]).settings
    assert settings.tensorflow_inter_op_parallelism == 0


def test_session_config_file_is_the_base_and_given_flags_apply_over_it(tmp_path):
    import tensorflow as tf

    from servex.server.app import session_config

    path = tmp_path / "session.config"
    path.write_text(
        "intra_op_parallelism_threads: 3 inter_op_parallelism_threads: 5 "
        "gpu_options { allow_growth: true per_process_gpu_memory_fraction: 0.25 } log_device_placement: false"
    )
    settings = parse_settings([f"--tensorflow_session_config_file={path}"]).settings
    config = session_config(settings)
    assert isinstance(config, tf.compat.v1.ConfigProto)
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (3, 5)
    assert config.gpu_options.allow_growth and config.gpu_options.per_process_gpu_memory_fraction == 0.25
    assert config.allow_soft_placement  # servex's own
    settings = parse_settings(
        [
            f"--tensorflow_session_config_file={path}",
            "--tensorflow_intra_op_parallelism=1",
            "--per_process_gpu_memory_fraction=0.5",
        ]
    ).settings
    config = session_config(settings)
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (1, 5)
    assert config.gpu_options.allow_growth and config.gpu_options.per_process_gpu_memory_fraction == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "cannot read"), ("intra_op_parallelism_threads: 'many'", "is not a TensorFlow ConfigProto in text")],
)
def test_a_session_config_file_that_cannot_be_used_is_refused(tmp_path, text, message, capsys):
    path = tmp_path / "session.config"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--tensorflow_session_config_file={path}"])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_saved_model_tags_and_grpc_channel_arguments(capsys):
    settings = parse_settings([]).settings
    assert settings.saved_model_tags == ("serve",) and settings.grpc_channel_arguments == ()
    settings = parse_settings(
        [
            "--saved_model_tags=serve, gpu",
            "--grpc_channel_arguments=grpc.max_connection_age_ms=2000,a.b=text,grpc.big=99999999999",
        ]
    ).settings
    assert settings.saved_model_tags == ("serve", "gpu")
    assert settings.grpc_channel_arguments == (
        ("grpc.max_connection_age_ms", 2000),
        ("a.b", "text"),
        ("grpc.big", "99999999999"),  # past a C int: a string, as TensorFlow Serving passes it
    )
    # gRPC's message size limits are --max_message_bytes's: taken, with a note, so the command line starts
    parsed = parse_settings(["--grpc_channel_arguments=grpc.max_receive_message_length=104857600,grpc.x=1"])
    assert parsed.settings.grpc_channel_arguments == (("grpc.x", 1),)
    assert any("grpc.max_receive_message_length=104857600 has no effect" in note for note in parsed.notes)
    for bad, message in [
        ("--grpc_channel_arguments=grpc.keepalive_time_ms", "expects key=value"),
        ("--saved_model_tags=,", "names no tag"),
        ("--per_process_gpu_memory_fraction=1.5", "must be from 0 to 1"),
    ]:
        with pytest.raises(SystemExit):
            parse_settings([bad])
        assert message in capsys.readouterr().err


def test_monitoring_config_file_serves_prometheus_on_the_rest_port(tmp_path, capsys):
    path = tmp_path / "monitoring.config"
    path.write_text('prometheus_config { enable: true path: "/monitoring/prometheus/metrics" }')
    assert parse_settings([f"--monitoring_config_file={path}"]).settings.prometheus_rest_path == (
        "/monitoring/prometheus/metrics"
    )
    path.write_text("prometheus_config { enable: true }")
    assert parse_settings([f"--monitoring_config_file={path}"]).settings.prometheus_rest_path == (
        DEFAULT_PROMETHEUS_PATH
    )
    path.write_text('prometheus_config { enable: false path: "/m" }')
    assert parse_settings([f"--monitoring_config_file={path}"]).settings.prometheus_rest_path == ""
    path.write_text("prometheus_config { enable: true }")
    parsed = parse_settings([f"--monitoring_config_file={path}", "--rest_api_port=0"])
    assert parsed.settings.prometheus_rest_path == ""
    assert any("the REST port is off" in note for note in parsed.notes)
    path.write_text('prometheus_config { enable: true path: "metrics" }')
    with pytest.raises(SystemExit):
        parse_settings([f"--monitoring_config_file={path}"])
    assert "must start with '/'" in capsys.readouterr().err


def test_tensorflow_serving_s_own_monitoring_config_file_is_read():
    from tests.conftest import EXPECTED

    settings = parse_settings([f"--monitoring_config_file={EXPECTED / 'monitoring_config.txt'}"]).settings
    assert settings.prometheus_rest_path == "/monitoring/prometheus/metrics"


def test_version_prints_servex_and_tensorflow_versions(capsys):
    import tensorflow as tf

    with pytest.raises(SystemExit) as info:
        parse_settings(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("servex ") and f"TensorFlow Library: {tf.__version__}" in out


def platform_config(tmp_path, legacy_config: str, platform: str = "tensorflow", extra: str = "") -> str:
    """A TensorFlow Serving platform config file (as its docs write them) whose platform holds this
    SessionBundleConfig text; its path."""
    path = tmp_path / "platform.config"
    path.write_text(
        f"""platform_configs {{
  key: "{platform}"
  value {{
    source_adapter_config {{
      [type.googleapis.com/tensorflow.serving.SavedModelBundleSourceAdapterConfig] {{
        legacy_config {{ {legacy_config} }}
      }}
    }}
  }}
}}
{extra}"""
    )
    return str(path)


def test_platform_config_file_replaces_the_session_bundle_flags_as_in_tensorflow_serving(tmp_path):
    from servex.server.app import session_config
    from servex.server.config.batching import batching_options

    path = platform_config(
        tmp_path,
        """session_config { intra_op_parallelism_threads: 3 gpu_options { allow_growth: true } }
           batching_parameters { max_batch_size { value: 4 } allowed_batch_sizes: [2, 4] }
           saved_model_tags: "serve" saved_model_tags: "gpu"
           enable_model_warmup: true model_warmup_options { num_request_iterations { value: 3 } }
           enable_per_model_batching_params: true""",
    )
    # The flags the file replaces, given with other values: TensorFlow Serving ignores them; servex says so.
    replaced = ["--enable_batching=false", "--tensorflow_intra_op_parallelism=7", "--saved_model_tags=other",
                "--num_request_iterations_for_warmup=5", "--per_process_gpu_memory_fraction=0.5"]  # fmt: skip
    parsed = parse_settings([f"--platform_config_file={path}", *replaced])
    settings = parsed.settings
    assert settings.enable_batching and settings.enable_per_model_batching_params
    assert batching_options(settings) == BatchingOptions(max_batch_size=4, allowed_batch_sizes=(2, 4))
    assert settings.saved_model_tags == ("serve", "gpu")
    assert settings.enable_model_warmup and settings.num_request_iterations_for_warmup == 3
    config = session_config(settings)
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (3, usable_cores())
    assert config.gpu_options.allow_growth and config.gpu_options.per_process_gpu_memory_fraction == 0
    ignored = [n.split(" ")[0] for n in parsed.notes if "is ignored: --platform_config_file" in n]
    assert ignored == [flag.split("=")[0] for flag in sorted(replaced, key=_session_bundle_order)]
    assert "(as in TensorFlow Serving)" in parsed.notes[0]


def _session_bundle_order(flag: str) -> int:
    from servex.server.config.tfserving_flags import SESSION_BUNDLE_FLAGS

    return SESSION_BUNDLE_FLAGS.index(flag.split("=")[0][2:])


def test_the_platform_config_s_tags_are_taken_as_written_and_replaced_flags_not_checked(tmp_path):
    path = platform_config(tmp_path, 'saved_model_tags: "serve,gpu" saved_model_tags: "tpu"')
    parsed = parse_settings([f"--platform_config_file={path}", "--num_request_iterations_for_warmup=0"])
    assert parsed.settings.saved_model_tags == ("serve,gpu", "tpu")  # not split at the comma
    assert "--num_request_iterations_for_warmup is ignored" in parsed.notes[0]


def test_a_platform_config_without_batching_or_warmup_turns_both_off(tmp_path):
    """As in TensorFlow Serving: batching only with batching_parameters (even empty), warm-up only with
    enable_model_warmup, tags "serve" where none are named; pools left at 0 take servex's defaults."""
    from servex.server.config.batching import batching_options

    d = ServerSettings()
    settings = parse_settings([f"--platform_config_file={platform_config(tmp_path, '')}", "--enable_batching"]).settings
    assert not settings.enable_batching and batching_options(settings) is None
    assert not settings.enable_model_warmup and settings.saved_model_tags == ("serve",)
    assert (settings.tensorflow_intra_op_parallelism, settings.tensorflow_inter_op_parallelism) == (
        d.tensorflow_intra_op_parallelism,
        d.tensorflow_inter_op_parallelism,
    )
    path = platform_config(tmp_path, "batching_parameters { }")
    settings = parse_settings([f"--platform_config_file={path}"]).settings
    assert settings.enable_batching and batching_options(settings) == BatchingOptions()


def test_platform_config_fields_and_platforms_without_effect_are_noted(tmp_path):
    other = 'platform_configs { key: "tflite" value { } }'
    path = platform_config(
        tmp_path,
        "prefer_tflite_model: true remove_unused_fields_from_bundle_metagraph: true "
        "model_warmup_options { num_model_warmup_threads { value: 4 } }",
        extra=other,
    )
    notes = parse_settings([f"--platform_config_file={path}"]).notes
    where = f"--platform_config_file {path!r}"
    assert notes == (
        f"{where}: platform 'tflite' has no effect in servex: it serves the 'tensorflow' platform only",
        f"{where}: remove_unused_fields_from_bundle_metagraph has no effect in servex: servex keeps no MetaGraphDef "
        "once a version is loaded",
        f"{where}: prefer_tflite_model has no effect in servex: servex serves no TensorFlow Lite models",
        f"{where}: model_warmup_options.num_model_warmup_threads has no effect in servex: a version's warm-up "
        "records replay one after another",
    )


ADAPTER = "[type.googleapis.com/tensorflow.serving.SavedModelBundleSourceAdapterConfig]"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "--platform_config_file: cannot read"),
        ("platform_configs { key: 'tensorflow' value { nope: 1 } }", "is not a PlatformConfigMap in text format"),
        ('platform_configs { key: "tflite" value { } }', "has no 'tensorflow' platform, the one servex serves "
         "(platform_configs has ['tflite'])"),
        ('platform_configs { key: "tensorflow" value { source_adapter_config { '
         "[type.googleapis.com/tensorflow.serving.TfrtSavedModelSourceAdapterConfig] { } } } }",
         "TfrtSavedModelSourceAdapterConfig not found in descriptor pool; servex reads the 'tensorflow' platform's "
         "tensorflow.serving.SavedModelBundleSourceAdapterConfig"),
        ('platform_configs { key: "tensorflow" value { } }',
         f"source_adapter_config holds 'nothing'; expected {ADAPTER} {{ legacy_config {{ ... }} }}"),
        ('platform_configs { key: "tensorflow" value { source_adapter_config { '
         'type_url: "type.googleapis.com/tensorflow.serving.SavedModelBundleSourceAdapterConfig" value: "\\377" '
         "} } }", "SavedModelBundleSourceAdapterConfig cannot be decoded"),
        ('session_target: "grpc://elsewhere:2222"', "session_target 'grpc://elsewhere:2222' is not supported"),
        ('experimental_fixed_input_tensors { name: "x" }', "experimental_fixed_input_tensors is not supported"),
        ("model_warmup_options { num_request_iterations { value: 0 } }",
         "model_warmup_options.num_request_iterations must be at least 1, got 0"),
        ('saved_model_tags: "serve" saved_model_tags: ""', "saved_model_tags has an empty tag: ['serve', '']"),
    ],
)  # fmt: skip
def test_a_platform_config_that_cannot_be_used_is_refused_naming_what_and_why(tmp_path, text, message, capsys):
    if text is None:
        path = str(tmp_path / "missing.config")
    elif text.startswith("platform_configs"):
        path = tmp_path / "platform.config"
        path.write_text(text)
    else:
        path = platform_config(tmp_path, text)
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--platform_config_file={path}"])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_bad_batching_parameters_in_a_platform_config_fail_the_start_naming_the_file(tmp_path):
    from servex.loader.errors import InvalidArgument
    from servex.server.config.batching import batching_options

    path = platform_config(tmp_path, "batching_parameters { max_batch_size { value: 4 } allowed_batch_sizes: 8 }")
    settings = parse_settings([f"--platform_config_file={path}"]).settings
    with pytest.raises(InvalidArgument) as info:
        batching_options(settings)
    assert str(info.value) == (
        f"the batching_parameters of platform config file {path!r}: allowed_batch_sizes [8] must increase and end "
        "with max_batch_size 4"
    )
