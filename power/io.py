"""The one way the board layer writes a file, and the injectable root every path is relative to.

Every change the board layer makes to a board goes through a :class:`Writer`: the
:class:`FileWriter` here (the agent running as a user allowed to write the files), a privileged
helper's client that forwards each request over a socket (the service packaging), or the
simulator's :class:`~power.sim.kernel.FakeKernel` (the kernel's rules over a fake tree). Reads go
straight to the files through :func:`read_text` under the same root.

**What a writer is asked to write.** Paths are relative to the board's root, with ``/``
separators, no ``..`` and no leading ``/``; values are the text the kernel parses, without a
newline. The board layer produces only these (``<gpu>`` is the GPU's devfreq directory found
through ``sys/class/devfreq``, ``<gpudev>`` its device directory, ``<policy>`` each
``sys/devices/system/cpu/cpufreq/policyN``, ``<emc>`` ``sys/kernel/debug/bpmp/debug/clk/emc``):

==================================  ==============================================================
``<gpu>/min_freq``, ``max_freq``    a decimal integer in Hz, within the GPU's frequency table
``<policy>/scaling_min_freq``,      a decimal integer in kHz, within that policy's
``<policy>/scaling_max_freq``       ``scaling_available_frequencies`` (or cpuinfo min..max)
``<emc>/mrq_rate_locked``           ``0`` or ``1``
``<emc>/rate``                      a decimal integer in Hz, one of debugfs ``possible_rates``
``<gpudev>/railgate_enable``        ``0`` or ``1``
``<gpudev>/power/control``          ``auto`` or ``on`` (rail-gating where railgate_enable is absent)
``<gpudev>/railgate_delay``         a decimal integer in ms, 0..60000 (the idle time before the
                                    rail is gated); ``<gpudev>/power/autosuspend_delay_ms`` where
                                    railgate_delay is absent (power/sysfs/railgate.py: ASSUMPTION)
==================================  ==============================================================

:func:`allowed_writes` lists exactly these for a board tree, each with the :class:`WriteRule` its
value must pass, so a privileged helper can refuse anything else.

**Errors.** A writer raises :class:`OSError` as the kernel does (``PermissionError`` for a
read-only or root-only file, ``FileNotFoundError`` for a missing one, ``EINVAL`` for a value the
kernel refuses) and :class:`~agent.errors.PowerError` for a request outside its rules. The caller
(:class:`~power.board.Board`) turns either into a mismatch or a degraded capability.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from agent.errors import PowerError

RAILGATE_DELAY_MAX_MS = 60000  # the longest GPU rail-gate delay the board layer writes (a minute)


class Writer(Protocol):
    """Writes ``value`` into the file ``relpath`` under the board's root."""

    def write(self, relpath: str, value: str) -> None: ...


def check_relpath(relpath: str) -> str:
    """``relpath`` if it is a plain relative path inside the root, else a :class:`PowerError`."""
    pure = PurePosixPath(relpath)
    if (not relpath or pure.is_absolute() or ".." in pure.parts or "\\" in relpath
            or "\0" in relpath or str(pure) != relpath):
        raise PowerError("a board file's path must be relative to the board's root, without '..'",
                         path=relpath)
    return relpath


def check_value(value: str) -> str:
    if not value or len(value) > 32 or not value.isascii() or not value.isprintable() or \
            value != value.strip():
        raise PowerError("a board file's value must be a short ASCII word or number without "
                         "spaces around it or a newline", value=value)
    return value


class FileWriter:
    """Writes the files themselves under ``root`` (``/`` on a board).

    A file is opened without ``O_CREAT``: a sysfs attribute that does not exist cannot be made by
    writing it, and a typo in a path must fail rather than leave a stray file in a fake tree.
    ``rules``: when given (a privileged helper), every write must pass :func:`allowed_writes`'s
    rule for its path.
    """

    def __init__(self, root: Path, *, rules: dict[str, WriteRule] | None = None) -> None:
        self.root = Path(root)
        self._root = os.fspath(self.root)
        self.rules = rules
        self._checked: set[str] = set()

    def write(self, relpath: str, value: str) -> None:
        if relpath not in self._checked:  # the same few paths every step: check each once
            check_relpath(relpath)
            self._checked.add(relpath)
        check_value(value)
        if self.rules is not None:
            rule = self.rules.get(relpath)
            if rule is None:
                raise PowerError("this file is not one the board layer writes", path=relpath)
            reason = rule.check(value)
            if reason is not None:
                raise PowerError("value refused for this file", path=relpath, value=value,
                                 reason=reason)
        fd = os.open(f"{self._root}/{relpath}", os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode("ascii"))
        finally:
            os.close(fd)


def read_text(root: Path, relpath: str) -> str:
    """A board file's content, stripped of whitespace and device-tree NULs. Raises OSError.

    Plain ``os`` calls on a joined string: the governor reads a few dozen files every step, and
    pathlib's joins cost more than the reads themselves."""
    fd = os.open(f"{os.fspath(root)}/{relpath}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip().strip("\0").strip()


def read_int(root: Path, relpath: str) -> int:
    """A board file holding one integer (its first word). Raises OSError, or ValueError for
    other content, an empty file included (a read can come back empty while a driver updates)."""
    words = read_text(root, relpath).split()
    if not words or not words[0].isascii():
        raise ValueError(f"{relpath}: not an integer: {' '.join(words)[:40]!r}")
    return int(words[0])


@dataclass(frozen=True, kw_only=True)
class WriteRule:
    """The values one file may be given: integers in ``low..high`` (and, when ``values`` is not
    empty, one of them), or one of the words in ``words``."""

    what: str  # "gpu_min_hz" ...: what the file controls, in the board layer's words
    low: int | None = None
    high: int | None = None
    values: frozenset[int] = frozenset()
    words: frozenset[str] = frozenset()

    def check(self, value: str) -> str | None:
        """``None`` when ``value`` is allowed, else why not."""
        if self.words:
            return None if value in self.words else f"expected one of {sorted(self.words)}"
        if not (value.isascii() and value.isdigit()):  # "²".isdigit() is true, int("²") fails
            return "expected a decimal integer"
        number = int(value)
        if self.low is not None and number < self.low or self.high is not None and number > \
                self.high:
            return f"outside {self.low}..{self.high}"
        if self.values and number not in self.values:
            return "not one of the rates this board accepts"
        return None


def allowed_writes(root: Path) -> dict[str, WriteRule]:
    """Every file the board layer may write under ``root``, with the rule for its values; read
    from the board's own files (its GPU, CPU and EMC tables), so a helper running as root can
    refuse any other request. Controls the board lacks are simply absent."""
    # Imported here: the discovery needs this module's readers.
    from power.sysfs.discover import discover

    paths = discover(Path(root))
    rules: dict[str, WriteRule] = {}
    if paths.gpu is not None and paths.gpu.table_hz:
        low, high = paths.gpu.table_hz[0], paths.gpu.table_hz[-1]
        rules[f"{paths.gpu.freq_dir}/min_freq"] = WriteRule(what="gpu_min_hz", low=low, high=high)
        rules[f"{paths.gpu.freq_dir}/max_freq"] = WriteRule(what="gpu_max_hz", low=low, high=high)
    if paths.gpu is not None and paths.gpu.railgate_file is not None:
        words = {"0", "1"} if paths.gpu.railgate_file.endswith("railgate_enable") \
            else {"auto", "on"}
        rules[paths.gpu.railgate_file] = WriteRule(what="gpu_railgate", words=frozenset(words))
    if paths.gpu is not None and paths.gpu.railgate_delay_file is not None:
        rules[paths.gpu.railgate_delay_file] = WriteRule(what="gpu_railgate_delay_ms", low=0,
                                                         high=RAILGATE_DELAY_MAX_MS)
    for policy in paths.cpu:
        if policy.table_khz:
            low, high = policy.table_khz[0], policy.table_khz[-1]
            rules[f"{policy.path}/scaling_min_freq"] = WriteRule(what="cpu_min_khz", low=low,
                                                                 high=high)
            rules[f"{policy.path}/scaling_max_freq"] = WriteRule(what="cpu_max_khz", low=low,
                                                                 high=high)
    if paths.emc is not None and paths.emc.rates_hz:
        rules[f"{paths.emc.path}/mrq_rate_locked"] = WriteRule(what="emc_lock",
                                                               words=frozenset({"0", "1"}))
        rules[f"{paths.emc.path}/rate"] = WriteRule(what="emc_hz",
                                                    values=frozenset(paths.emc.rates_hz))
    return rules


__all__ = ["FileWriter", "WriteRule", "Writer", "allowed_writes", "check_relpath", "read_int",
           "read_text"]
