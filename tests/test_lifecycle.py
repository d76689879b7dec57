"""The daemon's lifecycle in one process: its states, its background tasks and what the serving
path reports to subscribers, on a real signed bundle of a tiny model served by ONNX Runtime."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from agent.config import load_config
from agent.daemon import TRANSITIONS, Daemon, DaemonState
from agent.errors import AgentError, InternalError, StopRequested, Terminated
from agent.observers import BatchDone, RequestDone, ServingObserver
from agent.run import run_foreground
from agent.supervisor import Supervisor, TaskState
from models.signing import load_private_key, write_keypair
from tests.tiny_models import make_bundle


def _own_tasks(daemon: Daemon) -> list[Any]:
    """The daemon's background tasks but the updater's, which every daemon runs."""
    return [task for task in daemon.supervisor.status() if task.name != "updater"]


@pytest.fixture()
def daemon(tmp_path: Path) -> Daemon:
    """A daemon with a tiny model installed; nothing started."""
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path))
    config = load_config(None, env={}, overrides={
        "state_dir": tmp_path / "state", "http.port": 0, "serving.backend": "onnxruntime",
        "trust.public_keys": [Path(str(key_path) + ".pub")]})
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    return Daemon(config)


def infer(port: int) -> None:
    """One real request over HTTP (a blocking client, run off the loop)."""
    from agent.tooling.loadgen import encode_request

    body, header_length = encode_request(
        "input", np.zeros((1, 3, 16, 16), np.float32), datatype="FP32")
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/tiny/infer", data=body,
        headers={"Inference-Header-Content-Length": str(header_length),
                 "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


async def infer_async(port: int, count: int = 1) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(count):
        await loop.run_in_executor(None, infer, port)


def test_constructing_a_daemon_touches_nothing(tmp_path: Path) -> None:
    config = load_config(None, env={}, overrides={"state_dir": tmp_path / "state"})
    daemon = Daemon(config)
    assert daemon.state is DaemonState.CREATED
    assert not (tmp_path / "state").exists()


def test_the_states_follow_the_table_through_a_run(daemon: Daemon) -> None:
    seen: list[DaemonState] = []
    daemon.add_state_listener(seen.append)

    async def session(port: int) -> str:
        assert daemon.state is DaemonState.SERVING
        await infer_async(port)
        return "done"

    assert run_foreground(daemon, session=session) == "done"
    assert seen == [DaemonState.STARTING, DaemonState.SERVING, DaemonState.STOPPING,
                    DaemonState.STOPPED]
    assert all(after in TRANSITIONS[before] for before, after in
               zip([DaemonState.CREATED, *seen], seen))
    assert daemon.services == {} and daemon.server is None


def test_an_illegal_transition_is_a_bug_of_ours(daemon: Daemon) -> None:
    with pytest.raises(InternalError, match="cannot go from created to serving"):
        daemon._set_state(DaemonState.SERVING)


def test_a_failed_start_ends_failed(daemon: Daemon, tmp_path: Path) -> None:
    (daemon.config.state_dir / "current").write_bytes(b"garbage")
    seen: list[DaemonState] = []
    daemon.add_state_listener(seen.append)
    with pytest.raises(AgentError, match="pointer is corrupt"):
        run_foreground(daemon)
    assert seen == [DaemonState.STARTING, DaemonState.FAILED]


def test_tasks_start_after_the_model_serves_and_stop_in_reverse_order_first(
        daemon: Daemon) -> None:
    events: list[str] = []

    def task(name: str) -> Any:
        async def run() -> None:
            events.append(f"{name} started while {daemon.state.value}")
            try:
                await asyncio.Event().wait()
            finally:
                # Stopped before the listener closes: the model still answers.
                events.append(f"{name} stopped, server {'open' if daemon.server else 'gone'}")
        return run

    daemon.add_task("first", task("first"))
    daemon.add_task("second", task("second"))

    async def session(port: int) -> None:
        await asyncio.sleep(0)  # let the tasks run their first step
        await infer_async(port)

    run_foreground(daemon, session=session)
    assert events == ["first started while serving", "second started while serving",
                      "second stopped, server open", "first stopped, server open"]
    assert [task.state for task in _own_tasks(daemon)] == [TaskState.STOPPED] * 2


def test_a_task_that_dies_is_logged_and_visible_and_the_model_serves_on(
        daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("the governor's sysfs write failed")

    daemon.add_task("power", broken)

    async def session(port: int) -> dict[str, Any]:
        while _own_tasks(daemon)[0].state is TaskState.RUNNING:
            await asyncio.sleep(0.01)
        await infer_async(port)  # still serving
        metrics = await asyncio.get_running_loop().run_in_executor(
            None, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                 timeout=30).read().decode())
        return {"status": daemon.status(), "metrics": metrics}

    result = run_foreground(daemon, session=session)
    task = next(task for task in result["status"]["tasks"] if task["name"] != "updater")
    assert task == {"name": "power", "critical": False, "state": "failed",
                    "error": "the governor's sysfs write failed"}
    assert result["status"]["state"] == "serving"
    assert 'edge_agent_task_up{task="power"} 0.0' in result["metrics"]
    assert 'edge_agent_task_failures_total{task="power"} 1.0' in result["metrics"]
    failure = [record for record in caplog.records if "background task power failed" in
               record.getMessage()]
    assert failure and failure[0].levelno == logging.ERROR and failure[0].exc_info
    assert daemon.state is DaemonState.STOPPED


def test_a_critical_task_that_dies_stops_the_daemon_with_the_reason(daemon: Daemon) -> None:
    async def watchdog() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("sd_notify socket gone")

    daemon.add_task("watchdog", watchdog, critical=True)
    seen: list[DaemonState] = []
    daemon.add_state_listener(seen.append)

    async def session(port: int) -> None:
        await asyncio.Event().wait()  # serves until the daemon stops itself

    with pytest.raises(AgentError, match="a critical background task failed") as caught:
        run_foreground(daemon, session=session)
    assert caught.value.fields == {"task": "watchdog", "reason": "sd_notify socket gone"}
    assert seen[-2:] == [DaemonState.STOPPING, DaemonState.FAILED]


def test_a_task_that_returns_by_itself_is_a_failure(daemon: Daemon) -> None:
    async def gives_up() -> None:
        return None

    daemon.add_task("mqtt", gives_up)

    async def session(port: int) -> list[Any]:
        await asyncio.sleep(0.05)
        return _own_tasks(daemon)

    status = run_foreground(daemon, session=session)
    assert status[0].state is TaskState.FAILED and "returned" in (status[0].error or "")


def test_tasks_cannot_be_added_once_started_nor_twice_by_name() -> None:
    supervisor = Supervisor()

    async def idle() -> None:
        await asyncio.Event().wait()

    supervisor.add("a", idle)
    with pytest.raises(InternalError, match="two background tasks"):
        supervisor.add("a", idle)

    async def main() -> None:
        supervisor.start()
        with pytest.raises(InternalError, match="after the tasks started"):
            supervisor.add("b", idle)
        await supervisor.stop()

    asyncio.run(main())
    assert supervisor.status()[0].state is TaskState.STOPPED


def test_a_task_that_ignores_its_cancellation_does_not_hold_the_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor(stop_timeout_s=0.2)

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # a bug: it swallows the first cancellation...
        await asyncio.sleep(3600)  # ...and ends at the loop's own shutdown

    supervisor.add("stubborn", stubborn)

    async def main() -> TaskState:
        supervisor.start()
        await asyncio.sleep(0)
        await supervisor.stop()
        return supervisor.status()[0].state

    assert asyncio.run(main()) is TaskState.RUNNING
    assert "background task stubborn did not stop within 0.2 s of being cancelled" in caplog.text


class Recording(ServingObserver):
    def __init__(self) -> None:
        self.requests: list[RequestDone] = []
        self.batches: list[BatchDone] = []

    def request_done(self, event: RequestDone) -> None:
        self.requests.append(event)

    def batch_done(self, event: BatchDone) -> None:
        self.batches.append(event)


class Broken(ServingObserver):
    def request_done(self, event: RequestDone) -> None:
        raise ValueError("an observer's bug")


def test_a_component_subscribes_to_what_the_serving_path_reports(
        daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    recording, broken = Recording(), Broken()

    async def session(port: int) -> dict[str, Any]:
        observers = daemon.services["tiny"].observers
        observers.subscribe(broken)
        unsubscribe = observers.subscribe(recording)
        await infer_async(port, 3)  # the broken observer's failure fails no request
        unsubscribe()
        await infer_async(port)
        return daemon.services["tiny"].stats()

    stats = run_foreground(daemon, session=session)
    assert [event.outcome for event in recording.requests] == ["success"] * 3
    assert {event.version for event in recording.requests} == {1}
    # The phases never overlap (as in Triton): together they fit in the request's time.
    assert all(event.total_s >= event.queue_s + event.compute_input_s + event.compute_s
               + event.compute_output_s for event in recording.requests)
    assert sum(event.batch_size for event in recording.batches) == 3
    assert "serving observer Broken failed and is unsubscribed" in caplog.text
    # Triton's statistics count every phase of the four successful requests.
    inference = stats["inference_stats"]
    for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[phase]["count"] == 4, phase
    assert inference["compute_infer"]["ns"] > 0 and inference["compute_input"]["ns"] > 0
    assert sum(entry["compute_infer"]["count"] for entry in stats["batch_stats"]) == \
        stats["execution_count"]


def test_sigterm_during_a_session_drains_and_ends_as_terminated(daemon: Daemon) -> None:
    async def session(port: int) -> None:
        await infer_async(port)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()

    seen: list[DaemonState] = []
    daemon.add_state_listener(seen.append)
    with pytest.raises(Terminated):
        run_foreground(daemon, session=session)
    assert seen[-1] is DaemonState.STOPPED


# -- found by a review of the lifecycle: stops that overlap, start and stop crossing, tasks ------


def slow_batches(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every batch takes ``seconds`` on the backend (the real ONNX Runtime run, then a wait)."""
    from agent.backends.onnxruntime import OnnxRuntimeBackend

    real_run = OnnxRuntimeBackend.run

    def slow_run(self: Any, batch: Any) -> Any:
        outputs = real_run(self, batch)
        time.sleep(seconds)
        return outputs

    monkeypatch.setattr(OnnxRuntimeBackend, "run", slow_run)


def test_overlapping_and_cancelled_stops_wait_for_the_one_stop(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_batches(monkeypatch, 0.5)
    seen: list[DaemonState] = []
    daemon.add_state_listener(seen.append)

    async def main() -> list[Any]:
        port = await daemon.start()
        request = asyncio.ensure_future(infer_async(port))
        while not daemon.services["tiny"].batcher.load().busy_instances:
            await asyncio.sleep(0.01)
        impatient = asyncio.ensure_future(daemon.stop())  # cancelled below, mid-drain
        await asyncio.sleep(0.05)
        impatient.cancel()
        patient = await asyncio.gather(daemon.stop(), daemon.stop(), request,
                                       return_exceptions=True)
        return [impatient.cancelled(), *patient]

    # The cancelled caller did not cut the stop short: the batch in flight was answered, and
    # the states went through once.
    assert asyncio.run(main()) == [True, None, None, None]
    assert seen == [DaemonState.STARTING, DaemonState.SERVING, DaemonState.STOPPING,
                    DaemonState.STOPPED]


def test_a_stop_during_the_start_waits_for_it_to_give_up(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent import runtime

    real_start = runtime.start_backends
    loading = asyncio.Event()

    def slow_start(*args: Any) -> Any:
        daemon._loop.call_soon_threadsafe(loading.set)  # type: ignore[union-attr]
        time.sleep(0.3)  # the instances load meanwhile; the stop request is checked after
        return real_start(*args)

    monkeypatch.setattr(runtime, "start_backends", slow_start)

    async def main() -> tuple[BaseException | int, DaemonState]:
        start = asyncio.ensure_future(daemon.start())
        await loading.wait()
        await daemon.stop()
        state = daemon.state
        outcome = (await asyncio.gather(start, return_exceptions=True))[0]
        return outcome, state

    outcome, state = asyncio.run(main())
    assert isinstance(outcome, StopRequested) and state is DaemonState.STOPPED
    assert daemon.server is None and daemon.services == {}


def test_a_task_may_stop_the_daemon_itself(daemon: Daemon) -> None:
    async def control() -> None:
        await asyncio.sleep(0.05)
        await daemon.stop()  # as a control command would: the run then ends

    daemon.add_task("control", control)

    async def serve_forever(port: int) -> None:
        await asyncio.Event().wait()

    # A hang guard, not a timing check: a run the task's stop did not end is ended by a signal
    # after 30 s, and then fails the assertion (Terminated, not StopRequested).
    guard = threading.Timer(30, os.kill, (os.getpid(), signal.SIGTERM))
    guard.start()
    try:
        with pytest.raises(StopRequested, match="asked to stop before its session finished"):
            run_foreground(daemon, session=serve_forever)
    finally:
        guard.cancel()
    assert daemon.state is DaemonState.STOPPED and daemon.server is None
    assert _own_tasks(daemon)[0].state is TaskState.STOPPED


@pytest.mark.parametrize("critical", [False, True])
def test_a_task_whose_setup_fails_is_a_failed_task(daemon: Daemon, critical: bool) -> None:
    def broken_setup() -> Any:
        raise RuntimeError("no sysfs here")

    async def fine() -> None:
        await asyncio.Event().wait()

    daemon.add_task("power", broken_setup, critical=critical)
    daemon.add_task("other", fine)

    async def session(port: int) -> list[Any]:
        await infer_async(port)
        return _own_tasks(daemon)

    if critical:
        with pytest.raises(AgentError, match="a critical background task failed"):
            run_foreground(daemon, session=session)
        assert daemon.state is DaemonState.FAILED
        return
    status = run_foreground(daemon, session=session)
    assert [(task.name, task.state) for task in status] == [("power", TaskState.FAILED),
                                                           ("other", TaskState.RUNNING)]
    assert status[0].error == "no sysfs here" and daemon.state is DaemonState.STOPPED


def test_a_task_that_never_ends_does_not_keep_the_process(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import agent.run

    monkeypatch.setattr(agent.run, "LEFTOVER_TIMEOUT_S", 0.2)
    stubborn_daemon = Daemon(daemon.config, task_stop_timeout_s=0.1)

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # a bug: it never lets go

    stubborn_daemon.add_task("stubborn", stubborn)
    run_foreground(stubborn_daemon, session=lambda port: asyncio.sleep(0))
    assert stubborn_daemon.state is DaemonState.STOPPED
    assert "did not end 0 s after it was cancelled at exit; abandoned" in caplog.text


_STUCK_EXECUTOR = """
import asyncio, logging, sys, threading
import agent.run as run
logging.basicConfig(level=logging.ERROR)
run.EXECUTOR_TIMEOUT_S = 0.5
run.EXIT_JOIN_S = 0.2
never = threading.Event()

async def main() -> int:
    loop = asyncio.get_running_loop()
    loop.run_in_executor(None, never.wait)  # a job stuck for good
    await loop.run_in_executor(None, lambda: None)  # and one that ends
    return int(sys.argv[1])

status = run._run_loop(main())
run.exit_if_abandoned(status)
print("returned to the interpreter's exit", flush=True)
"""


def test_a_job_stuck_in_the_default_executor_does_not_keep_the_process() -> None:
    """Without a bound, the interpreter's exit joins the stuck thread for good."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STUCK_EXECUTOR, "7"], capture_output=True,
                          check=False, text=True, timeout=30, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 7, done.stderr
    assert time.monotonic() - started < 20
    assert "did not finish 0 s after the daemon stopped (agent-io" in done.stderr
    assert "exiting with 1 thread(s) still running: agent-io" in done.stderr
    assert "returned to the interpreter's exit" not in done.stdout


def test_a_run_whose_jobs_end_leaves_through_the_interpreter() -> None:
    import agent.run

    async def main() -> int:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: 5)

    assert agent.run._run_loop(main()) == 5
    assert agent.run._abandoned == []
    agent.run.exit_if_abandoned(0)  # returns: nothing was abandoned


def test_the_signal_handlers_are_as_they_were_after_a_run(daemon: Daemon) -> None:
    def mine(*_: Any) -> None:
        pass

    before = {signum: signal.signal(signum, mine) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        run_foreground(daemon, session=lambda port: asyncio.sleep(0))
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is mine
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_failed_or_stopped_start_lets_go_of_the_state_directory(daemon: Daemon) -> None:
    """A listener told STOPPED or FAILED may count on the state directory being free: another
    process opens it then."""
    probe = ("import sys; from agent.store import ModelStore\n"
             "ModelStore(sys.argv[1], trusted_keys=[]).open().close()\n")
    opened: list[int] = []

    def on_state(state: DaemonState) -> None:
        if state in (DaemonState.STOPPED, DaemonState.FAILED):
            opened.append(subprocess.run([sys.executable, "-c", probe,
                                          str(daemon.config.state_dir)],
                                         capture_output=True, timeout=60).returncode)

    daemon.add_state_listener(on_state)
    daemon.request_stop()  # before the start: it stops at once
    run_foreground(daemon)
    (daemon.config.state_dir / "current").write_bytes(b"garbage")
    failing = Daemon(daemon.config)
    failing.add_state_listener(on_state)
    with pytest.raises(AgentError, match="pointer is corrupt"):
        run_foreground(failing)
    assert opened == [0, 0]


@pytest.mark.parametrize("how", ["signal", "code"])
def test_a_cut_session_ends_by_what_stopped_it_whatever_the_session_does(
        daemon: Daemon, how: str) -> None:
    async def session(port: int) -> str:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            daemon.request_stop()  # a component, not an operator
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "pretends it finished"
        return "finished"

    expected = Terminated if how == "signal" else StopRequested
    with pytest.raises(expected):
        run_foreground(daemon, session=session)
    assert daemon.state is DaemonState.STOPPED
