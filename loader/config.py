"""Model configuration in TensorFlow Serving's text format (ModelServerConfig, read with protobuf's text_format).

``${NAME}`` in the file is replaced by the environment variable NAME (TensorFlow Serving's own test configs are
written that way); an unset variable is an error naming it. Only ``model_config_list`` is supported.
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
        specs.append(ModelSpec(model.name, model.base_path, policy, labels))
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
