"""Storage faults for daemon tests: ``faults.c`` built into a shared object that a daemon preloads (LD_PRELOAD),
and the switches that make reads of one file fail (EACCES on open, EIO on read) while they exist."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("faults.c")


def build(folder: Path) -> Path:
    """Compile the shim with the system's C compiler (cc; gcc on CI's Debian image) into ``folder``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build tests/support/faults.c")
    out = folder / "servex_faults.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"], check=True)
    return out


class Switch:
    """Faults of the files whose path contains ``match``, for a daemon started with ``environment()``."""

    def __init__(self, match: str):
        self.match = match
        self.base = Path(tempfile.mkdtemp(prefix="servex-faults-")) / "switch"

    def environment(self, shim: Path) -> dict[str, str]:
        return {"LD_PRELOAD": str(shim), "SERVEX_FAULT_PATH": self.match, "SERVEX_FAULT_SWITCH": str(self.base)}

    def on(self, kind: str) -> None:
        """``eio`` (reads fail) or ``eacces`` (opens fail)."""
        Path(f"{self.base}.{kind}").touch()

    def off(self, kind: str) -> None:
        Path(f"{self.base}.{kind}").unlink(missing_ok=True)
