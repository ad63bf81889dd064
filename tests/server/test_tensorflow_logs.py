"""TensorFlow's load-time lines: the INFO entries and absl's banner go, warnings and errors stay."""

from __future__ import annotations

import os
import subprocess
import sys

from servex.server.tensorflow_logs import kept_lines

CAUGHT = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1795828855.481265    9167 port.cc:153] oneDNN custom operations are on.\n"
    b"I0000 00:00:1795828857.707596    9167 cpu_feature_guard.cc:227] This TensorFlow binary is optimized\n"
    b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow\n"
    b"W0000 00:00:1795828857.708285    9167 gpu_device.cc:2342] Cannot dlopen some GPU libraries.\n"
    b"E0000 00:00:1795828859.041724    9217 cuda_platform.cc:52] failed call to cuInit\n"
    b"Traceback (most recent call last):\n"
)


def test_info_entries_and_the_banner_are_dropped_warnings_and_errors_kept():
    assert kept_lines(CAUGHT) == (
        b"W0000 00:00:1795828857.708285    9167 gpu_device.cc:2342] Cannot dlopen some GPU libraries.\n"
        b"E0000 00:00:1795828859.041724    9217 cuda_platform.cc:52] failed call to cuInit\n"
        b"Traceback (most recent call last):\n"
    )


def test_nothing_caught_writes_nothing():
    assert kept_lines(b"") == b""


_LOAD = """
import os, sys
from servex.server.tensorflow_logs import quiet_load
with quiet_load(sys.argv[1] == "quiet"):
    os.write(2, b"I0000 00:00:1.0 1 port.cc:153] loading\\n")
    os.write(2, b"E0000 00:00:1.0 1 cuda_platform.cc:52] failed\\n")
print("after", file=sys.stderr)
"""


def test_quiet_load_catches_the_process_stderr_and_writes_back_what_is_kept():
    quiet = subprocess.run([sys.executable, "-c", _LOAD, "quiet"], capture_output=True, env=dict(os.environ))
    assert quiet.stderr == b"E0000 00:00:1.0 1 cuda_platform.cc:52] failed\nafter\n"
    loud = subprocess.run([sys.executable, "-c", _LOAD, "loud"], capture_output=True, env=dict(os.environ))
    assert loud.stderr.startswith(b"I0000 00:00:1.0 1 port.cc:153] loading\n")
