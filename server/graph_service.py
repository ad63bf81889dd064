"""servex's own GraphExecutor service (protos/servex/v1/graph_executor.proto): runs by tensor names, with an
optional explicit graph name, over the ServingCore."""

from __future__ import annotations

from protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc
from server import tensors
from server.core import REQUEST, ServingCore, checked_priority
from server.rpc import rpc


class GraphExecutorService(graph_executor_pb2_grpc.GraphExecutorServicer):
    def __init__(self, core: ServingCore, max_tensor_bytes: int | None = None):
        self.core = core
        self.max_tensor_bytes = max_tensor_bytes

    @rpc
    async def Run(self, request: graph_executor_pb2.RunRequest, context) -> graph_executor_pb2.RunResponse:
        model = request.model
        if request.priority:
            REQUEST.get().priority = checked_priority(request.priority, "RunRequest.priority")
        feeds = {name: tensors.to_ndarray(proto, name, self.max_tensor_bytes) for name, proto in request.feeds.items()}
        result = await self.core.run_graph(
            model.name,
            model.version if model.HasField("version") else None,
            model.version_label,
            feeds,
            list(request.fetches),
            list(request.targets),
            graph_name=request.graph_name,
        )
        response = graph_executor_pb2.RunResponse(client_graph_key=result.client_graph_key)
        response.model.name = result.model_name
        response.model.version = result.version
        for value in result.outputs:
            tensors.fill_proto(response.outputs.add(), value, request.tensor_content_outputs)
        return response
