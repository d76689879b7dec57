"""nvpmodel: its configuration (parsed), the mode in force (queried) and mode changes (set).

The configuration grammar (``/etc/nvpmodel.conf``, a link to
``/etc/nvpmodel/nvpmodel_<board>.conf``):
``< PARAM TYPE=FILE|CLOCK NAME=X >`` sections map an argument to a file (``CORE_0 /sys/...``,
``MAX_FREQ /sys/...``); ``< POWER_MODEL ID=n NAME=s >`` blocks hold ``PARAM ARG value`` lines;
``< PM_CONFIG DEFAULT=n >`` names the default mode. Units as in the files (CPU kHz, GPU and EMC Hz);
``-1`` or ``2147483647`` (and an EMC ``MAX_FREQ`` of 0) mean no cap.

nvpmodel is known to misreport (a switch that needs a reboot fails silently and ``-q`` keeps the
old mode, ``docs/reference/power_anchors.md`` section 4): :meth:`Nvpmodel.set_mode` checks the
state file after the switch (it runs no ``-q``: the file is what ``-q`` reports), and the board
reads every clock back. A tool that is not installed or is refused for want of root raises
:class:`NvpmodelUnavailable`: that will not go away by itself, so the board stops asking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import PowerError
from power.commands import NOT_FOUND, CommandRunner
from power.io import read_text

CONF = "etc/nvpmodel.conf"
STATUS = "var/lib/nvpmodel/status"
NO_CAP = frozenset({-1, 2147483647, 9223372036854775807})

_HEADER = re.compile(r"^<\s*(\w+)((?:\s+\w+=\S+)*)\s*>$")


@dataclass(frozen=True, kw_only=True)
class Param:
    kind: str  # FILE or CLOCK
    name: str
    paths: dict[str, str]  # argument -> file (absolute, as in the conf)


@dataclass(frozen=True, kw_only=True)
class ConfMode:
    mode_id: int
    name: str
    # (param, argument, value) in file order; a value is an integer (a frequency, a flag, a mask)
    # or a word (GPU_POWER_CONTROL's "on"/"auto")
    settings: tuple[tuple[str, str, int | str], ...]

    def value(self, param: str, argument: str) -> int | str | None:
        for name, arg, value in self.settings:
            if name == param and arg == argument:
                return value
        return None

    def cap(self, param: str) -> int | None:
        """The MAX_FREQ ``param`` gets in this mode; None when uncapped or not set."""
        value = self.value(param, "MAX_FREQ")
        if not isinstance(value, int) or value in NO_CAP or value == 0 and param.startswith("EMC"):
            return None
        return value


@dataclass(frozen=True, kw_only=True)
class NvpmodelConf:
    params: dict[str, Param]
    modes: tuple[ConfMode, ...]
    default_mode: int
    source: str = ""
    warnings: tuple[str, ...] = field(default=())

    def mode(self, mode_id: int) -> ConfMode:
        for mode in self.modes:
            if mode.mode_id == mode_id:
                return mode
        raise PowerError("no such nvpmodel mode", mode=mode_id, conf=self.source or None,
                         modes=", ".join(f"{m.mode_id}={m.name}" for m in self.modes))


class NvpmodelUnavailable(PowerError):
    """nvpmodel cannot change the mode here at all (not installed, or not run as root)."""


def parse_conf(text: str, source: str = "") -> NvpmodelConf:
    """Parse an nvpmodel configuration. Raises PowerError naming the line that is malformed."""
    params: dict[str, Param] = {}
    modes: list[ConfMode] = []
    default: int | None = None
    section: tuple[str, dict[str, str]] | None = None
    settings: list[tuple[str, str, int | str]] = []

    def finish() -> None:
        if section is not None and section[0] == "POWER_MODEL":
            attrs = section[1]
            modes.append(ConfMode(mode_id=int(attrs["ID"]), name=attrs["NAME"],
                                  settings=tuple(settings)))

    # A byte-order mark from an editor would make the first header "a line before any section".
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue

        def bad(why: str, line_no: int = number, content: str = raw) -> PowerError:
            return PowerError(f"malformed nvpmodel configuration: {why}", conf=source or None,
                              line=line_no, text=content.strip())

        if line.startswith("<"):
            match = _HEADER.match(line)
            if match is None:
                raise bad("a section header must read '< KIND KEY=VALUE ... >'")
            kind = match.group(1)
            attrs = dict(pair.split("=", 1) for pair in match.group(2).split())
            finish()
            settings = []
            if kind == "PARAM":
                if "NAME" not in attrs or "TYPE" not in attrs:
                    raise bad("a PARAM needs TYPE= and NAME=")
                params[attrs["NAME"]] = Param(kind=attrs["TYPE"], name=attrs["NAME"], paths={})
            elif kind == "POWER_MODEL":
                if "NAME" not in attrs or not attrs.get("ID", "").isdigit():
                    raise bad("a POWER_MODEL needs a numeric ID= and a NAME=")
                if any(mode.mode_id == int(attrs["ID"]) for mode in modes):
                    raise bad("a second POWER_MODEL with this ID")
            elif kind == "PM_CONFIG":
                if not attrs.get("DEFAULT", "").isdigit():
                    raise bad("PM_CONFIG needs a numeric DEFAULT=")
                default = int(attrs["DEFAULT"])
            # Other sections (FAN_CONFIG on some releases) are skipped with their contents.
            section = (kind, attrs)
            continue
        words = line.split()
        if section is None:
            raise bad("a line before any section")
        kind, attrs = section
        if kind == "PARAM":
            if len(words) != 2:
                raise bad("a PARAM line must be 'ARGUMENT /path'")
            params[attrs["NAME"]].paths[words[0]] = words[1]
        elif kind == "POWER_MODEL":
            if len(words) != 3:
                raise bad("a POWER_MODEL line must be 'PARAM ARGUMENT value'")
            if words[0] not in params:
                raise bad(f"POWER_MODEL uses the undeclared PARAM {words[0]}")
            param = params[words[0]]
            is_number = re.fullmatch(r"-?\d+", words[2]) is not None
            if param.kind == "CLOCK" and not is_number:
                raise bad(f"{words[0]} {words[1]} needs an integer frequency")
            settings.append((words[0], words[1], int(words[2]) if is_number else words[2]))
    finish()
    if default is None:
        raise PowerError("malformed nvpmodel configuration: no '< PM_CONFIG DEFAULT=n >' line",
                         conf=source or None)
    if not modes:
        raise PowerError("malformed nvpmodel configuration: no POWER_MODEL", conf=source or None)
    if all(mode.mode_id != default for mode in modes):
        raise PowerError("nvpmodel configuration's default mode is not one of its modes",
                         conf=source or None, default=default)
    return NvpmodelConf(params=params, modes=tuple(modes), default_mode=default, source=source)


def read_status(root: Path) -> int | None:
    """The mode nvpmodel last set, from ``/var/lib/nvpmodel/status`` (``pmode:0002 ...``)."""
    try:
        match = re.search(r"pmode:(\d+)", read_text(root, STATUS))
    except OSError:
        return None
    return int(match.group(1)) if match else None


def parse_query(output: str) -> tuple[int, str]:
    """``nvpmodel -q``'s mode: the line ``NV Power Mode: NAME`` and the ID on a line of its own
    (warnings such as ``NVPM WARN: fan mode is not set!`` may come first)."""
    name = None
    mode_id = None
    for line in output.splitlines():
        line = line.strip()
        if "NV Power Mode:" in line:
            name = line.split("NV Power Mode:", 1)[1].strip()
        elif line.isdigit() and name is not None and mode_id is None:
            mode_id = int(line)
    if name is None or mode_id is None:
        raise PowerError("could not read the mode from nvpmodel -q's output",
                         output=output.strip()[:300])
    return mode_id, name


class Nvpmodel:
    """nvpmodel on the board under ``root`` (the configuration and status file), run through
    ``runner``."""

    def __init__(self, root: Path, runner: CommandRunner, *, command: str = "nvpmodel") -> None:
        self.root = Path(root)
        self.runner = runner
        self.command = command
        self.conf = parse_conf(read_text(self.root, CONF) + "\n", source=f"/{CONF}")

    def modes(self) -> tuple[tuple[int, str], ...]:
        return tuple((mode.mode_id, mode.name) for mode in self.conf.modes)

    def current(self) -> int | None:
        """The mode in force per the state file: no command run (cheap enough for telemetry)."""
        return read_status(self.root)

    def query(self) -> tuple[int, str]:
        result = self.runner.run([self.command, "-q"], timeout_s=30.0)
        if result.returncode != 0:
            raise PowerError("nvpmodel -q failed", code=result.returncode,
                             output=result.output.strip()[:300])
        return parse_query(result.stdout)

    def set_mode(self, mode_id: int) -> None:
        """Switch to ``mode_id`` and check that the switch happened."""
        self.conf.mode(mode_id)  # an unknown mode is refused before running anything
        result = self.runner.run([self.command, "-m", str(mode_id)], timeout_s=60.0)
        if result.returncode == NOT_FOUND:
            raise NvpmodelUnavailable("nvpmodel is not installed", command=self.command)
        if result.returncode != 0 and "permission denied" in result.output.lower():
            raise NvpmodelUnavailable("nvpmodel needs root to change the mode", mode=mode_id,
                                      output=result.output.strip()[:300])
        if result.returncode != 0 or "NVPM ERROR" in result.output:
            raise PowerError("nvpmodel could not set the mode", mode=mode_id,
                             code=result.returncode, output=result.output.strip()[:300])
        found = self.current()
        if found != mode_id:
            raise PowerError("nvpmodel reported success but the mode did not change (some "
                             "switches need a reboot)", mode=mode_id, found=found)


__all__ = ["ConfMode", "Nvpmodel", "NvpmodelConf", "NvpmodelUnavailable", "Param", "parse_conf",
           "parse_query", "read_status"]
