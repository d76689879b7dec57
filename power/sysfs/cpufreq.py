"""The CPU clusters' cpufreq policies: one table, a pair of limits and a current rate (kHz) each.

A policy covers the CPUs of one cluster (``related_cpus``); the board layer gives every policy the
same floor and cap, each clamped to that policy's own table.
"""

from __future__ import annotations

from pathlib import Path

from power.io import read_int
from power.sysfs.discover import CpuPolicyPaths
from power.sysfs.limits import LimitPair


class CpuPolicy:
    def __init__(self, root: Path, paths: CpuPolicyPaths) -> None:
        self.root = root
        self.path = paths.path
        self.table_khz = paths.table_khz
        self.limits = LimitPair(min_path=f"{paths.path}/scaling_min_freq",
                                max_path=f"{paths.path}/scaling_max_freq",
                                floor=self.table_khz[0] if self.table_khz else 0)
        self._cur = f"{paths.path}/scaling_cur_freq"

    def read_limits_khz(self) -> tuple[int, int]:
        return self.limits.read(self.root)

    def cur_freq_khz(self) -> int | None:
        try:
            return read_int(self.root, self._cur)
        except (OSError, ValueError):
            return None

    def nearest_khz(self, khz: int) -> int:
        """``khz`` kept within this policy's table range (clusters may offer different tops)."""
        if not self.table_khz:
            return khz
        return min(max(khz, self.table_khz[0]), self.table_khz[-1])
