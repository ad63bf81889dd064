"""Regenerate the Python modules of servex's .proto files (run after editing one; a test checks they are current).

    python -m servex.protos.generate [OUT_DIR]   (default: the repository root, so modules land beside their .proto)

protoc sees the sources as ``servex/protos/...`` (a temporary tree whose ``servex/protos`` is this folder), so the
generated modules import each other through the installed package: ``from servex.protos.inference import ...``.

TensorFlow's .proto sources are not in its wheel, so the imports (tensorflow/core/framework/tensor.proto) are
resolved from the descriptors compiled into the installed TensorFlow modules, passed to protoc as a descriptor set.
TSL's (tsl/profiler/protobuf/...) are modules of TensorFlow's wheel under ``tensorflow.tsl``: the generated imports
of them are written so, as TensorFlow's own generated modules write them.

protoc is always GENERATOR's, from a virtual environment of its own (made on first use under
``~/.cache/servex/``): the gencode it writes (protobuf 6.31.1, grpcio 1.80.1) is what decides the oldest protobuf
and grpcio servex runs with, so it does not follow whatever grpcio-tools the caller has installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parents[1]
# Its protoc writes gencode for protobuf >= 6.31.1 and grpcio >= 1.80.1: pyproject.toml's lower bounds.
GENERATOR = "grpcio-tools==1.80.1"
# A generated import of a TSL module: TensorFlow's wheel has them as tensorflow.tsl.*, not as a top-level tsl.
TSL_IMPORT = re.compile(r"^(from |import )tsl\.", re.MULTILINE)
PROTOS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "protos").rglob("*.proto"))


def _dependency_set() -> descriptor_pb2.FileDescriptorSet:
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow.core.protobuf import config_pb2, named_tensor_pb2
    from tensorflow.tsl.profiler.protobuf import profiler_options_pb2, xplane_pb2

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

    for module in (tensor_pb2, types_pb2, config_pb2, named_tensor_pb2, profiler_options_pb2, xplane_pb2):
        add(module.DESCRIPTOR)
    return descriptor_pb2.FileDescriptorSet(file=files)


def generator_python() -> str:
    """The Python of a virtual environment holding GENERATOR (made on first use)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = cache / "servex" / GENERATOR.replace("==", "-")
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", GENERATOR], check=True)
        (venv / "ready").touch()
    return str(python)


def generate(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        (root / "servex").mkdir(parents=True)
        (root / "servex" / "protos").symlink_to(REPO / "protos", target_is_directory=True)
        generated = Path(tmp) / "out"
        generated.mkdir()
        deps = Path(tmp) / "deps.pb"
        deps.write_bytes(_dependency_set().SerializeToString())
        # grpc_tools.protoc run as a module adds its own well-known .proto files (google/protobuf/*) to the path
        sources = [f"servex/{proto}" for proto in PROTOS]
        args = [generator_python(), "-m", "grpc_tools.protoc", f"-I{root}", f"--descriptor_set_in={deps}",
                f"--python_out={generated}", f"--grpc_python_out={generated}", *sources]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"protoc failed on {PROTOS}: {done.stderr}")
        for module in (generated / "servex").rglob("*.py"):
            target = out_dir / module.relative_to(generated / "servex")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(TSL_IMPORT.sub(r"\1tensorflow.tsl.", module.read_text("utf-8")), "utf-8")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
