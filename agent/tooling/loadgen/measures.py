"""What a measured window gives: the client's latencies and error counts (:class:`LoadResult`),
the server's own account of where the time went (:class:`ServerBreakdown`, from Triton's
statistics extension), percentiles, and the CPU a process used."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Error kinds, the keys of ``LoadResult.errors``; an HTTP error is "http_<status>".
ERROR_TIMEOUT = "timeout"
ERROR_CONNECTION = "connection"
ERROR_DECODE = "decode"
ERROR_MISMATCH = "mismatch"
ERROR_DROPPED = "dropped"


@dataclass(frozen=True, kw_only=True)
class ServerBreakdown:
    """Where the server says the time went, per request, over the measured window.

    From the difference of two ``/v2/models/{m}/stats`` readings (Triton's statistics extension).
    Triton charges a whole batch's compute time to every request in it, so ``compute_*`` is close to
    the time of one batch, not a share of it.
    """

    requests: int
    executions: int
    mean_batch_size: float | None
    queue_ms: float
    compute_input_ms: float
    compute_infer_ms: float
    compute_output_ms: float

    @property
    def compute_ms(self) -> float:
        return self.compute_input_ms + self.compute_infer_ms + self.compute_output_ms


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """One measured window.

    ``sent`` counts requests started in the window. In closed loop, ``completed`` and ``errors``
    count requests that started and finished inside it; in open loop, every arrival scheduled in
    the window is accounted for (completed, an error, or "dropped" at the in-flight cap), including
    requests that finish while the generator drains.
    """

    mode: str
    concurrency: int | None
    rate_per_s: float | None
    duration_s: float
    sent: int
    completed: int
    errors: dict[str, int]
    qps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None
    server: ServerBreakdown | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``server`` is null when the server has no statistics endpoint."""
        document = asdict(self)
        if self.server is not None:
            document["server"]["compute_ms"] = self.server.compute_ms
        return document


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time so far of the given processes (all their threads), from /proc; a
    process that has gone counts nothing. Both serve benchmarks read a server's CPU with it."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def percentiles(values: Sequence[float], percents: Sequence[float]) -> list[float]:
    """The given percentiles of ``values``, interpolating linearly between the closest ranks.

    This is numpy's default (``method="linear"``): percentile ``p`` of ``n`` sorted values sits at
    position ``(n - 1) * p / 100``.

    Raises:
        ValueError: ``values`` is empty or a percent is outside 0..100.
    """
    if not values:
        raise ValueError("percentiles of an empty sequence")
    ordered = sorted(values)
    last = len(ordered) - 1
    result = []
    for percent in percents:
        if not 0.0 <= percent <= 100.0:
            raise ValueError(f"percent must be within 0..100, got {percent}")
        position = last * percent / 100.0
        lower = math.floor(position)
        upper = min(lower + 1, last)
        weight = position - lower
        result.append(ordered[lower] + (ordered[upper] - ordered[lower]) * weight)
    return result


def server_breakdown(
    before: Mapping[str, int] | None, after: Mapping[str, int] | None
) -> ServerBreakdown | None:
    """Per-request averages between two readings of :func:`stats_totals`; None without both."""
    if before is None or after is None:
        return None

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    def mean_ms(stat: str) -> float:
        count = delta(f"{stat}_count")
        return delta(f"{stat}_ns") / count / 1e6 if count > 0 else 0.0

    requests = delta("success_count")
    if requests <= 0:
        return None
    executions = delta("execution_count")
    inferences = delta("inference_count")
    return ServerBreakdown(
        requests=requests,
        executions=executions,
        mean_batch_size=inferences / executions if executions > 0 else None,
        queue_ms=mean_ms("queue"),
        compute_input_ms=mean_ms("compute_input"),
        compute_infer_ms=mean_ms("compute_infer"),
        compute_output_ms=mean_ms("compute_output"),
    )


def stats_totals(document: Mapping[str, Any], model: str) -> dict[str, int] | None:
    """Counters of ``model`` summed over its versions in a ``/stats`` response; None if absent."""
    entries = [entry for entry in document.get("model_stats", []) if entry.get("name") == model]
    if not entries:
        return None
    totals: Counter[str] = Counter()
    for entry in entries:
        # Triton's HTTP endpoint writes counters as numbers; protobuf-to-JSON writes uint64 as
        # strings. int() reads both.
        totals["inference_count"] += int(entry.get("inference_count", 0))
        totals["execution_count"] += int(entry.get("execution_count", 0))
        stats = entry.get("inference_stats") or {}
        for name in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            stat = stats.get(name) or {}
            totals[f"{name}_count"] += int(stat.get("count", 0))
            totals[f"{name}_ns"] += int(stat.get("ns", 0))
    return dict(totals)
