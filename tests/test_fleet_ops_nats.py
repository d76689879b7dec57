"""One rollout on a clustered broker: a 3-node NATS cluster's MQTT gateway (MQTT 3.1.1, retained
messages in JetStream), each agent on a different node, the operator on yet another view of the
cluster. The operator's sync marker and retained documents work there as on Mosquitto, and the
rollout converges; then a rollback goes the same way."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.config import load_config
from agent.daemon import Daemon
from agent.fleet.documents import ModelSpec, utc_now
from agent.fleet.ops.deploy import RolloutDriver, turn_back
from agent.fleet.ops.operator import OperatorLink
from agent.fleet.ops.rollout import Policy, new_rollout
from agent.update.canary import CanaryPolicy
from agent.update.states import UpdatePolicy
from models.signing import load_private_key, write_keypair
from tests.brokers import NATS_SERVER, NatsCluster

pytest.importorskip("onnxruntime")
if not NATS_SERVER.exists():
    pytest.skip("nats-server is not installed", allow_module_level=True)

from tests.tiny_models import make_bundle  # noqa: E402 - needs onnx

FLEET = "plant"


def spec(bundle: Path, version: int) -> ModelSpec:
    return ModelSpec(name="tiny", version=version, url=bundle.resolve().as_uri(),
                     sha256=hashlib.sha256(bundle.read_bytes()).hexdigest())


@contextlib.asynccontextmanager
async def daemons_on(cluster: NatsCluster, tmp_path: Path, names: list[str],
                     bundles: dict[int, Path]) -> AsyncIterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        for index, name in enumerate(names):
            config = load_config(None, env={}, overrides={
                "state_dir": tmp_path / "state" / name, "http.port": 0,
                "serving.backend": "onnxruntime", "device_id": name,
                "trust.public_keys": [tmp_path / "bundle.key.pub"],
                "fleet.enabled": True, "fleet.broker": "127.0.0.1",
                "fleet.port": cluster.mqtt_port(index % len(cluster.nodes)),
                "fleet.tls": False, "fleet.protocol": "3.1.1", "fleet.fleet": FLEET,
                "fleet.public_keys": [tmp_path / "fleet.key.pub"],
                "fleet.reconnect_min_s": 0.05, "fleet.reconnect_max_s": 0.5})
            installer = Daemon(config)
            installer.make_current(installer.install(bundles[1]))
            installer.close()
            daemon = Daemon(config, canary_policy=CanaryPolicy(duration_s=0.3, min_samples=1,
                                                               watch_min_requests=1),
                            update_policy=UpdatePolicy(watch_window_s=0.5))
            await daemon.start()
            started.append(daemon)
        yield started
    finally:
        for daemon in started:
            await daemon.stop()
            daemon.close()


def test_agents_on_different_nats_nodes_converge_on_one_rollout(tmp_path: Path) -> None:
    write_keypair(tmp_path / "bundle.key")
    write_keypair(tmp_path / "fleet.key")
    key = load_private_key(tmp_path / "bundle.key")
    bundles = {version: make_bundle(tmp_path / "b", version=version, key=key)[0]
               for version in (1, 2)}
    names = ["cam-1", "cam-2", "cam-3"]

    async def scenario(cluster: NatsCluster) -> None:
        lines: list[str] = []
        async with daemons_on(cluster, tmp_path, names, bundles) as daemons:
            link = OperatorLink(cluster.options("ops-nats", node=2, session_expiry_s=0,
                                                reconnect_min_s=0.1, reconnect_max_s=1.0),
                                fleet=FLEET, signing_key=load_private_key(tmp_path / "fleet.key"),
                                trusted_keys=[load_private_key(tmp_path / "fleet.key")
                                              .public_key()])
            await link.start()
            try:
                deadline = asyncio.get_running_loop().time() + 60
                while sorted(link.view.reported) != names:  # every agent has reported
                    assert asyncio.get_running_loop().time() < deadline, link.view.reported
                    await asyncio.sleep(0.1)
                rollout = new_rollout(fleet=FLEET, rollout_id="r-nats", model=spec(bundles[2], 2),
                                      devices=names, policy=Policy(stages=("1", "100%")),
                                      now=utc_now(), views=link.view.views(names))
                previous = {"tiny": spec(bundles[1], 1)}

                def resolve(name: str, version: int) -> ModelSpec | None:
                    return previous["tiny"] if (name, version) == ("tiny", 1) else None

                driver = RolloutDriver(link, rollout, resolve=resolve, on_progress=lines.append)
                final = await asyncio.wait_for(driver.run(), 120)
                assert final.state == "completed", lines
                assert [daemon.services["tiny"].version for daemon in daemons] == [2, 2, 2]
                # The retained rollout document is on every node: a fresh operator on node 0
                # reads it.
                other = OperatorLink(cluster.options("ops-nats-2", node=0, session_expiry_s=0),
                                     fleet=FLEET, signing_key=load_private_key(
                                         tmp_path / "fleet.key"),
                                     trusted_keys=[load_private_key(tmp_path / "fleet.key")
                                                   .public_key()])
                await other.start()
                try:
                    assert other.view.rollouts["r-nats"].state == "completed"
                    assert {device: other.view.desired[device].version
                            for device in names} == {
                        device: final.devices[device].desired.version  # type: ignore[union-attr]
                        for device in names}
                finally:
                    await other.stop()

                turn_back(final, link, utc_now())
                back = await asyncio.wait_for(RolloutDriver(link, final, resolve=resolve,
                                                            on_progress=lines.append).run(), 120)
                assert back.state == "rolled_back", lines
                assert [daemon.services["tiny"].version for daemon in daemons] == [1, 1, 1]
            finally:
                await link.stop()

    with NatsCluster(tmp_path / "nats") as cluster:
        asyncio.run(asyncio.wait_for(scenario(cluster), 300))
