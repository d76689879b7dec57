"""The values that pass between the board layer, the governor, the simulator and the daemon.

The board layer (``power/board.py``, ``power/sysfs/``) reads a :class:`Telemetry` and the
:class:`OperatingPoint` in force and applies a new one, answering with an :class:`ApplyResult`
read back from the files; the governor (``power/governor.py``) turns what the serving path reports
(:class:`LoadSample`, :class:`Completion`) into the next point under a :class:`PowerPolicy`; the
controller (``power/controller.py``) drives both and the power states of :data:`TRANSITIONS`.
The board simulator (``power/sim/``) sits under the board layer's files, so everything above it is
the production code.

Units are in the names, as in the kernel's files: GPU and EMC in Hz, CPU in kHz, power in mW,
temperatures in degrees Celsius (converted from the kernel's m°C once, when read).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class PowerState(enum.Enum):
    ACTIVE = "active"  # requests arriving; the governor picks the operating point
    IDLE = "idle"  # no request for a moment; the governor still runs, clocks drifting down
    SLEEPING = "sleeping"  # lowest clocks, GPU rail-gated, maybe a low-power mode and no engine
    WAKING = "waking"  # a request arrived while sleeping: boosting before it is dispatched


TRANSITIONS: dict[PowerState, frozenset[PowerState]] = {
    PowerState.ACTIVE: frozenset({PowerState.IDLE}),
    PowerState.IDLE: frozenset({PowerState.ACTIVE, PowerState.SLEEPING}),
    PowerState.SLEEPING: frozenset({PowerState.WAKING}),
    PowerState.WAKING: frozenset({PowerState.ACTIVE}),
}
"""Design §6: ``active <-> idle -> sleeping -> waking -> active``."""


@dataclass(frozen=True, kw_only=True)
class OperatingPoint:
    """Clock limits to put in force. ``None`` leaves that limit as it is (or, in a point read from
    the board, means the board has no such control)."""

    gpu_min_hz: int | None = None
    gpu_max_hz: int | None = None
    cpu_min_khz: int | None = None  # the same floor and cap on every CPU policy (cluster)
    cpu_max_khz: int | None = None
    emc_hz: int | None = None  # a locked EMC rate; None = not locked (the board's own choice)
    gpu_railgate: bool | None = None  # allow the GPU rail to be gated when idle
    gpu_railgate_delay_ms: int | None = None  # idle this long (ms) before the rail is gated
    nvpmodel_mode: int | None = None  # only when the policy allows governing through nvpmodel

    def to_json(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """A limit that did not read back as written (a kernel clamp, a rounding, a silent drop)."""

    path: str  # the file, relative to the board's root
    wanted: int | str
    found: int | str | None  # None: unreadable after the write


@dataclass(frozen=True, kw_only=True)
class ApplyResult:
    """What applying an :class:`OperatingPoint` did: the point read back after the writes, the
    writes that did not stick, and the limits the board cannot change (degraded mode)."""

    applied: OperatingPoint
    mismatches: tuple[Mismatch, ...] = ()
    unsupported: tuple[str, ...] = ()  # e.g. "emc: no debugfs (not root?)"
    writes: int = 0  # files written

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True, kw_only=True)
class ClockTable:
    """The frequencies a board offers, ascending: what the governor chooses from."""

    gpu_hz: tuple[int, ...]
    cpu_khz: tuple[int, ...]
    emc_hz: tuple[int, ...] = ()  # empty: EMC cannot be locked here (no debugfs)
    nvpmodel_modes: tuple[tuple[int, str], ...] = ()  # (id, name)


@dataclass(frozen=True, kw_only=True)
class ThermalZone:
    name: str  # the zone's type without "-thermal"/"-therm": "cpu", "gpu", "tj"
    temp_c: float | None  # None: unreadable (cv zones on Orin Nano)
    trips_c: tuple[tuple[str, float], ...] = ()  # (type, temperature): ("passive", 99.0)


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    """One reading of the board. Fields the board cannot provide are ``None`` or empty."""

    time_s: float  # monotonic seconds of the reading
    gpu_freq_hz: int | None = None
    gpu_load: float | None = None  # 0..1 (the kernel's per-mille / 1000)
    gpu_railgated: bool | None = None  # runtime_status "suspended"
    # Per cpufreq policy, in the board's policy order; None where one cannot be read (kept in
    # place, so that a policy's index, and its cpuN label, never moves to another cluster).
    cpu_freq_khz: tuple[int | None, ...] = ()
    emc_hz: int | None = None
    thermal: tuple[ThermalZone, ...] = ()
    rails_mw: dict[str, int] = field(default_factory=dict)  # rail label -> mW
    total_power_mw: int | None = None  # VDD_IN where present, else the sum of the rails
    nvpmodel_mode: int | None = None
    source: str = "sysfs"  # "sysfs", "jtop", or "simulation"

    def hottest_margin_c(self) -> float | None:
        """Degrees below the nearest trip point over every zone (negative: past it)."""
        margins = [trip - zone.temp_c for zone in self.thermal if zone.temp_c is not None
                   for _, trip in zone.trips_c]
        return min(margins) if margins else None


@dataclass(frozen=True, kw_only=True)
class PowerPolicy:
    """What the governor aims for (``[power]`` in the configuration, or ``desired.power``)."""

    profile: str = "governed"  # governed | max | min | stock (hand back to the board's governors)
    latency_target_s: float = 0.050  # the request latency the percentile must stay under
    percentile: float = 0.99
    power_cap_mw: int | None = None  # never choose a point whose learned power exceeds this
    idle_after_s: float = 1.0  # no arrival for this long: idle
    sleep_after_s: float = 10.0  # idle this long (and the forecast idle passes break-even): sleep
    sleep_nvpmodel_mode: int | None = None  # a low-power mode to enter while sleeping
    release_engine_in_sleep: bool = False
    thermal_margin_c: float = 5.0  # start capping clocks this close to the nearest trip point
    max_changes_per_s: float = 5.0
    allow_nvpmodel: bool = False  # never govern through nvpmodel unless asked (it misreports)


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A request the serving path answered, as the governor learns from it."""

    time_s: float  # when it was answered
    total_s: float  # arrival to answer (what the target is about)
    compute_s: float  # its batch on the backend
    batch_size: int = 1
    ok: bool = True


@dataclass(frozen=True, kw_only=True)
class LoadSample:
    """The serving path's state at a governor step (from ``Batcher.load()`` and the observers)."""

    time_s: float
    queue_depth: int
    busy_instances: int
    instances: int
    arrivals_total: int  # monotonic counters: the governor differences them
    completed_total: int


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What one controller step decided (``Controller.step``'s answer, kept in its status)."""

    time_s: float  # the controller's clock at the step
    state: PowerState
    point: OperatingPoint  # the point in force after the step
    changed: bool  # this step applied a new point
    reason: str  # why: "steady", "slack", "over target", "queue emergency", "thermal cap", ...
    predicted_s: float | None = None  # the governor's P99 latency estimate at ``point``
    applied: ApplyResult | None = None  # the board's answer when ``changed``

    def to_json(self) -> dict[str, Any]:
        return {"time_s": round(self.time_s, 6), "state": self.state.value,
                "point": self.point.to_json(), "changed": self.changed, "reason": self.reason,
                "predicted_ms": None if self.predicted_s is None
                else round(self.predicted_s * 1000, 3),
                "mismatches": [] if self.applied is None
                else [m.path for m in self.applied.mismatches]}


class BoardControl(Protocol):
    """What the controller needs of a board: the real one (``power/board.py``) over sysfs, which
    the simulator's files also feed."""

    def clock_table(self) -> ClockTable: ...

    def read_point(self) -> OperatingPoint: ...

    def apply(self, point: OperatingPoint) -> ApplyResult: ...

    def telemetry(self) -> Telemetry: ...

    def snapshot(self) -> dict[str, Any]:
        """Every limit this board may write, as it is now (JSON-able): what :meth:`restore` puts
        back on shutdown, and after a crash from the copy the controller saved at its start."""
        ...

    def restore(self, snapshot: dict[str, Any]) -> ApplyResult: ...

    def capabilities(self) -> dict[str, str | None]:
        """Each control ("gpu", "cpu", "emc", "railgate", "nvpmodel", "thermal", "rails", "fan")
        to ``None`` when usable, or the reason it is not (degraded mode)."""
        ...


__all__ = [
    "TRANSITIONS", "ApplyResult", "BoardControl", "ClockTable", "Completion", "Decision",
    "LoadSample", "Mismatch", "OperatingPoint", "PowerPolicy", "PowerState", "Telemetry",
    "ThermalZone",
]
