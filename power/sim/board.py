"""SIMULATION: a Jetson board over simulated time, behind the same files the real code reads.

:class:`SimBoard` sits under a fake board tree (``power/sim/tree.py`` writes it for a profile): it
reads the limits and governors the board layer wrote there (``min_freq``/``max_freq``,
``scaling_min_freq``/``scaling_max_freq``, the EMC lock and rate, rail gating), runs the stock
governors where they are in charge (:mod:`power.sim.podgov`, :mod:`power.sim.cpugov`), puts each
new clock in force after its actuation delay, and writes back what the kernel would show:
``cur_freq``, ``scaling_cur_freq``, the EMC rate, the GPU's ``load`` and ``runtime_status``, the
INA3221 rails and the thermal zones. The GPU's rail is gated once it has been idle for the delay
its ``railgate_delay`` (or ``power/autosuspend_delay_ms``) file holds, while rail-gating is
allowed; the next batch waits the physics' ``unrailgate_s`` first (an UNCONFIRMED figure). The production :class:`~power.board.Board` and governor above
it are therefore the code a real board runs.

Time is the simulation's: the serving loop (:mod:`power.sim.serving`) calls :meth:`advance` up to
each of its events, :meth:`begin_gpu_work`/:meth:`end_gpu_work` around each batch, :meth:`sync`
after anything wrote the files and :meth:`publish` before anything reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import PowerError
from power.sim.cpugov import Schedutil
from power.sim.kernel import FakeKernel
from power.sim.physics import BoardPhysics, PowerInputs, power_mw, temperature_after_c
from power.sim.podgov import Podgov
from power.sysfs.discover import BoardPaths, discover

CPU_TICK_S = 0.010  # how often schedutil is evaluated (its rate limit; the tick is finer)
EMC_CAP_FILES = ("sys/kernel/nvpmodel_emc_cap/emc_iso_cap", "sys/kernel/nvpmodel_clk_cap/emc")
VDD_IN_MV = 4960  # the Orin Nano/NX input rail's bus voltage [jetson_sysfs_layout.md]


@dataclass
class _Pending:
    at_s: float
    value: int


@dataclass
class _Domain:
    """One clock: the rate in force, and the change on its way (after the actuation delay)."""

    current: int
    delay_s: float
    pending: _Pending | None = None

    def request(self, now_s: float, value: int) -> bool:
        """Ask for ``value``; answers whether that changed what this clock is heading for."""
        target = self.pending.value if self.pending is not None else self.current
        if value == target:
            return False
        if value == self.current:
            self.pending = None
        else:
            self.pending = _Pending(at_s=now_s + self.delay_s, value=value)
        return True


@dataclass(frozen=True)
class _Controls:
    """What the files asked for at the last sync."""

    gpu_low: int
    gpu_high: int
    gpu_governor: str
    gpu_3d_scaling: bool
    cpu: tuple[tuple[int, int, str, int], ...]  # (min, max, governor, setspeed) per policy
    emc_hz: int
    railgate: bool
    railgate_delay_s: float  # idle this long before the rail is gated


@dataclass
class TimelinePoint:
    """One sample of the board for the benchmark's plot (the average power since the last)."""

    time_s: float
    gpu_hz: int
    cpu_khz: int
    emc_hz: int
    power_mw: float
    gpu_on: bool
    temp_c: float


@dataclass
class _Window:
    """Accumulators since the last publish (telemetry) or governor sample."""

    start_s: float
    energy_mj: float = 0.0
    gpu_busy_s: float = 0.0
    cpu_busy_s: list[float] = field(default_factory=list)


class SimBoard:
    """A simulated board under the fake tree at ``root`` (already written for the profile).

    Args:
        root: the fake tree (``power/sim/tree.py``'s output).
        physics: the board's calibrated physics (:func:`power.sim.physics.physics_for`).
        record_timeline: keep a :class:`TimelinePoint` per :meth:`publish` (for the plot).
        kernel: the :class:`~power.sim.kernel.FakeKernel` every write into the tree goes through,
            if one does (then :meth:`sync` re-reads only after a write).
    """

    def __init__(self, *, root: Path, physics: BoardPhysics, record_timeline: bool = False,
                 kernel: FakeKernel | None = None) -> None:
        self.root = Path(root)
        self.physics = physics
        # When every write into the tree goes through this fake kernel, a sync with nothing new
        # in its log has nothing to re-read (the files are only re-read when written).
        self.kernel = kernel
        self._kernel_writes = -1
        self._written: dict[str, str] = {}  # what this board last wrote, by path
        self.paths: BoardPaths = discover(self.root)
        if self.paths.gpu is None or not self.paths.cpu:
            raise PowerError("the simulator needs a board tree with a GPU and CPU policies",
                             root=self.root)
        self.gpu_paths = self.paths.gpu
        self.now_s = 0.0
        self.energy_mj = 0.0
        self.temp_c = physics.initial_temp_c
        self.gpu = _Domain(current=self._read_int(f"{self.gpu_paths.freq_dir}/cur_freq",
                                                  self.gpu_paths.table_hz[0]),
                           delay_s=physics.gpu_change_s)
        self.cpus = [_Domain(current=self._read_int(f"{policy.path}/scaling_cur_freq",
                                                    policy.table_khz[-1]),
                             delay_s=physics.cpu_change_s) for policy in self.paths.cpu]
        emc_rates = self.paths.emc.rates_hz if self.paths.emc else ()
        self.emc_rates_hz: tuple[int, ...] = emc_rates or (2133000000,)
        self.emc = _Domain(current=self._emc_unlocked_hz(), delay_s=physics.emc_change_s)
        self.podgov = Podgov()
        self.schedutils = [Schedutil() for _ in self.paths.cpu]
        self._online = [self._online_cores(policy.path) for policy in self.paths.cpu]
        self._online_list = self._read("sys/devices/system/cpu/online")
        self.gpu_on = True
        self.gpu_busy = False
        self.serving_cpu_share = 0.0  # of one core of the first policy, while a batch runs
        self._gpu_idle_since_s = 0.0
        self._next_podgov_s = self.podgov.tunables.poll_s
        self._next_cpu_tick_s = CPU_TICK_S
        self._podgov_window = _Window(start_s=0.0)
        self._cpu_window = _Window(start_s=0.0, cpu_busy_s=[0.0] * len(self.cpus))
        self._publish_window = _Window(start_s=0.0)
        self.timeline: list[TimelinePoint] | None = [] if record_timeline else None
        self.clock_changes = 0  # rates put in force, counted per clock (GPU, EMC, each policy)
        # Operating-point changes: moments at which one or more clocks were asked for a new rate
        # (one apply of the board layer, or one decision of a stock governor).
        self.point_changes = 0
        self._zone_files = self._writable_zones()
        self._power_cache: dict[tuple[object, ...], float] = {}
        self.sync()
        self.publish()

    # -- the files ---------------------------------------------------------------------------

    def _read(self, relpath: str) -> str | None:
        try:
            return (self.root / relpath).read_text().strip()
        except OSError:
            return None

    def _read_int(self, relpath: str, default: int) -> int:
        text = self._read(relpath)
        try:
            return int(text) if text is not None else default
        except ValueError:
            return default

    def _write(self, relpath: str, value: object) -> None:
        # The kernel's side of the file: what a read shows. Written in place (never replaced), so
        # a mode the tree gave a file stays; skipped when it already shows that value.
        text = f"{value}\n"
        if self._written.get(relpath) == text:
            return
        with open(self.root / relpath, "w") as handle:
            handle.write(text)
        self._written[relpath] = text

    def _online_cores(self, policy: str) -> int:
        related = self._read(f"{policy}/related_cpus") or self._read(f"{policy}/affected_cpus")
        cpus = [int(word) for word in related.split()] if related else [0]
        online = 0
        for cpu in cpus:
            flag = self._read(f"sys/devices/system/cpu/cpu{cpu}/online")
            online += 0 if flag == "0" else 1
        return online

    def _writable_zones(self) -> list[tuple[str, str]]:
        zones = []
        for zone in self.paths.thermal_zones:
            path = f"{zone}/temp"
            if (self.root / path).is_file() and os.access(self.root / path, os.R_OK | os.W_OK):
                zones.append((path, self._read(f"{zone}/type") or ""))
        return zones

    def _emc_unlocked_hz(self) -> int:
        """EMC when not locked: the nvpmodel cap (an idle Orin Nano shows its cap, 2133 MHz in
        15W [ORN-CAP]), or the top rate when uncapped."""
        top = self.emc_rates_hz[-1]
        for path in EMC_CAP_FILES:
            cap = self._read_int(path, -1)
            if cap > 0:
                return max((rate for rate in self.emc_rates_hz if rate <= cap),
                           default=self.emc_rates_hz[0])
            if cap == 0:
                return top
        if self.paths.emc is not None:
            cap = self._read_int(f"{self.paths.emc.path}/max_rate", top)
            return max((rate for rate in self.emc_rates_hz if rate <= cap),
                       default=self.emc_rates_hz[0])
        return top

    def _limits(self, directory: str, low_name: str, high_name: str, table: tuple[int, ...]
                ) -> tuple[int, int]:
        low = self._read_int(f"{directory}/{low_name}", table[0])
        high = self._read_int(f"{directory}/{high_name}", table[-1])
        low, high = max(low, table[0]), min(high, table[-1]) if high > 0 else table[-1]
        low = min(low, high)
        return low, high

    # -- what the governors and limits ask for ----------------------------------------------

    def _read_controls(self) -> _Controls:
        gpu = self.gpu_paths
        gpu_low, gpu_high = self._limits(gpu.freq_dir, "min_freq", "max_freq", gpu.table_hz)
        cpu = []
        for policy in self.paths.cpu:
            low, high = self._limits(policy.path, "scaling_min_freq", "scaling_max_freq",
                                     policy.table_khz)
            governor = self._read(f"{policy.path}/scaling_governor") or "schedutil"
            setspeed = self._read_int(f"{policy.path}/scaling_setspeed", 0) \
                if governor == "userspace" else 0
            cpu.append((low, high, governor, setspeed))
        return _Controls(gpu_low=gpu_low, gpu_high=gpu_high,
                         gpu_governor=self._read(f"{gpu.freq_dir}/governor") or "nvhost_podgov",
                         gpu_3d_scaling=self._read(f"{gpu.device_dir}/enable_3d_scaling") != "0",
                         cpu=tuple(cpu), emc_hz=self._emc_wanted(),
                         railgate=self._railgate_allowed_now(),
                         railgate_delay_s=self._railgate_delay_now_s())

    def _gpu_wanted(self, podgov_choice: int | None) -> int:
        controls = self._controls
        low, high = controls.gpu_low, controls.gpu_high
        if controls.gpu_governor == "performance" or not controls.gpu_3d_scaling:
            return high
        if controls.gpu_governor == "powersave":
            return low
        target = self.gpu.pending.value if self.gpu.pending else self.gpu.current
        if controls.gpu_governor == "nvhost_podgov" and podgov_choice is not None:
            target = podgov_choice
        return min(max(target, low), high)

    def _cpu_wanted(self, index: int, schedutil_choice: int | None) -> int:
        low, high, governor, setspeed = self._controls.cpu[index]
        domain = self.cpus[index]
        target = domain.pending.value if domain.pending else domain.current
        if governor == "performance":
            return high
        if governor == "powersave":
            return low
        if governor == "userspace":
            target = setspeed or target
        elif schedutil_choice is not None:
            target = schedutil_choice
        return min(max(target, low), high)

    def _emc_wanted(self) -> int:
        emc = self.paths.emc
        if emc is None or self._read(f"{emc.path}/mrq_rate_locked") != "1":
            return self._emc_unlocked_hz()
        rate = self._read_int(f"{emc.path}/rate", self.emc.current)
        # BPMP rounds a request up to a rate it has (and never past the top).
        return next((r for r in self.emc_rates_hz if r >= rate), self.emc_rates_hz[-1])

    def railgate_allowed(self) -> bool:
        """Whether the files (as of the last :meth:`sync`) let the GPU rail be gated when idle."""
        return self._controls.railgate

    def _railgate_allowed_now(self) -> bool:
        railgate = self.gpu_paths.railgate_file
        if railgate is None:
            return False
        value = self._read(railgate)
        return value == ("auto" if railgate.endswith("power/control") else "1")

    def _railgate_delay_now_s(self) -> float:
        """The rail-gate delay the tree's file asks for (ms there); the physics' default (ga10b's
        500 ms) when the tree has no such file or it holds no delay."""
        delay = self.gpu_paths.railgate_delay_file
        if delay is None:
            return self.physics.railgate_delay_s
        ms = self._read_int(delay, -1)
        return ms / 1000.0 if ms >= 0 else self.physics.railgate_delay_s

    def sync(self) -> None:
        """Re-read the limits the board layer may have written and request the clocks they
        imply (in force after each domain's delay). The governors' samples between two syncs use
        the limits read here, as the kernel's would use the values last written."""
        if self.kernel is not None:
            if len(self.kernel.log) == self._kernel_writes:
                return
            self._kernel_writes = len(self.kernel.log)
        # Another writer may have changed files this board last wrote (the fake kernel moves
        # cur_freq into new limits at once): forget what they held.
        self._written.clear()
        self._controls = self._read_controls()
        changed = self.gpu.request(self.now_s, self._gpu_wanted(None))
        for index, domain in enumerate(self.cpus):
            changed = domain.request(self.now_s, self._cpu_wanted(index, None)) or changed
        changed = self.emc.request(self.now_s, self._controls.emc_hz) or changed
        self.point_changes += 1 if changed else 0
        self._show_clocks()
        online = self._read("sys/devices/system/cpu/online")
        if online != self._online_list:
            self._online_list = online
            self._online = [self._online_cores(policy.path) for policy in self.paths.cpu]

    def _show_clocks(self) -> None:
        """The clocks in force into their files. The fake kernel moves ``cur_freq`` into new
        limits the moment they are written; the hardware takes the actuation delay, so the
        simulator puts back what is really in force."""
        self._write(f"{self.gpu_paths.freq_dir}/cur_freq", self.gpu.current)
        for policy, domain in zip(self.paths.cpu, self.cpus):
            self._write(f"{policy.path}/scaling_cur_freq", domain.current)

    # -- activity ----------------------------------------------------------------------------

    def begin_gpu_work(self, cpu_share: float) -> float:
        """A batch starts now: the seconds until the GPU can run it (its unrailgate time when it
        was gated). ``cpu_share``: the share of one core the serving thread keeps busy."""
        wait_s = 0.0
        if not self.gpu_on:
            self.gpu_on = True
            wait_s = self.physics.unrailgate_s
            status = f"{self.gpu_paths.device_dir}/power/runtime_status"
            if os.path.exists(self.root / status):
                self._write(status, "active")
        self.gpu_busy = True
        self.serving_cpu_share = cpu_share
        return wait_s

    def end_gpu_work(self) -> None:
        self.gpu_busy = False
        self.serving_cpu_share = 0.0
        self._gpu_idle_since_s = self.now_s

    def effective(self) -> tuple[int, int, int]:
        """The GPU (Hz), serving CPU (kHz) and EMC (Hz) rates in force now."""
        return self.gpu.current, self.cpus[0].current, self.emc.current

    # -- time --------------------------------------------------------------------------------

    def _railgate_at_s(self) -> float | None:
        if self.gpu_on and not self.gpu_busy and self.railgate_allowed():
            return self._gpu_idle_since_s + self._controls.railgate_delay_s
        return None

    def next_event_s(self) -> float:
        """When the board next changes on its own (a clock coming into force, a governor
        sample, the rail gating)."""
        times = [self._next_podgov_s, self._next_cpu_tick_s]
        for domain in (self.gpu, self.emc, *self.cpus):
            if domain.pending is not None:
                times.append(domain.pending.at_s)
        railgate = self._railgate_at_s()
        if railgate is not None:
            times.append(railgate)
        return min(times)

    def _inputs(self) -> PowerInputs:
        cpu_khz: list[int] = []
        cpu_busy: list[float] = []
        for index, (domain, online) in enumerate(zip(self.cpus, self._online)):
            for core in range(online):
                cpu_khz.append(domain.current)
                busy = 0.01  # background
                if index == 0 and core == 0:
                    busy += self.serving_cpu_share if self.gpu_busy else 0.0
                cpu_busy.append(busy)
        return PowerInputs(cpu_khz=tuple(cpu_khz), cpu_busy=tuple(cpu_busy),
                           gpu_hz=self.gpu.current, gpu_load=1.0 if self.gpu_busy else 0.0,
                           gpu_on=self.gpu_on, emc_hz=self.emc.current)

    def power_now_mw(self) -> float:
        # Memoised on the state it depends on: the integration asks at every event.
        key = (self.gpu.current, self.emc.current, tuple(domain.current for domain in self.cpus),
               self.gpu_busy, self.serving_cpu_share, self.gpu_on, tuple(self._online))
        cached = self._power_cache.get(key)
        if cached is None:
            cached = power_mw(self.physics, self._inputs(),
                              cpu_table_khz=self.paths.cpu[0].table_khz,
                              gpu_table_hz=self.gpu_paths.table_hz).total_mw
            if len(self._power_cache) > 4096:
                self._power_cache.clear()
            self._power_cache[key] = cached
        return cached

    def _integrate(self, until_s: float) -> None:
        span = until_s - self.now_s
        if span <= 0:
            return
        power = self.power_now_mw()
        energy = power * span  # mW * s = mJ
        self.energy_mj += energy
        self.temp_c = temperature_after_c(self.physics, self.temp_c, power, span)
        busy = span if self.gpu_busy else 0.0
        cpu_busy = span * (0.01 + (self.serving_cpu_share if self.gpu_busy else 0.0))
        for window in (self._podgov_window, self._publish_window):
            window.energy_mj += energy
            window.gpu_busy_s += busy
        self._cpu_window.cpu_busy_s[0] += cpu_busy
        for index in range(1, len(self.cpus)):
            self._cpu_window.cpu_busy_s[index] += span * 0.01
        self.now_s = until_s

    def advance(self, until_s: float) -> None:
        """Run the board's own events up to ``until_s``, integrating power and heat."""
        while True:
            event_s = self.next_event_s()
            if event_s > until_s:
                break
            self._integrate(event_s)
            self._handle_events()
        self._integrate(until_s)

    def _handle_events(self) -> None:
        now = self.now_s
        gpu_before = self.gpu.current
        for domain in (self.gpu, self.emc, *self.cpus):
            if domain.pending is not None and domain.pending.at_s <= now + 1e-12:
                domain.current = domain.pending.value
                domain.pending = None
                self.clock_changes += 1
        railgate = self._railgate_at_s()
        if railgate is not None and railgate <= now + 1e-12:
            self.gpu_on = False
            status = self.gpu_paths.device_dir + "/power/runtime_status"
            if os.path.exists(self.root / status):
                self._write(status, "suspended")
        if self._next_podgov_s <= now + 1e-12:
            self._podgov_sample()
            self._next_podgov_s = now + self.podgov.tunables.poll_s
        if self._next_cpu_tick_s <= now + 1e-12:
            self._schedutil_tick()
            self._next_cpu_tick_s = now + CPU_TICK_S
        if self.gpu.current != gpu_before:
            self._write(f"{self.gpu_paths.freq_dir}/cur_freq", self.gpu.current)

    def _podgov_sample(self) -> None:
        window = self._podgov_window
        span = self.now_s - window.start_s
        busy = window.gpu_busy_s / span if span > 0 else 0.0
        low, high = self._controls.gpu_low, self._controls.gpu_high
        choice = self.podgov.sample(now_s=self.now_s, busy_share=min(1.0, busy),
                                    freq_hz=self.gpu.current, table_hz=self.gpu_paths.table_hz,
                                    min_hz=low, max_hz=high, railgated=not self.gpu_on)
        if self.gpu.request(self.now_s, self._gpu_wanted(choice)):
            self.point_changes += 1
        self._podgov_window = _Window(start_s=self.now_s)

    def _schedutil_tick(self) -> None:
        window = self._cpu_window
        span = self.now_s - window.start_s
        for index, (domain, governor) in enumerate(zip(self.cpus, self.schedutils)):
            policy = self.paths.cpu[index]
            busy = window.cpu_busy_s[index] / span if span > 0 else 0.0
            low, high = self._controls.cpu[index][:2]
            choice = governor.update(now_s=self.now_s, interval_s=span, busy_share=min(1.0, busy),
                                     freq_khz=domain.current, table_khz=policy.table_khz,
                                     min_khz=low, max_khz=high)
            if domain.request(self.now_s, self._cpu_wanted(index, choice)):
                self.point_changes += 1
        self._cpu_window = _Window(start_s=self.now_s, cpu_busy_s=[0.0] * len(self.cpus))

    # -- what a read shows -------------------------------------------------------------------

    def publish(self) -> None:
        """Write what the kernel shows now: clocks in force, GPU load and rail state, power
        (averaged since the last publish, as the INA3221 averages), temperatures."""
        window = self._publish_window
        span = self.now_s - window.start_s
        avg_mw = window.energy_mj / span if span > 0 else self.power_now_mw()
        load = window.gpu_busy_s / span if span > 0 else (1.0 if self.gpu_busy else 0.0)
        gpu = self.gpu_paths
        self._show_clocks()
        if os.path.exists(self.root / gpu.device_dir / "load"):
            self._write(f"{gpu.device_dir}/load", round(1000 * min(1.0, load)))
        status = f"{gpu.device_dir}/power/runtime_status"
        if os.path.exists(self.root / status):
            self._write(status, "active" if self.gpu_on else "suspended")
        emc = self.paths.emc
        if emc is not None and self._read(f"{emc.path}/mrq_rate_locked") != "1":
            self._write(f"{emc.path}/rate", self.emc.current)
        self._write_rails(avg_mw)
        for path, _ in self._zone_files:
            self._write(path, 100 * round(self.temp_c * 10))
        if self.timeline is not None:
            self.timeline.append(TimelinePoint(
                time_s=self.now_s, gpu_hz=self.gpu.current, cpu_khz=self.cpus[0].current,
                emc_hz=self.emc.current, power_mw=avg_mw, gpu_on=self.gpu_on,
                temp_c=self.temp_c))
        self._publish_window = _Window(start_s=self.now_s)

    def _write_rails(self, total_mw: float) -> None:
        if not self.paths.power_monitors:
            return
        monitor = self.paths.power_monitors[0]
        split = power_mw(self.physics, self._inputs(), cpu_table_khz=self.paths.cpu[0].table_khz,
                         gpu_table_hz=self.gpu_paths.table_hz)
        # The split of the instant, scaled to the window's average total.
        scale = total_mw / split.total_mw if split.total_mw > 0 else 1.0
        by_label = {"VDD_IN": total_mw, "VDD_CPU_GPU_CV": split.cpu_gpu_cv_mw * scale,
                    "VDD_SOC": split.soc_mw * scale}
        for channel in (1, 2, 3):
            label = self._read(f"{monitor}/in{channel}_label")
            if label not in by_label:
                continue
            if not os.path.exists(self.root / monitor / f"curr{channel}_input"):
                continue
            self._write(f"{monitor}/in{channel}_input", VDD_IN_MV)
            self._write(f"{monitor}/curr{channel}_input",
                        round(by_label[label] * 1000 / VDD_IN_MV))


__all__ = ["SimBoard", "TimelinePoint"]
