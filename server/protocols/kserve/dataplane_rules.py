"""The KServe v2 data plane's typed requests and answers, and the rules every request is checked by, whichever
transport brought it (server/protocols/kserve/dataplane.py serves them).

Request parameters arrive here as plain Python values: REST's JSON values as parsed, gRPC's ``InferParameter``
oneofs turned into the value they hold (``v2_types.parameter_values``; an InferParameter holding nothing is None).
So one function checks each parameter, with one message, for both transports:

- ``priority`` (an integer, larger runs first, -100..100: servex's priority, as the ``x-servex-priority`` metadata
  or header, which it overrides), ``timeout`` (microseconds the request may wait to start, Triton's; 0: none),
  ``signature_name`` (servex's extension: the signature to run, default ``serving_default``),
  ``binary_data_output`` (REST's binary tensor extension: the outputs the request does not name come binary);
- per output: ``classification`` (Triton's classification extension: the top N classes), ``binary_data``,
  ``shared_memory_region`` / ``shared_memory_byte_size`` / ``shared_memory_offset`` (Triton's system shared
  memory: the output is written there; inputs name their place with the same parameters);
- the repository load's ``base_path`` (a folder of version folders).

Version strings (``model_version``, REST's ``/versions/{v}``) are "" for the latest or a decimal int64, as Triton's
``std::stoll`` reads them (leading zeros allowed).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any, NamedTuple

import numpy as np

from servex.loader.errors import InvalidArgument, ServingError
from servex.server.core import RequestInfo, checked_priority
from servex.server.protocols.kserve.repository import BASE_PATH
from servex.server.transport import json_codec as codec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PRIORITY = "priority"
TIMEOUT = "timeout"
SIGNATURE_NAME = "signature_name"
BINARY_DATA_OUTPUT = "binary_data_output"
BINARY_DATA = "binary_data"
CLASSIFICATION = "classification"
SHARED_MEMORY_REGION = "shared_memory_region"
SHARED_MEMORY_BYTE_SIZE = "shared_memory_byte_size"
SHARED_MEMORY_OFFSET = "shared_memory_offset"
SERVER_NAME = "servex"
# The server version when servex's package metadata is missing (a source tree run without installing): a version
# number all the same, as Triton always answers one.
NO_VERSION = "0.0.0"


@functools.cache
def server_version() -> str:
    try:
        return metadata.version("servex")
    except metadata.PackageNotFoundError:
        return NO_VERSION


# -- typed requests and answers ---------------------------------------------------------------------------------


class Place(NamedTuple):
    """A tensor's place in a registered shared memory region."""

    region: str
    offset: int
    byte_size: int


@dataclasses.dataclass
class RequestedOutput:
    name: str
    classification: int = 0  # the top N classes asked (Triton's classification extension); 0: the tensor itself
    binary: bool | None = None  # REST's binary_data; None: not asked (the request's binary_data_output decides)
    place: Place | None = None  # where in shared memory to write it; None: in the answer


@dataclasses.dataclass
class InferRequest:
    model: str
    version: int | None  # None: the latest
    id: str = ""
    outputs: list[RequestedOutput] = dataclasses.field(default_factory=list)  # none: every output
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)  # as sent (checked)
    signature: str = ""  # "": serving_default
    binary_output: bool = False  # REST: outputs not named come binary
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # decoded arrays, by name

    def classes(self) -> dict[str, int]:
        return {o.name: o.classification for o in self.outputs if o.classification}

    def places(self) -> dict[str, Place]:
        return {o.name: o.place for o in self.outputs if o.place is not None}

    def binary(self) -> dict[str, bool]:
        """REST's choice per named output (Triton's rule: a named output is JSON unless it asks for binary)."""
        return {o.name: bool(o.binary) for o in self.outputs}


@dataclasses.dataclass
class InferAnswer:
    model_name: str
    model_version: str
    id: str  # the request's ("" is not echoed, as Triton leaves it out)
    outputs: dict[str, np.ndarray]  # classified where asked; each has a v2 datatype
    request: InferRequest


@dataclasses.dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: list[int]

    def as_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape}


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "versions": self.versions,
            "platform": self.platform,
            "inputs": [t.as_dict() for t in self.inputs],
            "outputs": [t.as_dict() for t in self.outputs],
        }


@dataclasses.dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "extensions": list(self.extensions)}


@dataclasses.dataclass(frozen=True)
class ModelReadiness:
    name: str
    ready: bool
    error: ServingError | None = None  # why not ready


# -- the rules ----------------------------------------------------------------------------------------------------


def cut(text: str, limit: int = 40) -> str:
    """``text`` for an error message, cut to about ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def parse_version(text: str) -> int | None:
    """A v2 model version: "" is the latest (None), else a decimal number up to int64's largest;
    INVALID_ARGUMENT otherwise (never int() of thousands of digits)."""
    if not text:
        return None
    digits = text.lstrip("0") or "0"
    if not (text.isascii() and text.isdigit()) or len(digits) > 19 or int(digits) > INT64_MAX:
        shown = cut(text)
        # Triton's words first: its own client examples look for them
        raise InvalidArgument(
            f"failed to get model version from specified version string {shown!r}: model version {shown!r} is not "
            f'a version number; send "" for the latest or e.g. "1"'
        )
    return int(digits)


def integer(value: Any, where: str, meaning: str) -> int:
    """``value`` as an int64; INVALID_ARGUMENT naming ``where`` (e.g. "parameter 'priority'") and ``meaning``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where} must be an integer ({meaning}), got {codec.show(value)}")
    if value > INT64_MAX:
        raise InvalidArgument(f"{where} is {value}, more than the largest int64 {INT64_MAX}")
    if value < INT64_MIN:
        raise InvalidArgument(f"{where} is {value}, less than the smallest int64 {INT64_MIN}")
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where} must be true or false, got {codec.show(value)}")
    return value


def string(value: Any, where: str, meaning: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string ({meaning}), got {codec.show(value)}")
    return value


def priority(value: Any) -> int:
    """The ``priority`` parameter as servex's priority (larger runs first); tritonclient's ``priority=`` sends it as
    uint64_param over gRPC, an integer over REST."""
    where = f"parameter {PRIORITY!r}"
    return checked_priority(integer(value, where, "larger runs first"), where)


def timeout_micros(value: Any) -> int:
    """The ``timeout`` parameter: microseconds the request may wait to start (Triton's); 0 or less: none."""
    return integer(value, f"parameter {TIMEOUT!r}", "microseconds")


def apply_parameters(parameters: Mapping[str, Any], info: RequestInfo | None) -> None:
    """Set the call's priority and deadline from the request's ``priority`` and ``timeout`` parameters: the
    priority wins over the metadata's; a timeout only shortens the call's own deadline, never lengthens it."""
    if PRIORITY in parameters:
        value = priority(parameters[PRIORITY])
        if info is not None:
            info.priority = value
    if TIMEOUT in parameters:
        micros = timeout_micros(parameters[TIMEOUT])
        if micros > 0 and info is not None:
            deadline = time.monotonic() + micros / 1e6
            info.deadline = deadline if info.deadline is None else min(info.deadline, deadline)


def place(parameters: Mapping[str, Any], tensor: str) -> Place:
    """An input's or output's place in shared memory (``tensor``: e.g. "input 'x'") from its parameters: the
    region's name, the offset in it (``shared_memory_offset``, default 0) and the byte size."""
    region = parameters[SHARED_MEMORY_REGION]
    if not isinstance(region, str):
        raise InvalidArgument(f"{tensor}: parameter {SHARED_MEMORY_REGION!r} must be a string naming a region, got "
                              f"{codec.show(region)}")  # fmt: skip
    if SHARED_MEMORY_BYTE_SIZE not in parameters:
        raise InvalidArgument(f"{tensor}: a shared memory region needs parameter {SHARED_MEMORY_BYTE_SIZE!r}")
    size = integer(parameters[SHARED_MEMORY_BYTE_SIZE], f"{tensor}: parameter {SHARED_MEMORY_BYTE_SIZE!r}", "bytes")
    offset = integer(parameters.get(SHARED_MEMORY_OFFSET, 0), f"{tensor}: parameter {SHARED_MEMORY_OFFSET!r}", "bytes")
    return Place(region, offset, size)


def classification_count(value: Any, output: str) -> int:
    count = integer(value, f"output {output!r}: parameter {CLASSIFICATION!r}", "top N")
    if count < 1:
        raise InvalidArgument(
            f"output {output!r}: parameter {CLASSIFICATION!r} is {count}; ask for at least 1 class (the top N)"
        )
    return count


def requested_outputs(outputs: Sequence[tuple[Any, Mapping[str, Any]]]) -> list[RequestedOutput]:
    """The outputs a request names, as (name, parameters) pairs, checked: each named once."""
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, (name, params) in enumerate(outputs):
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"outputs[{i}] has no 'name' (a string naming the output)")
        if name in seen:
            raise InvalidArgument(f"output {name!r} is requested twice")
        seen.add(name)
        out = RequestedOutput(name)
        if CLASSIFICATION in params:
            out.classification = classification_count(params[CLASSIFICATION], name)
        if SHARED_MEMORY_REGION in params:
            out.place = place(params, f"output {name!r}")
        if BINARY_DATA in params:
            out.binary = boolean(params[BINARY_DATA], f"output {name!r}: parameter {BINARY_DATA!r}")
        requested.append(out)
    return requested


def infer_request(
    model: str,
    version: str,
    request_id: str = "",
    parameters: Mapping[str, Any] | None = None,
    outputs: Sequence[tuple[Any, Mapping[str, Any]]] = (),
    info: RequestInfo | None = None,
) -> InferRequest:
    """An inference request's model, version, parameters and outputs, checked in this order (its inputs, which
    each transport decodes its own way, come after); sets ``info``'s priority and deadline."""
    parsed = parse_version(version)
    if not model:
        raise InvalidArgument("model_name is empty: name the model to call")
    parameters = dict(parameters or {})
    apply_parameters(parameters, info)
    binary_output = boolean(parameters.get(BINARY_DATA_OUTPUT, False), f"parameter {BINARY_DATA_OUTPUT!r}")
    signature = string(parameters.get(SIGNATURE_NAME, ""), f"parameter {SIGNATURE_NAME!r}", "a signature's name")
    return InferRequest(model, parsed, request_id, requested_outputs(outputs), parameters, signature, binary_output)


def base_path(model: str, parameters: Mapping[str, Any]) -> str | None:
    """A repository load's ``base_path`` parameter (a folder of version folders), None when absent."""
    if BASE_PATH not in parameters:
        return None
    value = parameters[BASE_PATH]
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"failed to load {model!r}: parameter {BASE_PATH!r} must be a string naming a folder, "
                              f"got {codec.show(value)}")  # fmt: skip
    return value
