"""What a user installs: the built wheel holds one import package, ``servex`` (its dist-info beside it, console
scripts in the metadata), every module of the card's folders beneath it, and the layering contracts in
pyproject.toml (import-linter) hold on exactly that code. Module and function sizes stay readable."""

from __future__ import annotations

import ast
import configparser
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.ports import free_port

PARTS = ("server", "executor", "loader", "transfer", "protos")
HALF_PLUS_TWO = REPO.parent / "shared" / "models" / "tensorflow_serving_testdata" / "saved_model_half_plus_two_cpu"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # a copy of the tracked tree: pip wheel writes build/ beside the sources it builds
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (build / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, build / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(build)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("servex-*.whl")
    return found


def test_the_wheel_puts_only_servex_at_the_top_of_site_packages(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = next(t for t in top if t.endswith(".dist-info"))
    assert top == {"servex", dist_info}, f"the wheel puts {sorted(top)} at the top of site-packages"
    scripts = configparser.ConfigParser()
    scripts.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert dict(scripts["console_scripts"]) == {
        "servex": "servex.server.cli:main",
        "servex-health": "servex.server.healthcheck:main",
    }


def test_every_module_of_the_cards_folders_installs_beneath_servex(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", *PARTS], cwd=REPO, capture_output=True, text=True).stdout.split()
    modules = [name for name in tracked if name.endswith(".py")]
    assert len(modules) > 50
    missing = [name for name in modules if f"servex/{name}" not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert "servex/server/demo_model/1/saved_model.pb" in names  # the bundled demo model, as package data


def test_the_generated_modules_import_through_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    generated = [name for name in names if name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert generated
    for name in generated:
        text = zipfile.ZipFile(wheel).read(name).decode()
        for line in text.splitlines():
            if line.startswith(("from protos", "import protos", "from inference", "from servex.v1")):
                pytest.fail(f"{name} imports outside the package: {line}")


def test_the_layering_contracts_hold_on_the_wheel(wheel, tmp_path):
    """pyproject.toml's [tool.importlinter] contracts: server -> executor -> loader, transfer -> protos; the core
    imports no protocol; transport imports no protocol; protocols do not import each other; no import cycle."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency: pip install -e '.[test]'"
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    done = subprocess.run([lint, "--no-cache", str(REPO / "pyproject.toml")], cwd=site, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def _product_modules():
    for part in ("servex", *PARTS):
        for path in sorted((REPO / part).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_no_product_module_is_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in _product_modules() if (n := p.read_text().count("\n")) > 500}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_product_function_is_over_80_lines():
    long = []
    for path in _product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


_TRITON_GRPC_CLIENT = """
import json, sys, time
import numpy as np
import google.protobuf
import tritonclient.grpc as grpcclient

client = grpcclient.InferenceServerClient(sys.argv[1])
deadline = time.monotonic() + 120
while True:
    try:
        if client.is_model_ready("half"):
            break
    except Exception:
        pass
    if time.monotonic() > deadline:
        sys.exit("servex did not serve 'half' in 120 s")
    time.sleep(0.3)
x = grpcclient.InferInput("x", [3, 1], "FP32")
x.set_data_from_numpy(np.array([[1.0], [2.0], [3.0]], np.float32))
answer = client.infer("half", [x])
print(json.dumps({"y": answer.as_numpy("y").ravel().tolist(), "protobuf": google.protobuf.__version__}))
"""


@pytest.mark.integration  # starts the servex daemon (its own Popen: tests/conftest.py cannot tell)
def test_tritonclient_installs_beside_servex_and_serves_through_its_grpc_client(wheel, tmp_path):
    """``pip install servex 'tritonclient[grpc,http]'`` into one environment: tritonclient's gRPC extra needs
    protobuf < 7, and servex runs with it (its generated modules are protobuf 6.31.1 gencode). The scratch
    environment takes TensorFlow and the other heavy dependencies from the test environment (a .pth after its own
    site-packages), so what pip resolves for servex and tritonclient together lands in it and wins."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    scratch_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(scratch_site) / "zz_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel), "tritonclient[grpc,http]"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    port, metrics = free_port(), free_port()
    log = tmp_path / "servex.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [str(venv / "bin" / "servex"), f"--port={port}", f"--metrics_port={metrics}", "--rest_api_port=0",
             "--model_name=half", f"--model_base_path={HALF_PLUS_TWO}", "--bind_address=127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        client = subprocess.run([str(python), "-c", _TRITON_GRPC_CLIENT, f"127.0.0.1:{port}"], capture_output=True,
                                text=True, timeout=180)  # fmt: skip
        assert client.returncode == 0, client.stderr[-3000:] + log.read_text()[-3000:]
        answer = json.loads(client.stdout.strip().splitlines()[-1])
        assert answer["y"] == [2.5, 3.0, 3.5]
        assert int(answer["protobuf"].split(".")[0]) < 7, f"pip resolved protobuf {answer['protobuf']}"
        health = subprocess.run([str(venv / "bin" / "servex-health"), f"--address=127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert health.returncode == 0, health.stdout + health.stderr
        servex_file = subprocess.run([str(python), "-c", "import servex; print(servex.__file__)"], cwd=tmp_path,
                                     capture_output=True, text=True).stdout  # fmt: skip
        assert servex_file.startswith(scratch_site), servex_file
    finally:
        daemon.terminate()
        daemon.wait(30)
