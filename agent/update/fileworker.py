"""The update's file work in a process of its own: the download, the bundle's checks and the
writing of its members, off the daemon's interpreter.

Why a process: the daemon's threads share one GIL. Opening a bundle (the tar headers parsed in
Python, the manifest's JSON and validation, the glue around every hash) holds it for about a
millisecond, an install for several, a download's transfer loop for more than one, and a thread's nice value does nothing against the GIL:
every request the event loop and the batcher handle meanwhile waits. In a process of its own,
at a lower CPU priority, that work only takes CPU the serving path leaves.

:class:`FileWorker` is the daemon's side: one worker process, started once (agent/update/
service.py starts it with the updater) and reused by every update, so its start (an interpreter
and the bundle modules, about 0.2 s of CPU) is paid once, not per update. The process is
``python -m agent.update.fileworker``: a fresh interpreter (spawned, never forked from the
daemon, which has threads and an event loop) that imports the bundle modules only (no torch,
no ONNX Runtime, no numpy), raises its nice value by :data:`~agent.update.priority.
LOAD_NICE_INCREMENT` and answers calls over a pipe, one at a time: a call is a task's name
from :data:`TASKS` and its keyword arguments, pickled; the answer is its result or the
:class:`~agent.errors.AgentError` it raised, pickled too (AgentError pickles with its
``reason`` and facts). The worker writes only into the directory it is given: the store names
a staging directory and renames it into place itself, under its lock
(:meth:`~agent.store.store.ModelStore.begin_install`).

Failures: a worker that dies (killed, out of memory) fails the call with reason
``worker_died`` and the exit status; the next call starts a new one. Its end is logged once, as
it happens (its reaping thread), with its exit status or signal: at warning level unless the
daemon ended it. :meth:`FileWorker.kill` ends a call in flight at once (a step cancelled or
past its deadline: the updater's cancellation must not wait for a file to be written), a
worker still starting for it included (an interpreter's start at nice +10 takes seconds on a
loaded board): the call then fails ``worker_died`` too, never ``worker_unavailable``, which
would send the cancelled step's work to the daemon's own thread. A worker that cannot be
started raises reason ``worker_unavailable``; the steps then do that update's file work on
their own thread, as before, with a warning (agent/update/steps.py). The worker ends by
itself when the daemon goes away: its requests' pipe closes, and a watchdog thread ends it
within :data:`WATCHDOG_S` if its parent dies mid-call; the store's start removes a staging
directory it was writing. A worker that no call has used for :data:`IDLE_STOP_S` is stopped
(its memory back to the board between updates); the next call starts another.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from agent.errors import AgentError, UpdateError

log = logging.getLogger(__name__)

WATCHDOG_S = 0.5  # how often a worker checks that its parent is alive
START_TIMEOUT_S = 60.0  # an interpreter's start on a loaded board, with margin
STOP_TIMEOUT_S = 2.0
# A worker unused this long is stopped (its 30-odd MiB given back between updates, which on a
# board may be weeks apart); the next call starts another, an interpreter's start of CPU.
IDLE_STOP_S = 600.0
_HEADER = struct.Struct(">Q")
_MAX_FRAME_BYTES = 64 << 20  # a manifest is at most 1 MiB; anything near this is a bug


# -- the tasks (run in the worker) ------------------------------------------------------------


def _keys(public_keys: Sequence[bytes]) -> list[Any]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return [Ed25519PublicKey.from_public_bytes(raw) for raw in public_keys]


def open_checked(path: str, public_keys: Sequence[bytes], agent_version: str,
                 sha256: str | None = None) -> dict[str, Any]:
    """The verifying state's heavy part: the bundle at ``path`` opened with ``open_bundle``
    (signature with ``public_keys``, raw Ed25519 keys, every hash, ``agent_version``), and the
    file's sha256 unless given. Returns ``manifest``, ``key_id`` and ``sha256``.

    Raises:
        SignatureError, BundleError: as ``open_bundle``.
    """
    from agent.fsutil import sha256_file
    from models.bundle import open_bundle

    if sha256 is None:
        sha256, _ = sha256_file(Path(path))
    bundle = open_bundle(Path(path), _keys(public_keys), agent_version=agent_version)
    return {"manifest": bundle.manifest, "key_id": bundle.key_id, "sha256": sha256}


def write_members(path: str, public_keys: Sequence[bytes], agent_version: str, directory: str,
                  name: str, version: int) -> dict[str, Any]:
    """The staged state's heavy part: the bundle at ``path`` verified again in full (it is
    read again, so a file changed since verifying is caught), that it is still ``name``
    ``version``, and its members written into ``directory`` (the store's staging directory),
    hashed and fsynced. Returns ``manifest``, ``manifest_bytes`` and ``key_id``.

    Raises:
        SignatureError, BundleError: as ``open_bundle``; the bundle is another version now,
            or a member does not match the manifest as it is written; writing fails.
    """
    from agent.errors import BundleError
    from models.bundle import open_bundle
    from models.manifest import MANIFEST_MEMBER

    bundle = open_bundle(Path(path), _keys(public_keys), agent_version=agent_version)
    manifest = bundle.manifest
    if (manifest["name"], manifest["version"]) != (name, version):
        raise BundleError("the bundle changed since it was verified", path=path,
                          expected=f"{name} v{version}",
                          found=f"{manifest['name']} v{manifest['version']}")
    try:
        bundle.write_members(Path(directory))
    except OSError as exc:
        raise BundleError("cannot extract bundle", path=directory, reason=str(exc)) from exc
    return {"manifest": manifest, "manifest_bytes": bundle.read_member(MANIFEST_MEMBER),
            "key_id": bundle.key_id}


# Modules the worker must never import: each costs memory for as long as the daemon runs.
HEAVY_MODULES = ("torch", "tensorrt", "onnxruntime", "numpy", "pycuda")


def fetch(source: str, destination: str, policy: Any, expected_sha256: str | None,
          progress: Callable[[Any], None]) -> Any:
    """The downloading state's work: ``source`` to ``destination``, resumable (agent/update/
    download.py, ``policy`` a DownloadPolicy), each progress report sent back as it comes.
    Returns the DownloadResult.

    Raises:
        DownloadError: as ``download``.
    """
    from agent.update.download import download_blocking

    return download_blocking(source, Path(destination), policy=policy,
                             expected_sha256=expected_sha256, on_progress=progress)


def _ping() -> dict[str, Any]:
    """The worker's pid, nice value, resident memory and the heavy modules it holds (none)."""
    return {"pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "rss_kib": _rss_kib(os.getpid()),
            "heavy_modules": sorted(name for name in HEAVY_MODULES if name in sys.modules)}


TASKS: dict[str, Callable[..., Any]] = {
    "fetch": fetch,
    "open_checked": open_checked,
    "write_members": write_members,
    "ping": _ping,
}


# -- the pipe ---------------------------------------------------------------------------------


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = _read_exact(stream, _HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > _MAX_FRAME_BYTES:
        raise EOFError(f"a frame of {size} bytes")
    return pickle.loads(_read_exact(stream, size))  # our own worker's answers


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the daemon's side ------------------------------------------------------------------------


def _describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class FileWorker:
    """The daemon's handle on its file worker process (module docstring).

    :meth:`call` blocks (call it from a thread, never the event loop) and runs one call at a
    time; :meth:`kill` may be called from any thread. Cheap to construct: the process starts at
    :meth:`start` or the first :meth:`call`.

    Args:
        nice: The worker's nice value (at least the daemon's plus the update's increment).
        python: The interpreter to run.
        idle_stop_s: Stop a worker no call has used for this long (None: never).
    """

    def __init__(self, *, nice: int, python: str = sys.executable,
                 start_timeout_s: float = START_TIMEOUT_S,
                 idle_stop_s: float | None = IDLE_STOP_S) -> None:
        self.nice = nice
        self.python = python
        self.start_timeout_s = start_timeout_s
        self.idle_stop_s = idle_stop_s
        self._idle: threading.Timer | None = None
        self._uses = 0  # start() and call()s so far: an idle stop checks none came since
        self._call_lock = threading.Lock()  # one call at a time
        self._state_lock = threading.Lock()  # _process and _closed
        self._process: subprocess.Popen[bytes] | None = None
        self._starting: subprocess.Popen[bytes] | None = None  # started, not answered yet
        self._closed = False
        self._in_call = False  # a call() or start() holds the call lock
        self._kill_pending = False  # kill() came during it: it must end, even mid-start
        # Processes the daemon itself ended (kill(), the idle stop, close()): their end is no
        # news. And those whose end was logged: once, by whoever saw it first.
        self._ended_by_us: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
        self._end_logged: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
        self.starts = 0  # processes started, for the tests and the log

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.poll() is not None else process.pid

    def rss_kib(self) -> int | None:
        """The worker's resident memory, None when none runs."""
        pid = self.pid
        return None if pid is None else _rss_kib(pid)

    def start(self) -> None:
        """Start the worker now, unless one runs (blocking: up to an interpreter's start).

        Raises:
            UpdateError: ``worker_unavailable``: it cannot be started or did not answer.
        """
        with self._call_lock:
            self._begin_call()
            try:
                self._ensure_started()
            finally:
                self._end_call()
            self._arm_idle_stop()

    def call(self, task: str, *, on_progress: Callable[[Any], None] | None = None,
             **kwargs: Any) -> Any:
        """Run ``TASKS[task](**kwargs)`` in the worker and return its result; a task that
        reports progress (``fetch``) has each report handed to ``on_progress`` on this thread.

        Raises:
            AgentError: what the task raised, as it raised it (its reason and facts).
            UpdateError: ``worker_died``: the worker ended during the call (killed, out of
                memory, :meth:`kill`); ``worker_unavailable``: it cannot be started;
                ``worker_error``: the task raised something other than an AgentError (the
                type and message are kept).
        """
        if task not in TASKS:
            raise UpdateError("no such file worker task", reason="worker_error", task=task)
        with self._call_lock:
            self._uses += 1
            self._begin_call()
            try:
                process = self._ensure_started()
            except BaseException:
                self._end_call()
                raise
            assert process.stdin is not None and process.stdout is not None  # made with PIPE
            try:
                _send(process.stdin, (task, kwargs))
                kind, value = _receive(process.stdout)
                while kind == "progress":
                    if on_progress is not None:
                        on_progress(value)
                    kind, value = _receive(process.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                status = self._reap(process)
                raise UpdateError("the update's file worker ended during its work",
                                  reason="worker_died", task=task, status=status,
                                  pid=process.pid, cause=str(exc)) from None
            finally:
                self._end_call()
                self._arm_idle_stop()
        if kind == "error":
            raise value
        return value

    def kill(self) -> None:
        """End the worker at once (a call in flight then fails ``worker_died``, one whose
        worker is still starting too); the next call starts a new one."""
        with self._state_lock:
            if self._in_call:
                self._kill_pending = True  # seen by a start not yet begun or not yet answered
            process = self._process or self._starting
            if process is not None:
                self._ended_by_us.add(process)
        if process is not None and process.poll() is None:
            process.kill()
            if self._call_lock.acquire(blocking=False):
                # No call in flight (one in flight reaps it itself): SIGKILL lands
                # asynchronously, and the next call must start a new worker, not write to
                # this dying one; its reaping thread collects it.
                try:
                    with self._state_lock:
                        if self._process is process:
                            self._process = None
                    _close_pipes(process)
                finally:
                    self._call_lock.release()

    def close(self) -> None:
        """Stop the worker (its requests' pipe closed, killed after :data:`STOP_TIMEOUT_S`),
        for good: a later :meth:`call` is refused."""
        with self._state_lock:
            self._closed = True
            process = self._process
            idle, self._idle = self._idle, None
            if process is not None:
                self._ended_by_us.add(process)
        if idle is not None:
            idle.cancel()
        if process is None:
            return
        if self._call_lock.locked():
            process.kill()  # mid-call: nothing it writes is wanted any more
        _stop(process)

    def _arm_idle_stop(self) -> None:
        """(Re)start the idle stop's countdown; with the call lock held."""
        if self.idle_stop_s is None:
            return
        timer = threading.Timer(self.idle_stop_s, self._stop_if_idle, args=(self._uses,))
        timer.name = "update-file-worker-idle"
        timer.daemon = True
        with self._state_lock:
            if self._closed:
                return
            earlier, self._idle = self._idle, timer
        if earlier is not None:
            earlier.cancel()
        timer.start()

    def _stop_if_idle(self, uses: int) -> None:
        """The idle stop: end the worker unless a call came since the countdown began (or
        runs now: it starts a new countdown when it ends)."""
        if not self._call_lock.acquire(blocking=False):
            return
        try:
            with self._state_lock:
                process = self._process
                if self._closed or uses != self._uses or process is None:
                    return
                self._process = None
                self._ended_by_us.add(process)
                self._end_logged.add(process)  # the line below says it
            _stop(process)
            log.info("update file worker pid %d stopped after %.0f s unused (%s)", process.pid,
                     self.idle_stop_s, _describe_status(process.returncode))
        finally:
            self._call_lock.release()

    def _begin_call(self) -> None:
        with self._state_lock:
            self._in_call, self._kill_pending = True, False

    def _end_call(self) -> None:
        with self._state_lock:
            self._in_call, self._kill_pending = False, False

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise UpdateError("the update's file worker is stopped (the daemon stops)",
                              reason="worker_unavailable")
        process = self._process
        if process is not None and process.poll() is None:
            return process
        if process is not None:
            self._reap(process)
        return self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        started = time.perf_counter()
        # The checkout or installed package this daemon runs from, whatever the working
        # directory: the worker must run the same code.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (root, env.get("PYTHONPATH")) if part)
        try:
            process = subprocess.Popen(  # our own interpreter and module
                [self.python, "-m", "agent.update.fileworker", str(os.getpid()), str(self.nice)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as exc:
            raise UpdateError("the update's file worker cannot be started",
                              reason="worker_unavailable", cause=str(exc)) from exc
        assert process.stdout is not None  # made with PIPE
        # Visible to kill() while it starts: a step cancelled meanwhile (a newer request, its
        # deadline) must not wait for the start, then run its work to the end regardless.
        with self._state_lock:
            self._starting = process
            killed = self._kill_pending
            if killed:
                self._ended_by_us.add(process)
        if killed:
            process.kill()
        try:
            ready, _, _ = select.select([process.stdout], [], [], self.start_timeout_s)
            if not ready:
                raise EOFError(f"no answer within {self.start_timeout_s:g} s")
            hello = _receive(process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            with self._state_lock:
                self._starting = None
                killed = self._kill_pending
                self._ended_by_us.add(process)
            process.kill()
            status = self._reap(process)
            if killed:
                raise UpdateError("the update's file worker was killed as it started",
                                  reason="worker_died", status=status, pid=process.pid,
                                  cause="kill() (the step was cancelled)") from None
            raise UpdateError("the update's file worker did not start",
                              reason="worker_unavailable", status=status,
                              cause=str(exc)) from None
        with self._state_lock:
            self._starting = None
            closed, killed = self._closed, self._kill_pending
            if closed or killed:
                self._ended_by_us.add(process)
            else:
                self._process = process
        if closed or killed:  # the daemon stopped, or the call was cancelled, as it started
            process.kill()
            status = self._reap(process)
            if closed:
                raise UpdateError("the update's file worker is stopped (the daemon stops)",
                                  reason="worker_unavailable")
            raise UpdateError("the update's file worker was killed as it started",
                              reason="worker_died", status=status, pid=process.pid,
                              cause="kill() (the step was cancelled)")
        self.starts += 1
        # Reaped the moment it ends, whenever that is: one killed between updates (the OOM
        # killer, an operator) is otherwise a zombie of the daemon until the next call, and
        # its end would only be logged then, perhaps weeks later.
        threading.Thread(target=self._reap_when_it_ends, args=(process,),
                         name=f"update-file-worker-{process.pid}", daemon=True).start()
        rss = _rss_kib(process.pid)
        log.info("update file worker pid %d started in %.2f s (nice %s, RSS %s MiB)",
                 process.pid, time.perf_counter() - started, hello.get("nice"),
                 "?" if rss is None else f"{rss / 1024:.1f}")
        return process

    def _reap(self, process: subprocess.Popen[bytes]) -> str:
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _close_pipes(process)
        with self._state_lock:
            if self._process is process:
                self._process = None
        return self._log_end(process)

    def _log_end(self, process: subprocess.Popen[bytes]) -> str:
        """Log that the (reaped) ``process`` ended, with its status, unless that was said
        already; returns the status."""
        status = _describe_status(process.returncode)
        with self._state_lock:
            if process in self._end_logged:
                return status
            self._end_logged.add(process)
            expected = process in self._ended_by_us
        log.log(logging.INFO if expected else logging.WARNING,
                "update file worker pid %d ended (%s)", process.pid, status)
        return status

    def _reap_when_it_ends(self, process: subprocess.Popen[bytes]) -> None:
        """Wait (a thread of its own) until ``process`` has ended, reap it and log its end,
        as it happens. The wait leaves it unreaped (WNOWAIT) and holds none of Popen's locks:
        Popen.wait() from the start would hold its lock throughout, and a poll() elsewhere
        would then take a dead worker for a live one until this thread ran again. Once it has
        ended, wait() only reaps it (or waits the moment another thread's poll() takes to).
        A worker that died while idle is also let go of here (its pipes closed), as kill()
        does: nothing of it waits for the next call, weeks later perhaps."""
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # reaped already (_reap, close)
        process.wait()
        if self._call_lock.acquire(blocking=False):  # else a call in flight reaps its own
            try:
                with self._state_lock:
                    if self._process is process:
                        self._process = None
                _close_pipes(process)
            finally:
                self._call_lock.release()
        self._log_end(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End ``process`` the orderly way: its requests' pipe closed (the worker ends at the end
    of its requests), killed after :data:`STOP_TIMEOUT_S`; reaped, its pipes closed."""
    try:
        if process.stdin is not None:
            process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    _close_pipes(process)


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for stream in (process.stdin, process.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


# -- the worker's side ------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(WATCHDOG_S)
        if os.getppid() != parent:
            os._exit(1)  # the daemon died mid-call: nothing here is worth finishing


def _answer(task: str, kwargs: dict[str, Any],
            progress: Callable[[Any], None]) -> tuple[str, Any]:
    function = TASKS[task]
    if "progress" in inspect.signature(function).parameters:
        kwargs = {**kwargs, "progress": progress}
    try:
        return "ok", function(**kwargs)
    except AgentError as exc:
        return "error", exc
    except Exception as exc:  # noqa: BLE001 - a bug of ours: its type and message go back
        return "error", UpdateError(f"the file worker's {task} raised {type(exc).__name__}: "
                                    f"{exc}", reason="worker_error", task=task)


def serve(parent: int, nice: int) -> int:
    """The worker's loop: calls from stdin, answers on the original stdout, until stdin closes."""
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not break the pipe
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError as exc:
        print(f"update file worker: could not lower its priority: {exc}", file=sys.stderr)
    threading.Thread(target=_watch_parent, args=(parent,), name="watchdog", daemon=True).start()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="update file worker: %(levelname)s %(name)s: %(message)s")
    # Imported once here, not at the first call: the first update then pays nothing.
    import models.bundle  # noqa: F401

    _send(answers, _ping())
    while True:
        try:
            task, kwargs = _receive(requests)
        except EOFError:
            return 0
        kind, value = _answer(task, kwargs, lambda report: _send(answers, ("progress", report)))
        try:
            _send(answers, (kind, value))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _send(answers, ("error", UpdateError(
                f"the file worker's {task} answer cannot be sent back: {exc}",
                reason="worker_error", task=task)))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's Ctrl-C is its to handle
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2])))
