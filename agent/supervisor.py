"""The daemon's background tasks: started once the model serves, stopped in a defined order,
and never allowed to die silently.

The updater, the MQTT control plane, the power governor and the systemd watchdog each run as one
such task: a coroutine that runs until it is cancelled. :class:`Supervisor` starts them in the
order they were added, after the model serves, and on shutdown cancels them in the reverse order
(the last one started stops first), each given ``stop_timeout_s`` to finish, before the HTTP
listener closes. A task that raises, or returns while the daemon still runs, is logged with its
traceback and reported (:class:`TaskStatus`, and the ``on_change`` callback, which the daemon
turns into metrics); a ``critical`` one's failure stops the daemon, whose exit then says why.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from agent.errors import InternalError, first_line

log = logging.getLogger(__name__)

TaskFactory = Callable[[], Coroutine[Any, Any, None]]


class TaskState(enum.Enum):
    PENDING = "pending"  # added, not started
    RUNNING = "running"
    STOPPED = "stopped"  # cancelled by the supervisor at shutdown
    FAILED = "failed"  # raised, or returned by itself while it should run


@dataclass(frozen=True)
class TaskStatus:
    name: str
    critical: bool
    state: TaskState
    error: str | None = None  # the failure, in one line

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "critical": self.critical, "state": self.state.value,
                "error": self.error}


@dataclass(eq=False)
class _Entry:
    name: str
    factory: TaskFactory
    critical: bool
    state: TaskState = TaskState.PENDING
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None


class Supervisor:
    """Runs the daemon's background tasks.

    Args:
        on_change: Called on the event loop with a task's new status whenever it changes (and the
            exception, for a failure). The daemon stops itself when a critical task fails.
        stop_timeout_s: How long each task may take to finish once cancelled.
    """

    def __init__(self, *, on_change: Callable[[TaskStatus, BaseException | None], None]
                 | None = None, stop_timeout_s: float = 10.0) -> None:
        self._entries: list[_Entry] = []
        self._on_change = on_change
        self._stop_timeout_s = stop_timeout_s
        self._started = False
        self._stopping = False

    def add(self, name: str, run: TaskFactory, *, critical: bool = False) -> None:
        """Register a task, to be started with the others by :meth:`start`.

        Args:
            name: Unique, for logs, status and metrics (``updater``, ``power``).
            run: Makes the task's coroutine; it should run until cancelled.
            critical: Its failure stops the daemon (the systemd watchdog, say); otherwise the
                failure is logged and reported and the model goes on serving.
        """
        if self._started:
            raise InternalError(f"background task {name!r} added after the tasks started")
        if any(entry.name == name for entry in self._entries):
            raise InternalError(f"two background tasks are named {name!r}")
        self._entries.append(_Entry(name, run, critical))

    def start(self) -> None:
        """Start every task, in the order added (call on the event loop)."""
        if self._started:
            raise InternalError("the background tasks were started twice")
        self._started = True
        loop = asyncio.get_running_loop()
        for entry in self._entries:
            try:
                coroutine = entry.factory()
            except Exception as exc:  # noqa: BLE001 - its setup failed: the others still start
                self._failed(entry, exc)
                continue
            entry.task = loop.create_task(coroutine, name=f"task-{entry.name}")
            entry.task.add_done_callback(functools.partial(self._ended, entry))
            self._change(entry, TaskState.RUNNING)
            log.info("background task %s started", entry.name)

    async def stop(self) -> None:
        """Cancel the running tasks, the last started first, each awaited for at most
        ``stop_timeout_s``; one that does not finish by then is logged and left behind."""
        self._stopping = True
        for entry in reversed(self._entries):
            task = entry.task
            if task is None or task.done():
                continue
            task.cancel()
            await asyncio.wait({task}, timeout=self._stop_timeout_s)
            if not task.done():
                log.error("background task %s did not stop within %.1f s of being cancelled",
                          entry.name, self._stop_timeout_s)

    def status(self) -> list[TaskStatus]:
        """Every task's status, in the order added."""
        return [self._status(entry) for entry in self._entries]

    def _ended(self, entry: _Entry, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            if self._stopping:
                self._change(entry, TaskState.STOPPED)
                log.info("background task %s stopped", entry.name)
                return
            error: BaseException = InternalError("cancelled by something other than the "
                                                 "supervisor")
        else:
            raised = task.exception()
            if raised is None and self._stopping:  # it finished as it was stopped
                self._change(entry, TaskState.STOPPED)
                return
            error = raised or InternalError("returned while the daemon still runs")
        self._failed(entry, error)

    def _failed(self, entry: _Entry, error: BaseException) -> None:
        entry.error = error
        critical = entry.critical and not self._stopping
        log.error("background task %s failed%s: %s", entry.name,
                  " (critical: the daemon stops)" if critical else "", first_line(error),
                  exc_info=error if not isinstance(error, InternalError) else None)
        self._change(entry, TaskState.FAILED, error)

    def _change(self, entry: _Entry, state: TaskState,
                error: BaseException | None = None) -> None:
        entry.state = state
        if self._on_change is not None:
            try:
                self._on_change(self._status(entry), error)
            except Exception:  # noqa: BLE001 - a broken listener must not hide the change
                log.exception("background task status listener failed")

    @staticmethod
    def _status(entry: _Entry) -> TaskStatus:
        return TaskStatus(entry.name, entry.critical, entry.state,
                          first_line(entry.error) if entry.error is not None else None)
