"""Faults around the update's file worker process (agent/update/fileworker.py) as a board meets
them: a worker that dies between updates (the OOM killer, an operator's kill) is not left a
zombie until the next update, and its end is logged as it happens; a step cancelled while its
worker still starts (seconds at nice +10 on a loaded board) ends at once, the half-started worker
killed and reaped."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import AgentError
from agent.update.fileworker import FileWorker


@pytest.fixture
def worker() -> Iterator[FileWorker]:
    worker = FileWorker(nice=os.getpriority(os.PRIO_PROCESS, 0) + 10)
    try:
        yield worker
    finally:
        worker.close()


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_worker_that_dies_between_updates_is_reaped_at_once(worker: FileWorker) -> None:
    """Killed while idle (no call in flight, perhaps for days before the next update), the
    worker must not stay a defunct child of the daemon."""
    worker.start()
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    # Reaped (gone from /proc), then known for dead: the reaping thread's poll() sets the
    # exit status a moment after its waitpid, and a poll() meanwhile knows nothing yet.
    while _state(pid) is not None or worker.pid is not None:
        assert time.monotonic() < deadline, f"the dead worker {pid} is left {_state(pid)}"
        time.sleep(0.05)
    answer = worker.call("ping")  # the next call starts a new one
    assert answer["pid"] != pid and worker.starts == 2


def test_a_call_right_after_kill_gets_a_new_worker_not_the_dying_one(worker: FileWorker) -> None:
    """kill() returns before the process is gone (SIGKILL is delivered asynchronously); the
    next call (a newer update's download, right after the older one was cancelled) must not be
    sent to the dying worker and fail ``worker_died``."""
    for _ in range(5):
        worker.start()
        killed = worker.pid
        worker.kill()
        answer = worker.call("ping")
        assert answer["pid"] != killed


def test_a_worker_unused_for_its_idle_time_is_stopped_and_the_next_call_starts_another() -> None:
    """Between updates (weeks apart on a board) the worker's memory goes back to the board."""
    worker = FileWorker(nice=os.getpriority(os.PRIO_PROCESS, 0) + 10, idle_stop_s=0.5)
    try:
        worker.start()
        pid = worker.pid
        assert pid is not None
        deadline = time.monotonic() + 10
        while _state(pid) is not None:  # ended and reaped, not left a zombie
            assert time.monotonic() < deadline, f"the idle worker {pid} is {_state(pid)}"
            time.sleep(0.05)
        assert worker.pid is None
        answer = worker.call("ping")
        assert answer["pid"] != pid and worker.starts == 2
    finally:
        worker.close()


def test_calls_keep_the_worker_from_its_idle_stop() -> None:
    worker = FileWorker(nice=os.getpriority(os.PRIO_PROCESS, 0) + 10, idle_stop_s=0.6)
    try:
        worker.start()
        pids = set()
        for _ in range(8):  # 1.6 s in all, never 0.6 s without a call
            pids.add(worker.call("ping")["pid"])
            time.sleep(0.2)
        assert len(pids) == 1 and worker.starts == 1
    finally:
        worker.close()


def _ends_logged(caplog: pytest.LogCaptureFixture, pid: int) -> list[logging.LogRecord]:
    return [record for record in caplog.records
            if record.getMessage().startswith(f"update file worker pid {pid} ended")]


def test_a_worker_that_dies_while_idle_is_logged_as_it_ends_and_only_then(
        worker: FileWorker, caplog: pytest.LogCaptureFixture) -> None:
    """An operator's kill or the OOM killer between updates: the log says so when it happens,
    with the signal, at warning level (the next update may be weeks later), and the next call
    does not say it again."""
    caplog.set_level(logging.INFO, logger="agent.update.fileworker")
    worker.start()
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not _ends_logged(caplog, pid):
        assert time.monotonic() < deadline, "the worker's end was not logged"
        time.sleep(0.05)
    [record] = _ends_logged(caplog, pid)
    assert record.levelno == logging.WARNING and "killed by SIGKILL" in record.getMessage()
    worker.call("ping")
    assert len(_ends_logged(caplog, pid)) == 1


def test_a_worker_ended_by_kill_while_idle_is_logged_once_at_info(
        worker: FileWorker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.update.fileworker")
    worker.start()
    pid = worker.pid
    assert pid is not None
    worker.kill()
    deadline = time.monotonic() + 5
    while not _ends_logged(caplog, pid):
        assert time.monotonic() < deadline, "the worker's end was not logged"
        time.sleep(0.05)
    worker.call("ping")
    [record] = _ends_logged(caplog, pid)
    assert record.levelno == logging.INFO


# An interpreter that takes as long as a loaded board's to start the worker: it says its pid in
# a file, sleeps, then becomes the real interpreter with the worker's arguments.
_SLOW_PYTHON = """#!{python}
import os, sys, time
with open(os.environ["SLOW_START_MARK"], "w") as mark:
    mark.write(str(os.getpid()))
time.sleep({seconds})
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def slow_python(directory: Path, monkeypatch: pytest.MonkeyPatch,
                seconds: float = 30.0) -> tuple[str, Path]:
    """A slow-starting interpreter for the worker, and the file its pid appears in."""
    script = directory / "slow-python"
    script.write_text(_SLOW_PYTHON.format(python=sys.executable, seconds=seconds))
    script.chmod(0o755)
    mark = directory / "slow-start.pid"
    monkeypatch.setenv("SLOW_START_MARK", str(mark))
    return str(script), mark


def wait_for_pid(mark: Path, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not (mark.exists() and mark.read_text()):
        assert time.monotonic() < deadline, "the slow interpreter never started"
        time.sleep(0.02)
    return int(mark.read_text())


def test_a_kill_while_the_worker_starts_ends_the_call_at_once_and_reaps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The step is cancelled (a newer request, its deadline) while its worker still starts:
    the call must end now, ``worker_died`` (``worker_unavailable`` would send the cancelled
    work to the daemon's own thread), not wait for the start and then run its task anyway."""
    caplog.set_level(logging.INFO, logger="agent.update.fileworker")
    python, mark = slow_python(tmp_path, monkeypatch)
    worker = FileWorker(nice=os.getpriority(os.PRIO_PROCESS, 0) + 10, python=python)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = worker.call("ping")
        except AgentError as exc:
            result["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        starting = wait_for_pid(mark)
        killed = time.monotonic()
        worker.kill()
        thread.join(10)
        assert not thread.is_alive(), "the call waited for the worker's start"
        assert time.monotonic() - killed < 5
        error = result.get("error")
        assert error is not None and error.reason == "worker_died", result
        assert _state(starting) is None  # killed and reaped
        assert worker.starts == 0 and worker.pid is None
        [record] = _ends_logged(caplog, starting)
        assert record.levelno == logging.INFO and "killed by SIGKILL" in record.getMessage()
        worker.python = sys.executable  # the next call starts a worker as usual
        assert worker.call("ping")["pid"] != starting and worker.starts == 1
    finally:
        worker.close()
