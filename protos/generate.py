"""Regenerate the Python modules of servex's .proto files (run after editing one; a test checks they are current).

    python -m servex.protos.generate [OUT_DIR]   (default: the repository root, so modules land beside their .proto)

protoc sees the sources as ``servex/protos/...`` (a temporary tree whose ``servex/protos`` is this folder), so the
generated modules import each other through the installed package: ``from servex.protos.inference import ...``.

TensorFlow's .proto sources are not in its wheel, so the imports (tensorflow/core/framework/tensor.proto) are
resolved from the descriptors compiled into the installed TensorFlow modules, passed to protoc as a descriptor set.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[1]
PROTOS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "protos").rglob("*.proto"))


def _dependency_set() -> descriptor_pb2.FileDescriptorSet:
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow.core.protobuf import config_pb2, named_tensor_pb2

    files, seen = [], set()

    def add(file_descriptor) -> None:
        if file_descriptor.name in seen:
            return
        seen.add(file_descriptor.name)
        for dependency in file_descriptor.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file_descriptor.CopyToProto(proto)
        files.append(proto)

    for module in (tensor_pb2, types_pb2, config_pb2, named_tensor_pb2):
        add(module.DESCRIPTOR)
    return descriptor_pb2.FileDescriptorSet(file=files)


def generate(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        (root / "servex").mkdir(parents=True)
        (root / "servex" / "protos").symlink_to(REPO / "protos", target_is_directory=True)
        generated = Path(tmp) / "out"
        generated.mkdir()
        deps = Path(tmp) / "deps.pb"
        deps.write_bytes(_dependency_set().SerializeToString())
        well_known = resources.files("grpc_tools") / "_proto"
        args = ["protoc", f"-I{root}", f"-I{well_known}", f"--descriptor_set_in={deps}", f"--python_out={generated}",
                f"--grpc_python_out={generated}", *(f"servex/{proto}" for proto in PROTOS)]  # fmt: skip
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTOS}")
        for module in (generated / "servex").rglob("*.py"):
            target = out_dir / module.relative_to(generated / "servex")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(module, target)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
