"""The generated modules in protos/ are what protoc makes of the .proto sources today: editing a .proto without
running `python -m servex.protos.generate` fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servex.protos.generate import PROTOS, REPO


def test_there_are_protos():
    assert {
        "protos/servex/v1/graph_executor.proto",
        "protos/servex/v1/variables.proto",
        "protos/servex/v1/batching.proto",
        "protos/inference/grpc_service.proto",
        "protos/tensorflow/profiler_service.proto",
    } <= set(PROTOS)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    # protoc runs in its own process: in-process, beside a loaded TensorFlow, it can crash
    subprocess.run(
        [sys.executable, "-m", "servex.protos.generate", str(out)], cwd=REPO, check=True, capture_output=True
    )
    return out


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("suffix", ["_pb2.py", "_pb2_grpc.py"])
def test_generated_module_is_current(fresh, proto, suffix):
    module = proto.removesuffix(".proto") + suffix
    committed = REPO / module
    assert committed.is_file(), f"{module} is missing: run python -m servex.protos.generate"
    assert committed.read_text() == (fresh / module).read_text(), (
        f"{module} is stale: run python -m servex.protos.generate"
    )


def test_generated_service_is_servex_v1_graph_executor():
    from servex.protos.servex.v1 import graph_executor_pb2

    service = graph_executor_pb2.DESCRIPTOR.services_by_name["GraphExecutor"]
    assert service.full_name == "servex.v1.GraphExecutor"
    assert [m.name for m in service.methods] == ["Run"]
    fields = graph_executor_pb2.RunRequest.DESCRIPTOR.fields_by_name
    assert {"model", "graph_name", "feeds", "fetches", "targets", "priority"} <= set(fields)


# Every message servex's inference proto defines, as (field name, number, type, repeated, message type), printed
# by a subprocess: servex's `inference.*` and tritonclient's cannot be loaded into one process.
_DUMP_SERVEX_INFERENCE = """
import json
from servex.protos.inference import grpc_service_pb2 as pb, model_config_pb2

def fields(d):
    return sorted((f.name, f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else "")
                  for f in d.fields)

def values(e):
    return sorted((v.name, v.number) for v in e.values)

def walk(d, out, enums):
    out[d.full_name] = fields(d)
    for e in d.enum_types:
        enums[e.full_name] = values(e)
    for nested in d.nested_types:
        walk(nested, out, enums)

out, enums = {}, {}
for file in (pb.DESCRIPTOR, model_config_pb2.DESCRIPTOR):
    enums.update({e.full_name: values(e) for e in file.enum_types_by_name.values()})
    for d in file.message_types_by_name.values():
        walk(d, out, enums)
service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
methods = {m.name: [m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming]
           for m in service.methods}
print(json.dumps({"service": service.full_name, "methods": methods, "messages": out, "enums": enums}))
"""


# Messages of Triton's protos that servex's holds in part: only the fields servex fills in.
_SUBSETS = {"inference.ModelStatistics"}


def test_inference_proto_is_wire_compatible_with_tritonclient():
    """Same service and method names, message names, field numbers and types as tritonclient.grpc uses."""
    import json

    from tritonclient.grpc import service_pb2 as triton

    out = subprocess.run(
        [sys.executable, "-c", _DUMP_SERVEX_INFERENCE], cwd=REPO, check=True, capture_output=True, text=True
    )
    servex = json.loads(out.stdout)
    assert servex["service"] == "inference.GRPCInferenceService"
    triton_service = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert set(servex["methods"]) == {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelStatistics",
        "ModelInfer",
        "ModelStreamInfer", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
        "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
        "LogSettings",
    }  # fmt: skip
    for name, signature in servex["methods"].items():
        method = triton_service.methods_by_name[name]
        expected = [method.input_type.full_name, method.output_type.full_name]
        assert signature == [*expected, method.client_streaming, method.server_streaming], name
    for full_name, fields in servex["messages"].items():
        descriptor = triton.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        expected = sorted(
            (f.name, f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else "")
            for f in descriptor.fields
        )
        if full_name in _SUBSETS:  # the fields servex fills in, each as Triton numbers it
            assert {tuple(f) for f in fields} <= set(expected), full_name
            assert len(fields) >= 2, full_name
        else:
            assert [tuple(f) for f in fields] == expected, full_name
    # model_config.proto whole: every message and enum of tritonclient's (a config.pbtxt written for Triton parses)
    from tritonclient.grpc import model_config_pb2 as triton_config

    everything, triton_enums = {}, {}

    def walk(d):
        everything[d.full_name] = d
        for e in d.enum_types:
            triton_enums[e.full_name] = e
        for nested in d.nested_types:
            if not nested.GetOptions().map_entry:
                walk(nested)

    for d in triton_config.DESCRIPTOR.message_types_by_name.values():
        walk(d)
    assert set(everything) <= set(servex["messages"])
    assert {"inference.DataType", "inference.ModelInput.Format", *triton_enums} == set(servex["enums"])
    for full_name, values in servex["enums"].items():
        descriptor = triton.DESCRIPTOR.pool.FindEnumTypeByName(full_name)
        assert [tuple(v) for v in values] == sorted((v.name, v.number) for v in descriptor.values), full_name


def _tensorflow_compiled_descriptor(name: str):
    """The FileDescriptorProto of ``name`` that TensorFlow's C++ library holds (compiled in by protoc's C++
    gencode as serialized bytes): TSL's profiler_service.proto is in no Python module of TensorFlow's wheel."""
    import mmap

    import tensorflow as tf
    from google.protobuf import descriptor_pb2

    start_marker = b"\n" + bytes([len(name)]) + name.encode() + b"\x12"
    for library in sorted(Path(tf.sysconfig.get_lib()).glob("lib*.so*")):
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            start = data.find(start_marker)
            if start < 0:
                continue
            end = data.find(b"b\x06proto3", start)  # syntax = "proto3", the last field protoc writes
            return descriptor_pb2.FileDescriptorProto.FromString(data[start : end + 8])
    raise AssertionError(f"{name} is in none of TensorFlow's libraries under {tf.sysconfig.get_lib()}")


def test_profiler_service_is_wire_compatible_with_tensorflows():
    """Every field servex's profiler_service.proto declares has TSL's name, number, type and label, and every
    method its input and output types: TensorFlow's C++ client (tf.profiler.experimental.client.trace, TensorBoard)
    is understood."""
    from google.protobuf import descriptor_pb2

    from servex.protos.tensorflow import profiler_service_pb2

    theirs = _tensorflow_compiled_descriptor("tsl/profiler/protobuf/profiler_service.proto")
    ours = descriptor_pb2.FileDescriptorProto()
    profiler_service_pb2.DESCRIPTOR.CopyToProto(ours)
    assert ours.package == theirs.package == "tensorflow"
    assert set(ours.dependency) <= set(theirs.dependency)
    their_messages = {m.name: m for m in theirs.message_type}
    assert {m.name for m in ours.message_type} == {
        "ProfileRequest", "ProfileResponse", "TerminateRequest", "TerminateResponse", "MonitorRequest",
        "MonitorResponse",
    }  # fmt: skip
    for message in ours.message_type:
        their_fields = {f.name: f for f in their_messages[message.name].field}
        for field in message.field:
            assert field == their_fields[field.name], f"{message.name}.{field.name}"
    (service,) = ours.service
    (their_service,) = theirs.service
    assert service.name == their_service.name == "ProfilerService"
    their_methods = {m.name: (m.input_type, m.output_type) for m in their_service.method}
    assert {m.name: (m.input_type, m.output_type) for m in service.method} == {
        name: their_methods[name] for name in ("Profile", "Terminate", "Monitor")
    }
