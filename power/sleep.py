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
from dataclasses import dataclass

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


__all__ = ["IdleForecast", "SleepDepth", "SleepPlanner", "default_depth"]
