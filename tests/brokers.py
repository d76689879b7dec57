"""Real MQTT brokers for tests and benchmarks: Mosquitto on a free port, a 3-node NATS cluster
with its MQTT gateway, and a throwaway certificate authority.

Usable from a pytest fixture and from plain code alike::

    with Mosquitto(tmp_path / "broker", persistence=True) as broker:
        options = broker.options("dev-1")        # an agent.fleet.mqtt.BrokerOptions
        ...
        broker.kill()                            # SIGKILL: no clean shutdown, no final save
        broker.restart()                         # the same port(s), the same store

Each broker lives in its own directory (configuration, logs, store) and on ports picked free at
start, never the shared brokers' 1883 and 4222. Nothing here imports paho or the agent's MQTT
module at import time, so a benchmark can use it without pulling in pytest.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    from agent.fleet.mqtt import BrokerOptions



def _binary(name: str) -> Path:
    """``name`` on PATH, else in /usr/sbin (where Debian puts the brokers; often off PATH)."""
    found = shutil.which(name)
    return Path(found) if found else Path("/usr/sbin") / name


MOSQUITTO = _binary("mosquitto")
MOSQUITTO_PASSWD = _binary("mosquitto_passwd")
NATS_SERVER = _binary("nats-server")

RESERVED_PORTS = frozenset({1883, 4222, 8883, 6222, 8222})  # the shared brokers' and NATS defaults
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


class BrokerError(RuntimeError):
    """A test broker did not start or stop as asked; the message carries its log's tail."""


def free_port(exclude: Iterable[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (never 1883, 4222 or ``exclude``)."""
    excluded = RESERVED_PORTS | set(exclude)
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in excluded:
            return port


def accepts_connections(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- a throwaway certificate authority ----------------------------------------------------------

@dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, both PEM files."""
    cert_file: Path
    key_file: Path


class ThrowawayCA:
    """A certificate authority for one test run: its own EC P-256 key, certificates valid for a
    day. ``server_cert()`` makes a broker certificate for 127.0.0.1 and localhost,
    ``client_cert(device_id)`` a client certificate with CN=device id (what Mosquitto's
    ``use_identity_as_username`` turns into the username)."""

    def __init__(self, directory: Path, name: str = "edge-agent test CA") -> None:
        self.directory = directory
        self.name = name
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = directory / "ca.pem"
        self.ca_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def server_cert(self, name: str = "broker",
                    hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> CertPair:
        alt_names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt_names.append(x509.DNSName(host))
        return self._issue(name, ExtendedKeyUsageOID.SERVER_AUTH, alt_names)

    def client_cert(self, common_name: str) -> CertPair:
        return self._issue(common_name, ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def _issue(self, common_name: str, usage: x509.ObjectIdentifier,
               alt_names: list[x509.GeneralName]) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
        )
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = self.directory / common_name.replace("/", "_")
        pair = CertPair(stem.with_suffix(".crt"), stem.with_suffix(".key"))
        pair.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key_file.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        pair.key_file.chmod(0o600)
        return pair


# -- Mosquitto ----------------------------------------------------------------------------------

class Mosquitto:
    """``/usr/sbin/mosquitto -c <generated conf>`` in ``directory``.

    Args:
        directory: Where the configuration, the log (``mosquitto.log``, appended across restarts)
            and the store (``persistence``) go; created.
        persistence: Mosquitto's ``persistence true`` with ``persistence_location`` in
            ``directory``: retained messages and sessions survive :meth:`stop` (SIGTERM saves).
            ``autosave_interval_s`` (with ``autosave_on_changes``) bounds what a :meth:`kill`
            loses: the default 0 saves only at shutdown, as a production broker with a long
            interval effectively does.
        allow_anonymous: Mosquitto 2's default is false; tests mostly want true.
        passwords: user -> password, hashed into a ``password_file`` with ``mosquitto_passwd -U``.
        acl: the text of an ``acl_file`` (``user``/``topic``/``pattern`` lines).
        tls_ca: adds a TLS listener (``tls_port``) with a server certificate from this CA.
        require_certificate: on the TLS listener, clients must present a certificate of the CA.
        use_identity_as_username: on the TLS listener, the certificate's CN is the username.
        plain_listener: keep the plain TCP listener (``port``) beside the TLS one.
        extra_config: appended to the generated configuration verbatim.
    """

    def __init__(self, directory: Path, *, persistence: bool = False,
                 autosave_interval_s: int = 0, allow_anonymous: bool = True,
                 passwords: Mapping[str, str] | None = None, acl: str | None = None,
                 tls_ca: ThrowawayCA | None = None, require_certificate: bool = True,
                 use_identity_as_username: bool = False, plain_listener: bool = True,
                 extra_config: str = "") -> None:
        if not plain_listener and tls_ca is None:
            raise ValueError("a broker needs at least one listener")
        self.directory = directory
        self.persistence = persistence
        self.autosave_interval_s = autosave_interval_s
        self.allow_anonymous = allow_anonymous
        self.acl = acl
        self.tls_ca = tls_ca
        self.require_certificate = require_certificate
        self.use_identity_as_username = use_identity_as_username
        self.extra_config = extra_config
        self.config_file = directory / "mosquitto.conf"
        self.log_file = directory / "mosquitto.log"
        self.store_dir = directory / "store"
        self.password_file = directory / "passwords" if passwords is not None else None
        self.acl_file = directory / "acl" if acl is not None else None
        self._passwords = dict(passwords or {})
        self.port: int | None = free_port() if plain_listener else None
        self.tls_port: int | None = (free_port(exclude=[self.port] if self.port else [])
                                     if tls_ca is not None else None)
        self.server_cert: CertPair | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # -- lifecycle

    def start(self) -> Mosquitto:
        """Write the configuration and start the broker; returns once every listener accepts
        connections. Raises :class:`BrokerError` (with the log's tail) when it does not."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(exist_ok=True)
        if self.tls_ca is not None and self.server_cert is None:
            self.server_cert = self.tls_ca.server_cert(name="mosquitto-server")
        if self.password_file is not None and not self.password_file.exists():
            self._write_passwords()
        if self.acl_file is not None and self.acl is not None:
            self.acl_file.write_text(self.acl)
            self.acl_file.chmod(0o600)
        self.config_file.write_text(self._config())
        self._spawn()
        return self

    def kill(self) -> None:
        """SIGKILL: clients see their sockets reset, nothing is saved."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (the store is saved when ``persistence`` is on)."""
        self._signal_and_wait(signal.SIGTERM)

    def restart(self) -> None:
        """Start again on the same port(s) and store (stopping first if it runs)."""
        if self.running:
            self.stop()
        self._spawn()

    def reload(self) -> None:
        """SIGHUP: Mosquitto re-reads its password and ACL files."""
        if self.acl_file is not None and self.acl is not None:
            self.acl_file.write_text(self.acl)
        if self._process is None:
            raise BrokerError("mosquitto is not running")
        self._process.send_signal(signal.SIGHUP)

    def close(self) -> None:
        if self.running:
            self.stop()
        self._process = None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.running and self._process is not None else None

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    # -- credentials

    def add_password(self, username: str, password: str) -> None:
        """Add or change a user in the password file (``mosquitto_passwd -b``); takes effect
        at once when the broker runs (a SIGHUP)."""
        if self.password_file is None:
            raise ValueError("this broker was made without passwords")
        self._passwords[username] = password
        subprocess.run([str(MOSQUITTO_PASSWD), "-b", str(self.password_file), username, password],
                       check=True, capture_output=True)
        if self.running:
            self.reload()

    def options(self, client_id: str, *, tls: bool = False, cert: CertPair | None = None,
                ca_file: Path | None = None, **overrides: Any) -> BrokerOptions:
        """Broker options for a client of this broker: the plain listener, or with ``tls`` the TLS
        listener trusting this broker's CA (``ca_file`` to trust another), with ``cert`` as the
        client certificate. ``overrides`` go to :class:`BrokerOptions` as they are
        (``username=``, ``protocol=``, ``reconnect_min_s=``...)."""
        from agent.fleet.mqtt import BrokerOptions

        if tls:
            if self.tls_port is None or self.tls_ca is None:
                raise ValueError("this broker has no TLS listener")
            return BrokerOptions(
                host="127.0.0.1", port=self.tls_port, client_id=client_id, tls=True,
                ca_file=ca_file or self.tls_ca.ca_file,
                cert_file=cert.cert_file if cert else None,
                key_file=cert.key_file if cert else None, **overrides)
        if self.port is None:
            raise ValueError("this broker has no plain listener")
        return BrokerOptions(host="127.0.0.1", port=self.port, client_id=client_id, **overrides)

    # -- internals

    def _write_passwords(self) -> None:
        assert self.password_file is not None
        self.password_file.write_text("".join(f"{user}:{password}\n"
                                              for user, password in self._passwords.items()))
        self.password_file.chmod(0o600)
        # -U hashes a file of user:password lines in place.
        subprocess.run([str(MOSQUITTO_PASSWD), "-U", str(self.password_file)], check=True,
                       capture_output=True)

    def _config(self) -> str:
        lines = [
            "# generated by tests/brokers.py",
            # Run as root (CI containers), Mosquitto would switch to the 'mosquitto' user and lose
            # access to this directory; 'user' names whoever runs the test (ignored if not root).
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
            "log_dest stderr",
            "log_type error", "log_type warning", "log_type notice", "log_type information",
            "connection_messages true",
            "log_timestamp true",
            f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
        ]
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.store_dir}/",
                      "persistence_file mosquitto.db"]
            if self.autosave_interval_s > 0:
                lines += [f"autosave_interval {self.autosave_interval_s}",
                          "autosave_on_changes false"]
        else:
            lines.append("persistence false")
        if self.password_file is not None:
            lines.append(f"password_file {self.password_file}")
        if self.acl_file is not None:
            lines.append(f"acl_file {self.acl_file}")
        if self.port is not None:
            lines.append(f"listener {self.port} 127.0.0.1")
        if self.tls_port is not None:
            assert self.tls_ca is not None and self.server_cert is not None
            lines += [f"listener {self.tls_port} 127.0.0.1",
                      f"cafile {self.tls_ca.ca_file}",
                      f"certfile {self.server_cert.cert_file}",
                      f"keyfile {self.server_cert.key_file}",
                      f"require_certificate {'true' if self.require_certificate else 'false'}",
                      "use_identity_as_username "
                      f"{'true' if self.use_identity_as_username else 'false'}"]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def _ports(self) -> list[int]:
        return [port for port in (self.port, self.tls_port) if port is not None]

    def _spawn(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with self.log_file.open("ab") as log:
                log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
                log.flush()
                self._process = subprocess.Popen(
                    [str(MOSQUITTO), "-c", str(self.config_file)], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    break
                if all(accepts_connections(port) for port in self._ports()):
                    return
                time.sleep(0.02)
            # A port still held (a restart right after a kill) frees itself within moments:
            # retry that until the deadline; anything else is reported in the broker's words.
            if self._process.poll() is None:
                self._signal_and_wait(signal.SIGKILL)
            port_busy = "address already in use" in _tail(self.log_file, 5).lower()
            if time.monotonic() >= deadline or not port_busy:
                raise BrokerError(f"mosquitto did not start on {self._ports()}:\n"
                                  f"{_tail(self.log_file)}")
            time.sleep(0.2)

    def _signal_and_wait(self, signum: int) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signum)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


# -- a NATS cluster's MQTT gateway --------------------------------------------------------------

def mqtt_connects(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> bool:
    """Whether an MQTT 3.1.1 CONNECT (clean session, a throwaway id) gets an accepting CONNACK:
    a NATS node answers only once JetStream and its MQTT streams are ready."""
    client_id = f"probe-{os.getpid()}-{time.monotonic_ns()}".encode()
    variable = b"\x00\x04MQTT\x04\x02\x00\x3c"
    payload = len(client_id).to_bytes(2, "big") + client_id
    body = variable + payload
    packet = b"\x10" + bytes([len(body)]) + body + b"\xe0\x00"  # CONNECT, then DISCONNECT
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(packet[:-2])
            answer = b""
            while len(answer) < 4:
                chunk = sock.recv(4 - len(answer))
                if not chunk:
                    return False
                answer += chunk
            sock.sendall(packet[-2:])
            return answer[0] == 0x20 and answer[3] == 0
    except OSError:
        return False


@dataclass
class _NatsNode:
    name: str
    directory: Path
    client_port: int
    http_port: int
    cluster_port: int
    mqtt_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.directory / "nats-server.log"


class NatsCluster:
    """A cluster of ``nodes`` nats-server processes (2.9: MQTT 3.1.1 only), each with JetStream
    (its own store directory) and an MQTT listener, joined by cluster routes. NATS keeps MQTT
    sessions and retained messages in JetStream streams replicated across the cluster, so a
    retained message published on one node is delivered to a subscriber on another.

    NATS's MQTT gateway needs a ``server_name`` per node and JetStream; the first MQTT connection
    creates the streams (a few seconds), which :meth:`start` waits for.
    """

    def __init__(self, directory: Path, *, nodes: int = 3, name: str = "edge-test") -> None:
        if nodes < 1:
            raise ValueError("a cluster needs a node")
        self.directory = directory
        self.name = name
        taken: set[int] = set()

        def port() -> int:
            chosen = free_port(exclude=taken)
            taken.add(chosen)
            return chosen

        self.nodes = [_NatsNode(f"n{index + 1}", directory / f"n{index + 1}", port(), port(),
                                port(), port()) for index in range(nodes)]

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        """Start every node; returns once each one's JetStream is healthy and its MQTT listener
        accepts a connection."""
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            (node.directory / "nats.conf").write_text(self._config(node))
        for index in range(len(self.nodes)):
            self._spawn(index)
        deadline = time.monotonic() + timeout_s
        for index in range(len(self.nodes)):
            self._wait_ready(index, deadline)
        return self

    def mqtt_port(self, node: int) -> int:
        return self.nodes[node].mqtt_port

    def options(self, client_id: str, *, node: int = 0, **overrides: Any) -> BrokerOptions:
        """Broker options for an MQTT 3.1.1 client of node ``node`` (0-based)."""
        from agent.fleet.mqtt import BrokerOptions

        overrides.setdefault("protocol", "3.1.1")
        return BrokerOptions(host="127.0.0.1", port=self.mqtt_port(node), client_id=client_id,
                             **overrides)

    def kill(self, node: int) -> None:
        """SIGKILL one node."""
        process = self.nodes[node].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def restart(self, node: int, timeout_s: float = 60.0) -> None:
        """Start a node again (same ports, same store) and wait until it is ready."""
        self.kill(node)
        self._spawn(node)
        self._wait_ready(node, time.monotonic() + timeout_s)

    def close(self) -> None:
        for node in self.nodes:
            process = node.process
            if process is None or process.poll() is not None:
                continue
            process.terminate()
        for node in self.nodes:
            process = node.process
            if process is None:
                continue
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)
            node.process = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, node: _NatsNode) -> str:
        routes = ", ".join(f"nats-route://127.0.0.1:{other.cluster_port}"
                           for other in self.nodes if other is not node)
        lines = [
            "# generated by tests/brokers.py",
            f"server_name: {node.name}",
            f"listen: 127.0.0.1:{node.client_port}",
            f"http: 127.0.0.1:{node.http_port}",
            f'jetstream {{ store_dir: "{node.directory / "jetstream"}" }}',
        ]
        if len(self.nodes) > 1:
            lines.append(f"cluster {{ name: {self.name}; listen: 127.0.0.1:{node.cluster_port}; "
                         f"routes: [{routes}] }}")
        lines.append(f"mqtt {{ listen: 127.0.0.1:{node.mqtt_port} }}")
        return "\n".join(lines) + "\n"

    def _spawn(self, index: int) -> None:
        node = self.nodes[index]
        with node.log_file.open("ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            node.process = subprocess.Popen(
                [str(NATS_SERVER), "-c", str(node.directory / "nats.conf")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=node.directory)

    def _wait_ready(self, index: int, deadline: float) -> None:
        node = self.nodes[index]
        while time.monotonic() < deadline:
            if node.process is None or node.process.poll() is not None:
                raise BrokerError(f"nats-server {node.name} exited:\n{_tail(node.log_file)}")
            if _healthy(node.http_port) and mqtt_connects(node.mqtt_port):
                return
            time.sleep(0.2)
        raise BrokerError(f"nats-server {node.name} did not become ready:\n{_tail(node.log_file)}")


def _healthy(http_port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=2)
    try:
        connection.request("GET", "/healthz")  # JetStream included, when enabled
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()
