"""Running the daemon in the foreground: the one lifecycle and signal handling every entry point
shares (``edge-agent serve``, which systemd runs, and ``edge-agent demo``; ``edge-agent bench
serve`` runs ``serve`` as its own process).

:func:`run_foreground` starts a :class:`~agent.daemon.Daemon`, serves until SIGTERM or SIGINT
(systemd's stop, Ctrl-C), until a session it was given finishes, or until a critical background
task fails, then stops the daemon in order and lets go of its state directory.

Under systemd (``$NOTIFY_SOCKET``, see :mod:`agent.systemd`) :func:`run_daemon` also tells it how
the start goes, when the daemon is ready, what it serves, that it is alive (the watchdog) and that
it stops. SIGHUP reloads the configuration when the entry point can read it again (``edge-agent
serve`` can: :mod:`agent.reload` says what changes at once and what needs a restart); otherwise,
and during the start, it is ignored, since by default it would kill the daemon without a drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, overload

from agent.backends import ModelArtifacts
from agent.config import AgentConfig
from agent.daemon import Daemon
from agent.errors import AgentError, StopRequested, Terminated
from agent.systemd import Notifier, SystemdService, attach_systemd, extend_while

log = logging.getLogger(__name__)

T = TypeVar("T")
Session = Callable[[int], Awaitable[T]]


def ignore_sighup(*_: object) -> None:
    log.warning("SIGHUP ignored: the daemon reloads its configuration only once it serves, and "
                "only when started by `edge-agent serve`")


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
               on_ready: Callable[[int], Any] | None = None,
               reload_config: Callable[[], AgentConfig] | None = None,
               notifier: Notifier | None = None) -> int:
    """``edge-agent serve``: install ``bundle`` if given, then serve until SIGTERM/SIGINT;
    returns the exit status. ``reload_config`` reads the configuration again for SIGHUP;
    ``notifier`` defaults to the one ``$NOTIFY_SOCKET`` names (nothing outside systemd)."""
    # A busy port would only be found once the model has loaded (minutes, when a TensorRT
    # engine is built first): look now.
    check_can_listen(config.http.host, config.http.port)
    # SIGHUP (a closed terminal, or an operator expecting a reload) would kill the daemon
    # outright, even mid-install: it is ignored until the daemon serves and can reload.
    signal.signal(signal.SIGHUP, ignore_sighup)
    notifier = notifier if notifier is not None else Notifier.from_environment()
    daemon = Daemon(config)
    candidate = None
    try:
        systemd = attach_systemd(daemon, notifier)
        if bundle is not None:
            notifier.status(f"installing {bundle.name}")
            candidate = daemon.install(bundle)
            log.info("installed %s v%d from %s", candidate.name, candidate.version, bundle)
    except BaseException:
        daemon.close()
        notifier.close()
        raise

    def ready(port: int) -> None:
        if systemd is not None:
            systemd.ready()
        if on_ready is not None:
            on_ready(port)

    try:
        run_foreground(daemon, candidate=candidate, on_ready=ready,
                       reload_config=reload_config, systemd=systemd)
    finally:
        notifier.close()
    return 0


@overload
def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: Session[T], on_ready: Callable[[int], Any] | None = None,
                   reload_config: Callable[[], AgentConfig] | None = None,
                   systemd: SystemdService | None = None) -> T: ...


@overload
def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: None = None, on_ready: Callable[[int], Any] | None = None,
                   reload_config: Callable[[], AgentConfig] | None = None,
                   systemd: SystemdService | None = None) -> None: ...


def run_foreground(daemon: Daemon, *, candidate: ModelArtifacts | None = None,
                   session: Session[T] | None = None,
                   on_ready: Callable[[int], Any] | None = None,
                   reload_config: Callable[[], AgentConfig] | None = None,
                   systemd: SystemdService | None = None) -> T | None:
    """Start ``daemon`` (on ``candidate``, an installed version, or the store's current one),
    serve, stop it in order and close it. Call from the main thread.

    Without a ``session`` it serves until SIGTERM or SIGINT, and returns None. With one, it
    returns what ``session(port)`` returns once that finishes; a signal meanwhile cancels the
    session and, once the daemon has stopped, raises :class:`~agent.errors.Terminated` (SIGTERM)
    or ``KeyboardInterrupt`` (SIGINT), as the CLI expects of work cut short.

    Raises:
        AgentError: the start failed (a candidate that did not start is named in the log), or a
            critical background task failed (after the daemon stopped).
        StopRequested: with a session, something other than a signal asked the daemon to stop
            before the session finished.
    """
    try:
        return _run_loop(_serve(daemon, candidate, session, on_ready, reload_config, systemd))
    finally:
        daemon.close()


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Tasks still pending when the run ends (a background task that ignored its cancellation) are
# cancelled again and given this long; the process does not wait for them beyond it.
LEFTOVER_TIMEOUT_S = 5.0
# The loop's default executor (journal writes, file work, freeing instances) is given this long
# to finish its jobs at exit. A job stuck for good (a hung driver call, a dead NFS mount) is
# abandoned then, and the process leaves through :func:`exit_if_abandoned` instead of waiting
# for it at interpreter exit until the service manager kills it.
EXECUTOR_TIMEOUT_S = 10.0
# Once a thread was abandoned, the threads still running at exit get this long in all.
EXIT_JOIN_S = 5.0

_abandoned: list[str] = []


async def _serve(daemon: Daemon, candidate: ModelArtifacts | None, session: Session[T] | None,
                 on_ready: Callable[[int], Any] | None,
                 reload_config: Callable[[], AgentConfig] | None = None,
                 systemd: SystemdService | None = None) -> T | None:
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        daemon.request_stop()  # a start still under way (an engine build) ends early

    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, ignore_sighup)
    try:
        try:
            port = await _start(daemon, candidate, systemd)
            result, cut_short = None, session is not None
            if port is not None:
                if reload_config is not None:
                    loop.add_signal_handler(signal.SIGHUP, _reloader(daemon, reload_config,
                                                                     systemd))
                if on_ready is not None:
                    on_ready(port)
                result, cut_short = await _until_stopped(
                    daemon, session(port) if session is not None else None)
        finally:
            await daemon.stop()  # whatever happened above; it does nothing if already stopped
    finally:
        for signum in _SIGNALS:  # as they were before, not the defaults asyncio leaves
            loop.remove_signal_handler(signum)
            signal.signal(signum, previous[signum])
    if daemon.failure is not None:
        raise daemon.failure
    if cut_short:
        _raise_for(received)
    return result


async def _start(daemon: Daemon, candidate: ModelArtifacts | None,
                 systemd: SystemdService | None = None) -> int | None:
    """Start the daemon; returns its port, or None when a stop request ended the start. Under
    systemd the start asks for more time while it runs (an engine build takes minutes)."""
    start = asyncio.ensure_future(daemon.start(candidate))
    extending = (asyncio.ensure_future(extend_while(start, systemd.notifier, "starting: loading "
                                                    "the model"))
                 if systemd is not None else None)
    try:
        return await start
    except StopRequested as exc:
        log.info("stopped while starting: %s", exc)
        return None
    finally:
        if extending is not None:
            extending.cancel()
            await asyncio.gather(extending, return_exceptions=True)


def _reloader(daemon: Daemon, read: Callable[[], AgentConfig],
              systemd: SystemdService | None) -> Callable[[], None]:
    """The SIGHUP handler once the daemon serves: one reload at a time, on the event loop; a
    configuration that does not load leaves the one in force, and says why."""
    from agent.reload import reload

    running: list[asyncio.Task[None]] = []

    async def run() -> None:
        if systemd is not None:
            systemd.notifier.reloading()
        outcome = "reload: "
        try:
            # Reading the file (and the key files it names) is quick, but off the loop all
            # the same: a slow disk must not hold requests.
            new = await asyncio.get_running_loop().run_in_executor(None, read)
            outcome += reload(daemon, new).summary()
        except AgentError as exc:
            log.error("reload refused, the configuration in force is kept: %s", exc)
            outcome += f"refused ({exc})"
        except Exception:  # noqa: BLE001 - a reload's bug must not take the daemon down
            log.exception("reload failed, the configuration in force is kept")
            outcome += "failed (see the log)"
        finally:
            if systemd is not None:
                systemd.notifier.ready()
                systemd.notifier.status(outcome)

    def on_sighup() -> None:
        if running and not running[-1].done():
            log.warning("SIGHUP: a reload is already under way")
            return
        log.info("SIGHUP: reloading the configuration")
        running[:] = [asyncio.get_running_loop().create_task(run(), name="reload")]

    return on_sighup


async def _until_stopped(daemon: Daemon, work: Awaitable[T] | None) -> tuple[T | None, bool]:
    """Wait for a stop request, or for ``work`` to finish first. Returns its result, and
    whether it was cut short (cancelled, whatever it then did)."""
    stop = asyncio.ensure_future(daemon.wait_for_stop())
    if work is None:
        await stop
        return None, False
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        cut_short = not task.done()
        if cut_short:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return (None, True) if cut_short else (task.result(), False)


def _raise_for(received: list[int]) -> None:
    """Work cut short ends as the CLI ends it for SIGTERM or Ctrl-C, or, when no signal asked
    for the stop, as the stop request it was."""
    if signal.SIGTERM in received:
        raise Terminated()
    if signal.SIGINT in received:
        raise KeyboardInterrupt
    raise StopRequested("the daemon was asked to stop before its session finished")


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, except that tasks left pending at the end are given
    :data:`LEFTOVER_TIMEOUT_S` once cancelled instead of as long as they take: a background task
    that swallows its cancellation must not keep the process from exiting."""
    loop = asyncio.new_event_loop()
    # The loop's own default executor would be shut down with no bound (before Python 3.12,
    # ``shutdown_default_executor`` joins its threads however long they take).
    executor = ThreadPoolExecutor(thread_name_prefix="agent-io")
    loop.set_default_executor(executor)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            _shut_down(executor, EXECUTOR_TIMEOUT_S)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _shut_down(executor: ThreadPoolExecutor, timeout_s: float) -> bool:
    """Shut ``executor`` down (queued jobs cancelled), waiting at most ``timeout_s`` for the
    running ones; False, logged and remembered for :func:`exit_if_abandoned`, when one is still
    running then."""
    before = set(threading.enumerate())
    done = threading.Event()

    def shut_down() -> None:
        executor.shutdown(wait=True, cancel_futures=True)
        done.set()

    threading.Thread(target=shut_down, name="agent-io-shutdown", daemon=True).start()
    if done.wait(timeout_s):
        return True
    stuck = sorted(thread.name for thread in before
                   if thread.name.startswith("agent-io") and thread.is_alive())
    _abandoned.extend(stuck)
    log.error("%d job(s) of the default executor did not finish %.0f s after the daemon "
              "stopped (%s); abandoned", len(stuck), timeout_s, ", ".join(stuck) or "?")
    return False


def exit_if_abandoned(status: int) -> None:
    """End the process now with ``status`` when a run abandoned a stuck thread (see
    :data:`EXECUTOR_TIMEOUT_S`); otherwise return.

    A thread of a thread pool is joined at interpreter exit however long it takes, so a job
    stuck for good would keep the stopped daemon's process alive until its service manager
    killed it. The other threads still running get :data:`EXIT_JOIN_S` in all, the output and
    the log are flushed, and the process exits at once (``os._exit``).
    """
    if not _abandoned:
        return
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [thread.name for thread in threading.enumerate()
            if thread is not threading.current_thread() and not thread.daemon
            and thread.is_alive()]
    log.error("exiting with %d thread(s) still running: %s", len(left), ", ".join(left))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    done, left = loop.run_until_complete(asyncio.wait(pending, timeout=LEFTOVER_TIMEOUT_S))
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed as it was cancelled at exit", task.get_name(),
                      exc_info=task.exception())
    for task in left:
        log.error("task %s did not end %.0f s after it was cancelled at exit; abandoned",
                  task.get_name(), LEFTOVER_TIMEOUT_S)
