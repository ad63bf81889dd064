"""How the requests of a batch become one run's inputs: TensorFlow Serving's BatchingParameters as servex applies
them, the allowed batch size a batch is padded up to (and the sizes of a graph served by XLA's programs), and
pad_variable_length_inputs (inputs of other lengths padded to the batch's largest, and what that padding would hold,
for the RunHandler's byte bound)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchingOptions:
    """TensorFlow Serving's BatchingParameters, as servex applies them."""

    max_batch_size: int = 32
    allowed_batch_sizes: tuple[int, ...] = ()  # padded up to the next one; the last must be max_batch_size
    # Inputs of one rank that differ beyond the 0th dimension batch together, padded (see pad_to_common_shape).
    pad_variable_length_inputs: bool = False
    # servex's automatic batching (no BatchingParameters given): the RunHandler learns each client graph's cost and
    # picks its batch limit and concurrency (executor/cost_model.py), after checking on its first batch that
    # batching does not change its answers; max_batch_size is then the largest batch it may pick.
    auto: bool = False


# A model's own "no batching" (a Triton config.pbtxt without dynamic_batching), over the server's automatic
# batching: no request has rows in (0, 0].
NO_BATCHING = BatchingOptions(max_batch_size=0)


def batch_rows(batching: BatchingOptions, rows: int) -> int:
    """The rows a batch of ``rows`` rows runs at: the next allowed batch size, if any are set."""
    allowed = batching.allowed_batch_sizes
    return allowed[min(bisect.bisect_left(allowed, rows), len(allowed) - 1)] if allowed else rows


def program_rows(rows: int, most: int) -> int:
    """The rows a batch of ``rows`` rows of a graph served by XLA's programs is padded to (client_graph.py): XLA
    compiles a program per batch size, so batches take a few sizes (two per power of two), each under half again
    its batch's rows: 1-4, 6, 8, 12, 16, 24, 32, 48, ... (``most``, the largest batch, at most, unless ``rows`` is
    more)."""
    if rows <= 4:
        return rows
    step = 1 << (rows.bit_length() - 2)
    return max(rows, min(-(-rows // step) * step, most))


def string_bytes(array: np.ndarray) -> int:
    """The bytes of a string tensor's strings (0 for other tensors)."""
    return sum(map(len, array.flat)) if array.dtype.kind == "O" else 0


def _strings(feeds: dict) -> int:
    """The bytes of the strings in ``feeds``' string tensors."""
    return sum([string_bytes(value) for value in feeds.values()])


def _first_len(value: np.ndarray) -> int:
    """The bytes of a string tensor's first string (what pads it), 0 without one."""
    return len(value.flat[0]) if value.size else 0


class PaddedBatch:
    """A batch being formed with pad_variable_length_inputs: the shapes beyond the 0th dimension its inputs are
    padded to, its rows, whether any input needs padding, and for string tensors the bytes of their strings and of
    the longest first string (what padding copies), for the byte bound."""

    __slots__ = ("dims", "rows", "padded", "strings", "first")

    def __init__(self, dims: dict, rows: int, padded: bool, strings: int, first: dict):
        self.dims, self.rows, self.padded, self.strings, self.first = dims, rows, padded, strings, first

    @classmethod
    def of(cls, item) -> PaddedBatch:
        """A batch of ``item`` (an _Item) alone."""
        feeds = item.feeds
        first = {name: _first_len(value) for name, value in feeds.items() if value.dtype.kind == "O"}
        return cls({name: value.shape[1:] for name, value in feeds.items()}, item.rows, False, _strings(feeds), first)

    def joined(self, other) -> PaddedBatch:
        """This batch with ``other`` (an _Item of the same batch key) in it."""
        feeds = other.feeds
        dims = {name: tuple(map(max, sizes, feeds[name].shape[1:])) for name, sizes in self.dims.items()}
        padded = self.padded or dims != self.dims or any(feeds[name].shape[1:] != dims[name] for name in dims)
        first = {name: max(size, _first_len(feeds[name])) for name, size in self.first.items()}
        return PaddedBatch(dims, self.rows + other.rows, padded, self.strings + _strings(feeds), first)

    def nbytes(self, feeds: dict, rows: int) -> int:
        """At most what the padded inputs hold at ``rows`` rows (``feeds``: a member's, for the dtypes): each
        element's own bytes, and for strings their own contents plus, per element, the longest first string."""
        total = self.strings
        for name, value in feeds.items():
            total += rows * math.prod(self.dims[name]) * (value.dtype.itemsize + self.first.get(name, 0))
        return total


def pad_to_common_shape(parts: list[np.ndarray]) -> list[np.ndarray]:
    """``parts`` (arrays of one rank, each with elements) padded at the end of every dimension but the 0th to the
    largest size among them, each with its own first element: TensorFlow Serving's pad_variable_length_inputs
    (batching_util.cc pads with ``input.flat<T>()(0)``). Parts already at that shape are returned as they are."""
    target = tuple(max(sizes) for sizes in zip(*[p.shape[1:] for p in parts], strict=True))
    out = []
    for part in parts:
        if part.shape[1:] == target:
            out.append(part)
            continue
        padded = np.full((part.shape[0], *target), part.flat[0], dtype=part.dtype)
        padded[tuple([slice(0, n) for n in part.shape])] = part
        out.append(padded)
    return out
