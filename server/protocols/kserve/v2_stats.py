"""Inference statistics per model version as Triton reports them (``ModelStatistics`` over gRPC,
``GET /v2/models[/{name}[/versions/{v}]]/stats`` over REST; tritonclient's ``get_inference_statistics``), from the
exact counts kept in executor/statistics.py.

Triton's meanings: ``success``/``fail``, inference calls answered and their time in the server (failures after
the version was resolved); ``queue``, time waiting for a run worker; ``compute_infer``, per request, the run that
served it (of its whole batch); ``inference_count``, rows run; ``execution_count``, runs; ``batch_stats``, runs
and their time by requests per run; ``compute_input`` and ``compute_output``, per successful request, decoding its
input tensors and encoding its output tensors (KServe v2 and TensorFlow Serving Predict calls, over gRPC and
REST; not in ``batch_stats``, since they are not work of the batch). ``cache_hit``/``cache_miss`` are 0: there is
no response cache.
"""

from __future__ import annotations

from servex.executor.statistics import Duration, statistics
from servex.loader.errors import InvalidArgument
from servex.loader.manager import AVAILABLE
from servex.server.core import ServingCore

_ZERO = {"count": 0, "ns": 0}


def model_statistics(core: ServingCore, name: str, version: int | None) -> dict:
    """``{"model_stats": [...]}`` for one model version, every available version of a model (version None), or
    every model (name empty)."""
    if not name and version is not None:
        raise InvalidArgument(f"version {version} was given without a model name: name the model, or neither")
    if name and version is not None:
        served = [core.resolve(name, version)]
    else:
        names = [name] if name else core.manager.model_names()
        served = [sv for n in names for sv in core.manager.statuses(n) if sv.state == AVAILABLE]
    return {"model_stats": [_one(sv.name, str(sv.version)) for sv in served]}


def _one(name: str, version: str) -> dict:
    f = statistics(name, version).snapshot()
    return {
        "name": name,
        "version": version,
        "last_inference": f.last_inference_ms,
        "inference_count": f.inference_count,
        "execution_count": f.execution_count,
        "inference_stats": {
            "success": _duration(f.success),
            "fail": _duration(f.fail),
            "queue": _duration(f.queue),
            "compute_input": _duration(f.compute_input),
            "compute_infer": _duration(f.compute_infer),
            "compute_output": _duration(f.compute_output),
            "cache_hit": _ZERO,
            "cache_miss": _ZERO,
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": _ZERO, "compute_infer": _duration(d), "compute_output": _ZERO}
            for size, d in sorted(f.batches.items())
        ],
    }


def _duration(d: Duration) -> dict:
    return {"count": d.count, "ns": d.ns}
