"""The operator's connection to the fleet: one MQTT link with the operator identity, and what it
shows of every device (retained ``desired``, ``reported``, ``online``; command answers) and of
every rollout.

A command that needs the fleet's state first waits for the link to be *in sync*: after every
connect it publishes a marker to a topic of its own (``edge/<fleet>/_ops/sync/<client id>``, a
level no device id can have) and waits for it to come back. Mosquitto sends the retained
messages of a subscription before anything published after it on the same connection, so once the
marker is back every retained document is in the view.

The link keeps no session (expiry 0): the state is in retained documents, read again on every
connect, and an operator that was away wants today's state, not the queue of yesterday's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import DocumentError, FleetError
from agent.fleet import topics
from agent.fleet.documents import (
    Command,
    Desired,
    Online,
    Reported,
    Response,
    decode,
    load_json,
    open_envelope,
    read_message,
    sign,
)
from agent.fleet.mqtt import BrokerOptions, Message, MqttLink
from agent.fleet.ops.rollout import DeviceView, Rollout, open_rollout, sign_rollout

__all__ = ["FleetView", "OperatorLink", "operator_client_id"]

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 30.0
PUBLISH_TIMEOUT_S = 30.0


def operator_client_id(purpose: str = "ops") -> str:
    """A client id of its own for each operator process (the operator listener lets several run
    at once; only devices' ids are fixed)."""
    return f"{purpose}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class _DesiredSeen:
    document: Desired | None  # None: present but not verifiable with our keys
    version: int  # the version it claims (verified or not)
    raw: bytes


@dataclass
class FleetView:
    """What the broker shows of a fleet, kept up to date by :class:`OperatorLink`."""

    fleet: str
    trusted_keys: list[Ed25519PublicKey]
    # The broker's retained desired documents as of this connection (forgotten at every
    # connect: a broker that restarted without its store has none), and the highest desired
    # version ever seen for each device (kept: a device may have taken it).
    desired: dict[str, _DesiredSeen] = field(default_factory=dict)
    desired_floor: dict[str, int] = field(default_factory=dict)
    # The newest reported and online documents seen (kept across connects: the last word of
    # a device is still its last word while the broker has lost it).
    reported: dict[str, Reported] = field(default_factory=dict)
    online: dict[str, Online] = field(default_factory=dict)
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    responses: dict[str, dict[str, Response]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # the last documents we could not read

    def devices(self) -> list[str]:
        return sorted({*self.desired, *self.reported, *self.online})

    def forget_retained_desired(self) -> None:
        """At a connect: the broker sends its retained desired documents again."""
        self.desired.clear()

    def device(self, device: str) -> DeviceView:
        seen = self.desired.get(device)
        online = self.online.get(device)
        return DeviceView(desired=seen.document if seen is not None else None,
                          desired_floor=self.desired_floor.get(device, 0),
                          reported=self.reported.get(device),
                          online=online.online if online is not None else None,
                          responses=self.responses.get(device, {}))

    def views(self, devices: Any = None) -> dict[str, DeviceView]:
        names = self.devices() if devices is None else devices
        return {device: self.device(device) for device in names}

    def handle(self, message: Message) -> str | None:
        """Take in one message; returns the device (or ``rollouts/<id>``) it was about, or None
        when it was not ours to read. A document that cannot be read is logged and ignored."""
        try:
            parsed = topics.parse_topic(message.topic)
        except DocumentError:
            return None
        if parsed.fleet != self.fleet:
            return None
        try:
            if parsed.leaf == topics.ROLLOUTS:
                assert parsed.rollout_id is not None
                if not message.payload:  # a cleared retained document
                    self.rollouts.pop(parsed.rollout_id, None)
                else:
                    rollout = open_rollout(message.payload, self.trusted_keys)
                    known = self.rollouts.get(parsed.rollout_id)
                    if known is None or rollout.revision >= known.revision:
                        self.rollouts[parsed.rollout_id] = rollout
                return f"{topics.ROLLOUTS}/{parsed.rollout_id}"
            device = parsed.device
            assert device is not None
            if parsed.leaf == topics.DESIRED:
                self._take_desired(device, message.payload)
            elif parsed.leaf == topics.REPORTED:
                if message.payload:
                    reported = decode(message.payload, Reported)
                    known_report = self.reported.get(device)
                    # A redelivered or late older report must not hide a newer one.
                    if known_report is None or reported.sequence >= known_report.sequence \
                            or not message.retain:
                        self.reported[device] = reported
            elif parsed.leaf == topics.ONLINE:
                if message.payload:
                    self.online[device] = decode(message.payload, Online)
            elif parsed.leaf == topics.RESP:
                response = read_message(message.payload, self.trusted_keys, Response).document
                self.responses.setdefault(device, {})[response.request_id] = response
            else:
                return None
            return device
        except (DocumentError, FleetError) as exc:
            note = f"{message.topic}: {exc}"
            log.warning("ignored a document that cannot be used: %s", note)
            self.refused = [*self.refused[-19:], note]
            return None

    def _take_desired(self, device: str, payload: bytes) -> None:
        if not payload:
            self.desired.pop(device, None)
            return
        try:
            document = open_envelope(payload, self.trusted_keys, Desired).document
        except DocumentError:
            # Not ours to trust (another key, a forgery): its version still counts, since a
            # device trusting another fleet key may have taken it.
            self._hold_desired(device, _DesiredSeen(None, _claimed_version(payload), payload))
            raise
        self._hold_desired(device, _DesiredSeen(document, document.version, payload))

    def _hold_desired(self, device: str, seen: _DesiredSeen) -> None:
        self.desired[device] = seen
        self.desired_floor[device] = max(self.desired_floor.get(device, 0), seen.version)


def _claimed_version(payload: bytes) -> int:
    try:
        envelope = load_json(payload, limit=1024 * 1024, what="message")
        inner = load_json(envelope["payload"].encode("utf-8"), limit=1024 * 1024,
                          what="payload")
        version = inner.get("version")
        return version if isinstance(version, int) and not isinstance(version, bool) else 0
    except (DocumentError, AttributeError, KeyError, TypeError):
        return 0


class OperatorLink:
    """The operator's MQTT link to a fleet, with its :class:`FleetView`.

    Args:
        options: The operator identity's broker options (``Workspace.operator_options``).
        fleet: The fleet id.
        signing_key: Signs desired documents, commands and rollout documents.
        trusted_keys: The fleet keys documents are verified with.
        on_change: Awaited after each message that changed the view, with what it was about
            (a device id, or ``rollouts/<id>``).
    """

    def __init__(self, options: BrokerOptions, *, fleet: str, signing_key: Ed25519PrivateKey,
                 trusted_keys: list[Ed25519PublicKey],
                 on_change: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.options = options
        self.fleet = fleet
        self.view = FleetView(fleet, trusted_keys)
        self._signing_key = signing_key
        self._on_change = on_change
        self._sync_topic = f"{topics.ROOT}/{fleet}/_ops/sync/{options.client_id}"
        self._sync_token = b""
        self._synced = asyncio.Event()
        self.reconnected = asyncio.Event()  # set on every connect after the first
        self._connects = 0
        self._markers: set[asyncio.Task[None]] = set()  # marker publications in flight
        subscriptions = [(topics.fleet_filter(fleet, leaf), 1)
                         for leaf in (topics.DESIRED, topics.REPORTED, topics.ONLINE,
                                      topics.RESP)]
        subscriptions += [(topics.rollouts_filter(fleet), 1), (self._sync_topic, 1)]
        self.link = MqttLink(options, subscriptions=subscriptions, on_message=self._message,
                             on_connect=self._connected)

    async def __aenter__(self) -> OperatorLink:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Connect and wait until the view holds every retained document."""
        await self.link.start()
        try:
            await self.link.wait_connected(timeout_s)
            await self.sync(timeout_s=SYNC_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        markers, self._markers = self._markers, set()
        for task in markers:
            task.cancel()
        await asyncio.gather(*markers, return_exceptions=True)
        await self.link.stop()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def sync(self, *, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the marker published after the last connect came back (see the module's
        docstring).

        Raises:
            FleetError: (``timeout``) it did not within ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._synced.is_set():
            if self.link.connected and not self._markers and not self._sync_token:
                # The marker of the last connect was not acknowledged: send another.
                self._spawn_marker()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise FleetError("the broker did not return the operator's sync marker in time",
                                 reason="timeout", broker=self.options.address,
                                 waited_s=timeout_s)
            try:
                await asyncio.wait_for(self._synced.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    def _spawn_marker(self) -> None:
        task = asyncio.get_running_loop().create_task(self._send_marker())
        self._markers.add(task)
        task.add_done_callback(self._markers.discard)

    async def _send_marker(self) -> None:
        token = secrets.token_hex(8).encode()
        self._sync_token = token
        try:
            await self.link.publish(self._sync_topic, token, qos=1,
                                    timeout_s=PUBLISH_TIMEOUT_S)
        except FleetError as exc:
            log.warning("the sync marker was not acknowledged: %s", exc)
            self._sync_token = b""

    async def _connected(self, session_present: bool) -> None:
        self._connects += 1
        self._synced.clear()
        self.view.forget_retained_desired()
        self._sync_token = b""
        if self._connects > 1:
            self.reconnected.set()
        # Not awaited here: this handler holds up the delivery of the retained documents,
        # which may take longer than the marker's acknowledgement.
        self._spawn_marker()

    async def _message(self, message: Message) -> None:
        if message.topic == self._sync_topic:
            if self._sync_token and message.payload == self._sync_token:
                self._synced.set()
            return
        about = self.view.handle(message)
        if about is not None and self._on_change is not None:
            await self._on_change(about)

    # -- publishing

    async def publish_desired(self, document: Desired) -> None:
        """Publish a signed desired document, retained."""
        if document.fleet != self.fleet:
            raise FleetError("a desired document for another fleet", reason="wrong_fleet",
                             fleet=document.fleet)
        await self.link.publish(topics.device_topic(self.fleet, document.device,
                                                    topics.DESIRED),
                                sign(document, self._signing_key), qos=1, retain=True,
                                timeout_s=PUBLISH_TIMEOUT_S)

    async def publish_rollout(self, rollout: Rollout) -> None:
        """Publish a signed rollout document, retained."""
        await self.link.publish(topics.rollout_topic(self.fleet, rollout.rollout_id),
                                sign_rollout(rollout, self._signing_key), qos=1, retain=True,
                                timeout_s=PUBLISH_TIMEOUT_S)

    async def send_command(self, command: Command) -> None:
        """Send a command (signed when it changes what runs): MQTT 5 with a response topic and
        correlation data under the device's own ``resp/``, MQTT 3.1.1 with the request id in
        the payload only."""
        payload = sign(command, self._signing_key) if command.needs_signature \
            else command.encode()
        extra: dict[str, Any] = {}
        if self.options.protocol == "5":
            extra = {"response_topic": topics.response_topic(self.fleet, command.device,
                                                             command.request_id),
                     "correlation_data": command.request_id.encode()}
        await self.link.publish(topics.device_topic(self.fleet, command.device, topics.CMD),
                                payload, qos=1, timeout_s=PUBLISH_TIMEOUT_S, **extra)


def latest(rollouts: Mapping[str, Rollout], *, unfinished_only: bool = False) -> Rollout | None:
    """The most recently created rollout (of those not final, if asked)."""
    candidates = [rollout for rollout in rollouts.values()
                  if not (unfinished_only and rollout.final)]
    return max(candidates, key=lambda rollout: (rollout.created_at, rollout.rollout_id),
               default=None)
