"""ServingCore.predict and run_graph in process, against TensorFlow Serving's half_plus_two (y = 0.5 x + 2): what
every protocol adapter calls, in milliseconds, with no daemon."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from servex.loader.errors import InvalidArgument, NotFound
from tests.support.in_process import serving_core


@pytest.fixture(scope="module")
def core():
    with serving_core() as serving:
        yield serving


X = np.array([[1.0], [4.0]], np.float32)


def test_predict_runs_the_default_signature_and_names_what_ran(core):
    result = asyncio.run(core.predict("hp", None, "", "", {"x": X}))
    assert (result.model_name, result.version, result.signature_name) == ("hp", 123, "serving_default")
    np.testing.assert_allclose(result.outputs["y"], [[2.5], [4.0]])


def test_predict_returns_only_the_outputs_asked_for(core):
    result = asyncio.run(core.predict("hp", 123, "", "serving_default", {"x": X}, ["y"]))
    assert list(result.outputs) == ["y"]
    with pytest.raises(InvalidArgument, match="'nope'"):
        asyncio.run(core.predict("hp", None, "", "", {"x": X}, ["nope"]))


def test_predict_refuses_inputs_that_do_not_match_the_signature(core):
    with pytest.raises(InvalidArgument, match="input 'x' expects dtype DT_FLOAT.*got DT_INT64"):
        asyncio.run(core.predict("hp", None, "", "", {"x": X.astype(np.int64)}))
    with pytest.raises(InvalidArgument, match="'z'"):
        asyncio.run(core.predict("hp", None, "", "", {"z": X}))


def test_predict_names_a_model_or_version_not_served(core):
    with pytest.raises(NotFound, match="'nope'"):
        asyncio.run(core.predict("nope", None, "", "", {"x": X}))
    with pytest.raises(NotFound, match="7"):
        asyncio.run(core.predict("hp", 7, "", "", {"x": X}))
    with pytest.raises(InvalidArgument, match="empty"):
        asyncio.run(core.predict("", None, "", "", {"x": X}))


def test_run_graph_runs_by_tensor_names_under_a_sorted_key(core):
    result = asyncio.run(core.run_graph("hp", None, "", {"x:0": X}, ["y:0"]))
    assert (result.model_name, result.version) == ("hp", 123)
    np.testing.assert_allclose(result.outputs[0], [[2.5], [4.0]])
    assert "x:0" in result.client_graph_key and "y:0" in result.client_graph_key
    again = asyncio.run(core.run_graph("hp", None, "", {"x:0": X * 2}, ["y:0"]))
    assert again.client_graph_key == result.client_graph_key  # the same client graph, cached
    np.testing.assert_allclose(again.outputs[0], [[3.0], [6.0]])


def test_run_graph_by_a_signatures_aliases_and_an_explicit_graph_name(core):
    by_alias = asyncio.run(core.run_graph("hp", None, "", {"x": X}, ["y"], aliases_of="serving_default"))
    np.testing.assert_allclose(by_alias.outputs[0], [[2.5], [4.0]])
    named = asyncio.run(core.run_graph("hp", None, "", {"x:0": X}, ["y:0"], graph_name="halves"))
    np.testing.assert_allclose(named.outputs[0], [[2.5], [4.0]])
    # the name is bound to the graph it was built for: other tensors under it are refused, naming both
    with pytest.raises(InvalidArgument, match="graph name 'halves' was built for feeds"):
        asyncio.run(core.run_graph("hp", None, "", {"x:0": X}, ["x:0"], graph_name="halves"))


def test_run_graph_names_a_tensor_the_graph_does_not_hold(core):
    with pytest.raises((InvalidArgument, NotFound), match="nope"):
        asyncio.run(core.run_graph("hp", None, "", {"x:0": X}, ["nope:0"]))
