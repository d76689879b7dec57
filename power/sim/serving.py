"""SIMULATION: the serving path over simulated time, feeding a power strategy what the daemon does.

Arrivals from a :class:`~power.sim.traces.Trace` join a queue; one backend instance takes batches
of up to ``max_batch`` as soon as it is free, each running for the physics' latency at the clocks
:class:`~power.sim.board.SimBoard` has in force (re-evaluated whenever a clock comes into force
mid-batch, so a boost speeds up the batch it was made for, after its actuation delay). Every
``step_period_s`` the strategy is stepped with the live :class:`~power.types.LoadSample` (queue
depth, busy instances, the monotonic arrival and completion counters) and the
:class:`~power.types.Completion` of every request answered since the last step -- the values the
daemon's batcher gives the controller. The batcher's wake hook is modelled: a request that finds
the strategy asleep calls its ``wake`` before its batch is dispatched.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from power.sim.board import SimBoard
from power.sim.physics import LatencyNoise, compute_s, cpu_share_of_batch
from power.sim.traces import Trace
from power.types import Completion, LoadSample

EPSILON_S = 1e-9


class Strategy(Protocol):
    """A way of running the board's clocks: max clocks, the stock governors, or ours."""

    name: str

    def start(self, now_s: float) -> None: ...

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None: ...

    def sleeping(self) -> bool:
        """Whether a request must call :meth:`wake` before dispatch (the batcher's wake hook)."""
        ...

    def wake(self, now_s: float) -> None: ...

    def stop(self, now_s: float) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ServingConfig:
    max_batch: int = 4
    step_period_s: float = 0.050  # how often the daemon steps the power controller
    drain_s: float = 5.0  # after the trace's end, let the queue empty for at most this long


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    arrival_s: float
    done_s: float
    compute_s: float  # its batch's time on the backend (including an unrailgate wait)
    batch_size: int
    ideal_compute_s: float  # its batch, noise included, at the top clocks on a warm GPU
    woke: bool  # its arrival called the wake hook

    @property
    def total_s(self) -> float:
        return self.done_s - self.arrival_s


@dataclass
class ServingResult:
    records: list[RequestRecord] = field(default_factory=list)
    energy_mj: float = 0.0
    duration_s: float = 0.0
    clock_changes: int = 0  # per clock
    point_changes: int = 0  # operating-point changes (see SimBoard.point_changes)
    steps: int = 0
    wakes: int = 0
    max_queue_depth: int = 0


@dataclass
class _Batch:
    arrivals_s: list[float]
    start_s: float
    ready_s: float  # after the unrailgate wait
    noise: float
    remaining: float = 1.0  # share of the work left
    rate_per_s: float = 0.0
    woke: bool = False


def run_serving(board: SimBoard, trace: Trace, strategy: Strategy, *, config: ServingConfig,
                noise: LatencyNoise) -> ServingResult:
    """Serve ``trace`` on ``board`` under ``strategy``; the result's energy is the board's over the
    trace (and its drain)."""
    physics = board.physics
    top_gpu = board.gpu_paths.table_hz[-1]
    top_cpu = board.paths.cpu[0].table_khz[-1]
    top_emc = board.emc_rates_hz[-1]
    result = ServingResult()
    queue: deque[tuple[float, bool]] = deque()  # (arrival, it called the wake hook)
    arrivals = trace.arrivals_s
    next_arrival = 0
    arrivals_total = 0
    completed_total = 0
    completions: list[Completion] = []
    batch: _Batch | None = None
    energy_start = board.energy_mj
    changes_start = board.clock_changes
    points_start = board.point_changes
    end_s = trace.duration_s
    strategy.start(board.now_s)
    board.sync()
    next_step_s = board.now_s + config.step_period_s

    def rate_of(current: _Batch) -> float:
        gpu_hz, cpu_khz, emc_hz = board.effective()
        seconds = compute_s(physics, gpu_hz=gpu_hz, cpu_khz=cpu_khz, emc_hz=emc_hz,
                            batch_size=len(current.arrivals_s)) * current.noise
        return 1.0 / seconds

    while True:
        now = board.now_s
        arrival_s = arrivals[next_arrival] if next_arrival < len(arrivals) else math.inf
        ready_s = done_s = math.inf  # the batch's GPU ready (after an unrailgate), its end
        if batch is not None:
            if now < batch.ready_s:
                ready_s = batch.ready_s
            else:
                done_s = now + batch.remaining / batch.rate_per_s
        if arrival_s == math.inf and batch is None and not queue and now >= end_s:
            break
        if now >= end_s + config.drain_s:
            break
        when = min(arrival_s, ready_s, done_s, next_step_s, board.next_event_s(),
                   max(end_s, now) if now < end_s else math.inf)
        if batch is not None and now >= batch.ready_s:
            batch.remaining -= batch.rate_per_s * (when - now)
        board.advance(when)
        now = when

        if batch is not None and when == done_s:
            size = len(batch.arrivals_s)
            ideal = compute_s(physics, gpu_hz=top_gpu, cpu_khz=top_cpu, emc_hz=top_emc,
                              batch_size=size) * batch.noise
            for index, arrived in enumerate(batch.arrivals_s):
                record = RequestRecord(arrival_s=arrived, done_s=now,
                                       compute_s=now - batch.start_s, batch_size=size,
                                       ideal_compute_s=ideal, woke=batch.woke and index == 0)
                result.records.append(record)
                completions.append(Completion(time_s=now, total_s=record.total_s,
                                              compute_s=record.compute_s, batch_size=size))
            completed_total += size
            board.end_gpu_work()
            batch = None
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= now + EPSILON_S:
            queue.append((arrivals[next_arrival], False))
            next_arrival += 1
            arrivals_total += 1
        result.max_queue_depth = max(result.max_queue_depth, len(queue))
        if now >= next_step_s - EPSILON_S:
            board.publish()
            strategy.step(LoadSample(time_s=now, queue_depth=len(queue),
                                     busy_instances=1 if batch is not None else 0, instances=1,
                                     arrivals_total=arrivals_total,
                                     completed_total=completed_total), tuple(completions))
            completions = []
            result.steps += 1
            board.sync()
            next_step_s += config.step_period_s
        if batch is None and queue:
            woke = False
            if strategy.sleeping():
                board.publish()
                strategy.wake(now)
                board.sync()
                woke = True
                result.wakes += 1
            taken = [queue.popleft()[0] for _ in range(min(config.max_batch, len(queue)))]
            gpu_hz, cpu_khz, emc_hz = board.effective()
            share = cpu_share_of_batch(physics, gpu_hz=gpu_hz, cpu_khz=cpu_khz, emc_hz=emc_hz)
            wait_s = board.begin_gpu_work(share)
            batch = _Batch(arrivals_s=taken, start_s=now, ready_s=now + wait_s,
                           noise=noise.factor(now), woke=woke)
        if batch is not None:
            batch.rate_per_s = rate_of(batch)
    board.publish()
    strategy.stop(board.now_s)
    board.sync()
    result.energy_mj = board.energy_mj - energy_start
    result.duration_s = board.now_s
    result.clock_changes = board.clock_changes - changes_start
    result.point_changes = board.point_changes - points_start
    return result


__all__ = ["RequestRecord", "ServingConfig", "ServingResult", "Strategy", "run_serving"]
