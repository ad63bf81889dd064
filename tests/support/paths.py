"""Where the project and TensorFlow Serving's own test models are.

TensorFlow Serving's test models live in ../shared/models (relative to the project root); tests use them in place
and never copy them into the project."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTDATA = REPO.parent / "shared" / "models" / "tensorflow_serving_testdata"
HALF_PLUS_TWO_TF1 = TESTDATA / "saved_model_half_plus_two_cpu"
HALF_PLUS_TWO_TF2 = TESTDATA / "saved_model_half_plus_two_tf2_cpu"
HALF_PLUS_THREE = TESTDATA / "saved_model_half_plus_three"
TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"
COUNTER = TESTDATA / "saved_model_counter"
BAD_HALF_PLUS_TWO = TESTDATA / "bad_half_plus_two"
EXPECTED = TESTDATA / "expected"
