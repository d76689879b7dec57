"""Whether the GPU's rail may be gated when it is idle.

``railgate_enable`` (1/0, root-only) where the kernel has it; otherwise the device's runtime power
management (``power/control``: ``auto`` lets it suspend, ``on`` keeps it powered).
"""

from __future__ import annotations

from pathlib import Path

from power.io import Writer, read_text
from power.types import Mismatch


class GpuRailgate:
    def __init__(self, root: Path, path: str) -> None:
        self.root = root
        self.path = path
        self._words = ("1", "0") if path.endswith("railgate_enable") else ("auto", "on")

    def allowed(self) -> bool | None:
        try:
            return read_text(self.root, self.path) == self._words[0]
        except OSError:
            return None

    def set(self, writer: Writer, allow: bool) -> tuple[int, list[Mismatch]]:
        word = self._words[0] if allow else self._words[1]
        if self.allowed() == allow:
            return 0, []
        writer.write(self.path, word)
        found = self.allowed()
        return 1, [] if found == allow else [Mismatch(
            path=self.path, wanted=word, found=None if found is None else self._words[
                0 if found else 1])]
