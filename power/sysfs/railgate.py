"""Whether the GPU's rail may be gated when it is idle.

``railgate_enable`` (1/0, root-only) where the kernel has it; otherwise the device's runtime power
management (``power/control``: ``auto`` lets it suspend, ``on`` keeps it powered). How long the GPU
must be idle before it is gated: :class:`GpuRailgateDelay`.
"""

from __future__ import annotations

from pathlib import Path

from power.io import Writer, read_int, read_text
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


class GpuRailgateDelay:
    """How long (ms) the GPU stays idle before its rail is gated: nvgpu's ``railgate_delay``
    [NVGPU in power_anchors.md: 500 ms by default on ga10b], else the device's runtime-PM
    ``power/autosuspend_delay_ms``.

    ASSUMPTION: the reference names ``railgate_delay`` (ms) but not its directory; it is taken
    to sit in the GPU's device directory beside ``railgate_enable`` (where the reference lists
    the other nvgpu attributes), and ``power/autosuspend_delay_ms`` (the kernel's runtime-PM
    attribute, ms) to be the same delay where nvgpu's own file is absent (the JetPack 7 layout).
    The value is a decimal integer in ms, read back as written.
    """

    def __init__(self, root: Path, path: str) -> None:
        self.root = root
        self.path = path

    def delay_ms(self) -> int:
        """The delay in force, ms. Raises OSError, or ValueError for a file that is no number."""
        return read_int(self.root, self.path)

    def set(self, writer: Writer, delay_ms: int) -> tuple[int, list[Mismatch]]:
        if self.delay_ms() == delay_ms:
            return 0, []
        writer.write(self.path, str(delay_ms))
        return 1, self.check(delay_ms)

    def check(self, delay_ms: int) -> list[Mismatch]:
        """What differs from ``delay_ms`` now (after a write)."""
        try:
            found: int | None = self.delay_ms()
        except (OSError, ValueError):
            found = None
        return [] if found == delay_ms else [Mismatch(path=self.path, wanted=delay_ms,
                                                       found=found)]
