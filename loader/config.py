"""Model configuration in TensorFlow Serving's text format (ModelServerConfig, read with protobuf's text_format).

``${NAME}`` in the file is replaced by the environment variable NAME (TensorFlow Serving's own test configs are
written that way); an unset variable is an error naming it. Only ``model_config_list`` is supported. A model's
``logging_config`` becomes its LoggingSpec (the request logs that server/observability/request_log.py writes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from servex.loader.errors import InvalidArgument

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model to serve: the ``latest`` N (default 1), ``all``, or ``specific`` ones."""

    kind: str = "latest"
    num_versions: int = 1
    versions: frozenset[int] = frozenset()

    def select(self, candidates: list[int]) -> list[int]:
        """The versions to serve among ``candidates`` (usable versions on disk), highest first."""
        ordered = sorted(candidates, reverse=True)
        if self.kind == "latest":
            return ordered[: self.num_versions]
        if self.kind == "all":
            return ordered
        return [v for v in ordered if v in self.versions]

    def describe(self) -> str:
        if self.kind == "latest":
            return f"latest {self.num_versions}"
        if self.kind == "all":
            return "all"
        return f"specific {sorted(self.versions)}"


# The log collectors servex has (LogCollectorConfig.type): TensorFlow Serving finds its collector by this name in a
# registry of factories and refuses a name none registered; servex has one, TFRecord files of PredictionLog records.
LOG_COLLECTOR_TYPES = ("tfrecord",)


@dataclass(frozen=True)
class LoggingSpec:
    """A model's request logging (TensorFlow Serving's ``logging_config``): the sampled calls' PredictionLog
    records, written to TFRecord files named from ``filename_prefix`` (made absolute)."""

    filename_prefix: str
    sampling_rate: float
    collector_type: str = "tfrecord"
    # The SamplingConfig as configured, serialized: each record's LogMetadata carries it, as TensorFlow Serving's do
    sampling_config: bytes = b""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base_path: str
    policy: VersionPolicy = VersionPolicy()
    labels: dict[str, int] = field(default_factory=dict)
    # The folder in each version folder that holds the SavedModel ('': the version folder itself, TensorFlow
    # Serving's layout; 'model.savedmodel' in a Triton model repository)
    model_file: str = ""
    # A Triton model repository's config.pbtxt (inference.ModelConfig), or None (loader/model_repository.py)
    triton_config: object | None = None
    # The model's logging_config (None: its calls are not logged)
    logging: LoggingSpec | None = None


def _policy(config: model_server_config_pb2.ModelConfig, where: str) -> VersionPolicy:
    policy = config.model_version_policy
    which = policy.WhichOneof("policy_choice")
    if which is None or which == "latest":
        # latest {} (num_versions 0) means 1, as in TensorFlow Serving
        return VersionPolicy("latest", num_versions=max(1, policy.latest.num_versions))
    if which == "all":
        return VersionPolicy("all")
    versions = frozenset(policy.specific.versions)
    if not versions:
        raise InvalidArgument(f"{where}: model_version_policy specific lists no versions")
    return VersionPolicy("specific", versions=versions)


def _logging(config: model_server_config_pb2.ModelConfig, where: str) -> LoggingSpec | None:
    """The model's LoggingSpec, None without a logging_config; InvalidArgument naming the field that is wrong."""
    if not config.HasField("logging_config"):
        return None
    logging_config = config.logging_config
    where = f"{where}: logging_config"
    collector = logging_config.log_collector_config
    if collector.type not in LOG_COLLECTOR_TYPES:
        raise InvalidArgument(
            f"{where}.log_collector_config.type {collector.type!r} is not a log collector servex has; set "
            f"type: {LOG_COLLECTOR_TYPES[0]!r} (TFRecord files of PredictionLog records)"
        )
    given = collector.filename_prefix
    if not given:
        raise InvalidArgument(
            f"{where}.log_collector_config.filename_prefix is empty: name where the log files go, e.g. "
            f"'/var/log/servex/requests' (files /var/log/servex/requests-<pid>-<n>.tfrecord)"
        )
    if "\0" in given:  # no file name holds one: opening the log files would fail with ValueError
        raise InvalidArgument(f"{where}.log_collector_config.filename_prefix {given!r} holds a NUL character")
    prefix = os.path.abspath(given)
    folder = os.path.dirname(prefix)
    if given.endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise InvalidArgument(
            f"{where}.log_collector_config.filename_prefix {given!r} names a directory: end it with the start of "
            f"the files' names, e.g. {os.path.join(prefix, 'requests')!r}"
        )
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        problem = "is not a directory servex can write to" if os.path.isdir(folder) else "does not exist"
        raise InvalidArgument(f"{where}.log_collector_config.filename_prefix {given!r}: directory {folder!r} {problem}")
    sampling = logging_config.sampling_config
    rate = sampling.sampling_rate
    if not 0.0 <= rate <= 1.0:  # NaN too
        raise InvalidArgument(f"{where}.sampling_config.sampling_rate {rate} is outside [0, 1]")
    if sampling.per_task_sampling_configs:
        raise InvalidArgument(
            f"{where}.sampling_config.per_task_sampling_configs is not supported (servex has no datacenter or task "
            f"index to match them with): set sampling_rate"
        )
    if logging_config.HasField("custom_logging_config"):
        raise InvalidArgument(f"{where}.custom_logging_config is not supported: servex's logger takes no custom config")
    return LoggingSpec(prefix, rate, collector.type, sampling.SerializeToString(deterministic=True))


def specs_from_proto(
    config: model_server_config_pb2.ModelServerConfig, source: str = "config", replacing: bool = False
) -> list[ModelSpec]:
    """Validate a ModelServerConfig and turn it into ModelSpecs; InvalidArgument names what is wrong.

    ``replacing``: the config replaces one in effect (a reload, a changed config file). It must then set a
    model_config_list, as TensorFlow Serving requires: a message or file that sets nothing (an empty reload, a
    file caught half-written) would otherwise unload every model. An empty ``model_config_list {}`` still does.
    """
    kind = config.WhichOneof("config")
    if kind == "custom_model_config":
        raise InvalidArgument(f"{source}: custom_model_config is not supported; use model_config_list")
    if kind is None and replacing:
        raise InvalidArgument(
            f"{source} sets no model_config_list: only a model_config_list can replace the models served (as in "
            f"TensorFlow Serving); the models stay as they are. To unload every model, send an empty one: "
            f"model_config_list {{}}"
        )
    specs, seen = [], set()
    for i, model in enumerate(config.model_config_list.config):
        where = f"{source}: model_config_list.config[{i}]" + (f" ({model.name!r})" if model.name else "")
        if not model.name:
            raise InvalidArgument(f"{where}: name is empty")
        if model.name in seen:
            raise InvalidArgument(f"{where}: model name {model.name!r} appears twice")
        seen.add(model.name)
        if not model.base_path:
            raise InvalidArgument(f"{where}: base_path is empty")
        if model.model_platform not in ("", "tensorflow"):
            raise InvalidArgument(f"{where}: model_platform {model.model_platform!r} is not supported; use tensorflow")
        policy = _policy(model, where)
        labels = dict(model.version_labels)
        if policy.kind == "specific":
            stray = {label: v for label, v in labels.items() if v not in policy.versions}
            if stray:
                raise InvalidArgument(f"{where}: version_labels {stray} name versions outside the specific policy")
        specs.append(ModelSpec(model.name, model.base_path, policy, labels, logging=_logging(model, where)))
    return specs


def parse_model_config(text: str, source: str = "config", replacing: bool = False) -> list[ModelSpec]:
    """Parse a model config file's text (after ``${VAR}`` expansion) into ModelSpecs (``replacing``: as in
    ``specs_from_proto``)."""
    missing = sorted({m.group(1) for m in _VARIABLE.finditer(text) if m.group(1) not in os.environ})
    if missing:
        raise InvalidArgument(f"{source}: environment variable(s) {missing} used in the file are not set")
    expanded = _VARIABLE.sub(lambda m: os.environ[m.group(1)], text)
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(expanded, config)
    except text_format.ParseError as e:
        raise InvalidArgument(
            f"{source} is not a ModelServerConfig in protobuf text format "
            f"(e.g. model_config_list {{ config {{ name: 'm' base_path: '/models/m' }} }}): {e}"
        ) from e
    return specs_from_proto(config, source, replacing)


def read_model_config_file(path: str) -> list[ModelSpec]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read model config file {path!r}: {e.strerror}") from e
    return parse_model_config(text, f"model config file {path!r}")
