"""The KServe v2 data plane: what servex answers to a KServe v2 / Triton client, once, whichever transport the
request came by. The gRPC adapter (server/protocols/kserve/grpc_api.py, ``inference.GRPCInferenceService``) and the
REST adapter (server/protocols/kserve/rest_api.py, ``/v2/...``) turn their requests into the typed requests of
server/protocols/kserve/dataplane_rules.py (plain Python values), call a ``DataPlane`` and encode its answers; each
keeps only its transport's own parts (REST's JSON and binary tensor extension, gRPC's raw contents and streaming).

``DataPlane`` also holds the state only Triton's protocol has (none of it is the ServingCore's): the system shared
memory regions (server/protocols/kserve/shared_memory.py), Triton's log settings
(server/protocols/kserve/v2_settings.py) and the model repository extension where the inference ports serve it
(server/protocols/kserve/repository.py: explicit model control of a Triton model repository; else None, and the
admin port serves it). The app makes one and hands it to both adapters.

A v2 model is a servex model; its tensors are the ``serving_default`` signature's input and output aliases (a model
without that signature serves all the same, with none to describe).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from servex.loader.errors import InvalidArgument, ServingError, Unimplemented
from servex.loader.manager import AVAILABLE
from servex.server.core import DEFAULT_SIGNATURE, REQUEST, RequestInfo, ServingCore
from servex.server.protocols.kserve import v2_config, v2_settings, v2_stats, v2_types
from servex.server.protocols.kserve.dataplane_rules import (
    SERVER_NAME,
    InferAnswer,
    InferRequest,
    ModelMetadata,
    ModelReadiness,
    ServerMetadata,
    TensorMetadata,
    base_path,
    infer_request,
    integer,
    parse_version,
    server_version,
)
from servex.server.protocols.kserve.repository import ModelRepository
from servex.server.protocols.kserve.shared_memory import NO_CUDA_MEMORY, SharedMemoryRegistry
from servex.server.protocols.kserve.v2_config import PLATFORM
from servex.server.protocols.kserve.v2_settings import LogSettings
from servex.server.transport import json_codec as codec

REPOSITORY_EXTENSION = "model_repository"
# What ServerMetadata lists on the admin port: the model repository extension, the one it serves.
ADMIN_EXTENSIONS = (REPOSITORY_EXTENSION,)


def metadata_datatype(dtype) -> str:
    """A tensor's datatype in model metadata: its v2 datatype, or for a dtype with none (complex, ...) the NumPy
    name in v2's upper case (``COMPLEX64``): a client sees what the tensor is, though v2 cannot carry it."""
    try:
        return v2_types.datatype(dtype)
    except ValueError:
        return np.dtype(dtype).name.upper()


def tensor_metadata(name: str, spec) -> TensorMetadata:
    shape = [-1] if spec.shape is None else [-1 if d is None else d for d in spec.shape]
    return TensorMetadata(name, metadata_datatype(spec.dtype), shape)


class DataPlane:
    def __init__(
        self,
        core: ServingCore,
        *,
        shared_memory: SharedMemoryRegistry | None = None,
        log_settings: LogSettings | None = None,
        repository: ModelRepository | None = None,
    ):
        self.core = core
        # Triton's system shared memory regions, of both transports; an input read from one is a decoded input
        # tensor, bounded by --max_message_bytes as any other.
        self.shared_memory = shared_memory or SharedMemoryRegistry(max_read_bytes=core.max_tensor_bytes)
        self.log_settings = log_settings or LogSettings()  # Triton's log settings, of both transports
        # The model repository extension where the inference ports serve it (explicit model control of a Triton
        # model repository, as Triton serves it); else None: the admin port serves it.
        self.repository = repository
        # served version -> the tensors its metadata lists (a version's signature never changes)
        self._tensors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- server -----------------------------------------------------------------------------------------------

    def server_metadata(self, extensions: tuple[str, ...] | None = None) -> ServerMetadata:
        """The name, version and extensions (the inference ports', unless ``extensions`` says another port's)."""
        if extensions is None:
            extensions = v2_types.EXTENSIONS
            if self.repository is not None:
                extensions = (*extensions, REPOSITORY_EXTENSION)
        return ServerMetadata(SERVER_NAME, server_version(), tuple(extensions))

    def server_ready(self) -> bool:
        return self.core.ready()

    # -- models -----------------------------------------------------------------------------------------------

    def model_ready(self, name: str, version: str = "") -> ModelReadiness:
        """Whether that version serves; a version string that is not one is INVALID_ARGUMENT, a model that is
        unknown, loading or failed is not ready (``error`` says why)."""
        parsed = parse_version(version)
        try:
            served = self.core.resolve(name, parsed)
        except ServingError as e:
            return ModelReadiness(name, False, e)
        return ModelReadiness(served.name, True)

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        parsed = parse_version(version)
        if not name:
            raise InvalidArgument("name is empty: name the model to ask about")
        served = self.core.resolve(name, parsed)
        tensors = self._tensors.get(served)
        if tensors is None:
            sig = served.servable.model.signatures.get(DEFAULT_SIGNATURE)
            # In name order, as the model config lists them; outputs in the signature's alias order.
            inputs = [tensor_metadata(a, s) for a, s in sorted(sig.inputs.items())] if sig else []
            outputs = [tensor_metadata(a, sig.outputs[a]) for a in sig.output_aliases] if sig else []
            tensors = self._tensors[served] = (inputs, outputs)
        # the versions serving now (they change as versions load and unload)
        versions = [str(s.version) for s in self.core.manager.statuses(served.name) if s.state == AVAILABLE]
        return ModelMetadata(served.name, versions, PLATFORM, list(tensors[0]), list(tensors[1]))

    def model_config(self, name: str, version: str = "") -> dict:
        """The model's configuration in Triton's JSON form (server/protocols/kserve/v2_config.py)."""
        parsed = parse_version(version)
        if not name:
            raise InvalidArgument("name is empty: name the model to ask about")
        return v2_config.model_config(self.core, name, parsed)

    def model_statistics(self, name: str = "", version: str = "") -> dict:
        """Triton's inference statistics (server/protocols/kserve/v2_stats.py): one version, a model's, or all."""
        return v2_stats.model_statistics(self.core, name, parse_version(version))

    # -- inference --------------------------------------------------------------------------------------------

    @staticmethod
    def infer_request(
        model: str,
        version: str,
        request_id: str = "",
        parameters: Mapping[str, Any] | None = None,
        outputs=(),
        info: RequestInfo | None = None,
    ) -> InferRequest:
        """The request's model, version, parameters and outputs checked, before its inputs are decoded; the call's
        priority and deadline (``info``, else the current call's) follow its parameters."""
        info = info if info is not None else REQUEST.get(None)
        return infer_request(model, version, request_id, parameters, outputs, info)

    async def infer(self, request: InferRequest) -> InferAnswer:
        """Run the request (its ``inputs`` decoded); the answer's outputs are classified where asked, and each has
        a v2 datatype (FAILED_PRECONDITION names one that has none)."""
        requested = [o.name for o in request.outputs]
        result = await self.core.predict(
            request.model, request.version, "", request.signature, request.inputs, requested, "outputs"
        )
        outputs = v2_types.classified(result.outputs, request.classes())
        for name, array in outputs.items():
            v2_types.carried_datatype(name, array.dtype)
        return InferAnswer(result.model_name, str(result.version), request.id, outputs, request)

    # -- Triton's system shared memory extension (server/protocols/kserve/shared_memory.py) ---------------------

    def shared_memory_status(self, name: str = "") -> list[dict]:
        return self.shared_memory.status(name)

    def register_shared_memory(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        if not isinstance(key, str):
            raise InvalidArgument(
                f"'key' must be a string naming the shared memory (e.g. '/name'), got {codec.show(key)}"
            )
        offset = integer(offset, "offset", "bytes into the shared memory")
        byte_size = integer(byte_size, "byte_size", "the region's size in bytes")
        self.shared_memory.register(name, key, offset, byte_size)

    def unregister_shared_memory(self, name: str = "") -> None:
        self.shared_memory.unregister(name)

    # CUDA shared memory: registering is UNIMPLEMENTED, so there is never a region to list or unregister; status and
    # unregister answer as a Triton without GPUs does (Triton's examples unregister all CUDA regions first).
    def cuda_shared_memory_status(self, name: str = "") -> list[dict]:
        return self.shared_memory.cuda_status(name)  # empty, or NOT_FOUND for a named region

    @staticmethod
    def register_cuda_shared_memory() -> None:
        raise Unimplemented(NO_CUDA_MEMORY)

    @staticmethod
    def unregister_cuda_shared_memory(name: str = "") -> None:
        return None

    # -- Triton's log and trace settings (server/protocols/kserve/v2_settings.py) ------------------------------

    def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """The log settings after ``changes`` (Triton's keys to plain values; none: read them)."""
        return self.log_settings.update(changes)

    def trace_settings(self, model: str, changes: dict[str, list[str]]) -> dict[str, list[str]]:
        return v2_settings.trace_settings(self.core, model, changes)


# -- the model repository extension (server/protocols/kserve/repository.py) ----------------------------------------
# Over the inference ports' repository (``DataPlane.repository``) or the admin port's, which the adapter names.


async def repository_index(repository: ModelRepository, repository_name: str, ready: bool) -> list[dict[str, str]]:
    """Every model version servex knows (only those serving with ``ready``): name, version, state, reason."""
    repository.check_name(repository_name)
    return await repository.index(ready)


async def repository_load(
    repository: ModelRepository, repository_name: str, name: str, parameters: Mapping[str, Any]
) -> None:
    """Serve ``name`` (from the ``base_path`` parameter's folder when given); returns once it serves."""
    repository.check_name(repository_name)
    repository.check(name, "load")
    repository.check_parameters(name, parameters)
    await repository.load(name, base_path(name, parameters))


async def repository_unload(repository: ModelRepository, repository_name: str, name: str) -> None:
    repository.check_name(repository_name)
    await repository.unload(name)
