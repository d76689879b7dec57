"""The production Mosquitto (2.x) configuration of a fleet: its ``mosquitto.conf``, its ACL and
its password file.

Two TLS listeners, nothing in the clear:

- the *device* listener (8883) takes a device's password (or, in certificate mode, its client
  certificate of the fleet CA, whose common name becomes the user name) and sets the client id to
  the user name (``use_username_as_clientid``): a device cannot take over another device's
  session by connecting under its client id;
- the *operator* listener (8884) takes only client certificates of the operator CA, whose common
  name is the operator identity; operator processes pick their own client ids there, so a
  ``deploy`` on one machine and a ``watch`` on another can run together.

``allow_anonymous false``, one ``password_file``, one ``acl_file`` (``per_listener_settings
false``: the same rules on both listeners). The ACL gives the operator identity ``readwrite`` on
``edge/<fleet>/#`` and every other user, through ``pattern`` lines on ``%u`` (the authenticated
user name, never the client id the client chose), exactly its own topics: read ``desired`` and
``cmd``, write ``reported``, ``events``, ``online`` and ``resp/#``. Mosquitto 2.0 grants a
subscription to a topic the ACL denies and then delivers nothing on it; a denied publish is
dropped (MQTT 5: a PUBACK with reason 0x87). tests/test_fleet_ops_broker.py checks both on a real
broker.

``persistence true`` with a short ``autosave_interval``: retained documents (desired, reported,
online, rollouts) survive a restart, and a crash loses at most that many seconds of them (the
operator republishes desired documents on reconnect and each device keeps its last one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError, FleetError
from agent.fleet.ops.locking import locked
from agent.fleet.topics import check_id
from agent.fsutil import atomic_write_text, read_bounded

__all__ = [
    "BrokerLayout",
    "DEVICE_AUTH_MODES",
    "acl_text",
    "device_acl_topics",
    "mosquitto_conf",
    "remove_user",
    "set_password",
    "users",
]

DEVICE_AUTH_MODES = ("password", "certificate")
MOSQUITTO_PASSWD = "mosquitto_passwd"
MAX_PASSWORD_FILE_BYTES = 16 * 1024 * 1024

# The broker's files, by name, in its files directory.
FLEET_CA = "fleet-ca.crt"
OPERATOR_CA = "operator-ca.crt"
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"
PASSWORD_FILE = "passwd"
ACL_FILE = "acl"
CONFIG_FILE = "mosquitto.conf"


@dataclass(frozen=True, kw_only=True)
class BrokerLayout:
    """What the broker's configuration depends on.

    Attributes:
        fleet: The fleet id (the ACL's topic root ``edge/<fleet>/``).
        operator: The operator identity: the operator certificate's common name.
        device_auth: ``password`` or ``certificate`` (client certificates of the fleet CA).
        files_dir: Where the broker's files (CAs, server key, passwd, acl) are *on the broker
            host*; the configuration names them there.
        persistence_dir: Where Mosquitto keeps its store on the broker host.
        device_port, operator_port: The two TLS listeners.
        bind_address: Listen on this address only (None: every interface).
        autosave_interval_s: Seconds between saves of the store.
        run_as_user: A ``user`` line (Mosquitto started as root switches to this user; None
            keeps its default, ``mosquitto``, which must be able to read the files).
        log_dest: Mosquitto's ``log_dest`` (``syslog``, ``stderr``, ``file /path``).
    """

    fleet: str
    operator: str
    device_auth: str
    files_dir: Path
    persistence_dir: Path
    device_port: int = 8883
    operator_port: int = 8884
    bind_address: str | None = None
    autosave_interval_s: int = 30
    run_as_user: str | None = None
    log_dest: str = "syslog"

    def __post_init__(self) -> None:
        check_id(self.fleet, "fleet")
        check_id(self.operator, "operator")
        if self.device_auth not in DEVICE_AUTH_MODES:
            raise ConfigError("unknown device authentication", key="device_auth",
                              expected=" or ".join(DEVICE_AUTH_MODES), found=self.device_auth)
        for name in ("device_port", "operator_port"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ConfigError("a port must be from 1 to 65535", key=name, found=port)
        if self.device_port == self.operator_port:
            raise ConfigError("the device and operator listeners need different ports",
                              key="operator_port", found=self.operator_port)
        if self.autosave_interval_s < 1:
            raise ConfigError("autosave_interval_s must be at least 1",
                              key="autosave_interval_s", found=self.autosave_interval_s)


def device_acl_topics(fleet: str, device: str = "%u") -> list[tuple[str, str]]:
    """(access, topic) for a device's own topics: what the ACL's patterns give ``device``."""
    root = f"edge/{fleet}/{device}"
    return [("read", f"{root}/desired"), ("read", f"{root}/cmd"),
            ("write", f"{root}/reported"), ("write", f"{root}/events"),
            ("write", f"{root}/online"), ("write", f"{root}/resp/#")]


def acl_text(layout: BrokerLayout) -> str:
    """The ACL file."""
    lines = [
        f"# The ACL of fleet {layout.fleet}, written by 'edge-agent fleet broker-config'.",
        "# Mosquitto re-reads it on SIGHUP.",
        "",
        "# The operator identity (the operator certificate's common name): the whole fleet.",
        f"user {layout.operator}",
        f"topic readwrite edge/{layout.fleet}/#",
        "",
        "# Every device (user name = client id = device id): its own topics and nothing else.",
        "# %u is the authenticated user name, not the client id a client chose.",
    ]
    lines += [f"pattern {access} {topic}" for access, topic in device_acl_topics(layout.fleet)]
    return "\n".join(lines) + "\n"


def mosquitto_conf(layout: BrokerLayout) -> str:
    """The broker's ``mosquitto.conf``."""
    files = layout.files_dir
    bind = f" {layout.bind_address}" if layout.bind_address else ""
    lines = [
        f"# Mosquitto 2.x for fleet {layout.fleet}, written by 'edge-agent fleet broker-config'.",
        "# docs/fleet.md explains each choice.",
        "",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {files / PASSWORD_FILE}",
        f"acl_file {files / ACL_FILE}",
        "",
        "# Retained documents and sessions survive a restart; a crash loses at most the seconds",
        "# since the last save (operators republish desired documents, devices keep theirs).",
        "persistence true",
        f"persistence_location {layout.persistence_dir}/",
        f"autosave_interval {layout.autosave_interval_s}",
        "# A device that has not come back for two weeks loses its session (its desired",
        "# document is retained regardless).",
        "persistent_client_expiration 14d",
        "max_queued_messages 1000",
        "set_tcp_nodelay true",
        f"log_dest {layout.log_dest}",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "connection_messages true",
        "",
        "# Devices.",
        f"listener {layout.device_port}{bind}",
        "protocol mqtt",
        f"certfile {files / SERVER_CERT}",
        f"keyfile {files / SERVER_KEY}",
        f"cafile {files / FLEET_CA}",
        "tls_version tlsv1.2",
    ]
    if layout.device_auth == "certificate":
        lines += ["require_certificate true", "use_identity_as_username true"]
    else:
        lines += ["require_certificate false"]
    lines += [
        "# The client id is the user name: no device can take another's session over.",
        "use_username_as_clientid true",
        "",
        "# Operators: client certificates of the operator CA only.",
        f"listener {layout.operator_port}{bind}",
        "protocol mqtt",
        f"certfile {files / SERVER_CERT}",
        f"keyfile {files / SERVER_KEY}",
        f"cafile {files / OPERATOR_CA}",
        "tls_version tlsv1.2",
        "require_certificate true",
        "use_identity_as_username true",
    ]
    if layout.run_as_user:
        lines.insert(3, f"user {layout.run_as_user}")
    return "\n".join(lines) + "\n"


# -- the password file ---------------------------------------------------------------------------

def _mosquitto_passwd() -> str:
    found = shutil.which(MOSQUITTO_PASSWD) or (
        "/usr/bin/mosquitto_passwd" if os.path.exists("/usr/bin/mosquitto_passwd") else None)
    if found is None:
        raise FleetError("mosquitto_passwd is needed to hash device passwords (Debian/Ubuntu: "
                         "apt install mosquitto)", reason="missing_tool")
    return found


def _read_lines(password_file: Path) -> list[str]:
    try:
        text = read_bounded(password_file, MAX_PASSWORD_FILE_BYTES).decode("utf-8")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if line.strip()]


def users(password_file: Path) -> list[str]:
    """The user names in a password file."""
    return [line.split(":", 1)[0] for line in _read_lines(password_file)]


def _hash_line(user: str, password: str, directory: Path) -> str:
    """``user:<Mosquitto hash>``, from ``mosquitto_passwd -U`` on a private temporary file (the
    password never appears on a command line, where ``ps`` would show it)."""
    tool = _mosquitto_passwd()
    fd, name = tempfile.mkstemp(prefix=".passwd-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(f"{user}:{password}\n")
        done = subprocess.run([tool, "-U", name], capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode != 0:
            raise FleetError(f"mosquitto_passwd failed: {(done.stderr or done.stdout).strip()}",
                             reason="tool_failed", user=user)
        line = Path(name).read_text(encoding="utf-8").strip()
    finally:
        os.unlink(name)
    if not line.startswith(f"{user}:") or line == f"{user}:{password}":
        raise FleetError("mosquitto_passwd did not hash the password", reason="tool_failed",
                         user=user)
    return line


def set_password(password_file: Path, user: str, password: str) -> None:
    """Add ``user`` to the password file, or change its password (atomically, under a lock).
    The broker takes it on its next SIGHUP."""
    if not user or ":" in user or "\n" in user:
        raise ConfigError("a user name cannot be empty or hold ':' or a newline", key="user",
                          found=user)
    password_file.parent.mkdir(parents=True, exist_ok=True)
    with locked(password_file.with_name(f".{password_file.name}.lock")):
        line = _hash_line(user, password, password_file.parent)
        kept = [entry for entry in _read_lines(password_file)
                if entry.split(":", 1)[0] != user]
        atomic_write_text(password_file, "\n".join([*kept, line]) + "\n", mode=0o600)


def remove_user(password_file: Path, user: str) -> bool:
    """Remove ``user`` from the password file; whether it was there."""
    with locked(password_file.with_name(f".{password_file.name}.lock")):
        lines = _read_lines(password_file)
        kept = [entry for entry in lines if entry.split(":", 1)[0] != user]
        if len(kept) == len(lines):
            return False
        atomic_write_text(password_file, "".join(f"{entry}\n" for entry in kept), mode=0o600)
        return True
