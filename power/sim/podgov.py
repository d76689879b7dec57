"""SIMULATION: NVIDIA's stock GPU governor, nvhost_podgov, as its r36 source describes it.

Modelled from ``docs/reference/power_anchors.md`` §3 (nvidia-oot ``governor_pod_scaling.c``, the
same defaults as r32), so the "stock" baseline of the power benchmark is the board's own governor,
not a strawman:

* nvgpu samples the GPU every 25 ms; a change is considered at most once per ``block_window``
  (50 ms).
* ``rt_load`` is busy/total over the sample in per-mille; ``cycles_avg`` is an exponential average
  (``smooth`` = 10) of ``f * busy / total``, and busyness is ``cycles_avg / f``.
* Above ``load_max`` (900) the request jumps up by a third of the maximum frequency, undamped.
* Otherwise the boost is ``bias * f * (busyness - load_target) / load_target`` (bias 0.8,
  load_target 700), capped at a third of the maximum either way; an upward boost is damped by
  ``damp`` (7) -- our reading of "smoothed and damped": the source's damping keeps a governor that
  targets 70 % from oscillating upwards, while light load still parks it at the minimum, as the
  reference's re-implementation shows.
* The result is rounded up to the next table entry and clamped to the effective min and max
  (``min_freq``/``max_freq``, where a min above the max gives way to the max on r35+).
* While the GPU is rail-gated podgov holds the minimum frequency.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PodgovTunables:
    """The debugfs tunables under ``/sys/kernel/debug/<dev>_scaling/``, at their defaults."""

    poll_s: float = 0.025  # nvgpu's devfreq polling interval
    block_window_s: float = 0.050
    load_max: int = 900  # per-mille
    load_target: int = 700
    bias: float = 0.8
    damp: int = 7
    smooth: int = 10


class Podgov:
    """One GPU's podgov state. :meth:`sample` is called every ``poll_s`` of simulated time."""

    def __init__(self, tunables: PodgovTunables | None = None) -> None:
        self.tunables = tunables or PodgovTunables()
        self._cycles_avg = 0.0  # Hz-weighted busy share
        self._last_change_s = float("-inf")

    def sample(self, *, now_s: float, busy_share: float, freq_hz: int, table_hz: tuple[int, ...],
               min_hz: int, max_hz: int, railgated: bool) -> int:
        """The frequency podgov requests after a sample of ``busy_share`` (0..1) at ``freq_hz``.

        ``table_hz`` is the ascending table; ``min_hz``/``max_hz`` the effective limits.
        """
        tunables = self.tunables
        low, high = (min_hz, max_hz) if min_hz <= max_hz else (max_hz, max_hz)
        if railgated:
            self._cycles_avg = 0.0
            return _clamp_to_table(low, table_hz, low, high)
        self._cycles_avg = ((tunables.smooth - 1) * self._cycles_avg
                            + freq_hz * busy_share) / tunables.smooth
        if now_s - self._last_change_s < tunables.block_window_s - 1e-9:
            return _clamp_to_table(freq_hz, table_hz, low, high)
        rt_load = 1000.0 * busy_share
        top = table_hz[-1]
        if rt_load > tunables.load_max:
            target = freq_hz + top / 3
        else:
            busyness = 1000.0 * self._cycles_avg / freq_hz
            boost = tunables.bias * freq_hz * (busyness - tunables.load_target) \
                / tunables.load_target
            boost = max(-top / 3, min(top / 3, boost))
            if boost > 0:
                boost /= tunables.damp
            target = freq_hz + boost
        chosen = _clamp_to_table(target, table_hz, low, high)
        if chosen != freq_hz:
            self._last_change_s = now_s
        return chosen


def _clamp_to_table(target: float, table_hz: tuple[int, ...], low: int, high: int) -> int:
    """The table entry at or above ``target`` (rounded up), within [low, high]."""
    target = min(max(target, low), high)
    for freq in table_hz:
        if freq >= target - 0.5:
            return min(max(freq, low), high)
    return high


__all__ = ["Podgov", "PodgovTunables"]
