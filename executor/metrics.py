"""Client-graph cache metrics, labelled by model and version (prometheus_client, exported on /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LABELS = ["model", "version"]

CACHE_HITS = Counter("servex_client_graph_cache_hits", "Runs whose client graph was already built", LABELS)
CACHE_MISSES = Counter("servex_client_graph_cache_misses", "Runs whose client graph was not yet built", LABELS)
BUILDS = Counter("servex_client_graph_builds", "Client graphs built (pruned and made callable)", LABELS)
BUILD_SECONDS = Histogram(
    "servex_client_graph_build_seconds",
    "Time to build one client graph",
    LABELS,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
EVICTIONS = Counter("servex_client_graph_cache_evictions", "Client graphs evicted (least recently used)", LABELS)
ENTRIES = Gauge("servex_client_graph_cache_entries", "Client graphs in the cache", LABELS)


class CacheMetrics:
    """The label children of one model version, looked up once."""

    def __init__(self, model: str, version: str):
        self.labels = (model, version)
        self.hits = CACHE_HITS.labels(model, version)
        self.misses = CACHE_MISSES.labels(model, version)
        self.builds = BUILDS.labels(model, version)
        self.build_seconds = BUILD_SECONDS.labels(model, version)
        self.evictions = EVICTIONS.labels(model, version)
        self.entries = ENTRIES.labels(model, version)

    def remove(self) -> None:
        """Drop this version's series (it was unloaded)."""
        for metric in (CACHE_HITS, CACHE_MISSES, BUILDS, BUILD_SECONDS, EVICTIONS, ENTRIES):
            try:
                metric.remove(*self.labels)
            except KeyError:
                pass
