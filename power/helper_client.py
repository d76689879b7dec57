"""The daemon's side of the privileged power helper (power/helper.py): a
:class:`~power.io.Writer` that sends each write over the helper's Unix socket, and a
:class:`~power.commands.CommandRunner` that sends ``nvpmodel -m N`` the same way.

Under the service the board is opened as ``Board.open(root, **board_access(root))``: through
the helper when the daemon is not root and the helper's socket is there, else (a root daemon,
a development machine, a fake tree) with the board layer's own writer and runner.

The connection is the lease: the helper keeps what the board had before the first change and
puts it back when this connection closes, so the writer holds one connection for as long as
the daemon runs and closes it on stop (or the kernel closes it when the daemon dies). A helper
that restarted meanwhile (its connection broke) has restored the board; the writer connects
again once and resends, and the governor's next step re-applies the rest.

Errors are the writer protocol's: :class:`~agent.errors.PowerError` for a request the helper
refuses (with its reason), :class:`OSError` with the kernel's errno for a write the kernel
refused, and :class:`OSError` for a helper that cannot be reached.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

from collections.abc import Sequence
from pathlib import Path as _Path

from agent.errors import PowerError
from power.commands import CommandResult, CommandRunner, SubprocessRunner
from power.io import check_relpath, check_value

__all__ = ["DEFAULT_SOCKET", "HelperRunner", "HelperWriter", "board_access"]

DEFAULT_SOCKET = Path("/run/edge-agent-power.sock")
MAX_ANSWER_BYTES = 1 << 20


class HelperWriter:
    """Writes through the helper at ``socket_path``; also sets nvpmodel modes.

    Args:
        socket_path: The helper's socket (edge-agent-power.socket's ListenStream=).
        timeout_s: How long one request may take, connect included.
    """

    def __init__(self, socket_path: Path = DEFAULT_SOCKET, *, timeout_s: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s
        self._socket: socket.socket | None = None
        self._reader: Any = None
        self._lock = threading.Lock()

    def write(self, relpath: str, value: str) -> None:
        check_relpath(relpath)
        check_value(value)
        self._call({"op": "write", "path": relpath, "value": value})

    def nvpmodel(self, mode_id: int) -> None:
        """Set nvpmodel's mode (one of the board profile's)."""
        self._call({"op": "nvpmodel", "mode": int(mode_id)})

    def hello(self) -> dict[str, Any]:
        """What the helper serves: the board, the files it may write, the nvpmodel modes."""
        return self._call({"op": "hello"})

    def restore(self) -> int:
        """Ask the helper to put the board back now; returns how many settings it restored."""
        return int(self._call({"op": "restore"}).get("restored", 0))

    def close(self) -> None:
        """Close the connection: the helper restores the board."""
        with self._lock:
            self._drop()

    def __enter__(self) -> HelperWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> None:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        connection.settimeout(self.timeout_s)
        try:
            connection.connect(str(self.socket_path))
        except OSError:
            connection.close()
            raise
        self._socket = connection
        self._reader = connection.makefile("rb")

    def _drop(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._socket is not None:
            self._socket.close()
        self._socket = self._reader = None

    def _exchange(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._socket is None:
            self._connect()
        assert self._socket is not None and self._reader is not None  # set by _connect
        self._socket.sendall((json.dumps(request) + "\n").encode())
        line = self._reader.readline(MAX_ANSWER_BYTES)
        if not line:
            raise ConnectionResetError(errno.ECONNRESET, "the power helper closed the connection")
        answer = json.loads(line)
        if not isinstance(answer, dict) or "ok" not in answer:
            raise PowerError("the power helper's answer is not one of its replies",
                             answer=line[:200])
        return answer

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                answer = self._exchange(request)
            except (BrokenPipeError, ConnectionResetError):
                # The helper restarted (and restored the board): once more on a new connection.
                self._drop()
                try:
                    answer = self._exchange(request)
                except OSError:
                    self._drop()
                    raise
            except OSError:
                self._drop()
                raise
        if answer["ok"]:
            return answer
        if answer.get("kind") == "os":
            raise OSError(int(answer.get("errno", errno.EIO)), str(answer.get("error")))
        fields = answer.get("fields") or {}
        raise PowerError(f"the power helper refused: {answer.get('error')}",
                         **{str(key): value for key, value in fields.items()})


class HelperRunner:
    """A :class:`~power.commands.CommandRunner` for an unprivileged daemon: ``nvpmodel -m N``
    goes to the helper (which checks N against the board's profile and runs it as root);
    nvpmodel's queries (``-q``, ``-p``), which need no privilege, run here through
    ``fallback``; anything else (``jetson_clocks``, which changes clocks behind the board
    layer's back) is refused, as a failed command, without running.
    """

    def __init__(self, writer: HelperWriter, *, fallback: CommandRunner | None = None) -> None:
        self.writer = writer
        self.fallback: CommandRunner = fallback or SubprocessRunner()

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0) -> CommandResult:
        args = tuple(argv)
        tool = _Path(args[0]).name if args else ""
        options = [option for option in args[1:] if option != "--verbose"]
        if tool == "nvpmodel" and len(options) == 2 and options[0] in ("-m", "--mode"):
            try:
                self.writer.nvpmodel(int(options[1]))
            except ValueError:
                return CommandResult(argv=args, returncode=1,
                                     stderr=f"NVPM ERROR: Invalid power mode ID {options[1]}\n")
            except (PowerError, OSError) as exc:
                return CommandResult(argv=args, returncode=1, stderr=f"{exc}\n")
            return CommandResult(argv=args, returncode=0)
        if tool == "nvpmodel" and options in (["-q"], ["--query"], ["-p"], ["--parse"]):
            return self.fallback.run(args, timeout_s=timeout_s)
        return CommandResult(argv=args, returncode=1, stderr=(
            f"{tool or '(empty)'}: not run by an unprivileged daemon (only nvpmodel -m goes "
            "through the power helper)\n"))


def board_access(root: Path | str = "/", *, socket_path: Path = DEFAULT_SOCKET,
                 euid: int | None = None) -> dict[str, Any]:
    """The ``writer`` and ``runner`` keyword arguments for :meth:`power.board.Board.open`: the
    helper's when this process is not root, the board is the real one (``root`` is ``/``) and
    the helper's socket exists; none (the board layer's defaults) otherwise."""
    uid = os.geteuid() if euid is None else euid
    if uid == 0 or Path(root) != Path("/") or not Path(socket_path).is_socket():
        return {}
    writer = HelperWriter(socket_path)
    return {"writer": writer, "runner": HelperRunner(writer)}
