"""servex's GraphExecutor adapter (server/protocols/servex/graph_service.py) in process: runs by tensor names over a
ServingCore serving half_plus_two, through real gRPC with servex's generated stub, in milliseconds."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf

from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc
from servex.server.protocols.servex.graph_service import GraphExecutorService
from tests.support.in_process import aio_server, serving_core


@pytest.fixture(scope="module")
def stub():
    with serving_core("hp") as core:

        def add(server):
            graph_executor_pb2_grpc.add_GraphExecutorServicer_to_server(GraphExecutorService(core, 1 << 20), server)

        with aio_server(add) as channel:
            yield graph_executor_pb2_grpc.GraphExecutorStub(channel)


def run(stub, fetches, **kwargs) -> graph_executor_pb2.RunResponse:
    request = graph_executor_pb2.RunRequest(fetches=fetches, **kwargs)
    request.model.name = "hp"
    request.feeds["x:0"].CopyFrom(tf.make_tensor_proto(np.array([[1.0], [4.0]], np.float32)))
    return stub.Run(request, timeout=30)


def test_a_run_by_tensor_names_answers_each_fetch_and_the_client_graph_key(stub):
    answer = run(stub, ["y:0"])
    assert (answer.model.name, answer.model.version) == ("hp", 123)
    np.testing.assert_allclose(tf.make_ndarray(answer.outputs[0]), [[2.5], [4.0]])
    assert answer.client_graph_key == "x:0^y:0^"


def test_a_tensor_the_graph_does_not_hold_is_named(stub):
    with pytest.raises(grpc.RpcError) as error:
        run(stub, ["nope:0"])
    assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert "nope:0" in error.value.details()
