"""SIMULATION: the kernel's schedutil cpufreq governor, the stock CPU governor on Jetson.

schedutil (``kernel/sched/cpufreq_schedutil.c``) asks for ``1.25 * max_freq * util / capacity``
for a frequency-invariant utilisation (PELT: a geometric average with a 32 ms half-life), picks
the lowest table entry at or above it within the policy's scaling_min/max, and changes at most
once per ``rate_limit_us``. A core that wakes from idle with a burst raises util quickly; it decays
with the same half-life.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SchedutilTunables:
    rate_limit_s: float = 0.010  # policy's schedutil/rate_limit_us
    half_life_s: float = 0.032  # PELT
    headroom: float = 1.25


class Schedutil:
    """One cpufreq policy's schedutil. :meth:`update` is called with each interval's busy share
    (of the policy's busiest core) and answers the frequency to put in force."""

    def __init__(self, tunables: SchedutilTunables | None = None) -> None:
        self.tunables = tunables or SchedutilTunables()
        self._util = 0.0  # frequency-invariant, 0..1 of the top frequency's capacity
        self._last_change_s = float("-inf")

    def update(self, *, now_s: float, interval_s: float, busy_share: float, freq_khz: int,
               table_khz: tuple[int, ...], min_khz: int, max_khz: int) -> int:
        tunables = self.tunables
        # Frequency invariance: busy time at a lower clock is less work.
        invariant = busy_share * freq_khz / table_khz[-1]
        decay = math.exp(-math.log(2) * interval_s / tunables.half_life_s)
        self._util = self._util * decay + invariant * (1 - decay)
        low, high = (min_khz, max_khz) if min_khz <= max_khz else (max_khz, max_khz)
        if now_s - self._last_change_s < tunables.rate_limit_s - 1e-9:
            return min(max(freq_khz, low), high)
        target = tunables.headroom * table_khz[-1] * self._util
        chosen = high
        for khz in table_khz:
            if khz >= target and khz >= low:
                chosen = min(khz, high)
                break
        if chosen != freq_khz:
            self._last_change_s = now_s
        return chosen


__all__ = ["Schedutil", "SchedutilTunables"]
