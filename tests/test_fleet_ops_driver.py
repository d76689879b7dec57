"""The rollout driver's loop (agent/fleet/ops/deploy.py) over a double of the operator's link
(the broker is the seam): a broker that restarts without its retained documents while the final
rollout document's publication is held must not let the driver end the rollout before it has
published the desired documents the broker lost."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from agent.fleet.documents import Desired
from agent.fleet.ops.deploy import DriveOptions, RolloutDriver
from agent.fleet.ops.rollout import Rollout
from tests.test_fleet_ops_rollout import NEW, Fleet, rollout_of


@dataclass
class LinkDouble:
    """What the driver uses of an OperatorLink, over the recorded fleet of the rollout tests.
    The broker restarts (and loses its retained desired documents) while the publication of a
    final rollout document waits for its acknowledgement: it goes out after the reconnect."""

    fleet: Fleet
    synced: bool = True
    reconnected: asyncio.Event = field(default_factory=asyncio.Event)
    desired_published: list[Desired] = field(default_factory=list)
    restarted: bool = False
    on_change: Any = None  # the driver's notify, as OperatorLink's on_change

    def __post_init__(self) -> None:
        self.view = SimpleNamespace(views=lambda devices: {d: self.fleet.views[d]
                                                           for d in devices},
                                    rollouts={}, desired={})

    async def sync(self) -> None:
        self.synced = True

    async def publish_rollout(self, rollout: Rollout) -> None:
        if rollout.final and not self.restarted:
            self.restarted = True
            self.view.desired.clear()  # the broker came back empty
            self.synced = False
            self.reconnected.set()

    async def publish_desired(self, document: Desired) -> None:
        self.desired_published.append(document)
        self.view.desired[document.device] = SimpleNamespace(version=document.version)
        # The device takes it and converges on it at once.
        self.fleet.answer(document.device, "converged", NEW, version=document.version)
        self.on_change()

    async def send_command(self, command: Any) -> None:
        raise AssertionError("no command in this rollout")



def test_a_rollout_is_not_final_before_the_lost_desired_documents_are_published_again() -> None:
    fleet = Fleet(["a", "b"])
    rollout = rollout_of(["a", "b"], fleet, stages=("100%",))

    async def scenario() -> Rollout:
        link = LinkDouble(fleet)
        driver = RolloutDriver(link, rollout, options=DriveOptions(tick_s=0.05))  # type: ignore
        link.on_change = driver.notify
        final = await asyncio.wait_for(driver.run(), 10)
        assert link.restarted
        # Each device's desired document: once for the stage, once more after the restart.
        assert sorted(d.device for d in link.desired_published) == ["a", "a", "b", "b"]
        assert sorted(link.view.desired) == ["a", "b"]
        return final

    final = asyncio.run(scenario())
    assert final.state == "completed"
