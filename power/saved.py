"""The board's settings saved at start, so that they are put back after a crash.

If a snapshot is still on disk at start, the previous run did not stop cleanly (a kill, a power
cut, an OOM kill) and the board may still carry its governed limits, so that snapshot is restored
first; otherwise the board's settings as they are now are saved. On a clean stop they are
restored and the file removed. The controller (``power/controller.py``) does this in its
``start``/``stop`` through :class:`SavedSnapshot`'s ``load``, ``save`` and ``clear``;
:func:`begin` and :func:`end` are the same sequence for a caller driving a board without it
(stricter: :func:`begin` raises when the crash restore is not complete). The file is written
atomically (written, fsynced, renamed, its folder fsynced: ``agent/fsutil.py``), so a crash while
saving leaves the old copy or the new one, never half of one. A copy that cannot be read back
(a disk fault, a hand edit) is moved aside to ``<name>.damaged`` as the error is raised, so it
fails one start, not every one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from agent.errors import PowerError
from agent.fsutil import atomic_write_text, fsync_dir
from power.types import ApplyResult, BoardControl

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 20


class SavedSnapshot:
    """A board snapshot kept in ``path`` (e.g. ``/var/lib/edge-agent/power-snapshot.json``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def save(self, snapshot: dict[str, Any]) -> None:
        document = {"saved_at": time.time(), "pid": os.getpid(), "snapshot": snapshot}
        atomic_write_text(self.path, json.dumps(document, sort_keys=True) + "\n", mode=0o600)

    def load(self) -> dict[str, Any] | None:
        """The saved snapshot, or ``None`` when there is none (the last run stopped cleanly)."""
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise PowerError("cannot read the saved board settings", path=str(self.path),
                             reason=exc.strerror) from exc
        try:
            if len(data) > MAX_BYTES:
                raise ValueError("larger than 1 MiB")
            document = json.loads(data)
            snapshot = document["snapshot"]
            if not isinstance(snapshot, dict):
                raise TypeError("'snapshot' is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            moved = self.discard()
            raise PowerError("the saved board settings are not readable (moved aside: the next "
                             "start saves the board as it is then)", path=str(self.path),
                             moved_to=moved, reason=str(exc)[:200]) from exc
        return snapshot

    def discard(self) -> str | None:
        """Move the file aside to ``<name>.damaged`` (replacing an older one), for a copy that
        can never be restored: left in place it would fail every start and need a person on
        the board. Returns where it went, ``None`` when it could not be moved."""
        target = self.path.with_name(self.path.name + ".damaged")
        try:
            os.replace(self.path, target)
            fsync_dir(self.path.parent)
        except OSError as exc:
            log.error("cannot move the unusable %s aside: %s", self.path, exc.strerror)
            return None
        log.error("moved the unusable saved board settings to %s", target)
        return str(target)

    def clear(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path.parent)


def begin(board: BoardControl, saved: SavedSnapshot) -> ApplyResult | None:
    """Restore what a crashed run left behind (if anything), then save the board's settings.

    Returns the crash restore's result, ``None`` when there was nothing to restore. When the
    restore does not fully succeed the old file is kept (the next start tries again) and
    PowerError is raised: governing on top of a half-restored board would save the wrong
    settings as the original ones."""
    result = None
    leftover = saved.load()
    if leftover is not None:
        log.warning("the last run did not stop cleanly: restoring the board's settings saved "
                    "in %s", saved.path)
        result = board.restore(leftover)
        if result.mismatches or result.unsupported:
            raise PowerError("could not restore the board's settings after a crash",
                             path=str(saved.path),
                             mismatches=", ".join(m.path for m in result.mismatches) or None,
                             unsupported="; ".join(result.unsupported) or None)
    saved.save(board.snapshot())
    return result


def end(board: BoardControl, saved: SavedSnapshot) -> ApplyResult | None:
    """On a clean stop: put the saved settings back and remove the file (kept if the restore did
    not fully succeed, so the next start retries)."""
    snapshot = saved.load()
    if snapshot is None:
        return None
    result = board.restore(snapshot)
    if result.ok and not result.unsupported:
        saved.clear()
    else:
        log.warning("board settings not fully restored (kept %s for the next start): %s",
                    saved.path, "; ".join([*(m.path for m in result.mismatches),
                                           *result.unsupported]))
    return result


__all__ = ["SavedSnapshot", "begin", "end"]
