"""A model version's XLA session: a third session, over a copy of the graph whose TF2 function calls are compiled.

A TF2 SavedModel's signature runs one function call (``StatefulPartitionedCall``) whose function holds the model.
Marked ``_XlaMustCompile``, TensorFlow compiles that function with XLA on its first run at each set of input shapes
(the whole function, loops included, fused) and runs the compiled program after that. On this 2-core machine, in
process, batch-1 medians: a GRU (a loop of 64 small steps) 1.1 ms compiled against 2.8-4.6 ms, a BERT-like encoder
6.6 against 12.7; but MobileNetV2 84 against 17 (XLA's CPU convolutions), the MLP the same. So a client graph tries
it while serving, as it tries the other modes (executor/thread_modes.py), and keeps it only where it is faster; a
compile (0.2 s for the GRU, 0.5 s for the encoder, 1.3 s for MobileNetV2 at batch 1) happens off the requests' path,
and a compiled program's answer is checked against the session's before any client sees one
(executor/client_graph.py).

The graph is copied (and marked) once, when the first client graph asks: marking the served graph would change it
for sessions made after (the one-thread session), and a session made over a changed graph would compile what it
should not. The calls marked are those a signature runs (``signature_ops``); the session runs with TensorFlow's
functional control flow kept (``disable_functional_ops_lowering``) and Grappler off, which would lower a loop into
ops XLA cannot compile. Like the one-thread session it holds its own copy of the variables (VariableStore.add_session,
by op name: the copy's ops are named as the served graph's), and is closed when no client graph uses it.

Its programs run on one thread, as the one-thread session's runs, and for the same reason: the graphs XLA serves
best are loops of small ops, which a second thread barely speeds up and two runs at once, one per core, serve far
more. In process on 2 cores, the GRU at batch 16: 6.5 ms on one thread against 5.8 on two (which kept 1.71 cores
busy), and two one-thread runs at once 4,200 sequences/s; at batch 1 the same 1.1 ms. (The encoder's lone run took
11.5 ms on one thread against 8.0 on two: one-thread TensorFlow kernels, 8.6, serve it better.)
"""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from servex.loader.one_thread import OneThreadSession

CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})


def compiled_calls(ops: Iterable[tf.Operation]) -> frozenset[str]:
    """The names of the function calls among ``ops``, which the XLA session compiles."""
    return frozenset(op.name for op in ops if op.type in CALL_OPS)


class XlaSession(OneThreadSession):
    """The version's XLA session, shared by the client graphs that use it (counted)."""

    what = "its TF2 function calls compiled with XLA"

    def __init__(self, graph: tf.Graph, config, store, ops: Iterable[tf.Operation], init_reads, init):
        """``ops``: the signatures' ops, whose function calls it compiles."""
        super().__init__(graph, config, store, init_reads, init)
        self.calls = compiled_calls(ops)

    def _new_session(self):
        graph_def = self._graph.as_graph_def()
        for node in graph_def.node:
            if node.name in self.calls:
                node.attr["_XlaMustCompile"].CopyFrom(attr_value_pb2.AttrValue(b=True))
        copy = tf.Graph()
        with copy.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        copy.finalize()
        config = self._one_thread_config()
        config.experimental.disable_functional_ops_lowering = True
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        return tf.compat.v1.Session(graph=copy, config=config)

    def available(self) -> bool:
        """Whether a client graph may ask for it: the signatures run function calls (a TF2 SavedModel)."""
        return bool(self.calls) and (not self._made or self._session is not None)
