"""deploy/docker: the Dockerfile (parsed with dockerfile-parse: multi-stage, slim Python 3.11, non-root, ports,
/models, HEALTHCHECK through servex-health), its entrypoint script (run with a stand-in `servex` on PATH that
prints what it was given) and the repository's .dockerignore. No image is built: no registry is reachable here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from tests.conftest import REPO
from tests.deploy.conftest import DOCKER

ENTRYPOINT = DOCKER / "entrypoint.sh"


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKER / "Dockerfile"))


def instructions(dockerfile: DockerfileParser, name: str, stage: int | None = None) -> list[str]:
    """Values of instruction ``name``, in the last stage (the image) unless ``stage`` says which."""
    stages: list[list[dict]] = []
    for item in dockerfile.structure:
        if item["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(item)
    chosen = stages[-1 if stage is None else stage]
    return [item["value"] for item in chosen if item["instruction"] == name]


def test_multi_stage_on_slim_python_3_11(dockerfile):
    assert dockerfile.is_multistage
    args = dict(a.split("=", 1) for a in [i["value"] for i in dockerfile.structure if i["instruction"] == "ARG"])
    froms = [i["value"] for i in dockerfile.structure if i["instruction"] == "FROM"]
    assert len(froms) == 2
    for value in froms:
        image = value.split()[0]
        image = args.get(image.strip("${}"), image)
        assert image.startswith("python:3.11-slim"), image
    # the image gets the virtual environment built in the first stage, not the sources
    assert any(v.startswith("--from=build /opt/servex") for v in instructions(dockerfile, "COPY"))
    build_runs = " ".join(instructions(dockerfile, "RUN", stage=0))
    assert "build --wheel" in build_runs and "pip install /dist/servex-" in build_runs


def test_runs_as_non_root(dockerfile):
    (user,) = instructions(dockerfile, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can verify it"


def test_exposes_servex_ports_and_models_volume(dockerfile):
    exposed = {int(p.split("/")[0]) for value in instructions(dockerfile, "EXPOSE") for p in value.split()}
    assert exposed == {8500, 8501, 8502}
    assert any("/models" in v for v in instructions(dockerfile, "VOLUME"))
    env = " ".join(instructions(dockerfile, "ENV"))
    assert "MODEL_BASE_PATH=/models" in env


def test_healthcheck_uses_servex_health_with_valid_flags(dockerfile):
    from servex.server.healthcheck import build_parser

    (value,) = instructions(dockerfile, "HEALTHCHECK")
    options, _, command = value.partition("CMD")
    assert "--start-period=" in options and "--timeout=" in options
    argv = json.loads(command.strip())
    assert argv[0] == "servex-health"
    parsed = build_parser().parse_args(argv[1:])
    assert parsed.address.endswith(":8500") and parsed.service == ""


def test_entrypoint_is_the_script_and_stops_on_sigterm(dockerfile):
    (entry,) = instructions(dockerfile, "ENTRYPOINT")
    assert json.loads(entry) == ["servex-entrypoint"], "exec form: the script is PID 1 and execs servex"
    assert any(v.startswith("deploy/docker/entrypoint.sh /usr/local/bin/servex-entrypoint")
               for v in instructions(dockerfile, "COPY"))  # fmt: skip
    assert instructions(dockerfile, "STOPSIGNAL") in ([], ["SIGTERM"])
    assert os.access(ENTRYPOINT, os.X_OK)


@pytest.fixture
def fake_servex(tmp_path) -> dict[str, str]:
    """An environment whose `servex` prints its PID and then each argument on its own line."""
    script = tmp_path / "servex"
    script.write_text('#!/bin/sh\necho "$$"\nfor a in "$@"; do echo "$a"; done\n')
    script.chmod(0o755)
    return {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def run_entrypoint(env: dict[str, str], *args: str) -> tuple[int, list[str]]:
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines = out.splitlines()
    assert int(lines[0]) == proc.pid, "the entrypoint must exec servex (so servex gets SIGTERM)"
    return proc.pid, lines[1:]


def test_entrypoint_serves_model_name_from_models(fake_servex):
    _, argv = run_entrypoint(fake_servex)
    assert argv == ["--model_name=model", "--model_base_path=/models/model"]
    env = dict(fake_servex, MODEL_NAME="my_model", MODEL_BASE_PATH="/models")
    _, argv = run_entrypoint(env, "--enable_batching", "--drain_seconds=5")
    assert argv == ["--model_name=my_model", "--model_base_path=/models/my_model", "--enable_batching",
                    "--drain_seconds=5"]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--model_config_file=/etc/servex/models.config", "--port=8500"],
        ["--model_config_file", "/etc/servex/models.config"],
        ["--model_base_path=/models/x", "--model_name=x"],
        ["--port=9000", "--model_name", "x"],
    ],
)
def test_entrypoint_passes_model_flags_through(fake_servex, args):
    _, argv = run_entrypoint(dict(fake_servex, MODEL_NAME="ignored"), *args)
    assert argv == args


def _matches(pattern: str, path: str) -> bool:
    """Docker's .dockerignore matching: Go's filepath.Match plus ``**`` for any number of folders."""
    regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
    regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.fullmatch(regex, path) is not None


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(_matches(pattern, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_sends_what_the_build_copies_and_nothing_else(dockerfile):
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for value in [i["value"] for i in dockerfile.structure if i["instruction"] == "COPY"]:
        words = shlex.split(value)
        if any(w.startswith("--from=") for w in words):
            continue
        sources += [w for w in words[:-1] if not w.startswith("--")]
    for source in sources:
        assert (REPO / source).exists(), source
        assert not dockerignored(source.rstrip("/"), patterns), f"{source} is copied but .dockerignore drops it"
    # what building the wheel reads: the metadata, setup.py's package map, and every folder it maps beneath servex
    for needed in ("pyproject.toml", "setup.py", "README.md", "servex/", "server/", "executor/", "loader/", "transfer/",
                   "protos/"):  # fmt: skip
        assert needed in sources or needed.rstrip("/") in sources, f"the build needs {needed}"
    for path in ("server/core.py", "protos/__init__.py", "README.md", "setup.py", "servex/__init__.py"):
        assert not dockerignored(path, patterns), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "scripts/bench_predict.py",
                 "server/__pycache__/core.cpython-311.pyc"):  # fmt: skip
        assert dockerignored(path, patterns), path
    assert Path(REPO / "README.md").exists()
