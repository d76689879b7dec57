"""A Jetson board's clocks, limits and sensors behind :class:`~power.types.BoardControl`.

``Board.open(root)`` identifies the board (device-tree ``compatible`` and ``model``,
``/etc/nv_tegra_release``), finds its files (``power/sysfs/discover.py``) and builds one object per
sysfs group. Every write goes through the injected :class:`~power.io.Writer` (the files
themselves by default; a privileged helper's client, or the simulator's kernel) in an order every
kernel accepts, and is read back: :meth:`Board.apply` answers what stuck, what did not
(mismatches) and what this board cannot do (degraded mode). A control whose files are missing or
cannot be written is reported by :meth:`Board.capabilities` with the reason and skipped from then
on; it never raises out of ``apply``.

Values of an :class:`~power.types.OperatingPoint`: GPU limits must be entries of the GPU's table
(Hz), CPU limits entries of the CPU table (kHz); a value outside the table is refused with a
:class:`~agent.errors.PowerError` before anything is written (a MHz figure given as Hz is caught
there). ``emc_hz``: a rate from the EMC table locks the EMC there, ``0`` unlocks it (hands it
back to the board), ``None`` leaves it as it is.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import PowerError
from power.commands import CommandRunner, SubprocessRunner
from power.io import RAILGATE_DELAY_MAX_MS, FileWriter, Writer, read_text
from power.nvpmodel import Nvpmodel, NvpmodelUnavailable, read_status
from power.profiles import BoardProfile, identify
from power.sysfs.cpufreq import CpuPolicy
from power.sysfs.devfreq import GpuDevfreq
from power.sysfs.discover import TEGRA_RELEASE, BoardPaths, discover, read_device_tree
from power.sysfs.emc import Emc
from power.sysfs.fan import Fan
from power.sysfs.limits import LimitPair
from power.sysfs.railgate import GpuRailgate, GpuRailgateDelay
from power.sysfs.rails import PowerRails
from power.sysfs.thermal import ThermalZones
from power.types import ApplyResult, ClockTable, Mismatch, OperatingPoint, Telemetry

log = logging.getLogger(__name__)

CONTROLS = ("gpu", "cpu", "emc", "railgate", "railgate_delay", "nvpmodel", "thermal", "rails",
            "fan")
CONTROL_FILES = frozenset({"min_freq", "max_freq", "scaling_min_freq", "scaling_max_freq",
                           "mrq_rate_locked", "rate", "railgate_enable", "control",
                           "railgate_delay", "autosuspend_delay_ms"})
"""The names of the files a snapshot may hold (power/io.py's table)."""
SNAPSHOT_FORMAT = 1


def _reason(exc: OSError, path: str) -> str:
    what = exc.strerror or type(exc).__name__
    return f"cannot write {path}: {what}"


def _degrades(exc: OSError) -> bool:
    """A write error that will not go away by itself (no permission, no file, read-only)."""
    return isinstance(exc, (PermissionError, FileNotFoundError)) or exc.errno in (
        errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT)


def parse_release(text: str) -> str | None:
    """``/etc/nv_tegra_release``'s ``# R36 (release), REVISION: 4.3, ...`` as ``R36.4.3``."""
    match = re.match(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"R{match.group(1)}.{match.group(2)}" if match else None


def jetpack_of(release: str | None) -> int | None:
    """The JetPack major version an L4T release belongs to (R32 -> 4, R34 (5.0 Developer
    Preview) and R35 -> 5, R36 -> 6, R38 and later -> 7)."""
    if release is None:
        return None
    major = int(release[1:].split(".")[0])
    return {32: 4, 34: 5, 35: 5, 36: 6}.get(major, 7 if major >= 38 else None)


class Board:
    """One board under ``root``; build it with :meth:`open`."""

    def __init__(self, *, root: Path, paths: BoardPaths, writer: Writer, runner: CommandRunner,
                 profile: BoardProfile | None, compatible: tuple[str, ...], model: str,
                 release: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.paths = paths
        self.writer = writer
        self.runner = runner
        self.profile = profile
        self.compatible = compatible
        self.model = model
        self.release = release
        self.clock = clock
        self.gpu = GpuDevfreq(root, paths.gpu) if paths.gpu is not None else None
        self.cpu = [CpuPolicy(root, policy) for policy in paths.cpu]
        self.emc = Emc(root, paths.emc) if paths.emc is not None and paths.emc.rates_hz else None
        self.railgate = GpuRailgate(root, paths.gpu.railgate_file) if (
            paths.gpu is not None and paths.gpu.railgate_file is not None) else None
        self.railgate_delay = GpuRailgateDelay(root, paths.gpu.railgate_delay_file) if (
            paths.gpu is not None and paths.gpu.railgate_delay_file is not None) else None
        self.thermal = ThermalZones(root, paths.thermal_zones)
        self.rails = PowerRails(root, paths.power_monitors)
        self.fan = Fan(root, paths.fan_pwm, paths.fan_tach)
        self.nvpmodel: Nvpmodel | None = None
        self._problems: dict[str, str] = {}
        self._warned: dict[str, str] = {}  # a limit file's problem, warned about once
        try:
            self.nvpmodel = Nvpmodel(root, runner)
        except OSError:
            self._problems["nvpmodel"] = "no /etc/nvpmodel.conf"
        except PowerError as exc:
            self._problems["nvpmodel"] = str(exc)
        self._check_files()
        self._table = self._clock_table()

    @classmethod
    def open(cls, root: Path | str = "/", *, runner: CommandRunner | None = None,
             writer: Writer | None = None, profile: BoardProfile | None = None) -> Board:
        """The board under ``root``. ``profile``: force one instead of identifying the board.

        Raises PowerError when ``root`` holds no Jetson at all (no device-tree entry and no
        Tegra GPU): a development machine, where the caller runs without power control."""
        root = Path(root)
        compatible = read_device_tree(root, "compatible")
        model_parts = read_device_tree(root, "model")
        model = model_parts[0] if model_parts else ""
        paths = discover(root)
        if not any("tegra" in entry for entry in compatible) and paths.gpu is None:
            raise PowerError("no Jetson board here: no Tegra device-tree entry and no Tegra GPU "
                             "under the root", root=str(root),
                             compatible=", ".join(compatible) or "(none)")
        found = profile or identify(compatible)
        if found is None:
            log.warning("board %r (%s) matches no profile: using the tables in its files",
                        model, ", ".join(compatible))
        try:
            release = parse_release(read_text(root, TEGRA_RELEASE))
        except OSError:
            release = None
        return cls(root=root, paths=paths, writer=writer or FileWriter(root),
                   runner=runner or SubprocessRunner(), profile=found, compatible=compatible,
                   model=model, release=release)

    @property
    def jetpack(self) -> int | None:
        return jetpack_of(self.release)

    @property
    def name(self) -> str:
        return self.profile.name if self.profile is not None else f"unknown ({self.model})"

    # -- what the board offers --------------------------------------------------------------

    def _check_files(self) -> None:
        if self.gpu is None:
            self._problems["gpu"] = "no Tegra GPU under sys/class/devfreq"
        elif not self.gpu.table_hz:
            self._problems["gpu"] = f"no frequency table in {self.gpu.paths.freq_dir}"
        if not self.cpu:
            self._problems["cpu"] = "no cpufreq policy under sys/devices/system/cpu/cpufreq"
        elif not all(policy.table_khz for policy in self.cpu):
            self._problems["cpu"] = "a cpufreq policy without a frequency table"
        if self.paths.emc is None:
            self._problems["emc"] = "no EMC control in debugfs (not mounted, or not root)"
        elif not self.paths.emc.rates_hz:
            self._problems["emc"] = "no possible_rates for the EMC in debugfs"
        if self.railgate is None:
            self._problems["railgate"] = "no railgate_enable or power/control for the GPU"
        if self.railgate_delay is None:
            self._problems["railgate_delay"] = ("no railgate_delay or power/autosuspend_delay_ms "
                                                "for the GPU")
        if not self.thermal.zones:
            self._problems["thermal"] = "no thermal zone"
        if not self.rails.channels:
            self._problems["rails"] = "no INA3221 power monitor"
        if self.fan.pwm_path is None:
            self._problems["fan"] = "no pwmfan hwmon"
        # Files that exist but cannot be written (a user without the group, a read-only mount):
        # os.access answers for this process; as root it says yes and the write itself tells.
        for control, files in (("gpu", self._gpu_files()), ("cpu", self._cpu_files()),
                               ("emc", self._emc_files()),
                               ("railgate", [self.railgate.path] if self.railgate else []),
                               ("railgate_delay", self._delay_files())):
            for path in files:
                if control not in self._problems and not os.access(self.root / path, os.W_OK):
                    self._problems[control] = f"cannot write {path}: permission denied"

    def _gpu_files(self) -> list[str]:
        return [self.gpu.limits.min_path, self.gpu.limits.max_path] if self.gpu else []

    def _cpu_files(self) -> list[str]:
        return [path for policy in self.cpu for path in (policy.limits.min_path,
                                                           policy.limits.max_path)]

    def _emc_files(self) -> list[str]:
        return [self.emc.lock_path, self.emc.rate_path] if self.emc else []

    def _delay_files(self) -> list[str]:
        return [self.railgate_delay.path] if self.railgate_delay else []

    def _rail_files(self) -> list[str]:
        return [*([self.railgate.path] if self.railgate else []), *self._delay_files()]

    def _clock_table(self) -> ClockTable:
        cpu_khz = sorted({khz for policy in self.cpu for khz in policy.table_khz})
        return ClockTable(gpu_hz=self.gpu.table_hz if self.gpu else (),
                          cpu_khz=tuple(cpu_khz),
                          emc_hz=self.emc.rates_hz if self.emc else (),
                          nvpmodel_modes=self.nvpmodel.modes() if self.nvpmodel else ())

    def clock_table(self) -> ClockTable:
        return self._table

    def capabilities(self) -> dict[str, str | None]:
        found = {control: self._problems.get(control) for control in CONTROLS}
        if found["rails"] is None and self.rails.problems:
            # Some rails read, some do not (a channel's files missing or unreadable): the rails
            # still report, degraded, and say which are missing.
            found["rails"] = "degraded: " + "; ".join(
                f"{label}: {why}" for label, why in sorted(self.rails.problems.items()))
        return found

    def describe(self) -> dict[str, Any]:
        """What this board is and can do, JSON-able (for ``edge-agent power status``)."""
        table = self._table
        return {"board": self.name, "model": self.model, "compatible": list(self.compatible),
                "release": self.release, "jetpack": self.jetpack,
                "gpu_hz": list(table.gpu_hz), "cpu_khz": list(table.cpu_khz),
                "emc_hz": list(table.emc_hz),
                "nvpmodel_modes": {str(mode_id): name for mode_id, name in table.nvpmodel_modes},
                "capabilities": self.capabilities()}

    def usable(self, control: str) -> bool:
        return control not in self._problems

    # -- reading ----------------------------------------------------------------------------

    def read_point(self) -> OperatingPoint:
        gpu_min = gpu_max = cpu_min = cpu_max = None
        if self.gpu is not None:
            try:
                gpu_min, gpu_max = self.gpu.read_limits_hz()
            except (OSError, ValueError):
                pass
        if self.cpu:
            try:
                cpu_min, cpu_max = self.cpu[0].read_limits_khz()
            except (OSError, ValueError):
                pass
        delay_ms = None
        if self.railgate_delay is not None:
            try:
                delay_ms = self.railgate_delay.delay_ms()
            except (OSError, ValueError):
                pass
        emc_hz = None
        if self.emc is not None:
            try:
                emc_hz = self.emc.rate_hz() if self.emc.locked() else None
            except (OSError, ValueError):
                pass
        return OperatingPoint(
            gpu_min_hz=gpu_min, gpu_max_hz=gpu_max, cpu_min_khz=cpu_min, cpu_max_khz=cpu_max,
            emc_hz=emc_hz, gpu_railgate=self.railgate.allowed() if self.railgate else None,
            gpu_railgate_delay_ms=delay_ms,
            nvpmodel_mode=read_status(self.root) if self.nvpmodel else None)

    def telemetry(self) -> Telemetry:
        rails = self.rails.read_mw()
        return Telemetry(
            time_s=self.clock(),
            gpu_freq_hz=self.gpu.cur_freq_hz() if self.gpu else None,
            gpu_load=self.gpu.load() if self.gpu else None,
            gpu_railgated=self.gpu.railgated() if self.gpu else None,
            cpu_freq_khz=tuple(policy.cur_freq_khz() for policy in self.cpu),
            emc_hz=self.emc.rate_hz() if self.emc else self._emc_rate_read_only(),
            thermal=self.thermal.read(), rails_mw=rails,
            total_power_mw=self.rails.total_mw(rails),
            nvpmodel_mode=read_status(self.root) if self.nvpmodel else None, source="sysfs")

    def _emc_rate_read_only(self) -> int | None:
        if self.paths.emc is None:
            return None
        try:
            return int(read_text(self.root, f"{self.paths.emc.path}/rate"))
        except (OSError, ValueError):
            return None

    # -- writing ----------------------------------------------------------------------------

    def _check_point(self, point: OperatingPoint) -> None:
        """Refuse values this board's tables do not hold, before any write."""
        table = self._table
        for name, value in point.__dict__.items():
            # A float frequency would be written as "612000000.0" (EINVAL), a bool is an int to
            # Python but never a frequency; gpu_railgate alone is a flag.
            if value is None:
                continue
            flag = name == "gpu_railgate"
            if (not isinstance(value, bool)) if flag else (
                    isinstance(value, bool) or not isinstance(value, int)):
                raise PowerError(f"{name} must be {'a bool' if flag else 'an int'}",
                                 value=repr(value)[:40], found=type(value).__name__)
        for name, value, entries, unit in (
                ("gpu_min_hz", point.gpu_min_hz, table.gpu_hz, "Hz"),
                ("gpu_max_hz", point.gpu_max_hz, table.gpu_hz, "Hz"),
                ("cpu_min_khz", point.cpu_min_khz, table.cpu_khz, "kHz"),
                ("cpu_max_khz", point.cpu_max_khz, table.cpu_khz, "kHz")):
            if value is None or not entries:
                continue
            if value not in entries:
                raise PowerError(f"{name} is not a frequency of this board's table (in {unit})",
                                 board=self.name, value=value,
                                 expected=f"one of {entries[0]}..{entries[-1]} {unit} "
                                          f"({len(entries)} entries)")
        for low, high, what, limits in (
                (point.gpu_min_hz, point.gpu_max_hz, "gpu", self.gpu.limits if self.gpu else None),
                (point.cpu_min_khz, point.cpu_max_khz, "cpu",
                 self.cpu[0].limits if self.cpu else None)):
            if low is None and high is None:
                continue
            if (low is None or high is None) and limits is not None:
                # One limit given: it must not cross the one left as it is.
                try:
                    cur_low, cur_high = limits.read(self.root)
                except (OSError, ValueError):
                    continue  # unreadable: the write step reports it
                low = cur_low if low is None else low
                high = cur_high if high is None else high
            if low is not None and high is not None and low > high:
                raise PowerError(f"{what} minimum above its maximum (a limit given alone is "
                                 "checked against the other's current value)", minimum=low,
                                 maximum=high)
        delay = point.gpu_railgate_delay_ms
        if delay is not None and not 0 <= delay <= RAILGATE_DELAY_MAX_MS:
            raise PowerError("gpu_railgate_delay_ms must be in 0..60000 (milliseconds)",
                             value=delay)
        if point.emc_hz and table.emc_hz and point.emc_hz not in table.emc_hz:
            raise PowerError("emc_hz is not a rate this board's EMC accepts (in Hz; 0 unlocks)",
                             board=self.name, value=point.emc_hz,
                             expected=", ".join(map(str, table.emc_hz)))
        if point.nvpmodel_mode is not None and self.nvpmodel is not None:
            self.nvpmodel.conf.mode(point.nvpmodel_mode)

    def apply(self, point: OperatingPoint) -> ApplyResult:
        self._check_point(point)
        step = _Step(self)
        if point.nvpmodel_mode is not None:
            step.nvpmodel(point.nvpmodel_mode)
        if point.gpu_min_hz is not None or point.gpu_max_hz is not None:
            step.gpu(point.gpu_min_hz, point.gpu_max_hz)
        if point.cpu_min_khz is not None or point.cpu_max_khz is not None:
            step.cpu(point.cpu_min_khz, point.cpu_max_khz)
        if point.emc_hz is not None:
            step.emc(point.emc_hz or None)
        if point.gpu_railgate_delay_ms is not None:
            step.railgate_delay(point.gpu_railgate_delay_ms)
        if point.gpu_railgate is not None:
            step.railgate(point.gpu_railgate)
        return step.result()

    def snapshot(self) -> dict[str, Any]:
        files: dict[str, str] = {}
        for path in [*self._gpu_files(), *self._cpu_files(), *self._emc_files(),
                     *self._rail_files()]:
            try:
                files[path] = read_text(self.root, path)
            except OSError:
                continue
        if self.emc is not None and files.get(self.emc.lock_path) == "0":
            files.pop(self.emc.rate_path, None)  # unlocked: the rate is the board's choice
        if self.railgate_delay is not None and \
                not files.get(self.railgate_delay.path, "0").isdigit():
            # Not a delay the board layer can write back (a negative one turns autosuspend off):
            # the controller never changes it then, so there is nothing to restore.
            files.pop(self.railgate_delay.path, None)
        return {"format": SNAPSHOT_FORMAT, "board": self.name,
                "nvpmodel_mode": read_status(self.root) if self.nvpmodel else None,
                "files": files}

    def restore(self, snapshot: dict[str, Any]) -> ApplyResult:
        """Put back every limit of ``snapshot`` (from :meth:`snapshot`, maybe of an earlier run):
        nvpmodel's mode first (it rewrites the caps), then the GPU and CPU limits in the safe
        order, the EMC (unlocked, or locked at its rate), the rail-gate delay and rail-gating. Limits of a control
        this board cannot reach now are skipped and named in ``unsupported``; a snapshot of
        another board, of another format, with values that are not text or with files that
        are no board limit raises PowerError before anything is written."""
        if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT or \
                not isinstance(snapshot.get("files"), dict):
            raise PowerError("not a board snapshot this version can restore",
                             format=snapshot.get("format") if isinstance(snapshot, dict) else None)
        if snapshot.get("board") != self.name:
            raise PowerError("the snapshot is of another board", board=self.name,
                             found=snapshot.get("board"))
        files: dict[str, str] = snapshot["files"]
        mode = snapshot.get("nvpmodel_mode")
        bad = sorted(str(path) for path, value in files.items() if not isinstance(value, str))
        if bad or (mode is not None and type(mode) is not int):
            raise PowerError("the snapshot holds values that are not a file's text or a mode "
                             "number (damaged?)", files=", ".join(bad[:5]) or None,
                             nvpmodel_mode=None if type(mode) is int else repr(mode)[:40])
        known = {*self._gpu_files(), *self._cpu_files(), *self._emc_files(),
                 *self._rail_files()}
        unknown = sorted(set(files) - known)
        foreign = [path for path in unknown if path.rsplit("/", 1)[-1] not in CONTROL_FILES]
        if foreign:
            raise PowerError("the snapshot names files this board does not write",
                             files=", ".join(foreign[:5]))
        step = _Step(self)
        if unknown:
            # Limits of a control this board cannot reach now (debugfs not mounted or not
            # readable after a reboot, a GPU path moved by an upgrade): the rest is still put
            # back, these are reported.
            step.unsupported.append(f"snapshot: {len(unknown)} limit(s) this board cannot "
                                    f"write now, not restored: {', '.join(unknown[:3])}")
        if mode is not None and self.nvpmodel is not None and \
                read_status(self.root) != mode:
            step.nvpmodel(mode)

        def number(path: str) -> int | None:
            value = files.get(path)
            return int(value) if value is not None and value.isdigit() else None

        if self.gpu is not None:
            step.pair("gpu", self.gpu.limits, number(self.gpu.limits.min_path),
                      number(self.gpu.limits.max_path))
        for policy in self.cpu:
            step.pair("cpu", policy.limits, number(policy.limits.min_path),
                      number(policy.limits.max_path))
        if self.emc is not None and self.emc.lock_path in files:
            rate = number(self.emc.rate_path)
            step.emc(rate if files[self.emc.lock_path] == "1" and rate else None)
        if self.railgate_delay is not None and self.railgate_delay.path in files:
            delay = number(self.railgate_delay.path)
            if delay is not None:
                step.railgate_delay(delay)
            else:
                step.unsupported.append(f"snapshot: {self.railgate_delay.path} holds "
                                        f"{files[self.railgate_delay.path]!r}, not a delay in ms: "
                                        "not restored")
        if self.railgate is not None and self.railgate.path in files:
            step.railgate(files[self.railgate.path] in ("1", "auto"))
        return step.result()


class _Step:
    """One apply or restore: its writes, mismatches and the controls found unusable."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.writes = 0
        self.mismatches: list[Mismatch] = []
        self.unsupported: list[str] = []

    def _skip(self, control: str) -> bool:
        reason = self.board._problems.get(control)
        if reason is not None:
            self.unsupported.append(f"{control}: {reason}")
            return True
        return False

    def _degrade(self, control: str, reason: str) -> None:
        log.warning("power control %s degraded: %s", control, reason)
        self.board._problems[control] = reason
        self.unsupported.append(f"{control}: {reason}")

    def _run(self, control: str, path: str, action: Callable[[], tuple[int, list[Mismatch]]],
             recheck: Callable[[], list[Mismatch]]) -> None:
        """Run one control's writes; ``recheck`` reads back what is in force after a write the
        kernel refused (the mismatches then say what was wanted and what is there)."""
        try:
            writes, mismatches = action()
        except PowerError as exc:  # the writer refused (a privileged helper's rules): for good
            self._degrade(control, f"writer refused {path}: {exc}")
            return
        except ValueError as exc:
            # A file that read back as no number (empty mid-update, "<unsupported>"): this value
            # may not be in force, the control may still work next time.
            self._warn_once(control, path, f"did not read as a number: {exc}")
            self.mismatches.extend(recheck() or [Mismatch(path=path, wanted="a write",
                                                          found=None)])
            return
        except OSError as exc:
            if exc.errno == errno.EBUSY and control == "cpu":
                # A cpufreq policy whose CPUs are all offline (AGX Orin's 15W and 30W modes)
                # answers EBUSY: nothing to set there until nvpmodel brings its CPUs back.
                return
            where = str(exc.filename or path)
            if _degrades(exc):
                self._degrade(control, _reason(exc, where))
                return
            # EINVAL and the like: this value was refused, the control still works.
            self._warn_once(control, path, f"{where} refused a write: {exc.strerror}")
            self.mismatches.extend(recheck() or [Mismatch(path=where, wanted="a write",
                                                          found=None)])
            return
        self.writes += writes
        self.mismatches.extend(mismatches)
        if path in self.board._warned:
            del self.board._warned[path]
            log.info("power control %s: %s takes its writes again", control, path)

    def _warn_once(self, control: str, path: str, problem: str) -> None:
        """Warn about ``path``'s control once per problem, not on every apply (a governor
        applies several times a second): again only when the problem changes, and
        :meth:`_run` says once when it is gone."""
        if self.board._warned.get(path) != problem:
            self.board._warned[path] = problem
            log.warning("power control %s: %s (said once until it changes)", control, problem)

    def nvpmodel(self, mode_id: int) -> None:
        nvpmodel = self.board.nvpmodel
        if self._skip("nvpmodel") or nvpmodel is None:
            return
        try:
            nvpmodel.set_mode(mode_id)
            self.writes += 1
        except NvpmodelUnavailable as exc:
            self._degrade("nvpmodel", str(exc))
        except PowerError as exc:
            self.mismatches.append(Mismatch(path="var/lib/nvpmodel/status", wanted=mode_id,
                                            found=nvpmodel.current()))
            log.warning("nvpmodel: %s", exc)

    def pair(self, control: str, limits: LimitPair, new_min: int | None,
             new_max: int | None) -> None:
        if self._skip(control):
            return
        board = self.board

        wanted: list[int | None] = [new_min, new_max]

        def action() -> tuple[int, list[Mismatch]]:
            # One limit unreadable (a directory where the file was) must not keep the other
            # from being set: each is taken as found, or as asked for.
            cur_min, cur_max = limits.read_known(board.root)
            high = cur_max if new_max is None else new_max
            low = cur_min if new_min is None else new_min
            if low is not None and high is not None:
                low = min(low, high)
            wanted[:] = [low, high]
            return limits.set(board.root, board.writer, low, high)

        def recheck() -> list[Mismatch]:
            return limits.check(board.root, wanted[0], wanted[1])

        self._run(control, limits.max_path, action, recheck)

    def gpu(self, new_min: int | None, new_max: int | None) -> None:
        if self.board.gpu is not None:
            self.pair("gpu", self.board.gpu.limits, new_min, new_max)
        else:
            self._skip("gpu")

    def cpu(self, new_min: int | None, new_max: int | None) -> None:
        if not self.board.cpu:
            self._skip("cpu")
            return
        for policy in self.board.cpu:
            self.pair("cpu", policy.limits,
                      None if new_min is None else policy.nearest_khz(new_min),
                      None if new_max is None else policy.nearest_khz(new_max))
            if "cpu" in self.board._problems:
                return

    def emc(self, rate_hz: int | None) -> None:
        emc = self.board.emc
        if self._skip("emc") or emc is None:
            return
        writer = self.board.writer
        if rate_hz is None:
            self._run("emc", emc.lock_path, lambda: emc.unlock(writer), list)
        else:
            self._run("emc", emc.rate_path, lambda: emc.lock(writer, rate_hz),
                      lambda: emc.check(rate_hz))

    def railgate(self, allow: bool) -> None:
        railgate = self.board.railgate
        if self._skip("railgate") or railgate is None:
            return
        self._run("railgate", railgate.path, lambda: railgate.set(self.board.writer, allow),
                  list)

    def railgate_delay(self, delay_ms: int) -> None:
        delay = self.board.railgate_delay
        if self._skip("railgate_delay") or delay is None:
            return
        self._run("railgate_delay", delay.path, lambda: delay.set(self.board.writer, delay_ms),
                  lambda: delay.check(delay_ms))

    def result(self) -> ApplyResult:
        return ApplyResult(applied=self.board.read_point(), mismatches=tuple(self.mismatches),
                           unsupported=tuple(dict.fromkeys(self.unsupported)),
                           writes=self.writes)


__all__ = ["CONTROLS", "Board"]
