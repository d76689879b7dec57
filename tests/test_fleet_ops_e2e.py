"""Staged rollouts end to end: the operator's ``edge-agent fleet`` commands as separate processes,
real daemons serving the tiny model with their fleet control planes, a real Mosquitto run with
the production configuration ``fleet init`` wrote (TLS listeners, per-device passwords, the
ACL), and bundles fetched over HTTP from ``fleet serve``'s server.

- a staged deploy across three agents converges, ``status`` shows it, and ``rollback`` of the
  completed rollout takes every device back;
- a bundle the canary stage refuses on one device aborts the rollout at the canary stage, and
  every device that took it goes back, while the devices of later stages are never touched; a
  bundle that fails its warm-up (NaN) aborts a canary of one the same way;
- a deploy killed mid-way is resumed by ``deploy --resume --take-over``, and that one, killed in
  turn, is taken over by ``watch``;
- the broker killed mid-rollout and restarted with its store lost: every device converges and
  the rollout completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.config import load_config
from agent.daemon import Daemon
from agent.fleet.ops.artifacts import publish_bundle
from agent.fleet.ops.fileserver import serve_directory
from agent.fleet.ops.provision import add_device
from agent.update.canary import CanaryPolicy
from agent.update.states import UpdatePolicy
from models.signing import load_private_key, write_keypair
from tests.brokers import MOSQUITTO, free_port
from tests.fleet_ops_helpers import FleetBroker, make_workspace

pytest.importorskip("onnxruntime")
if not MOSQUITTO.exists():
    pytest.skip("mosquitto is not installed", allow_module_level=True)

from tests.tiny_models import make_bundle  # noqa: E402 - needs onnx

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 150.0


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    """A workspace with bundles v1 (installed everywhere), v2 (good), v3 (NaN outputs: fails
    its warm-up) and v4 (for device class orin-a only), published and served; its broker."""
    write_keypair(tmp_path / "keys" / "bundle.key")
    key = load_private_key(tmp_path / "keys" / "bundle.key")
    http_port = free_port()
    workspace = make_workspace(tmp_path / "fleet", bundle_keys=[tmp_path / "keys/bundle.key.pub"],
                               artifacts_base_url=f"http://127.0.0.1:{http_port}")
    bundles = {1: make_bundle(tmp_path / "b", version=1, key=key)[0],
               2: make_bundle(tmp_path / "b", version=2, key=key)[0],
               3: make_bundle(tmp_path / "b", version=3, key=key, fault="nan")[0],
               4: make_bundle(tmp_path / "b", version=4, key=key,
                              manifest_extra={"targets": ["orin-a"]})[0]}
    for bundle in bundles.values():
        publish_bundle(bundle, workspace.artifact_directory(), [key.public_key()])
    broker = FleetBroker(workspace).start()
    try:
        yield {"workspace": workspace, "bundles": bundles, "broker": broker,
               "http_port": http_port, "dir": tmp_path}
    finally:
        broker.close()


def make_daemon(fleet: dict[str, Any], name: str, device_class: str = "orin-a") -> Daemon:
    """A device provisioned with ``devices add`` and configured from the agent.toml it wrote
    (its files installed where they were written), running v1."""
    workspace = fleet["workspace"]
    out = workspace.devices_dir / name
    add_device(workspace, name, groups=["line1"], out_dir=out, install_dir=out)
    fleet["broker"].reload()  # the new password
    config = load_config(out / "agent.toml", env={}, overrides={
        "state_dir": fleet["dir"] / "state" / name, "http.port": 0,
        "serving.backend": "onnxruntime", "device_class": device_class,
        "fleet.reconnect_min_s": 0.05, "fleet.reconnect_max_s": 0.5})
    installer = Daemon(config)
    installer.make_current(installer.install(fleet["bundles"][1]))
    installer.close()
    return Daemon(config, canary_policy=CanaryPolicy(duration_s=0.3, min_samples=1,
                                                     watch_min_requests=1),
                  update_policy=UpdatePolicy(watch_window_s=0.5))


@contextlib.asynccontextmanager
async def running(fleet: dict[str, Any], daemons: list[Daemon]) -> AsyncIterator[None]:
    """The file server and the daemons, in this event loop."""
    stop = asyncio.Event()
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve_directory(
        fleet["workspace"].artifact_directory(), host="127.0.0.1", port=fleet["http_port"],
        stop=stop, started=started))
    await asyncio.wait_for(started, 10)
    for daemon in daemons:
        await daemon.start()
    try:
        yield
    finally:
        for daemon in daemons:
            await daemon.stop()
            daemon.close()
        stop.set()
        await server


class Cli:
    """``edge-agent fleet ...`` in a process of its own, its output read line by line."""

    def __init__(self, fleet: dict[str, Any], *args: str) -> None:
        self.args = ["fleet", args[0], "--fleet-dir", str(fleet["workspace"].root), *args[1:]]
        self.lines: list[str] = []  # its output
        self.log: list[str] = []  # its log (stderr)
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Cli:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", *self.args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None and self.process.stderr is not None

        async def read(stream: asyncio.StreamReader, into: list[str]) -> None:
            async for raw in stream:
                into.append(raw.decode(errors="replace").rstrip("\n"))

        await asyncio.gather(read(self.process.stdout, self.lines),
                             read(self.process.stderr, self.log))

    async def wait(self, timeout_s: float = CLI_TIMEOUT_S) -> int:
        assert self.process is not None and self._reader is not None
        try:
            code = await asyncio.wait_for(self.process.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise AssertionError(f"{self.args} did not end in {timeout_s} s:\n{self.output}")
        await self._reader
        return code

    async def until(self, text: str, timeout_s: float = CLI_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.process is not None
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise AssertionError(f"never printed {text!r}:\n{self.output}")
            await asyncio.sleep(0.02)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)

    @property
    def output(self) -> str:
        return "\n".join(self.lines + self.log)


async def cli(fleet: dict[str, Any], *args: str, expect: int = 0) -> Cli:
    """Run a command to its end; its exit status must be ``expect``."""
    command = await Cli(fleet, *args).start()
    code = await command.wait()
    assert code == expect, f"{args} exited {code}, not {expect}:\n{command.output}"
    return command


async def status(fleet: dict[str, Any]) -> dict[str, Any]:
    result = await cli(fleet, "status", "--json")
    return json.loads("\n".join(result.lines))  # type: ignore[no-any-return]


def serving(daemons: list[Daemon]) -> list[int]:
    return [daemon.services["tiny"].version for daemon in daemons]


def run(scenario: Any, timeout_s: float = 400.0) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout_s))


def test_a_staged_deploy_converges_on_every_agent_and_a_rollback_takes_them_back(
        fleet: dict[str, Any]) -> None:
    names = ["cam-1", "cam-2", "cam-3"]
    daemons = [make_daemon(fleet, name) for name in names]

    async def scenario() -> None:
        async with running(fleet, daemons):
            before = await status(fleet)
            assert [before["devices"][name]["applied"]["version"] for name in names] == [1] * 3
            assert all(before["devices"][name]["online"] for name in names)
            deploy = await cli(fleet, "deploy", "tiny", "2", "--group", "line1", "--stages",
                               "1,100%", "--id", "r-good", "--stage-timeout-s", "90")
            assert "stage 1/2 passed" in deploy.output and "stage 2/2 passed" in deploy.output
            assert "rollout r-good completed: 3 succeeded" in deploy.output
            assert serving(daemons) == [2, 2, 2]
            after = await status(fleet)
            for name in names:
                row = after["devices"][name]
                assert row["applied"]["version"] == 2
                assert row["desired"]["rollout"] == "r-good"
                assert row["desired_status"]["status"] == "converged"
            assert [(r["rollout_id"], r["state"]) for r in after["rollouts"]] == [
                ("r-good", "completed")]
            table = await cli(fleet, "status")
            assert any(line.startswith("cam-2") and "tiny 2" in line for line in table.lines)

            # One device back to what it ran before the rollout that wrote its desired
            # document, then the whole rollout (that device's way back is already done).
            one = await cli(fleet, "rollback", "--devices", "cam-2")
            assert "cam-2: back on tiny 1" in one.output
            assert serving(daemons) == [2, 1, 2]
            back = await cli(fleet, "rollback", "r-good")
            assert "rolled back: 3 of 3 devices back" in back.output
            assert serving(daemons) == [1, 1, 1]
            final = await status(fleet)
            assert final["devices"]["cam-1"]["desired"]["allow_downgrade"] is True

    run(scenario)


def test_a_bad_bundle_aborts_at_the_canary_stage_and_every_device_that_took_it_goes_back(
        fleet: dict[str, Any]) -> None:
    # v4 is for orin-a devices: cam-3, an orin-b, refuses it; cam-1 and cam-2 take it.
    classes = {"cam-1": "orin-a", "cam-2": "orin-a", "cam-3": "orin-b", "cam-4": "orin-a",
               "cam-5": "orin-a"}
    daemons = [make_daemon(fleet, name, device_class) for name, device_class in classes.items()]

    async def scenario() -> None:
        async with running(fleet, daemons):
            deploy = await cli(fleet, "deploy", "tiny", "4", "--all", "--canary", "3",
                               "--stages", "100%", "--abort-failure-share", "0.2",
                               "--abort-min-finished", "3", "--id", "r-targets", expect=3)
            assert "cam-3: failed (wrong_target)" in deploy.output
            assert "stage 1/2 aborted" in deploy.output
            assert "rollout r-targets aborted: 3 of 3 devices back" in deploy.output
            assert serving(daemons) == [1, 1, 1, 1, 1]
            table = await status(fleet)
            for name in ("cam-1", "cam-2", "cam-3"):
                row = table["devices"][name]
                assert row["desired"]["allow_downgrade"] is True, name
                assert row["desired"]["model"] == {"name": "tiny", "version": 1}
            for name in ("cam-4", "cam-5"):  # the later stage: never given anything
                assert table["devices"][name]["desired"] is None
            events = [line for line in deploy.output.splitlines() if "cam-1" in line]
            assert any("succeeded" in line for line in events), deploy.output  # it took v4

            # A bundle that fails its warm-up aborts a canary of one alike.
            nan = await cli(fleet, "deploy", "tiny", "3", "--all", "--canary", "1",
                            "--abort-min-finished", "1", "--id", "r-nan", expect=3)
            assert "non_finite" in nan.output
            assert "rollout r-nan aborted: 1 of 1 devices back" in nan.output
            assert serving(daemons) == [1, 1, 1, 1, 1]
            table = await status(fleet)
            reached = [name for name, row in table["devices"].items()
                       if row["desired"] and row["desired"]["rollout"] == "r-nan"]
            assert len(reached) == 1

    run(scenario)


def test_a_deploy_killed_mid_way_is_resumed_and_then_taken_over_by_watch(
        fleet: dict[str, Any]) -> None:
    names = ["cam-1", "cam-2", "cam-3", "cam-4"]
    daemons = [make_daemon(fleet, name) for name in names]

    async def scenario() -> None:
        async with running(fleet, daemons):
            first = await Cli(fleet, "deploy", "tiny", "2", "--all", "--stages", "1,2,100%",
                              "--id", "r-kill").start()
            await first.until("stage 1/3 started")
            first.kill()
            await first.wait()
            # Its heartbeat is fresh: a plain resume refuses to drive it alongside.
            refused = await cli(fleet, "deploy", "--resume", "r-kill", expect=1)
            assert "another process is driving this rollout" in refused.output
            # Nor does another rollout get the same devices meanwhile.
            other = await cli(fleet, "deploy", "tiny", "2", "--devices", "cam-4", expect=1)
            assert "in a rollout that has not ended" in other.output and "r-kill" in other.output
            second = await Cli(fleet, "deploy", "--resume", "r-kill", "--take-over").start()
            await second.until("stage 2/3 started")
            second.kill()
            await second.wait()
            watch = await cli(fleet, "watch", "r-kill", "--stale-after-s", "2")
            assert "driving it from here" in watch.output
            assert "rollout r-kill completed: 4 succeeded" in watch.output
            assert serving(daemons) == [2, 2, 2, 2]
            again = await cli(fleet, "deploy", "--resume", "r-kill")
            assert "has ended: completed" in again.output

    run(scenario)


def test_the_broker_killed_mid_rollout_and_restarted_without_its_store_every_device_converges(
        fleet: dict[str, Any]) -> None:
    names = ["cam-1", "cam-2", "cam-3"]
    daemons = [make_daemon(fleet, name) for name in names]
    broker = fleet["broker"]

    async def scenario() -> None:
        async with running(fleet, daemons):
            deploy = await Cli(fleet, "deploy", "tiny", "2", "--all", "--stages", "1,100%",
                               "--id", "r-restart").start()
            await deploy.until("stage 2/2 started")
            broker.kill()
            # Its retained documents (the rollout, the desired documents) are gone with it.
            shutil.rmtree(broker.directory / "store")
            (broker.directory / "store").mkdir()
            await asyncio.sleep(1.0)
            broker.restart()
            code = await deploy.wait()
            assert code == 0, deploy.output
            assert "rollout r-restart completed: 3 succeeded" in deploy.output
            assert serving(daemons) == [2, 2, 2]
            table = await status(fleet)
            assert [(r["rollout_id"], r["state"]) for r in table["rollouts"]] == [
                ("r-restart", "completed")]
            for name in names:
                assert table["devices"][name]["desired"]["rollout"] == "r-restart"
                assert table["devices"][name]["applied"]["version"] == 2

    run(scenario)
