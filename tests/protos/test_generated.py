"""The generated modules in protos/ are what protoc makes of the .proto sources today: editing a .proto without
running `python -m protos.generate` fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protos.generate import PROTOS, REPO


def test_there_are_protos():
    assert {
        "protos/servex/v1/graph_executor.proto",
        "protos/servex/v1/variables.proto",
        "protos/servex/v1/batching.proto",
    } <= set(PROTOS)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    # protoc runs in its own process: in-process, beside a loaded TensorFlow, it can crash
    subprocess.run([sys.executable, "-m", "protos.generate", str(out)], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("suffix", ["_pb2.py", "_pb2_grpc.py"])
def test_generated_module_is_current(fresh, proto, suffix):
    module = proto.removesuffix(".proto") + suffix
    committed = REPO / module
    assert committed.is_file(), f"{module} is missing: run python -m protos.generate"
    assert committed.read_text() == (fresh / module).read_text(), f"{module} is stale: run python -m protos.generate"


def test_generated_service_is_servex_v1_graph_executor():
    from protos.servex.v1 import graph_executor_pb2

    service = graph_executor_pb2.DESCRIPTOR.services_by_name["GraphExecutor"]
    assert service.full_name == "servex.v1.GraphExecutor"
    assert [m.name for m in service.methods] == ["Run"]
    fields = graph_executor_pb2.RunRequest.DESCRIPTOR.fields_by_name
    assert {"model", "graph_name", "feeds", "fetches", "targets", "priority"} <= set(fields)
