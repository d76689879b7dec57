"""The local control channel on real Unix sockets: the round trip and its streamed events, every
error reply, the bounds (line size, idle clients, clients that leave mid-stream), the socket file's
life (stale replaced, live refused, mode 0600, removed on stop), who may connect (another uid is
turned away by the file mode and by SO_PEERCRED), ``edge-agent update`` end to end against a real
server, and a real daemon answering ``daemon.status``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.cli import main
from agent.cli.update import ProgressPrinter, source_url, summary
from agent.control import protocol
from agent.control.client import CommandError, ControlClient
from agent.control.protocol import (
    ProgressEvent,
    StateEvent,
    UpdateFailure,
    UpdateStatus,
    UpdateTarget,
)
from agent.control.server import ControlServer, Emit
from agent.errors import AgentError, ControlError, InputError, UpdateError

T = TypeVar("T")
NOBODY_UID = 65534


class ServerThread:
    """A ControlServer on its own event loop thread, so the blocking client (and the CLI) can
    talk to it from the test's thread."""

    def __init__(self, path: Path, handlers: dict[str, Any], **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = ControlServer(path, **options)
        for name, handler in handlers.items():
            self.server.register(name, handler)
        self.path = path
        self.running = False

    def start(self) -> ServerThread:
        self.call(self.server.start())
        self.running = True
        return self

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if self.running:
            self.running = False
            self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def echo(args: dict[str, Any], emit: Emit) -> Any:
    return args


async def count(args: dict[str, Any], emit: Emit) -> str:
    for index in range(args["n"]):
        emit({"index": index})
    return "counted"


async def count_from_a_thread(args: dict[str, Any], emit: Emit) -> str:
    def work() -> None:
        for index in range(3):
            emit({"index": index})

    await asyncio.get_running_loop().run_in_executor(None, work)
    await asyncio.sleep(0.05)  # the events, sent through the loop, go out before the reply
    return "counted"


async def refuse_update(args: dict[str, Any], emit: Emit) -> Any:
    raise UpdateError("the bundle's hash does not match its manifest", reason="hash_mismatch",
                      path="model.onnx")


async def refuse(args: dict[str, Any], emit: Emit) -> Any:
    raise AgentError("nothing to roll back to", installed="tiny v1")


async def crash(args: dict[str, Any], emit: Emit) -> Any:
    raise RuntimeError("a bug in a handler")


async def not_json(args: dict[str, Any], emit: Emit) -> Any:
    return {"value": object()}


HANDLERS = {"echo": echo, "count": count, "count.thread": count_from_a_thread,
            "refuse.update": refuse_update, "refuse": refuse, "crash": crash,
            "not.json": not_json}


@pytest.fixture()
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(handlers: dict[str, Any] | None = None, *, path: Path | None = None,
              **options: Any) -> ServerThread:
        thread = ServerThread(path or tmp_path / protocol.SOCKET_NAME,
                              HANDLERS if handlers is None else handlers, **options)
        started.append(thread)
        return thread.start()

    yield start
    for thread in reversed(started):
        thread.close()


def raw_exchange(path: Path, data: bytes, *, timeout_s: float = 5) -> list[dict[str, Any]]:
    """Send ``data`` as is and read every line until the server closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server hung up first; its reply is still there to read
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(ConnectionResetError):  # the server closed with data unread
            while chunk := sock.recv(65536):
                received += chunk
    return [json.loads(line) for line in received.splitlines()]


# -- the protocol ---------------------------------------------------------------------------------


def test_a_call_returns_its_result_after_its_events_in_order(start_server: Any) -> None:
    server = start_server()
    client = ControlClient(server.path)
    events: list[dict[str, Any]] = []
    assert client.call("count", {"n": 5}, on_event=events.append) == "counted"
    assert events == [{"index": index} for index in range(5)]
    assert client.call("echo", {"a": [1, "b"]}) == {"a": [1, "b"]}
    assert client.call("echo") == {}
    events.clear()
    assert client.call("count.thread", on_event=events.append) == "counted"
    assert events == [{"index": index} for index in range(3)]


@pytest.mark.parametrize("line, reason, answers_id", [
    (b"{not json\n", "bad_request", False),
    (b"[1, 2]\n", "bad_request", False),
    (b"\xff\xfe\n", "bad_request", False),
    (b'{"command": "echo"}\n', "bad_request", False),
    (b'{"id": 5, "command": "echo"}\n', "bad_request", False),
    (b'{"id": "r1", "command": 7}\n', "bad_request", True),
    (b'{"id": "r1", "command": "echo", "args": [1]}\n', "bad_request", True),
    (b'{"id": "r1", "command": "no.such"}\n', "unknown_command", True),
])
def test_a_malformed_request_is_answered_and_the_server_goes_on(
        start_server: Any, line: bytes, reason: str, answers_id: bool) -> None:
    server = start_server()
    # Two requests on one connection: the bad one is answered, and the next still runs.
    replies = raw_exchange(server.path, line + b'{"id": "r2", "command": "echo", "args": {}}\n')
    assert replies[0]["ok"] is False and replies[0]["reason"] == reason, replies
    assert replies[0]["id"] == ("r1" if answers_id else None)
    assert replies[1] == {"id": "r2", "ok": True, "result": {}}


def test_an_unknown_command_names_the_commands_the_daemon_knows(start_server: Any) -> None:
    server = start_server({"echo": echo, "count": count})
    with pytest.raises(CommandError) as caught:
        ControlClient(server.path).call("update.apply", {"source": "file:///b"})
    assert caught.value.reason == "unknown_command"
    assert "'update.apply'" in str(caught.value) and "count, echo" in str(caught.value)


def test_handler_errors_become_error_replies(start_server: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    server = start_server()
    client = ControlClient(server.path)
    with pytest.raises(CommandError) as caught:
        client.call("refuse.update")
    assert caught.value.reason == "hash_mismatch" and caught.value.command == "refuse.update"
    assert "does not match its manifest" in str(caught.value)
    assert "path=model.onnx" in str(caught.value)
    with pytest.raises(CommandError) as caught:
        client.call("refuse")
    assert caught.value.reason is None
    assert str(caught.value) == "nothing to roll back to (installed=tiny v1)"
    with pytest.raises(CommandError) as caught:
        client.call("crash")
    assert caught.value.reason == "internal" and "a bug in a handler" in str(caught.value)
    assert "RuntimeError: a bug in a handler" in caplog.text  # the traceback is in the log
    with pytest.raises(CommandError) as caught:
        client.call("not.json")
    assert caught.value.reason == "internal"
    assert client.call("echo", {"still": "serving"}) == {"still": "serving"}


def test_a_line_longer_than_the_bound_is_refused_and_the_server_goes_on(
        start_server: Any) -> None:
    server = start_server(max_line_bytes=64 * 1024)
    request = json.dumps({"id": "big", "command": "echo",
                          "args": {"blob": "x" * 100_000}}).encode() + b"\n"
    replies = raw_exchange(server.path, request)
    assert replies == [{"id": None, "ok": False, "reason": "line_too_long",
                        "error": "a request line is longer than 65536 bytes"}]
    assert ControlClient(server.path).call("echo", {"small": 1}) == {"small": 1}


def test_the_client_refuses_a_reply_line_without_end(tmp_path: Path) -> None:
    path = tmp_path / "fake.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()

        def flood() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(4096)
                with contextlib.suppress(OSError):
                    connection.sendall(b"x" * (protocol.MAX_LINE_BYTES + 70_000))

        thread = threading.Thread(target=flood)
        thread.start()
        with pytest.raises(ControlError, match="longer than"):
            ControlClient(path).call("echo")
        thread.join(5)


def test_a_client_leaving_mid_stream_leaves_the_command_running(start_server: Any) -> None:
    finished = threading.Event()
    release = asyncio.Event()

    async def long_running(args: dict[str, Any], emit: Emit) -> str:
        emit({"step": 1})
        await release.wait()
        for step in range(2, 200):  # emits after the client has gone are dropped
            emit({"step": step})
            await asyncio.sleep(0)
        finished.set()
        return "done"

    server = start_server({"long": long_running, "echo": echo})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(server.path))
        sock.sendall(b'{"id": "a", "command": "long"}\n')
        assert json.loads(sock.recv(4096).splitlines()[0]) == {"id": "a", "event": {"step": 1}}
    server.loop.call_soon_threadsafe(release.set)
    assert finished.wait(5)
    assert ControlClient(server.path).call("echo", {"ok": 1}) == {"ok": 1}


def test_an_idle_client_is_told_and_disconnected(start_server: Any) -> None:
    server = start_server(idle_timeout_s=0.2)
    started = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(server.path))
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert json.loads(data)["reason"] == "idle_timeout"
    assert time.monotonic() - started < 3


def test_a_client_that_stops_reading_its_events_is_disconnected(start_server: Any) -> None:
    finished = threading.Event()

    async def chatty(args: dict[str, Any], emit: Emit) -> str:
        for _ in range(2000):
            emit({"filler": "y" * 1000})
            await asyncio.sleep(0)
        finished.set()
        return "done"

    server = start_server({"chatty": chatty, "echo": echo}, max_buffered_bytes=64 * 1024)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(server.path))
        sock.sendall(b'{"id": "c", "command": "chatty"}\n')
        assert finished.wait(5)  # the command ran to its end although nobody read
        sock.settimeout(5)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    lines = received.splitlines()
    assert len(lines) < 2000 and b'"ok"' not in received  # cut off, never answered
    assert ControlClient(server.path).call("echo", {"ok": 1}) == {"ok": 1}


def test_several_clients_are_served_at_once(start_server: Any) -> None:
    arrived: list[int] = []
    everyone = asyncio.Event()

    async def rendezvous(args: dict[str, Any], emit: Emit) -> int:
        arrived.append(args["n"])
        if len(arrived) == 3:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 5)  # a server serving one at a time times out
        return int(args["n"])

    server = start_server({"meet": rendezvous})
    results: dict[int, Any] = {}

    def call(n: int) -> None:
        results[n] = ControlClient(server.path).call("meet", {"n": n})

    threads = [threading.Thread(target=call, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == {0: 0, 1: 1, 2: 2}


def test_stopping_tells_a_running_command_s_client(start_server: Any) -> None:
    started = threading.Event()

    async def forever(args: dict[str, Any], emit: Emit) -> None:
        started.set()
        await asyncio.sleep(3600)

    server = start_server({"forever": forever})
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            ControlClient(server.path).call("forever", timeout_s=10)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert started.wait(5)
    server.running = False
    server.call(server.server.stop())
    thread.join(10)
    assert isinstance(outcome[0], CommandError) and outcome[0].reason == "stopping"


# -- the socket file ------------------------------------------------------------------------------


def test_the_socket_is_0600_from_the_start_and_removed_on_stop(start_server: Any) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    server = start_server()
    info = server.path.lstat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert os.umask(umask) == umask  # the process's umask is back as it was
    server.close()
    assert not server.path.exists()


def test_a_stale_socket_is_replaced(start_server: Any, tmp_path: Path) -> None:
    path = tmp_path / protocol.SOCKET_NAME
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # what a daemon killed with SIGKILL leaves: a file nobody serves
    assert stat.S_ISSOCK(path.lstat().st_mode)
    with pytest.raises(ControlError, match="a daemon that stopped left the socket"):
        ControlClient(path).call("echo")
    server = start_server()
    assert ControlClient(server.path).call("echo", {"x": 1}) == {"x": 1}


def test_a_live_socket_is_refused_and_left_alone(start_server: Any, tmp_path: Path) -> None:
    first = start_server()
    second = ServerThread(first.path, HANDLERS)
    try:
        with pytest.raises(ControlError, match="another daemon answers") as caught:
            second.call(second.server.start())
        assert str(first.path) in str(caught.value)
    finally:
        second.close()
    assert ControlClient(first.path).call("echo", {"first": 1}) == {"first": 1}


def test_a_path_taken_by_a_file_is_named_and_kept(start_server: Any, tmp_path: Path) -> None:
    path = tmp_path / protocol.SOCKET_NAME
    path.write_text("someone's notes")
    with pytest.raises(ControlError, match="taken by something else"):
        start_server()
    assert path.read_text() == "someone's notes"


def test_a_stop_does_not_remove_a_socket_that_replaced_its_own(start_server: Any) -> None:
    server = start_server()
    server.path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(server.path))  # a newer daemon's socket
        server.close()
        assert stat.S_ISSOCK(server.path.lstat().st_mode)


def test_no_daemon_says_how_to_find_one(tmp_path: Path) -> None:
    with pytest.raises(ControlError) as caught:
        ControlClient(tmp_path / "control.sock").call("update.status")
    assert "is 'edge-agent serve' running" in str(caught.value)
    assert "--state-dir" in str(caught.value) and str(tmp_path) in str(caught.value)


# -- who may connect ------------------------------------------------------------------------------


NOBODY_CLIENT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect": type(exc).__name__}))
    sys.exit()
try:
    sock.sendall(b'{"id": "n", "command": "echo"}\\n')
except OSError:
    pass  # refused at once: the reply is still there to read
data = b""
while True:
    try:
        chunk = sock.recv(4096)
    except ConnectionResetError:  # Linux, when the daemon closed with our request unread
        break
    if not chunk:
        break
    data += chunk
print(json.dumps({"connect": "ok", "replies": [json.loads(line) for line in data.splitlines()]}))
"""


def nobody_python() -> str:
    """An interpreter the user nobody can run (this one may live under root's home)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not candidate:
            continue
        try:
            subprocess.run([candidate, "-c", "pass"], user=NOBODY_UID, capture_output=True,
                           check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        return candidate
    pytest.skip("no Python interpreter the user nobody can run")


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
def test_another_user_is_refused_by_the_mode_and_by_the_peer_check(
        start_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A directory nobody can traverse (pytest's are root-only), so what refuses it is the
    # socket's own mode, then the peer check.
    directory = Path(tempfile.mkdtemp(prefix="control-"))
    try:
        directory.chmod(0o755)
        server = start_server(path=directory / protocol.SOCKET_NAME)
        python = nobody_python()

        def as_nobody() -> dict[str, Any]:
            result = subprocess.run([python, "-c", NOBODY_CLIENT, str(server.path)],
                                    user=NOBODY_UID, capture_output=True, text=True,
                                    timeout=30, check=False)
            assert result.returncode == 0, result.stderr
            return dict(json.loads(result.stdout))

        assert as_nobody() == {"connect": "PermissionError"}  # the kernel, by the file mode
        server.path.chmod(0o666)  # as an operator's mistake would
        outcome = as_nobody()
        assert outcome["connect"] == "ok"
        assert [reply["reason"] for reply in outcome["replies"]] == ["permission_denied"]
        assert f"not uid {NOBODY_UID}" in outcome["replies"][0]["error"]
        assert f"refused a client of uid {NOBODY_UID}" in caplog.text
        assert ControlClient(server.path).call("echo", {"root": 1}) == {"root": 1}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_client_turns_a_refused_peer_into_advice(start_server: Any) -> None:
    server = start_server(allowed_uids=frozenset({NOBODY_UID}))  # anyone but us
    with pytest.raises(ControlError, match="run as the daemon's user or root"):
        ControlClient(server.path).call("echo")


# -- edge-agent update ----------------------------------------------------------------------------


class FakeUpdater:
    """Handlers standing in for the daemon's updater: they record what they were asked and
    answer with the shapes protocol.py defines."""

    def __init__(self, *, outcome: str = "committed") -> None:
        self.outcome = outcome
        self.requests: list[dict[str, Any]] = []

    def handlers(self) -> dict[str, Any]:
        return {protocol.UPDATE_APPLY: self.apply, protocol.UPDATE_STATUS: self.status,
                protocol.UPDATE_ROLLBACK: self.rollback}

    async def apply(self, args: dict[str, Any], emit: Emit) -> Any:
        request = protocol.ApplyArgs.from_json(args)
        self.requests.append(request.to_json())
        target = UpdateTarget(source=request.source, name="tiny", version=4)
        if not request.wait:
            return UpdateStatus(state="downloading", target=target, attempts=1).to_json()
        emit(StateEvent(state="downloading", previous="idle").to_json())
        for done in (0, 250_000, 500_000, 1_000_000):
            emit(ProgressEvent(done_bytes=done, total_bytes=1_000_000).to_json())
        emit({"kind": "from-a-newer-daemon"})
        emit(StateEvent(state="verifying", previous="downloading").to_json())
        if self.outcome == "refused":
            raise UpdateError("the bundle was signed by an unknown key", reason="unknown_key",
                              key_id="k9")
        if self.outcome == "failed":
            emit(StateEvent(state="rolling-back", previous="canary",
                            message="NaN in outputs").to_json())
            return UpdateStatus(state="failed", serving=protocol.ModelVersion(
                name="tiny", version=3), target=target, attempts=1, error=UpdateFailure(
                reason="canary_nan", message="the new version answered NaN")).to_json()
        emit(StateEvent(state="committed", previous="canary").to_json())
        return UpdateStatus(state="committed", serving=protocol.ModelVersion(
            name="tiny", version=4), target=target, attempts=1).to_json()

    async def status(self, args: dict[str, Any], emit: Emit) -> Any:
        return UpdateStatus(state="downloading", serving=protocol.ModelVersion(
            name="tiny", version=3), target=UpdateTarget(source="https://cdn/tiny-4.bundle",
                                                         name="tiny", version=4),
            attempts=2, since_unix_s=time.time() - 40, done_bytes=3 * 1024 * 1024,
            total_bytes=12 * 1024 * 1024, error=UpdateFailure(
                reason="stalled", message="no byte for 30 s")).to_json()

    async def rollback(self, args: dict[str, Any], emit: Emit) -> Any:
        emit(StateEvent(state="rolling-back", previous="idle").to_json())
        if self.outcome == "failed":
            return UpdateStatus(state="failed", serving=protocol.ModelVersion(
                name="tiny", version=3), error=UpdateFailure(
                reason="rollback_failed", message="rolling back failed (the disk is full)")
            ).to_json()
        return UpdateStatus(state="idle", serving=protocol.ModelVersion(
            name="tiny", version=2)).to_json()


def run_cli(*argv: str) -> int:
    return main(["update", *argv])


def test_update_apply_shows_progress_and_exits_0_on_commit(
        start_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    updater = FakeUpdater()
    start_server(updater.handlers())
    bundle = tmp_path / "bundles" / "tiny-4.bundle"
    bundle.parent.mkdir()
    bundle.write_bytes(b"a bundle")
    monkeypatch.chdir(bundle.parent)
    assert run_cli("apply", "tiny-4.bundle", "--state-dir", str(tmp_path)) == 0
    # A relative path travels as the absolute file URL, as the daemon has its own directory.
    assert updater.requests == [{"source": bundle.resolve().as_uri(), "wait": True}]
    out = capsys.readouterr().out.splitlines()
    assert out == ["downloading", "  downloaded 0% (0.0 of 1.0 MiB)",
                   "  downloaded 25% (0.2 of 1.0 MiB)", "  downloaded 50% (0.5 of 1.0 MiB)",
                   "  downloaded 100% (1.0 of 1.0 MiB)", "verifying", "committed",
                   "committed: tiny v4 serves"]


def test_update_apply_exits_1_with_the_reason_when_the_update_fails(
        start_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start_server(FakeUpdater(outcome="failed").handlers())
    assert run_cli("apply", "https://cdn/tiny-4.bundle", "--state-dir", str(tmp_path)) == 1
    captured = capsys.readouterr()
    assert "rolling-back: NaN in outputs" in captured.out
    assert ("the update ended failed: the new version answered NaN (reason=canary_nan); "
            "tiny v3 serves") in captured.err


def test_update_apply_refused_exits_1_naming_the_reason(
        start_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start_server(FakeUpdater(outcome="refused").handlers())
    assert run_cli("apply", "https://cdn/tiny-4.bundle", "--state-dir", str(tmp_path)) == 1
    assert ("edge-agent: error: the bundle was signed by an unknown key (reason=unknown_key, "
            "key_id=k9)") in capsys.readouterr().err
    assert run_cli("apply", "https://cdn/tiny-4.bundle", "--state-dir", str(tmp_path),
                   "--json") == 1
    assert json.loads(capsys.readouterr().out)["reason"] == "unknown_key"


def test_update_apply_no_wait_and_json(start_server: Any, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    updater = FakeUpdater()
    start_server(updater.handlers())
    assert run_cli("apply", "https://cdn/tiny-4.bundle", "--no-wait",
                   "--state-dir", str(tmp_path)) == 0
    assert updater.requests[-1] == {"source": "https://cdn/tiny-4.bundle", "wait": False}
    assert "update requested: tiny v4 from https://cdn/tiny-4.bundle (downloading)" in \
        capsys.readouterr().out
    assert run_cli("apply", "https://cdn/tiny-4.bundle", "--json",
                   "--state-dir", str(tmp_path)) == 0
    result = json.loads(capsys.readouterr().out)  # only the JSON: no progress lines
    assert result["state"] == "committed" and result["serving"] == {"name": "tiny", "version": 4}


def test_update_status_and_rollback(start_server: Any, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    start_server(FakeUpdater().handlers())
    assert run_cli("status", "--state-dir", str(tmp_path)) == 0
    assert capsys.readouterr().out.splitlines() == [
        "state: downloading for 40 s", "serving: tiny v3",
        "update: tiny v4 from https://cdn/tiny-4.bundle, attempt 2",
        "progress: 25% (3.0 of 12.0 MiB)", "last error: stalled: no byte for 30 s"]
    assert run_cli("status", "--json", "--state-dir", str(tmp_path)) == 0
    status = UpdateStatus.from_json(json.loads(capsys.readouterr().out))
    assert status.state == "downloading" and status.attempts == 2
    assert run_cli("rollback", "--state-dir", str(tmp_path)) == 0
    assert capsys.readouterr().out.splitlines() == ["rolling-back", "rolled back: tiny v2 serves"]


def test_a_rollback_that_fails_exits_1_with_the_reason(
        start_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not 'rolled back' and 0: a script (or an operator at 3 a.m.) must see that the old
    version was not restored."""
    start_server(FakeUpdater(outcome="failed").handlers())
    assert run_cli("rollback", "--state-dir", str(tmp_path)) == 1
    captured = capsys.readouterr()
    assert "rolled back" not in captured.out
    assert ("edge-agent: error: the rollback ended failed: rolling back failed (the disk is "
            "full) (reason=rollback_failed); tiny v3 serves") in captured.err
    assert run_cli("rollback", "--json", "--state-dir", str(tmp_path)) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "failed"


def test_update_finds_the_socket_through_the_configuration(
        start_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state").mkdir()
    start_server(FakeUpdater().handlers(), path=tmp_path / "state" / protocol.SOCKET_NAME)
    config = tmp_path / "agent.toml"
    config.write_text('state_dir = "state"\n')  # relative to the file's directory
    assert run_cli("status", "--config", str(config)) == 0
    assert capsys.readouterr().out.startswith("state: downloading")


def test_update_without_a_daemon_exits_1_saying_so(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("status", "--state-dir", str(tmp_path)) == 1
    assert "no daemon listens here" in capsys.readouterr().err


def test_source_url_checks_paths_and_schemes(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no bundle at this path"):
        source_url(str(tmp_path / "missing.bundle"))
    with pytest.raises(InputError, match="not a file"):
        source_url(str(tmp_path))
    with pytest.raises(AgentError, match="http, https or file"):
        source_url("ftp://host/b.bundle")
    assert source_url("HTTPS://host/b.bundle") == "HTTPS://host/b.bundle"
    with pytest.raises(ControlError, match="'source' must be"):
        protocol.ApplyArgs.from_json({"source": "/not/a/url"})
    with pytest.raises(ControlError, match="'wait' must be"):
        protocol.ApplyArgs.from_json({"source": "file:///b", "wait": "yes"})


def test_progress_redraws_in_place_on_a_terminal() -> None:
    stream = io.StringIO()
    now = [0.0]
    printer = ProgressPrinter(stream, tty=True, clock=lambda: now[0])
    for done, at_s in ((0, 0.0), (100, 0.01), (300, 0.2), (1000, 0.21)):
        now[0] = at_s
        printer(ProgressEvent(done_bytes=done * 1024, total_bytes=1000 * 1024).to_json())
    printer(StateEvent(state="verifying").to_json())
    text = stream.getvalue()
    # 100 came too soon after 0 to be drawn; the end always is.
    assert text.count("\r") == 3 and "10%" not in text
    assert text.endswith("\r  downloaded 100% (1.0 of 1.0 MiB)\x1b[K\nverifying\n")


def test_a_status_summary_escapes_what_the_daemon_relays() -> None:
    status = UpdateStatus(state="failed", error=UpdateFailure(reason="bad_manifest",
                                                              message="name \x1b[31mred"))
    assert summary(status) == ("state: failed\nserving: no model\n"
                               "last error: bad_manifest: name \\x1b[31mred")


def test_a_status_with_a_mistyped_field_is_named() -> None:
    with pytest.raises(ControlError, match="'attempts' must be int"):
        UpdateStatus.from_json({"state": "idle", "attempts": "2"})
    with pytest.raises(ControlError, match="'version' must be int"):
        UpdateStatus.from_json({"state": "idle", "serving": {"name": "t", "version": True}})
    assert UpdateStatus.from_json({"state": "idle", "added_later": 1}).state == "idle"


# -- a real daemon --------------------------------------------------------------------------------


def test_a_started_daemon_answers_daemon_status_over_its_socket(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from agent.config import load_config
    from agent.daemon import Daemon
    from models.signing import load_private_key, write_keypair
    from tests.tiny_models import make_bundle

    key_path = tmp_path / "fleet.key"
    write_keypair(key_path)
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path))
    config = load_config(None, env={}, overrides={
        "state_dir": tmp_path / "state", "http.port": 0, "serving.backend": "onnxruntime",
        "trust.public_keys": [Path(f"{key_path}.pub")]})
    daemon = Daemon(config)
    candidate = daemon.install(bundle)
    socket_path = config.state_dir / protocol.SOCKET_NAME
    client = ControlClient(socket_path)

    async def scenario() -> Any:
        await daemon.start(candidate)
        try:
            # The client blocks: off the loop, which serves the socket.
            return await asyncio.get_running_loop().run_in_executor(
                None, client.call, protocol.DAEMON_STATUS)
        finally:
            await daemon.stop()

    try:
        status = asyncio.run(scenario())
    finally:
        daemon.close()
    assert status["state"] == "serving" and status["models"] == {"tiny": 1}
    assert not socket_path.exists()  # removed on stop


def test_a_path_too_long_for_a_unix_socket_is_named(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    server = ControlServer(deep / protocol.SOCKET_NAME)
    with pytest.raises(ControlError, match="use a shorter state directory"):
        asyncio.run(server.start())


def test_a_client_beyond_the_limit_is_told_to_try_again(start_server: Any) -> None:
    release = asyncio.Event()
    started = threading.Event()

    async def hold(args: dict[str, Any], emit: Emit) -> str:
        started.set()
        await release.wait()
        return "released"

    server = start_server({"hold": hold, "echo": echo}, max_clients=1)
    results: list[Any] = []
    holder = threading.Thread(target=lambda: results.append(
        ControlClient(server.path).call("hold")))
    holder.start()
    assert started.wait(5)
    with pytest.raises(CommandError) as caught:
        ControlClient(server.path).call("echo")
    assert caught.value.reason == "too_many_clients"
    server.loop.call_soon_threadsafe(release.set)
    holder.join(5)
    assert results == ["released"]
    # The slot frees once the server has seen the first client close its connection.
    deadline = time.monotonic() + 5
    while True:
        try:
            assert ControlClient(server.path).call("echo", {"after": 1}) == {"after": 1}
            break
        except CommandError as exc:
            if exc.reason != "too_many_clients" or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
