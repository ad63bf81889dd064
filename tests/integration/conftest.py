"""Daemons more than one integration module shares (session-scoped: one process for all of them); the fixtures
every test may use are in tests/support/fixtures.py (imported by tests/conftest.py). ``export_sum`` stays
importable from here for the modules that import it from here."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tests.support.daemon import model_config_file
from tests.support.models import export_sum  # noqa: F401
from tests.support.paths import COUNTER, HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2


@pytest.fixture(scope="session")
def graph_daemon(shared_daemon, tmp_path_factory):
    """The runs-by-tensor-name daemon of test_graph_runs.py and test_graph_run_safety.py: TensorFlow Serving's
    half_plus_two as hp and half (TF1) and as hp2 and half2 (TF2), and its counter, with a client-graph cache of 2
    entries per model (for the eviction test). Each test leaves the counter at 0."""
    models = {"hp": HALF_PLUS_TWO_TF1, "hp2": HALF_PLUS_TWO_TF2, "half": HALF_PLUS_TWO_TF1,
              "half2": HALF_PLUS_TWO_TF2, "counter": COUNTER}  # fmt: skip
    config = model_config_file(tmp_path_factory.mktemp("graph_config"), models)
    return shared_daemon(f"--model_config_file={config}", "--client_graph_cache_size=2")


@pytest.fixture(scope="session")
def half_daemon(shared_daemon):
    """TensorFlow Serving's half_plus_two (TF1) as ``half``, default flags otherwise: for the tests that only call
    it (test_malformed_messages.py, test_scheduling.py); their metric checks count from what they find."""
    return shared_daemon("--model_name=half", f"--model_base_path={HALF_PLUS_TWO_TF1}")


@pytest.fixture(scope="session")
def string_model(tmp_path_factory):
    """(test_rest.py, test_kserve_http.py) A model with a DT_STRING input: ``upper`` (text) and ``echo_bytes`` (the
    same bytes, alias ending in _bytes,
    so TensorFlow Serving's REST writes it base64) and ``length`` (int32)."""

    class Strings(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def serve(self, text):
            return {"upper": tf.strings.upper(text), "echo_bytes": text, "length": tf.strings.length(text)}

    base = tmp_path_factory.mktemp("strings")
    module = Strings()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base
