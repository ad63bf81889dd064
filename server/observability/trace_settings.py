"""Trace settings as Triton keeps them: global ones from ``--trace_config`` (Triton's ``--trace-config``), and per
model ones that Triton's trace extension (gRPC ``TraceSetting``, REST ``/v2[/models/M]/trace/setting``) sets over
them. A model's setting that was never given, or was cleared, is the global one of the moment.

The settings (Triton's names and wire spelling, every value a string or a list of strings):

- ``trace_level``: ``["OFF"]`` or ``["TIMESTAMPS"]`` (TENSORS is refused: servex does not copy tensors into traces);
- ``trace_rate``: one request of every ``trace_rate`` is traced (1000; a caller's sampled W3C ``traceparent`` is
  traced whatever the rate);
- ``trace_count``: traces left to take, -1 for no limit (-1);
- ``log_frequency``: Triton mode writes its trace file every this many traces, 0: at exit (0);
- ``trace_file``: Triton mode's JSON trace file, set at start only, as in Triton;
- ``trace_mode``: ``triton`` (a JSON file in Triton's format) or ``opentelemetry`` (OTLP), set at start only.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


def _error(kind: str, message: str) -> Exception:
    """loader's InvalidArgument or Unimplemented, imported when raised: the CLI checks --trace_config before
    TensorFlow (which the loader package imports) is imported."""
    from servex.loader import errors

    return getattr(errors, kind)(message)


LEVELS = ("OFF", "TIMESTAMPS")
MODES = ("triton", "opentelemetry")
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
# --trace_config's global keys (Triton's), and the settings they set
GLOBAL_KEYS = {"level": "trace_level", "rate": "trace_rate", "count": "trace_count", "mode": "trace_mode"}
TRITON_KEYS = {"file": "trace_file", "log-frequency": "log_frequency"}
OPENTELEMETRY_KEYS = ("url", "resource", "bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size")
UPDATABLE = ("trace_level", "trace_rate", "trace_count", "log_frequency")


@dataclass(frozen=True)
class TraceValues:
    """One set of effective settings."""

    level: str = "OFF"
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0

    def as_settings(self) -> dict[str, list[str]]:
        return {
            "trace_level": [self.level],
            "trace_rate": [str(self.rate)],
            "trace_count": [str(self.count)],
            "log_frequency": [str(self.log_frequency)],
        }


@dataclass(frozen=True)
class TraceConfig:
    """What ``--trace_config`` gave: the global settings, the mode, Triton's file and OpenTelemetry's options."""

    values: TraceValues = TraceValues()
    mode: str = "triton"
    file: str = ""
    opentelemetry: dict[str, str] = field(default_factory=dict)
    resource: dict[str, str] = field(default_factory=dict)


def parse_trace_config(entries: tuple[str, ...] | list[str]) -> TraceConfig:
    """``--trace_config`` values, Triton's syntax: ``level=TIMESTAMPS``, ``rate=100``, ``count=-1``,
    ``mode=opentelemetry``, ``triton,file=/tmp/trace.json``, ``triton,log-frequency=50``,
    ``opentelemetry,url=HOST:PORT``, ``opentelemetry,resource=KEY=VALUE``, ``opentelemetry,bsp_...=N``. Raises
    ValueError naming the entry and what is accepted."""
    values: dict[str, list[str]] = {}
    mode, file, otel, resource = "triton", "", {}, {}
    for entry in entries:
        scope, _, setting = entry.partition(",") if "," in entry.split("=", 1)[0] else ("", "", entry)
        key, eq, value = setting.partition("=")
        if not eq:
            raise ValueError(f"--trace_config {entry!r}: expected [MODE,]SETTING=VALUE")
        if scope == "":
            if key not in GLOBAL_KEYS:
                raise ValueError(
                    f"--trace_config {entry!r}: unknown global setting {key!r}; known: {sorted(GLOBAL_KEYS)}"
                )
            if key == "mode":
                if value not in MODES:
                    raise ValueError(f"--trace_config {entry!r}: mode must be one of {list(MODES)}")
                mode = value
            elif key == "level":
                values.setdefault("trace_level", []).append(value.upper())
            else:
                values[GLOBAL_KEYS[key]] = [value]
        elif scope == "triton":
            if key not in TRITON_KEYS:
                raise ValueError(
                    f"--trace_config {entry!r}: unknown triton setting {key!r}; known: {sorted(TRITON_KEYS)}"
                )
            if key == "file":
                file = value
            else:
                values["log_frequency"] = [value]
        elif scope == "opentelemetry":
            if key not in OPENTELEMETRY_KEYS:
                raise ValueError(
                    f"--trace_config {entry!r}: unknown opentelemetry setting {key!r}; "
                    f"known: {list(OPENTELEMETRY_KEYS)}"
                )
            if key == "resource":
                rkey, req, rvalue = value.partition("=")
                if not req or not rkey:
                    raise ValueError(f"--trace_config {entry!r}: expected opentelemetry,resource=KEY=VALUE")
                resource[rkey] = rvalue
            else:
                otel[key] = value
        else:
            raise ValueError(f"--trace_config {entry!r}: unknown mode {scope!r}; expected one of {list(MODES)}")
    try:
        parsed = apply_changes(TraceValues(), values, "--trace_config")
    except Exception as e:  # InvalidArgument
        raise ValueError(getattr(e, "message", str(e))) from None
    for key in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
        if key in otel and not (otel[key].isdigit() and int(otel[key]) > 0):
            raise ValueError(f"--trace_config opentelemetry,{key}={otel[key]!r}: expected a positive integer")
    return TraceConfig(parsed, mode, file, otel, resource)


def _integer(key: str, values: list[str], low: int, high: int, where: str) -> int:
    if len(values) != 1:
        raise _error("InvalidArgument", f"expect only 1 value for '{key}', got {len(values)} ({where})")
    text = values[0].strip()
    try:
        number = int(text)
    except ValueError:
        raise _error(
            "InvalidArgument", f"Unable to parse '{key}', got: {values[0]} (expected an integer from {low} to {high})"
        ) from None
    if not low <= number <= high:
        raise _error(
            "InvalidArgument", f"Unable to parse '{key}', value is out of range [ {low}, {high} ], got: {values[0]}"
        )
    return number


def _level(values: list[str]) -> str:
    levels = [v.upper() for v in values]
    unknown = [v for v in levels if v not in (*LEVELS, "TENSORS")]
    if unknown:
        raise _error("InvalidArgument", f"unknown trace_level {unknown}; expected 'OFF' or 'TIMESTAMPS'")
    if "TENSORS" in levels:
        raise _error(
            "Unimplemented",
            "trace_level TENSORS is not supported: servex traces TIMESTAMPS (use 'TIMESTAMPS' or 'OFF')",
        )
    if "OFF" in levels and len(levels) > 1:
        raise _error("InvalidArgument", "Expect only one trace level 'OFF' is specified")
    return levels[0]


def apply_changes(base: TraceValues, changes: dict[str, list[str]], where: str) -> TraceValues:
    """``base`` with ``changes`` (each a non-empty list of strings) applied; InvalidArgument naming a bad one."""
    updates = {}
    for key, values in changes.items():
        if key == "trace_level":
            updates["level"] = _level(values)
        elif key == "trace_rate":
            updates["rate"] = _integer(key, values, 1, UINT32_MAX, where)
        elif key == "trace_count":
            updates["count"] = _integer(key, values, -1, INT32_MAX, where)
        elif key == "log_frequency":
            updates["log_frequency"] = _integer(key, values, 0, UINT32_MAX, where)
    return dataclasses.replace(base, **updates)


class TraceSettings:
    """The global settings and each model's own (only what it set, parsed); thread-safe. ``sample`` decides
    whether a request is traced, counting Triton's rate and count down."""

    def __init__(self, config: TraceConfig = TraceConfig()):
        self.config = config
        self.global_values = config.values
        self._models: dict[str, dict[str, int | str]] = {}
        self._seen: dict[str, int] = {}  # requests counted toward each rate: per model with its own rate, else ""
        self._lock = threading.Lock()

    def effective(self, model: str) -> TraceValues:
        own = self._models.get(model)
        return dataclasses.replace(self.global_values, **own) if own else self.global_values

    def any_on(self) -> bool:
        return self.global_values.level != "OFF" or any(
            own.get("level", "OFF") != "OFF" for own in self._models.values()
        )

    def sample(self, model: str, parent_sampled: bool = False) -> bool:
        """Whether this request of ``model`` is traced: its level is on, traces are left (``trace_count``), and it
        is the ``trace_rate``-th request since the last one traced, or its caller's trace is sampled."""
        with self._lock:
            own = self._models.get(model) or {}
            values = dataclasses.replace(self.global_values, **own) if own else self.global_values
            if values.level == "OFF" or values.count == 0:
                return False
            rate_owner = model if "rate" in own else ""
            seen = self._seen.get(rate_owner, 0) + 1
            hit = parent_sampled or seen >= values.rate
            self._seen[rate_owner] = 0 if hit else seen
            if hit and values.count > 0:
                if "count" in own:
                    own["count"] = values.count - 1
                else:
                    self.global_values = dataclasses.replace(self.global_values, count=values.count - 1)
            return hit

    def update(self, model: str, changes: dict[str, list[str]]) -> dict[str, list[str]]:
        """Apply Triton's trace setting changes (an empty list clears a setting) to ``model``'s settings, or the
        global ones for ``""``; returns the settings after, in Triton's shape. Nothing changes when one is bad."""
        for key in changes:
            if key == "trace_file":
                raise _error("Unimplemented", "trace file location can not be updated through network protocol")
            if key == "trace_mode":
                raise _error("Unimplemented", "trace_mode can not be updated through network protocol: set it at start")
            if key not in UPDATABLE:
                raise _error("InvalidArgument", f"unknown trace setting {key!r}; expected one of {list(UPDATABLE)}")
        given = apply_changes(TraceValues(), {k: v for k, v in changes.items() if v}, "the request")
        set_fields = {_FIELD[k]: getattr(given, _FIELD[k]) for k, v in changes.items() if v}
        cleared = {_FIELD[k] for k, v in changes.items() if not v}
        with self._lock:
            if model:
                own = {k: v for k, v in self._models.get(model, {}).items() if k not in cleared}
                self._models[model] = {**own, **set_fields}
                if "rate" in cleared:
                    self._seen.pop(model, None)
            else:
                defaults = self.config.values
                self.global_values = dataclasses.replace(
                    self.global_values, **set_fields, **{f: getattr(defaults, f) for f in cleared}
                )
        return self.read(model)

    def read(self, model: str) -> dict[str, list[str]]:
        settings = self.effective(model).as_settings()
        if self.config.mode == "triton":
            settings["trace_file"] = [self.config.file]
        else:
            settings.pop("log_frequency")
        settings["trace_mode"] = [self.config.mode]
        return settings

    def forget(self, model: str) -> None:
        with self._lock:
            self._models.pop(model, None)
            self._seen.pop(model, None)


_FIELD = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency"}
