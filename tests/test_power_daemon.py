"""The power governor in the daemon (agent/power/service.py, the batcher's wake hook): a real
daemon serving a tiny model with ``[power]`` on over a fake board tree, whose files change.

The board and the controller are the doubles of tests/power_daemon_doubles.py (the board layer
and the governor are other modules' work); the daemon, the batcher, the service's thread, the
saved limits and the files are the real ones. No test asserts how long something took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from agent.backends.base import BackendOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import Batcher, BatchPolicy
from agent.config import load_config
from agent.control.client import ControlClient
from agent.control.protocol import SOCKET_NAME
from agent.daemon import Daemon
from agent.observers import BatchDone, ServingObserver
from agent.power.service import PowerParts
from power.saved import SavedSnapshot
from agent.run import run_foreground
from agent.supervisor import TaskState
from models.signing import load_private_key, write_keypair
from power.sim.tree import FakeTree
from power.types import OperatingPoint
from tests.power_boards import fake_board, serve_helper
from tests.power_daemon_doubles import StrictController, TreeBoard
from tests.tiny_models import artifacts_for, make_bundle, tiny_classifier


def images(count: int = 1) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(count, 3, 16, 16)).astype(np.float32)


# -- the batcher's wake hook ----------------------------------------------------------------------

@pytest.fixture()
def batcher(tmp_path: Path) -> Any:
    backend = OnnxRuntimeBackend(artifacts_for(tiny_classifier(tmp_path / "m" / "model.onnx")),
                                 BackendOptions(max_batch_size=8, threads=1))
    backend.activate()
    yield Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    backend.deactivate()


async def turns(count: int = 50) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_armed_requests_wait_for_the_wake_then_run(batcher: Batcher) -> None:
    calls: list[str] = []

    async def main() -> None:
        release = asyncio.Event()

        async def hook() -> None:
            calls.append("wake")
            await release.wait()
            calls.append("woken")

        batcher.set_wake_hook(hook)
        batcher.start()
        batcher.arm_wake()
        first = batcher.submit({"input": images()})
        second = batcher.submit({"input": images()})
        await turns()
        # Held, and one wake for both requests.
        assert calls == ["wake"] and not first.done() and not second.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        calls.append("answered")
        # Awake now: the next request goes at once, without the hook.
        await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        await batcher.stop()

    asyncio.run(main())
    assert calls == ["wake", "woken", "answered"]
    assert (batcher.wakes, batcher.wake_timeouts) == (1, 0)


@pytest.mark.parametrize("behaviour", ["hangs", "ignores_cancel", "raises"])
def test_a_bad_wake_hook_holds_requests_at_most_its_bound(batcher: Batcher,
                                                          behaviour: str) -> None:
    async def main() -> None:
        async def hook() -> None:
            if behaviour == "raises":
                raise RuntimeError("the board is gone")
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if behaviour == "hangs":
                    raise
            await asyncio.sleep(0.5)  # swallowed its cancellation: ends later by itself

        batcher.set_wake_hook(hook, timeout_s=0.2)
        batcher.start()
        batcher.arm_wake()
        result = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert result.outputs
        await batcher.stop()

    asyncio.run(main())
    assert batcher.wake_timeouts == (0 if behaviour == "raises" else 1)
    assert not batcher.wake_armed


def test_no_hook_or_not_armed_never_waits(batcher: Batcher) -> None:
    called: list[int] = []

    async def hook() -> None:
        called.append(1)

    async def main() -> None:
        batcher.start()
        batcher.arm_wake()  # no hook: nothing to arm
        assert not batcher.wake_armed
        await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        batcher.set_wake_hook(hook)  # set, but the board is awake
        await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        await batcher.stop()

    asyncio.run(main())
    assert called == [] and batcher.wakes == 0


# -- the daemon -----------------------------------------------------------------------------------

class Parts:
    """The injected board and controller, kept for the test to look at."""

    def __init__(self, tree: FakeTree, *, wake_delay_s: float = 0.0) -> None:
        self.tree = tree
        self.wake_delay_s = wake_delay_s
        self.board: TreeBoard | None = None
        self.controller: StrictController | None = None

    def parts(self) -> PowerParts:
        def open_board(config: Any) -> TreeBoard:
            assert config.root == self.tree.root
            self.board = TreeBoard(self.tree)
            return self.board

        def make_controller(board: Any, policy: Any, saved: Any, config: Any) -> Any:
            self.controller = StrictController(board, policy, saved,
                                               wake_delay_s=self.wake_delay_s)
            return self.controller

        return PowerParts(open_board=open_board, make_controller=make_controller)


@pytest.fixture()
def installed(tmp_path: Path) -> dict[str, Any]:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path))
    tree = fake_board(tmp_path)
    overrides = {"state_dir": tmp_path / "state", "http.port": 0,
                 "serving.backend": "onnxruntime",
                 "trust.public_keys": [Path(str(key_path) + ".pub")],
                 "power.enabled": True, "power.root": tree.root,
                 "power.idle_after_s": 0.05, "power.sleep_after_s": 0.1,
                 "power.control_period_s": 0.01, "power.telemetry_period_s": 0.05}
    config = load_config(None, env={}, overrides=overrides)
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    return {"config": config, "tree": tree}


def gpu_limits(tree: FakeTree) -> tuple[int, int]:
    return (int(tree.get(f"{tree.gpu_freq_dir}/min_freq")),
            int(tree.get(f"{tree.gpu_freq_dir}/max_freq")))


def infer(port: int) -> None:
    from agent.tooling.loadgen import encode_request

    body, header_length = encode_request("input", images(), datatype="FP32")
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/tiny/infer", data=body,
        headers={"Inference-Header-Content-Length": str(header_length),
                 "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


async def until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.01)


class WokenAtBatch(ServingObserver):
    """What the board was when a batch ran: woken or not, and the GPU's limits then (read at
    the batch, not after the answer: with the tests' short idle spells a loaded machine may
    have the board parked again by the time the test reads the files)."""

    def __init__(self, controller: StrictController, tree: FakeTree) -> None:
        self.controller = controller
        self.tree = tree
        self.seen: list[bool] = []
        self.limits: list[tuple[int, int]] = []

    def batch_done(self, event: BatchDone) -> None:
        self.seen.append(self.controller.woken.is_set())
        self.limits.append(gpu_limits(self.tree))


def wake_count(metrics: str, trigger: str) -> float:
    """The wake histogram's count for ``trigger`` in a /metrics page (0 when absent)."""
    import re

    found = re.search(r'^edge_agent_power_wake_duration_seconds_count\{trigger="%s"\} (\S+)$'
                      % trigger, metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_request_after_sleep_wakes_the_board_before_it_runs_and_stop_restores(
        installed: dict[str, Any]) -> None:
    tree: FakeTree = installed["tree"]
    original = gpu_limits(tree)
    original_snapshot = TreeBoard(tree).snapshot()
    table = tree.board.gpu_hz
    parts = Parts(tree, wake_delay_s=0.3)  # a wake the batcher must wait for
    daemon = Daemon(installed["config"], power_parts=parts.parts())
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        assert daemon.power is not None
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        seen["asleep"] = gpu_limits(tree)
        saved = SavedSnapshot(installed["config"].state_dir / "power" / "saved.json")
        seen["saved"] = json.loads(saved.path.read_text())["snapshot"]
        controller = parts.controller
        assert controller is not None
        watcher = WokenAtBatch(controller, tree)
        daemon.services["tiny"].observers.subscribe(watcher)
        await loop.run_in_executor(None, infer, port)
        seen["woken_at_batch"] = watcher.seen
        seen["awake"] = watcher.limits[0]
        seen["metrics"] = await loop.run_in_executor(None, scrape, port)
        seen["status"] = daemon.status()["power"]

    run_foreground(daemon, session=session)
    assert seen["asleep"] == (table[0], table[0])
    assert seen["woken_at_batch"] == [True]  # the batch ran after the wake, not beside it
    assert seen["awake"][1] == table[-1]
    metrics = seen["metrics"]
    assert wake_count(metrics, "request") == 1  # one request, one wake
    assert 'edge_agent_power_frequency_hertz{clock="gpu"}' in metrics
    assert 'edge_agent_power_rail_watts{rail="VDD_IN"} 5.0' in metrics
    assert 'edge_agent_power_temperature_celsius{zone="cpu"} 48.0' in metrics
    assert "edge_agent_power_decisions_total" in metrics
    assert seen["status"]["state"] in ("waking", "active", "idle", "sleeping")
    assert seen["saved"] == original_snapshot  # as the board was before the daemon
    # Shutdown: the controller stopped on its own thread, the files are as they were, and
    # nothing is left saved for the next start.
    controller = parts.controller
    assert controller is not None and controller.stopped
    assert parts.board is not None and threading.main_thread().ident not in parts.board.threads
    assert gpu_limits(tree) == original
    assert not (installed["config"].state_dir / "power" / "saved.json").exists()
    assert [t.state for t in daemon.supervisor.status() if t.name == "power"] == [
        TaskState.STOPPED]


def test_the_next_start_restores_what_a_killed_run_left(installed: dict[str, Any]) -> None:
    tree: FakeTree = installed["tree"]
    original = gpu_limits(tree)
    table = tree.board.gpu_hz
    state_dir = installed["config"].state_dir
    # What a run killed while the board slept leaves: its saved limits, the board at its floor.
    board = TreeBoard(tree)
    (state_dir / "power").mkdir(parents=True)
    SavedSnapshot(state_dir / "power" / "saved.json").save(board.snapshot())
    board.apply(OperatingPoint(gpu_min_hz=table[0], gpu_max_hz=table[0]))
    assert gpu_limits(tree) != original
    parts = Parts(tree)
    config = installed["config"]
    awake = dataclasses.replace(config, power=dataclasses.replace(
        config.power, idle_after_s=60.0, sleep_after_s=120.0))
    daemon = Daemon(awake, power_parts=parts.parts())
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        status = daemon.power.status() if daemon.power else {}
        seen["restored"] = status["restored_at_start"]
        client = ControlClient(state_dir / SOCKET_NAME)
        loop = asyncio.get_running_loop()
        seen["cli_status"] = await loop.run_in_executor(None, client.call, "power.status")
        seen["set"] = await loop.run_in_executor(
            None, lambda: client.call("power.set", {"changes": {"profile": "max"}}))
        seen["wake"] = await loop.run_in_executor(None, client.call, "power.wake")

    run_foreground(daemon, session=session)
    assert seen["restored"] is True
    assert seen["cli_status"]["running"] is True
    assert seen["set"]["policy"]["profile"] == "max"
    assert seen["wake"]["wake_s"] >= 0 and seen["wake"]["wakes"] == 1
    assert parts.controller is not None
    assert ("policy max", ) == tuple(name for name, _ in parts.controller.events
                                     if name.startswith("policy"))
    # The start put the killed run's saved limits back first (the controller then raised the
    # clocks), and the stop put them back again.
    assert gpu_limits(tree) == original
    assert not (state_dir / "power" / "saved.json").exists()


def test_power_off_attaches_nothing(installed: dict[str, Any]) -> None:
    config = installed["config"]
    off = dataclasses.replace(config, power=dataclasses.replace(config.power, enabled=False))
    daemon = Daemon(off)
    assert daemon.power is None
    assert "power" not in [task.name for task in daemon.supervisor.status()]
    assert "power.status" not in daemon.control.commands
    daemon.close()


def test_the_real_board_and_controller_govern_the_tree_and_stop_restores_it(
        installed: dict[str, Any]) -> None:
    """No doubles: power/board.py over the fake tree's files, power/controller.py's governor."""
    tree: FakeTree = installed["tree"]
    board_files = [f"{tree.gpu_freq_dir}/min_freq", f"{tree.gpu_freq_dir}/max_freq",
                   *(f"{policy}/scaling_max_freq" for policy in tree.policies)]
    original = {path: tree.get(path) for path in board_files}
    daemon = Daemon(installed["config"])
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        seen["asleep"] = {path: tree.get(path) for path in board_files}
        for _ in range(3):
            await loop.run_in_executor(None, infer, port)
        seen["status"] = daemon.power.status() if daemon.power else None
        seen["metrics"] = await loop.run_in_executor(None, scrape, port)

    run_foreground(daemon, session=session)
    assert seen["asleep"] != original  # the governor wrote the board's files
    # At least the first request woke the board (on a loaded machine the 50 ms idle spell may
    # pass between two of the three, which wakes it again).
    assert wake_count(seen["metrics"], "request") >= 1
    assert seen["status"]["wakes"] >= 1
    assert {path: tree.get(path) for path in board_files} == original
    assert not (installed["config"].state_dir / "power" / "saved.json").exists()


def test_a_killed_daemons_next_start_restores_the_board(installed: dict[str, Any],
                                                       tmp_path: Path) -> None:
    """``edge-agent serve`` in a process of its own, with the real board layer and controller,
    SIGKILLed while the board sleeps at its governed limits; the next start puts the board's
    own limits back before governing, and its stop leaves them so."""
    import os
    import signal
    import subprocess
    import sys

    config = installed["config"]
    tree: FakeTree = installed["tree"]
    board_files = [f"{tree.gpu_freq_dir}/min_freq", f"{tree.gpu_freq_dir}/max_freq",
                   *(f"{policy}/scaling_max_freq" for policy in tree.policies)]
    original = {path: tree.get(path) for path in board_files}
    config_file = tmp_path / "agent.toml"
    config_file.write_text(
        f'state_dir = "{config.state_dir}"\n[http]\nport = 0\n[serving]\nbackend = "onnxruntime"\n'
        f'[trust]\npublic_keys = ["{config.trust.public_keys[0]}"]\n'
        f'[power]\nenabled = true\nroot = "{tree.root}"\nidle_after_s = 0.05\n'
        "sleep_after_s = 0.1\ncontrol_period_s = 0.01\ntelemetry_period_s = 0.05\n")
    # The daemon's log goes to a file, not a pipe nobody reads while it runs: a full pipe
    # would block the daemon's logging (and with it the loop and the power thread).
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config",
                                    str(config_file)],
                                   env={**os.environ, "PYTHONPATH": os.getcwd()},
                                   stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        client = ControlClient(config.state_dir / SOCKET_NAME, connect_timeout_s=1.0)
        deadline = time.monotonic() + 60
        state = None
        while state != "sleeping":
            assert process.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the daemon's board never slept: " + \
                log_path.read_text()[-2000:]
            try:
                state = client.call("power.status", timeout_s=5.0)["state"]
            except Exception:  # noqa: BLE001 - not serving yet
                time.sleep(0.1)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert {path: tree.get(path) for path in board_files} != original  # left governed
    assert (config.state_dir / "power" / "saved.json").exists()

    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        seen["restored"] = daemon.power.status()["restored_at_start"] if daemon.power else None

    run_foreground(daemon, session=session)
    assert seen["restored"] is True
    assert {path: tree.get(path) for path in board_files} == original
    assert not (config.state_dir / "power" / "saved.json").exists()


def test_a_reload_hands_the_new_policy_to_the_controller(installed: dict[str, Any]) -> None:
    from agent.reload import reload

    tree: FakeTree = installed["tree"]
    parts = Parts(tree)
    config = installed["config"]
    awake = dataclasses.replace(config, power=dataclasses.replace(
        config.power, idle_after_s=60.0, sleep_after_s=120.0))
    daemon = Daemon(awake, power_parts=parts.parts())
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        new = dataclasses.replace(awake, power=dataclasses.replace(
            awake.power, profile="min", latency_target_s=0.2))
        seen["result"] = reload(daemon, new)
        await until(lambda: parts.controller is not None
                    and parts.controller.policy.profile == "min")
        # The service takes the policy as in force once the thread's call has answered on the
        # loop, a moment after the controller has it.
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["policy"]["profile"] == "min")
        seen["status"] = daemon.power.status() if daemon.power else None

    run_foreground(daemon, session=session)
    assert "power.profile" in seen["result"].applied
    assert seen["status"]["policy"]["latency_target_s"] == 0.2
    assert daemon.config.power.profile == "min"


def test_with_the_privileged_helper_every_write_goes_through_it(installed: dict[str, Any],
                                                                tmp_path: Path) -> None:
    """``[power] helper_socket``: the real board layer writes through power/helper.py's helper
    (served here on a socket of the test's), which keeps the board's originals."""
    import os

    from power.helper import PowerHelper

    tree: FakeTree = installed["tree"]
    board_files = [f"{tree.gpu_freq_dir}/min_freq", f"{tree.gpu_freq_dir}/max_freq"]
    original = {path: tree.get(path) for path in board_files}
    helper = PowerHelper(tree.root, allowed_uid=os.getuid())
    path = tmp_path / "power.sock"
    stop, thread = serve_helper(helper, path)
    config = installed["config"]
    daemon = Daemon(dataclasses.replace(config, power=dataclasses.replace(
        config.power, helper_socket=path)))
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        seen["kept"] = dict(helper.snapshot.files)
        seen["asleep"] = {p: tree.get(p) for p in board_files}

    try:
        run_foreground(daemon, session=session)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert seen["asleep"] != original
    # The helper saw the writes (it keeps what each file had before its first change).
    assert {p: seen["kept"][p] for p in board_files if p in seen["kept"]} == {
        p: original[p] for p in board_files if p in seen["kept"]}
    assert any(p in seen["kept"] for p in board_files)
    assert {p: tree.get(p) for p in board_files} == original


class FailingController(StrictController):
    """Fails its fifth step, as a board whose files went away would."""

    def step(self, load: Any, completions: Any) -> None:
        super().step(load, completions)
        if self.steps == 5:
            raise OSError(5, "Input/output error", "min_freq")


def test_a_failing_governor_is_a_failed_task_the_board_is_restored_and_serving_goes_on(
        installed: dict[str, Any]) -> None:
    tree: FakeTree = installed["tree"]
    original = gpu_limits(tree)
    made: list[FailingController] = []

    def make_controller(board: Any, policy: Any, saved: Any, config: Any) -> Any:
        made.append(FailingController(board, policy, saved))
        return made[-1]

    parts = PowerParts(open_board=lambda config: TreeBoard(tree), make_controller=make_controller)
    daemon = Daemon(installed["config"], power_parts=parts)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: any(task.name == "power" and task.state is TaskState.FAILED
                                for task in daemon.supervisor.status()))
        seen["limits"] = gpu_limits(tree)
        await asyncio.get_running_loop().run_in_executor(None, infer, port)  # still serves
        seen["metrics"] = await asyncio.get_running_loop().run_in_executor(None, scrape, port)

    run_foreground(daemon, session=session)
    assert made[0].stopped and seen["limits"] == original
    assert 'edge_agent_task_up{task="power"} 0.0' in seen["metrics"]
    # No stale readings or state from the governor that stopped: the board is restored.
    assert 'edge_agent_power_frequency_hertz{' not in seen["metrics"]
    assert '} 1.0' not in "\n".join(line for line in seen["metrics"].splitlines()
                                    if line.startswith("edge_agent_power_state{"))
    failed = [task for task in daemon.supervisor.status() if task.name == "power"]
    assert failed[0].error is not None and "Input/output error" in failed[0].error
