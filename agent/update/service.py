"""The updater attached to a daemon: its background task and its commands on the control channel.

:func:`attach_updater` makes the :class:`~agent.update.updater.Updater` with the daemon's steps
(agent/update/steps.py), runs it as a background task (its recovery first, as the daemon starts
serving) and answers ``update.apply``, ``update.status`` and ``update.rollback``
(agent/control/protocol.py) from it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import TYPE_CHECKING, Any

from agent.control import protocol
from agent.config import UpdateConfig
from agent.control.server import Emit
from agent.errors import UpdateError
from agent.update.canary import CanaryPolicy
from agent.update.download import DownloadPolicy
from agent.update.states import UpdatePolicy, UpdateState
from agent.update.steps import DaemonSteps
from agent.update.updater import Updater, UpdateRequest

if TYPE_CHECKING:
    from agent.daemon import Daemon

log = logging.getLogger(__name__)

# How long a command arriving as the daemon starts waits for the updater's recovery (a
# recovery that finishes a rollback loads a model); past it, the command is refused as not_ready.
RECOVERY_WAIT_S = 60.0
# Where ``update.apply --wait`` stops waiting: the update ended, or its new version serves.
_SETTLED = frozenset({UpdateState.IDLE.value, UpdateState.FAILED.value,
                      UpdateState.COMMITTED.value})


def policies(config: UpdateConfig) -> tuple[UpdatePolicy, CanaryPolicy, DownloadPolicy]:
    """The updater's deadlines, the canary's gates and the download bounds from ``[update]``.
    A state's deadline leaves room beyond the work it bounds: the canary's beyond its
    duration, the download state's beyond the download's own deadline."""
    return (
        UpdatePolicy(downloading_s=config.download_deadline_s + 60.0,
                     building_engine_s=config.building_engine_s,
                     canary_s=2 * config.canary_s + 60.0,
                     watch_window_s=config.watch_window_s,
                     max_failures=config.max_failures),
        CanaryPolicy(duration_s=config.canary_s, min_samples=config.canary_min_samples,
                     min_agreement=config.canary_min_agreement,
                     max_latency_ratio=config.canary_max_latency_ratio,
                     require_traffic=config.canary_require_traffic,
                     watch_max_failure_rate=config.watch_max_failure_rate),
        DownloadPolicy(deadline_s=config.download_deadline_s,
                       stall_timeout_s=config.download_stall_timeout_s,
                       max_bytes=config.max_bundle_mib << 20),
    )


def attach_updater(daemon: Daemon, *, policy: UpdatePolicy | None = None,
                   canary: CanaryPolicy | None = None,
                   download: DownloadPolicy | None = None) -> Updater:
    """Give ``daemon`` an updater: a background task and the ``update.*`` commands. The
    policies not given come from the configuration's ``[update]``."""
    configured = policies(daemon.config.update)
    policy = policy or configured[0]
    steps = DaemonSteps(daemon, canary=canary or configured[1],
                        download=download or configured[2],
                        drain_timeout_s=daemon.config.update.drain_timeout_s)
    updater = Updater(state_dir=daemon.config.state_dir, steps=steps, policy=policy)
    commands = UpdateCommands(daemon, updater, steps)

    async def run() -> None:
        # The file worker's start (an interpreter, at low priority) is paid here, once, rather
        # than by the first update.
        starting = asyncio.ensure_future(steps.start_worker())
        try:
            await updater.run()
        finally:
            starting.cancel()
            await steps.close()
            steps.shutdown()

    daemon.add_task("updater", run)
    daemon.control.register(protocol.UPDATE_APPLY, commands.apply)
    daemon.control.register(protocol.UPDATE_STATUS, commands.status)
    daemon.control.register(protocol.UPDATE_ROLLBACK, commands.rollback)
    daemon.updater = updater
    daemon.update_steps = steps
    return updater


class UpdateCommands:
    """The control channel's ``update.*`` handlers."""

    def __init__(self, daemon: Daemon, updater: Updater, steps: DaemonSteps) -> None:
        self.daemon = daemon
        self.updater = updater
        self.steps = steps

    async def apply(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        apply = protocol.ApplyArgs.from_json(args)
        await self.updater.until_recovered(timeout_s=RECOVERY_WAIT_S)
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.updater.add_listener(events.put_nowait)
        try:
            answer = await self.updater.request(UpdateRequest(source=apply.source))
            if answer.result != "started":
                if answer.result == "already_current":
                    return self.update_status()
                raise UpdateError(f"not applied: {answer.detail}", reason=answer.result)
            if not apply.wait:
                return self.update_status()
            await self._forward_until_outcome(events, answer.update_id, emit,
                                              until_committed=True)
            return self.update_status()
        finally:
            self.updater.remove_listener(events.put_nowait)

    async def status(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.update_status()

    async def rollback(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        await self.updater.until_recovered(timeout_s=RECOVERY_WAIT_S)
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.updater.add_listener(events.put_nowait)
        try:
            answer = await self.updater.rollback()
            update_id = answer.update_id
            await self._forward_until_outcome(events, update_id, emit)
            return self.update_status()
        finally:
            self.updater.remove_listener(events.put_nowait)

    async def _forward_until_outcome(self, events: asyncio.Queue[dict[str, Any]],
                                     update_id: str | None, emit: Emit, *,
                                     until_committed: bool = False) -> None:
        """Pass the update's events on until it ends (its outcome), or with
        ``until_committed`` until its new version serves; at once when nothing runs any more."""
        while True:
            if self.updater.running_update_id() != update_id and events.empty():
                return
            event = await events.get()
            if event.get("update_id") not in (None, update_id):
                continue
            forwarded = _forward(event)
            if forwarded is not None:
                emit(forwarded)
            if event.get("event") == "outcome" or (
                    until_committed and event.get("event") == "state"
                    and event.get("to") in _SETTLED):
                return

    def update_status(self) -> dict[str, Any]:
        """The updater's status in the control channel's shape (``protocol.UpdateStatus``)."""
        status = self.updater.status()
        services = self.daemon.services
        serving = None
        if len(services) == 1:
            service = next(iter(services.values()))
            serving = protocol.ModelVersion(name=service.name, version=service.version)
        update = status.get("update") or {}
        bundle = update.get("bundle") or {}
        target = None
        if update:
            target = protocol.UpdateTarget(source=update.get("source") or "rollback",
                                           name=bundle.get("name"), version=bundle.get("version"))
        progress = status.get("progress") or {}
        error = None
        outcome = status.get("last_outcome")
        if outcome and outcome.get("result") == "failed":
            error = protocol.UpdateFailure(reason=outcome.get("reason") or "failed",
                                           message=outcome.get("detail") or "")
        downloading = status["state"] == UpdateState.DOWNLOADING.value
        result = protocol.UpdateStatus(
            state=status["state"], serving=serving, target=target,
            attempts=status.get("attempt") or 0, since_unix_s=_unix_s(status.get("since")),
            done_bytes=progress.get("received_bytes") if downloading else None,
            total_bytes=progress.get("total_bytes") if downloading else None,
            error=error).to_json()
        # The updater's own account, for `update status --json` and the fleet side.
        result["updater"] = status
        return result


def _forward(event: dict[str, Any]) -> dict[str, Any] | None:
    """An updater event as the control channel's event, None for those it does not carry."""
    kind = event.get("event")
    if kind == "state":
        # Entering failed: its code only; the command's final answer gives the whole reason.
        message = (event.get("reason") if event["to"] == UpdateState.FAILED.value
                   else event.get("detail") or event.get("reason"))
        return protocol.StateEvent(state=event["to"], previous=event.get("from"),
                                   message=message).to_json()
    if kind == "progress" and "received_bytes" in event:
        return protocol.ProgressEvent(done_bytes=int(event["received_bytes"]),
                                      total_bytes=event.get("total_bytes")).to_json()
    return None


def _unix_s(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
