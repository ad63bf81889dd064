"""Property tests of server/config/batching.py's BatchingParameters reader: any message printed with text_format
(random fields, then random edits), and any text at all, gives BatchingOptions servex can apply or
INVALID_ARGUMENT naming the file, never another exception (tests/support/strategies.py)."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from hypothesis import example, given
from hypothesis import strategies as st

from servex.executor.batching import BatchingOptions
from servex.loader.errors import ServingError
from servex.protos.servex.v1 import batching_pb2
from servex.server.config.batching import parse_batching_parameters
from tests.support.strategies import examples, mangled, messages, outcome, refused

pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
WHERE = "batching parameters file '/etc/batching.txt'"


@st.composite
def batching_texts(draw) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=40))
    params = draw(messages(batching_pb2.BatchingParameters.DESCRIPTOR))
    if draw(st.booleans()):  # sizes that mostly make sense
        size = draw(st.integers(-2, 64))
        params.max_batch_size.value = size
        params.allowed_batch_sizes[:] = sorted(draw(st.sets(st.integers(-1, 64), max_size=3)) | {size})
    text = text_format.MessageToString(params)
    return draw(mangled(text)) if draw(st.booleans()) else text


@given(batching_texts())
@example("max_batch_size { value: 0 }")
@example("allowed_batch_sizes: [4, 2] max_batch_size { value: 4 }")
@example("max_batch_size: { value: 99999999999999999999 }")
@examples(300)
def test_batching_parameters_give_options_servex_applies_or_invalid_argument(text):
    result, _ = outcome(lambda: parse_batching_parameters(text, WHERE))
    if isinstance(result, ServingError):
        refused(result, WHERE)
        return
    assert isinstance(result, BatchingOptions) and result.max_batch_size >= 1
    allowed = list(result.allowed_batch_sizes)
    assert allowed == sorted(set(allowed))
    assert not allowed or (allowed[0] >= 1 and allowed[-1] == result.max_batch_size)
