"""What an operator does to a daemon governing power, found wrong while probing it: a profile set
while the board sleeps, ``power trace`` into a file it cannot write or cut short by Ctrl-C,
conflicting profiles on one ``power set``. Real daemons (the real board layer and controller
over a fake board tree from power/sim/tree.py), the real CLI."""

from __future__ import annotations

import asyncio
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")

from agent.cli import main
from agent.control.client import ControlClient
from agent.control.protocol import SOCKET_NAME
from agent.daemon import Daemon
from agent.run import run_foreground
from power.sim.tree import FakeTree
from tests.power_boards import fake_board
from tests.test_power_daemon import gpu_limits, installed, until  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.parametrize("profile", ["max", "min", "stock"])
def test_a_profile_set_while_the_board_sleeps_is_applied(installed: dict[str, Any],  # noqa: F811
                                                         profile: str) -> None:
    """``power set max`` on a sleeping board: the controller refused it (sleeping -> active is
    not a transition) after it had already taken the policy, so the daemon and the governor
    disagreed on the profile. Now the board is woken first and the profile applies."""
    tree: FakeTree = installed["tree"]
    table = tree.board.gpu_hz
    original = gpu_limits(tree)
    config = installed["config"]
    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        client = ControlClient(config.state_dir / SOCKET_NAME)
        seen["set"] = await loop.run_in_executor(
            None, lambda: client.call("power.set", {"changes": {"profile": profile}},
                                      timeout_s=30.0))
        seen["limits"] = gpu_limits(tree)
        seen["status"] = daemon.power.status() if daemon.power else None

    run_foreground(daemon, session=session)
    assert seen["set"]["policy"]["profile"] == profile
    assert seen["status"]["policy"]["profile"] == profile
    assert seen["status"]["controller"]["state"] != "sleeping"
    if profile == "max":
        assert seen["limits"] == (table[-1], table[-1])
    elif profile == "stock":
        assert seen["limits"] == original  # the board's own settings
    assert gpu_limits(tree) == original  # and the stop restored the board


def test_two_profiles_in_one_set_are_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["max", "min"], ["max", "profile=min"]):
        assert main(["power", "set", *argv, "--state-dir", str(tmp_path / "none")]) != 0
        err = capsys.readouterr().err
        assert "power.profile" in err and "one profile" in err, err


@pytest.mark.parametrize("where", ["missing/dir/trace.csv", "a-directory"])
def test_trace_into_a_file_it_cannot_write_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    tree = fake_board(tmp_path)
    (tmp_path / "a-directory").mkdir()
    out = tmp_path / where
    rc = main(["power", "trace", "--state-dir", str(tmp_path / "none"), "--root",
               str(tree.root), "--duration", "0.2", "--interval", "0.1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err and str(out) in err and "--out" in err, err


def test_ctrl_c_during_a_trace_leaves_every_row_whole_and_says_how_many(tmp_path: Path) -> None:
    """SIGINT to a real ``edge-agent power trace`` on the board's files: the CSV has its
    header and whole rows up to the last, and the count is said."""
    tree = fake_board(tmp_path)
    out = tmp_path / "trace.csv"
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "power", "trace", "--state-dir", str(tmp_path / "none"),
         "--root", str(tree.root), "--duration", "60", "--interval", "0.02", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 4):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "no rows came"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
    assert process.returncode == 130
    text = out.read_text()
    assert text.endswith("\n")  # no half row
    rows = list(csv.reader(text.splitlines()))
    assert len(rows) >= 4 and all(len(row) == len(rows[0]) for row in rows)
    assert f"{len(rows) - 1} readings written to {out}" in err, err
    assert "Traceback" not in err


def test_a_stop_that_cannot_put_a_limit_back_keeps_the_saved_limits_for_the_next_start(
        installed: dict[str, Any]) -> None:  # noqa: F811
    """The GPU's devfreq files gone when the daemon stops (a driver reload): its limits could
    not be put back, so the saved limits stay; once the files are back, the next start puts
    them back. Before, the stop logged 'restored' and dropped the saved file, leaving the
    board at the sleep floor for good."""
    import shutil

    tree: FakeTree = installed["tree"]
    original = gpu_limits(tree)
    config = installed["config"]
    saved = config.state_dir / "power" / "saved.json"
    gpu_dir = tree.root / tree.gpu_freq_dir
    aside = tree.root.parent / "gpu-aside"
    daemon = Daemon(config)

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        assert gpu_limits(tree) != original
        shutil.move(str(gpu_dir), str(aside))

    run_foreground(daemon, session=session)
    assert saved.exists()  # kept: the GPU's limits were not put back
    shutil.move(str(aside), str(gpu_dir))
    assert gpu_limits(tree) != original  # still the sleep floor

    again = Daemon(config)
    seen: dict[str, Any] = {}

    async def restart(port: int) -> None:
        await until(lambda: again.power is not None and again.power.status()["running"])
        seen["restored"] = again.power.status()["restored_at_start"] if again.power else None

    run_foreground(again, session=restart)
    assert seen["restored"] is True
    assert gpu_limits(tree) == original
    assert not saved.exists()


def test_a_request_after_the_board_was_raised_otherwise_is_not_counted_as_a_wake(
        installed: dict[str, Any]) -> None:  # noqa: F811
    """The board asleep, then raised by ``power set max``: the batchers were left armed, so
    the next request went through the wake hook and counted a wake of an awake board."""
    import urllib.request

    from tests.test_power_daemon import infer, wake_count

    config = installed["config"]
    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        client = ControlClient(config.state_dir / SOCKET_NAME)
        await loop.run_in_executor(None, lambda: client.call(
            "power.set", {"changes": {"profile": "max"}}, timeout_s=30.0))
        await until(lambda: not any(model.batcher.wake_armed
                                    for model in daemon.services.values()))
        await loop.run_in_executor(None, infer, port)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                return r.read().decode()
        seen["metrics"] = await loop.run_in_executor(None, scrape)
        seen["wakes"] = daemon.power.status()["wakes"] if daemon.power else None

    run_foreground(daemon, session=session)
    assert wake_count(seen["metrics"], "request") == 0
    assert seen["wakes"] == 0


def test_power_off_serves_without_a_power_thread_metrics_or_board_writes(
        installed: dict[str, Any]) -> None:  # noqa: F811
    import dataclasses
    import threading
    import urllib.request

    from tests.test_power_daemon import infer

    config = installed["config"]
    tree: FakeTree = installed["tree"]
    files = sorted(path for path in tree.root.rglob("*") if path.is_file()
                   and not path.is_symlink())
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files}
    daemon = Daemon(dataclasses.replace(config, power=dataclasses.replace(config.power,
                                                                          enabled=False)))
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            await loop.run_in_executor(None, infer, port)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                return r.read().decode()
        seen["metrics"] = await loop.run_in_executor(None, scrape)
        seen["threads"] = [thread.name for thread in threading.enumerate()]
        seen["armed"] = [model.batcher.wake_armed for model in daemon.services.values()]

    run_foreground(daemon, session=session)
    assert "power" not in seen["threads"]
    assert "edge_agent_power_" not in seen["metrics"]
    assert seen["armed"] == [False]
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files} == before


def test_many_first_requests_after_sleep_wake_the_board_once(
        installed: dict[str, Any]) -> None:  # noqa: F811
    import concurrent.futures
    import dataclasses
    import urllib.request

    from tests.test_power_daemon import infer, wake_count

    config = installed["config"]
    tree: FakeTree = installed["tree"]
    table = tree.board.gpu_hz
    # Longer quiet spells than the fixture's, so that the burst itself cannot idle the board.
    config = dataclasses.replace(config, power=dataclasses.replace(
        config.power, idle_after_s=0.5, sleep_after_s=0.6))
    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        seen["asleep"] = gpu_limits(tree)

        def burst() -> None:
            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda _: infer(port), range(32)))  # each asserts a 200
        await loop.run_in_executor(None, burst)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                return r.read().decode()
        seen["metrics"] = await loop.run_in_executor(None, scrape)

    run_foreground(daemon, session=session)
    assert seen["asleep"] == (table[0], table[0])
    assert wake_count(seen["metrics"], "request") == 1
    assert "edge_agent_power_wake_timeouts_total 0.0" in seen["metrics"]


def test_a_trace_faster_than_the_daemons_telemetry_says_rows_repeat(
        installed: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """From a daemon a trace's rows are the daemon's latest reading (every telemetry_period_s,
    0.05 s here): a finer --interval repeated readings without a word."""
    config = installed["config"]
    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])

        def cli() -> None:
            seen["rc"] = main(["power", "trace", "--state-dir", str(config.state_dir),
                               "--duration", "0.1", "--interval", "0.02", "--out",
                               str(config.state_dir / "fast.csv")])
            seen["err"] = capsys.readouterr().err
        await asyncio.get_running_loop().run_in_executor(None, cli)

    run_foreground(daemon, session=session)
    assert seen["rc"] == 0
    assert "telemetry every 0.05 s" in seen["err"] and "repeat" in seen["err"], seen["err"]


def test_a_board_write_that_hangs_holds_a_request_at_most_the_wake_bound(
        installed: dict[str, Any]) -> None:  # noqa: F811
    """A sysfs write that never returns during a wake (a wedged BPMP): the first request
    waits ``wake_timeout_s`` and is served; the status still answers; the requests after it
    are not held; the stop leaves the saved limits for the next start (the thread could not
    restore them)."""
    import dataclasses
    import threading

    from agent.power.service import PowerParts
    from tests.power_daemon_doubles import StrictController, TreeBoard
    from tests.test_power_daemon import infer

    release = threading.Event()

    class WedgedOnWake(TreeBoard):
        def apply(self, point: Any) -> Any:
            if wedged.is_set():
                release.wait(60)  # the test releases it at the end
            return super().apply(point)

    wedged = threading.Event()
    tree: FakeTree = installed["tree"]
    made: list[StrictController] = []

    def make_controller(board: Any, policy: Any, saved: Any, config: Any) -> Any:
        made.append(StrictController(board, policy, saved))
        return made[-1]

    config = installed["config"]
    config = dataclasses.replace(config, power=dataclasses.replace(config.power,
                                                                    wake_timeout_s=0.2))
    daemon = Daemon(config, power_parts=PowerParts(open_board=lambda c: WedgedOnWake(tree),
                                                   make_controller=make_controller))
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping")
        wedged.set()
        started = time.monotonic()
        await loop.run_in_executor(None, infer, port)
        seen["first_s"] = time.monotonic() - started
        seen["status"] = daemon.power.status() if daemon.power else None
        await loop.run_in_executor(None, infer, port)
        seen["timeouts"] = [model.batcher.wake_timeouts for model in daemon.services.values()]

    try:
        run_foreground(daemon, session=session)  # its stop waits 10 s for the thread
        # Looked at before the write is released (the thread would then restore the board).
        assert (config.state_dir / "power" / "saved.json").exists()
    finally:
        release.set()
    assert seen["first_s"] < 10  # held by the 0.2 s bound, not by the wedged write
    assert seen["status"]["running"] is True
    assert seen["timeouts"] == [1]
