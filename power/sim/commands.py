"""Strict fakes of ``nvpmodel`` and ``jetson_clocks`` acting on a fake board tree.

:class:`FakeCommands` is a :class:`~power.commands.CommandRunner`: it answers the two tools'
command lines as the real ones do (output formats of ``docs/reference/jetson_sysfs_layout.md``
section D) and changes the tree through a writer (normally a :class:`~power.sim.kernel.FakeKernel`,
so the kernel's rules apply to the tools' writes as to the board layer's). It is strict: an option
it does not know, a mode the configuration lacks or a change attempted without root fails as the
tools fail, and every command line is recorded in :attr:`calls`.

Two known behaviours of the real tools are reproduced because the board layer must cope with
them: a mode listed in ``reboot_modes`` "succeeds" without changing anything (Orin NX modes that
need a reboot, where ``-q`` keeps showing the old mode), and ``jetson_clocks --restore`` leaves
the EMC locked.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

from agent.errors import PowerError
from power.commands import NOT_FOUND, CommandResult
from power.io import Writer, read_int, read_text
from power.nvpmodel import CONF, STATUS, NvpmodelConf, parse_conf, read_status
from power.sysfs.discover import discover
from power.sysfs.limits import LimitPair

EMC = "sys/kernel/debug/bpmp/debug/clk/emc"


def _rel(path: str) -> str:
    return path.lstrip("/")


class FakeCommands:
    def __init__(self, root: Path, writer: Writer, *, as_root: bool = True,
                 reboot_modes: frozenset[int] = frozenset()) -> None:
        self.root = Path(root)
        self.writer = writer
        self.as_root = as_root
        self.reboot_modes = reboot_modes
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0) -> CommandResult:
        args = tuple(argv)
        self.calls.append(args)
        tool = Path(args[0]).name if args else ""
        if tool == "nvpmodel":
            return self._nvpmodel(args)
        if tool == "jetson_clocks":
            return self._jetson_clocks(args)
        return CommandResult(argv=args, returncode=NOT_FOUND,
                             stderr=f"{args[0] if args else ''}: command not found")

    # -- nvpmodel ---------------------------------------------------------------------------

    def _conf(self) -> NvpmodelConf:
        return parse_conf(read_text(self.root, CONF) + "\n", source=f"/{CONF}")

    def _nvpmodel(self, args: tuple[str, ...]) -> CommandResult:
        options = list(args[1:])
        verbose = "--verbose" in options
        options = [option for option in options if option != "--verbose"]
        try:
            conf = self._conf()
        except (OSError, PowerError) as exc:
            return CommandResult(argv=args, returncode=1,
                                 stdout=f"NVPM ERROR: failed to parse /{CONF}: {exc}\n")
        if options in (["-q"], ["--query"]):
            status = read_status(self.root)
            mode = conf.mode(conf.default_mode if status is None else status)
            lines = ["NVPM WARN: fan mode is not set!"]
            if verbose:
                lines += [f"NVPM VERB: Config file: /{CONF}",
                          f"NVPM VERB: parsing done for /{CONF}",
                          f"NVPM VERB: Current mode: NV Power Mode: {mode.name}",
                          str(mode.mode_id)]
            else:
                lines += [f"NV Power Mode: {mode.name}", str(mode.mode_id)]
            return CommandResult(argv=args, returncode=0, stdout="\n".join(lines) + "\n")
        if options in (["-p"], ["--parse"]):
            lines = [f"NVPM VERB: POWER_MODEL: ID={m.mode_id} NAME={m.name}" for m in conf.modes]
            return CommandResult(argv=args, returncode=0,
                                 stdout="\n".join(lines) + "\n" if verbose else "")
        if len(options) == 2 and options[0] in ("-m", "--mode"):
            return self._set_mode(args, conf, options[1])
        return CommandResult(argv=args, returncode=1,
                             stderr="Usage: nvpmodel [-m mode] [-q] [-p] [--verbose] [-f conf]\n")

    def _set_mode(self, args: tuple[str, ...], conf: NvpmodelConf, value: str) -> CommandResult:
        if not value.isdigit() or all(mode.mode_id != int(value) for mode in conf.modes):
            return CommandResult(argv=args, returncode=1,
                                 stdout=f"NVPM ERROR: Invalid power mode ID {value}\n")
        if not self.as_root:
            return CommandResult(argv=args, returncode=1, stdout=(
                f"NVPM ERROR: Error opening /{STATUS}: Permission denied\n"))
        mode = conf.mode(int(value))
        if mode.mode_id in self.reboot_modes:
            return CommandResult(argv=args, returncode=0, stdout=(
                "NVPM WARN: Reboot required for changing to this power mode\n"))
        clocks: dict[str, dict[str, int]] = {}
        before: list[tuple[str, str]] = []  # files written before the clocks, in file order
        after: list[tuple[str, str]] = []  # and after them
        for param, argument, setting in mode.settings:
            spec = conf.params[param]
            if spec.kind == "FILE":
                # CPUs come online before their clusters' clocks are set and go offline after
                # (a policy with no CPU online refuses its limits: EBUSY); other files keep
                # their place around the clock lines (power/control "on" before, "auto" after).
                late = bool(clocks) or param == "CPU_ONLINE" and setting == 0
                (after if late else before).append((_rel(spec.paths[argument]), str(setting)))
            elif isinstance(setting, int):
                clocks.setdefault(param, {})[argument] = setting
        try:
            for file, text in before:
                self.writer.write(file, text)
            for param, limits in clocks.items():
                try:
                    self._clock(conf, param, limits)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
            for file, text in after:
                self.writer.write(file, text)
        except OSError as exc:
            return CommandResult(argv=args, returncode=1,
                                 stdout=f"NVPM ERROR: failed to write {exc.filename}: "
                                        f"{exc.strerror}\n")
        (self.root / STATUS).write_text(f"pmode:{mode.mode_id:04d} fmode:fan_mode_quiet\n")
        return CommandResult(argv=args, returncode=0, stdout="")

    def _clock(self, conf: NvpmodelConf, param: str, limits: dict[str, int]) -> None:
        paths = conf.params[param].paths
        table: list[int] = []
        if "FREQ_TABLE" in paths:
            table = sorted(int(word) for word in read_text(
                self.root, _rel(paths["FREQ_TABLE"])).split())
        if "MIN_FREQ" not in paths:  # a cap only (the EMC): written as it is
            if "MAX_FREQ" in limits:
                self.writer.write(_rel(paths["MAX_FREQ"]), str(max(limits["MAX_FREQ"], 0)))
            return
        pair = LimitPair(min_path=_rel(paths["MIN_FREQ"]), max_path=_rel(paths["MAX_FREQ"]),
                         floor=table[0])
        cur_min, cur_max = pair.read(self.root)
        high = limits.get("MAX_FREQ", cur_max)
        high = table[-1] if high < 0 or high > table[-1] else high
        low = limits.get("MIN_FREQ", cur_min)
        low = min(max(low, table[0]), high)
        pair.set(self.root, self.writer, low, high)

    # -- jetson_clocks ----------------------------------------------------------------------

    def _offline(self, file: str) -> bool:
        """Whether ``file`` is a limit of a cpufreq policy whose CPUs are all offline."""
        if "/cpufreq/policy" not in file:
            return False
        policy = file.rsplit("/", 1)[0]
        cpus = read_text(self.root, f"{policy}/related_cpus").split()
        return all(read_text(self.root, f"sys/devices/system/cpu/cpu{cpu}/online") == "0"
                   for cpu in cpus)

    def _limit_files(self) -> list[str]:
        paths = discover(self.root)
        files = [f"{policy.path}/{name}" for policy in paths.cpu
                 for name in ("scaling_min_freq", "scaling_max_freq")]
        if paths.gpu is not None:
            files += [f"{paths.gpu.freq_dir}/min_freq", f"{paths.gpu.freq_dir}/max_freq"]
        return files

    def _jetson_clocks(self, args: tuple[str, ...]) -> CommandResult:
        options = list(args[1:])
        if options == ["--show"]:
            return CommandResult(argv=args, returncode=0, stdout=self._show())
        if not self.as_root:
            return CommandResult(argv=args, returncode=1,
                                 stderr="Error: Run this script(jetson_clocks) as a root user\n")
        try:
            if options == []:
                self._pin()
            elif len(options) == 2 and options[0] == "--store":
                self._store(Path(options[1]))
            elif len(options) == 2 and options[0] == "--restore":
                self._restore(Path(options[1]))
            else:
                return CommandResult(argv=args, returncode=1,
                                     stderr="usage: jetson_clocks [--show] [--store [file]] "
                                            "[--restore [file]]\n")
        except OSError as exc:
            return CommandResult(argv=args, returncode=1,
                                 stderr=f"jetson_clocks: {exc.filename}: {exc.strerror}\n")
        return CommandResult(argv=args, returncode=0)

    def _pin(self) -> None:
        paths = discover(self.root)
        pairs = [LimitPair(min_path=f"{p.path}/scaling_min_freq",
                           max_path=f"{p.path}/scaling_max_freq", floor=p.table_khz[0])
                 for p in paths.cpu]
        if paths.gpu is not None:
            pairs.append(LimitPair(min_path=f"{paths.gpu.freq_dir}/min_freq",
                                   max_path=f"{paths.gpu.freq_dir}/max_freq",
                                   floor=paths.gpu.table_hz[0]))
        for pair in pairs:
            _, high = pair.read(self.root)
            try:
                pair.set(self.root, self.writer, high, high)
            except OSError as exc:
                # The real script sets the CPUs that are online: a cluster a mode took offline
                # (AGX Orin 15W/30W) answers EBUSY and is left alone.
                if exc.errno != errno.EBUSY:
                    raise
        if paths.emc is not None:
            self.writer.write(f"{EMC}/mrq_rate_locked", "1")
            self.writer.write(f"{EMC}/rate", str(read_int(self.root, f"{EMC}/max_rate")))
        if paths.fan_pwm is not None:
            self.writer.write(f"{paths.fan_pwm}/pwm1", "255")

    def _store(self, path: Path) -> None:
        lines = [f"/{file} {read_text(self.root, file)}" for file in self._limit_files()
                 if not self._offline(file)]
        paths = discover(self.root)
        if paths.emc is not None:
            lines += [f"/{EMC}/mrq_rate_locked {read_text(self.root, f'{EMC}/mrq_rate_locked')}",
                      f"/{EMC}/rate {read_text(self.root, f'{EMC}/rate')}"]
        if paths.fan_pwm is not None:
            lines.append(f"/{paths.fan_pwm}/pwm1 {read_text(self.root, f'{paths.fan_pwm}/pwm1')}")
        path.write_text("\n".join(lines) + "\n")

    def _restore(self, path: Path) -> None:
        for line in path.read_text().splitlines():
            file, value = line.split()
            if file.endswith("mrq_rate_locked"):
                continue  # the real tool leaves the EMC locked [FX]
            try:
                self.writer.write(_rel(file), value)
            except OSError as exc:
                if exc.errno != errno.EBUSY:  # a cluster taken offline since the store
                    raise

    def _show(self) -> str:
        paths = discover(self.root)
        lines = []
        for policy in paths.cpu:
            low, high = (read_text(self.root, f"{policy.path}/{n}")
                         for n in ("scaling_min_freq", "scaling_max_freq"))
            cur = read_text(self.root, f"{policy.path}/scaling_cur_freq")
            lines.append(f"{policy.path.rsplit('/', 1)[1]}:  Governor=schedutil "
                         f"MinFreq={low} MaxFreq={high} CurrentFreq={cur}")
        if paths.gpu is not None:
            values = [read_text(self.root, f"{paths.gpu.freq_dir}/{n}")
                      for n in ("min_freq", "max_freq", "cur_freq")]
            lines.append("GPU MinFreq={} MaxFreq={} CurrentFreq={}".format(*values))
        if paths.emc is not None:
            values = [read_text(self.root, f"{EMC}/{n}") for n in ("min_rate", "max_rate",
                                                                    "rate")]
            lines.append("EMC MinFreq={} MaxFreq={} CurrentFreq={}".format(*values))
        return "\n".join(lines) + "\n"


__all__ = ["FakeCommands"]
