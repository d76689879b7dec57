"""The operator's workspace: one directory per fleet, made by ``fleet init``.

    fleet.toml                the fleet's settings (below); paths in it are relative to it
    devices.json              the devices and their groups (``devices add`` writes it)
    keys/fleet.key(.pub)      Ed25519: signs desired documents, commands and rollout documents
    ca/fleet-ca.crt(.key)     signs the broker's server certificate (and device certificates)
    ca/operator-ca.crt(.key)  signs operator certificates only
    operator/operator.crt     the operator identity's client certificate (and .key)
    broker/                   the broker's files: mosquitto.conf, acl, passwd, server cert, CAs
    devices/<id>/             what ``devices add`` made for a device, to install on it
    rollouts/<id>.json        the last state of each rollout this workspace drove (a copy; the
                              retained document on the broker is the one any machine resumes)

Whoever holds the directory (or the operator certificate, the fleet key and fleet.toml) is the
operator: keep it as private as the signing keys it holds.

``fleet.toml``::

    fleet = "plant-a"

    [broker]
    host = "mqtt.example.com"     # what devices and operators connect to
    device_port = 8883
    operator_port = 8884
    protocol = "5"                # or "3.1.1"
    device_auth = "password"      # or "certificate"

    [operator]
    name = "operator"             # the operator certificate's common name

    [artifacts]
    dir = "artifacts"                       # what 'fleet publish' writes
    base_url = "http://files.example:8080"  # where devices fetch it from
    bundle_keys = ["keys/release.pem.pub"]  # the keys bundles must be signed with
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import ConfigError, DocumentError, FleetError, InputError
from agent.fleet.ops.broker import DEVICE_AUTH_MODES
from agent.fleet.ops.locking import locked
from agent.fleet.topics import check_id
from agent.fsutil import atomic_write_text, read_bounded
from models.signing import load_private_key, load_public_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEVICES_FILE",
    "FLEET_TOML",
    "DeviceRecord",
    "Inventory",
    "Workspace",
    "load_inventory",
    "load_workspace",
    "save_inventory",
    "write_fleet_toml",
]

FLEET_TOML = "fleet.toml"
DEVICES_FILE = "devices.json"
DEVICES_FORMAT = 1
MAX_FILE_BYTES = 16 * 1024 * 1024
PROTOCOLS = ("5", "3.1.1")


@dataclass(frozen=True, kw_only=True)
class Workspace:
    """A fleet's workspace, as ``fleet.toml`` describes it (see the module's docstring)."""

    root: Path
    fleet: str
    broker_host: str
    device_port: int = 8883
    operator_port: int = 8884
    protocol: str = "5"
    device_auth: str = "password"
    operator_name: str = "operator"
    artifacts_dir: Path | None = None
    artifacts_base_url: str = ""
    bundle_keys: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        try:
            check_id(self.fleet, "fleet")
            check_id(self.operator_name, "operator")
        except DocumentError as exc:
            raise ConfigError(exc.message, file=self.root / FLEET_TOML, **exc.fields) from None
        if not self.broker_host:
            raise ConfigError("the broker host is empty", key="broker.host",
                              file=self.root / FLEET_TOML)
        if self.protocol not in PROTOCOLS:
            raise ConfigError("unknown MQTT protocol", key="broker.protocol",
                              expected=" or ".join(PROTOCOLS), found=self.protocol)
        if self.device_auth not in DEVICE_AUTH_MODES:
            raise ConfigError("unknown device authentication", key="broker.device_auth",
                              expected=" or ".join(DEVICE_AUTH_MODES), found=self.device_auth)

    # -- the fixed layout

    @property
    def signing_key_path(self) -> Path:
        return self.root / "keys" / "fleet.key"

    @property
    def public_key_path(self) -> Path:
        return self.root / "keys" / "fleet.key.pub"

    @property
    def fleet_ca(self) -> tuple[Path, Path]:
        return self.root / "ca" / "fleet-ca.crt", self.root / "ca" / "fleet-ca.key"

    @property
    def operator_ca(self) -> tuple[Path, Path]:
        return self.root / "ca" / "operator-ca.crt", self.root / "ca" / "operator-ca.key"

    @property
    def operator_cert(self) -> tuple[Path, Path]:
        return self.root / "operator" / "operator.crt", self.root / "operator" / "operator.key"

    @property
    def broker_dir(self) -> Path:
        return self.root / "broker"

    @property
    def devices_dir(self) -> Path:
        return self.root / "devices"

    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    @property
    def devices_file(self) -> Path:
        return self.root / DEVICES_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / ".fleet.lock"

    def artifact_directory(self) -> Path:
        if self.artifacts_dir is None:
            raise ConfigError("no artifact directory is configured", key="artifacts.dir",
                              file=self.root / FLEET_TOML)
        return self.artifacts_dir

    # -- keys

    def signing_key(self) -> Ed25519PrivateKey:
        return load_private_key(self.signing_key_path)

    def public_key(self) -> Ed25519PublicKey:
        return load_public_key(self.public_key_path)

    def trusted_bundle_keys(self) -> list[Ed25519PublicKey]:
        return [load_public_key(path) for path in self.bundle_keys]

    def operator_options(self, client_id: str, **overrides: Any) -> Any:
        """:class:`~agent.fleet.mqtt.BrokerOptions` for an operator process: TLS with the
        operator certificate on the operator listener, no session kept (the state is in
        retained documents, read on every connect), reconnects within 10 s of a broker's
        return (one operator, not hundreds of boards)."""
        from agent.fleet.mqtt import BrokerOptions

        cert, key = self.operator_cert
        return BrokerOptions(**{"host": self.broker_host, "port": self.operator_port,
                                "client_id": client_id, "protocol": self.protocol, "tls": True,
                                "ca_file": self.fleet_ca[0], "cert_file": cert,
                                "key_file": key, "session_expiry_s": 0,
                                "reconnect_min_s": 0.5, "reconnect_max_s": 10.0, **overrides})


def _relative(root: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else root / path


def load_workspace(root: Path) -> Workspace:
    """Read ``root/fleet.toml``.

    Raises:
        ConfigError: no fleet.toml there (with a hint to ``fleet init``), or a bad value in it.
    """
    root = Path(root).resolve()
    path = root / FLEET_TOML
    try:
        data = tomllib.loads(read_bounded(path, MAX_FILE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError("no fleet workspace here: no fleet.toml (make one with "
                          "'edge-agent fleet init', or give --fleet-dir)", path=path) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read fleet.toml: {exc}", path=path) from exc
    known = {"fleet": str, "broker": dict, "operator": dict, "artifacts": dict}
    for key, value in data.items():
        if key not in known:
            raise ConfigError("unknown key in fleet.toml", key=key, path=path,
                              expected=", ".join(known))
        if not isinstance(value, known[key]):
            raise ConfigError("wrong type in fleet.toml", key=key, path=path,
                              found=type(value).__name__)
    broker = _table(data, "broker", path, {"host": str, "device_port": int,
                                           "operator_port": int, "protocol": str,
                                           "device_auth": str})
    operator = _table(data, "operator", path, {"name": str})
    artifacts = _table(data, "artifacts", path, {"dir": str, "base_url": str,
                                                 "bundle_keys": list})
    keys = artifacts.get("bundle_keys", [])
    if not all(isinstance(item, str) for item in keys):
        raise ConfigError("artifacts.bundle_keys must be a list of paths", path=path,
                          key="artifacts.bundle_keys")
    if "fleet" not in data or "host" not in broker:
        raise ConfigError("fleet.toml needs 'fleet' and [broker] host", path=path)
    return Workspace(
        root=root, fleet=data["fleet"], broker_host=broker["host"],
        device_port=broker.get("device_port", 8883),
        operator_port=broker.get("operator_port", 8884),
        protocol=broker.get("protocol", "5"), device_auth=broker.get("device_auth", "password"),
        operator_name=operator.get("name", "operator"),
        artifacts_dir=_relative(root, artifacts["dir"]) if "dir" in artifacts else None,
        artifacts_base_url=artifacts.get("base_url", ""),
        bundle_keys=tuple(_relative(root, item) for item in keys))


def _table(data: Mapping[str, Any], name: str, path: Path,
           types: Mapping[str, type]) -> dict[str, Any]:
    table = data.get(name, {})
    for key, value in table.items():
        if key not in types:
            raise ConfigError("unknown key in fleet.toml", key=f"{name}.{key}", path=path,
                              expected=", ".join(types))
        if not isinstance(value, types[key]) or isinstance(value, bool) != (types[key] is bool):
            raise ConfigError("wrong type in fleet.toml", key=f"{name}.{key}", path=path,
                              expected=types[key].__name__, found=type(value).__name__)
    return dict(table)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string (ASCII, escaped) is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def toml_text(top: Mapping[str, object], tables: Mapping[str, Mapping[str, object]],
              comments: Mapping[str, str] | None = None) -> str:
    """Flat TOML: top-level keys, then one table each (values: strings, ints, bools, lists)."""
    comments = comments or {}
    lines = [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        for key, value in table.items():
            note = comments.get(f"{name}.{key}")
            lines.append(f"{key} = {_toml_value(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


def write_fleet_toml(workspace: Workspace) -> None:
    root = workspace.root

    def shown(path: Path) -> str:
        try:
            return str(path.relative_to(root))
        except ValueError:
            return str(path)

    artifacts: dict[str, object] = {"base_url": workspace.artifacts_base_url,
                                    "bundle_keys": [shown(key) for key in workspace.bundle_keys]}
    if workspace.artifacts_dir is not None:
        artifacts = {"dir": shown(workspace.artifacts_dir), **artifacts}
    text = toml_text(
        {"fleet": workspace.fleet},
        {"broker": {"host": workspace.broker_host, "device_port": workspace.device_port,
                    "operator_port": workspace.operator_port, "protocol": workspace.protocol,
                    "device_auth": workspace.device_auth},
         "operator": {"name": workspace.operator_name},
         "artifacts": artifacts},
        comments={"broker.host": "what devices and operators connect to",
                  "artifacts.base_url": "where devices fetch the artifact directory from",
                  "artifacts.bundle_keys": "bundles must be signed by one of these"})
    atomic_write_text(root / FLEET_TOML, "# Written by 'edge-agent fleet init'.\n" + text)


# -- the devices file ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DeviceRecord:
    """A provisioned device."""

    device: str
    groups: tuple[str, ...] = ()
    auth: str = "password"
    added_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "auth": self.auth, "added_at": self.added_at}


@dataclass(frozen=True)
class Inventory:
    """The fleet's devices and groups (``devices.json``)."""

    path: Path
    devices: Mapping[str, DeviceRecord] = field(default_factory=dict)

    @property
    def groups(self) -> dict[str, list[str]]:
        result: dict[str, list[str]] = {}
        for record in sorted(self.devices.values(), key=lambda item: item.device):
            for group in record.groups:
                result.setdefault(group, []).append(record.device)
        return result

    def with_device(self, record: DeviceRecord) -> Inventory:
        return replace(self, devices={**self.devices, record.device: record})

    def without(self, device: str) -> Inventory:
        return replace(self, devices={key: value for key, value in self.devices.items()
                                      if key != device})

    def select(self, devices: Sequence[str] = (), groups: Sequence[str] = (),
               *, everything: bool = False) -> list[str]:
        """The device ids named directly or through a group (sorted, each once).

        Raises:
            FleetError: a device or group that is not in the inventory.
        """
        chosen: set[str] = set(self.devices) if everything else set()
        for device in devices:
            if device not in self.devices:
                raise FleetError("no such device in the fleet's devices file", reason="unknown",
                                 device=device, path=self.path)
            chosen.add(device)
        known_groups = self.groups
        for group in groups:
            if group not in known_groups:
                raise FleetError("no such group in the fleet's devices file", reason="unknown",
                                 group=group, path=self.path,
                                 groups=",".join(sorted(known_groups)) or "none")
            chosen.update(known_groups[group])
        return sorted(chosen)


def load_inventory(workspace: Workspace) -> Inventory:
    """Read ``devices.json`` (an empty inventory when there is none yet).

    Raises:
        InputError: it cannot be read or is malformed.
    """
    path = workspace.devices_file
    try:
        document = json.loads(read_bounded(path, MAX_FILE_BYTES))
    except FileNotFoundError:
        return Inventory(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the devices file: {exc}", path=path) from exc
    if not isinstance(document, dict) or document.get("format") != DEVICES_FORMAT \
            or not isinstance(document.get("devices"), dict):
        raise InputError("the devices file is not a format-1 devices file", path=path)
    devices: dict[str, DeviceRecord] = {}
    for device, raw in document["devices"].items():
        if not isinstance(raw, dict) or not isinstance(raw.get("groups", []), list):
            raise InputError("a device entry is malformed", path=path, device=device)
        devices[device] = DeviceRecord(device=device, groups=tuple(raw.get("groups", [])),
                                       auth=str(raw.get("auth", "password")),
                                       added_at=str(raw.get("added_at", "")))
    return Inventory(path, devices)


def save_inventory(inventory: Inventory, fleet: str) -> None:
    document = {"format": DEVICES_FORMAT, "fleet": fleet,
                "devices": {device: inventory.devices[device].to_json()
                            for device in sorted(inventory.devices)}}
    atomic_write_text(inventory.path, json.dumps(document, indent=2) + "\n", mode=0o644)


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def workspace_lock(workspace: Workspace) -> Any:
    """The workspace's lock (devices file, password file and certificates change under it)."""
    return locked(workspace.lock_file)


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
