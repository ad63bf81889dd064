"""What a user installs: the built wheel holds one import package, ``servex`` (its dist-info beside it, console
scripts in the metadata), every module of the card's folders beneath it, and the layering contracts in
pyproject.toml (import-linter) hold on exactly that code. Module and function sizes stay readable."""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PARTS = ("server", "executor", "loader", "transfer", "protos")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # a copy of the tracked tree: pip wheel writes build/ beside the sources it builds
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
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
