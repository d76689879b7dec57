"""Fleet control end to end: real daemons serving the tiny model, a real Mosquitto broker on a
free port (tests/brokers.py), an operator speaking MQTT as the fleet side does, and tiny signed
bundles fetched by ``file://`` URL.

- a signed desired document updates two daemons together, and each reports the new version
  committed;
- a device offline through three desired changes applies only the newest when it returns;
- the broker killed and restarted without persistence mid-update (retained documents lost), and
  a daemon restarted while the broker is down: the device converges from its local copy;
- duplicated commands run once and are answered each time with their own correlation data, on
  the MQTT 5 response topic, across a daemon restart too;
- MQTT 3.1.1 mode answers on ``resp/<request_id>``.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.config import load_config
from agent.daemon import Daemon
from agent.fleet import documents as docs
from agent.fleet.mqtt import Message, MqttLink
from agent.update.canary import CanaryPolicy
from agent.update.states import UpdatePolicy
from models.signing import load_private_key, write_keypair
from tests.brokers import MOSQUITTO, NATS_SERVER, Mosquitto, NatsCluster
from tests.tiny_models import make_bundle

pytest.importorskip("onnxruntime")
pytest.importorskip("paho.mqtt")
if not MOSQUITTO.exists():
    pytest.skip("mosquitto is not installed", allow_module_level=True)

FLEET = "f1"
TIMEOUT_S = 60.0


class Operator:
    """The fleet side, as far as these tests need it: one MQTT link reading everything under
    ``edge/<fleet>/#`` and publishing signed documents."""

    def __init__(self, broker: Mosquitto | NatsCluster, key: Any, *, protocol: str = "5",
                 node: int = 0, options: Any = None) -> None:
        self.key = key
        self.messages: list[Message] = []
        options = options or (broker.options("operator", node=node, reconnect_min_s=0.05,
                                  reconnect_max_s=0.5) if isinstance(broker, NatsCluster)
                   else broker.options("operator", protocol=protocol, reconnect_min_s=0.05,
                                       reconnect_max_s=0.5))
        self.link = MqttLink(options, subscriptions=[(f"edge/{FLEET}/#", 1)],
                             on_message=self._on_message)

    async def _on_message(self, message: Message) -> None:
        self.messages.append(message)

    async def __aenter__(self) -> Operator:
        await self.link.start()
        await self.link.wait_connected(10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.link.stop()

    async def desired(self, device: str, version: int, bundle: Path, **fields: Any) -> None:
        document = docs.Desired(fleet=FLEET, device=device, version=version,
                                issued_at=docs.utc_now(), model=spec(bundle), **fields)
        await self.link.publish(f"edge/{FLEET}/{device}/desired", docs.sign(document, self.key),
                                retain=True)

    async def command(self, device: str, request_id: str, name: str, *, signed: bool = True,
                      args: dict[str, Any] | None = None, **properties: Any) -> None:
        now = docs.utc_now()
        document = docs.Command(fleet=FLEET, device=device, request_id=request_id, command=name,
                                args=args or {}, issued_at=now,
                                expires_at=now + datetime.timedelta(minutes=5))
        payload = docs.sign(document, self.key) if signed else document.encode()
        await self.link.publish(f"edge/{FLEET}/{device}/cmd", payload, **properties)

    def on(self, topic: str) -> list[Message]:
        return [message for message in self.messages if message.topic == topic]

    def reported(self, device: str) -> docs.Reported | None:
        found = [message for message in self.on(f"edge/{FLEET}/{device}/reported")
                 if message.payload]
        return docs.decode(found[-1].payload, docs.Reported) if found else None

    def events(self, device: str) -> list[docs.Event]:
        return [docs.decode(message.payload, docs.Event)
                for message in self.on(f"edge/{FLEET}/{device}/events")]

    def committed(self, device: str, version: int) -> bool:
        """Whether the device's newest report says ``version`` is applied and its desired
        document converged."""
        reported = self.reported(device)
        return bool(reported is not None and reported.applied is not None
                    and reported.applied.version == version and reported.desired is not None
                    and reported.desired.status == "converged")

    async def until(self, condition: Callable[[], bool], what: str,
                    timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last reports: "
                                     f"{[m.payload[:300] for m in self.messages[-5:]]}")
            await asyncio.sleep(0.05)


def spec(bundle: Path) -> docs.ModelSpec:
    manifest_version = int(bundle.name.split("-")[1].split(".")[0])
    return docs.ModelSpec(name="tiny", version=manifest_version, url=bundle.resolve().as_uri(),
                          sha256=hashlib.sha256(bundle.read_bytes()).hexdigest())


@pytest.fixture
def fleet(tmp_path: Path) -> dict[str, Any]:
    keys = tmp_path / "keys"
    keys.mkdir()
    write_keypair(keys / "bundle.key")
    write_keypair(keys / "fleet.key")
    bundle_key = load_private_key(keys / "bundle.key")
    bundles = {version: make_bundle(tmp_path / "bundles", version=version, key=bundle_key)[0]
               for version in (1, 2, 3, 4)}
    broker = Mosquitto(tmp_path / "broker").start()
    try:
        yield {"dir": tmp_path, "bundles": bundles, "broker": broker,
               "fleet_key": load_private_key(keys / "fleet.key"),
               "fleet_pub": keys / "fleet.key.pub", "bundle_pub": keys / "bundle.key.pub"}
    finally:
        broker.close()


def device_config(fleet: dict[str, Any], name: str, *, protocol: str = "5",
                  port: int | None = None) -> Any:
    config = load_config(None, env={}, overrides={
        "state_dir": fleet["dir"] / name, "http.port": 0, "serving.backend": "onnxruntime",
        "trust.public_keys": [fleet["bundle_pub"]], "device_id": name,
        "fleet.enabled": True, "fleet.broker": "127.0.0.1",
        "fleet.port": port or fleet["broker"].port,
        "fleet.tls": False, "fleet.protocol": protocol, "fleet.fleet": FLEET,
        "fleet.public_keys": [fleet["fleet_pub"]], "fleet.reconnect_min_s": 0.05,
        "fleet.reconnect_max_s": 0.5})
    if not (fleet["dir"] / name / "current").exists():
        installer = Daemon(config)
        installer.make_current(installer.install(fleet["bundles"][1]))
        installer.close()
    return config


def daemon(config: Any, *, canary_s: float = 0.3) -> Daemon:
    return Daemon(config, canary_policy=CanaryPolicy(duration_s=canary_s, min_samples=1,
                                                     watch_min_requests=1),
                  update_policy=UpdatePolicy(watch_window_s=0.5))


class Running:
    """A daemon started in this event loop, stopped and closed on exit."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def __aenter__(self) -> Daemon:
        await self.daemon.start()
        return self.daemon

    async def __aexit__(self, *exc: object) -> None:
        await self.daemon.stop()
        self.daemon.close()


def run(scenario: Any, timeout_s: float = 180.0) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), timeout_s))


def test_a_signed_desired_updates_two_daemons_and_each_reports_the_new_version_committed(
        fleet: dict[str, Any]) -> None:
    names = ("cam-1", "cam-2")
    daemons = [daemon(device_config(fleet, name)) for name in names]

    async def scenario() -> None:
        async with Operator(fleet["broker"], fleet["fleet_key"]) as operator, \
                Running(daemons[0]), Running(daemons[1]):
            await operator.until(lambda: all(operator.reported(name) for name in names),
                                 "the first reports")
            for name in names:
                online = docs.decode(operator.on(f"edge/{FLEET}/{name}/online")[-1].payload)
                assert online.online
                assert operator.reported(name).applied.version == 1
                await operator.desired(name, 1, fleet["bundles"][2])
            await operator.until(lambda: all(operator.committed(name, 2) for name in names),
                                 "both devices on v2")
            for name, running in zip(names, daemons):
                reported = operator.reported(name)
                assert reported.desired.version == 1
                assert reported.applied.sha256 == spec(fleet["bundles"][2]).sha256
                assert reported.agent_version and reported.fingerprint["backend"] == "onnxruntime"
                assert running.services["tiny"].version == 2
                types = [event.type for event in operator.events(name)]
                assert types.index("desired.accepted") < types.index("update.state")
                sequences = [docs.decode(m.payload).sequence
                             for m in operator.on(f"edge/{FLEET}/{name}/reported")]
                assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
            before = {name: len(operator.on(f"edge/{FLEET}/{name}/reported")) for name in names}
        # A clean stop publishes a last reported document, then says offline itself (the Will
        # is for unclean ones).
        for name in names:
            assert not docs.decode(operator.on(f"edge/{FLEET}/{name}/online")[-1].payload).online
            reported = operator.on(f"edge/{FLEET}/{name}/reported")
            assert len(reported) > before[name]
            assert docs.decode(reported[-1].payload).applied.version == 2

    run(scenario)


def test_a_device_offline_through_three_desired_changes_applies_only_the_newest(
        fleet: dict[str, Any]) -> None:
    config = device_config(fleet, "cam-1")

    async def scenario() -> None:
        async with Operator(fleet["broker"], fleet["fleet_key"]) as operator:
            async with Running(daemon(config)):
                await operator.until(lambda: operator.reported("cam-1") is not None,
                                     "the first report")
            # Offline (its session stays on the broker): three changes meanwhile.
            for version in (1, 2, 3):
                await operator.desired("cam-1", version, fleet["bundles"][version + 1])
            returned = daemon(config)
            async with Running(returned):
                await operator.until(lambda: operator.committed("cam-1", 4), "v4 committed")
                await returned.fleet.settle()
                assert returned.updater.counters.swaps == 1
                assert returned.services["tiny"].version == 4
                committed = [event for event in operator.events("cam-1")
                             if event.type == "update.state"
                             and event.detail.get("to") == "committed"]
                assert len(committed) == 1

    run(scenario)


def test_the_broker_restarted_without_persistence_mid_update_and_the_device_converges(
        fleet: dict[str, Any]) -> None:
    config = device_config(fleet, "cam-1")
    broker: Mosquitto = fleet["broker"]

    async def scenario() -> None:
        async with Operator(broker, fleet["fleet_key"]) as operator:
            first = daemon(config, canary_s=2.0)
            async with Running(first):
                await operator.until(lambda: operator.reported("cam-1") is not None,
                                     "the first report")
                await operator.desired("cam-1", 1, fleet["bundles"][2])
                await operator.until(lambda: first.updater.state.value == "canary", "canary")
                # The broker dies mid-update and comes back empty: no retained desired, no
                # sessions. The update goes on, and the device reports once reconnected.
                seen = len(operator.on(f"edge/{FLEET}/cam-1/desired"))
                await asyncio.to_thread(broker.kill)
                await asyncio.sleep(0.5)
                await asyncio.to_thread(broker.restart)
                await operator.link.wait_connected(10)
                await operator.until(lambda: operator.committed("cam-1", 2), "v2 committed")
                # The operator subscribed again: the broker had no retained desired to give.
                assert len(operator.on(f"edge/{FLEET}/cam-1/desired")) == seen
                # The next document, then the broker down and the daemon restarted meanwhile.
                await operator.desired("cam-1", 2, fleet["bundles"][3])
                await operator.until(lambda: first.updater.state.value == "canary", "canary")
                await asyncio.to_thread(broker.kill)
            # Stopped mid-update with no broker; started again with none.
            second = daemon(config)
            async with Running(second):
                await operator.until(lambda: second.services["tiny"].version == 3,
                                     "v3 serving from the stored desired document")
                await asyncio.to_thread(broker.restart)
                await operator.link.wait_connected(10)
                await operator.until(lambda: operator.committed("cam-1", 3),
                                     "v3 reported once the broker is back")
                assert operator.reported("cam-1").desired.version == 2

    run(scenario)


def test_duplicated_commands_run_once_answered_each_time_with_their_correlation(
        fleet: dict[str, Any]) -> None:
    config = device_config(fleet, "cam-1")
    resp = f"edge/{FLEET}/cam-1/resp/operator-7"
    args = {"model": spec(fleet["bundles"][2]).to_json()}

    async def scenario() -> None:
        async with Operator(fleet["broker"], fleet["fleet_key"]) as operator:
            first = daemon(config)
            async with Running(first):
                await operator.until(lambda: operator.reported("cam-1") is not None,
                                     "the first report")
                for index in range(3):
                    await operator.command("cam-1", "u-1", "update", args=args,
                                           response_topic=resp,
                                           correlation_data=f"c{index}".encode())
                await operator.until(lambda: len(operator.on(resp)) == 3, "three answers")
                await operator.until(lambda: operator.committed("cam-1", 2)
                                     or first.services["tiny"].version == 2, "v2")
                await first.fleet.settle()
                assert first.updater.counters.attempts == 1
            second = daemon(config)
            async with Running(second):
                await operator.command("cam-1", "u-1", "update", args=args, response_topic=resp,
                                       correlation_data=b"after-restart")
                await operator.until(lambda: len(operator.on(resp)) == 4, "the fourth answer")
                assert second.updater.counters.attempts == 0
        answers = operator.on(resp)
        assert [answer.correlation_data for answer in answers] == [b"c0", b"c1", b"c2",
                                                                    b"after-restart"]
        documents = [docs.decode(answer.payload, docs.Response) for answer in answers]
        assert [document.repeated for document in documents] == [False, True, True, True]
        assert all(document.ok and document.request_id == "u-1" for document in documents)
        assert len({json.dumps(document.result, sort_keys=True) for document in documents}) == 1
        # None went to resp/<request_id>: the response topic asked for was the device's own.
        assert operator.on(f"edge/{FLEET}/cam-1/resp/u-1") == []

    run(scenario)


def test_mqtt_311_mode_answers_on_resp_request_id_and_converges(fleet: dict[str, Any]) -> None:
    config = device_config(fleet, "cam-1", protocol="3.1.1")

    async def scenario() -> None:
        async with Operator(fleet["broker"], fleet["fleet_key"], protocol="3.1.1") as operator:
            async with Running(daemon(config)):
                await operator.until(lambda: operator.reported("cam-1") is not None,
                                     "the first report")
                await operator.command("cam-1", "s-1", "status", signed=False)
                await operator.command("cam-1", "u-2", "update", signed=False,
                                       args={"model": spec(fleet["bundles"][2]).to_json()})
                await operator.until(lambda: operator.on(f"edge/{FLEET}/cam-1/resp/s-1")
                                     and operator.on(f"edge/{FLEET}/cam-1/resp/u-2"),
                                     "answers on resp/<request_id>")
                status = docs.decode(operator.on(f"edge/{FLEET}/cam-1/resp/s-1")[0].payload)
                assert status.ok and status.request_id == "s-1"
                assert status.result["reported"]["applied"]["version"] == 1
                refused = docs.decode(operator.on(f"edge/{FLEET}/cam-1/resp/u-2")[0].payload)
                assert not refused.ok and refused.error.reason == "unsigned"
                await operator.desired("cam-1", 1, fleet["bundles"][2])
                await operator.until(lambda: operator.committed("cam-1", 2), "v2 committed")

    run(scenario)


def test_edge_agent_serve_runs_the_control_plane_and_its_will_says_offline(
        fleet: dict[str, Any]) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tests.test_daemon import wait_ready
    from tests.brokers import free_port

    state = fleet["dir"] / "served"
    config_file = fleet["dir"] / "agent.toml"
    config_file.write_text(
        f'state_dir = "{state}"\ndevice_id = "cam-9"\n'
        f'[http]\nport = {free_port()}\n[serving]\nbackend = "onnxruntime"\n'
        '[update]\ncanary_s = 0.3\nwatch_window_s = 0.5\n'
        f'[fleet]\nenabled = true\nbroker = "127.0.0.1"\nport = {fleet["broker"].port}\n'
        f'tls = false\nfleet = "{FLEET}"\npublic_keys = ["{fleet["fleet_pub"]}"]\n'
        'reconnect_min_s = 0.05\nreconnect_max_s = 0.5\n')
    http_port = int(config_file.read_text().split("port = ")[1].split("\n")[0])
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("EDGE_AGENT_")}

    def serve() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", "--config", str(config_file), "--bundle",
             str(fleet["bundles"][1]), "--pubkey", str(fleet["bundle_pub"])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    async def scenario() -> None:
        async with Operator(fleet["broker"], fleet["fleet_key"]) as operator:
            online = f"edge/{FLEET}/cam-9/online"
            process = serve()
            try:
                await asyncio.to_thread(wait_ready, http_port, process)
                await operator.until(lambda: operator.reported("cam-9") is not None,
                                     "the served daemon's report")
                assert docs.decode(operator.on(online)[-1].payload).online
                await operator.desired("cam-9", 1, fleet["bundles"][2])
                await operator.until(lambda: operator.committed("cam-9", 2), "v2 committed")
            finally:
                process.send_signal(signal.SIGKILL)  # no clean disconnect: the Will goes
                await asyncio.to_thread(process.communicate, timeout=30)
            await operator.until(
                lambda: not docs.decode(operator.on(online)[-1].payload).online,
                "the Last Will")

    run(scenario)


@pytest.mark.skipif(not NATS_SERVER.exists(), reason="nats-server is not installed")
def test_agents_on_different_nats_nodes_converge_in_mqtt_311_mode(
        fleet: dict[str, Any]) -> None:
    cluster = NatsCluster(fleet["dir"] / "nats").start()
    names = ("cam-1", "cam-2")
    try:
        daemons = [daemon(device_config(fleet, name, protocol="3.1.1",
                                        port=cluster.mqtt_port(node + 1)))
                   for node, name in enumerate(names)]

        async def scenario() -> None:
            async with Operator(cluster, fleet["fleet_key"], node=0) as operator, \
                    Running(daemons[0]), Running(daemons[1]):
                await operator.until(lambda: all(operator.reported(name) for name in names),
                                     "the first reports")
                for name in names:
                    await operator.desired(name, 1, fleet["bundles"][3])
                await operator.until(lambda: all(operator.committed(name, 3)
                                                 for name in names), "both on v3")
                await operator.command("cam-2", "s-9", "status", signed=False)
                await operator.until(lambda: operator.on(f"edge/{FLEET}/cam-2/resp/s-9"),
                                     "the answer through another node")

        run(scenario)
    finally:
        cluster.close()


DEVICE_ACL = f"""\
user operator
topic readwrite edge/{FLEET}/#
pattern read edge/{FLEET}/%u/desired
pattern read edge/{FLEET}/%u/cmd
pattern write edge/{FLEET}/%u/reported
pattern write edge/{FLEET}/%u/events
pattern write edge/{FLEET}/%u/online
pattern write edge/{FLEET}/%u/resp/#
"""


def test_a_device_with_a_password_over_tls_under_an_acl_converges(fleet: dict[str, Any]) -> None:
    from tests.brokers import ThrowawayCA

    ca = ThrowawayCA(fleet["dir"] / "ca")
    password_file = fleet["dir"] / "cam-1.password"
    password_file.write_text("cam-1-secret\n")
    password_file.chmod(0o600)
    with Mosquitto(fleet["dir"] / "tls-broker", allow_anonymous=False, tls_ca=ca,
                   require_certificate=False, plain_listener=False, acl=DEVICE_ACL,
                   passwords={"operator": "op-secret", "cam-1": "cam-1-secret"}) as broker:
        base = device_config(fleet, "cam-1")
        config = load_config(None, env={}, overrides={
            "state_dir": base.state_dir, "http.port": 0, "serving.backend": "onnxruntime",
            "trust.public_keys": [fleet["bundle_pub"]], "device_id": "cam-1",
            "fleet.enabled": True, "fleet.broker": "127.0.0.1", "fleet.port": broker.tls_port,
            "fleet.tls": True, "fleet.ca_file": ca.ca_file, "fleet.username": "cam-1",
            "fleet.password_file": password_file, "fleet.fleet": FLEET,
            "fleet.public_keys": [fleet["fleet_pub"]], "fleet.reconnect_min_s": 0.05,
            "fleet.reconnect_max_s": 0.5})

        async def scenario() -> None:
            operator = Operator(broker, fleet["fleet_key"], options=broker.options(
                "operator", tls=True, username="operator", password="op-secret"))
            async with operator, Running(daemon(config)):
                await operator.until(lambda: operator.reported("cam-1") is not None,
                                     "a report over TLS")
                await operator.desired("cam-1", 1, fleet["bundles"][2])
                await operator.until(lambda: operator.committed("cam-1", 2), "v2 committed")
                await operator.command("cam-1", "s-1", "status", signed=False)
                await operator.until(lambda: operator.on(f"edge/{FLEET}/cam-1/resp/s-1"),
                                     "the answer")

        run(scenario)
