"""servex's own GraphExecutor service (protos/servex/v1/graph_executor.proto): runs by tensor names, with an
optional explicit graph name, over the ServingCore."""

from __future__ import annotations

from servex.loader.errors import InvalidArgument
from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc
from servex.server.core import REQUEST, ServingCore, checked_priority
from servex.server.transport import tensors
from servex.server.transport.rpc import rpc


def model_ref(model) -> tuple[str, int | None, str]:
    """A servex.v1 ModelRef as (name, version or None, label); INVALID_ARGUMENT for no name, or for a version and
    a label together (TensorFlow Serving's ModelSpec makes them a oneof; here the label would silently win)."""
    if not model.name:
        raise InvalidArgument("model.name is empty: name the model")
    version = model.version if model.HasField("version") else None
    if version is not None and model.version_label:
        raise InvalidArgument(
            f"model {model.name!r}: the request names version {version} and version_label "
            f"{model.version_label!r}; give one of them"
        )
    return model.name, version, model.version_label


class GraphExecutorService(graph_executor_pb2_grpc.GraphExecutorServicer):
    def __init__(self, core: ServingCore, max_tensor_bytes: int | None = None):
        self.core = core
        self.max_tensor_bytes = max_tensor_bytes

    @rpc
    async def Run(self, request: graph_executor_pb2.RunRequest, context) -> graph_executor_pb2.RunResponse:
        name, version, label = model_ref(request.model)
        if request.priority:
            REQUEST.get().priority = checked_priority(request.priority, "RunRequest.priority")
        feeds = await tensors.decode_all(
            request.feeds, self.max_tensor_bytes, lambda: self.core.resolve(name, version, label)
        )
        result = await self.core.run_graph(
            name,
            version,
            label,
            feeds,
            list(request.fetches),
            list(request.targets),
            graph_name=request.graph_name,
        )
        response = graph_executor_pb2.RunResponse(client_graph_key=result.client_graph_key)
        response.model.name = result.model_name
        response.model.version = result.version
        REQUEST.get().answer_bytes = tensors.answer_bound(result.outputs)
        pairs = [(response.outputs.add(), value) for value in result.outputs]
        await tensors.fill_all(pairs, request.tensor_content_outputs)
        return response
