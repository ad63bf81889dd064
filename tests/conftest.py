"""Shared test paths and fixtures.

TensorFlow Serving's own test models live in ../shared/models (relative to the project root); tests use them in
place and never copy them into the project.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
TESTDATA = REPO.parent / "shared" / "models" / "tensorflow_serving_testdata"
HALF_PLUS_TWO_TF1 = TESTDATA / "saved_model_half_plus_two_cpu"
HALF_PLUS_TWO_TF2 = TESTDATA / "saved_model_half_plus_two_tf2_cpu"
COUNTER = TESTDATA / "saved_model_counter"
BAD_HALF_PLUS_TWO = TESTDATA / "bad_half_plus_two"
EXPECTED = TESTDATA / "expected"


@pytest.fixture(scope="session")
def testdata() -> Path:
    if not TESTDATA.is_dir():
        pytest.fail(f"TensorFlow Serving's test models are missing: expected them at {TESTDATA}")
    return TESTDATA
