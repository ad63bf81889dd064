"""A Triton model repository (``--model-repository``), read into the ModelSpecs servex serves.

Triton's layout, for TensorFlow SavedModels::

    REPOSITORY/NAME/config.pbtxt                       the model's ModelConfig in text format (optional)
    REPOSITORY/NAME/VERSION/model.savedmodel/          a version: a SavedModel (saved_model.pb, variables/)

Each folder of a repository is a model named by the folder (hidden folders are skipped). Its ``config.pbtxt`` is
read as Triton's ``inference.ModelConfig`` (protos/inference/model_config.proto, every field Triton has, so a
misspelt field is an error, as in Triton). What servex takes from it:

- ``name``: empty or the folder's name;
- ``platform`` ``tensorflow_savedmodel`` and/or ``backend`` ``tensorflow`` (or neither: a SavedModel is assumed,
  as Triton's auto-complete finds it); another platform or backend is refused, naming it;
- ``default_model_filename``: the folder in each version folder that holds the SavedModel (``model.savedmodel``);
- ``version_policy``: latest N (default 1), all, specific;
- ``max_batch_size``, ``input``, ``output``, ``dynamic_batching``: checked against the SavedModel's
  ``serving_default`` signature when a version loads, the model's contract, and batching per model
  (server/protocols/kserve/v2_config.py);
- ``parameters`` ``TF_SIGNATURE_DEF`` and ``TF_GRAPH_TAG``: only their defaults (``serving_default``, ``serve``).

Sequence batching, ensembles and batch inputs/outputs are refused (REFUSED); fields that change nothing in servex
(instance groups, optimization, rate limiting, Triton's warm-up, response cache, ...) come back as notes for the
caller to log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from google.protobuf import text_format

from servex.loader.config import ModelSpec, VersionPolicy
from servex.loader.errors import InvalidArgument
from servex.protos.inference import model_config_module

CONFIG_FILE = "config.pbtxt"
DEFAULT_MODEL_FILENAME = "model.savedmodel"
PLATFORM = "tensorflow_savedmodel"
BACKEND = "tensorflow"
# Triton's TensorFlow backend's parameters, and the values servex serves (the only ones)
SUPPORTED_PARAMETERS = {"TF_SIGNATURE_DEF": "serving_default", "TF_GRAPH_TAG": "serve"}
# ModelConfig fields servex acts on; the others are refused (REFUSED) or noted as changing nothing
_USED = {"name", "platform", "backend", "default_model_filename", "version_policy", "max_batch_size", "input",
         "output", "dynamic_batching", "parameters"}  # fmt: skip
REFUSED = {
    "sequence_batching": "servex does not do sequence batching (stateful models)",
    "ensemble_scheduling": "servex does not run ensembles",
    "batch_input": "servex does not make batch inputs",
    "batch_output": "servex does not split batch outputs",
}


@dataclass(frozen=True)
class Repository:
    """What a repository read gave: the models servex can serve, the notes on fields that change nothing (to log),
    and the models it cannot serve, each with the reason."""

    specs: list[ModelSpec]
    notes: list[str]
    refused: dict[str, str]


def read_repositories(paths: list[str]) -> Repository:
    """Read every repository of ``paths`` (Triton takes several); a model name in two of them is refused in both,
    as Triton refuses it. InvalidArgument when a repository folder is missing."""
    found: dict[str, list[tuple[str, str]]] = {}  # name -> [(repository, folder)]
    for root in paths:
        if not os.path.isdir(root):
            raise InvalidArgument(f"model repository {root!r} does not exist or is not a directory")
        for entry in sorted(os.listdir(root)):
            folder = os.path.join(root, entry)
            if not entry.startswith(".") and os.path.isdir(folder):
                found.setdefault(entry, []).append((root, folder))
    specs, notes, refused = [], [], {}
    for name, places in sorted(found.items()):
        if len(places) > 1:
            where = ", ".join(repr(root) for root, _ in places)
            refused[name] = f"model {name!r} is in more than one model repository ({where}): rename one"
            continue
        try:
            spec, spec_notes = read_model(name, places[0][1])
        except InvalidArgument as e:
            refused[name] = e.message
            continue
        specs.append(spec)
        notes.extend(spec_notes)
    return Repository(specs, notes, refused)


def read_model(name: str, folder: str) -> tuple[ModelSpec, list[str]]:
    """One model folder: its spec (base path the folder, the SavedModel in each version's ``model_file``) and the
    notes on config fields that change nothing. InvalidArgument, naming the file and field, when servex cannot
    serve it as configured."""
    config = model_config_module().ModelConfig()
    path = os.path.join(folder, CONFIG_FILE)
    where = f"model {name!r}"
    if os.path.isfile(path):
        where = f"model {name!r} ({path})"
        try:
            with open(path, encoding="utf-8") as f:
                text_format.Parse(f.read(), config)
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"{where}: cannot read the model configuration: {e}") from e
        except text_format.ParseError as e:
            raise InvalidArgument(f"{where} is not a Triton ModelConfig in protobuf text format: {e}") from e
    if config.name and config.name != name:
        raise InvalidArgument(
            f"{where}: the configuration names model {config.name!r}, but its folder is {name!r}: "
            f"they must be the same (or leave name out)"
        )
    if config.platform not in ("", PLATFORM) or config.backend not in ("", BACKEND):
        given = " and ".join(
            f"{field} {value!r}" for field, value in (("platform", config.platform), ("backend", config.backend))
            if value
        )  # fmt: skip
        raise InvalidArgument(
            f"{where}: {given} cannot be served: servex serves TensorFlow SavedModels "
            f"(platform {PLATFORM!r}, backend {BACKEND!r})"
        )
    given = {f.name for f, _ in config.ListFields()}
    for field, reason in REFUSED.items():
        if field in given:
            raise InvalidArgument(f"{where}: {field} is set, and {reason}")
    for key, param in config.parameters.items():
        supported = SUPPORTED_PARAMETERS.get(key)
        if supported is not None and param.string_value not in ("", supported):
            raise InvalidArgument(
                f"{where}: parameter {key} {param.string_value!r} is not supported: servex serves {supported!r} only"
            )
    if config.max_batch_size < 0:
        raise InvalidArgument(f"{where}: max_batch_size must be 0 or more, got {config.max_batch_size}")
    if config.HasField("dynamic_batching") and config.max_batch_size == 0:
        raise InvalidArgument(
            f"{where}: dynamic_batching needs max_batch_size > 0 (the most rows a batch may hold), as in Triton"
        )
    model_file = config.default_model_filename or DEFAULT_MODEL_FILENAME
    if os.sep in model_file or "\0" in model_file or model_file in (".", ".."):
        raise InvalidArgument(
            f"{where}: default_model_filename {model_file!r} must name a folder in the version folder"
        )
    ignored = sorted(given - _USED - set(REFUSED))
    other_parameters = sorted(set(config.parameters) - set(SUPPORTED_PARAMETERS))
    notes = []
    if ignored:
        notes.append(f"{where}: {', '.join(ignored)}: Triton settings that change nothing in servex")
    if other_parameters:
        notes.append(f"{where}: parameters {', '.join(other_parameters)}: change nothing in servex")
    return ModelSpec(name, folder, _policy(config, where), model_file=model_file, triton_config=config), notes


def _policy(config, where: str) -> VersionPolicy:
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which is None:
        return VersionPolicy("latest", num_versions=1)
    if which == "latest":
        if policy.latest.num_versions < 1:  # Triton fails such a model: no version is under its policy
            raise InvalidArgument(f"{where}: version_policy latest num_versions must be at least 1 (no version "
                                  f"would be available under the version policy)")  # fmt: skip
        return VersionPolicy("latest", num_versions=policy.latest.num_versions)
    if which == "all":
        return VersionPolicy("all")
    versions = frozenset(policy.specific.versions)
    if not versions:
        raise InvalidArgument(f"{where}: version_policy specific lists no versions")
    return VersionPolicy("specific", versions=versions)
