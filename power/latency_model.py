"""Latency against frequency, learned online: one table per EMC point.

The governor asks what a request's compute time would be at an operating point it has not tried.
Within one EMC point the time fits ``T = a * g0/f_gpu + k * c0/f_cpu + b`` well (K26: ``k/f + b``
per EMC point; the CPU term because a launch-bound engine slows with the CPU clock), so each EMC
point gets its own three coefficients, fitted by recursive least squares with forgetting from the
completions observed there. Across EMC points a ``1/f_emc`` law fails (K26), so nothing is shared
between tables except as a pessimistic guess for a point never observed: the nearest observed
table with its constant (memory) part scaled up by the EMC ratio when the point is slower.

A batch of ``n`` costs ``1 + beta * (n - 1)`` single requests; ``beta`` is learned from batches
seen at points whose single-request time the model already predicts.

The model also keeps the ratio of each observed time to what it predicted just before: the
governor's margin is a high quantile of that ratio (clustered, heavy-tailed noise: a Gaussian
``mean + 3 sigma`` would be wrong both ways), never a standard deviation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PRIOR_SPLIT = (0.5, 0.2, 0.3)
"""The share of a first observation given to the GPU, CPU and constant terms before more data
splits it (a guess; each new point observed corrects it)."""

FORGETTING = 0.998  # per sample: old samples fade over a few thousand requests
RATIO_WINDOW = 2000  # residual ratios kept for the margin
ROBUST_AFTER = 20  # samples in a table before its updates are clipped
ROBUST_SHARE = 0.25  # of the prediction: the largest error one sample may pull with
TAIL_REFRESH = 50  # recompute the cached quantiles every this many samples
TAIL_LEAST = 20  # ratios before their quantile is the margin ...
TAIL_GUESS = 1.5  # ... and the margin until then


@dataclass(frozen=True, kw_only=True)
class PointKey:
    """The clocks a latency was measured at (EMC 0: not locked, whatever the board chose)."""

    gpu_hz: int
    cpu_khz: int
    emc_hz: int = 0


class _Table:
    """RLS over the features ``(g0/f_gpu, c0/f_cpu, 1)`` at one EMC point."""

    def __init__(self, theta: list[float]) -> None:
        self.theta = theta
        # Covariance: the prior's coefficients are uncertain to about their own size.
        self.cov = [[(max(value, 1e-4) * 2.0) ** 2 if row == col else 0.0
                     for col, value in enumerate(theta)] for row in range(3)]
        self.samples = 0

    def predict(self, features: tuple[float, float, float]) -> float:
        return sum(t * x for t, x in zip(self.theta, features))

    def update(self, features: tuple[float, float, float], target: float) -> None:
        cov = self.cov
        px = [sum(cov[row][col] * features[col] for col in range(3)) for row in range(3)]
        denominator = FORGETTING + sum(features[row] * px[row] for row in range(3))
        gain = [value / denominator for value in px]
        predicted = self.predict(features)
        error = target - predicted
        if self.samples >= ROBUST_AFTER:
            # Huber-like: a slow spell (heavy-tailed, clustered) must not drag the typical time
            # up; the tail is the margin's business, through the ratios.
            bound = ROBUST_SHARE * max(predicted, 1e-6)
            error = min(bound, max(-bound, error))
        self.theta = [max(0.0, t + g * error) for t, g in zip(self.theta, gain)]
        self.cov = [[(cov[row][col] - gain[row] * px[col]) / FORGETTING for col in range(3)]
                    for row in range(3)]
        self.samples += 1


class LatencyModel:
    """Compute time per batch as a function of the operating point, learned from completions.

    Args:
        gpu_ref_hz: the GPU frequency the features are relative to (the table's top).
        cpu_ref_khz: the CPU frequency likewise.
    """

    def __init__(self, *, gpu_ref_hz: int, cpu_ref_khz: int) -> None:
        self._gpu_ref_hz = gpu_ref_hz
        self._cpu_ref_khz = cpu_ref_khz
        self._tables: dict[int, _Table] = {}
        self.batch_beta = 0.7  # a further request in a batch costs this share of one
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._tail_cache: dict[float, float] = {}
        self._since_refresh = 0
        self.samples = 0
        self.version = 0  # changes whenever a prediction may have changed

    def _features(self, key: PointKey) -> tuple[float, float, float]:
        return (self._gpu_ref_hz / key.gpu_hz, self._cpu_ref_khz / key.cpu_khz, 1.0)

    def batch_factor(self, batch_size: int) -> float:
        return 1.0 + self.batch_beta * max(0, batch_size - 1)

    @property
    def ready(self) -> bool:
        return self.samples > 0

    def observed_emc(self) -> tuple[int, ...]:
        return tuple(sorted(self._tables))

    def predict_s(self, key: PointKey, batch_size: int = 1) -> float | None:
        """The expected (median-like) compute time of a batch at ``key``; ``None`` before the
        first observation."""
        single = self._predict_single(key)
        return None if single is None else single * self.batch_factor(batch_size)

    def coefficients(self, emc_hz: int) -> tuple[float, float, float] | None:
        """The single-request time's ``(a, k, b)`` at ``emc_hz``: ``a * g0/f_gpu + k * c0/f_cpu
        + b`` (``None`` before the first observation)."""
        table = self._tables.get(emc_hz)
        if table is not None:
            a, k, b = table.theta
            return a, k, b
        if not self._tables:
            return None
        # Never observed at this EMC point: the nearest observed table, pessimistic when slower.
        nearest = min(self._tables, key=lambda emc: abs(emc - emc_hz))
        a, k, b = self._tables[nearest].theta
        if 0 < emc_hz < nearest:
            b *= nearest / emc_hz
        return a, k, b

    def _predict_single(self, key: PointKey) -> float | None:
        coefficients = self.coefficients(key.emc_hz)
        if coefficients is None:
            return None
        a, k, b = coefficients
        return max(a * self._gpu_ref_hz / key.gpu_hz + k * self._cpu_ref_khz / key.cpu_khz + b,
                   1e-6)

    def observe(self, key: PointKey, compute_s: float, batch_size: int = 1) -> None:
        """One batch of ``batch_size`` took ``compute_s`` at ``key`` (the clocks in force for
        the whole batch)."""
        if compute_s <= 0 or batch_size < 1:
            return
        features = self._features(key)
        table = self._tables.get(key.emc_hz)
        predicted = self.predict_s(key, batch_size)
        if predicted is not None:
            self._ratios.append(compute_s / predicted)
            self._since_refresh += 1
            if self._since_refresh >= TAIL_REFRESH:
                self._tail_cache.clear()
                self._since_refresh = 0
        if batch_size > 1 and table is not None and table.samples >= 20:
            single = max(table.predict(features), 1e-6)
            beta = (compute_s / single - 1.0) / (batch_size - 1)
            self.batch_beta = min(1.0, max(0.05, 0.98 * self.batch_beta + 0.02 * beta))
        single_s = compute_s / self.batch_factor(batch_size)
        if table is None:
            scale = single_s / sum(s * x for s, x in zip(PRIOR_SPLIT, features))
            table = self._tables[key.emc_hz] = _Table([s * scale for s in PRIOR_SPLIT])
        table.update(features, single_s)
        self.samples += 1
        self.version += 1

    def tail_ratio(self, quantile: float) -> float:
        """The ``quantile`` of observed/predicted over the recent window (:data:`TAIL_GUESS` before
        :data:`TAIL_LEAST` of them)."""
        cached = self._tail_cache.get(quantile)
        if cached is not None:
            return cached
        if len(self._ratios) < TAIL_LEAST:
            # Too few to tell: a generous margin, not cached (the cache lasts TAIL_REFRESH
            # samples, and would keep this guess well past the TAIL_LEAST-th ratio).
            return TAIL_GUESS
        ordered = sorted(self._ratios)
        value = ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]
        self._tail_cache[quantile] = value
        return value


__all__ = ["LatencyModel", "PointKey"]
