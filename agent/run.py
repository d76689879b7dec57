"""Running the daemon in the foreground: the one lifecycle and signal handling every entry point
shares (``edge-agent serve``, which systemd runs, and ``edge-agent demo``; ``edge-agent bench
serve`` runs ``serve`` as its own process).

:func:`run_foreground` starts a :class:`~agent.daemon.Daemon`, serves until SIGTERM or SIGINT
(systemd's stop, Ctrl-C), until a session it was given finishes, or until a critical background
task fails, then stops the daemon in order and lets go of its state directory. SIGHUP is ignored
throughout: there is nothing to reload, and by default it would kill the daemon without a drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, overload

from agent.backends import ModelArtifacts
from agent.config import AgentConfig
from agent.daemon import Daemon
from agent.errors import AgentError, StopRequested, Terminated

log = logging.getLogger(__name__)

T = TypeVar("T")
Session = Callable[[int], Awaitable[T]]


def ignore_sighup(*_: object) -> None:
    log.warning("SIGHUP ignored: the daemon does not reload its configuration; restart it instead")


def check_can_listen(host: str, port: int) -> None:
    """Raise the error the HTTP server would raise if ``host:port`` cannot be listened on now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        raise AgentError("cannot listen for HTTP", host=host, port=port,
                         reason=exc.strerror or str(exc)) from None


def run_daemon(config: AgentConfig, *, bundle: Path | None = None,
               on_ready: Callable[[int], Any] | None = None) -> int:
    """``edge-agent serve``: install ``bundle`` if given, then serve until SIGTERM/SIGINT;
    returns the exit status."""
    # A busy port would only be found once the model has loaded (minutes, when a TensorRT
    # engine is built first): look now.
    check_can_listen(config.http.host, config.http.port)
    # SIGHUP (a closed terminal, or an operator expecting a reload) would kill the daemon
    # outright, even mid-install: there is nothing to reload, so it is ignored throughout.
    signal.signal(signal.SIGHUP, ignore_sighup)
    daemon = Daemon(config)
    candidate = None
    try:
        if bundle is not None:
            candidate = daemon.install(bundle)
            log.info("installed %s v%d from %s", candidate.name, candidate.version, bundle)
    except BaseException:
        daemon.close()
        raise
    run_foreground(daemon, candidate=candidate, on_ready=on_ready)
    return 0


@overload
def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: Session[T], on_ready: Callable[[int], Any] | None = None) -> T: ...


@overload
def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: None = None, on_ready: Callable[[int], Any] | None = None) -> None: ...


def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: Session[T] | None = None,
                   on_ready: Callable[[int], Any] | None = None) -> T | None:
    """Start ``daemon`` (on ``candidate``, an installed version, or the store's current one),
    serve, stop it in order and close it. Call from the main thread.

    Without a ``session`` it serves until SIGTERM or SIGINT, and returns None. With one, it
    returns what ``session(port)`` returns once that finishes; a signal meanwhile cancels the
    session and, once the daemon has stopped, raises :class:`~agent.errors.Terminated` (SIGTERM)
    or ``KeyboardInterrupt`` (SIGINT), as the CLI expects of work cut short.

    Raises:
        AgentError: the start failed (a candidate that did not start is named in the log), or a
            critical background task failed (after the daemon stopped).
    """
    try:
        return asyncio.run(_serve(daemon, candidate, session, on_ready))
    finally:
        daemon.close()


async def _serve(daemon: Daemon, candidate: ModelArtifacts | None, session: Session[T] | None,
                 on_ready: Callable[[int], Any] | None) -> T | None:
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        daemon.request_stop()  # a start still under way (an engine build) ends early

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, ignore_sighup)
    try:
        port = await _start(daemon, candidate)
        if port is None:
            if session is not None:
                _raise_for(received)
            return None
        try:
            if on_ready is not None:
                on_ready(port)
            result = await _until_stopped(daemon, session(port) if session else None)
        finally:
            await daemon.stop()
        if daemon.failure is not None:
            raise daemon.failure
        if result is _CUT_SHORT:
            _raise_for(received)
        return result  # type: ignore[return-value]
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)


async def _start(daemon: Daemon, candidate: ModelArtifacts | None) -> int | None:
    """Start the daemon; returns its port, or None when a stop request ended the start."""
    try:
        port = await daemon.start(candidate)
    except StopRequested as exc:
        log.info("stopped while starting: %s", exc)
        return None
    except AgentError:
        if candidate is not None:
            current = daemon.store.current()
            if current is None or (current.name, current.version) != (candidate.name,
                                                                       candidate.version):
                log.error("%s v%d is installed but was not made current, since its start "
                          "failed; current is still %s", candidate.name, candidate.version,
                          f"{current.name} v{current.version}" if current else "none")
        raise
    return port


_CUT_SHORT = object()  # the session was cancelled by a stop request


async def _until_stopped(daemon: Daemon, work: Awaitable[T] | None) -> T | object | None:
    """Wait for a stop request, or for ``work`` to finish first (then its result)."""
    stop = asyncio.ensure_future(daemon.wait_for_stop())
    if work is None:
        await stop
        return None
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return _CUT_SHORT if task.cancelled() else task.result()


def _raise_for(received: list[int]) -> None:
    """Work cut short by a signal ends as the CLI ends it for Ctrl-C or SIGTERM."""
    if signal.SIGINT in received and signal.SIGTERM not in received:
        raise KeyboardInterrupt
    raise Terminated()
