"""SIMULATION: the physics of a simulated Jetson board (latency, power, noise, heat).

Nothing here reads or writes files: :class:`~power.sim.board.SimBoard` asks these functions what a
batch costs and what the board draws at the clocks its fake sysfs files put in force.

The model, per board (:class:`BoardPhysics`), and where each number comes from
(``docs/reference/power_anchors.md``; :mod:`power.sim.calibration` prints the deviations):

* Latency of one batch: a GPU part that scales with ``1/f_gpu``, a memory part tabulated per EMC
  point (K26: a ``1/f_emc`` law fails across EMC points, so one multiplier per point), and a
  launch part on the CPU that scales with ``1/f_cpu`` (CPU clocks set GPU latency, JI1533/F266).
  The reference job is the podgov illustration's: 8 ms at 1020 MHz, 30 % EMC-bound.
* Noise: a log-normal AR(1) factor correlated over time, plus heavy-tailed (generalised-Pareto)
  slow spells that persist from one batch to the next (K26: misses cluster, the next cycle missing
  with probability up to 0.74).
* Power (VDD_IN): a base (SoC always-on plus carrier peripherals), per online CPU core an idle and
  an active part, the GPU rail (nothing when rail-gated; leakage and clock power when on; dynamic
  power with its load), and EMC (a part that grows with its rate and a traffic part with GPU
  load). Voltage rises with frequency (``dynamic ~ f * V(f)^2``). The parameters were fitted to
  the Orin Nano Super idle figures of PC (15 W and 25 W modes), its MAXN idle figure (taken as
  clocks pinned) and its 17-20 W loaded range, and the stripped-mode floor of F348 fixes how much
  of the base is peripherals; every other anchor is a check.
* Heat: one thermal mass (first order) between the module's power and the ambient air.

Unconfirmed in the reference and so a plain parameter here: the GPU's unrailgate time (4 ms).
SC7 suspend is not simulated: the board layer never suspends the board (it has no write for it),
so the simulator's "sleep" is whatever the controller puts in force (lowest clocks, the rail
gated, an nvpmodel mode with fewer cores).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from agent.errors import PowerError


@dataclass(frozen=True, kw_only=True)
class BoardPhysics:
    """The simulated silicon of one board. Frequencies are the profile's maxima: the reference
    job's latency is at ``gpu_ref_hz``, ``cpu_ref_khz`` and the top of ``emc_memory_factor``."""

    # Latency of the reference job (one request) at the reference clocks.
    reference_latency_s: float = 0.008
    memory_share: float = 0.30  # of the reference latency, scaled by the EMC table
    cpu_share: float = 0.10  # launch-bound share, scaled by 1/f_cpu
    gpu_ref_hz: int = 1020000000
    cpu_ref_khz: int = 1728000
    # The memory part's multiplier at each lockable EMC rate (1.0 at the top rate).
    emc_memory_factor: tuple[tuple[int, float], ...] = (
        (204000000, 16.0), (665600000, 5.0), (2133000000, 1.6), (3199000000, 1.0))
    batch_item_share: float = 0.55  # each further item of a batch costs this share of one item

    # Noise: AR(1) on the log latency, correlation time noise_tau_s.
    noise_sigma: float = 0.04
    noise_tau_s: float = 0.5
    # Slow spells: entered with this probability per batch, kept with spell_stay_probability.
    spell_enter_probability: float = 0.0006
    spell_stay_probability: float = 0.70
    spell_scale: float = 0.45  # generalised-Pareto scale of the extra factor
    spell_shape: float = 0.25  # its shape (heavy tail)

    # Power, mW.
    soc_base_mw: float = 1875.0
    peripheral_mw: float = 2240.0  # carrier peripherals the stripped mode of F348 turns off
    cpu_core_leak_mw: float = 25.0  # times V
    cpu_core_clock_mw_per_mhz: float = 0.08  # idle core, times V^2
    cpu_core_active_mw_per_mhz: float = 0.55  # a busy core, times V^2
    cpu_v_min: float = 0.60  # voltage at the lowest table entry, relative to the top
    gpu_leak_mw: float = 800.0  # rail on, times V
    gpu_clock_mw_per_mhz: float = 2.0  # rail on and idle, times V^2
    gpu_active_mw_per_mhz: float = 6.37  # at load 1, times V^2
    gpu_v_min: float = 0.65
    emc_base_mw: float = 200.0
    emc_mw_per_mhz: float = 0.281
    emc_traffic_mw_per_mhz: float = 0.69  # at GPU load 1

    # Clock changes take effect after these (K26: ~1 ms CPU, 5 ms GPU, 8 ms EMC).
    cpu_change_s: float = 0.001
    gpu_change_s: float = 0.005
    emc_change_s: float = 0.008
    # Rail gating (nvgpu ga10b default autosuspend delay 500 ms: used when the tree has no
    # delay file; the file's value wins); unrailgate time UNCONFIRMED (an assumption: 4 ms).
    railgate_delay_s: float = 0.500
    unrailgate_s: float = 0.004

    # Heat: Tj = ambient + R * P at equilibrium, first order with tau.
    ambient_c: float = 25.0
    thermal_resistance_c_per_w: float = 2.30
    thermal_tau_s: float = 80.0
    initial_temp_c: float = 51.0

    def memory_factor(self, emc_hz: int) -> float:
        """The memory part's multiplier at ``emc_hz`` (interpolated in 1/f between points)."""
        points = sorted(self.emc_memory_factor)
        if emc_hz <= points[0][0]:
            return points[0][1]
        for (low_hz, low), (high_hz, high) in itertools.pairwise(points):
            if emc_hz <= high_hz:
                share = (1 / low_hz - 1 / emc_hz) / (1 / low_hz - 1 / high_hz)
                return low + (high - low) * share
        return points[-1][1] * points[-1][0] / emc_hz


PHYSICS: dict[str, BoardPhysics] = {
    "orin-nano-super": BoardPhysics(),
    # The same module without the super clocks: the same silicon, tables capped lower.
    "orin-nano-8gb": BoardPhysics(gpu_ref_hz=1020000000, cpu_ref_khz=1728000),
}


def physics_for(board: str) -> BoardPhysics:
    """The calibrated physics of ``board`` (a profile name)."""
    try:
        return PHYSICS[board]
    except KeyError:
        raise PowerError("the simulator has no calibrated physics for this board", board=board,
                         boards=", ".join(sorted(PHYSICS))) from None


def compute_s(physics: BoardPhysics, *, gpu_hz: int, cpu_khz: int, emc_hz: int,
              batch_size: int = 1) -> float:
    """Noise-free compute time of a batch at the clocks in force."""
    gpu_share = 1.0 - physics.memory_share - physics.cpu_share
    one = physics.reference_latency_s * (
        gpu_share * physics.gpu_ref_hz / gpu_hz
        + physics.memory_share * physics.memory_factor(emc_hz)
        + physics.cpu_share * physics.cpu_ref_khz / cpu_khz)
    return one * (1.0 + physics.batch_item_share * (batch_size - 1))


def cpu_share_of_batch(physics: BoardPhysics, *, gpu_hz: int, cpu_khz: int, emc_hz: int) -> float:
    """The share of a batch's time its serving thread keeps a CPU core busy (the launches)."""
    launch = physics.cpu_share * physics.cpu_ref_khz / cpu_khz
    total = compute_s(physics, gpu_hz=gpu_hz, cpu_khz=cpu_khz, emc_hz=emc_hz) \
        / physics.reference_latency_s
    return launch / total


def _voltage(freq: float, low: float, high: float, v_min: float) -> float:
    if high <= low:
        return 1.0
    share = min(1.0, max(0.0, (freq - low) / (high - low)))
    return v_min + (1.0 - v_min) * share ** 1.3


@dataclass(frozen=True, kw_only=True)
class PowerInputs:
    """What the board is doing over an interval, as the power model needs it."""

    cpu_khz: tuple[int, ...]  # per online core
    cpu_busy: tuple[float, ...]  # per online core, 0..1
    gpu_hz: int
    gpu_load: float  # 0..1
    gpu_on: bool  # False: rail-gated
    emc_hz: int
    peripherals: bool = True


@dataclass(frozen=True, kw_only=True)
class PowerSplit:
    """Module input power and the rails the Orin Nano/NX INA3221 shows."""

    total_mw: float
    cpu_gpu_cv_mw: float
    soc_mw: float


def power_mw(physics: BoardPhysics, inputs: PowerInputs, *, cpu_table_khz: tuple[int, ...],
             gpu_table_hz: tuple[int, ...]) -> PowerSplit:
    """The module's input power (VDD_IN) and its split, for the given activity."""
    cpu_low, cpu_high = cpu_table_khz[0] / 1000, cpu_table_khz[-1] / 1000
    cpu_mw = 0.0
    for khz, busy in zip(inputs.cpu_khz, inputs.cpu_busy):
        mhz = khz / 1000
        volt = _voltage(mhz, cpu_low, cpu_high, physics.cpu_v_min)
        cpu_mw += (physics.cpu_core_leak_mw * volt
                   + mhz * volt * volt * (physics.cpu_core_clock_mw_per_mhz
                                          + busy * physics.cpu_core_active_mw_per_mhz))
    gpu_mw = 0.0
    if inputs.gpu_on:
        mhz = inputs.gpu_hz / 1e6
        volt = _voltage(mhz, gpu_table_hz[0] / 1e6, gpu_table_hz[-1] / 1e6, physics.gpu_v_min)
        gpu_mw = (physics.gpu_leak_mw * volt
                  + mhz * volt * volt * (physics.gpu_clock_mw_per_mhz
                                         + inputs.gpu_load * physics.gpu_active_mw_per_mhz))
    emc_mhz = inputs.emc_hz / 1e6
    emc_mw = physics.emc_base_mw + emc_mhz * (physics.emc_mw_per_mhz
                                              + inputs.gpu_load * physics.emc_traffic_mw_per_mhz)
    base = physics.soc_base_mw + (physics.peripheral_mw if inputs.peripherals else 0.0)
    total = base + cpu_mw + gpu_mw + emc_mw
    return PowerSplit(total_mw=total, cpu_gpu_cv_mw=cpu_mw + gpu_mw,
                      soc_mw=physics.soc_base_mw + emc_mw)


def temperature_after_c(physics: BoardPhysics, temp_c: float, power_mw_in: float,
                        duration_s: float) -> float:
    """Tj after ``duration_s`` at a constant power, from ``temp_c`` (first order)."""
    target = physics.ambient_c + physics.thermal_resistance_c_per_w * power_mw_in / 1000
    return target + (temp_c - target) * math.exp(-duration_s / physics.thermal_tau_s)


class LatencyNoise:
    """Multiplicative latency noise: correlated over time, with clustered heavy-tailed spells.

    Deterministic for a seed. :meth:`factor` is called once per batch with the batch's start time.
    """

    def __init__(self, physics: BoardPhysics, seed: int) -> None:
        self._physics = physics
        self._random = random.Random(seed)
        self._log = self._random.gauss(0.0, physics.noise_sigma)  # from the stationary law
        self._last_s: float | None = None
        self._in_spell = False

    def factor(self, now_s: float) -> float:
        physics = self._physics
        if self._last_s is not None:
            rho = math.exp(-max(0.0, now_s - self._last_s) / physics.noise_tau_s)
            self._log = rho * self._log + math.sqrt(1 - rho * rho) * self._random.gauss(
                0.0, physics.noise_sigma)
        self._last_s = now_s
        if self._in_spell:
            self._in_spell = self._random.random() < physics.spell_stay_probability
        else:
            self._in_spell = self._random.random() < physics.spell_enter_probability
        spell = 1.0
        if self._in_spell:
            uniform = 1.0 - self._random.random()
            shape = physics.spell_shape
            spell += physics.spell_scale * (uniform ** -shape - 1) / shape
        # The AR part is centred so that its median factor is 1.
        return math.exp(self._log) * spell


__all__ = ["PHYSICS", "BoardPhysics", "LatencyNoise", "PowerInputs", "PowerSplit", "compute_s",
           "cpu_share_of_batch", "physics_for", "power_mw", "temperature_after_c"]
