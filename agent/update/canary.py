"""Health gates for a new version: the shadow canary before commit, the watch window after it.

**Canary** (:class:`ShadowCanary`): while the old version answers every request, the batches it
ran are handed (the batcher's tap) to the new version too, whose computing threads run at low
priority; the old answer goes to the client, the new one is only compared. The verdict (:class:`HealthVerdict`) fails on:

- ``errors``: the new version raised on more than ``max_error_rate`` of its shadowed batches;
- ``non_finite``: it gave NaN or Inf where the old version's output was finite;
- ``disagreement``: fewer than ``min_agreement`` of the shadowed samples decide as the old
  version did (the class for class scores, cosine >= ``min_cosine`` for other outputs, equal
  values for integers);
- ``slow``: the CPU time a sample costs the new version is over ``max_latency_ratio`` times what
  it costs the old one, and over :data:`MIN_SLOWDOWN_S` more (:meth:`ShadowCanary.cost`: CPU
  time, since the low-priority shadow is preempted while the serving instances are busy), over
  :data:`MIN_TIMED_BATCHES` shadowed batches at least; the first batch of an engine restored
  after a sleep (``release_engine_in_sleep``) is compared but left out of the cost.

With no traffic in ``duration_s`` there is nothing to compare: the verdict passes as
``no_traffic`` (the watch window still checks what comes later) unless ``require_traffic``.

**Watch window** (:class:`HealthWatch`): after commit, the served version's answers are checked
against the old version's figures from the canary: its failure share, NaN or Inf in its outputs,
and its 95th-percentile latency against the old one's. A regression there rolls back. A request
that waited for the board's wake (the power governor's wake hook, a sleep's engine restore with
``release_engine_in_sleep``) or ran in a restored engine's first batch is counted and checked, but
its latency is not mixed with the steady requests': timed from when dispatch resumed (the wait
for the wake left out, ``RequestDone.awake_s``), it is judged in a stratum of its own, its median
against the old version's own requests' after a wake in the canary (``ShadowCanary.old_latency``), when
the old version had :data:`MIN_LATENCY_SAMPLES` of them and the new one ``watch_min_requests``.
A restored engine's first batch is slower by nature on both versions, so it is compared with its
like, not with steady batches; on a board that sleeps before nearly every request, this stratum
is the only latency either side has. The median, not the P95: a wake's requests come together
and run in one or two batches, so over the few wakes of a canary or a window the P95 is the
slowest wake's alone, and the old version's is taken beside the canary's shadow, which loads the
CPU by as much as the new version costs (docs/power.md has the figures).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.backends.base import Backend
from agent.batcher.batcher import Tapped
from agent.errors import ConfigError
from agent.observers import RequestDone, ServingObserver
from agent.update.priority import LowPriority

log = logging.getLogger(__name__)

# Shadowed batches the latency gate needs before it judges: a version's first batch of a new
# shape is slow (ONNX Runtime allocates for it), and a quiet board's canary may see one or two
# requests, so a lone ratio of 7 rolled healthy versions back. With fewer, the watch window
# judges latency after commit.
MIN_TIMED_BATCHES = 5


# A new version is only "slow" when it also costs this much more CPU time a sample: three times
# a few microseconds is nothing a client notices.
MIN_SLOWDOWN_S = 0.0005
SCHEDSTAT = "/proc/self/task/{tid}/schedstat"


def thread_cpu_s(tid: int) -> float:
    """CPU seconds a thread of this process has run (its schedstat), 0 once it has ended."""
    try:
        with open(SCHEDSTAT.format(tid=tid), encoding="ascii") as handle:
            return int(handle.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True, kw_only=True)
class CanaryPolicy:
    """How a new version is judged before and after commit (``[update]`` in the configuration).

    Args:
        duration_s: How long the canary shadows live traffic at most.
        min_samples: Shadowed samples enough for a verdict (it may end before ``duration_s``).
        max_error_rate: Largest share of shadowed batches the new version may fail.
        min_agreement: Smallest share of shadowed samples deciding as the old version did.
        min_cosine: Per sample, for outputs without a class axis: the cosine that agrees.
        max_latency_ratio: Largest CPU time a sample of the new version over the old one's.
        require_traffic: Fail (``no_traffic``) when nothing could be shadowed.
        queue_batches: Batches waiting for the shadow at most; more are skipped, not queued.
        watch_min_requests: Requests the watch needs before it judges latency and failures.
        watch_max_failure_rate: Largest share of failed requests after commit.
        watch_max_latency_ratio: Largest P95 latency after commit over the old version's.
    """

    duration_s: float = 30.0
    min_samples: int = 64
    max_error_rate: float = 0.0
    min_agreement: float = 0.9
    min_cosine: float = 0.98
    max_latency_ratio: float = 3.0
    require_traffic: bool = False
    queue_batches: int = 4
    watch_min_requests: int = 50
    watch_max_failure_rate: float = 0.05
    watch_max_latency_ratio: float = 3.0

    def __post_init__(self) -> None:
        for name in ("duration_s", "max_latency_ratio", "watch_max_latency_ratio"):
            if not getattr(self, name) > 0:
                raise ConfigError("must be positive", key=f"update.canary.{name}",
                                  found=getattr(self, name))
        for name in ("max_error_rate", "min_agreement", "min_cosine", "watch_max_failure_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError("must be between 0 and 1", key=f"update.canary.{name}",
                                  found=getattr(self, name))
        for name in ("min_samples", "queue_batches", "watch_min_requests"):
            if getattr(self, name) < 1:
                raise ConfigError("must be at least 1", key=f"update.canary.{name}",
                                  found=getattr(self, name))


@dataclass(frozen=True)
class HealthVerdict:
    """A health gate's decision: ``reason`` is ``ok``/``no_traffic`` when it passed, else what
    failed (``errors``, ``non_finite``, ``disagreement``, ``slow``, ``failures``)."""

    passed: bool
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, **self.figures}

    def describe(self) -> str:
        details = ", ".join(f"{name} {value}" for name, value in self.figures.items())
        return f"{self.reason} ({details})" if details else self.reason


# -- comparing two versions' outputs -----------------------------------------------------------

def samples_agree(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], *,
                  batch_axes: Mapping[str, int], min_cosine: float) -> tuple[np.ndarray, bool]:
    """Per sample, whether ``new`` decides as ``old`` on every output; and whether ``new`` has
    NaN or Inf where ``old`` is finite."""
    agree: np.ndarray | None = None
    non_finite = False
    for name, want in old.items():
        got = new.get(name)
        axis = batch_axes.get(name, 0)
        want = np.moveaxis(np.asarray(want), axis, 0)
        if got is None or np.shape(got) != np.shape(np.moveaxis(want, 0, axis)):
            ok = np.zeros(want.shape[0], dtype=bool)  # a missing or reshaped output
        else:
            got = np.moveaxis(np.asarray(got), axis, 0)
            if got.dtype.kind == "f" and not np.isfinite(got).all():
                if np.isfinite(want[~np.isfinite(got)]).any():
                    non_finite = True
            ok = _agreement(want, got, min_cosine)
        agree = ok if agree is None else agree & ok
    if agree is None:
        return np.zeros(0, dtype=bool), non_finite
    return agree, non_finite


def _agreement(want: np.ndarray, got: np.ndarray, min_cosine: float) -> np.ndarray:
    count = want.shape[0]
    if want.dtype.kind != "f":
        return (want.reshape(count, -1) == got.reshape(count, -1)).all(axis=1)
    if want.ndim == 2 and want.shape[1] > 1:  # class scores: the class
        return np.asarray(want.argmax(axis=1) == got.argmax(axis=1))
    flat_want = want.reshape(count, -1).astype(np.float64)
    flat_got = np.nan_to_num(got.reshape(count, -1).astype(np.float64), nan=0.0,
                             posinf=0.0, neginf=0.0)
    norms = np.linalg.norm(flat_want, axis=1) * np.linalg.norm(flat_got, axis=1)
    dots = (flat_want * flat_got).sum(axis=1)
    both_zero = (np.abs(flat_want).max(axis=1, initial=0.0) == 0) & (
        np.abs(flat_got).max(axis=1, initial=0.0) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)
    return both_zero | (cosine >= min_cosine)


def _stack(requests: Sequence[tuple[Mapping[str, Any], dict[str, np.ndarray]]],
           batch_axes: Mapping[str, int]
           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """One batch of the requests' inputs (plain arrays only: a shared-memory input may have
    changed since it was answered) and of their outputs."""
    inputs: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    outputs: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for request_inputs, request_outputs in requests:
        if not all(isinstance(value, np.ndarray) for value in request_inputs.values()):
            continue
        for name, value in request_inputs.items():
            inputs[name].append(value)
        for name, value in request_outputs.items():
            outputs[name].append(value)
    if not inputs:
        return None
    return ({name: np.concatenate(values, axis=0) for name, values in inputs.items()},
            {name: np.concatenate(values, axis=batch_axes.get(name, 0))
             for name, values in outputs.items()})


# -- the canary ------------------------------------------------------------------------------

# Latencies a P95 or median is taken over at least (fewer: that stratum is not judged)
MIN_LATENCY_SAMPLES = 20


class _LatencyByVersion(ServingObserver):
    """Request latencies (seconds) of one version, most recent last; every outcome is counted.
    A request that waited for the board's wake is timed apart, from when dispatch resumed
    (``RequestDone.after_wake``, ``awake_s``): its total is the wake's and the engine restore's
    as much as its version's, and a restored engine's first batch is slower by nature."""

    def __init__(self, version: int, keep: int = 4096) -> None:
        self.version = version
        self.latencies_s: collections.deque[float] = collections.deque(maxlen=keep)
        self.after_wake_latencies_s: collections.deque[float] = collections.deque(maxlen=keep)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.after_wake = 0  # answered requests after a wake (not among latencies_s)

    def request_done(self, event: RequestDone) -> None:
        if event.version != self.version:
            return
        self.outcomes[event.outcome] += 1
        if event.outcome != "success":
            return
        if event.after_wake:
            self.after_wake += 1
            self.after_wake_latencies_s.append(event.awake_s)
        else:
            self.latencies_s.append(event.total_s)

    def p95_s(self) -> float | None:
        """The steady requests' P95, None with fewer than :data:`MIN_LATENCY_SAMPLES`."""
        return _percentile_of(self.latencies_s, 95)

    def after_wake_p50_s(self) -> float | None:
        """The median of the requests after a wake (from when dispatch resumed), None with
        fewer than :data:`MIN_LATENCY_SAMPLES`."""
        return _percentile_of(self.after_wake_latencies_s, 50)


def _percentile_of(latencies_s: collections.deque[float], percent: int) -> float | None:
    if len(latencies_s) < MIN_LATENCY_SAMPLES:
        return None
    return float(np.percentile(np.fromiter(latencies_s, dtype=np.float64), percent))


def _p95(values: np.ndarray) -> float:
    return float(np.percentile(values, 95))


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1e3, 3) if seconds else None


def warm_up() -> None:
    """Do the gates' first-time work now, before the daemon serves (its start calls this).

    The canary's verdict and the watch's checks run on the event loop, and the first
    ``np.percentile`` of a process imports ``numpy.ma`` (numpy 2, through ``np.unique``): 8 ms
    on the development VM idle, 19 ms under the swap benchmark's load, during which every
    request in flight waits. Left to the first update, the first canary's verdict did it.
    """
    _p95(np.zeros(20))


class ShadowCanary:
    """Shadows the old version's batches on the new version's backends (module docstring).

    Args:
        backends: The new version's instances (active, warmed up); the first one shadows.
        worker: The new version's low-priority thread.
        policy: The gates.
        old_version: The version serving now (its batches are the ones shadowed).
    """

    def __init__(self, backends: Sequence[Backend], worker: LowPriority, policy: CanaryPolicy,
                 *, old_version: int, old_threads: Callable[[], set[int]] | None = None) -> None:
        self.backend = backends[0]
        self.worker = worker
        self.policy = policy
        self.old_version = old_version
        self.old_latency = _LatencyByVersion(old_version)
        self._queue: asyncio.Queue[Tapped] = asyncio.Queue(maxsize=policy.queue_batches)
        self.samples = 0
        self.agreeing = 0
        self.batches = 0
        self.errors = 0
        self.skipped = 0
        # Batches shadowed for their answers but left out of the cost: the first after an
        # engine restore (the old version's run of it is counted with the restore, and the new
        # version's steady run of it would be compared with that cold one)
        self.after_restore = 0
        self.timed_batches = 0
        self.timed_samples = 0
        self._new_untimed_s = 0.0  # the new version's CPU time shadowing those
        self.non_finite = False
        # CPU time: the new version's threads (its worker and what it made) against the whole
        # process's less theirs, per sample each served or shadowed (see cost_ratio).
        self.old_samples = 0
        self._new_threads = worker.new_threads() | worker.worker_ids()
        self._old_threads = old_threads
        # The shadow's calls run on a thread of the daemon's own priority, not the version's
        # low-priority one: between ONNX Runtime runs (which release the GIL) they are Python
        # that holds it, and a low-priority thread preempted while holding it stalls the event
        # loop behind it (the swap benchmark's P99 doubled). The version's own threads, where
        # its computation runs, stay low.
        self._shadow_pool = ThreadPoolExecutor(1, thread_name_prefix="canary",
                                               initializer=self._remember_thread)
        self._cpu_start: tuple[float, float] | None = None
        self._cpu_end: tuple[float, float] | None = None
        self._old_engine_cpu_s = 0.0  # the old version's engine restores so far (Tapped)

    def _remember_thread(self) -> None:
        self._new_threads.add(threading.get_native_id())

    def tap(self, tapped: Tapped) -> None:
        """The batcher's tap (on the loop): queue the batch, or skip it when the shadow lags."""
        if tapped.version != self.old_version:
            return
        # A sleep's engine restores run on the old version's threads: not its serving cost.
        self._old_engine_cpu_s = tapped.engine_cpu_s
        if self._cpu_start is None:
            self._cpu_start = self._cpu_now()
            return  # counting starts with the next batch
        if not tapped.after_restore:  # a restored session's first: its cost is the restore's
            self.old_samples += tapped.samples
        try:
            self._queue.put_nowait(tapped)
        except asyncio.QueueFull:
            self.skipped += 1

    async def run(self) -> HealthVerdict:
        """Shadow until enough samples were compared or ``duration_s`` passed, or a gate
        failed; returns the verdict."""
        try:
            return await self._run()
        finally:
            self._shadow_pool.shutdown(wait=False)

    async def _run(self) -> HealthVerdict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.duration_s
        while True:
            verdict = self._early_verdict()
            if verdict is not None:
                return verdict
            left = deadline - loop.time()
            if left <= 0:
                return self._final_verdict()
            try:
                tapped = await asyncio.wait_for(self._queue.get(), timeout=left)
            except asyncio.TimeoutError:
                return self._final_verdict()
            await loop.run_in_executor(self._shadow_pool, self._shadow, tapped)

    def _shadow(self, tapped: Tapped) -> None:
        """Run one tapped batch on the new version and compare (the shadow thread)."""
        axes = self.backend.output_batch_axes
        stacked = _stack(tapped.requests, axes)
        if stacked is None:
            self.skipped += 1
            return
        inputs, old_outputs = stacked
        self.batches += 1
        untimed_from = self._untimed_cpu_s() if tapped.after_restore else None
        try:
            new_outputs = self.backend.infer(inputs)
        except Exception as exc:  # noqa: BLE001 - the new version's failure is the finding
            self.errors += 1
            log.warning("canary: the new version failed a shadowed batch: %s", exc)
            return
        finally:
            if untimed_from is not None:
                self.after_restore += 1
                self._new_untimed_s += self._untimed_cpu_s() - untimed_from
        agree, non_finite = samples_agree(old_outputs, new_outputs, batch_axes=axes,
                                          min_cosine=self.policy.min_cosine)
        self.non_finite |= non_finite
        self.samples += int(agree.size)
        self.agreeing += int(agree.sum())
        if untimed_from is None:
            self.timed_batches += 1
            self.timed_samples += int(agree.size)

    def _new_cpu_s(self) -> float:
        return sum(thread_cpu_s(tid) for tid in self._new_threads)

    def _untimed_cpu_s(self) -> float:
        """The new version's CPU seconds so far, as the shadow thread reads them around a
        batch left out of the cost: its own from thread_time(), since a running thread's
        schedstat lags (the kernel adds its time when it is switched out or at a tick, and a
        batch of a small model runs for less than that: the time then landed in the cost)."""
        own = threading.get_native_id()
        return time.thread_time() + sum(thread_cpu_s(tid) for tid in self._new_threads
                                        if tid != own)

    def _cpu_now(self) -> tuple[float, float]:
        """(CPU seconds of the old version's threads, of the new version's); without the old
        version's threads, the whole process's less the new version's."""
        new_s = self._new_cpu_s() - self._new_untimed_s
        old = self._old_threads() if self._old_threads is not None else set()
        if old:
            return sum(thread_cpu_s(tid) for tid in old) - self._old_engine_cpu_s, new_s
        return time.process_time() - new_s - self._old_engine_cpu_s, new_s

    def cost(self) -> tuple[float, float] | None:
        """CPU seconds a sample costs (old version, new version), None until both were seen.

        CPU time, not the time a run takes: the new version computes at low priority beside the
        serving instances and is preempted for as long as they are busy, which would make any new
        version look slow on a loaded device. Each version's is the CPU time of its threads
        (the batcher's workers and the backend's pools, ``ModelService.version_threads``) over
        the samples it ran; where the old version's threads are not known, the process's less
        the new version's, which includes the HTTP handling and so errs towards fast (the watch
        window then judges latency). The first batch after each engine restore (a sleep's,
        ``release_engine_in_sleep``) is left out on both sides: the old version's run of it is
        a re-created session's first, slower than its steady ones."""
        start = self._cpu_start
        end = self._cpu_end or self._cpu_now()
        if start is None or not self.timed_samples or not self.old_samples:
            return None
        new_s = end[1] - start[1]
        old_s = end[0] - start[0]
        if old_s <= 0:
            return None
        return old_s / self.old_samples, new_s / self.timed_samples

    def latency_ratio(self) -> float | None:
        """The new version's CPU time a sample over the old one's (:meth:`cost`)."""
        cost = self.cost()
        return None if cost is None else cost[1] / cost[0]

    def figures(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "batches": self.batches,
            "skipped_batches": self.skipped,
            "batches_after_restore": self.after_restore,
            "errors": self.errors,
            "agreement": round(self.agreeing / self.samples, 4) if self.samples else None,
            "cost_ratio": (round(ratio, 3) if (ratio := self.latency_ratio()) is not None
                           else None),
            "old_p95_ms": _ms(self.old_latency.p95_s()),
            "old_requests_after_wake": self.old_latency.after_wake,
            "old_after_wake_p50_ms": _ms(self.old_latency.after_wake_p50_s()),
        }

    def _early_verdict(self) -> HealthVerdict | None:
        policy = self.policy
        if self.non_finite:
            return HealthVerdict(False, "non_finite", self.figures())
        if self.batches and self.errors / self.batches > policy.max_error_rate and (
                self.errors >= 3 or self.batches >= 10 or policy.max_error_rate == 0):
            return HealthVerdict(False, "errors", self.figures())
        if self.samples >= policy.min_samples:
            return self._final_verdict()
        return None

    def _final_verdict(self) -> HealthVerdict:
        policy = self.policy
        self._cpu_end = self._cpu_now()
        figures = self.figures()
        if self.non_finite:
            return HealthVerdict(False, "non_finite", figures)
        if self.batches and self.errors / self.batches > policy.max_error_rate:
            return HealthVerdict(False, "errors", figures)
        if not self.samples:
            return HealthVerdict(not policy.require_traffic, "no_traffic", figures)
        if self.agreeing / self.samples < policy.min_agreement:
            return HealthVerdict(False, "disagreement", figures)
        cost = self.cost()
        if (cost is not None and self.timed_batches >= MIN_TIMED_BATCHES
                and cost[1] > policy.max_latency_ratio * cost[0]
                and cost[1] - cost[0] > MIN_SLOWDOWN_S):
            return HealthVerdict(False, "slow", figures)
        return HealthVerdict(True, "ok", figures)


# -- the watch window ------------------------------------------------------------------------

class HealthWatch(ServingObserver):
    """Checks the committed version's answers through the watch window (module docstring).

    Subscribe it to the service's observers and set :meth:`tap` as the batcher's tap; :meth:`run`
    returns the verdict when the window ends or at the first regression.

    Args:
        version: The version committed.
        policy: The gates.
        old_p95_s: The old version's steady P95 from the canary (``old_latency.p95_s()``).
        old_after_wake_p50_s: The old version's median after a wake from the canary
            (``old_latency.after_wake_p50_s()``).
    """

    def __init__(self, version: int, policy: CanaryPolicy, *, old_p95_s: float | None,
                 old_after_wake_p50_s: float | None = None) -> None:
        self.version = version
        self.policy = policy
        self.old_p95_s = float(old_p95_s) if old_p95_s else None
        self.old_after_wake_p50_s = old_after_wake_p50_s
        self.latency = _LatencyByVersion(version)
        self.non_finite_batches = 0
        self._changed = asyncio.Event()

    def request_done(self, event: RequestDone) -> None:
        self.latency.request_done(event)
        if event.version == self.version and event.outcome == "failure":
            self._changed.set()

    def tap(self, tapped: Tapped) -> None:
        if tapped.version != self.version:
            return
        for _, outputs in tapped.requests:
            if any(value.dtype.kind == "f" and not np.isfinite(value).all()
                   for value in outputs.values()):
                self.non_finite_batches += 1
                self._changed.set()
                return

    def figures(self) -> dict[str, Any]:
        outcomes = self.latency.outcomes
        p95 = self.latency.p95_s()
        return {
            "requests": sum(outcomes.values()),
            "failures": outcomes["failure"],
            "non_finite_batches": self.non_finite_batches,
            "requests_after_wake": self.latency.after_wake,
            "p95_ms": _ms(p95),
            "old_p95_ms": _ms(self.old_p95_s),
            "after_wake_p50_ms": _ms(self.latency.after_wake_p50_s()),
            "old_after_wake_p50_ms": _ms(self.old_after_wake_p50_s),
        }

    def check(self) -> HealthVerdict | None:
        """A failed verdict at a regression, else None (nothing wrong seen yet)."""
        policy = self.policy
        if self.non_finite_batches:
            return HealthVerdict(False, "non_finite", self.figures())
        outcomes = self.latency.outcomes
        total = sum(outcomes.values())
        if total >= policy.watch_min_requests:
            if outcomes["failure"] / total > policy.watch_max_failure_rate:
                return HealthVerdict(False, "failures", self.figures())
            if (self._slower(self.latency.latencies_s, self.latency.p95_s(), self.old_p95_s)
                    or self._slower(self.latency.after_wake_latencies_s,
                                    self.latency.after_wake_p50_s(),
                                    self.old_after_wake_p50_s)):
                return HealthVerdict(False, "slow", self.figures())
        return None

    def _slower(self, latencies_s: collections.deque[float], new_s: float | None,
                old_s: float | None) -> bool:
        """Whether one stratum (steady by P95, or after a wake by median) is a regression
        against the old version's same figure: judged with ``watch_min_requests`` timed and a
        reference."""
        policy = self.policy
        return (new_s is not None and old_s is not None and old_s > 0
                and len(latencies_s) >= policy.watch_min_requests
                and new_s > policy.watch_max_latency_ratio * old_s)

    async def run(self, *, poll_s: float = 0.25) -> HealthVerdict:
        """The verdict at the first regression; the updater ends the window (the watch
        passing) by cancelling this."""
        while True:
            verdict = self.check()
            if verdict is not None:
                return verdict
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=poll_s)
            except asyncio.TimeoutError:
                pass

