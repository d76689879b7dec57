"""INA3221 power monitors: each labelled channel's power in mW (bus mV x mA / 1000).

The channels and their labels are read once; channels labelled ``NC`` (not connected) and the
shunt-sum channel 7 are skipped, as jetson-stats does. The total is the rail that measures the
module's input (``VDD_IN``, or ``POM_5V_IN`` on older boards) where there is one, else the sum of
the rails (AGX Orin: that sum misses the carrier board's losses). A total that cannot be read is
``None``: the input rail unreadable is not replaced by the sum of the rails it feeds, and a sum
missing one of its rails is not a total.
"""

from __future__ import annotations

from pathlib import Path

from power.io import read_int, read_text

TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")


class PowerRails:
    def __init__(self, root: Path, monitors: tuple[str, ...]) -> None:
        self.root = root
        self.channels: list[tuple[str, str, str]] = []  # (label, mV file, mA file)
        for hwmon in monitors:
            for channel in (1, 2, 3):
                try:
                    label = read_text(root, f"{hwmon}/in{channel}_label")
                except OSError:
                    continue
                if "NC" in label.split() or label == "NC":
                    continue
                self.channels.append((label, f"{hwmon}/in{channel}_input",
                                      f"{hwmon}/curr{channel}_input"))

    def read_mw(self) -> dict[str, int]:
        rails = {}
        for label, volt_path, curr_path in self.channels:
            try:
                rails[label] = read_int(self.root, volt_path) * read_int(self.root,
                                                                         curr_path) // 1000
            except (OSError, ValueError):
                continue
        return rails

    def total_mw(self, rails: dict[str, int]) -> int | None:
        """The board's input power from one :meth:`read_mw` answer; ``None`` when unreadable."""
        labels = [label for label, _, _ in self.channels]
        for label in TOTAL_RAILS:
            if label in labels:
                return rails.get(label)
        if not labels or any(label not in rails for label in labels):
            return None
        return sum(rails[label] for label in labels)
