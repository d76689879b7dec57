"""The command line's end of the local control channel: one request over the daemon's Unix
socket, its progress events, then its result (the wire format is in agent/control/protocol.py).

Blocking and synchronous, as a command-line tool wants. Every way the channel can fail is a
:class:`~agent.errors.ControlError` that says what to do about it (start the daemon, point at its
state directory, run as its user); a command the daemon ran and refused is a
:class:`CommandError` carrying the daemon's message and reason.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.control import protocol
from agent.errors import AgentError, ControlError

__all__ = ["CommandError", "ControlClient", "OnEvent"]

OnEvent = Callable[[dict[str, Any]], None]
RECV_BYTES = 64 * 1024


class CommandError(AgentError):
    """The daemon ran a command and answered with an error: ``message`` is the daemon's own
    (already naming its facts), ``reason`` its stable code when it has one (an ``UpdateError``'s
    reason, ``unknown_command``...)."""

    def __init__(self, message: str, *, command: str, reason: str | None) -> None:
        super().__init__(message)
        self.command = command
        self.reason = reason


class ControlClient:
    """Talks to the daemon listening at ``socket_path`` (``<state_dir>/control.sock``). Cheap:
    each :meth:`call` opens its own connection.

    Args:
        socket_path: The daemon's control socket.
        connect_timeout_s: How long connecting may take (a daemon that is alive accepts at once).
    """

    def __init__(self, socket_path: Path, *, connect_timeout_s: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.connect_timeout_s = connect_timeout_s

    def call(self, command: str, args: dict[str, Any] | None = None, *,
             on_event: OnEvent | None = None, timeout_s: float | None = 30.0) -> Any:
        """Send ``command`` with ``args``, pass each progress event (the ``event`` object) to
        ``on_event`` as it arrives, and return the result.

        Args:
            timeout_s: The longest the whole call may take; None waits as long as the daemon
                works (its own deadlines end every update).

        Raises:
            ControlError: no daemon listens at the socket, permission is denied, the daemon
                closed the connection before answering, or no answer came within ``timeout_s``.
            CommandError: the daemon answered with an error.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_id = uuid.uuid4().hex
        request = protocol.encode_line({"id": request_id, "command": command,
                                        "args": args or {}})
        with self._connect() as sock:
            try:
                self._settimeout(sock, deadline, command, timeout_s)
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon hung up at once; it may have said why (a refused peer)
            except TimeoutError:
                raise self._timed_out(command, timeout_s) from None
            lines = _Lines(sock)
            while True:
                self._settimeout(sock, deadline, command, timeout_s)
                try:
                    line = lines.next()
                except TimeoutError:
                    raise self._timed_out(command, timeout_s) from None
                if line is None:
                    raise ControlError("the daemon closed the connection before answering: it "
                                       "may have stopped or crashed (see its log)",
                                       command=command, path=self.socket_path)
                try:
                    message = protocol.decode_line(line)
                except ControlError as exc:
                    raise ControlError("the daemon sent a malformed reply", command=command,
                                       reason=exc.message) from None
                if message.get("id") not in (request_id, None):
                    continue  # not ours: a late event of an earlier request
                if "event" in message:
                    if on_event is not None and isinstance(message["event"], dict):
                        on_event(message["event"])
                    continue
                return self._outcome(command, message)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        path = self.socket_path
        try:
            sock.connect(str(path))
        except OSError as exc:
            sock.close()
            raise self._connect_error(exc) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect_error(self, exc: OSError) -> ControlError:
        path = self.socket_path
        if isinstance(exc, FileNotFoundError):
            return ControlError("no daemon listens here: is 'edge-agent serve' running with this "
                                "state directory (--state-dir, --config), and serving yet (the "
                                "channel opens once the model serves)?", path=path)
        if isinstance(exc, ConnectionRefusedError):
            return ControlError("no daemon listens here (a daemon that stopped left the "
                                "socket): is 'edge-agent serve' running?", path=path)
        if isinstance(exc, PermissionError):
            return ControlError("permission denied on the daemon's control socket: run as the "
                                "daemon's user or root", path=path)
        if isinstance(exc, TimeoutError):
            return ControlError(f"the daemon did not accept a connection within "
                                f"{self.connect_timeout_s:g} s", path=path)
        return ControlError("cannot connect to the daemon", path=path,
                            reason=exc.strerror or str(exc))

    def _settimeout(self, sock: socket.socket, deadline: float | None, command: str,
                    timeout_s: float | None) -> None:
        if deadline is None:
            sock.settimeout(None)
            return
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise self._timed_out(command, timeout_s)
        sock.settimeout(remaining_s)

    def _timed_out(self, command: str, timeout_s: float | None) -> ControlError:
        return ControlError(f"no answer from the daemon within {timeout_s:g} s",
                            command=command, path=self.socket_path)

    def _outcome(self, command: str, message: dict[str, Any]) -> Any:
        ok = message.get("ok")
        if ok is True:
            return message.get("result")
        if ok is not False:
            raise ControlError("the daemon sent a reply that is neither a result nor an error",
                               command=command)
        error = message.get("error")
        reason = message.get("reason")
        text = error if isinstance(error, str) and error else "the daemon gave no reason"
        reason = reason if isinstance(reason, str) else None
        if reason == protocol.REASON_PERMISSION_DENIED:
            raise ControlError(f"{text}: run as the daemon's user or root", path=self.socket_path)
        raise CommandError(text, command=command, reason=reason)


class _Lines:
    """Lines from a blocking socket, each at most MAX_LINE_BYTES."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def next(self) -> bytes | None:
        """The next whole line; None at the end of the stream (a partial last line is
        dropped: the daemon always ends its lines)."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line, self._buffer = self._buffer[:end + 1], self._buffer[end + 1:]
                return line
            if len(self._buffer) > protocol.MAX_LINE_BYTES:
                raise ControlError(f"the daemon sent a line longer than "
                                   f"{protocol.MAX_LINE_BYTES} bytes")
            try:
                chunk = self._sock.recv(RECV_BYTES)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self._buffer += chunk
