"""Making a fleet and its devices: ``fleet init``, ``fleet broker-config``, ``fleet devices add``.

``init`` makes the workspace (agent/fleet/ops/workspace.py): the fleet signing key, the fleet CA
and the operator CA, the broker's server certificate, the operator certificate, the broker's
configuration, ACL and (empty) password file, and fleet.toml.

``devices add DEVICE`` gives a device its credentials (a random password, stored hashed in the
broker's password file, or a client certificate of the fleet CA whose common name is the device
id), records it and its groups in devices.json, and writes the files to install on the device:

    agent.toml          device_id, [trust] (bundle keys) and [fleet] (broker, credentials, keys)
    fleet-ca.crt        to check the broker's certificate
    fleet.pub           the key desired documents and commands are signed with
    bundle-keys/*.pub   the keys bundles are signed with
    mqtt-password       (password mode; 0600) or device.crt + device.key (certificate mode)

The ACL needs no line per device: its ``pattern`` lines give every user exactly its own topics
(agent/fleet/ops/broker.py). After adding or removing a device, the broker must re-read its
password file: copy ``broker/passwd`` to the broker host and send Mosquitto a SIGHUP.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError, DocumentError, FleetError
from agent.fleet.ops import broker, pki
from agent.fleet.ops.workspace import (
    FLEET_TOML,
    DeviceRecord,
    Workspace,
    load_inventory,
    private_dir,
    save_inventory,
    toml_text,
    utc_stamp,
    workspace_lock,
    write_fleet_toml,
)
from agent.fleet.topics import check_id
from agent.fsutil import atomic_write_bytes, atomic_write_text, read_bounded
from models.signing import load_public_key, write_keypair

__all__ = [
    "DEVICE_INSTALL_DIR",
    "DeviceFiles",
    "add_device",
    "init_workspace",
    "remove_device",
    "write_broker_config",
]

# Where the device's files go on the board; agent.toml names them there.
DEVICE_INSTALL_DIR = Path("/etc/edge-agent/fleet")
PASSWORD_BYTES = 24  # 32 URL-safe characters
MAX_KEY_BYTES = 64 * 1024


@dataclass(frozen=True)
class DeviceFiles:
    """What ``devices add`` made."""

    device: str
    directory: Path
    files: tuple[Path, ...]
    acl: tuple[tuple[str, str], ...]
    auth: str


def init_workspace(root: Path, *, fleet: str, broker_host: str,
                   broker_names: Sequence[str] = (), device_port: int = 8883,
                   operator_port: int = 8884, protocol: str = "5",
                   device_auth: str = "password", operator_name: str = "operator",
                   artifacts_dir: Path | None = None, artifacts_base_url: str = "",
                   bundle_keys: Sequence[Path] = ()) -> Workspace:
    """Make a new fleet workspace in ``root`` (see the module's docstring).

    Raises:
        ConfigError: ``root`` already holds a workspace, or a value is invalid.
        KeyFileError: a bundle key cannot be read.
    """
    root = Path(root).resolve()
    if (root / FLEET_TOML).exists():
        raise ConfigError("this directory holds a fleet workspace already", path=root)
    copied: list[Path] = []
    for index, key in enumerate(bundle_keys):
        load_public_key(key)  # refuse a bad or private key before anything is written
        copied.append(root / "keys" / "bundle" / f"bundle-{index + 1}.pub")
    workspace = Workspace(root=root, fleet=fleet, broker_host=broker_host,
                          device_port=device_port, operator_port=operator_port,
                          protocol=protocol, device_auth=device_auth,
                          operator_name=operator_name,
                          artifacts_dir=(Path(artifacts_dir).resolve() if artifacts_dir
                                         else root / "artifacts"),
                          artifacts_base_url=artifacts_base_url, bundle_keys=tuple(copied))
    root.mkdir(parents=True, exist_ok=True)
    with workspace_lock(workspace):
        for source, target in zip(bundle_keys, copied):
            atomic_write_bytes(target, read_bounded(source, MAX_KEY_BYTES), mode=0o644)
        private_dir(root / "keys")
        write_keypair(workspace.signing_key_path)
        private_dir(root / "ca")
        fleet_ca = pki.make_authority(*workspace.fleet_ca, common_name=f"{fleet} fleet CA")
        operator_ca = pki.make_authority(*workspace.operator_ca,
                                         common_name=f"{fleet} operator CA")
        private_dir(root / "operator")
        pki.make_client_certificate(operator_ca, *workspace.operator_cert,
                                    common_name=operator_name)
        files = private_dir(workspace.broker_dir)
        pki.make_server_certificate(fleet_ca, files / broker.SERVER_CERT,
                                    files / broker.SERVER_KEY,
                                    hosts=[broker_host, *broker_names])
        shutil.copyfile(workspace.fleet_ca[0], files / broker.FLEET_CA)
        shutil.copyfile(workspace.operator_ca[0], files / broker.OPERATOR_CA)
        atomic_write_text(files / broker.PASSWORD_FILE, "", mode=0o600)
        write_broker_config(workspace)
        save_inventory(load_inventory(workspace), fleet)
        write_fleet_toml(workspace)
    return workspace


def write_broker_config(workspace: Workspace, *, install_dir: Path | None = None,
                        persistence_dir: Path | None = None, bind_address: str | None = None,
                        run_as_user: str | None = None, log_dest: str = "syslog",
                        autosave_interval_s: int = 30) -> tuple[Path, Path]:
    """Write ``broker/mosquitto.conf`` and ``broker/acl``.

    Args:
        install_dir: Where the broker's files will be on the broker host (default: the
            workspace's broker directory, for a broker on this machine).
        persistence_dir: Mosquitto's store (default: ``/var/lib/mosquitto``).

    Returns:
        The configuration file and the ACL file.
    """
    layout = broker.BrokerLayout(
        fleet=workspace.fleet, operator=workspace.operator_name,
        device_auth=workspace.device_auth,
        files_dir=Path(install_dir) if install_dir else workspace.broker_dir,
        persistence_dir=Path(persistence_dir) if persistence_dir else Path("/var/lib/mosquitto"),
        device_port=workspace.device_port, operator_port=workspace.operator_port,
        bind_address=bind_address, run_as_user=run_as_user, log_dest=log_dest,
        autosave_interval_s=autosave_interval_s)
    files = workspace.broker_dir
    config, acl = files / broker.CONFIG_FILE, files / broker.ACL_FILE
    atomic_write_text(config, broker.mosquitto_conf(layout), mode=0o644)
    atomic_write_text(acl, broker.acl_text(layout), mode=0o644)
    return config, acl


def add_device(workspace: Workspace, device: str, *, groups: Sequence[str] = (),
               out_dir: Path | None = None, install_dir: Path = DEVICE_INSTALL_DIR,
               rotate: bool = False) -> DeviceFiles:
    """Provision ``device`` (see the module's docstring).

    Args:
        out_dir: Where the device's files are written (default ``devices/<device>/``).
        install_dir: Where they will be on the device (agent.toml names them there).
        rotate: Give a device that is already provisioned new credentials (its old ones stop
            working once the broker re-reads its password file; an old certificate stays
            valid until it expires: Mosquitto has no revocation without a CRL).

    Raises:
        ConfigError: an invalid device or group id, or the operator's own name.
        FleetError: the device is provisioned already (and ``rotate`` is not set).
    """
    try:
        check_id(device, "device")
        for group in groups:
            check_id(group, "group")
    except DocumentError as exc:
        raise ConfigError(exc.message, **exc.fields) from None
    if device == workspace.operator_name:
        raise ConfigError("a device cannot be named as the operator identity", device=device)
    out = Path(out_dir) if out_dir is not None else workspace.devices_dir / device
    with workspace_lock(workspace):
        inventory = load_inventory(workspace)
        existing = inventory.devices.get(device)
        if existing is not None and not rotate:
            raise FleetError("this device is provisioned already (--rotate gives it new "
                             "credentials)", reason="exists", device=device,
                             groups=",".join(existing.groups))
        private_dir(out)
        files: list[Path] = []
        fleet_section: dict[str, object] = {
            "enabled": True,
            "fleet": workspace.fleet,
            "broker": workspace.broker_host,
            "port": workspace.device_port,
            "protocol": workspace.protocol,
            "tls": True,
            "ca_file": str(install_dir / "fleet-ca.crt"),
        }
        if workspace.device_auth == "certificate":
            fleet_ca = pki.load_authority(*workspace.fleet_ca)
            pki.make_client_certificate(fleet_ca, out / "device.crt", out / "device.key",
                                        common_name=device)
            files += [out / "device.crt", out / "device.key"]
            fleet_section.update(cert_file=str(install_dir / "device.crt"),
                                 key_file=str(install_dir / "device.key"))
        else:
            password = secrets.token_urlsafe(PASSWORD_BYTES)
            broker.set_password(workspace.broker_dir / broker.PASSWORD_FILE, device, password)
            atomic_write_text(out / "mqtt-password", password + "\n", mode=0o600)
            files.append(out / "mqtt-password")
            fleet_section.update(username=device,
                                 password_file=str(install_dir / "mqtt-password"))
        shutil.copyfile(workspace.fleet_ca[0], out / "fleet-ca.crt")
        shutil.copyfile(workspace.public_key_path, out / "fleet.pub")
        files += [out / "fleet-ca.crt", out / "fleet.pub"]
        fleet_section["public_keys"] = [str(install_dir / "fleet.pub")]
        bundle_keys: list[str] = []
        for key in workspace.bundle_keys:
            target = out / "bundle-keys" / key.name
            atomic_write_bytes(target, read_bounded(key, MAX_KEY_BYTES), mode=0o644)
            files.append(target)
            bundle_keys.append(str(install_dir / "bundle-keys" / key.name))
        tables: dict[str, dict[str, object]] = {}
        if bundle_keys:
            tables["trust"] = {"public_keys": bundle_keys}
        tables["fleet"] = fleet_section
        config = ("# For /etc/edge-agent/agent.toml on the device (merge it with what is there);\n"
                  f"# the files it names go to {install_dir}/.\n"
                  + toml_text({"device_id": device}, tables))
        atomic_write_text(out / "agent.toml", config, mode=0o644)
        files.insert(0, out / "agent.toml")
        record = DeviceRecord(device=device, groups=tuple(dict.fromkeys(groups)),
                              auth=workspace.device_auth,
                              added_at=existing.added_at if existing else utc_stamp())
        save_inventory(inventory.with_device(record), workspace.fleet)
    return DeviceFiles(device=device, directory=out, files=tuple(files),
                       acl=tuple(broker.device_acl_topics(workspace.fleet, device)),
                       auth=workspace.device_auth)


def set_groups(workspace: Workspace, device: str, groups: Sequence[str]) -> DeviceRecord:
    """Replace a provisioned device's groups."""
    try:
        for group in groups:
            check_id(group, "group")
    except DocumentError as exc:
        raise ConfigError(exc.message, **exc.fields) from None
    with workspace_lock(workspace):
        inventory = load_inventory(workspace)
        existing = inventory.devices.get(device)
        if existing is None:
            raise FleetError("no such device in the fleet's devices file", reason="unknown",
                             device=device)
        record = DeviceRecord(device=device, groups=tuple(dict.fromkeys(groups)),
                              auth=existing.auth, added_at=existing.added_at)
        save_inventory(inventory.with_device(record), workspace.fleet)
    return record


def remove_device(workspace: Workspace, device: str) -> bool:
    """Forget ``device`` and remove its password (a certificate stays valid until it expires);
    whether it was there."""
    with workspace_lock(workspace):
        inventory = load_inventory(workspace)
        known = device in inventory.devices
        removed = broker.remove_user(workspace.broker_dir / broker.PASSWORD_FILE, device)
        if known:
            save_inventory(inventory.without(device), workspace.fleet)
    return known or removed
