"""jetson_clocks through an injectable runner: pin the clocks at the mode's maximums, store the
settings to a file and restore them.

The board layer does not use jetson_clocks to govern (it writes the limits itself, reading each
back); this wrapper is for operators and for the benchmark's "jetson_clocks" baseline. Its
``--restore`` may leave the EMC locked (``mrq_rate_locked=1``), so the board's own restore unlocks
it afterwards.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import PowerError
from power.commands import CommandRunner


class JetsonClocks:
    def __init__(self, runner: CommandRunner, *, command: str = "jetson_clocks") -> None:
        self.runner = runner
        self.command = command

    def _run(self, *args: str) -> str:
        result = self.runner.run([self.command, *args], timeout_s=60.0)
        if result.returncode != 0:
            raise PowerError("jetson_clocks failed", args=" ".join(args) or None,
                             code=result.returncode, output=result.output.strip()[:300])
        return result.stdout

    def pin(self) -> None:
        self._run()

    def show(self) -> str:
        return self._run("--show")

    def store(self, path: Path) -> None:
        self._run("--store", str(path))

    def restore(self, path: Path) -> None:
        if not Path(path).is_file():
            raise PowerError("no jetson_clocks settings stored there", path=str(path))
        self._run("--restore", str(path))


__all__ = ["JetsonClocks"]
