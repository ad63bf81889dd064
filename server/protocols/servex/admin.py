"""The admin surface: servex.v1.VariableService on its own port (--admin_port, loopback by default), guarded by
a bearer token when --admin_token_file is given. Never served on the public gRPC port."""

from __future__ import annotations

import concurrent.futures
import hmac
import logging

import grpc

from servex.loader.errors import InvalidArgument
from servex.loader.variables import VariableStore
from servex.protos.servex.v1 import graph_executor_pb2, variables_pb2, variables_pb2_grpc
from servex.server.core import ServingCore
from servex.server.protocols.servex.graph_service import model_ref
from servex.server.transport import tensors
from servex.server.transport.rpc import rpc

log = logging.getLogger(__name__)
# Assignments run here, off the event loop; a cancelled caller's assignment completes before its lease ends.
ASSIGN_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="servex-assign")

STATES = variables_pb2.Variable.State


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry ``authorization: Bearer <token>`` (UNAUTHENTICATED)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin calls need 'authorization: Bearer <token>'")

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    async def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(str(value).encode(), self._expected):
                return await continuation(handler_call_details)
        return self._refuse


def _variable(store: VariableStore, name: str) -> variables_pb2.Variable:
    record = store.records[name]
    return variables_pb2.Variable(
        name=name,
        dtype=tensors.dtype_enum(record.dtype),
        shape=list(record.shape),
        bytes=record.nbytes,
        state=STATES.Value(store.state(name)),
        checkpoint_key=record.key,
    )


class VariableService(variables_pb2_grpc.VariableServiceServicer):
    def __init__(self, core: ServingCore, max_tensor_bytes: int | None = None):
        self.core = core
        self.max_tensor_bytes = max_tensor_bytes

    def _resolve(self, model):
        return self.core.resolve(*model_ref(model))

    @staticmethod
    def _ref(served) -> graph_executor_pb2.ModelRef:
        return graph_executor_pb2.ModelRef(name=served.name, version=served.version)

    @rpc
    async def ListVariables(self, request, context):
        served = self._resolve(request.model)
        store = served.servable.model.variables
        response = variables_pb2.ListVariablesResponse(variables=[_variable(store, n) for n in sorted(store.records)])
        response.model.CopyFrom(self._ref(served))
        return response

    @rpc
    async def Prefetch(self, request, context):
        lease = self.core.lease(*model_ref(request.model))  # the version stays loaded while its variables restore
        served = lease.served
        try:
            store = served.servable.model.variables
            names = list(request.names) or sorted(store.records)
            unknown = [n for n in names if n not in store.records]
            if unknown:
                raise InvalidArgument(
                    f"model {served.name!r} version {served.version} has no variable(s) {unknown}; "
                    f"variables: {', '.join(sorted(store.records)) or 'none'}"
                )
            pending = store.ensure(names)
            if pending is not None and request.wait:
                await lease.wait(pending)
            response = variables_pb2.PrefetchResponse(variables=[_variable(store, n) for n in names])
            response.model.CopyFrom(self._ref(served))
            return response
        finally:
            lease.end()

    @rpc
    async def AssignVariable(self, request, context):
        lease = self.core.lease(*model_ref(request.model))
        served = lease.served
        try:
            store = served.servable.model.variables
            value = tensors.to_ndarray(request.value, request.name, self.max_tensor_bytes)
            await lease.wait(ASSIGN_POOL.submit(store.assign, request.name, value))
            log.info(
                "AssignVariable: model %r version %d variable %r replaced (peer %s)",
                served.name, served.version, request.name, context.peer(),
            )  # fmt: skip
            response = variables_pb2.AssignVariableResponse(variable=_variable(store, request.name))
            response.model.CopyFrom(self._ref(served))
            return response
        finally:
            lease.end()
