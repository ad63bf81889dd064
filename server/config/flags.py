"""Every flag of the ``servex`` command, from its one declaration: the argparse parser (so ``servex --help``) and the
flag reference docs/flags.md are made here.

The declarations (server/config/flagspec.py's Flag): ServerSettings's fields (server/config/settings.py) for the
flags that set a setting; COMMAND_LINE_FLAGS below for those the CLI reads into other settings; tfserving_flags.py's
OTHER_FLAGS (TensorFlow Serving's flags that change nothing in servex) and triton_flags.py's FLAGS (Triton's command
line).

Regenerate docs/flags.md after changing a flag: ``python -m servex.server.config.flags --markdown > docs/flags.md``.
"""

from __future__ import annotations

import argparse
import sys

from servex.server.config import tfserving_flags, triton_flags
from servex.server.config.flagspec import (
    GRPC,
    PROCESS,
    SERVEX_GROUPS,
    TENSORFLOW,
    TFSERVING_OTHER,
    TRITON,
    Flag,
    parse_bool,
    setting_flags,
)
from servex.server.config.settings import DEMO_MODEL_NAME, ServerSettings

REGENERATE = "python -m servex.server.config.flags --markdown > docs/flags.md"

# Flags that are no setting of their own: the CLI reads them into others (a file into what it holds, the TLS flags
# into grpc_tls), or acts on them (--log_level, --version).
COMMAND_LINE_FLAGS = (
    Flag("tensorflow_session_parallelism", "both TensorFlow thread pools at once (TensorFlow Serving's flag); a "
         "pool's own flag wins over it", TENSORFLOW, type=int, default=0, tfserving=True),
    Flag("tensorflow_session_config_file", "a TensorFlow ConfigProto in text format, the base of every session's "
         "config; the thread-pool and GPU memory flags apply over it where given", TENSORFLOW, default="",
         tfserving=True, doc="Where the pool flags are not given, servex's defaults apply over it to the pools it "
         "leaves at 0."),
    Flag("ssl_config_file", "TensorFlow Serving's SSLConfig in text format (server_key, server_cert, custom_ca, "
         "client_verify: PEM text): TLS on the gRPC port and the admin port, client certificates required and "
         "checked against custom_ca with client_verify: true; REST stays plaintext, as in TensorFlow Serving. "
         "Re-read when it changes: new connections get the new certificate", GRPC, default="", tfserving=True,
         doc="See [TLS on the gRPC port](security.md#tls-on-the-grpc-port)."),
    Flag("ssl_server_cert_file", "instead of --ssl_config_file: PEM file of the server's certificate chain (a "
         "Kubernetes TLS Secret's tls.crt); with --ssl_server_key_file", GRPC, default="",
         doc="Not with `--ssl_config_file` (exit 2)."),
    Flag("ssl_server_key_file", "PEM file of the server's private key (tls.key)", GRPC, default=""),
    Flag("ssl_custom_ca_file", "PEM file of the CAs client certificates must chain to (ca.crt); needed with "
         "--ssl_client_verify", GRPC, default=""),
    Flag("ssl_client_verify", "with the PEM file flags: require a client certificate that --ssl_custom_ca_file's "
         "CAs signed", GRPC, type=parse_bool, default=False),
    Flag("monitoring_config_file", "TensorFlow Serving's MonitoringConfig in text format: prometheus_config { "
         "enable: true path: ... } serves the metrics on the REST port at that path too (default path "
         f"{tfserving_flags.DEFAULT_PROMETHEUS_PATH})", PROCESS, default="", tfserving=True,
         doc="With TensorFlow Serving's `:tensorflow:serving:request_count`, `request_latency`, `runtime_latency` "
         "and (with batching on) `batching_session:queuing_latency`, and TensorFlow's "
         "`:tensorflow:cc:saved_model:load_attempt_count` and `load_latency`, made from servex's own at scrape "
         "time, so that dashboards and alerts written for TensorFlow Serving keep working (see [TensorFlow "
         "Serving's metrics](metrics.md#tensorflow-servings-metrics))."),
    Flag("log_level", "Python logging level", PROCESS, default="INFO"),
    Flag("version", "print servex's and TensorFlow's versions and exit", PROCESS, type=None, default=False,
         tfserving=True),
)  # fmt: skip


def servex_flags() -> list[Flag]:
    """servex's own flags: those of ServerSettings's fields, then COMMAND_LINE_FLAGS."""
    return [spec for _, spec in setting_flags(ServerSettings)] + list(COMMAND_LINE_FLAGS)


def flag_groups() -> list[tuple[str, list[Flag]]]:
    """Every flag of the command by group, in --help's order."""
    servex = servex_flags()
    groups = [(group, [spec for spec in servex if spec.group == group]) for group in SERVEX_GROUPS]
    unknown = {spec.group for spec in servex} - set(SERVEX_GROUPS)
    assert not unknown, f"flags in groups missing from flagspec.SERVEX_GROUPS: {unknown}"
    return groups + [(TFSERVING_OTHER, list(tfserving_flags.OTHER_FLAGS)), (TRITON, list(triton_flags.FLAGS))]


def build_parser() -> argparse.ArgumentParser:
    """The ``servex`` command's parser, from the declarations."""
    parser = argparse.ArgumentParser(
        prog="servex",
        description="Serve TensorFlow SavedModels over TensorFlow Serving's gRPC API. With no model flags, "
        f"serves the bundled demo model as {DEMO_MODEL_NAME!r}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag, with its TensorFlow Serving or Triton counterpart: docs/flags.md.",
    )
    for title, flags in flag_groups():
        group = parser.add_argument_group(title)
        for spec in flags:
            spec.add_to(group)
    return parser


# docs/flags.md


def _default_text(spec: Flag) -> str:
    if spec.doc_default:
        return spec.doc_default
    value = spec.default
    if spec.type is None or (spec.const is not None and value is None):
        return ""  # a switch, or a value taken and left unused
    if value is None or value in ("", (), []):
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def _counterparts(spec: Flag, triton_by_servex: dict[str, list[str]]) -> str:
    """A servex flag's TensorFlow Serving and Triton counterparts; a Triton flag's servex one."""
    parts = ["Triton's"] if spec.group == TRITON else []
    if spec.tfserving is True:
        parts.append("TensorFlow Serving's")
    elif spec.tfserving:
        parts.append(f"TensorFlow Serving's `--{spec.tfserving}`")
    triton = triton_by_servex.get(spec.name, [])
    if triton:
        parts.append("Triton's " + ", ".join(f"`--{name}`" for name in triton))
    if spec.sets:
        parts.append(f"servex's `--{spec.sets}`")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """docs/flags.md: a table per group (flag, default, meaning, counterpart)."""
    triton_by_servex: dict[str, list[str]] = {}
    for spec in triton_flags.FLAGS:
        if spec.sets:
            triton_by_servex.setdefault(spec.sets, []).append(spec.name)
    lines = [
        "# servex's flags",
        "",
        f"Generated from the flags' declarations (server/config/) by `{REGENERATE}`: do not edit it by hand, "
        "change the declarations and regenerate it (a test checks that it matches).",
        "",
        "Every flag of the `servex` command, by group, as `servex --help` lists them. servex takes TensorFlow "
        "Serving's flag names where it has them; with `--model-repository` it takes Triton's command line too. A "
        "boolean flag is given as `--flag`, `--flag=true` or `--flag=false`.",
    ]
    for title, flags in flag_groups():
        lines += ["", f"## {title}", "", "| flag | default | meaning | TensorFlow Serving / Triton |"]
        lines.append("| --- | --- | --- | --- |")
        for spec in flags:
            names = f"`--{spec.name}`" + "".join(f" (or `--{alias}`)" for alias in spec.aliases)
            meaning = spec.help
            if spec.repeatable and not spec.hidden and "repeatable" not in spec.help:
                meaning += " (repeatable)"
            meaning += f". {spec.doc}" if spec.doc else ""
            if spec.hidden:
                meaning += " (not in `--help`)"
            row = (names, _default_text(spec), meaning, _counterparts(spec, triton_by_servex))
            lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m servex.server.config.flags", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print docs/flags.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.error("nothing to do: give --markdown")
    sys.stdout.write(markdown())


if __name__ == "__main__":
    main()
