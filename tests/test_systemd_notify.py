"""sd_notify against a real Unix datagram socket (agent/systemd.py): the address forms, a full
queue that must not stall the caller, the watchdog variables, the health check that gates the
pings, and `edge-agent serve` under a listener playing systemd's part (start, READY=1 once it
serves, STATUS=, WATCHDOG=1 pings, a SIGHUP reload that applies one setting and names one that
needs a restart, STOPPING=1)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.supervisor import TaskState, TaskStatus
from agent.systemd import Health, Notifier, SystemdService, notify_address


class Listener:
    """systemd's end: a bound datagram socket whose thread collects (monotonic time, fields)
    pairs as they arrive (a drain starts the thread when a test wants the queue to fill)."""

    def __init__(self, address: str | bytes, *, buffer: int | None = None,
                 read: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        self.sock.bind(address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        if read:
            self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            self.messages.append((time.monotonic(), fields))

    def drain(self, seconds: float = 0.3) -> list[dict[str, str]]:
        time.sleep(seconds)
        return [fields for _, fields in self.messages]

    def wait_for(self, key: str, value: str | None = None, timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for _, fields in list(self.messages):
                if key in fields and (value is None or value in fields[key]):
                    return fields
            time.sleep(0.05)
        raise AssertionError(f"no {key}={value or '*'} within {timeout_s} s: {self.messages}")

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(1)
        self.sock.close()


def test_a_path_and_an_abstract_name_are_both_reached(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    listener = Listener(path)
    abstract_name = f"edge-agent-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract = Listener(b"\0" + abstract_name.encode())
    try:
        assert Notifier(notify_address(path)).ready("serving tiny v1")
        assert Notifier(notify_address("@" + abstract_name)).status("hello")
        assert listener.drain() == [{"READY": "1", "STATUS": "serving tiny v1"}]
        assert abstract.drain() == [{"STATUS": "hello"}]
    finally:
        listener.close()
        abstract.close()


def test_a_relative_or_empty_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="NOTIFY_SOCKET"):
        notify_address("run/notify")
    with pytest.raises(ConfigError, match="NOTIFY_SOCKET"):
        notify_address("@")


def test_without_notify_socket_nothing_is_sent_and_nothing_fails() -> None:
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert not notifier.ready() and not notifier.watchdog() and not notifier.stopping()


def test_the_watchdog_is_ours_only_when_watchdog_pid_names_this_process(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"}
    assert Notifier.from_environment(env).watchdog_s == 4.0
    assert Notifier.from_environment({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_s == 4.0
    assert Notifier.from_environment({**env, "WATCHDOG_PID": "1"}).watchdog_s is None
    with pytest.raises(ConfigError, match="WATCHDOG_USEC"):
        Notifier.from_environment({**env, "WATCHDOG_USEC": "soon"})


def test_a_full_queue_drops_the_message_instead_of_stalling(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    listener = Listener(path, buffer=4096, read=False)  # nobody reads: the queue fills
    notifier = Notifier(path)
    try:
        started = time.monotonic()
        results = [notifier.status("x" * 512) for _ in range(2000)]
        assert time.monotonic() - started < 2.0
        assert not all(results) and notifier.dropped > 0 and notifier.sent > 0
    finally:
        listener.close()


def test_a_listener_gone_is_not_an_error(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody"))
    assert notifier.watchdog() is False and notifier.dropped == 1


# -- the health check -------------------------------------------------------------------------

@dataclass
class _Load:
    queue_depth: int = 0
    busy_instances: int = 0
    completed_total: int = 0


@dataclass
class _Batcher:
    now: _Load = field(default_factory=_Load)

    def load(self) -> _Load:
        return self.now


@dataclass
class _Service:
    version: int = 1
    batcher: _Batcher = field(default_factory=_Batcher)


@dataclass
class _Supervisor:
    tasks: list[TaskStatus] = field(default_factory=list)

    def status(self) -> list[TaskStatus]:
        return self.tasks


@dataclass
class _Daemon:
    supervisor: _Supervisor = field(default_factory=_Supervisor)
    services: dict[str, _Service] = field(default_factory=lambda: {"tiny": _Service()})


def test_health_names_a_dead_task_but_not_its_own_watchdog() -> None:
    daemon = _Daemon()
    daemon.supervisor.tasks = [TaskStatus("updater", False, TaskState.RUNNING),
                               TaskStatus("watchdog", True, TaskState.RUNNING)]
    health = Health(daemon)  # type: ignore[arg-type]
    assert health.problems() == []
    daemon.supervisor.tasks[0] = TaskStatus("updater", False, TaskState.FAILED, "boom")
    assert health.problems() == ["task updater failed: boom"]


def test_health_finds_a_batcher_that_holds_work_and_answers_nothing() -> None:
    now = [100.0]
    daemon = _Daemon()
    health = Health(daemon, stall_s=30, clock=lambda: now[0])  # type: ignore[arg-type]
    batcher = daemon.services["tiny"].batcher
    batcher.now = _Load(queue_depth=3, busy_instances=1, completed_total=10)
    assert health.problems() == []
    now[0] += 29
    assert health.problems() == []
    now[0] += 2
    assert health.problems() and "tiny" in health.problems()[0]
    batcher.now = _Load(queue_depth=3, busy_instances=1, completed_total=11)  # it moved
    assert health.problems() == []
    # Idle is not stalled: nothing waiting, nothing answered, for as long as you like.
    batcher.now = _Load(completed_total=11)
    now[0] += 1000
    assert health.problems() == []


def test_a_probe_that_fails_or_raises_stops_the_pings() -> None:
    health = Health(_Daemon())  # type: ignore[arg-type]
    health.add_probe("power", lambda: "no heartbeat for 12 s")
    health.add_probe("broken", lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    problems = health.problems()
    assert problems[0] == "power: no heartbeat for 12 s"
    assert problems[1].startswith("broken: its check raised ZeroDivisionError")


def test_the_pings_stop_while_the_event_loop_is_stalled_and_resume(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    listener = Listener(path)
    daemon = _Daemon()
    daemon.state = type("S", (), {"value": "serving"})()  # type: ignore[attr-defined]
    daemon.updater = None  # type: ignore[attr-defined]
    service = SystemdService(daemon, Notifier(path, watchdog_s=0.2))  # type: ignore[arg-type]

    async def scenario() -> None:
        task = asyncio.ensure_future(service.run_watchdog())
        await asyncio.sleep(0.5)
        time.sleep(1.0)  # the loop stalls: nothing on it runs, the watchdog task included
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    started = time.monotonic()
    asyncio.run(scenario())
    listener.drain(0.3)
    pings = [at - started for at, fields in listener.messages if "WATCHDOG" in fields]
    gaps = [later - earlier for earlier, later in zip(pings, pings[1:])]
    assert len(pings) >= 5, pings
    assert max(gaps) >= 0.9  # the stall
    assert sorted(gaps)[len(gaps) // 2] < 0.3  # otherwise every 0.1 s
    listener.close()


def test_a_failed_task_stops_the_pings_and_says_why_in_the_status(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    listener = Listener(path)
    daemon = _Daemon()
    daemon.state = type("S", (), {"value": "serving"})()  # type: ignore[attr-defined]
    daemon.updater = None  # type: ignore[attr-defined]
    daemon.supervisor.tasks = [TaskStatus("fleet", False, TaskState.FAILED, "broker gone")]
    service = SystemdService(daemon, Notifier(path, watchdog_s=0.2))  # type: ignore[arg-type]

    async def scenario() -> None:
        task = asyncio.ensure_future(service.run_watchdog())
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    messages = listener.drain(0.3)
    assert not any("WATCHDOG" in fields for fields in messages)
    assert any("unhealthy: task fleet failed: broker gone" in fields.get("STATUS", "")
               for fields in messages)
    listener.close()


# -- `edge-agent serve` under a listener playing systemd --------------------------------------

pytest.importorskip("onnxruntime")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serve_tells_systemd_ready_status_watchdog_reload_and_stopping(tmp_path: Path) -> None:
    from models.signing import load_private_key, write_keypair
    from tests.tiny_models import make_bundle

    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path))
    port = _free_port()
    config = tmp_path / "agent.toml"

    def write_config(delay_us: int, http_port: int) -> None:
        config.write_text(f'state_dir = "{tmp_path / "state"}"\n[http]\nport = {http_port}\n'
                          f'[serving]\nmax_queue_delay_us = {delay_us}\n'
                          f'[trust]\npublic_keys = ["{key_path}.pub"]\n')

    write_config(5000, port)
    listener = Listener(str(tmp_path / "notify"))
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("EDGE_AGENT_") or name == "EDGE_AGENT_CACHE"}
    env.update(NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="600000")
    process = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--config", str(config),
                                "--bundle", str(bundle)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env=env)
    try:
        listener.wait_for("EXTEND_TIMEOUT_USEC")
        ready = listener.wait_for("READY", "1")
        assert "serving tiny v1" in ready["STATUS"] and "update idle" in ready["STATUS"]
        # Ready means serving: the API answers now.
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5):
            pass
        listener.drain(1.5)
        pings = [at for at, fields in listener.messages if "WATCHDOG" in fields]
        assert len(pings) >= 3, listener.messages

        write_config(2000, port + 1)
        process.send_signal(signal.SIGHUP)
        listener.wait_for("RELOADING", "1")
        reloaded = listener.wait_for("STATUS", "reload:")
        assert ("applied serving.max_queue_delay_us; needs a restart: http.port"
                in reloaded["STATUS"]), reloaded
        assert process.poll() is None

        process.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING", "1")
        output = process.communicate(timeout=30)[0].decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        listener.close()
    assert process.returncode == 0, output
    assert "systemd watchdog: 0.6 s" in output


def test_a_power_thread_that_stops_stepping_makes_the_daemon_unhealthy(tmp_path: Path) -> None:
    from agent.config import PowerConfig
    from agent.power.service import PowerService
    from agent.systemd import attach_systemd

    power = PowerService(PowerConfig(enabled=True), tmp_path, batchers=lambda: [])
    assert power.liveness() is None  # not started yet
    power._running = True
    power.last_step_at = time.monotonic()
    assert power.liveness() is None
    power.last_step_at = time.monotonic() - 60
    assert "has not stepped for 60 s" in (power.liveness() or "")

    added: list[str] = []
    daemon = _Daemon()
    daemon.power = power  # type: ignore[attr-defined]
    daemon.add_task = lambda name, run, critical=False: added.append(name)  # type: ignore
    daemon.add_state_listener = lambda listener: None  # type: ignore[attr-defined]
    listener = Listener(str(tmp_path / "notify"))
    try:
        service = attach_systemd(daemon, Notifier(str(tmp_path / "notify")))  # type: ignore
        assert service is not None and added == ["watchdog"]
        assert any(problem.startswith("power: the power thread has not stepped")
                   for problem in service.health.problems())
    finally:
        listener.close()
