"""The one paho-mqtt wrapper: a link to one broker, driven from asyncio.

paho runs on a thread of its own (one per link) that owns the socket; its callbacks never
raise, never block and never publish-and-wait: each only hands a record to the asyncio loop with
``call_soon_threadsafe``. On the loop, received messages are handled one at a time in arrival
order, and a QoS 1 message is acknowledged (PUBACK, paho's ``manual_ack``) only after its handler
returned, so a crash before handling means redelivery; every handler must therefore be idempotent
(QoS 1 is at least once, and paho resends unacknowledged publishes with DUP after a reconnect).

The session is stable: the client id is fixed, MQTT 5 connects with ``clean_start=False`` and a
Session Expiry Interval, MQTT 3.1.1 with ``clean_session=False``, so QoS 1 messages sent to a
device while it is away are delivered when it returns. Subscriptions are made again on every
connect all the same (a broker that restarted without persistence forgot them).

Reconnecting uses exponential backoff with full jitter (see :func:`reconnect_delay_s`): after a
broker restart, hundreds of boards spread their reconnects instead of arriving together.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.errors import ConfigError, FleetError, InternalError, first_line

__all__ = ["BrokerOptions", "Message", "MqttLink", "Will", "reconnect_delay_s"]

log = logging.getLogger(__name__)

PROTOCOLS = {"5": MQTTProtocolVersion.MQTTv5, "3.1.1": MQTTProtocolVersion.MQTTv311}

CONNECT_TIMEOUT_S = 10.0  # TCP connect plus TLS handshake; a broker busy after a restart is slow
STABLE_CONNECTION_S = 10.0  # a connection shorter than this does not reset the backoff
NETWORK_POLL_S = 1.0  # the network thread's select timeout (publishes wake it at once)
STOP_FLUSH_S = 2.0  # how long stop() lets the DISCONNECT packet go out
SELECT_MAX_FD = 1024  # FD_SETSIZE: select(), which paho's loop() uses, watches only lower ones
MAX_QUEUED_MESSAGES = 1000  # publishes held while offline; beyond this publish() fails at once

# CONNACK reason codes (MQTT 5 numbering; paho maps 3.1.1 return codes onto them). These say
# something about our configuration or our standing with the broker, not about the network:
# wait_connected() fails with them at once instead of letting the caller wait out its timeout.
REFUSALS = {
    0x84: "unsupported_protocol",
    0x85: "client_id_rejected",
    0x86: "bad_credentials",
    0x87: "not_authorized",
    0x8A: "banned",
    0x8C: "bad_auth_method",
}
# Failures that a later attempt may not meet: the broker is starting, busy or rate-limiting.
TRANSIENT_CONNACK = frozenset({0x88, 0x89, 0x97, 0x9F})


@dataclass(frozen=True, kw_only=True)
class BrokerOptions:
    """One broker endpoint and this client's identity on it.

    ``session_expiry_s`` is how long the broker keeps the session (subscriptions, queued QoS 1
    messages) after the connection drops (MQTT 5; a 3.1.1 broker keeps it per its own settings).
    ``reconnect_min_s``/``reconnect_max_s`` bound the backoff between connection attempts.
    """

    host: str
    port: int
    client_id: str
    protocol: str = "5"
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    keepalive_s: int = 30
    session_expiry_s: int = 3600
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError("unknown MQTT protocol version", key="protocol",
                              expected=" or ".join(PROTOCOLS), found=self.protocol)
        if not self.host:
            raise ConfigError("the broker host is empty", key="host")
        if not 0 < self.port < 65536:
            raise ConfigError("the broker port is out of range", key="port", found=self.port)
        if not self.client_id:
            # An empty id would get a broker-assigned one: a new session on every connect.
            raise ConfigError("the MQTT client id is empty", key="client_id")
        if self.password is not None and self.username is None:
            raise ConfigError("an MQTT password needs a username", key="password")
        if not self.tls and any(path is not None
                                for path in (self.ca_file, self.cert_file, self.key_file)):
            raise ConfigError("TLS files are given but tls is off", key="tls")
        if self.key_file is not None and self.cert_file is None:
            raise ConfigError("a client key needs its certificate", key="cert_file")
        if self.keepalive_s < 1 or self.session_expiry_s < 0:
            raise ConfigError("keepalive must be at least 1 s and the session expiry not negative",
                              key="keepalive_s", found=f"{self.keepalive_s}/{self.session_expiry_s}")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ConfigError("the reconnect backoff needs 0 < reconnect_min_s <= reconnect_max_s",
                              key="reconnect_min_s",
                              found=f"{self.reconnect_min_s}/{self.reconnect_max_s}")

    @property
    def address(self) -> str:
        """``mqtt://host:port`` or ``mqtts://host:port``, for messages."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Will:
    """The Last Will: published by the broker when this client goes without a clean disconnect
    (retained by default, so a later subscriber still sees that the device went away)."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Message:
    """A received message, as handed to the handler on the asyncio loop. ``retain`` is true for
    a retained message delivered because of a (re)subscription."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    response_topic: str | None = None
    correlation_data: bytes | None = None


def reconnect_delay_s(failures: int, *, min_s: float, max_s: float,
                      rng: random.Random | None = None) -> float:
    """The wait before the next connection attempt, after ``failures`` attempts that failed since
    the last stable connection (0: the first attempt after losing one).

    Exponential backoff with *full* jitter: uniform over ``[0, min(max_s, min_s * 2**failures)]``.
    A fixed doubling (paho's own ``reconnect_delay_set``) keeps boards that lost the broker at the
    same moment in lockstep, each retry a synchronised wave against a broker that is starting up;
    drawing the whole delay at random spreads them evenly over the window and costs at most one
    window of extra latency.
    """
    ceiling = min(max_s, min_s * 2.0 ** min(max(failures, 0), 62))
    return (rng or random).uniform(0.0, ceiling)


# -- records the network thread hands to the loop -----------------------------------------------

@dataclass(frozen=True)
class _Connected:
    session_present: bool


@dataclass(frozen=True)
class _Received:
    message: Message
    mid: int
    generation: int  # which connection it came on: a PUBACK only makes sense on that one


@dataclass
class _Problem:
    """A connection attempt that failed, in words; ``refusal`` when retrying cannot help until
    someone changes a configuration (credentials, certificates, ACL)."""

    message: str
    reason: str
    refusal: bool
    fields: dict[str, Any] = field(default_factory=dict)

    def error(self) -> FleetError:
        return FleetError(self.message, reason=self.reason, **self.fields)


MessageHandler = Callable[[Message], Awaitable[None]]
ConnectHandler = Callable[[bool], Awaitable[None]]


class MqttLink:
    """A link to one broker: connects and reconnects in the background, subscribes on every
    connect, hands received messages to ``on_message`` on the asyncio loop, publishes with
    acknowledgement.

    Args:
        options: The broker and this client's identity.
        subscriptions: ``(topic filter, QoS)`` pairs, (re)made on every connect.
        on_message: Awaited for each received message, one at a time in arrival order. An
            exception is logged and the message acknowledged all the same (a message that always
            fails must not come back forever); cancellation (stop) leaves it unacknowledged.
        on_connect: Awaited after every successful connect (once the broker acknowledged the
            subscriptions), in order with the messages (a kept session's queued messages may come
            first), with whether the broker still had our session (``session_present``).
        will: The Last Will.

    The constructor does no I/O; :meth:`start` does.
    """

    def __init__(self, options: BrokerOptions, *, subscriptions: Sequence[tuple[str, int]],
                 on_message: MessageHandler, on_connect: ConnectHandler | None = None,
                 will: Will | None = None) -> None:
        for topic, qos in subscriptions:
            if not topic or qos not in (0, 1, 2):
                raise ConfigError("a subscription needs a topic filter and QoS 0, 1 or 2",
                                  key="subscriptions", found=f"{topic!r}/{qos!r}")
        if will is not None and will.qos not in (0, 1, 2):
            raise ConfigError("the Will's QoS must be 0, 1 or 2", key="will", found=will.qos)
        self.options = options
        self._subscriptions = tuple(subscriptions)
        self._on_message = on_message
        self._on_connect = on_connect
        self._will = will
        self._v5 = options.protocol == "5"

        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: paho.Client | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._inbox: asyncio.Queue[_Connected | _Received] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[None]] = {}  # mid -> its publish() waiting
        self._rng = random.Random()

        # Loop-side state, changed only on the loop.
        self._connected = False
        self._connect_count = 0
        self._problem: _Problem | None = None
        self._state_event = asyncio.Event()  # replaced (and the old one set) on every change

        # Network-thread state, changed only on the network thread (the loop reads
        # _thread_generation when it acknowledges: a stale read costs one redelivery).
        self._thread_generation = 0
        self._connack_seen = False  # on this attempt: a CONNACK came, accepting or refusing
        self._accepted = False  # on this attempt: the CONNACK accepted us
        self._connected_at = 0.0
        self._session_present = False
        self._subscribe_mid: int | None = None
        self._last_paho_error: str | None = None

    # -- the public API --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start connecting in the background and return at once (see :meth:`wait_connected`).

        Raises:
            FleetError: the TLS files cannot be read (reason ``tls_config``).
        """
        if self._thread is not None:
            raise InternalError("MqttLink.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        self._state_event = asyncio.Event()
        self._stop_requested.clear()
        # tls_set() reads the certificate files: off the loop.
        self._client = await asyncio.to_thread(self._make_client)
        self._dispatcher = asyncio.create_task(self._dispatch(),
                                               name=f"mqtt-dispatch-{self.options.client_id}")
        self._thread = threading.Thread(target=self._network_main, daemon=True,
                                        name=f"mqtt-{self.options.client_id}")
        self._thread.start()

    async def wait_connected(self, timeout_s: float) -> None:
        """Return once connected (see :attr:`connected`: subscriptions included).

        Raises:
            FleetError: not connected within ``timeout_s`` (reason ``timeout``, with the last
                connection error in ``last_error``), or at once when the last attempt was
                refused (``bad_credentials``, ``not_authorized``, ``tls``...: retrying cannot help
                until a configuration changes; the link still retries in the background, with
                backoff), or when the link is not running (``stopped``).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._connected:
            if self._thread is None:
                raise FleetError("the MQTT link is not running (not started, or stopped)",
                                 reason="stopped", client_id=self.options.client_id)
            if self._problem is not None and self._problem.refusal:
                raise self._problem.error()
            remaining = deadline - loop.time()
            if remaining <= 0:
                last = self._problem.message if self._problem is not None else None
                raise FleetError(f"no connection to the MQTT broker within {timeout_s:g} s",
                                 reason="timeout", broker=self.options.address,
                                 client_id=self.options.client_id, last_error=last)
            changed = self._state_event
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    @property
    def connected(self) -> bool:
        """Whether the broker accepted our last connection and acknowledged its subscriptions
        (SUBACK), and the connection has not been lost since."""
        return self._connected

    @property
    def connect_count(self) -> int:
        """How many times the broker accepted a connection from this link."""
        return self._connect_count

    @property
    def last_error(self) -> FleetError | None:
        """Why the last connection attempt failed or the last connection ended; None while
        connected."""
        return self._problem.error() if self._problem is not None else None

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False,
                      response_topic: str | None = None, correlation_data: bytes | None = None,
                      timeout_s: float = 10.0) -> None:
        """Publish and, for QoS 1 and 2, return once the broker acknowledged it.

        While the link is down the message waits in paho's queue and goes out on reconnect. A
        publish that timed out may still be delivered later: QoS 1 is at least once.

        Raises:
            FleetError: no acknowledgement within ``timeout_s`` (reason ``timeout``); the
                broker refused it (MQTT 5: ``not_authorized`` and the like; an MQTT 3.1.1 broker
                drops a denied publish silently); the offline queue is full (``queue_full``);
                QoS 0 while disconnected (``not_connected``); a malformed topic (``invalid``);
                response topic or correlation data on MQTT 3.1.1 (``unsupported``).
        """
        client = self._started_client()
        properties: Properties | None = None
        if response_topic is not None or correlation_data is not None:
            if not self._v5:
                raise FleetError("response topic and correlation data need MQTT 5",
                                 reason="unsupported", topic=topic, protocol=self.options.protocol)
            properties = Properties(PacketTypes.PUBLISH)
            if response_topic is not None:
                properties.ResponseTopic = response_topic
            if correlation_data is not None:
                properties.CorrelationData = correlation_data
        try:
            info = client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        except ValueError as exc:
            raise FleetError(f"cannot publish: {exc}", reason="invalid", topic=topic) from None
        if info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
            raise FleetError("too many publishes are waiting for the broker", reason="queue_full",
                             topic=topic, limit=MAX_QUEUED_MESSAGES)
        if qos == 0:
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                raise FleetError("not connected to the MQTT broker (QoS 0 is not queued)",
                                 reason="not_connected", topic=topic, broker=self.options.address)
            return
        # The network thread reports the PUBACK through the loop (_acknowledged), which cannot
        # run before this coroutine yields: registering the future now cannot miss it.
        future = asyncio.get_running_loop().create_future()
        self._pending[info.mid] = future
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise FleetError(f"the broker did not acknowledge a publish within {timeout_s:g} s",
                             reason="timeout", topic=topic, broker=self.options.address,
                             connected=self._connected) from None
        finally:
            self._pending.pop(info.mid, None)

    async def stop(self) -> None:
        """Disconnect cleanly (the broker does not send the Will) and stop the network thread.
        Messages not yet handled stay unacknowledged: the broker redelivers them to the session.
        Safe to call more than once."""
        thread, client = self._thread, self._client
        if thread is None or client is None:
            return
        # disconnect() first: once the thread sees the stop flag, the DISCONNECT is queued.
        client.disconnect()
        self._stop_requested.set()
        await asyncio.to_thread(thread.join, CONNECT_TIMEOUT_S + STOP_FLUSH_S + NETWORK_POLL_S)
        if thread.is_alive():
            log.warning("the MQTT network thread of %s did not stop in time",
                        self.options.client_id)
        self._thread = None
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None and dispatcher is not asyncio.current_task():
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(FleetError("the MQTT link was stopped", reason="stopped"))
        self._pending.clear()
        self._set_state(connected=False)

    async def run(self) -> None:
        """For ``Daemon.add_task``: start, run until cancelled, then stop."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    # -- building the client ---------------------------------------------------------------------

    def _make_client(self) -> paho.Client:
        options = self.options
        protocol = PROTOCOLS[options.protocol]
        client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=options.client_id, protocol=protocol,
            # MQTT 5 takes clean_start on connect instead; 3.1.1 keeps the session this way,
            # except for a client that asked for none (an expiry of 0: an operator's one-off
            # command, which would otherwise leave a session on the broker for good).
            clean_session=None if self._v5 else options.session_expiry_s == 0,
            # Our own thread reconnects; this also stops paho's silent downgrade to MQTT 3.1.
            reconnect_on_failure=False,
            manual_ack=True,
        )
        client.suppress_exceptions = True  # a second net under our own try/except
        client.connect_timeout = CONNECT_TIMEOUT_S
        client.max_queued_messages_set(MAX_QUEUED_MESSAGES)
        if options.username is not None:
            client.username_pw_set(options.username, options.password)
        if options.tls:
            try:
                client.tls_set(
                    ca_certs=str(options.ca_file) if options.ca_file else None,
                    certfile=str(options.cert_file) if options.cert_file else None,
                    keyfile=str(options.key_file) if options.key_file else None)
            except (OSError, ValueError) as exc:
                raise FleetError(f"cannot load the TLS files: {first_line(exc)}",
                                 reason="tls_config", ca_file=options.ca_file,
                                 cert_file=options.cert_file, key_file=options.key_file) from None
        if self._will is not None:
            client.will_set(self._will.topic, self._will.payload, qos=self._will.qos,
                            retain=self._will.retain)
        properties: Properties | None = None
        if self._v5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = options.session_expiry_s
            client.connect_async(options.host, options.port, options.keepalive_s,
                                 clean_start=False, properties=properties)
        else:
            client.connect_async(options.host, options.port, options.keepalive_s)
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        client.on_message = self._cb_message
        client.on_publish = self._cb_publish
        client.on_subscribe = self._cb_subscribe
        client.on_log = self._cb_log
        # With a "register write" callback set, paho's publish() and ack() only queue the packet
        # and wake our thread's select(); without one (and without loop_start), they would write
        # to the socket from the calling thread, racing the network thread.
        client.on_socket_register_write = _ignore_socket
        client.on_socket_unregister_write = _ignore_socket
        return client

    def _started_client(self) -> paho.Client:
        if self._client is None or self._thread is None:
            raise InternalError("the MQTT link is not started")
        return self._client

    # -- the network thread ----------------------------------------------------------------------

    def _network_main(self) -> None:
        # Our own loop rather than paho's loop_forever(): its retry delay is a fixed doubling
        # without jitter, and it swallows the exception of a failed connect (on_connect_fail gets
        # none), so it could never say "the broker's certificate is not trusted".
        client = self._client
        assert client is not None
        failures = 0
        first = True
        try:
            while not self._stop_requested.is_set():
                if not first:
                    delay = reconnect_delay_s(failures, min_s=self.options.reconnect_min_s,
                                              max_s=self.options.reconnect_max_s, rng=self._rng)
                    if self._stop_requested.wait(delay):
                        break
                first = False
                if self._attempt(client):
                    failures = 0
                else:
                    failures += 1
        except Exception:  # noqa: BLE001 - a bug here must not pass silently
            log.exception("the MQTT network thread of %s failed", self.options.client_id)
            self._post(self._set_problem, _Problem(
                "the MQTT network thread failed (a bug; see the log)", reason="internal",
                refusal=True))

    def _attempt(self, client: paho.Client) -> bool:
        """One connection attempt and, when it succeeds, the connection's life. Returns whether
        the connection was stable (the backoff restarts from its minimum)."""
        self._connack_seen = self._accepted = False
        self._last_paho_error = None
        try:
            client.reconnect()
        except (OSError, ValueError) as exc:
            self._post(self._set_problem, self._connect_problem(exc))
            return False
        sock = client.socket()
        if sock is not None and sock.fileno() >= SELECT_MAX_FD:
            # paho's loop() waits with select(), which cannot watch a descriptor from 1024 on:
            # paho would take the failure for a lost connection and we would retry blindly.
            number = sock.fileno()
            sock.close()
            self._post(self._set_problem, _Problem(
                f"the connection's file descriptor is {number}, and the MQTT client's select() "
                f"loop cannot watch descriptors from {SELECT_MAX_FD} on: this process has too "
                "many files open", reason="too_many_files", refusal=False,
                fields={"broker": self.options.address, "client_id": self.options.client_id}))
            return False
        stop_deadline: float | None = None
        while True:
            rc = client.loop(timeout=NETWORK_POLL_S)
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                break
            if self._stop_requested.is_set():
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + STOP_FLUSH_S
                    client.disconnect()  # again: stop() may have raced a connect in progress
                elif time.monotonic() > stop_deadline:
                    break
        sock = client.socket()
        if sock is not None:  # only when the DISCONNECT could not go out in time
            sock.close()
        if self._stop_requested.is_set():
            return True
        if not self._connack_seen:
            self._post(self._set_problem, self._closed_before_connack())
            return False
        return self._accepted and time.monotonic() - self._connected_at >= STABLE_CONNECTION_S

    def _connect_problem(self, exc: BaseException) -> _Problem:
        options = self.options
        where = {"broker": options.address, "client_id": options.client_id}
        if isinstance(exc, ssl.SSLCertVerificationError):
            return _Problem(
                f"the broker's TLS certificate is not trusted: {exc.verify_message or exc}",
                reason="tls", refusal=True, fields={**where, "ca_file": options.ca_file})
        if isinstance(exc, ssl.SSLError):
            return _Problem(f"the TLS handshake with the broker failed: {first_line(exc)}",
                            reason="tls", refusal=True,
                            fields={**where, "cert_file": options.cert_file})
        if isinstance(exc, socket.gaierror):
            return _Problem(f"cannot resolve the broker's host name: {first_line(exc)}",
                            reason="unreachable", refusal=False, fields=where)
        if isinstance(exc, OSError):
            return _Problem(f"cannot reach the broker: {first_line(exc)}", reason="unreachable",
                            refusal=False, fields=where)
        return _Problem(f"cannot connect: {first_line(exc)}", reason="invalid", refusal=True,
                        fields=where)

    def _closed_before_connack(self) -> _Problem:
        detail = self._last_paho_error or "the connection was closed"
        fields = {"broker": self.options.address, "client_id": self.options.client_id}
        # With TLS 1.3 the broker checks our certificate after the handshake returned: its
        # refusal arrives as an alert on the first read.
        if self.options.tls and "alert" in detail.lower():
            return _Problem(f"the broker refused our TLS client certificate: {detail}",
                            reason="tls", refusal=True,
                            fields={**fields, "cert_file": self.options.cert_file})
        return _Problem(f"the broker closed the connection before accepting it: {detail}",
                        reason="closed", refusal=False, fields=fields)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop; from the network thread, never raising."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    # -- paho callbacks (network thread: never raise, never block) ----------------------------

    def _cb_connect(self, client: paho.Client, userdata: Any, flags: paho.ConnectFlags,
                    reason_code: ReasonCode, properties: Properties | None) -> None:
        try:
            self._connack_seen = True
            if reason_code.is_failure:
                self._post(self._set_problem, self._connack_problem(reason_code))
                return
            self._accepted = True
            self._thread_generation += 1
            self._connected_at = time.monotonic()
            self._session_present = bool(flags.session_present)
            if not self._subscriptions:
                self._post(self._connected_now, self._session_present)
                return
            # Connected counts from the SUBACK: a caller told "connected" may rely on hearing
            # what is published from then on (with the session gone, nothing is subscribed yet).
            rc, self._subscribe_mid = client.subscribe(self._subscribe_request())
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                log.warning("subscribing for %s failed at once: %s", self.options.client_id,
                            paho.error_string(rc))
        except Exception:  # noqa: BLE001
            log.exception("on_connect of %s failed", self.options.client_id)

    def _subscribe_request(self) -> list[tuple[str, Any]]:
        if self._v5:
            return [(topic, SubscribeOptions(qos=qos)) for topic, qos in self._subscriptions]
        return list(self._subscriptions)

    def _connack_problem(self, reason_code: ReasonCode) -> _Problem:
        value = reason_code.value
        fields = {"broker": self.options.address, "client_id": self.options.client_id,
                  "username": self.options.username, "code": f"0x{value:02X}"}
        if value in TRANSIENT_CONNACK:
            return _Problem(f"the broker is not accepting connections now: {reason_code}",
                            reason="unavailable", refusal=False, fields=fields)
        return _Problem(f"the broker refused the connection: {reason_code}",
                        reason=REFUSALS.get(value, "refused"), refusal=True, fields=fields)

    def _cb_disconnect(self, client: paho.Client, userdata: Any, flags: paho.DisconnectFlags,
                       reason_code: ReasonCode, properties: Properties | None) -> None:
        try:
            if self._stop_requested.is_set():
                self._post(self._set_state, False)
            elif self._accepted:
                if flags.is_disconnect_packet_from_server:
                    detail = f"the broker disconnected us: {reason_code}"
                else:  # paho's reason code is a bare "Unspecified error" here
                    detail = self._last_paho_error or "the connection was closed"
                self._post(self._set_problem, _Problem(
                    f"lost the connection to the broker ({detail})", reason="connection_lost",
                    refusal=False, fields={"broker": self.options.address}))
        except Exception:  # noqa: BLE001
            log.exception("on_disconnect of %s failed", self.options.client_id)

    def _cb_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            try:
                topic = msg.topic
            except UnicodeDecodeError:
                log.warning("dropped a message whose topic is not UTF-8 (%s)",
                            self.options.client_id)
                client.ack(msg.mid, msg.qos)
                return
            response_topic = correlation_data = None
            if msg.properties is not None:
                response_topic = getattr(msg.properties, "ResponseTopic", None)
                correlation_data = getattr(msg.properties, "CorrelationData", None)
            message = Message(topic, bytes(msg.payload), msg.qos, bool(msg.retain),
                              response_topic=response_topic,
                              correlation_data=bytes(correlation_data)
                              if correlation_data is not None else None)
            inbox = self._inbox
            if inbox is not None:
                self._post(inbox.put_nowait, _Received(message, msg.mid, self._thread_generation))
        except Exception:  # noqa: BLE001
            log.exception("on_message of %s failed", self.options.client_id)

    def _cb_publish(self, client: paho.Client, userdata: Any, mid: int,
                    reason_code: ReasonCode, properties: Properties | None) -> None:
        try:
            self._post(self._acknowledged, mid, reason_code.value, str(reason_code))
        except Exception:  # noqa: BLE001
            log.exception("on_publish of %s failed", self.options.client_id)

    def _cb_subscribe(self, client: paho.Client, userdata: Any, mid: int,
                      reason_codes: list[ReasonCode], properties: Properties | None) -> None:
        try:
            if mid != self._subscribe_mid:
                return
            for (topic, _), code in zip(self._subscriptions, reason_codes):
                if code.is_failure:
                    # Usually the ACL: the device's configuration and the broker's disagree.
                    log.error("the broker refused the subscription %r of %s: %s", topic,
                              self.options.client_id, code)
            self._post(self._connected_now, self._session_present)
        except Exception:  # noqa: BLE001
            log.exception("on_subscribe of %s failed", self.options.client_id)

    def _cb_log(self, client: paho.Client, userdata: Any, level: int, text: str) -> None:
        try:
            if level == paho.MQTT_LOG_ERR:
                self._last_paho_error = text.removeprefix("failed to receive on socket: ")
        except Exception:  # noqa: BLE001
            pass

    # -- on the loop -----------------------------------------------------------------------------

    def _set_state(self, connected: bool) -> None:
        self._connected = connected
        old, self._state_event = self._state_event, asyncio.Event()
        old.set()

    def _connected_now(self, session_present: bool) -> None:
        self._connect_count += 1
        self._problem = None
        self._set_state(True)
        log.info("connected to %s as %s (session %s)", self.options.address,
                 self.options.client_id, "kept" if session_present else "new")
        if self._inbox is not None:
            self._inbox.put_nowait(_Connected(session_present))

    def _set_problem(self, problem: _Problem) -> None:
        previous, self._problem = self._problem, problem
        self._set_state(False)
        if self._stop_requested.is_set():
            return
        # Every attempt of a long outage fails alike: say it once, then at debug level.
        repeated = previous is not None and previous.message == problem.message
        level = logging.DEBUG if repeated else (logging.ERROR if problem.refusal
                                                else logging.WARNING)
        log.log(level, "MQTT %s: %s", self.options.client_id, problem.error())

    def _acknowledged(self, mid: int, code: int, name: str) -> None:
        future = self._pending.get(mid)
        if future is None or future.done():
            return  # QoS 0, or a publish() that gave up waiting
        if code >= 0x80:
            future.set_exception(FleetError(
                f"the broker refused the publish: {name}",
                reason="not_authorized" if code == 0x87 else "refused", code=f"0x{code:02X}"))
        else:
            future.set_result(None)

    async def _dispatch(self) -> None:
        assert self._inbox is not None
        while True:
            item = await self._inbox.get()
            if isinstance(item, _Connected):
                if self._on_connect is not None:
                    try:
                        await self._on_connect(item.session_present)
                    except Exception:  # noqa: BLE001
                        log.exception("the on_connect handler of %s failed",
                                      self.options.client_id)
                continue
            try:
                await self._on_message(item.message)
            except Exception:  # noqa: BLE001
                log.exception("the handler of a message on %s failed", item.message.topic)
            self._ack(item)

    def _ack(self, item: _Received) -> None:
        client = self._client
        if item.message.qos == 0 or client is None:
            return
        # On a later connection the mid may name another message; the broker redelivers this
        # one to the session instead, and the handler (idempotent) sees it again.
        if item.generation != self._thread_generation:
            return
        client.ack(item.mid, item.message.qos)


def _ignore_socket(client: paho.Client, userdata: Any, sock: Any) -> None:
    pass
