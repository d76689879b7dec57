"""The privileged power helper: the one process that writes the board's power settings when the
daemon runs as an unprivileged service (edge-agent-power.service, socket-activated).

DVFS limits, rail gating and nvpmodel need root; the daemon has no capability at all. So the
daemon's :class:`~power.helper_client.HelperWriter` sends each write here over a Unix socket,
and this process, running as root, does it only if it is one the board layer would make:

- the peer must be the daemon's user (``SO_PEERCRED`` on the connection; the socket's mode
  0660 root:edge-agent already keeps others out, the uid check keeps out other members of the
  group);
- a ``write`` must name a file of :func:`power.io.allowed_writes` for this board (its GPU
  devfreq limits, cpufreq policy limits, EMC lock and rate, GPU rail gating) with a value its
  rule accepts (within the board's own frequency tables);
- an ``nvpmodel`` request must name a mode of the board's profile (:mod:`power.profiles`,
  identified from the device tree), and is run as ``nvpmodel -m N``.

Everything else is refused with a reason, and the connection stays usable. Before the first
change to each setting the helper reads and keeps what the board had; when the daemon's
connection closes (a clean stop, a crash, a watchdog kill) or the helper is stopped, it puts
all of it back: nvpmodel's mode first (it resets the caps), then each file, minima lowered to
the table's floor before maxima are restored, so that no kernel refuses an intermediate state
(JetPack 4 rejects a minimum above the maximum). One client at a time: a second connection is
told the helper is busy.

The protocol is JSON lines: one request object a line, one answer a line::

    {"op": "hello"}                                   -> {"ok": true, "board": ..., "paths": [...]}
    {"op": "write", "path": "sys/...", "value": "..."} -> {"ok": true}
    {"op": "nvpmodel", "mode": 2}                     -> {"ok": true}
    {"op": "restore"}                                 -> {"ok": true, "restored": N}
    refused: {"ok": false, "kind": "refused", "error": "...", "fields": {...}}
    the kernel said no: {"ok": false, "kind": "os", "errno": 22, "error": "..."}

Run as ``python -m power.helper --user edge-agent`` (systemd passes the listening socket, fd 3,
``$LISTEN_FDS``), or with ``--socket PATH`` to listen itself.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import pwd
import selectors
import signal
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import AgentError, PowerError
from power.commands import CommandRunner, SubprocessRunner
from power.io import FileWriter, WriteRule, Writer, allowed_writes, read_text
from power.nvpmodel import STATUS as NVPMODEL_STATUS
from power.nvpmodel import read_status

__all__ = ["MAX_LINE_BYTES", "PowerHelper", "Snapshot", "listening_socket", "main", "peer_uid"]

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 4096
SD_LISTEN_FDS_START = 3
NVPMODEL_TIMEOUT_S = 60.0


@dataclass
class Snapshot:
    """What the board had before the helper first changed each setting."""

    files: dict[str, str] = field(default_factory=dict)
    nvpmodel_mode: int | None = None

    def __bool__(self) -> bool:
        return bool(self.files) or self.nvpmodel_mode is not None


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of a Unix stream socket (``SO_PEERCRED``)."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                  struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class PowerHelper:
    """The helper's decisions, apart from the socket: validate, write, remember, restore.

    Args:
        root: The board's root (``/``; a fake tree in tests).
        allowed_uid: The only peer uid whose requests are served.
        runner: Runs ``nvpmodel`` (:class:`power.commands.SubprocessRunner`; tests pass the
            strict fake of power/sim/commands.py).
        rules: The allowed writes (default: :func:`power.io.allowed_writes` of ``root``).
        modes: The nvpmodel mode ids the board's profile has (default: from its profile, none
            when the board is not a known one).
        writer: What does the writes once they are checked (default: the files themselves;
            tests pass power/sim/kernel.py's FakeKernel, the kernel's rules over a fake tree).
    """

    def __init__(self, root: Path, *, allowed_uid: int, runner: CommandRunner | None = None,
                 rules: dict[str, WriteRule] | None = None,
                 modes: Sequence[int] | None = None, board: str | None = None,
                 writer: Writer | None = None) -> None:
        self.root = Path(root)
        self.allowed_uid = allowed_uid
        self.runner: CommandRunner = runner or SubprocessRunner()
        self.rules = allowed_writes(self.root) if rules is None else rules
        self.board = board
        if modes is None:
            modes, self.board = self._profile_modes()
        self.modes = frozenset(modes)
        self.writer: Writer = writer or FileWriter(self.root, rules=self.rules)
        # Restores write back what the board itself had, which need not pass the rules (a rate
        # the board was booted with but does not list, say).
        self._restore_writer: Writer = writer or FileWriter(self.root)
        self.snapshot = Snapshot()
        self._lock = threading.Lock()

    def _profile_modes(self) -> tuple[tuple[int, ...], str | None]:
        from power.profiles import identify
        from power.sysfs.discover import read_device_tree

        found = identify(read_device_tree(self.root, "compatible"))
        if found is None:
            log.warning("this board is not a known profile: nvpmodel requests will be refused")
            return (), None
        return tuple(mode.mode_id for mode in found.modes), found.name

    # -- requests --------------------------------------------------------------------------

    def handle(self, request: object) -> dict[str, Any]:
        """The answer to one decoded request line."""
        try:
            if not isinstance(request, dict):
                raise PowerError("a request is a JSON object", found=type(request).__name__)
            op = request.get("op")
            with self._lock:
                if op == "hello":
                    return {"ok": True, "board": self.board, "paths": sorted(self.rules),
                            "modes": sorted(self.modes)}
                if op == "write":
                    self._write(request)
                    return {"ok": True}
                if op == "nvpmodel":
                    self._nvpmodel(request)
                    return {"ok": True}
                if op == "restore":
                    return {"ok": True, "restored": self._restore()}
            raise PowerError("unknown request", op=str(op)[:40])
        except AgentError as exc:
            return {"ok": False, "kind": "refused", "error": exc.message,
                    "fields": {key: str(value)[:200] for key, value in exc.fields.items()}}
        except OSError as exc:
            return {"ok": False, "kind": "os", "errno": exc.errno or errno.EIO,
                    "error": exc.strerror or str(exc)}

    def _write(self, request: dict[str, Any]) -> None:
        path, value = request.get("path"), request.get("value")
        if not isinstance(path, str) or not isinstance(value, str):
            raise PowerError("a write names a path and a value, both strings")
        if path not in self.rules:
            # Checked here as well as by the writer, so nothing is read for a foreign path.
            raise PowerError("this file is not one the board layer writes", path=path)
        reason = self.rules[path].check(value)
        if reason is not None:
            raise PowerError("value refused for this file", path=path, value=value,
                             reason=reason)
        if path not in self.snapshot.files:
            self.snapshot.files[path] = read_text(self.root, path)
        self.writer.write(path, value)

    def _nvpmodel(self, request: dict[str, Any]) -> None:
        mode = request.get("mode")
        if not isinstance(mode, int) or isinstance(mode, bool):
            raise PowerError("an nvpmodel request names a mode id (an integer)")
        if mode not in self.modes:
            raise PowerError("not an nvpmodel mode of this board's profile", mode=mode,
                             board=self.board, modes=",".join(map(str, sorted(self.modes))))
        if self.snapshot.nvpmodel_mode is None:
            current = read_status(self.root)
            if current is None:
                raise PowerError("nvpmodel's current mode cannot be read, so it could not be "
                                 "restored; refusing to change it", path=NVPMODEL_STATUS)
            self.snapshot.nvpmodel_mode = current
        self._run_nvpmodel(mode)

    def _run_nvpmodel(self, mode: int) -> None:
        result = self.runner.run(["nvpmodel", "-m", str(mode)], timeout_s=NVPMODEL_TIMEOUT_S)
        if result.returncode != 0 or "NVPM ERROR" in result.output:
            raise PowerError("nvpmodel failed", mode=mode, status=result.returncode,
                             output=result.output.strip()[-200:])

    def _restore(self) -> int:
        """Put back what the snapshot holds; returns how many settings were restored. A write
        the kernel refuses is logged and the rest still restored."""
        snapshot = self.snapshot
        restored = 0
        if snapshot.nvpmodel_mode is not None:
            try:
                self._run_nvpmodel(snapshot.nvpmodel_mode)
                restored += 1
            except (AgentError, OSError) as exc:
                log.error("could not restore nvpmodel mode %d: %s", snapshot.nvpmodel_mode, exc)
        failed: set[str] = set()
        for path, value in _restore_order(snapshot.files, self.rules):
            try:
                self._restore_writer.write(path, value)
            except (AgentError, OSError) as exc:
                failed.add(path)
                log.error("could not restore %s to %s: %s", path, value, exc)
        # Emptied only now, so that whoever sees an empty snapshot sees the board restored.
        self.snapshot = Snapshot()
        return restored + len(set(snapshot.files) - failed)

    def restore(self) -> int:
        with self._lock:
            return self._restore()

    # -- the socket ------------------------------------------------------------------------

    def serve(self, listener: socket.socket, *, stop: threading.Event,
              idle_exit_s: float | None = None) -> None:
        """Serve connections on ``listener`` until ``stop`` is set (or, with ``idle_exit_s``,
        until that long passes with no client and nothing to restore); restores on the way
        out."""
        listener.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        client: socket.socket | None = None
        buffer = b""
        idle_s = 0.0
        tick_s = 0.2
        try:
            while not stop.is_set():
                events = selector.select(timeout=tick_s)
                if not events:
                    idle_s += tick_s
                    if (idle_exit_s is not None and client is None and not self.snapshot
                            and idle_s >= idle_exit_s):
                        log.info("no client for %.0f s: exiting (the socket starts it again)",
                                 idle_s)
                        return
                    continue
                idle_s = 0.0
                for key, _ in events:
                    if key.fileobj is listener:
                        client = self._accept(listener, selector, client)
                        continue
                    assert client is not None and key.fileobj is client
                    try:
                        data = client.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        self._disconnected(selector, client)
                        client, buffer = None, b""
                        continue
                    buffer += data
                    buffer, keep = self._answer_lines(client, buffer)
                    if not keep:
                        self._disconnected(selector, client)
                        client, buffer = None, b""
        finally:
            if client is not None:
                self._disconnected(selector, client)
            selector.close()
            if self.snapshot:
                self.restore()

    def _accept(self, listener: socket.socket, selector: selectors.BaseSelector,
                client: socket.socket | None) -> socket.socket | None:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return client
        uid = peer_uid(connection)
        if uid != self.allowed_uid:
            log.warning("refused a connection from uid %d (only uid %d is served)", uid,
                        self.allowed_uid)
            self._send_and_close(connection, {"ok": False, "kind": "refused",
                                              "error": "this user may not use the power helper",
                                              "fields": {"uid": str(uid)}})
            return client
        if client is not None:
            self._send_and_close(connection, {"ok": False, "kind": "refused",
                                              "error": "the helper serves one client at a time "
                                                       "and has one"})
            return client
        connection.setblocking(False)
        selector.register(connection, selectors.EVENT_READ, "client")
        log.info("client connected (uid %d)", uid)
        return connection

    @staticmethod
    def _send_and_close(connection: socket.socket, answer: dict[str, Any]) -> None:
        try:
            connection.sendall((json.dumps(answer) + "\n").encode())
        except OSError:
            pass
        connection.close()

    def _answer_lines(self, client: socket.socket, buffer: bytes) -> tuple[bytes, bool]:
        """Answer every complete line in ``buffer``; returns the rest and whether to keep the
        connection (a line over :data:`MAX_LINE_BYTES` ends it)."""
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if len(line) > MAX_LINE_BYTES:
                self._reply(client, {"ok": False, "kind": "refused",
                                     "error": "request line too long"})
                return b"", False
            try:
                request = json.loads(line)
            except ValueError:
                answer: dict[str, Any] = {"ok": False, "kind": "refused",
                                          "error": "a request is one JSON object a line"}
            else:
                answer = self.handle(request)
            if not answer["ok"]:
                log.warning("refused %s: %s", line[:200].decode("utf-8", "replace"),
                            answer.get("error"))
            self._reply(client, answer)
        if len(buffer) > MAX_LINE_BYTES:
            self._reply(client, {"ok": False, "kind": "refused", "error": "request line too long"})
            return b"", False
        return buffer, True

    @staticmethod
    def _reply(client: socket.socket, answer: dict[str, Any]) -> None:
        client.setblocking(True)
        try:
            client.sendall((json.dumps(answer) + "\n").encode())
        except OSError:
            pass
        finally:
            client.setblocking(False)

    def _disconnected(self, selector: selectors.BaseSelector, client: socket.socket) -> None:
        try:
            selector.unregister(client)
        except (KeyError, ValueError):
            pass
        client.close()
        count = self.restore()
        log.info("client gone: restored %d setting(s)", count)


def _restore_order(files: dict[str, str], rules: dict[str, WriteRule]) -> list[tuple[str, str]]:
    """The writes that put ``files`` back: minima to their floor, then maxima, then minima,
    then the rest (the EMC rate before its lock)."""
    minima = [path for path in files if path.endswith(("/min_freq", "/scaling_min_freq"))]
    maxima = [path for path in files if path.endswith(("/max_freq", "/scaling_max_freq"))]
    others = sorted((path for path in files if path not in minima and path not in maxima),
                    key=lambda path: path.endswith("mrq_rate_locked"))
    steps: list[tuple[str, str]] = []
    for path in minima:
        low = rules[path].low if path in rules else None
        if low is not None and files[path] != str(low):
            steps.append((path, str(low)))
    steps += [(path, files[path]) for path in maxima]
    steps += [(path, files[path]) for path in minima]
    steps += [(path, files[path]) for path in others]
    return steps


def listening_socket(path: Path | None, environ: dict[str, str] | None = None) -> socket.socket:
    """The socket systemd passed (``$LISTEN_FDS``, for this pid), else one bound at ``path``.

    Raises:
        PowerError: neither is there.
    """
    env = os.environ if environ is None else environ
    if env.get("LISTEN_FDS") and env.get("LISTEN_PID") == str(os.getpid()):
        if int(env["LISTEN_FDS"]) != 1:
            raise PowerError("the power helper takes exactly one socket from systemd",
                             found=env["LISTEN_FDS"])
        return socket.socket(fileno=SD_LISTEN_FDS_START)
    if path is None:
        raise PowerError("no socket: run it from edge-agent-power.socket, or give --socket")
    path = Path(path)
    if path.is_socket():
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    listener.bind(str(path))
    os.chmod(path, 0o660)
    listener.listen(4)
    return listener


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m power.helper",
                                     description="The edge agent's privileged power helper.")
    parser.add_argument("--user", required=True,
                        help="the daemon's user: the only one whose requests are served")
    parser.add_argument("--root", type=Path, default=Path("/"), help="the board's root")
    parser.add_argument("--socket", type=Path,
                        help="listen here (default: the socket systemd passes)")
    parser.add_argument("--idle-exit-s", type=float, default=None,
                        help="exit after this long with no client (socket activation restarts)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        uid = int(args.user) if args.user.isdigit() else pwd.getpwnam(args.user).pw_uid
    except KeyError:
        log.error("no such user: %s", args.user)
        return 2
    try:
        listener = listening_socket(args.socket)
        helper = PowerHelper(args.root, allowed_uid=uid)
    except AgentError as exc:
        log.error("%s", exc)
        return 1
    stop = threading.Event()

    def _stop(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("serving power writes for uid %d: %d file(s), nvpmodel modes %s", uid,
             len(helper.rules), sorted(helper.modes) or "none")
    helper.serve(listener, stop=stop, idle_exit_s=args.idle_exit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
