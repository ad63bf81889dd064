"""The `servex` command: TensorFlow Serving's flag names, parsed into ServerSettings.

The flags are declared once, with their settings (server/config/flags.py builds the parser and docs/flags.md from
them); here the command line becomes ServerSettings. TensorFlow is imported only after the flags are parsed, so
`servex --help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NamedTuple

from servex.server import affinity, group, tensorflow_logs
from servex.server.config import tfserving_flags, triton_flags
from servex.server.config.flags import build_parser
from servex.server.config.flagspec import setting_flags
from servex.server.config.settings import DEMO_MODEL_NAME, ServerSettings
from servex.server.transport import tls

__all__ = ["MAX_SOCKET_PATH", "Parsed", "build_parser", "main", "parse_settings"]


class Parsed(NamedTuple):
    settings: ServerSettings
    log_level: str
    notes: tuple[str, ...]  # warnings about the command line, logged once logging is set up


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux, less its terminating NUL


def parse_settings(argv: list[str] | None = None) -> Parsed:
    """The command line's settings; exits 2 with a message naming the flag for what cannot be served."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(tfserving_flags.versions())
        raise SystemExit(0)
    fail = parser.error
    notes = tfserving_flags.check_other_flags(args, fail)
    given = tfserving_flags.given_flags(parser, argv, triton_flags.DEFAULTS_REPLACED)
    trace_config = _trace_config(args, fail)  # before Triton's flags: its trace flags need no model repository
    triton_flags.apply(args, set(given), fail, notes)
    derived = {"prefetch_variables": _prefetch_variables(args, fail)}
    derived["admin_port"] = args.admin_port or (8503 if args.admin_token_file else 0)
    _check_bounds(args, derived["admin_port"], fail)
    _check_ports(args, derived["admin_port"], fail)
    _check_models(args, fail, notes)
    platform, session_config = _session_bundle(args, parser, argv, fail, notes)
    derived.update(_thread_pools(args, session_config))
    if not 0 <= args.per_process_gpu_memory_fraction <= 1:
        fail(f"--per_process_gpu_memory_fraction must be from 0 to 1, got {args.per_process_gpu_memory_fraction}")
    derived["saved_model_tags"] = _saved_model_tags(args, platform, fail)
    derived["prometheus_rest_path"] = _prometheus_rest_path(args, fail, notes)
    if len(os.fsencode(args.grpc_socket_path)) > MAX_SOCKET_PATH:
        fail(f"--grpc_socket_path is {len(os.fsencode(args.grpc_socket_path))} bytes long: a UNIX socket's path "
             f"takes at most {MAX_SOCKET_PATH}")  # fmt: skip
    derived["grpc_tls"] = _grpc_tls(args, fail)
    derived.update({**_models(args), **_batching(args, platform), **_triton(args)})
    derived["tensorflow_session_config"] = session_config.SerializeToString() if session_config is not None else b""
    derived["grpc_channel_arguments"] = tfserving_flags.channel_arguments(args.grpc_channel_arguments, fail, notes)
    derived["trace_config"] = trace_config
    return Parsed(_settings(args, derived), args.log_level, tuple(notes))


def _settings(args: argparse.Namespace, derived: dict) -> ServerSettings:
    """ServerSettings: each field declaring a flag takes that flag's value, unless ``derived`` gives it."""
    values = {name: getattr(args, spec.destination) for name, spec in setting_flags(ServerSettings)}
    return ServerSettings(**{**values, **derived})


def _trace_config(args: argparse.Namespace, fail) -> tuple[str, ...]:
    """--trace_config's entries (Triton's deprecated --trace-level and the like turned into them), checked now so
    that a mistake stops the command with the entry named."""
    from servex.server.observability.trace_export import otlp_endpoint
    from servex.server.observability.trace_settings import parse_trace_config

    entries = tuple(args.trace_config) + triton_flags.trace_entries(args)
    try:
        config = parse_trace_config(entries)
        if "url" in config.opentelemetry:
            otlp_endpoint(config.opentelemetry["url"])
    except ValueError as e:
        fail(str(e))
    return entries


def _prefetch_variables(args: argparse.Namespace, fail) -> dict[str, tuple[str, ...]]:
    prefetch: dict[str, tuple[str, ...]] = {}
    for item in args.prefetch_variables:
        model, sep, names = item.partition("=")
        if not sep or not model or not names:
            fail(f"--prefetch_variables expects MODEL=VAR[,VAR...], got {item!r}")
        prefetch[model] = prefetch.get(model, ()) + tuple(n for n in names.split(",") if n)
    return prefetch


def _check_ports(args: argparse.Namespace, admin_port: int, fail) -> None:
    """No two of servex's own ports are the same: the second bind would fail at start on servex's own port."""
    ports = {"--port": args.port, "--rest_api_port": args.rest_api_port, "--metrics_port": args.metrics_port,
             "--admin_port": admin_port}  # fmt: skip
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port and port in seen:
            fail(
                f"{flag}={port} is also {seen[port]}'s port: servex would bind port {port} twice; give each of "
                f"--port, --rest_api_port, --metrics_port and --admin_port its own port (0 turns the last three off)"
            )
        seen.setdefault(port, flag)


def _check_bounds(args: argparse.Namespace, admin_port: int, fail) -> None:
    """The counts and the admin API's conditions."""
    if args.grpc_listeners < 1:
        fail(f"--grpc_listeners must be at least 1, got {args.grpc_listeners}")
    if args.max_queued_bytes < 0:
        fail(f"--max_queued_bytes must be 0 (no bound) or more, got {args.max_queued_bytes}")
    if args.max_memory_bytes < 0:
        fail(f"--max_memory_bytes must be 0 (the cgroup's limit, if any) or more, got {args.max_memory_bytes}")
    if args.lower_priority_burst < 0:
        fail(f"--lower_priority_burst must be 0 (off) or more, got {args.lower_priority_burst}")
    if args.event_loop_cpu != -1:
        try:
            affinity.resolve(args.event_loop_cpu)
        except ValueError as e:
            fail(str(e))
    if args.num_request_iterations_for_warmup < 1 and not args.platform_config_file:  # else ignored (noted)
        fail(f"--num_request_iterations_for_warmup must be at least 1, got {args.num_request_iterations_for_warmup}")
    if args.auto_max_batch_size < 1:
        fail(f"--auto_max_batch_size must be at least 1, got {args.auto_max_batch_size}")
    if args.auto_compute_bound_runs < 1:
        fail(f"--auto_compute_bound_runs must be at least 1, got {args.auto_compute_bound_runs}")
    if args.serving_processes < 1:
        fail(f"--serving_processes must be at least 1, got {args.serving_processes}")
    if args.serving_processes > 1 and admin_port:
        fail("the admin API changes one process's variables and models: it needs --serving_processes=1")
    loopback = args.admin_bind_address in ("127.0.0.1", "localhost", "::1")
    if admin_port and not loopback and not args.admin_token_file:
        fail("--admin_bind_address other than loopback needs --admin_token_file")


def _check_models(args: argparse.Namespace, fail, notes: list[str]) -> None:
    if args.model_config_file is not None and (args.model_base_path is not None or args.model_name is not None):
        notes.append("--model_name and --model_base_path are ignored: --model_config_file names the models (as in "
                     "TensorFlow Serving)")  # fmt: skip
        args.model_name = args.model_base_path = None
    if args.model_name is not None and args.model_base_path is None:
        fail("--model_name needs --model_base_path")


def _session_bundle(args: argparse.Namespace, parser, argv, fail, notes: list[str]):
    """--platform_config_file's PlatformConfig (None without one), which replaces the flags TensorFlow Serving
    builds a SessionBundleConfig from; and the session ConfigProto (None: TensorFlow's defaults)."""
    if not args.platform_config_file:
        if args.tensorflow_session_config_file:
            return None, tfserving_flags.session_config(args.tensorflow_session_config_file, fail)
        return None, None
    platform = tfserving_flags.platform_config(args.platform_config_file, fail, notes)
    for flag in tfserving_flags.given_flags(parser, argv, tfserving_flags.SESSION_BUNDLE_FLAGS):
        notes.append(f"--{flag} is ignored: --platform_config_file's SessionBundleConfig replaces it (as in "
                     f"TensorFlow Serving)")  # fmt: skip
    # The flags it replaces, as the file sets them (pools left at 0 there take servex's defaults, as below).
    args.tensorflow_session_parallelism = 0
    args.tensorflow_intra_op_parallelism = args.tensorflow_inter_op_parallelism = None
    args.per_process_gpu_memory_fraction = 0.0  # the file's session_config has its own
    args.enable_batching, args.batching_parameters_file = platform.enable_batching, ""
    args.enable_per_model_batching_parameters = platform.enable_per_model_batching_params
    args.enable_model_warmup = platform.enable_model_warmup
    args.num_request_iterations_for_warmup = platform.num_request_iterations_for_warmup
    return platform, platform.session_config


def _thread_pools(args: argparse.Namespace, session_config) -> dict[str, int]:
    """A pool's own flag, else --tensorflow_session_parallelism, else the session config file, else servex's
    default."""
    d = ServerSettings()
    pools = {}
    for pool in ("intra", "inter"):
        setting = f"tensorflow_{pool}_op_parallelism"
        from_file = getattr(session_config, f"{pool}_op_parallelism_threads", 0)
        pools[setting] = next(
            v for v in (getattr(args, setting), args.tensorflow_session_parallelism or None, from_file or None,
                        getattr(d, setting)) if v is not None
        )  # fmt: skip
    return pools


def _saved_model_tags(args: argparse.Namespace, platform, fail) -> tuple[str, ...]:
    if platform is not None:
        tags = platform.saved_model_tags  # as the file names them
    else:
        tags = tuple(t.strip() for t in args.saved_model_tags.split(",") if t.strip())
    if not tags:
        fail(f"--saved_model_tags names no tag: {args.saved_model_tags!r}")
    return tags


def _prometheus_rest_path(args: argparse.Namespace, fail, notes: list[str]) -> str:
    path = tfserving_flags.prometheus_path(args.monitoring_config_file, fail) if args.monitoring_config_file else ""
    if path and not args.rest_api_port:
        notes.append(f"--monitoring_config_file's path {path} is not served: the REST port is off "
                     f"(--rest_api_port=0); the metrics stay on --metrics_port")  # fmt: skip
    return path if args.rest_api_port else ""


def _grpc_tls(args: argparse.Namespace, fail):
    """TLS of the gRPC ports, from --ssl_config_file or the PEM file flags (None: plaintext)."""
    pem_files = args.ssl_server_cert_file or args.ssl_server_key_file or args.ssl_custom_ca_file
    if args.ssl_config_file and (pem_files or args.ssl_client_verify):
        fail("--ssl_config_file and the PEM file flags (--ssl_server_cert_file, ...) are two ways to give one TLS "
             "configuration: give one of them")  # fmt: skip
    if args.ssl_config_file:
        try:
            return tls.read_ssl_config(args.ssl_config_file)
        except tls.TlsConfigError as e:
            fail(f"--ssl_config_file: {e}")
    elif pem_files or args.ssl_client_verify:
        if not (args.ssl_server_cert_file and args.ssl_server_key_file):
            fail("TLS from PEM files needs both --ssl_server_cert_file and --ssl_server_key_file")
        try:
            return tls.read_pem_files(args.ssl_server_cert_file, args.ssl_server_key_file,
                                      args.ssl_custom_ca_file, args.ssl_client_verify)  # fmt: skip
        except tls.TlsConfigError as e:
            fail(str(e))
    return None


def _models(args: argparse.Namespace) -> dict:
    if args.model_base_path is not None:
        name = args.model_name or "default"
    else:
        name = DEMO_MODEL_NAME
    return {
        "model_name": name,
        "model_base_path": args.model_base_path or "",
        "model_config_file": args.model_config_file or "",
    }


def _batching(args: argparse.Namespace, platform) -> dict:
    return {
        "enable_batching": bool(args.enable_batching) or bool(args.batching_parameters_file),
        "auto_batching": args.enable_batching is None and not args.batching_parameters_file,
        "batching_parameters": platform.batching_parameters if platform is not None else "",
    }


def _triton(args: argparse.Namespace) -> dict:
    """The settings of a Triton model repository (triton_flags.apply made them)."""
    repositories = tuple(args.triton_model_repository)  # each once
    return {
        "model_repositories": repositories,
        "model_control_mode": args.triton_model_control_mode or "none",
        "load_models": tuple(args.triton_load_model),
        "exit_on_error": bool(repositories and args.triton_exit_on_error),
        "strict_readiness": bool(repositories and args.triton_strict_readiness),
        "triton_auto_complete": args.repository_auto_complete,
        "repository_restrictions": args.repository_restrictions,
        "triton_default_max_batch_size": args.repository_default_max_batch_size,
    }


def main(argv: list[str] | None = None) -> None:
    settings, log_level, notes = parse_settings(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:
        logging.getLogger("servex").warning("%s", note)
    quiet = "TF_CPP_MIN_LOG_LEVEL" not in os.environ  # else TensorFlow logs as the user told it
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # gRPC core's own log at ERROR and above (read when grpc is first imported, after this): at INFO it writes a
    # line per failed TLS handshake, so any client could fill the log (40,449 lines in a 10-minute soak).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if not settings.tensorflow_intra_op_parallelism:  # servex sizes the pools: each session its own, so that a
        # version's second session can run with one intra-op thread (loader/one_thread.py)
        os.environ.setdefault("TF_OVERRIDE_GLOBAL_THREADPOOL", "1")  # before TensorFlow starts
    group.follow_supervisor()  # one of a group's serving processes: dies with its supervisor
    if settings.serving_processes > 1:
        from servex.server.supervisor import supervise  # no TensorFlow in the supervisor

        sys.exit(supervise(settings, sys.argv[1:] if argv is None else argv))
    # Until the server takes SIGTERM/SIGINT over (to drain), one stops the process at once: nothing is served yet,
    # so there is nothing to drain, and it exits 0 as a drained stop does (a signal's default action would kill it
    # mid-import, which a process group's supervisor then reported as a failure).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_before_serving)
    with tensorflow_logs.quiet_load(quiet):
        from servex.server.app import run  # imports TensorFlow

    sys.exit(run(settings))


def _stop_before_serving(signum, _frame) -> None:
    logging.getLogger("servex").info("%s before serving: stopped", signal.Signals(signum).name)
    raise SystemExit(0)


if __name__ == "__main__":
    main()
