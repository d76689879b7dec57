"""Talking to systemd when it runs the daemon (``Type=notify``): readiness, status, the watchdog,
reloads and stops, over the datagram socket named by ``$NOTIFY_SOCKET``.

The protocol is sd_notify(3)'s: newline-separated ``KEY=value`` assignments in one datagram on an
``AF_UNIX`` socket, whose address is a file path or, written with a leading ``@``, a name in the
abstract namespace. Without ``$NOTIFY_SOCKET`` (a terminal, a test) every call does nothing. The
socket is non-blocking: when systemd is slow to read and its queue is full the message is dropped
with a warning instead of stalling the event loop (the next ping or status goes out as usual).

What the daemon says, and when (:func:`attach_systemd` and :mod:`agent.run`):

- ``EXTEND_TIMEOUT_USEC`` with a ``STATUS`` line while the start runs: building a TensorRT engine
  takes minutes, longer than any start timeout one would set, so the start asks for more time as
  long as it is making progress;
- ``READY=1`` once the model is loaded and warm and the HTTP API listens;
- ``STATUS=`` whenever what it serves, the update or the power state changes
  (``serving tiny v3; update idle; power active``);
- ``WATCHDOG=1`` every half ``$WATCHDOG_USEC`` from a task on the event loop, only while the
  background tasks run and no batcher holds work it has not moved for :data:`STALL_S`: a loop that
  stalls, a dead task or a wedged backend stops the pings, and systemd kills and restarts the
  service (``WatchdogSec=`` in the unit);
- ``RELOADING=1`` (with ``MONOTONIC_USEC``) on SIGHUP, ``READY=1`` once the reload is applied;
- ``STOPPING=1`` as the stop begins.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.errors import ConfigError

if TYPE_CHECKING:
    from agent.daemon import Daemon

log = logging.getLogger(__name__)

STALL_S = 30.0
"""A batcher with queued or running work and no answer for this long is wedged."""

START_EXTEND_EVERY_S = 20.0
"""While the start runs, ask systemd for this much more time, twice, every this often."""

Probe = Callable[[], "str | None"]
"""A health check: ``None`` when healthy, else why not (in a few words)."""


def notify_address(value: str) -> str | bytes:
    """The socket address ``$NOTIFY_SOCKET`` names: a path, or ``@name`` in the abstract
    namespace (a leading NUL byte in the address).

    Raises:
        ConfigError: neither form (systemd only ever sets these two).
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise ConfigError("NOTIFY_SOCKET is neither an absolute path nor an @abstract name",
                      value=value)


class Notifier:
    """Sends sd_notify messages; every method does nothing when not under systemd.

    Args:
        address: As :func:`notify_address` returns it; ``None`` disables the notifier.
        watchdog_s: The watchdog's timeout (``$WATCHDOG_USEC``), ``None`` when not asked for.
    """

    def __init__(self, address: str | bytes | None, *, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self.sent = 0
        self.dropped = 0
        self._socket: socket.socket | None = None
        if address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *,
                         unset: bool = True) -> Notifier:
        """The notifier ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC``/``$WATCHDOG_PID`` describe.
        With ``unset`` (and the process's own environment) the variables are removed, as
        sd_notify's ``unset_environment`` does, so that child processes (an engine build) do not
        take the daemon's socket for theirs."""
        env = os.environ if environ is None else environ
        value = env.get("NOTIFY_SOCKET", "")
        watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec:
            try:
                watchdog_s = int(usec) / 1e6 if int(usec) > 0 else None
            except ValueError:
                raise ConfigError("WATCHDOG_USEC is not a number of microseconds",
                                  value=usec) from None
            if pid and pid != str(os.getpid()):
                watchdog_s = None  # meant for another process (the one that exec'd us, say)
        if unset and environ is None:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return cls(notify_address(value) if value else None, watchdog_s=watchdog_s)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keyword names as the keys); returns whether it went out."""
        if self._socket is None or self.address is None:
            return False
        text = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            self._socket.sendto(text.encode(), self.address)
        except (BlockingIOError, InterruptedError):
            self.dropped += 1
            log.warning("systemd's notification socket is full: dropped %s",
                        ", ".join(fields))
            return False
        except OSError as exc:
            # ECONNREFUSED / ENOENT: systemd went away (or a test's listener did); the daemon
            # carries on without it.
            self.dropped += 1
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                log.warning("could not notify systemd (%s): %s", ", ".join(fields), exc)
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6),
                         **({"STATUS": status} if status else {}))

    def reloading(self) -> bool:
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec)

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


@dataclass
class _Watched:
    """What the health check remembers of one batcher between checks."""

    completed: int
    since: float


class Health:
    """Decides whether the watchdog may be pinged: every background task but the watchdog's own
    runs, every probe passes, and no batcher has held work without answering for ``stall_s``.

    Args:
        daemon: Its supervisor's tasks and its services' batchers are checked.
        clock: Monotonic seconds (tests inject one).
    """

    def __init__(self, daemon: Daemon, *, stall_s: float = STALL_S,
                 clock: Callable[[], float] = time.monotonic,
                 ignore_tasks: Iterable[str] = ("watchdog",)) -> None:
        self._daemon = daemon
        self._stall_s = stall_s
        self._clock = clock
        self._ignore = set(ignore_tasks)
        self._watched: dict[str, _Watched] = {}
        self._probes: dict[str, Probe] = {}

    def add_probe(self, name: str, probe: Probe) -> None:
        """Another part of the daemon's own liveness check (the power thread's heartbeat)."""
        self._probes[name] = probe

    def problems(self) -> list[str]:
        """Why the daemon is not healthy now; empty when it is."""
        from agent.supervisor import TaskState

        found = [f"task {status.name} {status.state.value}"
                 + (f": {status.error}" if status.error else "")
                 for status in self._daemon.supervisor.status()
                 if status.name not in self._ignore and status.state is not TaskState.RUNNING]
        now = self._clock()
        for name, service in list(self._daemon.services.items()):
            load = service.batcher.load()
            pending = load.queue_depth + load.busy_instances
            seen = self._watched.get(name)
            if seen is None or load.completed_total != seen.completed or pending == 0:
                self._watched[name] = _Watched(load.completed_total, now)
                continue
            if now - seen.since >= self._stall_s:
                found.append(f"model {name}: {pending} batch(es) or request(s) waiting and "
                             f"nothing answered for {now - seen.since:.0f} s")
        for name, probe in self._probes.items():
            try:
                problem = probe()
            except Exception as exc:  # noqa: BLE001 - a broken probe is a problem, not a crash
                problem = f"its check raised {type(exc).__name__}: {exc}"
            if problem:
                found.append(f"{name}: {problem}")
        return found


def status_line(daemon: Daemon) -> str:
    """What STATUS= says: the versions served, the update's state, the power state."""
    models = ", ".join(f"{name} v{service.version}"
                       for name, service in sorted(daemon.services.items())) or "no model"
    parts = [f"{daemon.state.value} {models}"]
    if daemon.updater is not None:
        parts.append(f"update {daemon.updater.state.value}")
    power = getattr(daemon, "power", None)
    if power is not None:
        with_state = getattr(power, "status", None)
        try:
            state = with_state()["state"] if callable(with_state) else None
        except Exception:  # noqa: BLE001 - the status line must not fail on a power bug
            state = "unknown"
        if state:
            parts.append(f"power {state}")
    return "; ".join(parts)


class SystemdService:
    """The daemon's side of systemd: the watchdog task, status updates and the stop notice.
    Made by :func:`attach_systemd`."""

    def __init__(self, daemon: Daemon, notifier: Notifier, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.daemon = daemon
        self.notifier = notifier
        self.health = Health(daemon, clock=clock)
        self.unhealthy: list[str] = []  # what stopped the last ping, for the status and logs
        self._last_status = ""

    def update_status(self, *, force: bool = False) -> None:
        line = status_line(self.daemon)
        if self.unhealthy:
            line += "; unhealthy: " + "; ".join(self.unhealthy)
        if force or line != self._last_status:
            self._last_status = line
            self.notifier.status(line)

    def ready(self) -> None:
        self._last_status = status_line(self.daemon)
        self.notifier.ready(self._last_status)

    async def run_watchdog(self) -> None:
        """The background task: ping while healthy, refresh the status line; runs until
        cancelled. Without a watchdog it still keeps STATUS= current."""
        interval = (self.notifier.watchdog_s / 2) if self.notifier.watchdog_s else 5.0
        while True:
            problems = self.health.problems()
            if problems != self.unhealthy:
                if problems:
                    log.error("not pinging systemd's watchdog: %s", "; ".join(problems))
                elif self.unhealthy:
                    log.warning("healthy again: pinging systemd's watchdog")
                self.unhealthy = problems
            if not problems and self.notifier.watchdog_s:
                self.notifier.watchdog()
            self.update_status()
            await asyncio.sleep(interval)

    def on_state(self, state: Any) -> None:
        from agent.daemon import DaemonState

        if state is DaemonState.STOPPING:
            self.notifier.stopping("stopping: draining in-flight requests")


def attach_systemd(daemon: Daemon, notifier: Notifier | None = None) -> SystemdService | None:
    """Wire ``daemon`` to systemd when ``$NOTIFY_SOCKET`` is set (call before the start);
    returns None otherwise. The watchdog task is critical: if it dies, nothing pings, and the
    daemon stops itself rather than wait for systemd to kill it."""
    notifier = notifier if notifier is not None else Notifier.from_environment()
    if not notifier.enabled:
        return None
    service = SystemdService(daemon, notifier)
    power = getattr(daemon, "power", None)
    if power is not None and callable(getattr(power, "liveness", None)):
        service.health.add_probe("power", power.liveness)
    daemon.add_task("watchdog", service.run_watchdog, critical=True)
    daemon.add_state_listener(service.on_state)
    if notifier.watchdog_s:
        log.info("systemd watchdog: %.1f s, pinged every %.1f s while healthy",
                 notifier.watchdog_s, notifier.watchdog_s / 2)
    return service


async def extend_while(work: asyncio.Future[Any], notifier: Notifier, what: str, *,
                       every_s: float = START_EXTEND_EVERY_S) -> None:
    """Ask systemd for more start time every ``every_s`` until ``work`` is done (a start that
    builds an engine for minutes is not a hung one)."""
    started = time.monotonic()
    while not work.done():
        notifier.extend_timeout(2 * every_s,
                                f"{what} ({time.monotonic() - started:.0f} s so far)")
        await asyncio.wait({work}, timeout=every_s)


__all__ = ["Health", "Notifier", "SystemdService", "attach_systemd", "extend_while",
           "notify_address", "status_line"]
