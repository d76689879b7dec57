"""Running the board's tools (nvpmodel, jetson_clocks) through an injectable runner.

Production uses :class:`SubprocessRunner`; tests and the simulator pass the strict fakes of
``power/sim/commands.py``, which act on a fake board tree. A runner never raises for a failed
command: it answers a :class:`CommandResult` (a command that is not installed is return code 127),
and the caller decides what a failure means.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

NOT_FOUND = 127
TIMED_OUT = 124


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0) -> CommandResult: ...


class SubprocessRunner:
    """Runs the real commands (nvpmodel and jetson_clocks need root to change anything)."""

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0) -> CommandResult:
        args = tuple(argv)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
        except FileNotFoundError:
            return CommandResult(argv=args, returncode=NOT_FOUND,
                                 stderr=f"{args[0]}: command not found")
        except subprocess.TimeoutExpired:
            log.warning("%s did not finish within %.0f s", args[0], timeout_s)
            return CommandResult(argv=args, returncode=TIMED_OUT,
                                 stderr=f"{args[0]}: timed out after {timeout_s:.0f} s")
        return CommandResult(argv=args, returncode=done.returncode, stdout=done.stdout,
                             stderr=done.stderr)


__all__ = ["CommandResult", "CommandRunner", "SubprocessRunner"]
