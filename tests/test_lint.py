"""The tree is ruff clean (the rules are in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_ruff_check_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install -e '.[test]'"
    out = subprocess.run([ruff, "check", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
