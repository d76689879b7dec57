"""Setting a minimum/maximum pair of clock limits in an order every kernel accepts.

Kernel 4.9 (JetPack 4) refuses a minimum above the maximum, and a maximum below the minimum, with
``EINVAL``; 5.10 and later (JetPack 5+) clamp the minimum to the maximum instead, silently. The
sequence here never asks either for an inverted pair: when the new maximum is below the current
minimum, the minimum is first floored (written to the table's lowest entry), then the maximum is
set, then the minimum. A limit already at its value is not written again (writes stay idempotent
and cheap; the minimum is looked at again after a new maximum, which a 5.10+ kernel may have
lifted it with), and both are read back: what did not stick is a :class:`~power.types.Mismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from power.io import Writer, read_int
from power.types import Mismatch


@dataclass(frozen=True, kw_only=True)
class LimitPair:
    """Two files holding a lower and an upper clock limit in the same unit."""

    min_path: str
    max_path: str
    floor: int  # the lowest value the minimum may always take (the table's first entry)

    def read(self, root: Path) -> tuple[int, int]:
        return read_int(root, self.min_path), read_int(root, self.max_path)

    def set(self, root: Path, writer: Writer, new_min: int, new_max: int
            ) -> tuple[int, list[Mismatch]]:
        """Write ``new_min``/``new_max`` (``new_min <= new_max``, checked by the caller) and read
        them back. Returns (files written, mismatches). Raises OSError from the writer."""
        cur_min, cur_max = self.read(root)
        writes = 0
        if new_max < cur_min and cur_min != self.floor:
            writer.write(self.min_path, str(self.floor))
            cur_min = self.floor
            writes += 1
        if new_max != cur_max:
            writer.write(self.max_path, str(new_max))
            writes += 1
            # 5.10+ keep each request: a minimum shown clamped under the old cap (someone else
            # lowered it) comes back with a higher one, so look again before skipping the write.
            cur_min = read_int(root, self.min_path)
        if new_min != cur_min:
            writer.write(self.min_path, str(new_min))
            writes += 1
        return writes, self.check(root, new_min, new_max)

    def check(self, root: Path, new_min: int, new_max: int) -> list[Mismatch]:
        found: list[int | None] = []
        for path in (self.min_path, self.max_path):
            try:
                found.append(read_int(root, path))
            except (OSError, ValueError):
                found.append(None)
        return [Mismatch(path=path, wanted=wanted, found=value)
                for path, wanted, value in ((self.min_path, new_min, found[0]),
                                            (self.max_path, new_max, found[1]))
                if value != wanted]
