"""Which client graphs the GraphExecutor offers XLA (executor/xla_programs.py, loader/xla.py): TF2 function calls
without convolutions, unless --xla=false; TF1 graphs have nothing to compile. A loop's is tried from its first runs,
the others' only where the worker's runs left the cores idle enough (thread_modes.py)."""

from __future__ import annotations

import tensorflow as tf

from servex.executor import GraphExecutor
from servex.executor.thread_modes import XLA
from servex.loader import load_saved_model
from tests.support.models import tanh_loop


def test_xla_is_offered_to_tf2_function_calls_without_convolutions(tmp_path, half):
    def export(name: str, body) -> str:
        module = tf.Module()
        module.w = tf.Variable(tf.ones((3, 3, 4, 4)) * 0.1)
        fn = tf.function(lambda x: {"y": body(module, x)}, input_signature=[tf.TensorSpec([None, 6, 6, 4])])
        tf.saved_model.save(module, str(tmp_path / name), signatures={"serving_default": fn})
        return str(tmp_path / name)

    def offered(path: str, **flags) -> str:
        """How XLA is offered to the graph: "" (not), "gated" (after the busy cores) or "ungated" (at once)."""
        model = load_saved_model(path)
        try:
            sig = model.signatures["serving_default"]
            executor = GraphExecutor(model, **flags)
            graph = executor.client_graph([sig.inputs["x"].name], [sig.outputs["y"].name])
            if XLA not in graph._makers:
                return ""
            return "ungated" if XLA in graph._chooser.modes else "gated"
        finally:
            model.close()

    dense = export("dense", lambda m, x: tf.tanh(tf.reshape(x, [-1, 4]) @ m.w[0, 0]))
    conv = export("conv", lambda m, x: tf.nn.conv2d(x, m.w, strides=1, padding="SAME"))
    loop = export("loop", lambda m, x: tanh_loop(tf.reshape(x, [-1, 4]), m.w[0, 0], steps=8))
    assert offered(dense) == "gated" and offered(dense, xla=False) == ""
    assert offered(loop) == "ungated" and offered(loop, xla=False) == ""  # a recurrent loop of tiny ops
    assert offered(conv) == ""  # XLA's CPU convolutions: slower than TensorFlow's own
    assert half.xla.calls == frozenset() and not half.xla.available()  # a TF1 graph: no function call
