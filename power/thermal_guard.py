"""Caps the clocks as the board nears its own thermal trip points.

The trip points are the board's (``trip_point_*`` read with the telemetry; the reference found no
primary source for fixed thresholds, so none is assumed here). While the hottest zone is within
``margin_c`` of its nearest trip, the guard lowers a cap one frequency step per reading; it lifts
the cap one step per reading once the margin is back above ``margin_c + hysteresis_c``. The kernel's
own thermal throttling stays in charge past the trip: the guard only keeps the board from
reaching it.
"""

from __future__ import annotations

from dataclasses import dataclass

from power.types import ClockTable, Telemetry

HYSTERESIS_C = 3.0


@dataclass(frozen=True, kw_only=True)
class ThermalCap:
    """The highest GPU and CPU clocks the guard allows now (``None``: no cap)."""

    gpu_max_hz: int | None = None
    cpu_max_khz: int | None = None
    margin_c: float | None = None  # the margin at the reading that set it


class ThermalGuard:
    """Steps a clock cap down and up from each telemetry reading's trip margin."""

    def __init__(self, table: ClockTable, *, margin_c: float, hysteresis_c: float = HYSTERESIS_C
                 ) -> None:
        self._gpu = table.gpu_hz
        self._cpu = table.cpu_khz
        self.margin_c = margin_c
        self._hysteresis_c = hysteresis_c
        self._steps_down = 0  # how many table entries below the top the cap is
        self.cap = ThermalCap()

    def update(self, telemetry: Telemetry) -> ThermalCap:
        margin = telemetry.hottest_margin_c()
        if margin is None:
            return self.cap
        limit = max(len(self._gpu), len(self._cpu)) - 1
        if margin < self.margin_c:
            self._steps_down = min(limit, self._steps_down + 1)
        elif margin > self.margin_c + self._hysteresis_c and self._steps_down > 0:
            self._steps_down -= 1
        if self._steps_down == 0:
            self.cap = ThermalCap(margin_c=margin)
        else:
            gpu_index = max(0, len(self._gpu) - 1 - self._steps_down)
            # The CPU table is finer: step it down in proportion to the GPU's.
            share = self._steps_down / max(1, len(self._gpu) - 1)
            cpu_index = max(0, len(self._cpu) - 1 - round(share * (len(self._cpu) - 1)))
            self.cap = ThermalCap(gpu_max_hz=self._gpu[gpu_index] if self._gpu else None,
                                  cpu_max_khz=self._cpu[cpu_index] if self._cpu else None,
                                  margin_c=margin)
        return self.cap

    @property
    def capping(self) -> bool:
        return self._steps_down > 0


__all__ = ["ThermalCap", "ThermalGuard"]
