"""Provisioning and the production broker configuration, on a real Mosquitto started with exactly
the files ``fleet init`` and ``fleet devices add`` wrote: TLS only, no anonymous clients, each
device confined to its own topics (what Mosquitto 2.0 does with a denied subscription: grants it
and delivers nothing; with a denied publish: drops it, PUBACK 0x87), the operator identity on its
own listener with the whole fleet."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import ConfigError, FleetError
from agent.fleet.mqtt import BrokerOptions, Message, MqttLink
from agent.fleet.ops import broker as broker_config
from agent.fleet.ops.provision import add_device, remove_device, set_groups
from agent.fleet.ops.workspace import Workspace, load_inventory, load_workspace
from tests.fleet_ops_helpers import FleetBroker, make_workspace

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

WAIT_S = 10.0
QUIET_S = 0.5  # how long "nothing arrives" is watched for, after a marker that did arrive


def device_options(workspace: Workspace, device: str, *, client_id: str | None = None,
                   password: str | None = None, **overrides: Any) -> BrokerOptions:
    """How the provisioned device connects, from the files ``devices add`` wrote for it."""
    out = workspace.devices_dir / device
    config = tomllib.loads((out / "agent.toml").read_text())["fleet"]
    assert config["port"] == workspace.device_port
    auth: dict[str, Any]
    if workspace.device_auth == "certificate":
        auth = {"cert_file": out / "device.crt", "key_file": out / "device.key"}
    else:
        auth = {"username": config["username"],
                "password": password or (out / "mqtt-password").read_text().strip()}
    return BrokerOptions(host="127.0.0.1", port=workspace.device_port,
                         client_id=client_id or device, tls=True, ca_file=out / "fleet-ca.crt",
                         reconnect_min_s=0.2, reconnect_max_s=1.0, **auth, **overrides)


class Client:
    """An MqttLink that keeps what it receives."""

    def __init__(self, options: BrokerOptions, subscriptions: list[tuple[str, int]]) -> None:
        self.received: list[Message] = []
        self.arrived = asyncio.Event()
        self.link = MqttLink(options, subscriptions=subscriptions, on_message=self._on_message)

    async def _on_message(self, message: Message) -> None:
        self.received.append(message)
        self.arrived.set()

    def payloads(self, topic: str) -> list[bytes]:
        return [message.payload for message in self.received if message.topic == topic]

    async def until(self, topic: str, payload: bytes) -> None:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while payload not in self.payloads(topic):
            remaining = deadline - asyncio.get_running_loop().time()
            assert remaining > 0, f"{payload!r} never arrived on {topic}: {self.received}"
            self.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)


@contextlib.asynccontextmanager
async def connected(options: BrokerOptions,
                    subscriptions: list[tuple[str, int]] | None = None) -> AsyncIterator[Client]:
    client = Client(options, subscriptions or [])
    await client.link.start()
    try:
        await client.link.wait_connected(WAIT_S)
        await asyncio.sleep(0.2)  # the SUBACK
        yield client
    finally:
        await client.link.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    workspace = make_workspace(tmp_path / "fleet")
    for device in ("cam-a", "cam-b"):
        add_device(workspace, device, groups=["line1"])
    with FleetBroker(workspace) as running:
        yield workspace, running


def test_init_and_devices_add_write_the_files_a_device_installs(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path / "fleet")
    made = add_device(workspace, "cam-1", groups=["line1", "north"])
    out = workspace.devices_dir / "cam-1"
    assert {path.name for path in made.files} == {"agent.toml", "mqtt-password", "fleet-ca.crt",
                                                  "fleet.pub"}
    assert (out / "mqtt-password").stat().st_mode & 0o077 == 0
    config = tomllib.loads((out / "agent.toml").read_text())
    assert config["device_id"] == "cam-1"
    assert config["fleet"]["username"] == "cam-1"
    assert config["fleet"]["public_keys"] == ["/etc/edge-agent/fleet/fleet.pub"]
    assert (out / "fleet.pub").read_bytes() == workspace.public_key_path.read_bytes()
    # The broker's file has the user, hashed, never the password itself.
    passwd = (workspace.broker_dir / "passwd").read_text()
    password = (out / "mqtt-password").read_text().strip()
    assert passwd.startswith("cam-1:$") and password not in passwd
    assert broker_config.users(workspace.broker_dir / "passwd") == ["cam-1"]
    assert ("read", "edge/plant/cam-1/desired") in made.acl
    inventory = load_inventory(workspace)
    assert inventory.groups == {"line1": ["cam-1"], "north": ["cam-1"]}
    assert inventory.select(groups=["north"]) == ["cam-1"]
    with pytest.raises(FleetError, match="provisioned already"):
        add_device(workspace, "cam-1")
    add_device(workspace, "cam-1", rotate=True)
    assert (out / "mqtt-password").read_text().strip() != password
    assert broker_config.users(workspace.broker_dir / "passwd") == ["cam-1"]
    set_groups(workspace, "cam-1", ["south"])
    assert load_inventory(workspace).groups == {"south": ["cam-1"]}
    for bad in ("cam/1", "+", "rollouts", "operator", ""):
        with pytest.raises(ConfigError):
            add_device(workspace, bad)
    assert load_workspace(workspace.root) == workspace
    with pytest.raises(ConfigError, match="holds a fleet workspace already"):
        make_workspace(workspace.root)


def test_the_acl_confines_each_device_to_its_own_topics(fleet: Any) -> None:
    workspace, _ = fleet
    root = "edge/plant"

    async def scenario() -> None:
        operator = workspace.operator_options("ops-test", reconnect_min_s=0.2,
                                              reconnect_max_s=1.0)
        async with connected(operator, [(f"{root}/#", 1)]) as ops, \
                connected(device_options(workspace, "cam-a"),
                          [(f"{root}/cam-b/desired", 1), (f"{root}/cam-b/cmd", 1),
                           (f"{root}/+/reported", 1), (f"{root}/#", 1)]) as cam_a, \
                connected(device_options(workspace, "cam-b"),
                          [(f"{root}/cam-b/desired", 1), (f"{root}/cam-b/cmd", 1)]) as cam_b:
            # The operator writes every device's desired and cmd.
            for device in ("cam-a", "cam-b"):
                await ops.link.publish(f"{root}/{device}/desired", f"d-{device}".encode(),
                                       retain=True)
                await ops.link.publish(f"{root}/{device}/cmd", f"c-{device}".encode())
            await cam_b.until(f"{root}/cam-b/desired", b"d-cam-b")
            await cam_b.until(f"{root}/cam-b/cmd", b"c-cam-b")
            await cam_a.until(f"{root}/cam-a/desired", b"d-cam-a")
            await cam_a.until(f"{root}/cam-a/cmd", b"c-cam-a")

            # A device writes its own reported, events, online and resp/...
            for leaf in ("reported", "events", "online", "resp/r-1"):
                await cam_a.link.publish(f"{root}/cam-a/{leaf}", f"own {leaf}".encode())
                await ops.until(f"{root}/cam-a/{leaf}", f"own {leaf}".encode())
            # ...and nothing of another device's, nor the operator's topics: refused (0x87)
            # and never delivered.
            forged = [f"{root}/cam-b/{leaf}" for leaf in
                      ("reported", "events", "online", "resp/r-1", "desired", "cmd")]
            forged += [f"{root}/cam-a/desired", f"{root}/cam-a/cmd", f"{root}/rollouts/r1"]
            for topic in forged:
                with pytest.raises(FleetError) as refused:
                    await cam_a.link.publish(topic, b"forged", retain=True)
                assert refused.value.reason == "not_authorized", topic
            await ops.link.publish(f"{root}/cam-b/desired", b"marker", retain=True)
            await cam_b.until(f"{root}/cam-b/desired", b"marker")
            await ops.until(f"{root}/cam-b/desired", b"marker")
            await asyncio.sleep(QUIET_S)
            assert all(message.payload != b"forged" for message in ops.received)
            assert all(message.payload != b"forged" for message in cam_b.received)

            # cam-a's subscriptions to cam-b's topics and to the whole fleet were granted but
            # carried only its own documents.
            others = [message.topic for message in cam_a.received
                      if not message.topic.startswith(f"{root}/cam-a/")]
            assert others == []
            assert b"marker" not in [message.payload for message in cam_a.received]

    asyncio.run(scenario())


def test_a_device_cannot_take_over_another_devices_client_id(fleet: Any) -> None:
    workspace, running = fleet
    root = "edge/plant"

    async def scenario() -> None:
        operator = workspace.operator_options("ops-test")
        async with connected(operator, []) as ops, \
                connected(device_options(workspace, "cam-b"),
                          [(f"{root}/cam-b/cmd", 1)]) as cam_b, \
                connected(device_options(workspace, "cam-a", client_id="cam-b"),
                          [(f"{root}/cam-b/cmd", 1)]) as impostor:
            # The broker renamed the impostor's client id to its user name: cam-b stays.
            await asyncio.sleep(0.5)
            assert cam_b.link.connected and cam_b.link.connect_count == 1
            await ops.link.publish(f"{root}/cam-b/cmd", b"for cam-b")
            await cam_b.until(f"{root}/cam-b/cmd", b"for cam-b")
            await asyncio.sleep(QUIET_S)
            assert impostor.received == []
        assert "as cam-a" in running.log_text()

    asyncio.run(scenario())


def test_credentials_tls_and_the_operator_listener(fleet: Any) -> None:
    workspace, running = fleet

    async def refused(options: BrokerOptions) -> FleetError:
        link = MqttLink(options, subscriptions=[], on_message=_ignore)
        await link.start()
        try:
            with pytest.raises(FleetError) as failure:
                await link.wait_connected(3.0)
            return failure.value
        finally:
            await link.stop()

    async def scenario() -> None:
        # A wrong password, and a device's password on the operator listener.
        wrong = await refused(device_options(workspace, "cam-a", password="not-it"))
        assert wrong.reason in ("bad_credentials", "not_authorized")
        on_operator_port = device_options(workspace, "cam-a")
        on_operator_port = BrokerOptions(**{**on_operator_port.__dict__,
                                            "port": workspace.operator_port})
        assert (await refused(on_operator_port)).reason in ("timeout", "tls")
        # A removed device, once the broker re-read its password file.
        assert remove_device(workspace, "cam-b")
        running._process.send_signal(1)  # SIGHUP
        await asyncio.sleep(0.5)
        gone = await refused(device_options(workspace, "cam-b"))
        assert gone.reason in ("bad_credentials", "not_authorized")

    asyncio.run(scenario())
    # No plain-text MQTT anywhere: a TCP client that does not speak TLS gets nothing back.
    for port in (workspace.device_port, workspace.operator_port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")  # CONNECT, 3.1.1
            raw.settimeout(3)
            try:
                reply = raw.recv(4)
            except OSError:
                reply = b""
            assert not reply.startswith(b"\x20"), reply  # no CONNACK
    # And the server certificate is the fleet CA's, for the broker host.
    context = ssl.create_default_context(cafile=str(workspace.fleet_ca[0]))
    with socket.create_connection(("127.0.0.1", workspace.device_port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_certificate_mode_devices_and_their_confinement(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path / "fleet", device_auth="certificate")
    for device in ("cam-a", "cam-b"):
        made = add_device(workspace, device)
        assert {path.name for path in made.files} >= {"device.crt", "device.key"}
    assert broker_config.users(workspace.broker_dir / "passwd") == []
    root = "edge/plant"

    async def scenario() -> None:
        operator = workspace.operator_options("ops-test")
        async with connected(operator, [(f"{root}/#", 1)]) as ops, \
                connected(device_options(workspace, "cam-a", client_id="anything"),
                          [(f"{root}/cam-a/desired", 1), (f"{root}/cam-b/desired", 1)]) as cam_a:
            await ops.link.publish(f"{root}/cam-a/desired", b"mine", retain=True)
            await ops.link.publish(f"{root}/cam-b/desired", b"not mine", retain=True)
            await cam_a.until(f"{root}/cam-a/desired", b"mine")
            await cam_a.link.publish(f"{root}/cam-a/reported", b"ok")
            await ops.until(f"{root}/cam-a/reported", b"ok")
            with pytest.raises(FleetError):
                await cam_a.link.publish(f"{root}/cam-b/reported", b"forged")
            await asyncio.sleep(QUIET_S)
            assert cam_a.payloads(f"{root}/cam-b/desired") == []
            assert b"forged" not in [message.payload for message in ops.received]
        # A device certificate does not open the operator listener (operator CA only).
        cam = device_options(workspace, "cam-a")
        link = MqttLink(BrokerOptions(**{**cam.__dict__, "port": workspace.operator_port}),
                        subscriptions=[], on_message=_ignore)
        await link.start()
        try:
            with pytest.raises(FleetError):
                await link.wait_connected(3.0)
        finally:
            await link.stop()

    with FleetBroker(workspace):
        asyncio.run(scenario())


def test_retained_documents_survive_a_broker_restart(fleet: Any) -> None:
    workspace, running = fleet
    topic = "edge/plant/cam-a/desired"

    async def publish() -> None:
        async with connected(workspace.operator_options("ops-test"), []) as ops:
            await ops.link.publish(topic, b"kept", retain=True)

    async def read() -> None:
        async with connected(device_options(workspace, "cam-a"), [(topic, 1)]) as cam_a:
            await cam_a.until(topic, b"kept")

    asyncio.run(publish())
    running.stop()  # SIGTERM: Mosquitto saves its store
    running.restart()
    asyncio.run(read())


async def _ignore(message: Message) -> None:
    pass
