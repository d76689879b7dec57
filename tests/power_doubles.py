"""Test doubles for the power controller: a strict board, a fake clock and a small serving loop.

:class:`StrictBoard` implements :class:`~power.types.BoardControl` as strictly as the real board
layer: every frequency must be an entry of its :class:`~power.types.ClockTable`, a minimum above
its maximum is refused, and every write is recorded, so a test can count clock changes and check
what was restored. :func:`serve` is a deterministic single-server queue whose service time follows
the clocks in force (a ``k/f + b`` law per EMC point, with an optional slow spell), stepping a
controller every ``step_s`` as the daemon's power thread does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from power.types import (
    ApplyResult, ClockTable, Completion, LoadSample, Mismatch, OperatingPoint, Telemetry,
    ThermalZone,
)

ORIN_NANO_TABLE = ClockTable(
    gpu_hz=(306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000,
            1020000000),
    cpu_khz=tuple(range(115200, 1728000, 76800)) + (1728000,),
    emc_hz=(204000000, 665600000, 2133000000, 3199000000))


class FakeClock:
    def __init__(self, start_s: float = 100.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class BoardRefused(AssertionError):
    """The controller asked the double for something a real board would refuse."""


@dataclass
class StrictBoard:
    """A board double that enforces the clock table and records every write."""

    table: ClockTable = ORIN_NANO_TABLE
    original: OperatingPoint = field(default_factory=lambda: OperatingPoint(
        gpu_min_hz=306000000, gpu_max_hz=1020000000, cpu_min_khz=729600, cpu_max_khz=1728000,
        emc_hz=None, gpu_railgate=True, nvpmodel_mode=1))
    temp_c: float = 50.0
    trips_c: tuple[tuple[str, float], ...] = (("passive", 95.0), ("critical", 105.0))
    power_mw: int = 6000
    clock: Callable[[], float] | None = None
    # What a restore cannot put back (a limit's file gone): read back different, or skipped.
    restore_mismatches: tuple[Mismatch, ...] = ()
    restore_unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.point = self.original
        self.writes: list[tuple[str, int | bool]] = []  # (limit, value) per file written
        self.applies: list[OperatingPoint] = []
        self.restores: list[dict[str, Any]] = []
        self.telemetry_reads = 0

    def clock_table(self) -> ClockTable:
        return self.table

    def read_point(self) -> OperatingPoint:
        return self.point

    def _check(self, name: str, value: int | None, allowed: Sequence[int]) -> None:
        if value is not None and value not in allowed:
            raise BoardRefused(f"{name}={value} is not in the board's table")

    def apply(self, point: OperatingPoint) -> ApplyResult:
        self._check("gpu_min_hz", point.gpu_min_hz, self.table.gpu_hz)
        self._check("gpu_max_hz", point.gpu_max_hz, self.table.gpu_hz)
        self._check("cpu_min_khz", point.cpu_min_khz, self.table.cpu_khz)
        self._check("cpu_max_khz", point.cpu_max_khz, self.table.cpu_khz)
        if point.emc_hz is not None and not self.table.emc_hz:
            raise BoardRefused("EMC cannot be locked on this board")
        self._check("emc_hz", point.emc_hz, self.table.emc_hz)
        if point.nvpmodel_mode is not None and self.table.nvpmodel_modes and \
                point.nvpmodel_mode not in [mode for mode, _ in self.table.nvpmodel_modes]:
            raise BoardRefused(f"nvpmodel mode {point.nvpmodel_mode} does not exist")
        merged = {**self.point.__dict__}
        writes = 0
        for name, value in point.__dict__.items():
            if value is None:
                continue
            if merged[name] != value:
                self.writes.append((name, value))
                writes += 1
            merged[name] = value
        new = OperatingPoint(**merged)
        for low, high in (("gpu_min_hz", "gpu_max_hz"), ("cpu_min_khz", "cpu_max_khz")):
            if getattr(new, low) is not None and getattr(new, high) is not None \
                    and getattr(new, low) > getattr(new, high):
                raise BoardRefused(f"{low} above {high}: {new}")
        self.point = new
        self.applies.append(point)
        return ApplyResult(applied=new, writes=writes)

    def telemetry(self) -> Telemetry:
        self.telemetry_reads += 1
        return Telemetry(time_s=self.clock() if self.clock else 0.0,
                         gpu_freq_hz=self.point.gpu_max_hz,
                         thermal=(ThermalZone(name="tj", temp_c=self.temp_c,
                                              trips_c=self.trips_c),),
                         total_power_mw=self.power_mw, nvpmodel_mode=self.point.nvpmodel_mode,
                         source="simulation")

    def snapshot(self) -> dict[str, Any]:
        return {"point": self.point.to_json(), "emc_locked": self.point.emc_hz is not None}

    def restore(self, snapshot: dict[str, Any]) -> ApplyResult:
        self.restores.append(snapshot)
        values = dict(snapshot["point"])
        self.point = OperatingPoint(**{name: values.get(name)
                                       for name in OperatingPoint.__dataclass_fields__})
        self.writes.append(("restore", True))
        return ApplyResult(applied=self.point, writes=len(values),
                           mismatches=self.restore_mismatches,
                           unsupported=self.restore_unsupported)

    def capabilities(self) -> dict[str, str | None]:
        return {"gpu": None, "cpu": None, "emc": None, "railgate": None,
                "nvpmodel": None, "thermal": None, "rails": None, "fan": "no fan"}

    # -- what the clocks in force mean for a request (for :func:`serve`) ---------------------

    def service_s(self, batch_size: int = 1) -> float:
        """A batch's compute time at the point in force: ``k/f_gpu + c/f_cpu + m(emc)``."""
        gpu = self.point.gpu_max_hz or self.table.gpu_hz[-1]
        cpu = self.point.cpu_max_khz or self.table.cpu_khz[-1]
        emc = self.point.emc_hz or self.table.emc_hz[-1]
        one = 0.0048 * 1020e6 / gpu + 0.0008 * 1728000 / cpu + 0.0024 * (3199e6 / emc) ** 0.8
        return one * (1 + 0.6 * (batch_size - 1))


@dataclass
class ServeResult:
    latencies_s: list[float] = field(default_factory=list)
    decisions: list[Any] = field(default_factory=list)
    points: list[tuple[float, OperatingPoint]] = field(default_factory=list)
    max_queue: int = 0

    def miss_share(self, target_s: float) -> float:
        if not self.latencies_s:
            return 0.0
        return sum(1 for value in self.latencies_s if value > target_s) / len(self.latencies_s)

    def max_consecutive_misses(self, target_s: float) -> int:
        run = best = 0
        for value in self.latencies_s:
            run = run + 1 if value > target_s else 0
            best = max(best, run)
        return best


def serve(controller: Any, board: StrictBoard, clock: FakeClock, arrivals_s: Sequence[float],
          *, until_s: float, step_s: float = 0.05, max_batch: int = 4,
          slow: Callable[[float], float] = lambda now_s: 1.0) -> ServeResult:
    """Serve ``arrivals_s`` (absolute times on ``clock``) on one instance, stepping
    ``controller`` every ``step_s``; a batch's time is fixed when it starts (the clocks then)."""
    result = ServeResult()
    queue: deque[float] = deque()
    pending = deque(sorted(arrivals_s))
    arrivals_total = completed_total = 0
    batch: tuple[list[float], float, float] | None = None  # (arrivals, start, end)
    completions: list[Completion] = []
    next_step = clock.now_s + step_s
    while clock.now_s < until_s:
        next_arrival = pending[0] if pending else math.inf
        batch_end = batch[2] if batch is not None else math.inf
        when = min(next_arrival, batch_end, next_step, until_s)
        clock.now_s = max(clock.now_s, when)
        now = clock.now_s
        if batch is not None and batch[2] <= now + 1e-12:
            members, start, _ = batch
            for arrived in members:
                result.latencies_s.append(now - arrived)
                completions.append(Completion(time_s=now, total_s=now - arrived,
                                              compute_s=now - start, batch_size=len(members)))
            completed_total += len(members)
            batch = None
        while pending and pending[0] <= now + 1e-12:
            queue.append(pending.popleft())
            arrivals_total += 1
        result.max_queue = max(result.max_queue, len(queue))
        if now >= next_step - 1e-12:
            decision = controller.step(LoadSample(
                time_s=now, queue_depth=len(queue), busy_instances=int(batch is not None),
                instances=1, arrivals_total=arrivals_total, completed_total=completed_total),
                tuple(completions))
            completions = []
            result.decisions.append(decision)
            next_step += step_s
        if batch is None and queue:
            if controller.needs_wake():
                controller.wake()
            members = [queue.popleft() for _ in range(min(max_batch, len(queue)))]
            result.points.append((now, board.point))
            batch = (members, now, now + board.service_s(len(members)) * slow(now))
    return result


__all__ = ["ORIN_NANO_TABLE", "BoardRefused", "FakeClock", "ServeResult", "StrictBoard", "serve"]
