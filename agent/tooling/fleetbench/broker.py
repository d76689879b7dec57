"""Mosquitto run with a fleet workspace's own production configuration (agent/fleet/ops/broker.py:
two TLS listeners, no anonymous clients, per-device passwords, the ``%u`` ACL, persistence),
which ``fleet init`` and ``fleet broker-config`` wrote: only the paths, the address, the user and
the log destination differ from what an operator installs.

:meth:`FleetBroker.kill` is a SIGKILL: no clean shutdown and no final save of the store, so what
changed since the last autosave (``autosave_interval``) is lost, as in a crash.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from agent.errors import FleetError
from agent.fleet.ops.broker import CONFIG_FILE
from agent.fleet.ops.workspace import Workspace

__all__ = ["FleetBroker", "free_port", "mosquitto_binary"]

START_TIMEOUT_S = 20.0
# The shared brokers' ports on this kind of machine, and MQTT's defaults: never taken here.
RESERVED_PORTS = frozenset({1883, 4222, 8883, 8884})


def mosquitto_binary() -> Path:
    """``mosquitto`` on PATH, else /usr/sbin's (Debian's place, often off PATH).

    Raises:
        FleetError: (``missing_tool``) neither.
    """
    found = shutil.which("mosquitto")
    path = Path(found) if found else Path("/usr/sbin/mosquitto")
    if not path.exists():
        raise FleetError("the fleet benchmark needs Mosquitto 2 (Debian/Ubuntu: apt install "
                         "mosquitto)", reason="missing_tool")
    return path


def free_port(exclude: frozenset[int] = frozenset()) -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in RESERVED_PORTS | exclude:
            return port


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class FleetBroker:
    """Mosquitto with ``workspace``'s ``broker/mosquitto.conf``; its output goes to
    ``log_file``. Cheap to construct; :meth:`start` runs it."""

    def __init__(self, workspace: Workspace, log_file: Path) -> None:
        self.workspace = workspace
        self.config_file = workspace.broker_dir / CONFIG_FILE
        self.log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None
        self._earlier_cpu_s = 0.0  # what the instances before this one used

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start it and wait until both listeners accept connections.

        Raises:
            FleetError: (``broker_failed``) it exited or did not listen in time (with its log's
                tail).
        """
        ports = (self.workspace.device_port, self.workspace.operator_port)
        if self._process is not None and self._process.poll() is None:
            self._process.wait()  # killed a moment ago: gone, and its ports free, first
        with self.log_file.open("ab") as log:
            self._process = subprocess.Popen(
                [str(mosquitto_binary()), "-c", str(self.config_file)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_accepts(port) for port in ports):
            if self._process.poll() is not None or time.monotonic() > deadline:
                status = self._process.poll()
                self.stop()
                raise FleetError("Mosquitto did not start", reason="broker_failed",
                                 status=status, config=self.config_file, log=self.log_tail())
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.kill_now()
        if self._process is not None:
            self._process.wait()

    def kill_now(self) -> None:
        """SIGKILL, without waiting (safe on an event loop); :meth:`kill` or :meth:`start`
        reaps it."""
        if self._process is not None and self._process.poll() is None:
            self._earlier_cpu_s += process_cpu_s(self._process.pid) or 0.0
            self._process.send_signal(signal.SIGKILL)

    def cpu_s(self) -> float:
        """CPU seconds used by every instance so far (a killed one's up to its kill)."""
        running = process_cpu_s(self.pid) if self.pid is not None else None
        return self._earlier_cpu_s + (running or 0.0)

    def stop(self) -> None:
        """SIGTERM (Mosquitto saves its store), SIGKILL after 10 s."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def rss_mib(self) -> float | None:
        """Its resident memory now."""
        return None if self.pid is None else process_memory(self.pid).get("rss_mib")


def process_memory(pid: int) -> dict[str, float]:
    """``rss_mib`` (now) and ``peak_rss_mib`` (VmHWM) of a process, from /proc; empty once it
    has ended."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found["rss_mib" if key == "VmRSS" else "peak_rss_mib"] = int(value.split()[0]) / 1024
        elif key == "Threads":
            found["threads"] = float(value.strip())
    return found


def process_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds a process has used (children excluded), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
