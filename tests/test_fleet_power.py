"""Power in the fleet documents (agent/fleet/): ``desired.power`` sets the governor's policy,
``reported.power`` says its state, and the ``power.wake`` command wakes the board; over a real
control plane (no broker: its outbox), a real updater with fake steps, and the real power service
on the doubles of tests/power_daemon_doubles.py over a fake board tree."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent.config import PowerConfig
from agent.fleet import documents as docs
from agent.power.service import PowerParts, PowerService
from tests.power_boards import fake_board
from tests.power_daemon_doubles import StrictController, TreeBoard
from tests.test_fleet_device import KEY, Plane, command, desired, run

jsonschema = pytest.importorskip("jsonschema")


def schema(kind: str) -> Any:
    return jsonschema.Draft202012Validator(docs.load_schema(kind))


class Governed:
    """A power service running on the doubles, for one scenario."""

    def __init__(self, tmp_path: Path) -> None:
        tree = fake_board(tmp_path)
        self.controllers: list[StrictController] = []

        def make_controller(board: Any, policy: Any, saved: Any, config: Any) -> Any:
            self.controllers.append(StrictController(board, policy, saved))
            return self.controllers[-1]

        self.service = PowerService(
            PowerConfig(enabled=True, root=tree.root, idle_after_s=30.0, sleep_after_s=60.0),
            tmp_path / "state", batchers=lambda: [],
            parts=PowerParts(open_board=lambda config: TreeBoard(tree),
                             make_controller=make_controller))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PowerService:
        self.task = asyncio.ensure_future(self.service.run())
        while not self.service.status()["running"]:
            await asyncio.sleep(0.01)
        return self.service

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_desired_power_sets_the_policy_and_reported_says_the_state(tmp_path: Path) -> None:
    governed = Governed(tmp_path)

    async def scenario() -> None:
        async with governed as power, Plane(tmp_path) as plane:
            plane.device.power = power
            document = desired(2, model_version=None,
                               power={"profile": "max", "latency_target_s": 0.02})
            await plane.send("desired", docs.sign(document, KEY))
            await plane.settled()
            assert power.status()["policy"]["profile"] == "max"
            assert governed.controllers[0].policy.latency_target_s == 0.02
            events = [event.type for event in plane.events()]
            assert "power.policy" in events and "desired.refused" not in events
            ((_, response),) = plane.responses(await plane.send(
                "cmd", command("s1", "status", key=None, expires_at=None)))
            reported = response.result["reported"]
            schema("reported").validate(reported)
            assert reported["power"]["profile"] == "max"
            assert reported["power"]["state"] == "active"
            assert reported["power"]["power_mw"] == 5000
            assert docs.Reported.from_json(reported).power == reported["power"]
            assert reported["desired"]["status"] == "converged"

    run(scenario)


@pytest.mark.parametrize("power", [{"profile": "turbo"}, {"latency_target_s": "fast"},
                                   {"root": "/"}])
def test_a_bad_desired_power_is_refused_and_changes_nothing(tmp_path: Path,
                                                           power: dict[str, Any]) -> None:
    governed = Governed(tmp_path)

    async def scenario() -> None:
        async with governed as service, Plane(tmp_path) as plane:
            plane.device.power = service
            await plane.send("desired", docs.sign(desired(2, power=power), KEY))
            await plane.settled()
            refused = [event for event in plane.events() if event.type == "desired.refused"]
            assert refused and refused[0].detail["reason"] == "bad_power"
            assert "power." in refused[0].detail["message"]  # names the key
            assert service.status()["policy"]["profile"] == "governed"
            assert plane.updater.status()["state"] == "idle"  # the model was not touched

    run(scenario)


def test_the_power_wake_command_may_come_unsigned(tmp_path: Path) -> None:
    governed = Governed(tmp_path)

    async def scenario() -> None:
        async with governed as service, Plane(tmp_path) as plane:
            plane.device.power = service
            payload = command("w1", "power.wake", key=None, expires_at=None)
            schema("cmd").validate(json.loads(payload))
            ((_, response),) = plane.responses(await plane.send("cmd", payload))
            assert response.ok and response.result["wake_s"] >= 0
            assert [name for name, _ in governed.controllers[0].events].count("woken") == 1
            assert 'trigger="mqtt"' in service.metrics.render().decode()

    run(scenario)


def test_without_power_the_device_says_so(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            ((_, response),) = plane.responses(await plane.send(
                "cmd", command("w1", "power.wake", key=None, expires_at=None)))
            assert not response.ok and response.error is not None
            assert response.error.reason == "no_power"
            ((_, status),) = plane.responses(await plane.send(
                "cmd", command("s1", "status", key=None, expires_at=None)))
            assert "power" not in status.result["reported"]  # absent, not null

    run(scenario)
