"""The GPU's devfreq files: its frequency table, limits and current rate (Hz), and its load.

The devfreq directory holds ``available_frequencies``, ``min_freq``, ``max_freq`` and
``cur_freq``; the device directory above it holds ``load`` (per-mille, busy time over the last
window) and ``power/runtime_status`` (``suspended`` while the rail is gated).
"""

from __future__ import annotations

from pathlib import Path

from power.io import read_int, read_text
from power.sysfs.discover import GpuPaths
from power.sysfs.limits import LimitPair


class GpuDevfreq:
    def __init__(self, root: Path, paths: GpuPaths) -> None:
        self.root = root
        self.paths = paths
        self.table_hz = paths.table_hz  # fixed for the board's life: read once at discovery
        floor = self.table_hz[0] if self.table_hz else 0
        self.limits = LimitPair(min_path=f"{paths.freq_dir}/min_freq",
                                max_path=f"{paths.freq_dir}/max_freq", floor=floor)
        self._cur = f"{paths.freq_dir}/cur_freq"
        self._load = f"{paths.device_dir}/load"
        self._status = f"{paths.device_dir}/power/runtime_status"

    def read_limits_hz(self) -> tuple[int, int]:
        return self.limits.read(self.root)

    def cur_freq_hz(self) -> int | None:
        try:
            return read_int(self.root, self._cur)
        except (OSError, ValueError):
            return None

    def load(self) -> float | None:
        """Busy fraction 0..1 (the kernel's per-mille)."""
        try:
            return min(1.0, max(0.0, read_int(self.root, self._load) / 1000.0))
        except (OSError, ValueError):
            return None

    def railgated(self) -> bool | None:
        try:
            return read_text(self.root, self._status) == "suspended"
        except OSError:
            return None
