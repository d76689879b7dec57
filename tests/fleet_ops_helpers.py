"""Helpers for the operator-side tests: a fleet workspace on free ports, and Mosquitto run with
exactly the configuration ``fleet init`` / ``fleet broker-config`` wrote for it."""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from pathlib import Path

from agent.fleet.ops.broker import CONFIG_FILE
from agent.fleet.ops.provision import init_workspace, write_broker_config
from agent.fleet.ops.workspace import Workspace
from tests.brokers import Mosquitto, free_port


def make_workspace(root: Path, *, fleet: str = "plant", device_auth: str = "password",
                   bundle_keys: Sequence[Path] = (), protocol: str = "5",
                   artifacts_base_url: str = "") -> Workspace:
    """A fleet workspace whose broker listens on two free ports of 127.0.0.1, its store and log
    in ``root/broker-run``, running as whoever runs the tests."""
    device_port = free_port()
    operator_port = free_port(exclude=[device_port])
    workspace = init_workspace(root, fleet=fleet, broker_host="127.0.0.1",
                               broker_names=["localhost"], device_port=device_port,
                               operator_port=operator_port, device_auth=device_auth,
                               protocol=protocol, bundle_keys=bundle_keys,
                               artifacts_base_url=artifacts_base_url)
    run = root / "broker-run"
    (run / "store").mkdir(parents=True, exist_ok=True)
    write_broker_config(workspace, persistence_dir=run / "store", bind_address="127.0.0.1",
                        run_as_user=pwd.getpwuid(os.getuid()).pw_name, log_dest="stderr",
                        autosave_interval_s=1)
    return workspace


class FleetBroker(Mosquitto):
    """Mosquitto started with the workspace's own ``broker/mosquitto.conf`` (kill, stop,
    restart and SIGHUP reload as tests/brokers.py's :class:`Mosquitto`)."""

    def __init__(self, workspace: Workspace) -> None:
        # Not Mosquitto.__init__: that one writes a configuration of its own.
        self.workspace = workspace
        self.directory = workspace.root / "broker-run"
        self.config_file = workspace.broker_dir / CONFIG_FILE
        self.log_file = self.directory / "mosquitto.log"
        self.acl = None
        self.acl_file = None
        self.port = workspace.device_port
        self.tls_port = workspace.operator_port
        self._process = None

    def start(self) -> FleetBroker:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._spawn()
        return self

    def _ports(self) -> list[int]:
        return [self.workspace.device_port, self.workspace.operator_port]

    def __enter__(self) -> FleetBroker:
        return self.start()
