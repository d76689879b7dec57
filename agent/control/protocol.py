"""The control channel's wire format and the shapes of its commands, in one place: the server, the
client, the daemon's handlers and ``edge-agent update`` all read them from here.

The socket is ``<state_dir>/control.sock`` (:data:`SOCKET_NAME`). Messages are JSON objects, one
per line (UTF-8, ``\\n``-terminated, at most :data:`MAX_LINE_BYTES` each).

A request::

    {"id": "4f1c...", "command": "update.status", "args": {}}

``id`` is the client's choice (a short string) and comes back on every line that answers it;
``args`` is optional (an object). The daemon answers with zero or more progress lines, then
exactly one final line::

    {"id": "4f1c...", "event": {"kind": "state", "state": "verifying", ...}}
    {"id": "4f1c...", "ok": true, "result": ...}
    {"id": "4f1c...", "ok": false, "error": "the bundle's signature ...", "reason": "bad_signature"}

``reason`` is a short stable code: an :class:`~agent.errors.UpdateError`'s own, or one of the
channel's (:data:`REASON_BAD_REQUEST` and its siblings below); it is null for other errors. An error
the daemon sends before it has read a request (a refused peer, a line too long) has ``"id": null``
and is followed by the daemon closing the connection.

The commands (:data:`COMMANDS`) and what they carry:

``daemon.status``
    args ``{}``; result: ``Daemon.status()`` (state, models served, background tasks, failure).
``update.apply``
    args :class:`ApplyArgs` (``{"source": URL, "wait": bool}``). With ``wait``, events
    (:class:`StateEvent`, :class:`ProgressEvent`) stream while the update runs and the result is
    the :class:`UpdateStatus` it ended in (``state`` is ``committed`` when it succeeded). Without,
    the result is the status as soon as the update is accepted. A request the updater refuses
    outright (a source it cannot use, a bundle that already failed its attempts budget) is an
    error reply with the ``UpdateError``'s reason.
``update.status``
    args ``{}``; result :class:`UpdateStatus`.
``update.rollback``
    args ``{}``; events as for ``update.apply``; result the :class:`UpdateStatus` after the
    rollback (an error reply when there is no previous version to return to).

A client leaving does not cancel what it asked for: an ``update.apply`` whose ``edge-agent update
apply`` is interrupted goes on in the daemon.

Readers accept keys they do not know and event kinds they do not know (they skip them), so the
daemon can say more without breaking an older command-line tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from agent.errors import ControlError

__all__ = [
    "COMMANDS",
    "COMMITTED",
    "DAEMON_STATUS",
    "MAX_LINE_BYTES",
    "SOCKET_NAME",
    "UPDATE_APPLY",
    "UPDATE_ROLLBACK",
    "UPDATE_STATES",
    "UPDATE_STATUS",
    "URL_SCHEMES",
    "ApplyArgs",
    "ModelVersion",
    "ProgressEvent",
    "StateEvent",
    "UpdateFailure",
    "UpdateStatus",
    "UpdateTarget",
    "decode_line",
    "encode_line",
    "parse_event",
]

SOCKET_NAME = "control.sock"
# Requests and replies are small (a status, a URL); the bound keeps a client that never sends a
# newline from making the daemon buffer without end.
MAX_LINE_BYTES = 1 << 20
MAX_ID_CHARS = 200

DAEMON_STATUS = "daemon.status"
UPDATE_APPLY = "update.apply"
UPDATE_STATUS = "update.status"
UPDATE_ROLLBACK = "update.rollback"
COMMANDS = (DAEMON_STATUS, UPDATE_APPLY, UPDATE_STATUS, UPDATE_ROLLBACK)

# The updater's states (design section 6), as they travel; the enum lives with the updater.
UPDATE_STATES = ("idle", "downloading", "verifying", "staged", "building-engine", "warming",
                 "canary", "committed", "rolling-back", "failed")
COMMITTED = "committed"

# The channel's own reasons for an error reply.
REASON_BAD_REQUEST = "bad_request"  # not JSON, not an object, a field of the wrong type
REASON_UNKNOWN_COMMAND = "unknown_command"
REASON_LINE_TOO_LONG = "line_too_long"
REASON_PERMISSION_DENIED = "permission_denied"  # the peer is neither the daemon's user nor root
REASON_IDLE = "idle_timeout"  # no request within the server's idle limit
REASON_BUSY = "too_many_clients"
REASON_STOPPING = "stopping"  # the daemon stopped while the command ran
REASON_INTERNAL = "internal"  # a bug in a handler (logged by the daemon with its traceback)

URL_SCHEMES = ("http", "https", "file")


def encode_line(message: dict[str, Any]) -> bytes:
    """One message as a line; raises ``TypeError``/``ValueError`` for what JSON cannot hold (NaN
    included: the reader on the other side may not accept it)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def decode_line(line: bytes) -> dict[str, Any]:
    """The JSON object on one line.

    Raises:
        ControlError: the line is not UTF-8 JSON, or not an object.
    """
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ControlError("a control message is not JSON", reason=str(exc)) from None
    if not isinstance(message, dict):
        raise ControlError("a control message is not a JSON object",
                           found=type(message).__name__)
    return message


# -- the shapes of the update commands --------------------------------------------------------


def _field(obj: dict[str, Any], name: str, kinds: type | tuple[type, ...], *,
           optional: bool = False, where: str) -> Any:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = obj.get(name)
    if value is None and optional:
        return None
    # bool is an int in Python, but a version or a byte count of true is a mistake.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(kind.__name__ for kind in kinds) + (" or null" if optional else "")
        raise ControlError(f"{where}: '{name}' must be {expected}", found=repr(value)[:100])
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ControlError(f"{where} must be a JSON object", found=type(value).__name__)
    return value


@dataclass(frozen=True, kw_only=True)
class ApplyArgs:
    """``update.apply``'s arguments: the bundle's ``source`` (an ``http``, ``https`` or ``file``
    URL: the command line turns a local path into an absolute ``file://`` URL) and whether to
    ``wait`` for the update to end, streaming its progress."""

    source: str
    wait: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "wait": self.wait}

    @classmethod
    def from_json(cls, args: Any) -> ApplyArgs:
        """Raises ControlError: a missing or mistyped field, or a source that is no URL of a
        scheme the updater fetches."""
        args = _object(args, "update.apply's args")
        source = _field(args, "source", str, where="update.apply")
        scheme, sep, rest = source.partition("://")
        if not sep or scheme.lower() not in URL_SCHEMES or not rest:
            raise ControlError("update.apply: 'source' must be an http, https or file URL",
                               found=source[:200])
        wait = args.get("wait", True)
        if not isinstance(wait, bool):
            raise ControlError("update.apply: 'wait' must be true or false", found=repr(wait))
        return cls(source=source, wait=wait)


@dataclass(frozen=True, kw_only=True)
class ModelVersion:
    """A model version by name."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}

    @classmethod
    def from_json(cls, obj: Any, where: str = "a model") -> ModelVersion:
        obj = _object(obj, where)
        return cls(name=_field(obj, "name", str, where=where),
                   version=_field(obj, "version", int, where=where))


@dataclass(frozen=True, kw_only=True)
class UpdateTarget:
    """What an update installs: its source, and the name and version once the manifest has been
    read (null before)."""

    source: str
    name: str | None = None
    version: int | None = None

    def __str__(self) -> str:
        if self.name is None:
            return self.source
        version = f" v{self.version}" if self.version is not None else ""
        return f"{self.name}{version} from {self.source}"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "name": self.name, "version": self.version}

    @classmethod
    def from_json(cls, obj: Any) -> UpdateTarget:
        where = "an update's target"
        obj = _object(obj, where)
        return cls(source=_field(obj, "source", str, where=where),
                   name=_field(obj, "name", str, optional=True, where=where),
                   version=_field(obj, "version", int, optional=True, where=where))


@dataclass(frozen=True, kw_only=True)
class UpdateFailure:
    """Why the last update failed or was refused: the ``UpdateError``'s reason and message."""

    reason: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_json(cls, obj: Any) -> UpdateFailure:
        where = "an update's error"
        obj = _object(obj, where)
        return cls(reason=_field(obj, "reason", str, where=where),
                   message=_field(obj, "message", str, where=where))


@dataclass(frozen=True, kw_only=True)
class UpdateStatus:
    """Where the updater stands (``update.status``'s result, and ``update.apply``'s).

    Attributes:
        state: One of :data:`UPDATE_STATES`.
        serving: The version the daemon serves now.
        target: The update in progress or the last one (None when there has been none).
        attempts: Attempts made at ``target`` so far.
        since_unix_s: When ``state`` was entered (seconds since the epoch).
        done_bytes, total_bytes: The download's progress (total None when the server did not
            say); None outside a download.
        error: Why the last update failed (None after a success).
    """

    state: str
    serving: ModelVersion | None = None
    target: UpdateTarget | None = None
    attempts: int = 0
    since_unix_s: float | None = None
    done_bytes: int | None = None
    total_bytes: int | None = None
    error: UpdateFailure | None = None

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "serving": self.serving.to_json() if self.serving else None,
            "target": self.target.to_json() if self.target else None,
            "attempts": self.attempts,
            "since_unix_s": self.since_unix_s,
            "done_bytes": self.done_bytes,
            "total_bytes": self.total_bytes,
            "error": self.error.to_json() if self.error else None,
        }

    @classmethod
    def from_json(cls, obj: Any) -> UpdateStatus:
        """Raises ControlError: a missing or mistyped field (unknown keys are ignored)."""
        where = "an update status"
        obj = _object(obj, where)
        serving, target, error = obj.get("serving"), obj.get("target"), obj.get("error")
        since = _field(obj, "since_unix_s", (int, float), optional=True, where=where)
        return cls(
            state=_field(obj, "state", str, where=where),
            serving=ModelVersion.from_json(serving, "the version served")
            if serving is not None else None,
            target=UpdateTarget.from_json(target) if target is not None else None,
            attempts=_field(obj, "attempts", int, optional=True, where=where) or 0,
            since_unix_s=float(since) if since is not None else None,
            done_bytes=_field(obj, "done_bytes", int, optional=True, where=where),
            total_bytes=_field(obj, "total_bytes", int, optional=True, where=where),
            error=UpdateFailure.from_json(error) if error is not None else None,
        )


@dataclass(frozen=True, kw_only=True)
class StateEvent:
    """The updater entered ``state`` (from ``previous``); ``message`` says more where there is
    more to say (the reason of a rollback)."""

    state: str
    previous: str | None = None
    message: str | None = None

    KIND: ClassVar[str] = "state"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "state": self.state, "previous": self.previous,
                "message": self.message}


@dataclass(frozen=True, kw_only=True)
class ProgressEvent:
    """A download's progress: ``done_bytes`` of ``total_bytes`` (None when unknown)."""

    done_bytes: int
    total_bytes: int | None = None

    KIND: ClassVar[str] = "progress"

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return min(1.0, self.done_bytes / self.total_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "done_bytes": self.done_bytes,
                "total_bytes": self.total_bytes}


def parse_event(obj: Any) -> StateEvent | ProgressEvent | None:
    """An event line's ``event``; None for a kind this version does not know.

    Raises:
        ControlError: a known kind with a missing or mistyped field.
    """
    obj = _object(obj, "an event")
    kind = obj.get("kind")
    if kind == StateEvent.KIND:
        where = "a state event"
        return StateEvent(state=_field(obj, "state", str, where=where),
                          previous=_field(obj, "previous", str, optional=True, where=where),
                          message=_field(obj, "message", str, optional=True, where=where))
    if kind == ProgressEvent.KIND:
        where = "a progress event"
        return ProgressEvent(done_bytes=_field(obj, "done_bytes", int, where=where),
                             total_bytes=_field(obj, "total_bytes", int, optional=True,
                                                where=where))
    return None
