"""The MQTT link (agent.fleet.mqtt) against real brokers started on free ports (Mosquitto 2.0,
and a 3-node NATS cluster's MQTT gateway): publish and receive, retained messages, sessions that
keep QoS 1 messages for an absent device, reconnecting and resubscribing after a broker SIGKILL,
the Last Will, acknowledgement after the handler (a raising handler, a handler cut off by a stop),
MQTT 5 request/response properties, MQTT 3.1.1 mode, TLS with client certificates, refused
credentials and certificates reported as such, and the reconnect backoff's jitter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.errors import ConfigError, FleetError
from agent.fleet.mqtt import BrokerOptions, Message, MqttLink, Will, reconnect_delay_s
from tests.brokers import Mosquitto, NatsCluster, ThrowawayCA, free_port

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 15.0  # generous bounds for things that happen in milliseconds; never a measurement
FAST: dict[str, Any] = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5}
PROTOCOLS = ["5", "3.1.1"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path / "mosquitto") as mosquitto:
        yield mosquitto


class Inbox:
    """What a link received: messages in order, and every on_connect's session_present."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.connects: list[bool] = []

    async def on_message(self, message: Message) -> None:
        self.queue.put_nowait(message)

    async def on_connect(self, session_present: bool) -> None:
        self.connects.append(session_present)

    async def next(self, timeout_s: float = WAIT_S) -> Message:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def next_on(self, topic: str, timeout_s: float = WAIT_S) -> Message:
        while True:
            message = await self.next(timeout_s)
            if message.topic == topic:
                return message


LinkFactory = Callable[..., Awaitable[tuple[MqttLink, Inbox]]]


@contextlib.asynccontextmanager
async def links() -> AsyncIterator[LinkFactory]:
    """``make(options, subscriptions, ...)`` starts a link (and waits until it is connected
    unless ``wait=False``); every link made is stopped on the way out."""
    made: list[MqttLink] = []

    async def make(options: BrokerOptions, subscriptions: Sequence[tuple[str, int]] = (), *,
                   will: Will | None = None, wait: bool = True,
                   handler: Callable[[Message], Awaitable[None]] | None = None,
                   ) -> tuple[MqttLink, Inbox]:
        inbox = Inbox()
        link = MqttLink(options, subscriptions=subscriptions,
                        on_message=handler or inbox.on_message, on_connect=inbox.on_connect,
                        will=will)
        made.append(link)
        await link.start()
        if wait:
            await link.wait_connected(WAIT_S)
        return link, inbox

    try:
        yield make
    finally:
        for link in reversed(made):
            await link.stop()


async def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- publish, receive, retained, sessions --------------------------------------------------------

@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_published_message_reaches_a_subscriber_with_its_payload_and_qos(
        broker: Mosquitto, protocol: str) -> None:
    async def scenario() -> None:
        async with links() as make:
            _, device = await make(broker.options("dev-1", protocol=protocol),
                                   [("edge/f/dev-1/cmd", 1), ("edge/f/dev-1/desired", 0)])
            operator, _ = await make(broker.options("operator", protocol=protocol))
            await operator.publish("edge/f/dev-1/cmd", b'{"kind": "cmd"}')
            await operator.publish("edge/f/dev-1/desired", b"at most once", qos=0)
            await operator.publish("edge/f/dev-2/cmd", b"not for dev-1")
            await operator.publish("edge/f/dev-1/cmd", b"second")
            received = [await device.next() for _ in range(3)]
            assert [(m.topic, m.payload, m.qos, m.retain) for m in received] == [
                ("edge/f/dev-1/cmd", b'{"kind": "cmd"}', 1, False),
                ("edge/f/dev-1/desired", b"at most once", 0, False),
                ("edge/f/dev-1/cmd", b"second", 1, False),
            ]
            assert device.connects == [False]

    run(scenario())


def test_a_retained_message_reaches_a_later_subscriber_marked_retained(broker: Mosquitto) -> None:
    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator"))
            await operator.publish("edge/f/dev-1/desired", b"version 1", retain=True)
            await operator.publish("edge/f/dev-1/desired", b"version 2", retain=True)
            _, device = await make(broker.options("dev-1"), [("edge/f/dev-1/desired", 1)])
            message = await device.next()
            assert (message.payload, message.retain) == (b"version 2", True)
            # Live publications to a subscriber are not marked retained.
            await operator.publish("edge/f/dev-1/desired", b"version 3", retain=True)
            live = await device.next()
            assert (live.payload, live.retain) == (b"version 3", False)

    run(scenario())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_qos1_messages_sent_while_a_device_is_away_arrive_when_it_returns(
        broker: Mosquitto, protocol: str) -> None:
    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator", protocol=protocol))
            device, _ = await make(broker.options("dev-1", protocol=protocol),
                                   [("edge/f/dev-1/cmd", 1)])
            await device.stop()  # a clean disconnect ends the connection, not the session
            for number in range(3):
                await operator.publish("edge/f/dev-1/cmd", f"cmd {number}".encode())
            # The device's process starts again: a new link with the same client id.
            _, returned = await make(broker.options("dev-1", protocol=protocol),
                                     [("edge/f/dev-1/cmd", 1)])
            assert [(await returned.next()).payload for _ in range(3)] == [
                b"cmd 0", b"cmd 1", b"cmd 2"]
            assert returned.connects == [True]

    run(scenario())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_session_expiry_of_zero_keeps_nothing(broker: Mosquitto, protocol: str) -> None:
    # On 3.1.1 that is a clean session: a one-off client leaves nothing on the broker.
    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator"))
            options = broker.options("dev-1", session_expiry_s=0, protocol=protocol)
            device, _ = await make(options, [("edge/f/dev-1/cmd", 1)])
            await device.stop()
            await operator.publish("edge/f/dev-1/cmd", b"lost")
            _, returned = await make(options, [("edge/f/dev-1/cmd", 1)])
            await operator.publish("edge/f/dev-1/cmd", b"after")
            assert (await returned.next()).payload == b"after"
            assert returned.connects == [False]

    run(scenario())


# -- broker restarts ---------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_after_a_broker_sigkill_and_restart_the_link_reconnects_and_resubscribes(
        tmp_path: Path, protocol: str) -> None:
    # No persistence: the restarted broker has forgotten every session and subscription, so
    # the device hears the command only if it subscribed again by itself.
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto") as mosquitto:
            async with links() as make:
                device, inbox = await make(mosquitto.options("dev-1", protocol=protocol, **FAST),
                                           [("edge/f/dev-1/cmd", 1)])
                mosquitto.kill()
                await eventually(lambda: not device.connected, "the link to notice the loss")
                assert device.last_error is not None
                assert device.last_error.reason in ("connection_lost", "unreachable")
                mosquitto.restart()
                await device.wait_connected(WAIT_S)
                assert device.connect_count == 2
                await eventually(lambda: len(inbox.connects) == 2, "the second on_connect")
                assert inbox.connects == [False, False]
                operator, _ = await make(mosquitto.options("operator", protocol=protocol))
                await operator.publish("edge/f/dev-1/cmd", b"after the restart")
                assert (await inbox.next()).payload == b"after the restart"

    run(scenario())


def test_a_publish_made_while_the_broker_is_down_goes_out_when_it_returns(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto") as mosquitto:
            async with links() as make:
                device, _ = await make(mosquitto.options("dev-1", **FAST))
                mosquitto.kill()
                await eventually(lambda: not device.connected, "the link to notice the loss")
                pending = asyncio.create_task(device.publish(
                    "edge/f/dev-1/reported", b"state", retain=True, timeout_s=WAIT_S))
                await asyncio.sleep(0.1)
                assert not pending.done()
                mosquitto.restart()
                await pending  # acknowledged by the restarted broker
                _, operator = await make(mosquitto.options("operator"),
                                         [("edge/f/+/reported", 1)])
                assert (await operator.next()).payload == b"state"

    run(scenario())


def test_a_publish_that_the_broker_cannot_acknowledge_times_out(tmp_path: Path) -> None:
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto") as mosquitto:
            async with links() as make:
                device, _ = await make(mosquitto.options("dev-1", **FAST))
                mosquitto.kill()
                await eventually(lambda: not device.connected, "the link to notice the loss")
                with pytest.raises(FleetError) as caught:
                    await device.publish("edge/f/dev-1/events", b"e", timeout_s=0.2)
                assert caught.value.reason == "timeout"
                assert caught.value.fields["topic"] == "edge/f/dev-1/events"
                with pytest.raises(FleetError) as caught:
                    await device.publish("edge/f/dev-1/events", b"e", qos=0)
                assert caught.value.reason == "not_connected"

    run(scenario())


def test_with_persistence_a_clean_broker_restart_keeps_sessions_and_retained_messages(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto", persistence=True) as mosquitto:
            async with links() as make:
                operator, _ = await make(mosquitto.options("operator", **FAST))
                await operator.publish("edge/f/dev-1/desired", b"kept", retain=True)
                device, inbox = await make(mosquitto.options("dev-1", **FAST),
                                           [("edge/f/dev-1/cmd", 1)])
                await device.stop()
                await operator.publish("edge/f/dev-1/cmd", b"queued for dev-1")
                mosquitto.stop()  # SIGTERM: Mosquitto saves its store
                mosquitto.restart()
                _, returned = await make(mosquitto.options("dev-1", **FAST),
                                         [("edge/f/dev-1/cmd", 1), ("edge/f/dev-1/desired", 1)])
                payloads = {(await returned.next()).payload for _ in range(2)}
                assert payloads == {b"queued for dev-1", b"kept"}
                assert returned.connects == [True]

    run(scenario())


def test_a_broker_that_stops_answering_is_noticed_by_the_keepalive(tmp_path: Path) -> None:
    # SIGSTOP: the socket stays open and silent, as on a link that died without a reset.
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto") as mosquitto:
            async with links() as make:
                device, _ = await make(mosquitto.options("dev-1", keepalive_s=1, **FAST))
                assert mosquitto.pid is not None
                os.kill(mosquitto.pid, signal.SIGSTOP)
                try:
                    await eventually(lambda: not device.connected, "the keepalive to fire")
                finally:
                    os.kill(mosquitto.pid, signal.SIGCONT)
                await device.wait_connected(WAIT_S)
                assert device.connect_count == 2

    run(scenario())


# -- the Last Will -----------------------------------------------------------------------------

WILL_CLIENT = """
import asyncio, sys
from agent.fleet.mqtt import BrokerOptions, MqttLink, Will

async def ignore(message):
    pass

async def main():
    port, client_id, protocol, topic = sys.argv[1:5]
    link = MqttLink(BrokerOptions(host="127.0.0.1", port=int(port), client_id=client_id,
                                  protocol=protocol),
                    subscriptions=[], on_message=ignore, will=Will(topic, b"offline"))
    await link.start()
    await link.wait_connected(10)
    await link.publish(topic, b"online", retain=True)
    print("online", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_will_is_published_retained_when_the_client_dies(
        broker: Mosquitto, protocol: str) -> None:
    topic = "edge/f/dev-1/online"

    async def scenario() -> None:
        async with links() as make:
            _, watcher = await make(broker.options("watcher"), [(topic, 1)])
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            process = subprocess.Popen(
                [sys.executable, "-c", WILL_CLIENT, str(broker.port), "dev-1", protocol, topic],
                stdout=subprocess.PIPE, env=env, cwd=REPO)
            try:
                assert process.stdout is not None
                line = await asyncio.to_thread(process.stdout.readline)
                assert line == b"online\n"
                assert (await watcher.next()).payload == b"online"
                process.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker sees the socket close
                process.wait(timeout=WAIT_S)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            will = await watcher.next()
            assert (will.topic, will.payload) == (topic, b"offline")
            _, later = await make(broker.options("later"), [(topic, 1)])
            retained = await later.next()
            assert (retained.payload, retained.retain) == (b"offline", True)

    run(scenario())


def test_a_clean_stop_sends_no_will(broker: Mosquitto) -> None:
    topic = "edge/f/dev-1/online"

    async def scenario() -> None:
        async with links() as make:
            _, watcher = await make(broker.options("watcher"), [(topic, 1), ("marker", 1)])
            device, _ = await make(broker.options("dev-1"), will=Will(topic, b"offline"))
            await device.publish(topic, b"online", retain=True)
            assert (await watcher.next()).payload == b"online"
            await device.stop()
            # Anything the broker sent on the device's departure comes before this marker.
            marker, _ = await make(broker.options("marker"))
            await marker.publish("marker", b"after the stop")
            assert (await watcher.next()).payload == b"after the stop"
            assert watcher.queue.empty()

    run(scenario())


def test_run_as_a_supervised_task_disconnects_cleanly_when_cancelled(broker: Mosquitto) -> None:
    topic = "edge/f/dev-1/online"

    async def scenario() -> None:
        async with links() as make:
            _, watcher = await make(broker.options("watcher"), [(topic, 1), ("marker", 1)])
            device = MqttLink(broker.options("dev-1"), subscriptions=[],
                              on_message=Inbox().on_message, will=Will(topic, b"offline"))
            task = asyncio.create_task(device.run())
            await eventually(lambda: device.connected, "run() to connect")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not device.connected
            marker, _ = await make(broker.options("marker"))
            await marker.publish("marker", b"after the cancel")
            assert (await watcher.next()).payload == b"after the cancel"

    run(scenario())


# -- handlers and acknowledgement ----------------------------------------------------------------

def test_a_handler_that_raises_is_logged_acknowledged_and_does_not_stop_later_messages(
        broker: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="agent.fleet.mqtt")
    handled: list[bytes] = []

    async def handler(message: Message) -> None:
        handled.append(message.payload)
        if message.payload == b"poison":
            raise ValueError("the handler broke")

    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator"))
            device, _ = await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)],
                                   handler=handler)
            for payload in (b"first", b"poison", b"after"):
                await operator.publish("edge/f/dev-1/cmd", payload)
            await eventually(lambda: len(handled) == 3, "three messages handled")
            assert handled == [b"first", b"poison", b"after"]
            await device.stop()
            # Acknowledged after the handler, raising or not: nothing comes back to the session.
            await operator.publish("edge/f/dev-1/cmd", b"next")
            handled.clear()
            await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)], handler=handler)
            await eventually(lambda: len(handled) == 1, "the next message")
            assert handled == [b"next"]

    run(scenario())
    assert any("the handler broke" in (record.exc_text or "") or
               (record.exc_info and "the handler broke" in str(record.exc_info[1]))
               for record in caplog.records)


def test_a_message_whose_handler_did_not_finish_is_delivered_again(broker: Mosquitto) -> None:
    # The PUBACK goes out after the handler returned; a handler cut off (the daemon stopping, a
    # crash) leaves the message unacknowledged and the broker delivers it again.
    started = []

    async def stuck(message: Message) -> None:
        started.append(message.payload)
        await asyncio.Event().wait()

    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator"))
            device, _ = await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)],
                                   handler=stuck)
            await operator.publish("edge/f/dev-1/cmd", b"do it once")
            await eventually(lambda: started == [b"do it once"], "the handler to start")
            await device.stop()
            _, returned = await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)])
            again = await returned.next()
            assert (again.topic, again.payload) == ("edge/f/dev-1/cmd", b"do it once")

    run(scenario())


def test_messages_are_handled_one_at_a_time_in_arrival_order(broker: Mosquitto) -> None:
    order: list[int] = []
    running = 0
    most = 0

    async def slow(message: Message) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(random.Random(int(message.payload)).random() * 0.01)
        order.append(int(message.payload))
        running -= 1

    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator"))
            await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)], handler=slow)
            await asyncio.gather(*(operator.publish("edge/f/dev-1/cmd", str(n).encode())
                                   for n in range(40)))
            await eventually(lambda: len(order) == 40, "40 messages handled")

    run(scenario())
    assert most == 1
    assert order == sorted(order)


# -- MQTT 5 request/response ------------------------------------------------------------------

def test_response_topic_and_correlation_data_round_trip_on_mqtt5(broker: Mosquitto) -> None:
    async def scenario() -> None:
        async with links() as make:
            device_link: list[MqttLink] = []

            async def answer(message: Message) -> None:
                assert message.response_topic is not None
                await device_link[0].publish(message.response_topic, b"done",
                                             correlation_data=message.correlation_data)

            device, _ = await make(broker.options("dev-1"), [("edge/f/dev-1/cmd", 1)],
                                   handler=answer)
            device_link.append(device)
            operator, replies = await make(broker.options("operator"),
                                           [("edge/f/dev-1/resp/#", 1)])
            await operator.publish("edge/f/dev-1/cmd", b"status?",
                                   response_topic="edge/f/dev-1/resp/r-1",
                                   correlation_data=b"\x00\x01corr")
            reply = await replies.next()
            assert (reply.topic, reply.payload, reply.correlation_data) == (
                "edge/f/dev-1/resp/r-1", b"done", b"\x00\x01corr")
            assert reply.response_topic is None

    run(scenario())


def test_request_response_properties_are_refused_on_mqtt311(broker: Mosquitto) -> None:
    async def scenario() -> None:
        async with links() as make:
            operator, _ = await make(broker.options("operator", protocol="3.1.1"))
            with pytest.raises(FleetError) as caught:
                await operator.publish("edge/f/dev-1/cmd", b"x", response_topic="edge/f/r")
            assert caught.value.reason == "unsupported"

    run(scenario())


# -- authentication, authorisation, TLS --------------------------------------------------------

ACL = """\
user operator
topic readwrite edge/#
pattern readwrite edge/+/%u/#
"""


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_wrong_password_fails_wait_connected_with_the_reason_and_is_logged(
        tmp_path: Path, protocol: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="agent.fleet.mqtt")

    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto", allow_anonymous=False,
                       passwords={"operator": "op-secret", "dev-1": "right"}, acl=ACL) as mosquitto:
            async with links() as make:
                device, _ = await make(mosquitto.options("dev-1", username="dev-1",
                                                         password="wrong", protocol=protocol,
                                                         **FAST), wait=False)
                started = time.monotonic()
                with pytest.raises(FleetError) as caught:
                    await device.wait_connected(WAIT_S)
                assert time.monotonic() - started < WAIT_S  # a refusal, not a timeout
                # Mosquitto 2.0 answers a bad password with "not authorized".
                assert caught.value.reason in ("bad_credentials", "not_authorized")
                assert caught.value.fields["username"] == "dev-1"
                assert not device.connected
                # The link keeps trying: once the broker knows the password, it is in.
                mosquitto.add_password("dev-1", "wrong")
                await eventually(lambda: device.connected, "a connection with the new password")
                assert device.last_error is None

    run(scenario())
    refusals = [record for record in caplog.records if "refused the connection" in
                record.getMessage()]
    assert refusals and refusals[0].levelno == logging.ERROR
    assert len(refusals) <= 2  # said once (per distinct error), not on every retry


def test_no_broker_listening_fails_wait_connected_with_a_timeout_naming_the_last_error() -> None:
    async def scenario() -> None:
        async with links() as make:
            link, _ = await make(BrokerOptions(host="127.0.0.1", port=free_port(),
                                               client_id="dev-1", **FAST), wait=False)
            with pytest.raises(FleetError) as caught:
                await link.wait_connected(0.5)
            assert caught.value.reason == "timeout"
            assert "cannot reach the broker" in caught.value.fields["last_error"]

    run(scenario())


def test_the_acl_keeps_a_device_to_its_own_topics_and_mqtt5_reports_a_denied_publish(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        with Mosquitto(tmp_path / "mosquitto", allow_anonymous=False,
                       passwords={"operator": "op", "dev-1": "d1", "dev-2": "d2"},
                       acl=ACL) as mosquitto:
            async with links() as make:
                _, operator = await make(mosquitto.options("operator", username="operator",
                                                           password="op"), [("edge/#", 1)])
                dev1, _ = await make(mosquitto.options("dev-1", username="dev-1", password="d1"))
                await dev1.publish("edge/f/dev-1/reported", b"mine")
                assert (await operator.next()).payload == b"mine"
                with pytest.raises(FleetError) as caught:
                    await dev1.publish("edge/f/dev-2/reported", b"forged")
                assert caught.value.reason == "not_authorized"
                # MQTT 3.1.1 has no negative PUBACK: the broker drops the message silently.
                dev2, _ = await make(mosquitto.options("dev-2", username="dev-2", password="d2",
                                                       protocol="3.1.1"))
                await dev2.publish("edge/f/dev-1/reported", b"forged too")
                await dev2.publish("edge/f/dev-2/reported", b"own")
                assert (await operator.next()).payload == b"own"

    run(scenario())


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[tuple[Mosquitto, ThrowawayCA]]:
    ca = ThrowawayCA(tmp_path / "ca")
    with Mosquitto(tmp_path / "mosquitto", allow_anonymous=False, acl=ACL, tls_ca=ca,
                   use_identity_as_username=True, plain_listener=False) as mosquitto:
        yield mosquitto, ca


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_with_a_client_certificate_connects_as_its_common_name(
        tls_broker: tuple[Mosquitto, ThrowawayCA], protocol: str) -> None:
    mosquitto, ca = tls_broker

    async def scenario() -> None:
        async with links() as make:
            _, operator = await make(mosquitto.options(
                "operator", tls=True, cert=ca.client_cert("operator")), [("edge/#", 1)])
            device, _ = await make(mosquitto.options(
                "dev-1", tls=True, cert=ca.client_cert("dev-1"), protocol=protocol))
            await device.publish("edge/f/dev-1/reported", b"over TLS")
            assert (await operator.next()).payload == b"over TLS"

    run(scenario())


def test_tls_refuses_a_broker_certificate_from_another_ca(
        tls_broker: tuple[Mosquitto, ThrowawayCA], tmp_path: Path) -> None:
    mosquitto, ca = tls_broker
    other = ThrowawayCA(tmp_path / "other-ca", name="another CA")

    async def scenario() -> None:
        async with links() as make:
            device, _ = await make(mosquitto.options(
                "dev-1", tls=True, cert=ca.client_cert("dev-1"), ca_file=other.ca_file, **FAST),
                wait=False)
            with pytest.raises(FleetError) as caught:
                await device.wait_connected(WAIT_S)
            assert caught.value.reason == "tls"
            assert "certificate is not trusted" in caught.value.message
            assert caught.value.fields["ca_file"] == other.ca_file

    run(scenario())


@pytest.mark.parametrize("certificate", ["another CA's", "none"])
def test_tls_broker_refuses_a_client_without_a_certificate_of_its_ca(
        tls_broker: tuple[Mosquitto, ThrowawayCA], tmp_path: Path, certificate: str) -> None:
    mosquitto, _ = tls_broker
    cert = (ThrowawayCA(tmp_path / "other-ca").client_cert("dev-1")
            if certificate == "another CA's" else None)

    async def scenario() -> None:
        async with links() as make:
            device, _ = await make(mosquitto.options("dev-1", tls=True, cert=cert, **FAST),
                                   wait=False)
            with pytest.raises(FleetError) as caught:
                await device.wait_connected(WAIT_S)
            assert caught.value.reason == "tls"
            assert "client certificate" in caught.value.message

    run(scenario())


def test_unreadable_tls_files_fail_start_with_tls_config(tmp_path: Path) -> None:
    async def scenario() -> None:
        link = MqttLink(BrokerOptions(host="127.0.0.1", port=free_port(), client_id="dev-1",
                                      tls=True, ca_file=tmp_path / "missing.pem"),
                        subscriptions=[], on_message=Inbox().on_message)
        with pytest.raises(FleetError) as caught:
            await link.start()
        assert caught.value.reason == "tls_config"

    run(scenario())


# -- options and backoff -----------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    ({"protocol": "4"}, "protocol"),
    ({"client_id": ""}, "client_id"),
    ({"port": 0}, "port"),
    ({"password": "p"}, "password"),
    ({"ca_file": Path("ca.pem")}, "tls"),
    ({"tls": True, "key_file": Path("k.pem")}, "cert_file"),
    ({"reconnect_min_s": 5.0, "reconnect_max_s": 1.0}, "reconnect_min_s"),
])
def test_broker_options_refuse_inconsistent_settings(overrides: dict[str, Any], key: str) -> None:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 1, "client_id": "dev-1",
                                **overrides}
    with pytest.raises(ConfigError) as caught:
        BrokerOptions(**settings)
    assert caught.value.fields["key"] == key


def test_reconnect_delays_are_jittered_over_the_whole_exponential_window() -> None:
    rng = random.Random(17)
    for failures, ceiling in [(0, 1.0), (1, 2.0), (3, 8.0), (6, 60.0), (500, 60.0)]:
        delays = [reconnect_delay_s(failures, min_s=1.0, max_s=60.0, rng=rng)
                  for _ in range(2000)]
        assert all(0.0 <= delay <= ceiling for delay in delays)
        # Full jitter: spread over the whole window, not clustered at its top (paho's fixed
        # doubling) nor at its bottom.
        assert min(delays) < 0.05 * ceiling and max(delays) > 0.95 * ceiling
        assert 0.45 * ceiling < sum(delays) / len(delays) < 0.55 * ceiling
        assert len(set(delays)) == len(delays)
    # Two boards that failed together do not retry together.
    first = [reconnect_delay_s(2, min_s=1.0, max_s=60.0, rng=random.Random(1)) for _ in range(5)]
    second = [reconnect_delay_s(2, min_s=1.0, max_s=60.0, rng=random.Random(2)) for _ in range(5)]
    assert first != second


def test_links_of_one_process_draw_different_reconnect_delays() -> None:
    # Each link has its own generator: many links in one process (the benchmark) do not share
    # a sequence that would line their retries up.
    options = BrokerOptions(host="127.0.0.1", port=1, client_id="dev-1")
    links_ = [MqttLink(options, subscriptions=[], on_message=Inbox().on_message)
              for _ in range(2)]
    draws = [[reconnect_delay_s(3, min_s=1.0, max_s=60.0, rng=link._rng) for _ in range(5)]
             for link in links_]
    assert draws[0] != draws[1]


# -- a NATS cluster ---------------------------------------------------------------------------

def test_nats_cluster_delivers_a_retained_message_published_on_one_node_to_another(
        tmp_path: Path) -> None:
    async def scenario(cluster: NatsCluster) -> None:
        async with links() as make:
            operator, _ = await make(cluster.options("operator", node=0))
            await operator.publish("edge/f/dev-1/desired", b"from node A", retain=True)
            _, device = await make(cluster.options("dev-1", node=2),
                                   [("edge/f/dev-1/desired", 1), ("edge/f/dev-1/cmd", 1)])
            retained = await device.next()
            assert (retained.topic, retained.payload, retained.retain) == (
                "edge/f/dev-1/desired", b"from node A", True)
            # Live QoS 1 traffic crosses the cluster too.
            await operator.publish("edge/f/dev-1/cmd", b"live")
            assert (await device.next_on("edge/f/dev-1/cmd")).payload == b"live"

    with NatsCluster(tmp_path / "nats") as cluster:
        run(scenario(cluster))


def test_a_connection_on_a_descriptor_select_cannot_watch_is_reported_as_such(
        broker: Mosquitto) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no descriptor above 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held = []
    try:
        while True:  # fill every descriptor below 1024, so the link's socket gets a higher one
            fd = os.open(os.devnull, os.O_RDONLY)
            held.append(fd)
            if fd >= 1023:
                break

        async def scenario() -> FleetError:
            async with links() as make:
                link, _ = await make(broker.options("dev-1", reconnect_min_s=0.05,
                                                    reconnect_max_s=0.1), wait=False)
                with pytest.raises(FleetError) as caught:
                    await link.wait_connected(2.0)
                return caught.value

        error = run(scenario())
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    last = error.fields.get("last_error")
    assert last is not None and "1024" in str(last) and "too many files" in str(last), error
