"""What the soaks (scripts/soak.py, scripts/chaos_soak.py) measure of servex's processes: RSS, threads and open
descriptors from /proc, and the slope of a series."""

from __future__ import annotations

import os

import numpy as np


def process_sample(pid: int) -> dict:
    """Process ``pid``'s RSS (MB), threads and open descriptors."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {
        "rss_mb": round(int(fields["VmRSS"][0]) / 1024, 1),
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def slope_per_100k(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (calls, MB), in MB per 100,000 calls."""
    if len(points) < 2:
        return 0.0
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    if np.ptp(x) == 0:
        return 0.0
    return float(np.polyfit(x, y, 1)[0] * 100_000)
