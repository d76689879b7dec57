"""The fleet control plane attached to a daemon, as agent/update/service.py attaches the updater.

:func:`attach_fleet` makes the :class:`~agent.fleet.device.FleetDevice` from ``[fleet]`` (the
broker, the credentials, the fleet's keys) around the daemon's updater and runs it as a
background task once the daemon serves. The daemon calls it only when ``fleet.enabled``, so a
board without fleet control never imports paho.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

from agent.errors import InternalError
from agent.fleet.device import FleetDevice
from agent.fleet.mqtt import BrokerOptions

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.daemon import Daemon


def broker_options(config: AgentConfig) -> BrokerOptions:
    """``[fleet]``'s broker and credentials; the client id is the device id."""
    fleet = config.fleet
    return BrokerOptions(
        host=fleet.broker, port=fleet.port, client_id=config.device_id, protocol=fleet.protocol,
        username=fleet.username or None,
        password=fleet.password.reveal() if fleet.password is not None else None,
        tls=fleet.tls, ca_file=fleet.ca_file, cert_file=fleet.cert_file, key_file=fleet.key_file,
        keepalive_s=fleet.keepalive_s, session_expiry_s=fleet.session_expiry_s,
        reconnect_min_s=fleet.reconnect_min_s, reconnect_max_s=fleet.reconnect_max_s)


def fingerprint(config: AgentConfig) -> dict[str, Any]:
    """What kind of device this is, for ``reported``."""
    return {"device_class": config.device_class or None, "machine": platform.machine(),
            "system": platform.system(), "release": platform.release(),
            "python": platform.python_version(), "backend": config.serving.backend}


def attach_fleet(daemon: Daemon) -> FleetDevice:
    """Give ``daemon`` its fleet control plane (a background task); needs its updater."""
    if daemon.updater is None:
        raise InternalError("the fleet control plane needs the daemon's updater")
    config = daemon.config

    def health() -> dict[str, Any]:
        status = daemon.status()
        return {"daemon": status["state"], "models": status["models"],
                "failed_tasks": [task["name"] for task in status["tasks"]
                                 if task.get("state") == "failed"]}

    device = FleetDevice(fleet=config.fleet.fleet, device=config.device_id,
                         updater=daemon.updater, state_dir=config.state_dir,
                         keys=config.fleet.keys, options=broker_options(config),
                         fingerprint=fingerprint(config), health=health,
                         power=daemon.power)
    daemon.add_task("fleet", device.run)
    daemon.fleet = device
    return device


__all__ = ["attach_fleet", "broker_options", "fingerprint"]
