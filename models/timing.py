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


# glibc mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_allocations(limit_bytes: int = 256 << 20) -> bool:
    """Have glibc's malloc serve and keep blocks up to ``limit_bytes`` on its heap.

    By default glibc maps every block above a threshold that starts at 128 KiB afresh with mmap and
    unmaps it on free, raising the threshold only as large blocks happen to be freed. PyTorch's
    eager activations (25 MB for ResNet-18's first layer at 8x224x224) then pay page faults on
    every forward pass until the threshold has crept up: on the development VM the FP32 baseline
    ran at 75-79 img/s in a fresh process and at 90-95 once some unrelated 100 MB buffer had been
    freed. Fixing the thresholds gives the baseline its best case in every run, whatever ran before
    it. ONNX Runtime allocates from its own arena and is not affected. Returns False where this is
    not glibc (nothing changes there).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * limit_bytes))
