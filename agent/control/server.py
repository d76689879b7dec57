"""The daemon's end of the local control channel: an asyncio Unix socket server at
``<state_dir>/control.sock`` that runs named command handlers (the wire format is in
agent/control/protocol.py).

Who may connect is checked twice, on purpose:

- The socket file is created with mode 0600 (owner only): on Linux, connecting to a Unix socket
  needs write permission on its file, so the kernel turns other users away before a byte reaches
  the daemon. The mode is set by the umask in force at ``bind()``, not by a ``chmod`` after it,
  which would leave a moment in which anyone could connect.
- Each connection's peer is then checked with ``SO_PEERCRED`` (the credentials the kernel recorded
  for the connecting process): only the daemon's own user and root are served. This holds even
  when the file's mode does not (an operator's ``chmod``, a file system that ignores modes, the
  socket reached through a bind mount or a descriptor handed on) and it names who was refused in
  the log.

The server never lets one client disturb the daemon or the others: malformed requests, unknown
commands and handler failures are error replies; a line longer than the bound, a client idle
before its request, or one that stops reading a stream of events is answered (where it can be) and
disconnected; a client that goes away mid-stream leaves its command running to its end (an
``update.apply`` goes on; the handler's events are then dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.control import protocol
from agent.errors import (
    AgentError,
    ControlError,
    InternalError,
    UpdateError,
    first_line,
    printable,
)

log = logging.getLogger(__name__)

__all__ = ["ControlServer", "Emit", "Handler"]

Emit = Callable[[dict[str, Any]], None]
# A handler gets the request's args and an emit function for progress events (callable from any
# thread), and returns the result, which must be JSON-able.
Handler = Callable[[dict[str, Any], Emit], Awaitable[Any]]

# The socket is created while this umask is in force: rw for the owner, nothing for the others.
# umask is per process, so for the instant of the bind() a file another thread creates gets at
# most the owner's permissions too: stricter than asked, never looser.
SOCKET_UMASK = 0o177
# How long the check of an existing socket file waits for an answer.
PROBE_TIMEOUT_S = 1.0
# A Unix socket's path has at most this many bytes on Linux (sun_path, less its NUL).
MAX_SOCKET_PATH_BYTES = 107


class ControlServer:
    """The control socket and its command handlers. Cheap to construct; :meth:`start` binds.

    Args:
        socket_path: Where the socket lives (``<state_dir>/control.sock``); the directory must
            exist.
        idle_timeout_s: How long a connection may wait before sending a (next) request.
        write_timeout_s: How long a reply may wait for the client to read it.
        max_clients: Connections served at once; one more is answered with an error and closed.
        max_line_bytes: The longest request line read.
        max_buffered_bytes: Events queued for a client that does not read them; past it the
            client is disconnected (its command goes on).
        allowed_uids: Who may connect; default the daemon's effective user and root.
    """

    def __init__(self, socket_path: Path, *, idle_timeout_s: float = 30.0,
                 write_timeout_s: float = 10.0, max_clients: int = 16,
                 max_line_bytes: int = protocol.MAX_LINE_BYTES,
                 max_buffered_bytes: int = 4 << 20,
                 allowed_uids: frozenset[int] | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_clients = max_clients
        self.max_line_bytes = max_line_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.allowed_uids = (allowed_uids if allowed_uids is not None
                             else frozenset({os.geteuid(), 0}))
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound
        self._connections: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._stopping = False

    # -- handlers -------------------------------------------------------------------------------

    def register(self, name: str, handler: Handler) -> None:
        """Serve ``name`` with ``handler``: ``await handler(args, emit)``. An
        :class:`~agent.errors.AgentError` it raises is an error reply with its message (and
        ``reason`` for an :class:`~agent.errors.UpdateError`); any other exception is logged
        with its traceback and answered as an internal error.

        Raises:
            InternalError: ``name`` is registered already (two parts claiming one command).
        """
        if name in self._handlers:
            raise InternalError(f"control command {name!r} is registered twice")
        self._handlers[name] = handler

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(sorted(self._handlers))

    @property
    def serving(self) -> bool:
        return self._server is not None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket (replacing one a crashed daemon left) and start accepting.

        Raises:
            ControlError: another process answers on the socket, the path is taken by something
                that is not a socket, or the socket cannot be created (the directory is
                missing, the path is too long for a Unix socket).
        """
        if self._server is not None:
            raise InternalError("ControlServer.start() twice")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stopping = False
        self._clear_stale_socket()
        sock = self._bind()
        try:
            self._server = await asyncio.start_unix_server(
                self._serve_client, sock=sock, limit=self.max_line_bytes)
        except BaseException:
            sock.close()
            self._remove_own_socket()
            raise
        log.info("control channel listening on %s", self.socket_path)

    async def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop accepting, end the commands still running (their clients are told the daemon is
        stopping) and remove the socket file. Safe to call when not started."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        connections = set(self._connections)
        for task in connections:
            task.cancel()
        if connections:
            _, pending = await asyncio.wait(connections, timeout=timeout_s)
            if pending:
                log.warning("%d control connection(s) did not end within %.1f s",
                            len(pending), timeout_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), timeout_s)
        self._remove_own_socket()

    async def __aenter__(self) -> ControlServer:  # noqa: PYI034 - typing.Self needs 3.11
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _clear_stale_socket(self) -> None:
        """Remove a socket file that nothing answers on (left by a daemon that was killed);
        refuse one that answers, and anything that is not a socket."""
        path = self.socket_path
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ControlError("cannot examine the control socket", path=path,
                               reason=exc.strerror) from None
        if not stat.S_ISSOCK(mode):
            raise ControlError("the control socket's path is taken by something else; "
                               "remove it if nothing needs it", path=path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(PROBE_TIMEOUT_S)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                pass  # stale: nobody listens
            except OSError as exc:  # a timeout (a listener that is wedged), no permission
                raise ControlError("cannot tell whether another daemon uses the control socket",
                                   path=path, reason=exc.strerror or type(exc).__name__) from None
            else:
                raise ControlError("another daemon answers on the control socket: stop it, or "
                                   "give this one another state directory", path=path)
        log.info("removing a stale control socket (left by a daemon that did not stop): %s",
                 path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _bind(self) -> socket.socket:
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ControlError(f"the control socket's path is longer than a Unix socket's "
                               f"{MAX_SOCKET_PATH_BYTES} bytes: use a shorter state directory",
                               path=self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            previous = os.umask(SOCKET_UMASK)
            try:
                sock.bind(str(self.socket_path))
            finally:
                os.umask(previous)
            info = os.stat(self.socket_path)
            self._socket_id = (info.st_dev, info.st_ino)
        except OSError as exc:
            sock.close()
            reason = exc.strerror or str(exc)
            if exc.errno == errno.ENOENT:
                reason = "its directory does not exist"
            raise ControlError("cannot create the control socket", path=self.socket_path,
                               reason=reason) from None
        return sock

    def _remove_own_socket(self) -> None:
        """Remove the socket file if it is still the one this server bound (not one a newer
        daemon made since)."""
        own, self._socket_id = self._socket_id, None
        if own is None:
            return
        try:
            info = os.stat(self.socket_path)
            if (info.st_dev, info.st_ino) == own:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the control socket %s: %s", self.socket_path, exc)

    # -- one connection -------------------------------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        busy = len(self._connections) >= self.max_clients
        if task is not None:  # always, as asyncio runs this callback in a task
            self._connections.add(task)
        try:
            refusal = self._refusal(writer)
            if refusal is not None:
                await self._write(writer, _error_reply(None, refusal,
                                                       protocol.REASON_PERMISSION_DENIED))
                return
            if busy:
                await self._write(writer, _error_reply(
                    None, f"the daemon serves {self.max_clients} control clients already; "
                    "try again", protocol.REASON_BUSY))
                return
            while not self._stopping:
                line = await self._read_request(reader, writer)
                if line is None or not await self._answer(line, writer):
                    return
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the daemon
            log.exception("control connection failed")
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()  # flushes what is buffered (a last error reply), then closes

    def _refusal(self, writer: asyncio.StreamWriter) -> str | None:
        """Why this peer may not use the channel, or None when it may."""
        peer = writer.get_extra_info("socket")
        if peer is None or not hasattr(socket, "SO_PEERCRED"):
            return None  # not Linux: the socket file's mode is the only check
        credentials = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                      struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", credentials)
        if uid in self.allowed_uids:
            return None
        log.warning("control channel: refused a client of uid %d (pid %d); only uids %s may "
                    "use %s", uid, pid, sorted(self.allowed_uids), self.socket_path)
        return (f"permission denied: the control channel serves only the daemon's user "
                f"and root, not uid {uid}")

    async def _read_request(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> bytes | None:
        """The next request line; None when the connection should end (the client closed it,
        went idle or sent a line too long: those two are told why)."""
        try:
            line = await asyncio.wait_for(reader.readline(), self.idle_timeout_s)
        except asyncio.TimeoutError:
            await self._write(writer, _error_reply(
                None, f"no request within {self.idle_timeout_s:g} s", protocol.REASON_IDLE))
            return None
        except ValueError:  # StreamReader's limit: a line longer than max_line_bytes
            await self._write(writer, _error_reply(
                None, f"a request line is longer than {self.max_line_bytes} bytes",
                protocol.REASON_LINE_TOO_LONG))
            return None
        except ConnectionError:
            return None
        if not line.endswith(b"\n"):
            return None  # the client closed the connection (mid-line or between requests)
        return line

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter) -> bool:
        """Run one request and send its final reply; False when the connection should end."""
        try:
            request_id, command, args = self._parse(line)
        except _BadRequest as exc:
            return await self._write(writer, _error_reply(exc.request_id, exc.message,
                                                          exc.reason))
        handler = self._handlers[command]
        emitter = _Emitter(writer, request_id, command, loop=self._loop,
                           loop_thread=self._loop_thread,
                           max_buffered_bytes=self.max_buffered_bytes)
        try:
            result = await handler(args, emitter)
            data = protocol.encode_line({"id": request_id, "ok": True, "result": result})
            if len(data) > protocol.MAX_LINE_BYTES:
                raise ValueError(f"the result is {len(data)} bytes, more than a line may hold")
        except asyncio.CancelledError:
            if self._stopping:
                await self._write(writer, _error_reply(
                    request_id, f"the daemon stopped while {command} ran",
                    protocol.REASON_STOPPING), drain=False)
            raise
        except UpdateError as exc:
            data = _error_reply(request_id, str(exc), exc.reason)
        except AgentError as exc:
            data = _error_reply(request_id, str(exc), None)
        except Exception as exc:  # noqa: BLE001 - a handler's bug is answered, not fatal
            log.exception("control command %s failed", command)
            data = _error_reply(request_id, f"internal error in {command}: {first_line(exc)} "
                                "(the daemon's log has the details)", protocol.REASON_INTERNAL)
        finally:
            emitter.done = True
        return await self._write(writer, data)

    def _parse(self, line: bytes) -> tuple[str, str, dict[str, Any]]:
        """A request's id, command and args.

        Raises:
            _BadRequest: what to answer instead.
        """
        bad = protocol.REASON_BAD_REQUEST
        try:
            message = protocol.decode_line(line)
        except ControlError as exc:
            raise _BadRequest(str(exc), bad) from None
        request_id = message.get("id")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= protocol.MAX_ID_CHARS:
            raise _BadRequest(f"a request's 'id' must be a string of 1 to "
                              f"{protocol.MAX_ID_CHARS} characters", bad)
        command = message.get("command")
        if not isinstance(command, str):
            raise _BadRequest("a request's 'command' must be a string", bad, request_id)
        if command not in self._handlers:
            raise _BadRequest(f"unknown command '{printable(command, 100)}'; this daemon knows "
                              + ", ".join(self.commands), protocol.REASON_UNKNOWN_COMMAND,
                              request_id)
        args = message.get("args", {})
        if not isinstance(args, dict):
            raise _BadRequest(f"{command}: 'args' must be a JSON object, not "
                              f"{type(args).__name__}", bad, request_id)
        return request_id, command, args

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, *,
                     drain: bool = True) -> bool:
        """Send ``data``; False when the client is gone or does not read within the limit."""
        if writer.is_closing():
            return False
        writer.write(data)
        if not drain:
            return True
        try:
            await asyncio.wait_for(writer.drain(), self.write_timeout_s)
        except asyncio.TimeoutError:
            log.warning("control client did not read a reply within %.1f s; disconnecting",
                        self.write_timeout_s)
            writer.transport.abort()
            return False
        except ConnectionError:
            return False
        return True


class _Emitter:
    """A handler's ``emit``: sends one event line to its client, from the loop or any thread.
    Events for a client that has gone, or after the final reply, are dropped."""

    def __init__(self, writer: asyncio.StreamWriter, request_id: str, command: str, *,
                 loop: asyncio.AbstractEventLoop | None, loop_thread: int | None,
                 max_buffered_bytes: int) -> None:
        self._writer = writer
        self._request_id = request_id
        self._command = command
        self._loop = loop
        self._loop_thread = loop_thread
        self._max_buffered_bytes = max_buffered_bytes
        self.done = False

    def __call__(self, event: dict[str, Any]) -> None:
        if threading.get_ident() == self._loop_thread:
            self._send(event)
        elif self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._send, event)

    def _send(self, event: dict[str, Any]) -> None:
        writer = self._writer
        if self.done or writer.is_closing():
            return
        try:
            data = protocol.encode_line({"id": self._request_id, "event": event})
        except (TypeError, ValueError) as exc:
            log.error("control command %s emitted an event JSON cannot hold (%s): dropped",
                      self._command, exc)
            return
        if len(data) > protocol.MAX_LINE_BYTES:
            log.error("control command %s emitted an event of %d bytes: dropped",
                      self._command, len(data))
            return
        if writer.transport.get_write_buffer_size() + len(data) > self._max_buffered_bytes:
            # The client does not read: disconnect it rather than buffer without bound. The
            # command itself goes on.
            log.warning("control client of %s does not read its events; disconnecting",
                        self._command)
            writer.transport.abort()
            return
        writer.write(data)


class _BadRequest(Exception):
    """A request the server answers with an error without running a handler."""

    def __init__(self, message: str, reason: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.request_id = request_id


def _error_reply(request_id: str | None, message: str, reason: str | None) -> bytes:
    return protocol.encode_line({"id": request_id, "ok": False, "error": message,
                                 "reason": reason})
