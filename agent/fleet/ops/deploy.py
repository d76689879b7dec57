"""Driving a rollout over the broker: ``deploy`` (a new one, or ``--resume``), ``watch`` (follow,
and take over one whose driver died) and ``rollback``.

The driver loops on :func:`agent.fleet.ops.rollout.advance`: each time the view of the fleet
changes (or every ``tick_s``), it advances the rollout, publishes the rollout document when it
changed (and at least every ``heartbeat_s``, so that others can tell it is alive), then the
desired documents and commands the step asked for. The rollout document goes first: a driver
killed between the two leaves a rollout that names desired documents the broker may not have,
and whoever resumes republishes them (they are rebuilt byte for byte from the rollout). After
every reconnect, and when resuming, the driver republishes whatever the broker lost: a desired
document older than the rollout's for a device, the rollout document itself.

Two drivers of one rollout: each sees the other's rollout documents; the one that sees a newer
revision from a driver whose heartbeat is fresh stops (``FleetError`` reason ``taken_over``). A
``deploy --resume`` refuses a rollout whose driver's heartbeat is fresh unless told to take over;
``watch`` takes over only a rollout whose driver went quiet for ``stale_after_s``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.errors import FleetError, InputError
from agent.fleet.documents import ModelSpec, utc_now
from agent.fleet.ops.artifacts import ArtifactIndex, bundle_url
from agent.fleet.ops.operator import OperatorLink
from agent.fleet.ops.rollout import (
    Driver,
    PublishDesired,
    Rollout,
    SendCommand,
    advance,
    begin_rollback,
    changes,
    snapshot,
)
from agent.fsutil import atomic_write_text, read_bounded

__all__ = [
    "DriveOptions",
    "RolloutDriver",
    "busy_devices",
    "driver_id",
    "driver_is_fresh",
    "index_resolver",
    "load_local",
    "make_rollout_id",
    "pick_for_resume",
    "turn_back",
]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
# Publications in flight at once (paho keeps up to 1000 queued; the broker's receive maximum is
# usually higher than this).
PUBLISH_BATCH = 64


@dataclass(frozen=True, kw_only=True)
class DriveOptions:
    """How a driver paces itself: a step at least every ``tick_s``; the rollout document again
    at least every ``heartbeat_s``; another driver counts as gone after ``stale_after_s``
    without a heartbeat."""

    tick_s: float = 1.0
    heartbeat_s: float = 15.0
    stale_after_s: float = 60.0


def driver_id() -> str:
    host = socket.gethostname().split(".")[0][:32] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(3)}"


def make_rollout_id(model: ModelSpec, now: datetime.datetime) -> str:
    stem = f"{model.name}-v{model.version}"[:43]
    return f"{stem}-{now.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"


def index_resolver(index: ArtifactIndex | None, base_url: str) -> Callable[[str, int],
                                                                         ModelSpec | None]:
    """Names a model version's bundle from the artifact index (None when it is not there)."""
    def resolve(name: str, version: int) -> ModelSpec | None:
        entry = index.find(name, version) if index is not None else None
        if entry is None or not base_url:
            return None
        return ModelSpec(name=name, version=version, url=bundle_url(base_url, entry),
                         sha256=entry.sha256)
    return resolve


def local_path(directory: Path, rollout_id: str) -> Path:
    return Path(directory) / f"{rollout_id}.json"


def save_local(directory: Path | None, rollout: Rollout) -> None:
    if directory is None:
        return
    try:
        atomic_write_text(local_path(directory, rollout.rollout_id),
                          json.dumps(rollout.to_json(), indent=1) + "\n", mode=0o600)
    except OSError as exc:  # the broker's copy is the one that matters
        log.warning("cannot keep the local copy of rollout %s: %s", rollout.rollout_id, exc)


def load_local(directory: Path | None, rollout_id: str) -> Rollout | None:
    """The local copy of a rollout this workspace drove, if any."""
    if directory is None:
        return None
    path = local_path(directory, rollout_id)
    try:
        data = json.loads(read_bounded(path, 16 * 1024 * 1024))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the local copy of the rollout: {exc}", path=path) from exc
    return Rollout.from_json(data)


def pick_for_resume(link: OperatorLink, rollout_id: str, local_dir: Path | None) -> Rollout:
    """The newest known state of a rollout: the broker's retained document or this workspace's
    copy, whichever has the higher revision.

    Raises:
        FleetError: (``unknown``) neither has it.
    """
    candidates = [rollout for rollout in (link.view.rollouts.get(rollout_id),
                                          load_local(local_dir, rollout_id))
                  if rollout is not None]
    if not candidates:
        known = sorted(link.view.rollouts)
        raise FleetError("no such rollout on the broker or in this workspace", reason="unknown",
                         rollout=rollout_id, known=",".join(known[-10:]) or "none")
    return max(candidates, key=lambda rollout: rollout.revision)


def busy_devices(link: OperatorLink, devices: Sequence[str]) -> dict[str, str]:
    """The devices of ``devices`` that a rollout not yet ended holds (device -> rollout id):
    two rollouts giving one device different models would undo each other."""
    wanted = set(devices)
    return {device: rollout.rollout_id for rollout in link.view.rollouts.values()
            if not rollout.final for device in rollout.devices if device in wanted}


def driver_is_fresh(rollout: Rollout, now: datetime.datetime, stale_after_s: float) -> bool:
    return rollout.driver is not None and (
        now - rollout.driver.heartbeat_at).total_seconds() < stale_after_s


class RolloutDriver:
    """Drives one rollout to a final state over an :class:`OperatorLink` that is started.

    Args:
        link: The operator's link (started and in sync).
        rollout: The rollout (new, resumed, or turned back with ``begin_rollback``).
        resolve: Names a model version's bundle (the artifact index).
        on_progress: Called with one line per change (stage, device, state).
        local_dir: Where a local copy of the rollout is kept (None: none).
        options: Pacing.
        clock: The current time (UTC).
    """

    def __init__(self, link: OperatorLink, rollout: Rollout, *,
                 resolve: Callable[[str, int], ModelSpec | None] | None = None,
                 on_progress: Progress | None = None, local_dir: Path | None = None,
                 options: DriveOptions = DriveOptions(), identity: str | None = None,
                 clock: Callable[[], datetime.datetime] = utc_now) -> None:
        self.link = link
        self.rollout = rollout
        self.identity = identity or driver_id()
        self._resolve = resolve
        self._progress = on_progress or (lambda line: None)
        self._local_dir = local_dir
        self._options = options
        self._clock = clock
        self._changed = asyncio.Event()
        self._published: str | None = None  # the rollout's JSON as last published, sans driver
        self._published_at: datetime.datetime | None = None
        self._shown: Rollout | None = None

    def notify(self) -> None:
        """Something in the view changed: step soon (OperatorLink's ``on_change``)."""
        self._changed.set()

    async def run(self) -> Rollout:
        """Drive until the rollout is final; returns it.

        Raises:
            FleetError: (``taken_over``) another driver is driving it now.
        """
        self._say(changes(None, self.rollout))
        self._shown = snapshot(self.rollout)
        await self._repair()
        while True:
            # Never a step on a view the broker is still filling after a connect (it would
            # take a device that has no documents yet for a new one): sync first, repair what
            # the broker lost, and check again, with no await between the check and the step.
            if not self.link.synced or self.link.reconnected.is_set():
                self.link.reconnected.clear()
                try:
                    await self.link.sync()
                except FleetError as exc:
                    log.warning("%s", exc)
                    continue
                await self._repair()
                continue
            self._check_not_taken_over()
            now = self._clock()
            actions = advance(self.rollout, self.link.view.views(list(self.rollout.devices)),
                              now, resolve=self._resolve)
            await self._publish_rollout(now)
            await self._perform_all(actions)
            self._say(changes(self._shown, self.rollout))
            self._shown = snapshot(self.rollout)
            # Final only once the broker has what the rollout names: a publication held while
            # the link was down goes out after the reconnect, and returning then would skip the
            # repair of what the broker lost meanwhile (the desired documents of a restarted
            # broker that had not saved them).
            if (self.rollout.final and self._published == self._content()
                    and self.link.synced and not self.link.reconnected.is_set()):
                return self.rollout
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self._options.tick_s)
            except asyncio.TimeoutError:
                pass

    def _say(self, lines: Sequence[str]) -> None:
        for line in lines:
            self._progress(line)

    def _check_not_taken_over(self) -> None:
        seen = self.link.view.rollouts.get(self.rollout.rollout_id)
        if seen is None or seen.driver is None or seen.driver.id == self.identity:
            return
        if seen.revision > self.rollout.revision or (
                seen.revision == self.rollout.revision and seen.driver.id < self.identity):
            raise FleetError("another operator process drives this rollout now",
                             reason="taken_over", rollout=self.rollout.rollout_id,
                             driver=seen.driver.id, revision=seen.revision)

    def _content(self) -> str:
        document = self.rollout.to_json()
        for key in ("driver", "updated_at", "revision"):
            document.pop(key)
        return json.dumps(document, sort_keys=True)

    async def _publish_rollout(self, now: datetime.datetime, *, force: bool = False) -> None:
        content = self._content()
        due = self._published_at is None or (
            now - self._published_at).total_seconds() >= self._options.heartbeat_s
        if not force and content == self._published and not due:
            return
        self.rollout.revision += 1
        self.rollout.updated_at = now
        self.rollout.driver = Driver(id=self.identity, heartbeat_at=now)
        save_local(self._local_dir, self.rollout)
        try:
            await self.link.publish_rollout(self.rollout)
        except FleetError as exc:
            log.warning("the rollout document was not published (retrying): %s", exc)
            return
        self._published, self._published_at = content, now

    async def _perform(self, action: PublishDesired | SendCommand) -> None:
        try:
            if isinstance(action, PublishDesired):
                await self.link.publish_desired(action.document)
            else:
                await self.link.send_command(action.document)
        except FleetError as exc:
            # A desired document is published again on reconnect (_repair); a lost command
            # leaves its device to the rollback timeout.
            log.warning("publishing to %s failed: %s", action.document.device, exc)

    async def _perform_all(self, actions: Sequence[PublishDesired | SendCommand]) -> None:
        """Publish a stage's documents a batch at a time: each publication waits for its
        acknowledgement, and a stage of hundreds must not wait for them one by one."""
        for start in range(0, len(actions), PUBLISH_BATCH):
            await asyncio.gather(*(self._perform(action)
                                   for action in actions[start:start + PUBLISH_BATCH]))

    async def _repair(self) -> None:
        """Republish what the broker does not have: the rollout document, and each device's
        desired document when the broker's is older than the rollout's."""
        await self._publish_rollout(self._clock(), force=True)
        missing: list[PublishDesired | SendCommand] = []
        for device in sorted(self.rollout.devices):
            wanted = self.rollout.wanted_desired(device)
            if wanted is None:
                continue
            held = self.link.view.desired.get(device)
            if held is None or held.version < wanted.version:
                missing.append(PublishDesired(wanted))
        await self._perform_all(missing)


def turn_back(rollout: Rollout, link: OperatorLink, now: datetime.datetime) -> None:
    """``fleet rollback ROLLOUT``: start the operator's rollback (the driver publishes it)."""
    begin_rollback(rollout, link.view.views(list(rollout.devices)), now, cause="operator")
