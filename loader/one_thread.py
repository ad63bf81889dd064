"""A model version's second session, whose runs use one intra-op thread.

TensorFlow's Python API takes no thread count per run: a session's runs use its CPU device's intra-op pool. With
``TF_OVERRIDE_GLOBAL_THREADPOOL=1`` set before TensorFlow starts (servex sets it when it sizes the pools itself),
each session owns a pool of its config's size instead of sharing one per process. A version then gets, when a
client graph asks, a second session over the same graph with one intra-op thread. On 2 cores a lone request of a
model of many small ops ran about 20% faster on one thread (the encoder 8.6 ms against 10.2 in process, MobileNetV2
13.6 against 17.3), while ResNet-50's ran slower (71 against 54): executor/cost_model.py's ThreadModeChooser tries
both and keeps the faster.

The second session holds its own copy of the variables (the memory of the version's restored variables again):
VariableStore.add_session restores into it what the first holds and runs the init op, and from then on restores
and new values go to both. It is made once per version, when the first client graph asks, and closed when no
client graph uses it any more; one whose variables were given new values through the API gets none.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

import tensorflow as tf

log = logging.getLogger(__name__)

PER_SESSION_POOLS = "TF_OVERRIDE_GLOBAL_THREADPOOL"


def per_session_pools() -> bool:
    """Whether each session owns its intra-op pool (TensorFlow reads the variable once, when it starts)."""
    return os.environ.get(PER_SESSION_POOLS, "").strip().lower() in ("1", "true")


class OneThreadSession:
    """The version's one-intra-op-thread session, shared by the client graphs that use it (counted)."""

    def __init__(
        self,
        graph: tf.Graph,
        config: tf.compat.v1.ConfigProto | None,
        store,
        init_reads: Iterable[str] = (),
        init: Callable[[object], None] = lambda session: None,
    ):
        """``store``: the version's VariableStore; ``init_reads``: the variables its init op reads; ``init``: runs
        the init op on a session."""
        self._graph = graph
        self._config = tf.compat.v1.ConfigProto()
        if config is not None:
            self._config.CopyFrom(config)
        self._store = store
        self._init_reads = tuple(init_reads)
        self._init = init
        self._lock = threading.Lock()
        self._session = None
        self._users = 0
        self._made = False  # made once per version
        self.closed = False

    what = "its runs use one intra-op thread"

    def _one_thread_config(self) -> tf.compat.v1.ConfigProto:
        """The version's session config with one intra-op thread (its own pool where sessions own theirs)."""
        config = tf.compat.v1.ConfigProto()
        config.CopyFrom(self._config)
        config.intra_op_parallelism_threads = 1
        return config

    def _new_session(self):
        return tf.compat.v1.Session(graph=self._graph, config=self._one_thread_config())

    def available(self) -> bool:
        """Whether a client graph may ask for it: sessions own their pools, and the first has more than one
        thread."""
        if not per_session_pools() or self._config.intra_op_parallelism_threads <= 1:
            return False
        return not self._made or self._session is not None

    def acquire(self):
        """The session for one more client graph, made on the first call (restoring the variables into it: call it
        off the requests' path); None where it cannot be had (made and closed before, the version unloaded, or a
        variable was given a new value)."""
        with self._lock:
            if self._session is None:
                if self._made or self.closed:
                    return None
                self._made = True
                session = self._new_session()
                try:
                    added = self._store.add_session(session, self._init_reads, self._init)
                except BaseException:
                    session.close()
                    raise
                if not added:
                    session.close()
                    return None
                self._session = session
                log.info("another session of the version made: %s", self.what)
            self._users += 1
            return self._session

    def release(self) -> None:
        """One client graph no longer uses it; the last one closes it (its copy of the variables goes)."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._session is None:
                return
            session, self._session = self._session, None
        self._store.remove_session(session)
        session.close()
        log.info("the version's session (%s) closed: no client graph runs faster in it", self.what)

    def close(self) -> None:
        """The version unloads."""
        with self._lock:
            self.closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()
