"""Smart sleep: whether an idle board should go to sleep, from a forecast of how long it stays idle.

Sleeping (lowest clocks, the GPU rail gated, optionally a low-power nvpmodel mode and the engine's
memory released) saves power but costs energy and time to leave: the mode switch, and reloading
the engine when it was released. A depth is entered only when the idle time still expected passes
its break-even, ``transition_mj / saved_mw``. The forecast is the past idle gaps' empirical
distribution: given that the board has been idle for ``t``, the expected remaining gap is the
median of the past gaps longer than ``t``, minus ``t`` (no history: assume it stays idle).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from power.types import Completion

GAP_HISTORY = 64


@dataclass(frozen=True, kw_only=True)
class SleepDepth:
    """What a sleep depth saves against idle, and what entering and leaving it costs."""

    name: str
    saved_mw: float  # below the idle draw while in it
    transition_mj: float  # entering and leaving, above the idle draw
    wake_s: float  # how long leaving it takes

    @property
    def break_even_s(self) -> float:
        return float("inf") if self.saved_mw <= 0 else self.transition_mj / self.saved_mw


class IdleForecast:
    """The distribution of past idle gaps (seconds from going idle to the next request)."""

    def __init__(self, history: int = GAP_HISTORY) -> None:
        self._gaps: deque[float] = deque(maxlen=history)

    def record(self, gap_s: float) -> None:
        if gap_s >= 0:
            self._gaps.append(gap_s)

    def expected_remaining_s(self, idle_for_s: float) -> float:
        longer = sorted(gap for gap in self._gaps if gap > idle_for_s)
        if not self._gaps:
            return float("inf")
        if not longer:
            # Longer than every gap seen: the past says nothing more; assume it goes on as
            # long again (a doubling guess, as the gaps seen were all shorter).
            return idle_for_s
        return longer[len(longer) // 2] - idle_for_s

    @property
    def gaps(self) -> tuple[float, ...]:
        return tuple(self._gaps)


class SleepPlanner:
    """Decides when an idle board goes to sleep.

    Args:
        sleep_after_s: the least idle time before sleeping (the policy's ``sleep_after_s``).
        depth: the sleep depth's costs.
    """

    def __init__(self, *, sleep_after_s: float, depth: SleepDepth) -> None:
        self.sleep_after_s = sleep_after_s
        self.depth = depth
        self.forecast = IdleForecast()

    def should_sleep(self, idle_for_s: float) -> bool:
        if idle_for_s < self.sleep_after_s:
            return False
        return self.forecast.expected_remaining_s(idle_for_s) >= self.depth.break_even_s


def default_depth(*, idle_mw: float | None, sleep_mw: float | None, engine_reload_s: float,
                  release_engine: bool, active_mw: float | None = None) -> SleepDepth:
    """The sleep depth from measured draws where the board gave them (else rough Orin Nano
    figures): leaving it costs the engine's reload at the active draw when it was released."""
    idle = idle_mw if idle_mw is not None else 5500.0
    sleep = sleep_mw if sleep_mw is not None else idle * 0.85
    active = active_mw if active_mw is not None else idle * 1.6
    reload_s = engine_reload_s if release_engine else 0.0
    # A mode switch and the clocks' return: a few tens of milliseconds at the active draw.
    transition = (0.05 + reload_s) * active
    return SleepDepth(name="sleeping", saved_mw=max(0.0, idle - sleep),
                      transition_mj=transition, wake_s=0.02 + reload_s)


# Rail-gating between requests (a periodic stream: a camera's frames).
UNRAILGATE_ASSUMED_S = 0.004
"""How long the GPU takes to come back from a gated rail: UNCONFIRMED (power_anchors.md: "Unrailgate
latency UNCONFIRMED: measure"); the simulator's figure, used for the break-even and the latency room
until a board's own is measured. The governor's latency model learns the real one from the
completions (their compute time includes it)."""
GPU_RAIL_IDLE_MW = 780.0  # ASSUMPTION: the rail's idle draw at the lowest clock (the simulator's)
GPU_RAIL_ACTIVE_MW = 2000.0  # ASSUMPTION: its draw while it comes back (taken as busy)
RAILGATE_SHORT_MS = 10  # the delay between frames: a few times the unrailgate time
GAP_WINDOW = 16  # the last idle gaps of the GPU the decision looks at
GAPS_LEAST = 8
GAP_QUANTILE = 0.2  # the share of gaps allowed under the need (a jittery stream's short ones)
ENTER_FACTOR = 2.0  # shorten when that quantile is this many times the need; back under 1 of it


@dataclass(frozen=True, kw_only=True)
class RailgateCost:
    """What gating the GPU's rail in a gap saves and costs (assumed figures by default)."""

    unrailgate_s: float = UNRAILGATE_ASSUMED_S
    saved_mw: float = GPU_RAIL_IDLE_MW
    transition_mj: float = UNRAILGATE_ASSUMED_S * GPU_RAIL_ACTIVE_MW

    @property
    def break_even_s(self) -> float:
        return float("inf") if self.saved_mw <= 0 else self.transition_mj / self.saved_mw


class RailgatePlanner:
    """Whether the GPU's rail-gate delay should be short, from the idle gaps between its batches.

    A periodic stream (5 Hz frames, ~30 ms of compute) leaves the GPU idle ~170 ms a frame, but
    the default delay (ga10b's 500 ms) never lets it gate. When nearly every recent gap (all but
    :data:`GAP_QUANTILE` of them) is longer than the short delay plus the unrailgate time plus its
    break-even, by :data:`ENTER_FACTOR`, the delay may be shortened; once that quantile falls under
    the need (the load goes continuous, batches back to back), it goes back. Whether the latency
    target has room for the unrailgate is the controller's check (it has the governor).
    """

    def __init__(self, *, short_ms: int = RAILGATE_SHORT_MS,
                 cost: RailgateCost | None = None) -> None:
        self.short_ms = short_ms
        self.cost = cost or RailgateCost()
        self._gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self._last_end_s: float | None = None

    @property
    def need_s(self) -> float:
        """The least gap worth gating in: the delay, the way back, and the break-even."""
        return self.short_ms / 1000.0 + self.cost.unrailgate_s + self.cost.break_even_s

    def observe(self, completions: Sequence[Completion]) -> None:
        """Learn the GPU's idle gaps from answered requests (a batch's requests share their end
        time; it started ``compute_s`` before)."""
        for completion in completions:
            end = completion.time_s
            if self._last_end_s is not None and end <= self._last_end_s:
                continue  # the same batch
            start = end - completion.compute_s
            if self._last_end_s is not None:
                self._gaps.append(max(0.0, start - self._last_end_s))
            self._last_end_s = end

    def gap_quantile_s(self) -> float | None:
        if len(self._gaps) < GAPS_LEAST:
            return None
        ordered = sorted(self._gaps)
        return ordered[int(GAP_QUANTILE * len(ordered))]

    def wants_short(self, *, short_now: bool) -> bool:
        """Whether the delay should be short, given whether it is now (hysteresis)."""
        gap = self.gap_quantile_s()
        if gap is None:
            return short_now  # too few gaps yet: keep what is in force
        return gap >= self.need_s if short_now else gap >= ENTER_FACTOR * self.need_s

    @property
    def gaps(self) -> tuple[float, ...]:
        return tuple(self._gaps)


__all__ = ["IdleForecast", "RailgateCost", "RailgatePlanner", "SleepDepth", "SleepPlanner",
           "default_depth"]
