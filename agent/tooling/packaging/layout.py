"""What the service install puts where on a board: one list of entries (files, directories and
the ``systemctl enable`` links) that the root file system installer writes and the Debian
package carries, so the two cannot drift apart.

Paths are relative to the board's root. Ownership is what the file has on the board once
systemd has run at boot: a root file system is written on the host before the ``edge-agent``
user exists (systemd-sysusers makes it at first boot from ``edge-agent.sysusers``), so every
file is written as root and the few the daemon's group must read get their group from
``edge-agent.tmpfiles`` (``z`` lines). :func:`tmpfiles_owners` reads those lines back, and the
tests check that every entry's recorded owner is one tmpfiles will give it.

The configuration is the documented example (every key at its default, with its comment), with
the device's values put in place of the defaults they replace: the provisioned files from
``edge-agent fleet devices add`` (its ``agent.toml`` and the files it names), the bundle keys
and the device id given to the installer.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from agent import __version__
from agent.errors import ConfigError
from agent.fleet.ops.provision import DEVICE_INSTALL_DIR
from agent.tooling.packaging.units import read_unit

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

__all__ = [
    "CONFIG_PATH",
    "ENABLE_DIR",
    "Entry",
    "PREFIX",
    "UNIT_DIR",
    "UNIT_NAMES",
    "USER",
    "configured_toml",
    "service_entries",
    "tmpfiles_owners",
    "wheel_name_version",
]

USER = "edge-agent"
UNIT_NAMES = ("edge-agent.service", "edge-agent-power.socket", "edge-agent-power.service",
              "edge-agent-setup.service")
UNIT_DIR = PurePosixPath("usr/lib/systemd/system")
ENABLE_DIR = PurePosixPath("etc/systemd/system")
PREFIX = PurePosixPath("opt/edge-agent")
CONFIG_DIR = PurePosixPath("etc/edge-agent")
CONFIG_PATH = CONFIG_DIR / "agent.toml"
FLEET_DIR = PurePosixPath(str(DEVICE_INSTALL_DIR).lstrip("/"))
KEYS_DIR = CONFIG_DIR / "keys"
DOC_DIR = PurePosixPath("usr/share/doc/edge-agent")
MAX_FILE_BYTES = 1024 * 1024
# Files from `fleet devices add` that hold a secret: readable by the daemon's group only.
SECRET_FILES = frozenset({"mqtt-password", "device.key"})
ROOT = "root:root"
DAEMON_GROUP = f"root:{USER}"
# Directories that are not root:root 0755 on the board (edge-agent.tmpfiles gives them this).
DIR_OWNERS = {FLEET_DIR: (0o750, DAEMON_GROUP)}


@dataclass(frozen=True)
class Entry:
    """One thing on the board: a file (``data``), a directory, or a symbolic link (``target``).

    ``owner`` is ``user:group`` as it is on the board after boot (see the module docstring);
    ``config`` marks a file an operator may edit (kept by an uninstall when changed, a conffile
    of the package).
    """

    path: PurePosixPath
    kind: str  # "file", "dir" or "link"
    mode: int = 0o644
    data: bytes | None = None
    target: str | None = None
    owner: str = ROOT
    config: bool = False


def wheel_name_version(name: str) -> tuple[str, str] | None:
    """The distribution and version a wheel's file name gives (PEP 427), normalized as pip
    compares them; None for a file that is not a wheel."""
    if not name.endswith(".whl"):
        return None
    parts = name[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


def _file(path: PurePosixPath, data: bytes, mode: int = 0o644, owner: str = ROOT,
          config: bool = False) -> Entry:
    return Entry(path=path, kind="file", mode=mode, data=data, owner=owner, config=config)


def _dirs_of(entries: Iterable[Entry]) -> list[Entry]:
    """The directories the entries need, made by the install (root:root 0755), outermost
    first; the top-level ones (usr, etc, opt) are the root file system's own and not listed."""
    needed: set[PurePosixPath] = set()
    for entry in entries:
        for parent in entry.path.parents:
            if len(parent.parts) >= 2:
                needed.add(parent)
    return [Entry(path=path, kind="dir", mode=0o755, owner=ROOT) if path not in DIR_OWNERS
            else Entry(path=path, kind="dir", mode=DIR_OWNERS[path][0], owner=DIR_OWNERS[path][1])
            for path in sorted(needed)]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise ConfigError("only strings, numbers, booleans and lists can be set in agent.toml",
                      found=type(value).__name__)


def configured_toml(example: str, values: Mapping[str, Any]) -> str:
    """The example configuration with ``values`` in place of the defaults: each ``key = ...``
    line (top-level keys as ``key``, others as ``section.key``) is replaced where it stands, so
    its comment still explains it.

    Raises:
        ConfigError: a key the example does not have (so it is not a setting), or a result that
            does not read back as the values given.
    """
    lines = example.splitlines()
    section = ""
    where: dict[str, int] = {}
    for index, line in enumerate(lines):
        header = re.fullmatch(r"\[([A-Za-z0-9_]+)\]\s*", line)
        if header:
            section = header.group(1)
            continue
        setting = re.match(r"([A-Za-z0-9_]+) = ", line)
        if setting:
            where[f"{section}.{setting.group(1)}" if section else setting.group(1)] = index
    for key, value in values.items():
        if key not in where:
            raise ConfigError("not a setting of the configuration (no such key in the "
                              "example)", key=key)
        name = key.rpartition(".")[2]
        lines[where[key]] = f"{name} = {_toml_value(value)}"
    text = "\n".join(lines) + "\n"
    parsed = tomllib.loads(text)
    for key, value in values.items():
        section_name, _, name = key.rpartition(".")
        found = parsed[section_name][name] if section_name else parsed[name]
        if found != value:
            raise ConfigError("the configuration did not read back as written", key=key,
                              expected=value, found=found)
    return text


def _flatten(document: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            flat[key] = value
    return flat


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError("not a regular file", path=path)
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError("file too large for the install", path=path, size=len(data))
    return data


def _device_entries(device_files: Path) -> tuple[list[Entry], dict[str, Any]]:
    """The files ``fleet devices add`` made for one device, placed where its agent.toml names
    them, and that agent.toml's settings."""
    toml_path = device_files / "agent.toml"
    try:
        settings = _flatten(tomllib.loads(_read(toml_path).decode()))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("the device's agent.toml is not TOML", path=toml_path,
                          reason=str(exc)) from None
    entries: list[Entry] = []
    for path in sorted(device_files.rglob("*")):
        relative = PurePosixPath(path.relative_to(device_files).as_posix())
        if path.is_dir() or relative == PurePosixPath("agent.toml"):
            continue
        if path.is_symlink():
            raise ConfigError("a link among the device's files", path=path)
        secret = relative.name in SECRET_FILES
        entries.append(_file(FLEET_DIR / relative, _read(path), 0o640 if secret else 0o644,
                             DAEMON_GROUP if secret else ROOT))
    named = [value for value in settings.values() if isinstance(value, str)] + [
        item for value in settings.values() if isinstance(value, list) for item in value]
    shipped = {"/" + str(entry.path) for entry in entries}
    for value in named:
        if value.startswith(f"/{FLEET_DIR}/") and value not in shipped:
            raise ConfigError("the device's agent.toml names a file that is not among its "
                              "files", path=value, directory=device_files)
    return entries, settings


def service_entries(source: Path, *, wheelhouse: Path | None = None,
                    extras: Sequence[str] = ("device",), device_files: Path | None = None,
                    bundle_keys: Sequence[Path] = (), device_id: str | None = None,
                    enable_links: bool = True) -> list[Entry]:
    """Everything the service install puts on a board, in the order to write it.

    Args:
        source: The project's checkout (its ``systemd/`` folder and README).
        wheelhouse: Wheels for the board's architecture and Python, one of them this project's
            at this version; None leaves the Python environment out (the .deb carries its
            own wheelhouse through the same argument).
        device_files: A directory written by ``edge-agent fleet devices add``.
        bundle_keys: Public keys (PEM) whose bundles the device installs, added to
            ``trust.public_keys``.
        device_id: The device's id (``device_id``); the provisioned agent.toml's otherwise.
        enable_links: The links ``systemctl enable`` makes (a package makes them in postinst).

    Raises:
        ConfigError: a missing or unreadable input, a wheelhouse without this project's wheel,
            a key that is not a public key.
    """
    from models.signing import load_public_key

    systemd = Path(source) / "systemd"
    entries: list[Entry] = [_file(UNIT_DIR / name, _read(systemd / name)) for name in UNIT_NAMES]
    entries += [
        _file(PurePosixPath("usr/lib/sysusers.d/edge-agent.conf"),
              _read(systemd / "edge-agent.sysusers")),
        _file(PurePosixPath("usr/lib/tmpfiles.d/edge-agent.conf"),
              _read(systemd / "edge-agent.tmpfiles")),
        _file(PurePosixPath("usr/lib/edge-agent/build-venv"),
              _read(systemd / "edge-agent-build-venv"), 0o755),
        _file(DOC_DIR / "README.md", _read(Path(source) / "README.md")),
    ]
    if wheelhouse is not None:
        entries += _wheelhouse_entries(Path(wheelhouse), extras)

    settings: dict[str, Any] = {}
    if device_files is not None:
        device_entries, settings = _device_entries(Path(device_files))
        entries += device_entries
    else:
        entries.append(_file(FLEET_DIR / "README", PLACEHOLDER.encode()))
    trusted = list(settings.get("trust.public_keys", []))
    for key in bundle_keys:
        load_public_key(Path(key))  # a private or broken key stops the install here
        target = KEYS_DIR / Path(key).name
        entries.append(_file(target, _read(Path(key))))
        trusted.append(f"/{target}")
    if trusted:
        settings["trust.public_keys"] = list(dict.fromkeys(trusted))
    if device_id is not None:
        settings["device_id"] = device_id
    example = _read(systemd / "agent.toml.example").decode()
    entries.append(_file(CONFIG_PATH, configured_toml(example, settings).encode(), 0o640,
                         DAEMON_GROUP, config=True))

    if enable_links:
        for name in UNIT_NAMES:
            for wanted in read_unit(systemd / name).wanted_by():
                entries.append(Entry(path=ENABLE_DIR / f"{wanted}.wants" / name, kind="link",
                                     mode=0o777, target=f"/{UNIT_DIR / name}"))
    return _dirs_of(entries) + entries


def _wheelhouse_entries(wheelhouse: Path, extras: Sequence[str]) -> list[Entry]:
    wheels = sorted(path for path in wheelhouse.iterdir() if path.name.endswith(".whl"))
    ours = [path for path in wheels
            if wheel_name_version(path.name) == ("jetson-edge-agent", __version__)]
    if not ours:
        raise ConfigError("the wheelhouse has no wheel of this agent at this version (make it "
                          "with `pip wheel --wheel-dir DIR '.[device]'`, README)",
                          path=wheelhouse, expected=f"jetson_edge_agent-{__version__}-*.whl")
    extra = f"[{','.join(extras)}]" if extras else ""
    requirements = f"jetson-edge-agent{extra}=={__version__}\n"
    return [
        _file(PREFIX / "version", f"{__version__}\n".encode()),
        _file(PREFIX / "requirements.txt", requirements.encode()),
        *(Entry(path=PREFIX / "wheelhouse" / path.name, kind="file", mode=0o644,
                data=path.read_bytes()) for path in wheels),
    ]


def tmpfiles_owners(text: str) -> dict[str, tuple[int, str]]:
    """What ``edge-agent.tmpfiles`` gives each path at boot: its mode and ``user:group``."""
    owners: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0] in ("d", "z", "f") and not line.startswith("#"):
            owners[fields[1]] = (int(fields[2], 8), f"{fields[3]}:{fields[4]}")
    return owners


PLACEHOLDER = f"""\
This device's fleet credentials go here (/{FLEET_DIR}/).

On the operator's machine, `edge-agent fleet devices add DEVICE` writes them (agent.toml,
fleet-ca.crt, fleet.pub, bundle-keys/, and mqtt-password or device.crt + device.key). Either
give that directory to the installer when flashing (tools/install_rootfs.py --device-files DIR),
or copy the files here on the board, merge its agent.toml into /{CONFIG_PATH}, run
`systemd-tmpfiles --create` (it gives the secrets their owner and mode) and
`systemctl restart edge-agent`.
"""
