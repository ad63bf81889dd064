"""NumPy buffers at known addresses, for the CPU transfer executor's zero-copy and aligned-copy checks."""

from __future__ import annotations

import numpy as np

from servex.transfer.cpu import ALIGN_COPY_MIN_BYTES, ALIGNMENT

BIG = ALIGN_COPY_MIN_BYTES // 4  # float32 elements in an array just at the copy threshold


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def unaligned(n: int, dtype=np.float32) -> np.ndarray:
    """A C-contiguous array of ``n`` elements whose buffer starts 16 bytes past a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 2 * ALIGNMENT, np.uint8)
    start = (-address(raw) % ALIGNMENT) + 16
    out = raw[start : start + n * itemsize].view(dtype)
    out[...] = (np.arange(n) % 1000).astype(dtype)
    return out
