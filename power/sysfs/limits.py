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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from power.io import Writer, read_int
from power.types import Mismatch

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class LimitPair:
    """Two files holding a lower and an upper clock limit in the same unit."""

    min_path: str
    max_path: str
    floor: int  # the lowest value the minimum may always take (the table's first entry)

    def read(self, root: Path) -> tuple[int, int]:
        return _read(root, self.min_path), _read(root, self.max_path)

    def read_known(self, root: Path) -> tuple[int | None, int | None]:
        """The two limits, each ``None`` where its file cannot be read as a number."""
        found: list[int | None] = []
        for path in (self.min_path, self.max_path):
            try:
                found.append(read_int(root, path))
            except (OSError, ValueError):
                found.append(None)
        return found[0], found[1]

    def set(self, root: Path, writer: Writer, new_min: int | None, new_max: int | None
            ) -> tuple[int, list[Mismatch]]:
        """Write ``new_min``/``new_max`` (``new_min <= new_max``, checked by the caller; None:
        leave that one) and read them back. Returns (files written, mismatches).

        One file that cannot be read or written (gone, a directory in its place, a refused
        value) does not stop the other from being written: the first such error is raised
        after both were tried (OSError or ValueError, naming its file in ``filename``)."""
        errors: list[OSError | ValueError] = []

        def attempt(path: str, action: Callable[[], _T]) -> _T | None:
            try:
                return action()
            except OSError as exc:
                if exc.filename is None:  # os.read's EISDIR names no file
                    exc.filename = path
                errors.append(exc)
            except ValueError as exc:
                errors.append(exc)
            return None

        def write(path: str, value: int) -> bool:
            def action() -> bool:
                writer.write(path, str(value))
                return True
            return attempt(path, action) is True

        cur_min = attempt(self.min_path, lambda: read_int(root, self.min_path))
        cur_max = attempt(self.max_path, lambda: read_int(root, self.max_path))
        min_readable = cur_min is not None
        writes = 0
        if new_max is not None and cur_min is not None and new_max < cur_min and \
                cur_min != self.floor and write(self.min_path, self.floor):
            cur_min = self.floor
            writes += 1
        if new_max is not None and new_max != cur_max:
            if write(self.max_path, new_max):
                writes += 1
            if min_readable:
                # 5.10+ keep each request: a minimum shown clamped under the old cap (someone
                # else lowered it) comes back with a higher one, so look again before skipping
                # the write.
                cur_min = attempt(self.min_path, lambda: read_int(root, self.min_path))
        if new_min is not None and new_min != cur_min and write(self.min_path, new_min):
            writes += 1
        if errors:
            raise errors[0]
        return writes, self.check(root, new_min, new_max)

    def check(self, root: Path, new_min: int | None, new_max: int | None) -> list[Mismatch]:
        """What of ``new_min``/``new_max`` (None: not looked at) the files do not hold."""
        found = self.read_known(root)
        return [Mismatch(path=path, wanted=wanted, found=value)
                for path, wanted, value in ((self.min_path, new_min, found[0]),
                                            (self.max_path, new_max, found[1]))
                if wanted is not None and value != wanted]


def _read(root: Path, path: str) -> int:
    """:func:`read_int`, its OSError naming ``path`` where the OS did not (a directory read)."""
    try:
        return read_int(root, path)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path
        raise
