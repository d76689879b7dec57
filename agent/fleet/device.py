"""The device's control plane (design §5.3): the daemon's side of fleet control over MQTT.

:class:`FleetDevice` is one of the daemon's supervised tasks. It holds one
:class:`~agent.fleet.mqtt.MqttLink` subscribed to the device's ``desired`` and ``cmd`` topics, and
drives the same :class:`~agent.update.updater.Updater` as the local control channel does.

``desired`` (signed): the envelope is opened with the fleet's keys, the document must name this
fleet and device, and its version must be higher than the last one accepted (an older one is
refused with an event, an equal one is the same document again: nothing to do). It is stored
(``<state_dir>/fleet/desired.json``) *before* anything acts on it, then converged to: the updater
is asked for its model; the newest request wins there, so a desired document that changes while
an update runs cancels that update and applies the newest one only. At start, before and without
any broker, the stored document is loaded and converged to, unless that already ended
(``converged``, ``failed``, ``refused``: a failed one is tried again by a newer document or the
``reload`` command, never by itself in a loop). ``allow_downgrade`` lets the model be older than
the one serving (an authorised rollback); everything else keeps the updater's anti-rollback.

``cmd``: ``status`` (may come unsigned), ``rollback``, ``reload`` and ``update`` (signed, and
refused once past ``expires_at``). Each request id is written to ``answers.json`` as running
before the command runs and with its answer after: a repeated id is answered again from there
(``repeated``: true), never run twice, and one whose run a crash interrupted is answered with
reason ``interrupted`` instead of being run again. Answers go to the MQTT 5 response topic when it
lies under this device's ``resp/`` (the only place its ACL lets it write), else to
``resp/<request_id>``, always echoing the correlation data (MQTT 3.1.1: ``resp/<request_id>``, the
request id in the payload is the correlation).

Every refusal (bad JSON, wrong types, too large, unsigned where a signature is needed, another
device's document, a replayed old version, an unknown key) is an ``events`` message with its reason
and never an action. The updater's own events become ``events`` too (progress at most one a second
per update) and ``reported`` updates, coalesced, with a ``sequence`` that keeps increasing across
restarts. On every connect the device publishes ``online`` (retained; its Last Will is the
offline form) and a fresh ``reported``.

Handlers run on the event loop, one message at a time (the link's order), and never wait for the
broker: publications go through an outbox that a task of its own sends while connected.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__
from agent.errors import (
    ConfigError,
    DocumentError,
    FleetError,
    PowerError,
    UpdateError,
    first_line,
    printable,
)
from agent.fleet import topics
from agent.fleet.documents import (
    MAX_DOCUMENT_BYTES,
    Applied,
    Command,
    Desired,
    DesiredStatus,
    ErrorInfo,
    Event,
    Online,
    Reported,
    Response,
    UpdaterStatus,
    load_json,
    open_envelope,
    read_message,
    utc_now,
)
from agent.fleet.mqtt import BrokerOptions, Message, MqttLink, Will
from agent.fleet.state import MAX_ANSWERS, AnswerEntry, FleetFiles, SavedState
from agent.update.journal import BundleId
from agent.update.updater import RequestAnswer, Updater, UpdateRequest

__all__ = ["FleetDevice", "Publication"]

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 1.0  # update.progress events, at most one per update this often
REPORTED_MIN_INTERVAL_S = 0.2  # reported publications coalesce changes within this
SEQUENCE_BLOCK = 1000  # reported sequences reserved on disk at a time
OUTBOX_LIMIT = 1000  # publications waiting for the broker; beyond it the oldest are dropped
PUBLISH_TIMEOUT_S = 10.0
RETRY_PUBLISH_S = 0.5
STOP_PUBLISH_S = 2.0  # the last "offline" publication on a clean stop
RECOVERY_WAIT_S = 60.0  # how long a command waits for the updater's recovery at start
SERVING_QUERY_S = 5.0
# A status command carries no expiry: its answer is kept this long for a repeat.
UNSIGNED_ANSWER_KEEP = datetime.timedelta(hours=1)
# Statuses of a stored desired document that need no more work at start.
_SETTLED = frozenset({"converged", "failed", "refused"})

Clock = Callable[[], datetime.datetime]


@dataclasses.dataclass(frozen=True)
class Publication:
    """One message waiting in the outbox."""

    topic: str
    payload: bytes
    retain: bool = False
    correlation_data: bytes | None = None
    what: str = "event"  # "event", "resp", "reported", "online": for logs and tests


class FleetDevice:
    """The control plane of one device. Cheap to construct; :meth:`run` does the I/O.

    Args:
        fleet: The fleet id (``[fleet] fleet``).
        device: The device id, which is also the MQTT client id.
        updater: The updater it drives (recovered by its own task).
        state_dir: The daemon's state directory; the plane's files go to ``fleet/`` in it.
        keys: The fleet's trusted public keys (``[fleet] public_keys``).
        options: The broker; None runs without one (converging to the stored document only).
        fingerprint: What the device is (device class, platform...), for ``reported``.
        health: The daemon's health, for ``reported``; called on the loop, must be cheap.
        serving: What serves now; default: the updater's steps' ``serving()``.
        clock: The wall clock (command expiry, document times).
        link_factory: Makes the MQTT link (the benchmark's agents share this code path).
        power: The daemon's power governor (agent/power/service.py), where it governs:
            ``desired.power`` sets its policy, ``power.wake`` wakes the board, and
            ``reported.power`` says its state.
    """

    def __init__(self, *, fleet: str, device: str, updater: Updater, state_dir: Path,
                 keys: Sequence[Ed25519PublicKey], options: BrokerOptions | None,
                 fingerprint: Mapping[str, Any] | None = None,
                 health: Callable[[], dict[str, Any]] | None = None,
                 serving: Callable[[], Awaitable[BundleId | None]] | None = None,
                 clock: Clock = utc_now,
                 link_factory: Callable[..., MqttLink] = MqttLink,
                 power: Any = None) -> None:
        self.fleet = topics.check_id(fleet, "fleet")
        self.device = topics.check_id(device, "device")
        self.updater = updater
        self.keys = tuple(keys)
        self.options = options
        self.fingerprint = dict(fingerprint or {})
        self._health = health or (lambda: {})
        self._serving = serving or updater.steps.serving
        self._clock = clock
        self._link_factory = link_factory
        self.power = power
        self.files = FleetFiles(state_dir)
        self.root = topics.device_root(fleet, device)
        self.v5 = options is None or options.protocol == "5"
        self.link: MqttLink | None = None

        self.desired: Desired | None = None  # the newest accepted document
        self._desired_bytes: bytes | None = None
        self._status: DesiredStatus | None = None
        # The update converging to a desired document's model: (that document, update id).
        self._tracking: tuple[Desired, str] | None = None
        self._answers: dict[str, AnswerEntry] = {}
        self._saved = SavedState()
        self._sequence = 0  # the next reported sequence
        self._outbox: collections.deque[Publication] = collections.deque()
        self.dropped = 0  # publications dropped from a full outbox
        self._online_pending = False
        self._reported_dirty = False
        self._last_reported = 0.0
        self._last_progress: dict[str, float] = {}
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._save_lock: asyncio.Lock | None = None
        self._publisher: asyncio.Future[None] | None = None
        self._loaded = False
        self.started_at = clock()

    # -- the task ---------------------------------------------------------------------------

    async def run(self) -> None:
        """The daemon's task: :meth:`start`, run until cancelled, :meth:`close`."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def start(self) -> None:
        """Load the stored state, converge to the stored desired document (without waiting
        for a broker), and start the link to the broker in the background."""
        await self.load()
        self.updater.add_listener(self._on_update_event)
        self._publisher = asyncio.ensure_future(self._publish_loop())
        if self.desired is not None and (self._status is None
                                         or self._status.status not in _SETTLED):
            self._spawn(self._converge(self.desired))
        if self.options is not None:
            self.link = self._make_link(self.options)
            await self.link.start()

    async def close(self) -> None:
        """Say "offline" (a clean disconnect sends no Will), stop the link and the plane's
        tasks. What was stored stays for the next start."""
        self.updater.remove_listener(self._on_update_event)
        await self._stop_link()
        tasks = [task for task in (self._publisher, *self._tasks) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._publisher = None

    async def load(self) -> None:
        """Read ``<state_dir>/fleet/`` (off the loop) and reserve a block of sequences."""
        if self._loaded:
            return
        self._wake = asyncio.Event()
        self._save_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        saved = await loop.run_in_executor(None, self.files.read_state)
        self._answers = await loop.run_in_executor(None, self.files.read_answers)
        stored = await loop.run_in_executor(None, self.files.read_desired)
        self._sequence = saved.sequence_reserved
        self._saved = dataclasses.replace(saved,
                                          sequence_reserved=self._sequence + SEQUENCE_BLOCK)
        if stored is not None:
            desired = self._verify_stored(stored)
            if desired is not None:
                self.desired, self._desired_bytes = desired, stored
                if saved.desired_version == desired.version and saved.desired_status:
                    self._status = DesiredStatus(version=desired.version,
                                                 status=saved.desired_status,
                                                 reason=saved.desired_reason)
        await self._save_state()
        self._loaded = True

    def _verify_stored(self, stored: bytes) -> Desired | None:
        try:
            desired = open_envelope(stored, self.keys, expect=Desired).document
            if (desired.fleet, desired.device) != (self.fleet, self.device):
                raise DocumentError("the stored desired document is another device's",
                                    reason="wrong_device", fleet=desired.fleet,
                                    device=desired.device)
            return desired  # type: ignore[no-any-return]
        except DocumentError as exc:
            log.error("the stored desired document is not used: %s", exc)
            self._event("desired.refused", self._refusal(exc, source="stored"))
            return None

    def _make_link(self, options: BrokerOptions) -> MqttLink:
        will = Will(topic=f"{self.root}/{topics.ONLINE}",
                    payload=self._online(False, self.started_at).encode(), retain=True)
        return self._link_factory(
            options, subscriptions=[(f"{self.root}/{topics.DESIRED}", 1),
                                    (f"{self.root}/{topics.CMD}", 1)],
            on_message=self.handle_message, on_connect=self._on_connect, will=will)

    async def _stop_link(self) -> None:
        link, self.link = self.link, None
        if link is None:
            return
        if link.connected:
            # The last word of this run: what it serves and where the update stands now (the
            # update itself is parked in its journal as the daemon stops), then "offline" (a
            # clean disconnect suppresses the Will: say it ourselves).
            try:
                await link.publish(f"{self.root}/{topics.REPORTED}",
                                   await asyncio.wait_for(self._reported_payload(),
                                                          STOP_PUBLISH_S),
                                   retain=True, timeout_s=STOP_PUBLISH_S)
            except (FleetError, asyncio.TimeoutError) as exc:
                log.warning("could not publish the final reported document: %s", exc)
            try:
                await link.publish(f"{self.root}/{topics.ONLINE}",
                                   self._online(False, self._clock()).encode(), retain=True,
                                   timeout_s=STOP_PUBLISH_S)
            except FleetError as exc:
                log.warning("could not publish that this device goes offline: %s", exc)
        await link.stop()

    async def _on_connect(self, session_present: bool) -> None:
        self._online_pending = True
        self._reported_dirty = True
        self._wake_publisher()

    # -- messages ---------------------------------------------------------------------------

    async def handle_message(self, message: Message) -> None:
        """One message from the link. Never raises: whatever a message holds ends in an
        action, an answer or an event that says why not."""
        try:
            parsed = topics.parse_topic(message.topic)
            if (parsed.fleet, parsed.device) != (self.fleet, self.device):
                raise DocumentError("a message on another device's topic", reason="wrong_topic",
                                    topic=message.topic)
            if parsed.leaf == topics.DESIRED:
                await self._on_desired(message.payload)
            elif parsed.leaf == topics.CMD:
                await self._on_command(message)
            else:
                raise DocumentError("a message on a topic this device does not read",
                                    reason="wrong_topic", topic=message.topic)
        except DocumentError as exc:
            self._event("message.refused", self._refusal(exc))
        except Exception as exc:  # a bug of ours: reported, never the link's problem
            log.exception("handling a message on %s failed", printable(message.topic, 200))
            self._event("fleet.internal_error", {"reason": "internal_error",
                                                 "message": printable(first_line(exc), 500)})

    async def _on_desired(self, payload: bytes) -> None:
        if not payload:
            # The retained document was cleared (or a broker lost it): the stored copy stays
            # what the device converges to.
            self._event("desired.cleared", {"version": None if self.desired is None
                                            else self.desired.version})
            return
        try:
            desired: Desired = open_envelope(payload, self.keys, expect=Desired).document
        except DocumentError as exc:
            self._event("desired.refused", self._refusal(exc))
            return
        if (desired.fleet, desired.device) != (self.fleet, self.device):
            self._event("desired.refused", {
                "reason": "wrong_device", "version": desired.version,
                "message": f"the document is for {desired.fleet}/{desired.device}, not "
                           f"{self.fleet}/{self.device}"})
            return
        accepted = self.desired
        if accepted is not None and desired.version <= accepted.version:
            if desired.version < accepted.version:
                self._event("desired.refused", {
                    "reason": "old_version", "version": desired.version,
                    "accepted_version": accepted.version,
                    "message": f"version {desired.version} is older than the accepted "
                               f"{accepted.version} (a replay, or a late delivery)"})
            elif payload != self._desired_bytes and desired != accepted:
                self._event("desired.refused", {
                    "reason": "version_reused", "version": desired.version,
                    "message": f"another document with the accepted version "
                               f"{desired.version}: a new document needs a higher version"})
            return  # the same document again (a redelivery, a resubscription): done already
        await asyncio.get_running_loop().run_in_executor(None, self.files.write_desired,
                                                         payload)
        self.desired, self._desired_bytes = desired, payload
        self._event("desired.accepted", {"version": desired.version, "rollout": desired.rollout,
                                         "model": None if desired.model is None
                                         else desired.model.to_json()})
        await self._set_status(desired, "applying", None)
        self._spawn(self._converge(desired))

    async def _on_command(self, message: Message) -> None:
        try:
            received = read_message(message.payload, self.keys, expect=Command)
        except DocumentError as exc:
            request_id = _request_id_of(message.payload)
            self._event("cmd.refused", {**self._refusal(exc), "request_id": request_id})
            if request_id is not None:
                self._answer(message, self._error(request_id, exc.reason, exc.message))
            return
        command: Command = received.document
        if (command.fleet, command.device) != (self.fleet, self.device):
            self._refuse_command(message, command, "wrong_device",
                                 f"the command is for {command.fleet}/{command.device}")
            return
        if command.needs_signature and not received.signed:
            self._refuse_command(message, command, "unsigned",
                                 f"a {command.command} command must be signed by a fleet key")
            return
        entry = self._answers.get(command.request_id)
        if entry is not None:
            await self._answer_again(message, command, entry)
            return
        now = self._clock()
        if command.expires_at is not None and now >= command.expires_at:
            self._refuse_command(message, command, "expired",
                                 f"the command expired at {command.expires_at.isoformat()}")
            return
        keep_until = command.expires_at or (now + UNSIGNED_ANSWER_KEEP)
        # At most once: the request id is on disk before the command runs.
        await self._remember(command.request_id, AnswerEntry("running", keep_until))
        response = await self._execute(command)
        await self._remember(command.request_id,
                             AnswerEntry("answered", keep_until, response.to_json()))
        self._answer(message, response)

    async def _answer_again(self, message: Message, command: Command,
                            entry: AnswerEntry) -> None:
        if entry.state == "running" or entry.response is None:
            # It began before a crash or a stop and its end is unknown: never run it again.
            response = self._error(command.request_id, "interrupted",
                                   "the daemon stopped while this command ran; it is not run "
                                   "again (ask with a new request id)")
            await self._remember(command.request_id, AnswerEntry(
                "answered", entry.keep_until, response.to_json()))
        else:
            try:
                response = Response.from_json(entry.response)
            except DocumentError:
                response = self._error(command.request_id, "interrupted",
                                       "the first answer to this command is unreadable")
        self._event("cmd.repeated", {"request_id": command.request_id,
                                     "command": command.command})
        self._answer(message, dataclasses.replace(response, repeated=True))

    def _refuse_command(self, message: Message, command: Command, reason: str,
                        text: str) -> None:
        self._event("cmd.refused", {"reason": reason, "request_id": command.request_id,
                                    "command": command.command, "message": text})
        self._answer(message, self._error(command.request_id, reason, text))

    async def _execute(self, command: Command) -> Response:
        try:
            if command.command == "status":
                return self._ok(command.request_id,
                                {"reported": (await self._reported()).to_json()})
            if command.command == "power.wake":
                if self.power is None:
                    return self._error(command.request_id, "no_power",
                                       "this device does not govern power ([power] enabled "
                                       "is false)")
                seconds = await self.power.wake("mqtt")
                return self._ok(command.request_id, {"wake_s": seconds,
                                                     "power": self.power.reported()})
            await self.updater.until_recovered(timeout_s=RECOVERY_WAIT_S)
            if command.command == "rollback":
                answer = await self.updater.rollback()
                if self.desired is not None:
                    # The stored desired document must not bring the version back by itself
                    # (at a restart): a newer document or a reload does.
                    await self._set_status(self.desired, "failed", "operator_rollback")
                return self._ok(command.request_id, answer.to_json())
            if command.command == "reload":
                return await self._reload(command)
            if command.command == "update":
                model = command.model
                assert model is not None  # Command.from_json checked the update's args
                answer = await self.updater.request(UpdateRequest(
                    source=model.url, name=model.name, version=model.version,
                    sha256=model.sha256, request_id=f"cmd-{command.request_id}"))
                return self._ok(command.request_id, answer.to_json())
            return self._error(command.request_id, "unknown_command", command.command)
        except UpdateError as exc:
            return self._error(command.request_id, exc.reason, exc.message)
        except DocumentError as exc:
            return self._error(command.request_id, exc.reason, str(exc))
        except PowerError as exc:
            return self._error(command.request_id, "power_error", str(exc))

    async def _reload(self, command: Command) -> Response:
        stored = await asyncio.get_running_loop().run_in_executor(None, self.files.read_desired)
        desired = None if stored is None else self._verify_stored(stored)
        if desired is None:
            return self._error(command.request_id, "no_desired",
                               "no usable desired document is stored")
        if self.desired is None or desired.version >= self.desired.version:
            self.desired, self._desired_bytes = desired, stored
        await self._set_status(desired, "applying", None)
        answer = await self._converge(desired)
        return self._ok(command.request_id, {"desired_version": desired.version,
                                             **(answer.to_json() if answer else {})})

    # -- converging -------------------------------------------------------------------------

    async def _converge(self, desired: Desired) -> RequestAnswer | None:
        """Ask the updater for ``desired``'s model; the status follows its answer, then the
        update's events (:meth:`_on_update_event`)."""
        if not await self._apply_power(desired):
            return None
        model = desired.model
        if model is None:
            await self._set_status(desired, "converged", None)
            return None
        await self.updater.until_recovered(timeout_s=RECOVERY_WAIT_S)
        if self.desired is not desired:
            return None  # a newer document came meanwhile
        request_id = f"desired-{desired.version}-{uuid.uuid4().hex[:8]}"
        try:
            answer = await self.updater.request(UpdateRequest(
                source=model.url, name=model.name, version=model.version, sha256=model.sha256,
                request_id=request_id, allow_downgrade=desired.allow_downgrade))
        except UpdateError as exc:
            if self.desired is desired:
                await self._set_status(desired, "refused", exc.reason)
            self._event("desired.refused", {"reason": exc.reason, "version": desired.version,
                                            "message": exc.message})
            return None
        if self.desired is not desired:
            return answer
        if answer.result in ("started", "in_progress") and answer.update_id is not None:
            self._tracking = (desired, answer.update_id)
            await self._set_status(desired, "applying", None)
        elif answer.result == "already_current":
            self._tracking = None
            await self._set_status(desired, "converged", None)
        return answer

    async def _apply_power(self, desired: Desired) -> bool:
        """``desired.power`` onto the configured policy; False (the document refused) when
        its keys or values are bad, or this device does not govern power."""
        if desired.power is None:
            return True
        reason, message = None, ""
        if self.power is None:
            reason, message = "no_power", "this device does not govern power ([power] enabled " \
                                          "is false)"
        else:
            try:
                await self.power.set_policy(desired.power, base=self.power.config)
                self._event("power.policy", {"version": desired.version,
                                             "power": self.power.reported()})
                return True
            except ConfigError as exc:
                reason, message = "bad_power", str(exc)
            except PowerError as exc:
                reason, message = "power_error", str(exc)
        if self.desired is desired:
            await self._set_status(desired, "refused", reason)
        self._event("desired.refused", {"reason": reason, "version": desired.version,
                                        "message": printable(message, 500)})
        return False

    def _on_update_event(self, event: dict[str, Any]) -> None:
        """The updater's listener (on the loop, must not block): events, the desired
        status, and a reported update."""
        kind = event.get("event")
        update_id = event.get("update_id")
        if kind == "progress":
            now = time.monotonic()
            key = str(update_id)
            if now - self._last_progress.get(key, 0.0) < PROGRESS_INTERVAL_S:
                return
            self._last_progress[key] = now
            self._event("update.progress", {k: v for k, v in event.items() if k != "event"})
            return
        tracking = self._tracking
        desired = tracking[0] if tracking is not None and tracking[1] == update_id else None
        if kind == "state":
            self._event("update.state", {k: v for k, v in event.items() if k != "event"})
            if desired is not None and event.get("to") == "committed":
                self._spawn(self._set_status(desired, "converged", None))
        elif kind == "outcome":
            self._last_progress.pop(str(update_id), None)
            self._event("update.outcome", {k: v for k, v in event.items() if k != "event"})
            result, reason = event.get("result"), event.get("reason")
            if desired is not None and result in ("committed", "already_current"):
                self._spawn(self._set_status(desired, "converged", None))
            elif desired is not None and result in ("failed", "rolled_back", "cancelled",
                                                    "interrupted"):
                # Superseded by a newer desired document: that one's status is current, and
                # this write is ignored. By a local or commanded update: this one failed.
                self._tracking = None
                self._spawn(self._set_status(desired, "failed", str(reason or result)))
        self._reported_dirty = True
        self._wake_publisher()

    async def _set_status(self, desired: Desired, status: str, reason: str | None) -> None:
        if self.desired is not desired:
            return
        new = DesiredStatus(version=desired.version, status=status, reason=reason)
        if new == self._status:
            return
        self._status = new
        self._saved = dataclasses.replace(self._saved, desired_version=desired.version,
                                          desired_status=status, desired_reason=reason)
        await self._save_state()
        self._reported_dirty = True
        self._wake_publisher()

    async def _save_state(self) -> None:
        assert self._save_lock is not None
        async with self._save_lock:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.files.write_state,
                                                                 self._saved)
            except OSError as exc:
                log.error("cannot write %s: %s", self.files.directory, exc)

    async def _remember(self, request_id: str, entry: AnswerEntry) -> None:
        now = self._clock()
        answers = {key: value for key, value in self._answers.items()
                   if value.keep_until > now}
        answers[request_id] = entry
        while len(answers) > MAX_ANSWERS:
            oldest = min(answers, key=lambda key: answers[key].keep_until)
            log.warning("forgetting the answer to command %s to stay within %d", oldest,
                        MAX_ANSWERS)
            del answers[oldest]
        self._answers = answers
        await asyncio.get_running_loop().run_in_executor(None, self.files.write_answers,
                                                         dict(answers))

    # -- documents out ----------------------------------------------------------------------

    def _now(self) -> datetime.datetime:
        return self._clock()

    def _online(self, online: bool, since: datetime.datetime) -> Online:
        return Online(fleet=self.fleet, device=self.device, online=online, since=since,
                      agent_version=__version__)

    def _ok(self, request_id: str, result: dict[str, Any]) -> Response:
        return Response(fleet=self.fleet, device=self.device, request_id=request_id, ok=True,
                        answered_at=self._now(), result=result)

    def _error(self, request_id: str, reason: str, message: str) -> Response:
        return Response(fleet=self.fleet, device=self.device, request_id=request_id, ok=False,
                        answered_at=self._now(), error=ErrorInfo.of(reason, message))

    def _refusal(self, exc: DocumentError, **facts: Any) -> dict[str, Any]:
        return {"reason": exc.reason, "field": exc.field,
                "message": printable(str(exc), 500), **facts}

    def _event(self, event_type: str, detail: dict[str, Any]) -> None:
        document = Event(fleet=self.fleet, device=self.device, at=self._now(), type=event_type,
                         detail=detail)
        try:
            payload = document.encode()
        except (DocumentError, TypeError, ValueError) as exc:
            payload = Event(fleet=self.fleet, device=self.device, at=self._now(),
                            type=event_type, detail={"reason": "detail_unencodable",
                                                     "message": printable(str(exc), 200)}
                            ).encode()
        log.log(logging.WARNING if event_type.endswith((".refused", "internal_error"))
                else logging.DEBUG, "fleet event %s: %s", event_type,
                printable(str(detail), 300))
        self._put(Publication(f"{self.root}/{topics.EVENTS}", payload))

    def _answer(self, message: Message, response: Response) -> None:
        topic = topics.response_topic(self.fleet, self.device, response.request_id)
        if self.v5 and message.response_topic and self._own_response_topic(
                message.response_topic):
            topic = message.response_topic
        self._put(Publication(topic, response.encode(), what="resp",
                              correlation_data=message.correlation_data if self.v5 else None))

    def _own_response_topic(self, topic: str) -> bool:
        try:
            parsed = topics.parse_topic(topic)
        except DocumentError:
            return False
        return (parsed.fleet, parsed.device, parsed.leaf) == (self.fleet, self.device,
                                                              topics.RESP)

    def _put(self, publication: Publication) -> None:
        if len(self._outbox) >= OUTBOX_LIMIT:
            self._outbox.popleft()
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning("the fleet outbox is full: %d publication(s) dropped", self.dropped)
        self._outbox.append(publication)
        self._wake_publisher()

    def pending(self) -> list[Publication]:
        """What waits in the outbox (tests, status)."""
        return list(self._outbox)

    async def _reported(self) -> Reported:
        serving = await self._query_serving()
        status = self.updater.status()
        outcome = status.get("last_outcome")
        applied = None
        if serving is not None and serving.name is not None and serving.version is not None:
            sha256 = serving.sha256
            # The steps may not know the sha256 of what serves; the updater's record of the
            # update that made it serve (running or last) does.
            for bundle in ((status.get("update") or {}).get("bundle") or {},
                           (outcome or {}).get("bundle") or {}):
                if sha256 is None and (bundle.get("name"), bundle.get("version")) == (
                        serving.name, serving.version):
                    sha256 = bundle.get("sha256")
            applied = Applied(name=serving.name, version=serving.version, sha256=sha256)
        error = None
        if outcome and outcome.get("result") == "failed":
            error = ErrorInfo.of(str(outcome.get("reason") or "failed"),
                                 str(outcome.get("detail") or ""))
        updater = UpdaterStatus(state=status["state"], update_id=self.updater.running_update_id(),
                                error=error, last_outcome=outcome)
        sequence = await self._next_sequence()
        return Reported(fleet=self.fleet, device=self.device, sequence=sequence,
                        reported_at=self._now(), agent_version=__version__,
                        fingerprint=self.fingerprint, applied=applied, desired=self._status,
                        updater=updater, health=self._health(),
                        power=None if self.power is None else self.power.reported())

    async def _query_serving(self) -> BundleId | None:
        try:
            return await asyncio.wait_for(self._serving(), SERVING_QUERY_S)
        except Exception as exc:  # noqa: BLE001 - a report without it beats no report
            log.warning("cannot tell which version serves: %s", exc)
            return None

    async def _next_sequence(self) -> int:
        if self._sequence >= self._saved.sequence_reserved:
            self._saved = dataclasses.replace(
                self._saved, sequence_reserved=self._sequence + SEQUENCE_BLOCK)
            await self._save_state()
        sequence = self._sequence
        self._sequence += 1
        return sequence

    async def _reported_payload(self) -> bytes:
        document = await self._reported()
        try:
            return document.encode()
        except DocumentError:  # an outcome's detail, or health, out of bounds: drop them
            return dataclasses.replace(document, health={}, updater=dataclasses.replace(
                document.updater, last_outcome=None)).encode()

    # -- the publisher ------------------------------------------------------------------------

    def _wake_publisher(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _publish_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            link = self.link
            if link is None or not link.connected:
                continue  # the next connect wakes it
            try:
                await self._publish_pending(link)
            except FleetError as exc:
                log.warning("publishing to the broker failed (%s); trying again", exc)
                await asyncio.sleep(RETRY_PUBLISH_S)
                self._wake.set()

    async def _publish_pending(self, link: MqttLink) -> None:
        while link.connected:
            if self._online_pending:
                self._online_pending = False
                try:
                    await link.publish(f"{self.root}/{topics.ONLINE}",
                                       self._online(True, self._clock()).encode(), retain=True,
                                       timeout_s=PUBLISH_TIMEOUT_S)
                except FleetError:
                    self._online_pending = True
                    raise
            elif self._outbox:
                publication = self._outbox[0]
                try:
                    await link.publish(publication.topic, publication.payload,
                                       retain=publication.retain,
                                       correlation_data=publication.correlation_data,
                                       timeout_s=PUBLISH_TIMEOUT_S)
                except FleetError as exc:
                    if exc.reason in ("invalid", "unsupported", "not_authorized"):
                        # It will never go: drop it rather than block everything behind it.
                        log.error("dropping a %s publication to %s: %s", publication.what,
                                  publication.topic, exc)
                    else:
                        raise
                if self._outbox and self._outbox[0] is publication:
                    self._outbox.popleft()
            elif self._reported_dirty:
                wait_s = self._last_reported + REPORTED_MIN_INTERVAL_S - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)  # changes meanwhile join this publication
                    continue
                self._reported_dirty = False
                self._last_reported = time.monotonic()
                try:
                    await link.publish(f"{self.root}/{topics.REPORTED}",
                                       await self._reported_payload(), retain=True,
                                       timeout_s=PUBLISH_TIMEOUT_S)
                except FleetError:
                    self._reported_dirty = True
                    raise
            else:
                return

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a fleet task failed", exc_info=task.exception())

    async def settle(self) -> None:
        """Wait until the plane's own work (converging, status writes) and the update it
        started are over (tests, benchmarks)."""
        while True:
            tasks = [task for task in self._tasks if not task.done()]
            if tasks:
                await asyncio.wait(tasks)
                continue
            await self.updater.wait()
            await asyncio.sleep(0)
            if not any(not task.done() for task in self._tasks) and (
                    self.updater.running_update_id() is None):
                return

    def status(self) -> dict[str, Any]:
        """The control plane's state, JSON-able (tests, ``daemon.status``)."""
        link = self.link
        return {"fleet": self.fleet, "device": self.device,
                "connected": bool(link is not None and link.connected),
                "desired": None if self._status is None else self._status.to_json(),
                "tracking": None if self._tracking is None else self._tracking[1],
                "outbox": len(self._outbox),
                "dropped": self.dropped, "sequence": self._sequence}


def _request_id_of(payload: bytes) -> str | None:
    """The request id of a refused command, when one can be read at all (to answer the
    refusal): from the document, or from the payload of an envelope. Nothing of it is trusted:
    it only addresses the answer, and a refusal is not remembered as the id's answer."""
    try:
        data = load_json(payload, limit=2 * MAX_DOCUMENT_BYTES + 4096, what="message")
        if isinstance(data, dict) and isinstance(data.get("payload"), str):
            data = load_json(data["payload"].encode("utf-8", "surrogatepass"),
                             limit=MAX_DOCUMENT_BYTES, what="payload")
        request_id = data.get("request_id") if isinstance(data, dict) else None
        return topics.check_request_id(request_id)
    except DocumentError:
        return None
