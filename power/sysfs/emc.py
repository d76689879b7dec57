"""The memory controller clock (EMC) through BPMP's debugfs: its rate (Hz) and whether it is locked.

Only debugfs can force a rate, so only root can, and only where debugfs is mounted. Locking is
``mrq_rate_locked`` = 1 then ``rate``; BPMP drops a rate that is not in ``possible_rates`` (kHz
there), so the board layer only asks for listed rates and reads the result back. Unlocking
(``mrq_rate_locked`` = 0) hands the rate back to the board's own scaling.
"""

from __future__ import annotations

from pathlib import Path

from power.io import Writer, read_int
from power.sysfs.discover import EmcPaths
from power.types import Mismatch


class Emc:
    def __init__(self, root: Path, paths: EmcPaths) -> None:
        self.root = root
        self.rates_hz = paths.rates_hz
        self.lock_path = f"{paths.path}/mrq_rate_locked"
        self.rate_path = f"{paths.path}/rate"

    def rate_hz(self) -> int | None:
        try:
            return read_int(self.root, self.rate_path)
        except (OSError, ValueError):
            return None

    def locked(self) -> bool:
        return read_int(self.root, self.lock_path) == 1

    def lock(self, writer: Writer, rate_hz: int) -> tuple[int, list[Mismatch]]:
        writes = 0
        if not self.locked():
            writer.write(self.lock_path, "1")
            writes += 1
        if self.rate_hz() != rate_hz:
            writer.write(self.rate_path, str(rate_hz))
            writes += 1
        found = self.rate_hz()
        return writes, [] if found == rate_hz else [Mismatch(path=self.rate_path,
                                                             wanted=rate_hz, found=found)]

    def check(self, rate_hz: int) -> list[Mismatch]:
        """What differs from the EMC locked at ``rate_hz``, read now (after a refused write)."""
        try:
            locked: bool | None = self.locked()
        except (OSError, ValueError):
            locked = None
        mismatches = [] if locked else [Mismatch(path=self.lock_path, wanted=1,
                                                 found=None if locked is None else 0)]
        found = self.rate_hz()
        if found != rate_hz:
            mismatches.append(Mismatch(path=self.rate_path, wanted=rate_hz, found=found))
        return mismatches

    def unlock(self, writer: Writer) -> tuple[int, list[Mismatch]]:
        if not self.locked():
            return 0, []
        writer.write(self.lock_path, "0")
        return 1, [] if not self.locked() else [Mismatch(path=self.lock_path, wanted=0,
                                                            found=1)]
