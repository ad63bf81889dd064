"""TensorFlow Serving's command line where it goes beyond servex's own flags: TensorFlow Serving's flags that servex
takes but that change nothing here (each one given is noted, with the reason), those it refuses, and the reading of
the files and lists its other flags name (a session ConfigProto, a platform config, a MonitoringConfig, gRPC channel
arguments).
server/config/flags.py builds the parser (these flags are OTHER_FLAGS), server/cli.py the settings; this module keeps
TensorFlow Serving's side of it apart.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from google.protobuf import text_format

from servex.server.config.flagspec import TFSERVING_OTHER, Flag

DEFAULT_PROMETHEUS_PATH = "/monitoring/prometheus/metrics"  # TensorFlow Serving's


# TensorFlow Serving's flags that servex takes, so that a tensorflow_model_server command line starts it, but that
# change nothing here; each one given is logged at start with the reason.
NO_EFFECT_FLAGS = {
    "rest_api_num_threads": "REST is served by the event loop; runs go to the run workers (--num_run_workers)",
    "allow_version_labels_for_unavailable_models": "servex always accepts a new label on a version that is not "
    "available, and says so (moving a label to one is refused, as in TensorFlow Serving)",
    "num_load_threads": "versions load one at a time, off the request path",
    "num_unload_threads": "versions unload off the request path, once their in-flight calls end",
    "flush_filesystem_caches": "servex does not flush file system caches",
    "grpc_max_threads": "gRPC is served by asyncio listeners (--grpc_listeners)",
    "remove_unused_fields_from_bundle_metagraph": "servex keeps no MetaGraphDef once a version is loaded",
    "prefer_tflite_model": "servex serves no TensorFlow Lite models",
    "use_tflite_model": "servex serves no TensorFlow Lite models",
    "num_tflite_pools": "servex serves no TensorFlow Lite models",
    "num_tflite_interpreters_per_pool": "servex serves no TensorFlow Lite models",
    "enable_signature_method_name_check": "servex checks a signature by its inputs and outputs (TensorFlow "
    "Serving's default)",
    "xla_cpu_compilation_enabled": "servex leaves XLA as TensorFlow configures it",
    "xla_gpu_compilation_enabled": "servex leaves XLA as TensorFlow configures it",
    "thread_pool_factory_config_file": "runs use the run workers (--num_run_workers) and TensorFlow's pools",
    "mixed_precision": "servex runs graphs as they were exported",
    "skip_initialize_tpu": "servex does not use TPUs",
    "enable_grpc_healthcheck_service": "servex always serves grpc.health.v1.Health",
}
# TensorFlow Serving's flags servex refuses: serving plaintext where ALTS was asked for would be worse than not
# starting.
REFUSED_FLAGS = {
    "use_alts_credentials": "servex serves gRPC without ALTS; terminate it in front of servex",
}


# Their declarations (server/config/flagspec.py): each takes a value, or none (then "true").
OTHER_FLAGS = tuple(
    Flag(name, why, TFSERVING_OTHER, const="true", default=None, metavar="VALUE", tfserving=True)
    for name, why in NO_EFFECT_FLAGS.items()
) + tuple(
    Flag(name, f"refused: {why}", TFSERVING_OTHER, const="true", default=None, metavar="VALUE", tfserving=True)
    for name, why in REFUSED_FLAGS.items()
)


def check_other_flags(args: argparse.Namespace, fail) -> list[str]:
    """``fail`` for a refused flag given; the notes (to log at start) for each flag given that changes nothing."""
    for flag, why in REFUSED_FLAGS.items():
        if _given(getattr(args, flag)):
            fail(f"--{flag}: {why}")
    notes = []
    for flag, why in NO_EFFECT_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            notes.append(f"--{flag}={value} has no effect in servex: {why}")
    return notes


def _given(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def session_config(path: str, fail) -> object:
    """The ConfigProto of --tensorflow_session_config_file (TensorFlow is imported only when it is given)."""
    from tensorflow.core.protobuf import config_pb2

    try:
        return text_format.Parse(Path(path).read_text(encoding="utf-8"), config_pb2.ConfigProto())
    except OSError as e:
        fail(f"--tensorflow_session_config_file: cannot read {path!r}: {e.strerror}")
    except text_format.ParseError as e:
        fail(f"--tensorflow_session_config_file: {path!r} is not a TensorFlow ConfigProto in text format: {e}")


# The flags TensorFlow Serving builds its SessionBundleConfig from when no --platform_config_file is given (its
# server.cc); with one, the file's SessionBundleConfig replaces them all, and each one given is noted as ignored.
SESSION_BUNDLE_FLAGS = (
    "enable_batching",
    "batching_parameters_file",
    "enable_per_model_batching_parameters",
    "tensorflow_session_parallelism",
    "tensorflow_intra_op_parallelism",
    "tensorflow_inter_op_parallelism",
    "tensorflow_session_config_file",
    "per_process_gpu_memory_fraction",
    "saved_model_tags",
    "enable_model_warmup",
    "num_request_iterations_for_warmup",
)
TENSORFLOW_PLATFORM = "tensorflow"  # TensorFlow Serving's kTensorFlowModelPlatform
ADAPTER_CONFIG = "tensorflow.serving.SavedModelBundleSourceAdapterConfig"
_TFLITE = NO_EFFECT_FLAGS["prefer_tflite_model"]
# SessionBundleConfig's fields that servex reads but that change nothing here, each one set noted with the reason.
SESSION_BUNDLE_NO_EFFECT = {
    "session_run_load_threadpool_index": "versions load on servex's own loading thread",
    "experimental_transient_ram_bytes_during_load": "servex does not estimate the memory a load takes",
    "enable_session_metadata": "servex puts no model name or version into a session's config",
    "remove_unused_fields_from_bundle_metagraph": NO_EFFECT_FLAGS["remove_unused_fields_from_bundle_metagraph"],
    "prefer_tflite_model": _TFLITE,
    "use_tflite_model": _TFLITE,
    "num_tflite_interpreters": _TFLITE,
    "num_tflite_interpreters_per_pool": _TFLITE,
    "num_tflite_pools": _TFLITE,
    "wrap_session_with_no_threading_params": "servex passes no thread-pool options with a run",
    "resource_estimation_uses_validation_result": "servex does not estimate resources before a load",
    "mixed_precision": NO_EFFECT_FLAGS["mixed_precision"],
}
WARMUP_NO_EFFECT = {
    "num_model_warmup_threads": "a version's warm-up records replay one after another",
    "model_name": "warm-up runs the records on the version being loaded, whatever model they name",
    "model_version": "warm-up runs the records on the version being loaded, whatever version they name",
    "enable_all_batch_sizes_warmup": "warm-up replays each record as written",
}


@dataclass(frozen=True)
class PlatformConfig:
    """What the "tensorflow" platform's SessionBundleConfig of --platform_config_file sets in servex, in place of
    the flags of SESSION_BUNDLE_FLAGS (as in TensorFlow Serving)."""

    session_config: object  # a TensorFlow ConfigProto: the file's session_config
    enable_batching: bool  # batching_parameters present, even empty
    batching_parameters: str  # BatchingParameters in text format (empty: the defaults)
    enable_per_model_batching_params: bool
    saved_model_tags: tuple[str, ...]  # "serve" where the file names none, as TensorFlow Serving loads
    enable_model_warmup: bool  # off unless the file sets it, as in TensorFlow Serving
    num_request_iterations_for_warmup: int


def platform_config(path: str, fail, notes: list[str]) -> PlatformConfig:
    """--platform_config_file: TensorFlow Serving's PlatformConfigMap in text format, whose "tensorflow" entry holds
    a SavedModelBundleSourceAdapterConfig; ``fail`` names what cannot be used, ``notes`` gets what changes nothing
    (TensorFlow is imported: the session config is a TensorFlow ConfigProto)."""
    from google.protobuf.message import DecodeError
    from tensorflow_serving.config import platform_config_pb2

    from servex.protos.servex.v1.platform_config_pb2 import SavedModelBundleSourceAdapterConfig  # the Any's type

    where = f"--platform_config_file {path!r}"
    try:
        config = text_format.Parse(Path(path).read_text(encoding="utf-8"), platform_config_pb2.PlatformConfigMap())
    except OSError as e:
        fail(f"--platform_config_file: cannot read {path!r}: {e.strerror}")
    except text_format.ParseError as e:
        hint = ""
        if "not found in descriptor pool" in str(e):
            hint = f"; servex reads the {TENSORFLOW_PLATFORM!r} platform's {ADAPTER_CONFIG} (TensorFlow Serving's)"
        fail(f"{where} is not a PlatformConfigMap in text format: {e}{hint}")
    platforms = dict(config.platform_configs)
    for name in sorted(platforms.keys() - {TENSORFLOW_PLATFORM}):
        notes.append(f"{where}: platform {name!r} has no effect in servex: it serves the {TENSORFLOW_PLATFORM!r} "
                     f"platform only")  # fmt: skip
    if TENSORFLOW_PLATFORM not in platforms:
        fail(f"{where} has no {TENSORFLOW_PLATFORM!r} platform, the one servex serves (platform_configs has "
             f"{sorted(platforms)})")  # fmt: skip
    packed = platforms[TENSORFLOW_PLATFORM].source_adapter_config
    adapter = SavedModelBundleSourceAdapterConfig()
    try:
        unpacked = packed.Unpack(adapter)
    except DecodeError as e:
        fail(f"{where}: the {TENSORFLOW_PLATFORM!r} platform's {ADAPTER_CONFIG} cannot be decoded: {e}")
    if not unpacked:
        fail(f"{where}: the {TENSORFLOW_PLATFORM!r} platform's source_adapter_config holds "
             f"{packed.type_url or 'nothing'!r}; expected [type.googleapis.com/{ADAPTER_CONFIG}] {{ legacy_config "
             f"{{ ... }} }}")  # fmt: skip
    bundle = adapter.legacy_config
    if bundle.session_target:
        fail(f"{where}: session_target {bundle.session_target!r} is not supported: servex runs TensorFlow in its "
             f"own process (leave it empty)")  # fmt: skip
    if bundle.experimental_fixed_input_tensors:
        fail(f"{where}: experimental_fixed_input_tensors is not supported: a run's inputs are the request's")
    for field, _ in bundle.ListFields():
        if field.name in SESSION_BUNDLE_NO_EFFECT:
            notes.append(f"{where}: {field.name} has no effect in servex: {SESSION_BUNDLE_NO_EFFECT[field.name]}")
    warmup = bundle.model_warmup_options
    for field, _ in warmup.ListFields():
        if field.name in WARMUP_NO_EFFECT:
            notes.append(f"{where}: model_warmup_options.{field.name} has no effect in servex: "
                         f"{WARMUP_NO_EFFECT[field.name]}")  # fmt: skip
    iterations = warmup.num_request_iterations.value if warmup.HasField("num_request_iterations") else 1
    if iterations < 1:
        fail(f"{where}: model_warmup_options.num_request_iterations must be at least 1, got {iterations}")
    tags = tuple(bundle.saved_model_tags) or ("serve",)
    if not all(tag.strip() for tag in tags):
        fail(f"{where}: saved_model_tags has an empty tag: {list(tags)}")
    return PlatformConfig(
        session_config=bundle.session_config,
        enable_batching=bundle.HasField("batching_parameters"),
        batching_parameters=text_format.MessageToString(bundle.batching_parameters),
        enable_per_model_batching_params=bundle.enable_per_model_batching_params,
        saved_model_tags=tags,
        enable_model_warmup=bundle.enable_model_warmup,
        num_request_iterations_for_warmup=iterations,
    )


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None, dests) -> list[str]:
    """Those of ``dests`` that the command line gives (whatever their value); the parser is left as it was."""
    unset = object()
    defaults = {dest: parser.get_default(dest) for dest in dests}
    parser.set_defaults(**dict.fromkeys(dests, unset))
    try:
        args = parser.parse_args(argv)
    finally:
        parser.set_defaults(**defaults)
    return [dest for dest in dests if getattr(args, dest) is not unset]


# gRPC's message size limits: servex checks answers and decoded requests against --max_message_bytes as well, so
# they are set by that flag only.
MESSAGE_LIMITS = ("grpc.max_receive_message_length", "grpc.max_send_message_length")


def channel_arguments(text: str, fail, notes: list[str]) -> tuple[tuple[str, int | str], ...]:
    """--grpc_channel_arguments: ``key=value`` pairs, comma-separated; a value that parses as a 32-bit integer is
    one (gRPC's integer arguments are C ints), others are strings, as TensorFlow Serving passes them. gRPC's
    message size limits are left out, with a note: --max_message_bytes sets them."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            fail(f"--grpc_channel_arguments expects key=value[,key=value...], got {item!r}")
        if key in MESSAGE_LIMITS:
            notes.append(
                f"--grpc_channel_arguments: {key}={value} has no effect in servex: --max_message_bytes sets gRPC's "
                f"message size limits, which servex's own checks of answers and requests follow too"
            )
            continue
        try:
            number = int(value)
        except ValueError:
            number = None
        pairs.append((key, number if number is not None and -(2**31) <= number < 2**31 else value))
    return tuple(pairs)


def prometheus_path(path: str, fail) -> str:
    """The REST path of --monitoring_config_file's Prometheus metrics; empty when it does not enable them."""
    from servex.protos.servex.v1 import monitoring_pb2

    try:
        config = text_format.Parse(Path(path).read_text(encoding="utf-8"), monitoring_pb2.MonitoringConfig())
    except OSError as e:
        fail(f"--monitoring_config_file: cannot read {path!r}: {e.strerror}")
    except text_format.ParseError as e:
        fail(f"--monitoring_config_file: {path!r} is not a MonitoringConfig in text format: {e}")
    if not config.prometheus_config.enable:
        return ""
    rest_path = config.prometheus_config.path or DEFAULT_PROMETHEUS_PATH
    if not rest_path.startswith("/"):
        fail(f"--monitoring_config_file: prometheus_config.path must start with '/', got {rest_path!r}")
    return rest_path


def versions() -> str:
    try:
        servex = metadata.version("servex")
    except metadata.PackageNotFoundError:
        servex = "unknown (not installed)"
    import tensorflow as tf

    return f"servex {servex}\nTensorFlow Library: {tf.__version__}"
