"""Triton's log and trace settings, one core for gRPC (``LogSettings``, ``TraceSetting``) and REST (``/v2/logging``,
``/v2/trace/setting``), as ``tritonclient``'s ``get_log_settings``, ``update_log_settings``,
``get_trace_settings`` and ``update_trace_settings`` call them.

Trace settings: Triton's, global and per model, kept by the process's tracer (server/observability/tracing.py and
trace_settings.py): ``trace_level`` (OFF, TIMESTAMPS), ``trace_rate``, ``trace_count``, ``log_frequency``, and,
read only, ``trace_file`` and ``trace_mode``.

Log settings (``LogSettings``) are Python's logging: which severities servex logs, read and changed at run time.

Triton's keys, and what they do here:

- ``log_info``, ``log_warning``, ``log_error`` (bool): log records of that severity (ERROR covers CRITICAL);
- ``log_verbose_level`` (uint32): above 0, DEBUG records too;
- ``log_file`` (string): only ``""``: servex logs to standard error, where Kubernetes collects it;
- ``log_format`` (string): only ``"default"``, servex's one format.

The start values follow ``--log_level``. A change applies to the process it reaches: with --serving_processes the
other processes would keep theirs, so changes are refused there (FAILED_PRECONDITION), as HandleReloadConfigRequest
is. The root logger's level is set to the lowest severity logged (records below it are never made), and a filter
on the root handlers drops the severities switched off above it (``log_info`` on with ``log_warning`` off).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from servex.loader.errors import FailedPrecondition, InvalidArgument
from servex.server.observability.tracing import TRACER

log = logging.getLogger("servex")

TYPES: dict[str, type] = {
    "log_file": str,
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
}
_FORMATS = ("default",)


class LogSettings:
    def __init__(self, process_group_size: int = 1):
        self.process_group_size = process_group_size
        level = logging.getLogger().getEffectiveLevel()
        self._values: dict[str, Any] = {
            "log_file": "",
            "log_info": level <= logging.INFO,
            "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR,
            "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default",
        }
        self._lock = threading.Lock()
        self._filter = _SeverityFilter(self)

    def values(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (Triton's keys to values of their types), all or none; the settings after."""
        if not changes:
            return self.values()
        unknown = sorted(set(changes) - set(TYPES))
        if unknown:
            raise InvalidArgument(f"unknown log setting(s) {unknown}; the settings are {sorted(TYPES)}")
        for key, value in changes.items():
            kind = TYPES[key]
            if type(value) is not kind or (kind is int and value < 0):
                what = {bool: "a boolean", int: "an unsigned integer", str: "a string"}[kind]
                raise InvalidArgument(f"log setting {key!r} must be {what}, got {value!r}")
        if changes.get("log_file", ""):
            raise InvalidArgument(f"log_file {changes['log_file']!r}: servex logs to standard error only (log_file '')")
        if changes.get("log_format", "default") not in _FORMATS:
            raise InvalidArgument(f"log_format {changes['log_format']!r} is not supported; supported: {list(_FORMATS)}")
        if self.process_group_size > 1:
            raise FailedPrecondition(
                f"log settings reach one of {self.process_group_size} serving processes (--serving_processes): "
                f"set --log_level, which every process takes"
            )
        with self._lock:
            self._values.update(changes)
            values = dict(self._values)
            self._apply(values)
        log.warning("log settings changed: %s", ", ".join(f"{k}={v}" for k, v in sorted(changes.items())))
        return values

    def _apply(self, values: dict[str, Any]) -> None:
        enabled = self._enabled(values)
        root = logging.getLogger()
        root.setLevel(min(enabled) if enabled else logging.CRITICAL + 1)
        for handler in root.handlers:
            if self._filter not in handler.filters:
                handler.addFilter(self._filter)

    @staticmethod
    def _enabled(values: dict[str, Any]) -> set[int]:
        levels = set()
        if values["log_verbose_level"] > 0:
            levels.add(logging.DEBUG)
        for key, level in (("log_info", logging.INFO), ("log_warning", logging.WARNING), ("log_error", logging.ERROR)):
            if values[key]:
                levels.add(level)
        return levels

    def logs(self, level: int) -> bool:
        """Whether a record of ``level`` is logged under the current settings."""
        values = self._values
        if level >= logging.ERROR:
            return values["log_error"]
        if level >= logging.WARNING:
            return values["log_warning"]
        if level >= logging.INFO:
            return values["log_info"]
        return values["log_verbose_level"] > 0


class _SeverityFilter(logging.Filter):
    def __init__(self, settings: LogSettings):
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        return self.settings.logs(record.levelno)


def trace_settings(core, model_name: str, changes: dict[str, list[str]]) -> dict[str, list[str]]:
    """The trace settings (of ``model_name``, which must be served, when given) after ``changes`` (an empty list
    clears a setting: a model's falls back to the global one), as Triton answers them (server/observability/
    trace_settings.py)."""
    if model_name:
        core.resolve(model_name)  # NOT_FOUND for a model not served, in Triton's words
    if not changes:
        return TRACER.settings.read(model_name)
    return TRACER.update(model_name, changes)
