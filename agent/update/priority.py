"""Low CPU priority for the work of an update, so that it does not take the serving instances' CPU.

Loading a new version (ONNX Runtime session creation, a TensorRT engine build: minutes on a
board) and its warm-up happen on a thread whose nice value is :data:`LOAD_NICE_INCREMENT` above
the daemon's (:class:`LowPriority`); so does the ``update-files`` thread that calls the file
worker process (agent/update/fileworker.py), which runs the download, the bundle's checks and
the writing of its members at the same increment, in a process of its own. (A thread's nice
value does nothing against the GIL: work that holds it at a low priority can even be preempted
while holding it, keeping the serving threads waiting; hence the process for the file work.
Session creation still holds the daemon's GIL.) On Linux the nice value belongs to the thread, and
threads inherit it from the thread that creates them: ONNX Runtime's intra-op pool, made when a
session is created on that thread, runs at the same low priority.

So once the version is committed its threads are set back to the daemon's priority
(:meth:`LowPriority.restore`): the threads that appeared while it loaded, as ``/proc/self/task``
lists them. Raising a priority back needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (the
service unit's ``LimitNICE=``); without either the version keeps serving at the lower priority,
which costs nothing while nothing else competes for the CPU, and a warning says so once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

LOAD_NICE_INCREMENT = 10
TASKS = Path("/proc/self/task")

T = TypeVar("T")

_warned_restore = False


def thread_ids() -> set[int]:
    """The ids of this process's threads (empty where ``/proc`` is not Linux's)."""
    try:
        return {int(entry.name) for entry in TASKS.iterdir() if entry.name.isdigit()}
    except OSError:
        return set()


def thread_nice(tid: int) -> int | None:
    """A thread's nice value, or None once it has ended."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None


def lower_this_thread(increment: int = LOAD_NICE_INCREMENT) -> bool:
    """Lower the calling thread's priority by ``increment`` (a thread of its own, such as a
    download's); False, with a warning, where the system refuses."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:
        log.warning("could not lower the priority of an update's thread: %s", exc)
        return False
    return True


class LowPriority:
    """One worker thread at a lower priority, for one version's load, warm-up and shadow runs.

    Call :meth:`run` (awaitable through ``loop.run_in_executor(self.executor, ...)``) for the
    work, :meth:`restore` when the version is committed, :meth:`close` when done with it.
    """

    def __init__(self, name: str, *, increment: int = LOAD_NICE_INCREMENT) -> None:
        self.base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.increment = increment
        self._before = thread_ids()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name,
                                           initializer=self._lower)
        self.lowered = False
        self._worker: int | None = None

    def _lower(self) -> None:
        self._worker = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           self.base_nice + self.increment)
            self.lowered = True
        except OSError as exc:  # a nice value cannot be too high, but a sandbox may refuse
            log.warning("could not lower the priority of the update's worker thread: %s", exc)

    def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the low-priority thread and wait for it (from another thread)."""
        return self.executor.submit(work).result()

    def new_threads(self) -> set[int]:
        """Threads that appeared since this was made (the version's, and any other made
        meanwhile) and still run below the daemon's priority."""
        found = set()
        for tid in thread_ids() - self._before:
            nice = thread_nice(tid)
            if nice is not None and nice > self.base_nice:
                found.add(tid)
        return found

    def worker_ids(self) -> set[int]:
        """The worker thread's id, once it has started."""
        return set() if self._worker is None else {self._worker}

    def restore(self) -> int:
        """Set the threads this version made back to the daemon's priority; returns how many.
        The worker thread itself stays low; :meth:`close` ends it."""
        global _warned_restore
        restored = 0
        for tid in self.new_threads() - {self._worker}:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.base_nice)
                restored += 1
            except PermissionError:
                if not _warned_restore:
                    _warned_restore = True
                    log.warning("the new version's threads keep a lower CPU priority (raising it "
                                "back needs CAP_SYS_NICE or LimitNICE=+%d in the service unit)",
                                self.base_nice)
                break
            except OSError:
                continue  # the thread ended meanwhile
        return restored

    def close(self) -> None:
        self.executor.shutdown(wait=False)
