"""The DVFS governor: the cheapest operating point that keeps the latency percentile on target.

Inputs at each step: the serving path's load (arrival and completion counters, queue depth), the
completions since the last step (their latencies, and the clocks they ran at), a thermal cap and
the policy. Output: the operating point to hold, GPU and CPU pinned (min = max), EMC locked where
the board allows it.

How a point is chosen:

* **Prediction.** :class:`~power.latency_model.LatencyModel` predicts a batch's compute time at
  every candidate point (one table per EMC point). The P99 estimate is that time times a margin,
  the recent high quantile of observed/predicted (heavy-tailed and clustered: never a Gaussian
  sigma), plus the queueing delay the arrival rate implies at that point's capacity. From a
  point's 50th answer, its own quantile of latency over predicted compute replaces the pooled
  one (:meth:`Governor._point_multiplier`).
* **Cost.** Candidates are ranked by an energy rate: the point's idle draw plus its busy extra
  times the share of time it would be busy at the current arrival rate (a generic CMOS shape,
  ``f * V(f)^2``; only the ranking matters). A power cap excludes points whose estimated draw,
  scaled by what the board's telemetry measured, passes it.
* **Hysteresis.** Up at once when the point in force no longer meets the target; down only after
  a hold time, to a point that meets a tighter target (a band between the two), and only when it
  is cheaper by a margin. Clock changes are rationed by a token bucket (at most
  ``max_changes_per_s`` domain changes a second) so it cannot oscillate faster than that.
* **Emergencies** skip the hold and the ration: a queue deeper than the point in force can drain
  inside the target, or a request over the target (misses cluster, K26: the next one is likely to
  miss too), send it to the top point for a while.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from power.latency_model import LatencyModel, PointKey
from power.thermal_guard import ThermalCap
from power.types import ClockTable, Completion, LoadSample, OperatingPoint, PowerPolicy

CPU_LEVELS = 6  # CPU entries the governor chooses among (the table's ends and evenly between)
TAIL_QUANTILE = 0.995  # of observed/predicted compute, for the margin
MIN_MARGIN = 1.15
MISS_HEADROOM = 0.70  # after a miss: aim this far under the target
UP_HEADROOM = 0.95  # going up: aim this far under the target, so one step is enough
DOWN_BAND = 0.85  # going down: the new point must meet this share of the target
DOWN_COST_GAIN = 0.97  # ... and cost at most this share of the point in force
DOWN_HOLD_S = 1.5  # no move down sooner than this after any change ...
ROOMY_HOLD_S = 0.3  # ... or, for the first move down, than this where the point in force has
ROOMY_LEAST = 2  # plenty of room: this many requests answered there, each within this share
ROOMY_SHARE = 0.4  # of the target
DOWN_AFTER_UP_S = 3.0  # ... nor this soon after a move up, unless explored:
EXPLORE_AFTER_UP_S = 0.5  # once this long after a move up, one move down may be tried where
EXPLORE_SHARE = 0.6  # the P99 observed at the new point is within this share of the target,
EXPLORE_WAKE_S = 1.0  # the move up came this soon after a wake's boost (a burst's start), and
# the arrival rate (both windows) is no higher than the move up was made for
MISS_HOLD_S = 1.0  # a miss counts against its point, and blocks moves down, this long
MAX_UTILISATION = 0.80  # never plan a point busier than this at the current arrival rate
PREDICTION_REFRESH_S = 0.5  # re-predict every candidate at most this often
TOTAL_QUANTILE = 0.99  # of observed latency / predicted compute, per utilisation bucket
UTILISATION_BUCKETS = 8
POINT_RATIO_LEAST = 50  # answers at a point before its own latency / compute quantile stands for
# it (over the utilisation buckets, which pool every point's burst starts)
POINT_RATIO_KEEP = 300  # ... of its latest answers
DOWN_CHECK_S = 0.25  # look for a cheaper point at most this often
DOWN_RATE_FACTOR = 1.1
DOWN_RATE_FALL = 0.9  # moving down needs the load to have fallen this far since the last move up
DOWN_EXPLORE_S = 10.0  # ... or that move to be this old on a load no higher (the model may
# know better by then)
DOWN_MAX_BUSY = 0.45  # no move down to a point busier than this share of the time
HELD_TRUST = 1.1  # the observed P99 at the point in force, times this, caps its estimate
CHOSEN_TRUST = 1.1  # the estimate a point was chosen with, times this, until it is observed
RATE_RISE = 1.2  # ... unless the load rose past this share of what the point was chosen for
HELD_LEAST = 20  # requests at the point in force before its observed P99 counts
RATE_FAST_S = 0.5  # arrival-rate windows
RATE_SLOW_S = 2.0
WAKE_RATE_S = 3.0  # after a wake, for this long, the rate since the wake plans (the windows
# still hold the idle before it, or too few of the burst's arrivals to tell noise from a rise)
WAKE_RATE_LEAST = 30  # ... once this many arrivals followed the one that woke it (fewer:
# a rate from 8-20 arrivals is off by a quarter to a third, and its highs size the next wake)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    key: PointKey
    idle_mw: float  # rough draw of the clocks held, GPU on, nothing running
    busy_extra_mw: float  # rough extra while a batch runs


@dataclass(frozen=True, kw_only=True)
class Choice:
    key: PointKey
    reason: str
    predicted_s: float | None  # P99 estimate at ``key``
    emergency: bool = False


def _voltage(share: float) -> float:
    """Relative voltage at a share of the clock range (a typical DVFS curve: 0.65..1)."""
    return 0.65 + 0.35 * min(1.0, max(0.0, share))


def _share(value: int, table: Sequence[int]) -> float:
    return 0.0 if table[-1] == table[0] else (value - table[0]) / (table[-1] - table[0])


def estimate_draw(key: PointKey, table: ClockTable, cpu_cores: int = 6) -> Candidate:
    """A rough idle and busy-extra draw (mW) of ``key``: the ``f * V^2`` shape per domain with
    magnitudes of an Orin-class module. Only the ranking between points matters."""
    gpu_mhz = key.gpu_hz / 1e6
    gpu_v = _voltage(_share(key.gpu_hz, table.gpu_hz))
    cpu_mhz = key.cpu_khz / 1e3
    cpu_v = _voltage(_share(key.cpu_khz, table.cpu_khz))
    emc_mhz = (key.emc_hz or (table.emc_hz[-1] if table.emc_hz else 2133000000)) / 1e6
    idle = (1000.0 * gpu_v + 2.5 * gpu_mhz * gpu_v ** 2
            + cpu_cores * 0.1 * cpu_mhz * cpu_v ** 2 + 0.3 * emc_mhz)
    busy = 6.0 * gpu_mhz * gpu_v ** 2 + 0.5 * cpu_mhz * cpu_v ** 2 + 0.6 * emc_mhz
    return Candidate(key=key, idle_mw=idle, busy_extra_mw=busy)


def cpu_levels(cpu_khz: Sequence[int], count: int = CPU_LEVELS) -> tuple[int, ...]:
    """``count`` entries of the CPU table: both ends and evenly spaced (by index) between."""
    if len(cpu_khz) <= count:
        return tuple(cpu_khz)
    last = len(cpu_khz) - 1
    return tuple(sorted({cpu_khz[round(i * last / (count - 1))] for i in range(count)}))


class _RateMeter:
    """Arrival rate from the monotonic counter over two sliding windows: the long one plans,
    the short one takes over only when it is significantly higher (a burst), so a steady stream's
    counting noise does not move the clocks."""

    def __init__(self) -> None:
        self._counts: deque[tuple[float, int]] = deque()
        self.slow_hz = 0.0
        self.fast_hz = 0.0
        self.planning_hz = 0.0
        self.since_wake_hz: float | None = None  # None: no recent wake, or too few arrivals
        self._wake_s: float | None = None
        self._wake_total: int | None = None  # the counter before the wake's request

    def wake(self, time_s: float) -> None:
        """A wake at ``time_s``, before its request is dispatched: the rate since then is
        counted from the last sample (the idle before held no arrivals but that request)."""
        self._wake_s = time_s
        self._wake_total = self._counts[-1][1] if self._counts else None
        self.since_wake_hz = None

    def _since(self, now_s: float, window_s: float, total: int) -> tuple[int, float]:
        for time_s, count in self._counts:
            if now_s - time_s <= window_s + 1e-9:
                return total - count, max(now_s - time_s, 1e-3)
        return 0, window_s

    def update(self, time_s: float, total: int) -> None:
        counts = self._counts
        counts.append((time_s, total))
        while counts and time_s - counts[0][0] > RATE_SLOW_S + 1e-9:
            counts.popleft()
        if len(counts) < 2:
            return
        slow_count, slow_span = self._since(time_s, RATE_SLOW_S, total)
        fast_count, fast_span = self._since(time_s, RATE_FAST_S, total)
        self.slow_hz = slow_count / slow_span
        self.fast_hz = fast_count / fast_span
        base_hz = max(self.slow_hz, self._since_wake(time_s, total))
        expected = base_hz * fast_span
        significant = fast_count > expected + 3.0 * math.sqrt(max(expected, 1.0)) + 1
        self.planning_hz = self.fast_hz if significant else base_hz

    def _since_wake(self, time_s: float, total: int) -> float:
        """The arrival rate since a recent wake (0: none, or too few arrivals yet to say).

        A burst's first seconds: the slow window still holds the idle before it, so against it
        every fast window reads as a rise, and the fast window's few arrivals are noisy (a
        40 req/s stream reads 46-64 in some 0.5 s windows). The arrivals since the wake, over
        the time since the wake, are the most the burst has said so far. The request that
        woke it is left out of the count: the wake is its arrival, so the rest over the time
        since is the rate's estimate from one arrival on (not biased up by a short span)."""
        wake_s = self._wake_s
        if wake_s is None or time_s - wake_s > WAKE_RATE_S:
            self._wake_s = self.since_wake_hz = None
            return 0.0
        if self._wake_total is None:
            # No sample before the wake: this one (its request counted) stands in.
            self._wake_total = total - 1
        after = total - self._wake_total - 1
        if after < WAKE_RATE_LEAST or time_s <= wake_s:
            self.since_wake_hz = None
            return 0.0
        self.since_wake_hz = after / (time_s - wake_s)
        return self.since_wake_hz


class _ChangeRation:
    """A token bucket of domain changes: ``rate_per_s`` tokens a second, ``rate_per_s`` at most."""

    def __init__(self, rate_per_s: float) -> None:
        self.rate_per_s = rate_per_s
        self._tokens = rate_per_s
        self._last_s: float | None = None

    def refill(self, now_s: float) -> None:
        if self._last_s is not None:
            self._tokens = min(self.rate_per_s,
                               self._tokens + (now_s - self._last_s) * self.rate_per_s)
        self._last_s = now_s

    def allows(self, changes: int) -> bool:
        return self._tokens >= changes

    def spend(self, changes: int) -> None:
        self._tokens -= changes  # an emergency may overdraw: it is paid back before the next


def changed_domains(old: PointKey | None, new: PointKey) -> int:
    if old is None:
        return 3
    return ((old.gpu_hz != new.gpu_hz) + (old.cpu_khz != new.cpu_khz)
            + (old.emc_hz != new.emc_hz))


class _RatioBuckets:
    """Observed request latency over the predicted single-request compute at its point, kept per
    utilisation bucket: the P99 multiplier of a point, queueing and batching included, learned
    rather than assumed (periodic arrivals hardly queue; Poisson ones at the same load do)."""

    def __init__(self, buckets: int, width: float, keep: int = 300) -> None:
        self.width = width
        self._ratios: list[deque[float]] = [deque(maxlen=keep) for _ in range(buckets)]
        self._own: list[float | None] = [None] * buckets  # each bucket's quantile, cached
        self._dirty = [False] * buckets
        self.quantiles: list[float | None] = [None] * buckets

    def index(self, busy: float) -> int:
        return min(len(self._ratios) - 1, max(0, int(busy / self.width)))

    def add(self, busy: float, ratio: float) -> None:
        index = self.index(busy)
        self._ratios[index].append(ratio)
        self._dirty[index] = True

    def refresh(self, quantile: float, least: int = 20) -> None:
        for index, ratios in enumerate(self._ratios):
            if self._dirty[index] and len(ratios) >= least:
                ordered = sorted(ratios)
                self._own[index] = ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]
            self._dirty[index] = False
        learned: list[float | None] = []
        floor = 0.0
        for own in self._own:
            if own is None:
                learned.append(None)
                continue
            # Never below a less busy bucket's: more load cannot mean less waiting.
            floor = max(floor, own)
            learned.append(floor)
        self.quantiles = learned


class Governor:
    """Chooses the operating point from the load, the completions and the policy.

    Args:
        table: the board's clocks (cached: the governor never reads the board).
        policy: what to aim for.
    """

    def __init__(self, table: ClockTable, policy: PowerPolicy) -> None:
        self.table = table
        self.policy = policy
        self.model = LatencyModel(gpu_ref_hz=table.gpu_hz[-1], cpu_ref_khz=table.cpu_khz[-1])
        emc_points: tuple[int, ...] = table.emc_hz or (0,)
        self.candidates = [estimate_draw(PointKey(gpu_hz=gpu, cpu_khz=cpu, emc_hz=emc), table)
                           for emc in emc_points for gpu in table.gpu_hz
                           for cpu in cpu_levels(table.cpu_khz)]
        self.top = PointKey(gpu_hz=table.gpu_hz[-1], cpu_khz=table.cpu_khz[-1],
                            emc_hz=emc_points[-1])
        self.bottom = PointKey(gpu_hz=table.gpu_hz[0], cpu_khz=table.cpu_khz[0],
                               emc_hz=emc_points[0])
        self._draw = {candidate.key: candidate for candidate in self.candidates}
        self._emc_points = emc_points
        self._features = [(c.key.emc_hz, table.gpu_hz[-1] / c.key.gpu_hz,
                           table.cpu_khz[-1] / c.key.cpu_khz) for c in self.candidates]
        self._rate = _RateMeter()
        self._ration = _ChangeRation(policy.max_changes_per_s)
        self._batch_avg = 1.0
        self._batch_max = 1
        self._ratios = _RatioBuckets(UTILISATION_BUCKETS, MAX_UTILISATION / UTILISATION_BUCKETS)
        self._predicted: list[float] | None = None  # per candidate, single request
        self._predicted_version = -1
        self._predicted_at_s = -math.inf
        self._last_change_s = -math.inf
        self._last_up_s = -math.inf
        self._last_miss_s = -math.inf
        self._rate_at_up_hz = math.inf  # the arrival rate the last move up was made for
        self.peak_rate_hz = 0.0  # the highest planning rate since the controller last reset it
        self._rate_at_change_hz = 0.0  # the planning rate when the point in force was taken
        self._chosen_p99_s: float | None = None  # the estimate it was taken with
        self._planned_rate_hz = 0.0  # the rate the last search planned for
        self._fresh_miss_s = 0.0  # the worst miss at the point in force, while fresh
        self._fresh_miss_at_s = -math.inf
        self._last_down_check_s = -math.inf
        self._moved_down = False  # a move down was made (the short first hold is spent)
        self._explored = False  # the last move up was explored down already
        self._placed_s = -math.inf  # when the controller last placed a point (a wake, a park)
        self._power_scale = 1.0  # measured / estimated draw
        self.recent: deque[tuple[float, float]] = deque(maxlen=400)  # (time, total_s)
        self._held: deque[float] = deque(maxlen=200)  # totals at the point in force, since it was
        self.misses = 0
        self.current: PointKey | None = None
        # Observed latency / predicted compute per point answered at, and its cached quantile
        # (the point's own evidence, once it has POINT_RATIO_LEAST answers).
        self._point_ratios: dict[PointKey, deque[float]] = {}
        self._point_quantiles: dict[PointKey, float] = {}
        self._points_dirty: set[PointKey] = set()

    # -- inputs ------------------------------------------------------------------------------

    def set_policy(self, policy: PowerPolicy) -> None:
        self.policy = policy
        self._ration.rate_per_s = policy.max_changes_per_s

    def observe(self, load: LoadSample, completions: Sequence[Completion],
                key_of: Callable[[Completion], PointKey | None]) -> None:
        """Learn from one step's completions; ``key_of`` names the clocks a completion's whole
        batch ran at (``None``: they changed during it)."""
        self._rate.update(load.time_s, load.arrivals_total)
        self.peak_rate_hz = max(self.peak_rate_hz, self._rate.planning_hz)
        target = self.policy.latency_target_s
        model = self.model
        for completion in completions:
            self.recent.append((completion.time_s, completion.total_s))
            missed = completion.total_s > target
            if missed:
                self.misses += 1
                self._last_miss_s = completion.time_s
            self._batch_avg += 0.05 * (completion.batch_size - self._batch_avg)
            self._batch_max = max(self._batch_max, completion.batch_size)
            if not completion.ok:
                continue
            key = key_of(completion)
            if missed and (key == self.current or (
                    key is None and completion.time_s - completion.compute_s
                    >= self._last_change_s)):
                # A miss at the point in force (or on its way to it) counts against it.
                self._fresh_miss_s = max(self._fresh_miss_s, completion.total_s)
                self._fresh_miss_at_s = completion.time_s
            if key is None:
                continue
            if key == self.current:
                self._held.append(completion.total_s)
            single = model.predict_s(key)
            if single is not None:
                busy = self._busy(single, self._rate.slow_hz)
                self._ratios.add(busy, completion.total_s / single)
                own = self._point_ratios.get(key)
                if own is None:
                    own = self._point_ratios[key] = deque(maxlen=POINT_RATIO_KEEP)
                own.append(completion.total_s / single)
                self._points_dirty.add(key)
            model.observe(key, completion.compute_s, completion.batch_size)

    def observe_power(self, key: PointKey, measured_mw: float, busy_share: float) -> None:
        """A telemetry reading at ``key``: corrects the draw estimates' scale (for the cap)."""
        draw = self._draw.get(key)
        if draw is None or measured_mw <= 0:
            return
        estimate = draw.idle_mw + busy_share * draw.busy_extra_mw
        self._power_scale += 0.2 * (measured_mw / estimate - self._power_scale)

    # -- prediction ---------------------------------------------------------------------------

    def _refresh(self, now_s: float) -> list[float] | None:
        model = self.model
        if not model.ready:
            return None
        if self._predicted is None or (model.version != self._predicted_version
                                       and now_s - self._predicted_at_s >= PREDICTION_REFRESH_S):
            # One set of coefficients per EMC point, then a multiply-add per candidate: this
            # runs every PREDICTION_REFRESH_S inside a step that has 1 ms.
            per_emc = {emc: model.coefficients(emc) for emc in self._emc_points}
            predicted = []
            for (emc, gpu_share, cpu_share) in self._features:
                coefficients = per_emc[emc]
                if coefficients is None:
                    predicted.append(math.inf)
                    continue
                a, k, b = coefficients
                predicted.append(max(a * gpu_share + k * cpu_share + b, 1e-6))
            self._predicted = predicted
            self._predicted_version = model.version
            self._predicted_at_s = now_s
            self._ratios.refresh(TOTAL_QUANTILE)
            for key in self._points_dirty:
                ratios = self._point_ratios[key]
                if len(ratios) >= POINT_RATIO_LEAST:
                    ordered = sorted(ratios)
                    self._point_quantiles[key] = ordered[
                        min(len(ordered) - 1, int(TOTAL_QUANTILE * len(ordered)))]
            self._points_dirty.clear()
        return self._predicted

    def _busy(self, single_s: float, rate_hz: float) -> float:
        batch = max(1.0, self._batch_avg)
        return rate_hz * single_s * self.model.batch_factor(round(batch)) / batch

    def _multiplier(self, busy: float, margin: float) -> float:
        """P99 latency over the single-request compute time at a point this busy."""
        if busy >= MAX_UTILISATION:
            return math.inf
        ratios = self._ratios
        index = ratios.index(busy)
        learned = ratios.quantiles[index]
        if learned is not None:
            return max(learned, margin)
        # Not seen at this load yet: a request may wait for the batch in progress and for a
        # queue (M/D/1-like), in units of the batch time, all times the compute margin; scaled
        # to the nearest less busy load seen, where there is one.
        batch_factor = self.model.batch_factor(round(max(1.0, self._batch_avg)))
        analytic = batch_factor * (margin + busy + 1.5 * busy / (1.0 - busy))
        for lower in range(index - 1, -1, -1):
            seen = ratios.quantiles[lower]
            if seen is not None:
                at = (lower + 1) * ratios.width  # the top of that bucket: pessimistic
                return max(margin, seen * analytic
                           / (batch_factor * (margin + at + 1.5 * at / (1.0 - at))))
        return analytic

    def _point_multiplier(self, key: PointKey, busy: float, margin: float) -> float:
        """P99 latency over the single-request compute time at ``key`` this busy: the point's
        own observed quantile where it has answered :data:`POINT_RATIO_LEAST` requests (what
        its answers said, not the pooled buckets, which carry every point's burst starts), not
        scaled with the load and never under the compute margin; else the buckets'. Over
        :data:`MAX_UTILISATION` busy: never."""
        pooled = self._multiplier(busy, margin)
        own = self._point_quantiles.get(key)
        if own is None or not math.isfinite(pooled):
            return pooled
        return max(margin, own)

    def point_ratio_evidence(self, key: PointKey) -> tuple[int, float | None]:
        """How many answers at ``key`` its own quantile rests on, and that quantile (``None``
        while under :data:`POINT_RATIO_LEAST`, or not refreshed yet)."""
        ratios = self._point_ratios.get(key)
        return (0 if ratios is None else len(ratios)), self._point_quantiles.get(key)

    @staticmethod
    def _shape(busy: float) -> float:
        """How queueing grows with the busy share (M/D/1-like, plus the batch in progress)."""
        return math.inf if busy >= 1.0 else 1.0 + busy + 1.5 * busy / (1.0 - busy)

    def predict_p99_s(self, key: PointKey, rate_hz: float | None = None) -> float | None:
        single = self.model.predict_s(key)
        if single is None:
            return None
        rate = self._rate.planning_hz if rate_hz is None else rate_hz
        return single * self._point_multiplier(key, self._busy(single, rate), self.margin())

    def margin(self) -> float:
        return max(MIN_MARGIN, self.model.tail_ratio(TAIL_QUANTILE))

    @property
    def arrival_rate_hz(self) -> float:
        return self._rate.planning_hz

    # -- the choice ---------------------------------------------------------------------------

    def _allowed(self, key: PointKey, cap: ThermalCap | None) -> bool:
        if cap is not None:
            if cap.gpu_max_hz is not None and key.gpu_hz > cap.gpu_max_hz:
                return False
            if cap.cpu_max_khz is not None and key.cpu_khz > cap.cpu_max_khz:
                return False
        return True

    def capped_top(self, cap: ThermalCap | None) -> PointKey:
        """The top point under ``cap``."""
        return self._capped_top(cap)

    def _capped_top(self, cap: ThermalCap | None) -> PointKey:
        if cap is None or (cap.gpu_max_hz is None and cap.cpu_max_khz is None):
            return self.top
        gpu = max((hz for hz in self.table.gpu_hz if cap.gpu_max_hz is None
                   or hz <= cap.gpu_max_hz), default=self.table.gpu_hz[0])
        cpu = max((khz for khz in self.table.cpu_khz if cap.cpu_max_khz is None
                   or khz <= cap.cpu_max_khz), default=self.table.cpu_khz[0])
        return PointKey(gpu_hz=gpu, cpu_khz=cpu, emc_hz=self.top.emc_hz)

    def best(self, now_s: float, share_of_target: float, cap: ThermalCap | None = None,
             queue_depth: int = 0, anchored: bool = False, down: bool = False,
             rate_hz: float | None = None, up: bool = False) -> tuple[PointKey, float] | None:
        """The cheapest allowed candidate whose P99 estimate is within ``share_of_target`` of
        the target (and which drains ``queue_depth`` requests inside it), with that estimate;
        ``None`` when none is (or nothing is learned yet). ``anchored``: no estimate below the
        P99 observed at the point in force, scaled by the predicted compute and queueing.
        ``down``: a move down (a margin on the rate, and a busy share it must stay under).
        ``rate_hz``: plan for this arrival rate instead of the one measured now. ``up``: a move
        up from the point in force: no clock lower than it is now."""
        predicted = self._refresh(now_s)
        if predicted is None:
            return None
        anchor = 0.0  # observed P99 / single compute at the point in force, over its shape
        if anchored and self.current is not None:
            held = self.observed_at_current_s(now_s)
            single_now = self.model.predict_s(self.current)
            if held is not None and single_now:
                anchor = held / single_now / self._shape(self._busy(single_now, self._rate.planning_hz))
        rate = self._rate.planning_hz if rate_hz is None else rate_hz
        busy_limit = MAX_UTILISATION
        below = self.current if down else None
        above = self.current if up else None
        if down:
            # Moving down: no clock goes up (a sideways move on a rising load is how a governor
            # starts to oscillate); plan for a rate a little above the measured one (a 2 s window of a
            # Poisson stream is off by several per cent), and not into a load where a slow spell
            # builds a queue the lower clocks cannot drain.
            rate = max(rate, self._rate.fast_hz, self._rate.slow_hz) * DOWN_RATE_FACTOR
            busy_limit = DOWN_MAX_BUSY
        self._planned_rate_hz = rate
        margin = self.margin()
        limit = self.policy.latency_target_s * share_of_target
        power_cap = self.policy.power_cap_mw
        scale = self._power_scale
        batch = max(1.0, self._batch_avg)
        per_item = self.model.batch_factor(round(batch)) / batch
        largest = self._batch_max
        full, rest = divmod(queue_depth, largest)
        drain_factor = (full * self.model.batch_factor(largest)
                        + (self.model.batch_factor(rest) if rest else 0.0)
                        + (0.5 * self.model.batch_factor(largest) if queue_depth else 0.0))
        best_cost = math.inf
        best: tuple[PointKey, float] | None = None
        for candidate, single in zip(self.candidates, predicted):
            busy = rate * single * per_item
            if busy > busy_limit:
                continue
            if below is not None and (candidate.key.gpu_hz > below.gpu_hz
                                      or candidate.key.cpu_khz > below.cpu_khz
                                      or candidate.key.emc_hz > below.emc_hz):
                continue
            if above is not None and (candidate.key == above
                                      or candidate.key.gpu_hz < above.gpu_hz
                                      or candidate.key.cpu_khz < above.cpu_khz
                                      or candidate.key.emc_hz < above.emc_hz):
                continue
            p99 = single * self._point_multiplier(candidate.key, busy, margin)
            if anchor:
                # What was observed where the governor is, carried to the candidate by the
                # compute and queueing ratios, overrides the buckets (which keep the transients
                # of every burst's start); never under the compute margin.
                p99 = single * max(anchor * self._shape(busy),
                                   margin * self.model.batch_factor(round(batch)))
            if p99 > limit or single * drain_factor > limit:
                continue
            cost = candidate.idle_mw + min(1.0, busy) * candidate.busy_extra_mw
            if cost >= best_cost or not self._allowed(candidate.key, cap):
                continue
            if power_cap is not None and cost * scale > power_cap:
                continue
            best_cost = cost
            best = (candidate.key, p99)
        return best

    def point_for_rate(self, now_s: float, rate_hz: float, cap: ThermalCap | None = None,
                       share_of_target: float = UP_HEADROOM) -> tuple[PointKey, float] | None:
        """The cheapest point meeting the target (with the headroom of a move up) at
        ``rate_hz``, with its P99 estimate: what a wake boosts to when the next burst is like
        the last."""
        return self.best(now_s, share_of_target, cap, rate_hz=rate_hz)

    def cost(self, key: PointKey) -> float:
        draw = self._draw.get(key) or estimate_draw(key, self.table)
        single = self.model.predict_s(key)
        busy = 0.0 if single is None else min(1.0, self._busy(single, self._rate.planning_hz))
        return draw.idle_mw + busy * draw.busy_extra_mw

    def _drain_s(self, key: PointKey, queue_depth: int, busy: bool) -> float | None:
        """How long the queue takes to clear at ``key``: its batches, after half the batch in
        progress (its expected rest)."""
        single = self.model.predict_s(key)
        if single is None:
            return None
        largest = self._batch_max
        full, rest = divmod(queue_depth, largest)
        batches_s = full * self.model.batch_factor(largest) + (
            self.model.batch_factor(rest) if rest else 0.0)
        in_progress = 0.5 * self.model.batch_factor(largest) if busy else 0.0
        return single * (batches_s + in_progress)

    def choose(self, load: LoadSample, cap: ThermalCap | None = None) -> Choice:
        """The point to hold from now (the point in force is :attr:`current`)."""
        now = load.time_s
        self._ration.refill(now)
        target = self.policy.latency_target_s
        current = self.current
        top = self._capped_top(cap)
        if not self.model.ready:
            return self._go(Choice(key=top, reason="learning", predicted_s=None), now)
        self._refresh(now)  # the multipliers every estimate below uses, current or not
        self._planned_rate_hz = 0.0
        # Emergencies first: a queue the point in force cannot drain inside the target (to the
        # cheapest point that can), or a fresh miss (clustered: the next is likely to miss too).
        if current is not None and load.queue_depth > 0 and current != top:
            drain = self._drain_s(current, load.queue_depth, load.busy_instances > 0)
            if drain is not None and drain > target * UP_HEADROOM:
                found = self.best(now, UP_HEADROOM, cap, queue_depth=load.queue_depth)
                key = found[0] if found is not None else top
                if key != current and self.cost(key) > self.cost(current):
                    return self._go(Choice(key=key, reason="queue emergency", predicted_s=drain,
                                           emergency=True), now)
        current_p99 = None if current is None else self.predict_p99_s(current)
        observed = self.observed_at_current_s(now)
        held = self.held_p99_s()
        if current_p99 is not None and not self._rate_rising():
            if held is not None:
                # Enough requests at this point under this load: what they saw, with a margin,
                # over what the buckets predict.
                current_p99 = min(current_p99, held * HELD_TRUST)
            elif self._chosen_p99_s is not None:
                # Too few yet: the estimate it was chosen with stands (else a move down made on
                # the observed anchor is undone at once on the buckets' word).
                current_p99 = min(current_p99, self._chosen_p99_s * CHOSEN_TRUST)
        if current_p99 is not None and observed is not None:
            current_p99 = max(current_p99, observed)
        missed = observed is not None and observed > target
        if current is None or current_p99 is None or current_p99 > target \
                or not self._allowed(current, cap):
            # After a miss, aim well under the target: misses cluster (K26), and the next
            # request may already be in the slow spell.
            found = self.best(now, MISS_HEADROOM if missed else UP_HEADROOM, cap,
                              anchored=True)
            key, p99 = found if found is not None else (top, None)
            if current is not None and self._allowed(current, cap) \
                    and self.cost(key) <= self.cost(current):
                # Over the target as observed, yet the model prefers a cheaper point: trust the
                # observation and go up: after a miss to the top; else to the cheapest point
                # with no clock lower than now that the model says meets it (the top is the
                # dearest point there is, and a burst often ends before a hold lets it down).
                key, p99 = (top, None) if missed else (self._halfway_up(current, top), None)
            capped = current is not None and not self._allowed(current, cap)
            reason = "thermal cap" if capped else "missed the target" if missed \
                else "over target"
            # A miss is an emergency (misses cluster, K26: the next is likely to miss too).
            return self._go(Choice(key=key, reason=reason, predicted_s=p99,
                                   emergency=capped or missed), now)
        # The point in force meets the target: move down only with slack, after a hold (for
        # the first move down, where the first few answers had plenty of room, a short one:
        # the start's top point is far more than a light load needs, and every second there
        # costs several watts; later, after a wake's boost or a move up, the full hold, as a
        # burst's first answers say little about its rest).
        hold_s = ROOMY_HOLD_S if not self._moved_down and self._roomy() else DOWN_HOLD_S
        since_up_s = now - self._last_up_s
        settled = (now - self._last_change_s >= hold_s and since_up_s >= DOWN_AFTER_UP_S
                   and (self._rate.slow_hz <= DOWN_RATE_FALL * self._rate_at_up_hz
                        or (since_up_s >= DOWN_EXPLORE_S
                            and self._rate.slow_hz <= self._rate_at_up_hz)))
        explore = not settled and self._explorable(now)
        if ((settled or explore) and now - self._last_miss_s >= MISS_HOLD_S
                and now - self._last_down_check_s >= DOWN_CHECK_S):
            self._last_down_check_s = now
            found = self.best(now, DOWN_BAND, cap, anchored=True, down=True)
            if found is not None and found[0] != current \
                    and self.cost(found[0]) < DOWN_COST_GAIN * self.cost(current):
                reason = "explored down" if explore else "slack"
                choice = self._go(Choice(key=found[0], reason=reason, predicted_s=found[1]),
                                  now)
                if choice.key == found[0]:
                    self._moved_down = True
                    self._explored = self._explored or explore
                return choice
        return Choice(key=current, reason="steady", predicted_s=current_p99)

    def _explorable(self, now_s: float) -> bool:
        """Whether the point a move up took may be tried one step back down before the usual
        wait: a burst's first seconds push the rate estimate (and the point) up on a few
        close arrivals, and the wait after a move up outlasts most bursts. Only once per move
        up, only where what was observed there has plenty of room, and never while the load is
        still rising (a ramp: either window above the rate the move up was made for)."""
        if self._explored or self._last_change_s != self._last_up_s \
                or now_s - self._last_up_s < EXPLORE_AFTER_UP_S \
                or self._last_up_s - self._placed_s > EXPLORE_WAKE_S:
            return False
        rate = self._rate
        if max(rate.fast_hz, rate.slow_hz, rate.planning_hz) > self._rate_at_up_hz:
            return False
        held = self.held_p99_s()
        return held is not None and held <= EXPLORE_SHARE * self.policy.latency_target_s

    def _halfway_up(self, current: PointKey, top: PointKey) -> PointKey:
        """Each clock halfway (by table index, rounded up) from ``current`` to ``top``: a move
        up that does not lean on the model that just proved optimistic."""
        def halfway(value: int, high: int, table: Sequence[int]) -> int:
            if value not in table or high not in table:
                return high
            low_index, high_index = table.index(value), table.index(high)
            return table[max(low_index, -(-(low_index + high_index) // 2))]
        cpu_table = cpu_levels(self.table.cpu_khz)
        return PointKey(gpu_hz=halfway(current.gpu_hz, top.gpu_hz, self.table.gpu_hz),
                        cpu_khz=halfway(current.cpu_khz, top.cpu_khz, cpu_table),
                        emc_hz=halfway(current.emc_hz, top.emc_hz, self._emc_points))

    def _go(self, choice: Choice, now_s: float) -> Choice:
        """Take ``choice`` if the ration allows (emergencies always), else stay."""
        current = self.current
        if choice.key == current:
            return choice
        changes = changed_domains(current, choice.key)
        if not choice.emergency and current is not None and not self._ration.allows(changes):
            return Choice(key=current, reason=f"{choice.reason} (rationed)",
                          predicted_s=None)
        self._ration.spend(changes)
        going_up = current is None or self.cost(choice.key) > self.cost(current)
        self._last_change_s = now_s
        if going_up:
            self._last_up_s = now_s
            # An emergency (a miss, a queue) is not explored back down: it said the target
            # itself was at stake.
            self._explored = choice.emergency
            self._rate_at_up_hz = math.inf if choice.reason == "learning" \
                else self._rate.planning_hz
        self.current = choice.key
        self._held.clear()
        self._fresh_miss_s = 0.0
        self._rate_at_change_hz = max(self._rate.planning_hz, self._planned_rate_hz)
        self._chosen_p99_s = choice.predicted_s
        return choice

    def placed(self, key: PointKey, now_s: float, *, rate_hz: float | None = None,
               predicted_s: float | None = None, wake: bool = False) -> None:
        """The controller put ``key`` in force by itself (a park, a wake boost). ``rate_hz``
        and ``predicted_s``: what a wake's point was sized for (the last busy period's rate)
        and its P99 estimate there: until the load passes that rate, the point is judged as
        if the governor had chosen it (a burst's first arrivals, in a rate window still half
        idle, would otherwise read as a load rising past anything the point was meant for).
        ``wake``: a wake placed it (the first request after idle is next): the arrival rate
        is planned on the arrivals since, for the first seconds."""
        self._placed_s = now_s
        if wake:
            self._rate.wake(now_s)
        if key != self.current:
            self._ration.refill(now_s)
            self._ration.spend(changed_domains(self.current, key))
            self._last_change_s = now_s
            self._held.clear()
            self._fresh_miss_s = 0.0
            self._rate_at_change_hz = max(self._rate.planning_hz, rate_hz or 0.0)
            self._chosen_p99_s = predicted_s if rate_hz is not None else None
        self.current = key

    def _roomy(self) -> bool:
        """Every request answered at the point in force (a few at least) was far under the
        target: a move down need not wait the full hold to learn more about this point."""
        held = self._held
        return len(held) >= ROOMY_LEAST and \
            max(held) <= ROOMY_SHARE * self.policy.latency_target_s

    def _rate_rising(self) -> bool:
        """The load is well above what the point in force was chosen for."""
        return self._rate.planning_hz > RATE_RISE * self._rate_at_change_hz

    def held_p99_s(self) -> float | None:
        """The P99 latency observed at the point in force (``None``: too few requests yet)."""
        if len(self._held) < HELD_LEAST:
            return None
        ordered = sorted(self._held)
        return ordered[min(len(ordered) - 1, int(TOTAL_QUANTILE * len(ordered)))]

    def observed_at_current_s(self, now_s: float) -> float | None:
        """The latency observed at the point in force: its P99, or a fresh miss there."""
        held = self.held_p99_s()
        if self._fresh_miss_s and now_s - self._fresh_miss_at_s < MISS_HOLD_S:
            return max(held or 0.0, self._fresh_miss_s)
        return held

    def observed_p99_s(self, window_s: float, now_s: float) -> float | None:
        values = sorted(total for time_s, total in self.recent if now_s - time_s <= window_s)
        if not values:
            return None
        return values[min(len(values) - 1, int(0.99 * len(values)))]


def point_for(key: PointKey, *, railgate: bool | None = None, nvpmodel_mode: int | None = None
              ) -> OperatingPoint:
    """The operating point that pins ``key``'s clocks (EMC 0: left unlocked)."""
    return OperatingPoint(gpu_min_hz=key.gpu_hz, gpu_max_hz=key.gpu_hz, cpu_min_khz=key.cpu_khz,
                          cpu_max_khz=key.cpu_khz, emc_hz=key.emc_hz or None,
                          gpu_railgate=railgate, nvpmodel_mode=nvpmodel_mode)


__all__ = ["Candidate", "Choice", "Governor", "changed_domains", "cpu_levels", "estimate_draw",
           "point_for"]
