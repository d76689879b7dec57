"""The fleet's power documents over the real board layer and controller (a fake board tree from
power/sim/tree.py), probing what an operator's fleet tooling sends: a ``desired.power`` profile
while the board sleeps, a partial document after another, and ``power.wake`` to a sleeping
board. The control plane is test_fleet_device's (its outbox, no broker)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from agent.config import PowerConfig
from agent.fleet import documents as docs
from agent.power.service import PowerService
from power.sim.tree import FakeTree
from tests.power_boards import fake_board
from tests.test_fleet_device import KEY, Plane, command, desired, run

pytest.importorskip("jsonschema")


def gpu_limits(tree: FakeTree) -> tuple[int, int]:
    return (int(tree.get(f"{tree.gpu_freq_dir}/min_freq")),
            int(tree.get(f"{tree.gpu_freq_dir}/max_freq")))


class RealGoverned:
    """The power service on the real Board and Controller over a fake tree, sleeping soon."""

    def __init__(self, tmp_path: Path) -> None:
        self.tree = fake_board(tmp_path)
        self.original = gpu_limits(self.tree)
        self.service = PowerService(
            PowerConfig(enabled=True, root=self.tree.root, idle_after_s=0.05,
                        sleep_after_s=0.1, control_period_s=0.01, telemetry_period_s=0.05),
            tmp_path / "state", batchers=lambda: [])
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PowerService:
        self.task = asyncio.ensure_future(self.service.run())
        deadline = time.monotonic() + 20
        while self.service.status()["state"] != "sleeping":
            assert time.monotonic() < deadline, "the board never slept"
            assert not self.task.done(), self.task
            await asyncio.sleep(0.01)
        return self.service

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_a_desired_profile_while_the_board_sleeps_is_applied_not_refused(tmp_path: Path) -> None:
    governed = RealGoverned(tmp_path)
    table = governed.tree.board.gpu_hz
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with governed as power, Plane(tmp_path) as plane:
            plane.device.power = power
            await plane.send("desired", docs.sign(desired(2, model_version=None,
                                                          power={"profile": "max"}), KEY))
            await plane.settled()
            seen["events"] = [(event.type, event.detail) for event in plane.events()]
            seen["status"] = power.status()
            seen["limits"] = gpu_limits(governed.tree)
            # A later document with other keys: the policy is the configuration's with these
            # (the profile back to governed), as docs/power.md says.
            await plane.send("desired", docs.sign(desired(3, model_version=None,
                                                          power={"latency_target_s": 0.02}),
                                                  KEY))
            await plane.settled()
            seen["later"] = power.status()["policy"]

    run(scenario)
    assert "desired.refused" not in [kind for kind, _ in seen["events"]], seen["events"]
    assert seen["status"]["policy"]["profile"] == "max"
    assert seen["status"]["controller"]["state"] == "active"
    assert seen["limits"] == (table[-1], table[-1])
    assert seen["later"]["profile"] == "governed" and seen["later"]["latency_target_s"] == 0.02
    assert gpu_limits(governed.tree) == governed.original  # the stop restored the board


def test_power_wake_to_a_sleeping_board_raises_it_and_reports(tmp_path: Path) -> None:
    governed = RealGoverned(tmp_path)
    table = governed.tree.board.gpu_hz
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with governed as power, Plane(tmp_path) as plane:
            plane.device.power = power
            seen["asleep"] = gpu_limits(governed.tree)
            payload = command("w1", "power.wake", key=None, expires_at=None)
            ((_, response),) = plane.responses(await plane.send("cmd", payload))
            seen["response"] = response
            seen["limits"] = gpu_limits(governed.tree)

    run(scenario)
    response = seen["response"]
    assert seen["asleep"][1] == table[0]
    assert response.ok and response.result["wake_s"] >= 0
    assert response.result["power"]["state"] == "active"
    assert seen["limits"][1] > table[0]  # raised before the answer
    json.dumps(response.result)  # JSON-able as it goes out


def test_reported_power_says_when_the_governor_has_stopped(tmp_path: Path) -> None:
    """A governor whose thread failed: ``reported.power`` said the last state it had (say
    ``active``) as if it still governed; it now says it does not run, with no state."""
    from agent.power.service import PowerParts
    from tests.power_daemon_doubles import StrictController, TreeBoard

    class Failing(StrictController):
        def step(self, load: Any, completions: Any) -> None:
            super().step(load, completions)
            if self.steps == 3:
                raise OSError(5, "Input/output error", "min_freq")

    tree = fake_board(tmp_path)
    service = PowerService(
        PowerConfig(enabled=True, root=tree.root, control_period_s=0.01,
                    telemetry_period_s=0.05),
        tmp_path / "state", batchers=lambda: [],
        parts=PowerParts(open_board=lambda config: TreeBoard(tree),
                         make_controller=lambda board, policy, saved, config: Failing(
                             board, policy, saved)))
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        task = asyncio.ensure_future(service.run())
        while not service.status()["running"]:
            await asyncio.sleep(0.01)
        seen["running"] = service.reported()
        await asyncio.gather(task, return_exceptions=True)
        seen["stopped"] = service.reported()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert seen["running"]["running"] is True and seen["running"]["state"] == "active"
    assert seen["stopped"]["running"] is False and seen["stopped"]["state"] is None
    assert seen["stopped"]["power_mw"] is None


def test_a_reload_keeps_the_fleets_desired_power_over_the_new_configuration(
        tmp_path: Path) -> None:
    """desired.power {"profile": "max"}, then SIGHUP with an edited [power] (another key): the
    device took the file's policy whole and dropped the fleet's profile, while its desired
    status still said converged. Now the desired keys stay over the reloaded section."""
    import dataclasses

    from agent.power.service import PowerParts
    from tests.power_daemon_doubles import StrictController, TreeBoard

    tree = fake_board(tmp_path)
    controllers: list[StrictController] = []

    def make_controller(board: Any, policy: Any, saved: Any, config: Any) -> Any:
        controllers.append(StrictController(board, policy, saved))
        return controllers[-1]

    configured = PowerConfig(enabled=True, root=tree.root, idle_after_s=30.0, sleep_after_s=60.0)
    service = PowerService(configured, tmp_path / "state", batchers=lambda: [],
                           parts=PowerParts(open_board=lambda config: TreeBoard(tree),
                                            make_controller=make_controller))
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        task = asyncio.ensure_future(service.run())
        try:
            while not service.status()["running"]:
                await asyncio.sleep(0.01)
            async with Plane(tmp_path) as plane:
                plane.device.power = service
                await plane.send("desired", docs.sign(desired(2, model_version=None,
                                                              power={"profile": "max"}), KEY))
                await plane.settled()
                service.reload(dataclasses.replace(configured, thermal_margin_c=9.0))
                deadline = time.monotonic() + 20
                while controllers[0].policy.thermal_margin_c != 9.0:
                    assert time.monotonic() < deadline, "the reload never reached the governor"
                    await asyncio.sleep(0.01)
                while service.status()["policy"]["thermal_margin_c"] != 9.0:
                    await asyncio.sleep(0.01)
                seen["policy"] = service.status()["policy"]
                seen["controller"] = controllers[0].policy
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(scenario)
    assert seen["policy"]["profile"] == "max" and seen["policy"]["thermal_margin_c"] == 9.0
    assert seen["controller"].profile == "max"
