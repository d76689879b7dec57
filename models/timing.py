"""Timing a call the same way everywhere: one warm-up, then enough runs to take a median."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_call(function: Callable[[], Any], min_time_s: float, min_runs: int) -> list[float]:
    """Latencies (s) of ``function`` over at least ``min_runs`` runs and ``min_time_s`` seconds."""
    function()  # warm-up: first-run allocations and kernel selection
    latencies: list[float] = []
    started = time.perf_counter()
    while len(latencies) < min_runs or time.perf_counter() - started < min_time_s:
        begin = time.perf_counter()
        function()
        latencies.append(time.perf_counter() - begin)
    return latencies
