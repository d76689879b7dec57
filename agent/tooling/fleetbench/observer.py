"""The benchmark's own view of the fleet, apart from whatever drives the rollouts: an operator
connection (the operator certificate, on the operator listener) subscribed to every device's
retained ``desired`` and ``reported`` documents, from which the phases are timed.

A device has *converged* on a model version when its newest ``reported`` answers the newest
``desired`` document the broker holds for it (the same document version) with status
``converged``, that document names the version, and the model it reports applied is that version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.errors import DocumentError
from agent.fleet import topics
from agent.fleet.documents import Desired, Reported, decode, open_envelope
from agent.fleet.mqtt import BrokerOptions, Message, MqttLink

__all__ = ["FleetObserver", "Standing"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Standing:
    """Where a device stands with a model version: ``converged``, ``failed`` (its desired
    status is failed or refused), ``applying`` (it took up the document naming the version),
    ``waiting`` (the document is out, not taken up yet) or ``other`` (its desired document
    names another version, or there is none)."""

    status: str
    reason: str | None = None
    applied: int | None = None


class FleetObserver:
    """Keeps the newest ``desired`` and ``reported`` document of every device of ``fleet``.

    Args:
        options: The operator identity's broker options (its own client id).
        fleet: The fleet id.
        keys: The fleet keys the desired documents are verified with.
    """

    def __init__(self, options: BrokerOptions, *, fleet: str,
                 keys: Sequence[Ed25519PublicKey]) -> None:
        self.fleet = fleet
        self.keys = list(keys)
        self.desired: dict[str, Desired] = {}
        self.reported: dict[str, Reported] = {}
        self.connects = 0
        self.messages = 0
        # (device, model version) -> when it was first seen converged on it (monotonic).
        self.converged_at: dict[tuple[str, int], float] = {}
        # Called after every message taken in, on the loop; must not block.
        self.hooks: list[Callable[[], None]] = []
        self.changed = asyncio.Event()
        self.link = MqttLink(options, subscriptions=[
            (topics.fleet_filter(fleet, topics.DESIRED), 1),
            (topics.fleet_filter(fleet, topics.REPORTED), 1)],
            on_message=self._message, on_connect=self._connected)

    async def start(self) -> None:
        await self.link.start()
        await self.link.wait_connected(CONNECT_TIMEOUT_S)

    async def stop(self) -> None:
        await self.link.stop()

    async def _connected(self, session_present: bool) -> None:
        self.connects += 1
        self.changed.set()

    async def _message(self, message: Message) -> None:
        self.messages += 1
        try:
            parsed = topics.parse_topic(message.topic)
            device = parsed.device
            if device is None or not message.payload:
                return
            if parsed.leaf == topics.DESIRED:
                desired: Desired = open_envelope(message.payload, self.keys,
                                                 expect=Desired).document
                known = self.desired.get(device)
                if known is None or desired.version >= known.version:
                    self.desired[device] = desired
            elif parsed.leaf == topics.REPORTED:
                reported: Reported = decode(message.payload, Reported)
                seen = self.reported.get(device)
                # A broker restored from an older save sends older retained documents again.
                if seen is None or reported.sequence >= seen.sequence:
                    self.reported[device] = reported
        except DocumentError as exc:
            log.warning("the observer could not read a message on %s: %s", message.topic, exc)
            return
        wanted = self.desired.get(device)
        if wanted is not None and wanted.model is not None:
            version = wanted.model.version
            if self.standing(device, version).status == "converged":
                self.converged_at.setdefault((device, version), time.monotonic())
        for hook in list(self.hooks):
            hook()
        self.changed.set()

    # -- the view -------------------------------------------------------------------------------

    def desired_version(self, device: str) -> int:
        """The version of the newest desired document seen for ``device`` (0: none)."""
        known = self.desired.get(device)
        return 0 if known is None else known.version

    def standing(self, device: str, model_version: int) -> Standing:
        desired, reported = self.desired.get(device), self.reported.get(device)
        applied = reported.applied.version if reported and reported.applied else None
        if desired is None or desired.model is None or desired.model.version != model_version:
            return Standing("other", applied=applied)
        answered = reported.desired if reported is not None else None
        if answered is None or answered.version != desired.version:
            return Standing("waiting", applied=applied)
        if answered.status == "converged" and applied == model_version:
            return Standing("converged", applied=applied)
        if answered.status in ("failed", "refused"):
            return Standing("failed", answered.reason, applied)
        return Standing("applying", applied=applied)

    def tally(self, devices: Sequence[str], model_version: int) -> dict[str, int]:
        counts = {"converged": 0, "applying": 0, "waiting": 0, "failed": 0, "other": 0}
        for device in devices:
            counts[self.standing(device, model_version).status] += 1
        return counts

    async def wait_for(self, done: Callable[[], bool], *, timeout_s: float,
                       progress: Callable[[], None] | None = None,
                       progress_every_s: float = 2.0) -> bool:
        """Wait until ``done()`` (checked on every change), at most ``timeout_s``; calls
        ``progress`` every ``progress_every_s``. Whether it came true."""
        deadline = time.monotonic() + timeout_s
        next_progress = time.monotonic() + progress_every_s
        while True:
            self.changed.clear()  # before the check: a change during it is not missed
            if done():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if progress is not None and now >= next_progress:
                progress()
                next_progress = now + progress_every_s
            try:
                await asyncio.wait_for(self.changed.wait(),
                                       max(0.0, min(deadline, next_progress) - now))
            except asyncio.TimeoutError:
                pass


def observer_client_id() -> str:
    return f"bench-observer-{os.getpid()}"
