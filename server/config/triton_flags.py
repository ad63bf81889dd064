"""Triton's command line (``tritonserver --model-repository=...``), taken by ``servex`` so that a Triton user switches
by changing the command's first word.

Given ``--model-repository`` (or ``--model-store``), servex serves a Triton model repository
(loader/model_repository.py) with Triton's defaults: gRPC on 8001, HTTP (REST) on 8000, metrics on 8002, every
model loaded at start and nothing changed after (``--model-control-mode=none``), the start failing when a model
fails to load (``--exit-on-error``), readiness only while every model serves (``--strict-readiness``). TensorFlow
Serving's flags still apply where given (``--port`` where ``--grpc-port`` is not).

Triton's flags that servex takes, and what they set:

- ``--grpc-port``, ``--http-port``, ``--metrics-port``, ``--allow-http``, ``--allow-metrics`` (``--allow-grpc=false``
  is refused: servex always serves gRPC), ``--grpc-address``/``--http-address`` (one address: servex binds every
  port to it);
- ``--model-control-mode`` (any case), ``--repository-poll-secs`` (poll mode; default 15), ``--load-model``
  (explicit mode, where the repository extension is served on the inference ports too, as in Triton; repeatable,
  ``*`` alone for all), ``--model-load-retry-count``;
- ``--disable-auto-complete-config`` and ``--strict-model-config=true`` (no max_batch_size from the SavedModel),
  ``--backend-config`` (TensorFlow's ``default-max-batch-size``, default 4);
- ``--exit-on-error``, ``--strict-readiness``, ``--exit-timeout-secs`` (the drain, default 30);
- ``--grpc-use-ssl``, ``--grpc-server-cert``, ``--grpc-server-key``, ``--grpc-root-cert``, ``--grpc-use-ssl-mutual``:
  TLS on the gRPC port, as TensorFlow Serving's PEM file flags;
- ``--log-verbose`` (above 0, or true: debug logging), ``--log-info``, ``--log-warning``, ``--log-error``;
- ``--grpc-restricted-protocol`` / ``--http-restricted-api`` for the model-repository category (the header the
  repository extension asks of callers on the inference ports; other categories are refused).

Triton's other flags are taken and noted at start as changing nothing (NO_EFFECT_FLAGS): backends, caches, GPU
memory pools, tracing, and the like.
"""

from __future__ import annotations

import argparse

from servex.server.config.flagspec import TRITON, Flag, parse_bool

DEFAULT_GRPC_PORT = 8001
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 8002
DEFAULT_POLL_SECONDS = 15.0
DEFAULT_EXIT_TIMEOUT_SECONDS = 30.0
CONTROL_MODES = ("none", "poll", "explicit")

# Triton flags taken with a value and noted as changing nothing in servex, with why.
NO_EFFECT_FLAGS = {
    "id": "servex names itself 'servex' in ServerMetadata",
    "backend-directory": "servex runs TensorFlow SavedModels itself, with no backends",
    "metrics-address": "servex binds every port to one address (--grpc-address, --http-address, --bind_address)",
    "grpc-infer-response-compression-level": "servex answers uncompressed",
    "grpc-max-connection-age": "set it with --grpc_channel_arguments=grpc.max_connection_age_ms=...",
    "grpc-max-connection-age-grace": "set it with --grpc_channel_arguments=grpc.max_connection_age_grace_ms=...",
    "cuda-virtual-address-size": "servex keeps no CUDA memory pool",
    "model-load-gpu-limit": "TensorFlow decides the GPU memory a model takes (see --per_process_gpu_memory_fraction)",
    "repoagent-directory": "servex has no repository agents",
    "model-load-thread-count": "servex loads one version at a time",
    "model-namespacing": "model names are the folder names",
    "pinned-memory-pool-byte-size": "servex keeps no pinned memory pool",
    "cuda-memory-pool-byte-size": "servex keeps no CUDA memory pool",
    "min-supported-compute-capability": "TensorFlow decides which GPUs it uses",
    "buffer-manager-thread-count": "servex has no buffer manager",
    "rate-limit": "servex schedules by priority (see --max_queued_requests)",
    "rate-limit-resource": "servex schedules by priority",
    "response-cache-byte-size": "servex caches no responses",
    "cache-config": "servex caches no responses",
    "cache-directory": "servex caches no responses",
    "http-thread-count": "servex's HTTP server runs on its event loop",
    "http-header-forward-pattern": "servex forwards no headers",
    "grpc-header-forward-pattern": "servex forwards no headers",
    "grpc-infer-allocation-pool-size": "servex keeps no allocation pool",
    "grpc-max-response-pool-size": "servex keeps no response pool",
    "grpc-keepalive-time": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-keepalive-timeout": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-keepalive-permit-without-calls": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-http2-max-pings-without-data": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-http2-min-recv-ping-interval-without-data": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-http2-max-ping-strikes": "set gRPC keepalive with --grpc_channel_arguments",
    "grpc-infer-thread-count": "servex's gRPC calls run on its event loop",
    "reuse-grpc-port": "servex's listeners share the gRPC port among themselves (--grpc_listeners)",
    "reuse-http-port": "servex's REST port is one listener",
    "allow-gpu-metrics": "servex exports no GPU metrics",
    "allow-cpu-metrics": "servex exports no CPU metrics",
    "metrics-interval-ms": "servex's metrics are read when scraped",
    "metrics-config": "servex's metrics are read when scraped",
    "allow-sagemaker": "servex serves no SageMaker endpoint",
    "allow-vertex-ai": "servex serves no Vertex AI endpoint",
    "host-policy": "servex runs on the CPUs it is given",
    "enable-peer-access": "servex does not set up GPU peer access",
    "log-format": "servex logs in its own format",
    "log-file": "servex logs to standard error",
    "model-config-name": "servex reads config.pbtxt",
}


def _int_or_bool(text: str) -> int:
    """Triton's integer flags that also take true and false (--log-verbose)."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return int(lowered == "true")
    try:
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, true or false, got {text!r}") from None


def _triton(name: str, help: str, **kwargs) -> Flag:
    """A Triton flag: its destination is ``triton_`` and its name, so that none collides with TensorFlow
    Serving's; not given, it is None (its default applies only with a model repository: ``doc_default``)."""
    kwargs.setdefault("default", None)
    return Flag(name, help, TRITON, dest="triton_" + name.replace("-", "_"), **kwargs)


def _switch(name: str, help: str, **kwargs) -> Flag:
    return _triton(name, help, type=parse_bool, **kwargs)


TRACE_FLAGS = {"trace-file": "triton,file", "trace-level": "level", "trace-rate": "rate", "trace-count": "count",
               "trace-log-frequency": "triton,log-frequency"}  # fmt: skip


def trace_entries(args: argparse.Namespace) -> tuple[str, ...]:
    """Triton's --trace-file, --trace-level, --trace-rate, --trace-count and --trace-log-frequency as --trace_config
    entries; they are taken with or without a model repository, and cleared here so as not to count as Triton
    flags that need one."""
    entries = []
    for name, entry in TRACE_FLAGS.items():
        dest = "triton_" + name.replace("-", "_")
        value = getattr(args, dest, None)
        values = value if isinstance(value, list | tuple) else [] if value is None else [value]
        entries += [f"{entry}={v}" for v in values]
        setattr(args, dest, None)
    return tuple(entries)


# Triton's flags that servex takes, in --help's order; ``sets``: the servex flag whose setting one gives.
FLAGS = (
    _triton("model-repository", "a Triton model repository (repeatable): each folder is a model",
            aliases=("model-store",), default=(), repeatable=True, metavar="PATH", doc_default="none"),
    _triton("grpc-port", f"gRPC port with a Triton model repository (default {DEFAULT_GRPC_PORT})", type=int,
            sets="port", doc_default=str(DEFAULT_GRPC_PORT)),
    _triton("http-port", f"REST port with a Triton model repository (default {DEFAULT_HTTP_PORT})", type=int,
            sets="rest_api_port", doc_default=str(DEFAULT_HTTP_PORT)),
    _triton("metrics-port", f"metrics port with a Triton model repository (default {DEFAULT_METRICS_PORT})",
            type=int, sets="metrics_port", doc_default=str(DEFAULT_METRICS_PORT)),
    _triton("grpc-address", "address to bind", sets="bind_address"),
    _triton("http-address", "address to bind", sets="bind_address"),
    _switch("allow-grpc", "false is refused: servex always serves gRPC"),
    _switch("allow-http", "false: no REST port"),
    _switch("allow-metrics", "false: no metrics port"),
    _switch("exit-on-error", "exit when a model fails to load at start (default true with a repository)"),
    _switch("strict-readiness", "ready only while every model serves (default true with a repository)"),
    _switch("grpc-use-ssl", "TLS on the gRPC port (needs --grpc-server-cert and --grpc-server-key)"),
    _switch("grpc-use-ssl-mutual", "TLS with client certificates checked against --grpc-root-cert",
            sets="ssl_client_verify"),
    _switch("log-info", "log informational messages (default true)"),
    _switch("log-warning", "log warnings (default true)"),
    _switch("log-error", "log errors (default true)"),
    _triton("model-control-mode", "none: every model at start, no change after; poll: the repositories re-read "
            "every --repository-poll-secs; explicit: --load-model at start, the repository extension after",
            type=str.lower, choices=CONTROL_MODES, doc_default="none"),
    _triton("repository-poll-secs", "poll mode: seconds between reads of the repositories (default "
            f"{DEFAULT_POLL_SECONDS:g})", type=float, sets="file_system_poll_wait_seconds",
            doc_default=f"{DEFAULT_POLL_SECONDS:g}"),
    _triton("load-model", "explicit mode: a model to load at start (repeatable; * for all)", default=(),
            repeatable=True, metavar="NAME", doc_default="none"),
    _triton("exit-timeout-secs", "seconds in-flight calls have at shutdown (default "
            f"{DEFAULT_EXIT_TIMEOUT_SECONDS:g})", type=float, sets="drain_seconds",
            doc_default=f"{DEFAULT_EXIT_TIMEOUT_SECONDS:g}"),
    *(_triton(name, "PEM file for --grpc-use-ssl", default="", metavar="FILE", sets=sets)
      for name, sets in (("grpc-server-cert", "ssl_server_cert_file"), ("grpc-server-key", "ssl_server_key_file"),
                         ("grpc-root-cert", "ssl_custom_ca_file"))),
    _triton("log-verbose", "above 0 (or true): debug logging", type=_int_or_bool, doc_default="0"),
    _triton("model-load-retry-count", "retries of a failed load (servex's --max_num_load_retries)", type=int,
            sets="max_num_load_retries"),
    _switch("disable-auto-complete-config", "no max_batch_size from the SavedModel"),
    _switch("strict-model-config", "true: as --disable-auto-complete-config"),
    *(_triton(name, "model-repository:KEY=VALUE: load and unload need that header", default=(), repeatable=True,
              metavar="CATEGORY[,...]:KEY=VALUE", doc_default="none")
      for name in ("grpc-restricted-protocol", "http-restricted-api")),
    _triton("backend-config", "tensorflow's default-max-batch-size is taken", default=(), repeatable=True,
            metavar="[BACKEND,]SETTING=VALUE", doc_default="none",
            doc="`tensorflow,default-max-batch-size=N` (default 4): the max_batch_size a model whose SavedModel "
            "batches and whose config.pbtxt gives none gets; other settings are logged as changing nothing."),
    # Triton's older tracing flags, as --trace_config entries (--trace-config is --trace_config's own alias).
    *(_triton(name, f"as --trace_config {entry}=VALUE", metavar="VALUE", repeatable=name == "trace-level",
              default=() if name == "trace-level" else None)
      for name, entry in TRACE_FLAGS.items()),
    # Taken and noted (hidden from --help, listed in docs/flags.md).
    *(Flag(name, f"no effect: {why}", TRITON, dest="triton_noop_" + name.replace("-", "_"), default=None,
           const="true", repeatable=True, hidden=True)
      for name, why in NO_EFFECT_FLAGS.items()),
)  # fmt: skip


# TensorFlow Serving's and servex's settings whose defaults become Triton's with a model repository, unless given
DEFAULTS_REPLACED = ("port", "rest_api_port", "metrics_port", "drain_seconds")


def triton_flags_given(args: argparse.Namespace) -> list[str]:
    """The Triton flags the command line gives (their values are no longer None or empty), as Triton spells them."""
    return sorted(
        "--" + dest.removeprefix("triton_").removeprefix("noop_").replace("_", "-")
        for dest, value in vars(args).items()
        if dest.startswith("triton_") and value not in (None, [], "")
    )  # fmt: skip


def apply(args: argparse.Namespace, given: set[str], fail, notes: list[str]) -> None:
    """Turn Triton's flags into TensorFlow Serving's and servex's ``args`` (``given``: those of DEFAULTS_REPLACED the
    command line sets), with Triton's defaults where a model repository is served; ``fail`` for what cannot be
    honoured."""
    for flag in NO_EFFECT_FLAGS:
        values = getattr(args, f"triton_noop_{flag.replace('-', '_')}")
        for value in values or ():
            notes.append(f"--{flag}={value} has no effect in servex: {NO_EFFECT_FLAGS[flag]}")
    args.repository_auto_complete, args.repository_default_max_batch_size = True, 4  # Triton's defaults
    args.repository_restrictions = {}
    repositories = list(dict.fromkeys(args.triton_model_repository))  # Triton keeps a set: a path given twice is one
    args.triton_model_repository = repositories
    if not repositories:
        named = triton_flags_given(args)
        if named:
            fail(f"{', '.join(named)}: Triton's flags need --model-repository (Triton's model repository to serve)")
        return
    if args.model_config_file is not None or args.model_base_path is not None:
        fail("--model-repository names the models: give it without --model_config_file and --model_base_path")
    if args.enable_batching or args.batching_parameters_file:
        fail("--model-repository: batching is set per model by each config.pbtxt's dynamic_batching, as in Triton; "
             "give it without --enable_batching and --batching_parameters_file")  # fmt: skip
    if args.triton_allow_grpc is False:
        fail("--allow-grpc=false: servex always serves gRPC")
    _ports_and_address(args, given, fail)
    _control_mode(args, fail, notes)
    args.triton_exit_on_error = True if args.triton_exit_on_error is None else args.triton_exit_on_error
    args.triton_strict_readiness = True if args.triton_strict_readiness is None else args.triton_strict_readiness
    if args.triton_exit_timeout_secs is not None:
        args.drain_seconds = args.triton_exit_timeout_secs
    elif "drain_seconds" not in given:
        args.drain_seconds = DEFAULT_EXIT_TIMEOUT_SECONDS
    _tls(args, fail)
    if args.triton_model_control_mode == "explicit" and args.serving_processes > 1:
        fail("--model-control-mode=explicit needs --serving_processes=1: a load or unload would reach one of the "
             "processes sharing the ports")  # fmt: skip
    _restrictions(args, fail)
    if args.triton_model_load_retry_count is not None:
        args.max_num_load_retries = args.triton_model_load_retry_count
    args.repository_auto_complete = not (args.triton_disable_auto_complete_config or args.triton_strict_model_config)
    _backend_config(args, fail, notes)
    if args.triton_log_verbose:
        args.log_level = "debug"
    elif args.triton_log_info is False:
        args.log_level = "error" if args.triton_log_warning is False else "warning"


def _ports_and_address(args: argparse.Namespace, given: set[str], fail) -> None:
    def port(triton_dest: str, tfs_dest: str, default: int, allowed) -> int:
        if allowed is False:
            return 0
        value = getattr(args, triton_dest)
        if value is not None:
            return value
        return getattr(args, tfs_dest) if tfs_dest in given else default

    args.port = port("triton_grpc_port", "port", DEFAULT_GRPC_PORT, True)
    args.rest_api_port = port("triton_http_port", "rest_api_port", DEFAULT_HTTP_PORT, args.triton_allow_http)
    args.metrics_port = port("triton_metrics_port", "metrics_port", DEFAULT_METRICS_PORT, args.triton_allow_metrics)
    addresses = {a for a in (args.triton_grpc_address, args.triton_http_address) if a is not None}
    if len(addresses) > 1:
        fail(f"--grpc-address and --http-address differ ({sorted(addresses)}): servex binds every port to one address")
    if addresses:
        args.bind_address = addresses.pop()


def _control_mode(args: argparse.Namespace, fail, notes: list[str]) -> None:
    mode = args.triton_model_control_mode or "none"
    if args.triton_load_model and mode != "explicit":
        notes.append(f"--load-model has no effect without --model-control-mode=explicit (mode {mode}), as in Triton")
        args.triton_load_model = []
    if "*" in args.triton_load_model and len(args.triton_load_model) > 1:
        fail("--load-model=* loads every model: give it alone, as Triton requires")
    if args.triton_repository_poll_secs is not None and mode != "poll":
        notes.append("--repository-poll-secs has no effect without --model-control-mode=poll, as in Triton")
    if mode == "poll":
        poll = args.triton_repository_poll_secs
        poll = DEFAULT_POLL_SECONDS if poll is None else poll
        if poll <= 0:
            fail(f"--repository-poll-secs must be more than 0, got {poll:g}")
        args.file_system_poll_wait_seconds = poll
    else:  # the versions on disk are read at start (and, explicit, at each load), not watched
        args.file_system_poll_wait_seconds = 0.0
    args.triton_model_control_mode = mode


def _tls(args: argparse.Namespace, fail) -> None:
    if args.triton_grpc_use_ssl or args.triton_grpc_use_ssl_mutual:
        if args.ssl_config_file or args.ssl_server_cert_file or args.ssl_server_key_file:
            fail("--grpc-use-ssl and TensorFlow Serving's TLS flags are two ways to give one TLS configuration: "
                 "give one of them")  # fmt: skip
        args.ssl_server_cert_file = args.triton_grpc_server_cert
        args.ssl_server_key_file = args.triton_grpc_server_key
        args.ssl_custom_ca_file = args.triton_grpc_root_cert
        args.ssl_client_verify = bool(args.triton_grpc_use_ssl_mutual)


def _restrictions(args: argparse.Namespace, fail) -> None:
    for protocol, flag in (("grpc", "grpc-restricted-protocol"), ("http", "http-restricted-api")):
        for item in getattr(args, f"triton_{flag.replace('-', '_')}"):
            categories, colon, header = item.partition(":")
            key, eq, value = header.partition("=")
            if not colon or not eq or not key.strip():
                fail(f"--{flag}={item}: expected CATEGORY[,CATEGORY...]:KEY=VALUE")
            other = sorted({c.strip() for c in categories.split(",")} - {"model-repository"})
            if other:
                fail(f"--{flag}={item}: servex restricts only the model-repository category; {other} would be "
                     f"served open, not restricted")  # fmt: skip
            args.repository_restrictions[protocol] = (key.strip().lower(), value)


def _backend_config(args: argparse.Namespace, fail, notes: list[str]) -> None:
    for item in args.triton_backend_config:
        backend, _, setting = item.partition(",") if "," in item else ("", "", item)
        key, eq, value = setting.partition("=")
        if not eq or backend not in ("", "tensorflow"):
            notes.append(f"--backend-config={item} has no effect in servex: it runs TensorFlow SavedModels itself")
        elif key == "default-max-batch-size":
            try:
                args.repository_default_max_batch_size = int(value)
            except ValueError:
                fail(f"--backend-config={item}: default-max-batch-size must be an integer")
        else:
            notes.append(f"--backend-config={item} has no effect in servex: only default-max-batch-size is taken")
