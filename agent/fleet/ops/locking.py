"""One writer at a time for the operator's files (the artifact index, the devices file, the
broker's password file): an exclusive ``flock`` on a lock file beside them, waited for."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from agent.errors import FleetError

__all__ = ["LOCK_WAIT_S", "locked"]

LOCK_WAIT_S = 30.0
_POLL_S = 0.05


@contextlib.contextmanager
def locked(path: Path, *, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    Raises:
        FleetError: another process held it for ``wait_s``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise FleetError("another edge-agent fleet command holds this lock",
                                     reason="locked", path=path, waited_s=wait_s) from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
