"""The fan: its PWM duty (0-255, the ``pwmfan`` hwmon) and speed (rpm, the ``pwm_tach`` hwmon).

Read only: nvfancontrol owns the fan, and writing ``pwm1`` behind its back fights it.
"""

from __future__ import annotations

from pathlib import Path

from power.io import read_int


class Fan:
    def __init__(self, root: Path, pwm_dir: str | None, tach_dir: str | None) -> None:
        self.root = root
        self.pwm_path = None if pwm_dir is None else f"{pwm_dir}/pwm1"
        self.rpm_path = None if tach_dir is None else f"{tach_dir}/rpm"

    def pwm(self) -> int | None:
        return self._read(self.pwm_path)

    def rpm(self) -> int | None:
        return self._read(self.rpm_path)

    def _read(self, path: str | None) -> int | None:
        if path is None:
            return None
        try:
            return read_int(self.root, path)
        except (OSError, ValueError):
            return None
