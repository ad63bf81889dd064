"""TensorFlow Serving's command line where it goes beyond servex's own flags: TensorFlow Serving's flags that servex
takes but that change nothing here (each one given is noted, with the reason), those it refuses, and the reading of
the files and lists its other flags name (a session ConfigProto, a MonitoringConfig, gRPC channel arguments).
server/cli.py builds the parser and the settings; this module keeps TensorFlow Serving's side of it apart.
"""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path

from google.protobuf import text_format

DEFAULT_PROMETHEUS_PATH = "/monitoring/prometheus/metrics"  # TensorFlow Serving's


# TensorFlow Serving's flags that servex takes, so that a tensorflow_model_server command line starts it, but that
# change nothing here; each one given is logged at start with the reason.
NO_EFFECT_FLAGS = {
    "rest_api_num_threads": "REST is served by the event loop; runs go to the run workers (--num_run_workers)",
    "allow_version_labels_for_unavailable_models": "servex always accepts a label on a version that is not "
    "available, and says so",
    "num_load_threads": "versions load one at a time, off the request path",
    "num_unload_threads": "versions unload off the request path, once their in-flight calls end",
    "flush_filesystem_caches": "servex does not flush file system caches",
    "platform_config_file": "servex serves TensorFlow SavedModels only",
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
    "enable_profiler": "servex serves no profiler service",
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


def add_other_flags(p: argparse.ArgumentParser) -> None:
    """TensorFlow Serving's flags that servex does not implement, as a group of their own in --help."""
    group = p.add_argument_group(
        "TensorFlow Serving's flags that change nothing in servex (taken so that its command lines start servex; "
        "each one given is logged with the reason)"
    )
    for flag, why in NO_EFFECT_FLAGS.items():
        group.add_argument(f"--{flag}", nargs="?", const="true", default=None, metavar="VALUE", help=why)
    for flag, why in REFUSED_FLAGS.items():
        group.add_argument(f"--{flag}", nargs="?", const="true", default=None, metavar="VALUE", help=f"refused: {why}")


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
    from protos.servex.v1 import monitoring_pb2

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
