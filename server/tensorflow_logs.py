"""TensorFlow's load-time log lines, kept out of a quiet start.

TensorFlow's shared libraries log INFO lines as they load (oneDNN, "Could not find cuda drivers", CPU features),
before absl's logging starts, so TF_CPP_MIN_LOG_LEVEL does not reach them. While ``import tensorflow`` runs,
``quiet_load`` catches the process's stderr (file descriptor 2) and writes back every line but those INFO entries
and absl's banner: a warning or an error still shows. The CLI does this only when the user has not set
TF_CPP_MIN_LOG_LEVEL; then TensorFlow logs as it was told.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_ENTRY = re.compile(rb"^[IWEF]\d{4} ")  # absl's prefix: severity, month and day
_INFO = re.compile(rb"^I\d{4} ")
_BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def kept_lines(caught: bytes) -> bytes:
    """``caught`` without absl's banner and INFO entries (with their continuation lines)."""
    kept, dropping = [], False
    for line in caught.splitlines(keepends=True):
        if line.rstrip() == _BANNER:
            continue
        if _ENTRY.match(line):
            dropping = bool(_INFO.match(line))
        if not dropping:
            kept.append(line)
    return b"".join(kept)


@contextmanager
def quiet_load(enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = kept_lines(caught.read())
            if kept:
                os.write(2, kept)
