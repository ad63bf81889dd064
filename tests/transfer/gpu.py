"""Whether the CuPy path can be tested here: CuPy importable and CUDA sees a device."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cupy_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # not installed, no driver, no device
        return False


# For tests of the CuPy path: marked `gpu`, skipped where no GPU is visible.
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(not cupy_usable(), reason="needs CuPy and a visible CUDA GPU")]
# For tests of what happens without one.
without_gpu = pytest.mark.skipif(cupy_usable(), reason="CuPy and a GPU are usable here")
