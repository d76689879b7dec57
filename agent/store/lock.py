"""One owner per state directory: an exclusive ``flock`` on ``state_dir/lock``.

A second daemon (or a control command) on the same directory is refused, with the owner's pid,
instead of racing this one's installs and clean-ups. Stores opened twice in one process share
the lock. A read-only disk is locked without writing the pid; a directory whose lock file cannot
be opened at all is used unguarded, with a warning.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
from pathlib import Path

from agent.errors import StoreError

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
_held: dict[str, list[int]] = {}  # real path -> [fd, users]
_held_guard = threading.Lock()


def lock_state_dir(state_dir: Path) -> str:
    """Take the state directory's lock; returns the key :func:`unlock_state_dir` takes.

    Raises:
        StoreError: another process holds it (``pid`` names it), or it cannot be taken.
    """
    key = os.path.realpath(state_dir)
    path = os.path.join(key, LOCK_FILE)
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            return key
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            writable = True
        except OSError as first:
            try:  # a read-only disk: lock what is there, write nothing
                fd, writable = os.open(path, os.O_RDONLY), False
            except OSError:
                # The first failure says why (permission denied), not the fallback's (no file).
                log.warning("cannot lock the state directory (%s); not guarding it",
                            first.strerror)
                _held[key] = [-1, 1]
                return key
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise StoreError("the state directory is in use by another edge-agent process",
                                 path=key, pid=holder) from None
            raise StoreError("cannot lock the state directory", path=key,
                             reason=exc.strerror) from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = [fd, 1]
    return key


def unlock_state_dir(key: str) -> None:
    """Release one use of the lock; the last one closes it (which releases the flock)."""
    with _held_guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            if entry[0] >= 0:
                os.close(entry[0])


def remove_store(state_dir: Path) -> None:
    """Delete a model store's state directory (nothing when there is none), under its lock.

    Raises:
        StoreError: another edge-agent process holds the directory (``pid`` names it), or its
            lock cannot be taken.
    """
    if not Path(state_dir).is_dir():
        return
    key = lock_state_dir(Path(state_dir))
    try:
        shutil.rmtree(state_dir, ignore_errors=True)
    finally:
        unlock_state_dir(key)
