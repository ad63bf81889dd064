"""Models the executor tests share: TensorFlow Serving's half_plus_two, loaded once per test module."""

from __future__ import annotations

import pytest

from servex.loader import load_saved_model
from tests.conftest import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2


@pytest.fixture(scope="module")
def half(testdata):
    """TF1 half_plus_two: x:0 -> y:0 = 0.5x+2 (reads a, b), y2:0 = 0.5x+3; x2:0 -> y3:0 = 0.5x2+3."""
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"))
    yield model
    model.close()


@pytest.fixture(scope="module")
def half_tf2(testdata):
    model = load_saved_model(str(HALF_PLUS_TWO_TF2 / "00000123"))
    yield model
    model.close()
