"""The fleet's documents (design §5.3): what travels on each topic, parsed strictly.

Every document is a UTF-8 JSON object with ``"kind"`` and ``"schema_version": 1``; the kinds are
``desired``, ``cmd``, ``resp``, ``reported``, ``event`` and ``online``, one dataclass each below,
and each has a JSON Schema (2020-12) in ``agent/fleet/schemas/<kind>.schema.json`` so other tools
can produce and check them (:func:`schema_path`). Parsing refuses more than the schemas do
(impossible dates, an expiry before the issue time, duplicate keys), never less.

Documents that change what a device runs (``desired``, and every ``cmd`` but ``status``) travel
in a signed envelope::

    {"payload": "<the document as JSON text>",
     "signature": {"algorithm": "ed25519", "key_id": "<16 hex>", "signature": "<base64>"}}

The signature is Ed25519 over the UTF-8 bytes of ``payload`` exactly, so nothing is
canonicalised: the device verifies the bytes it got and then parses them. Key ids are
models/signing.py's (the first 16 hex digits of sha256 over the raw public key); the device trusts
``[fleet] public_keys``, which are not the bundle keys.

Parsing is bounded: a message over :data:`MAX_MESSAGE_BYTES` (a document's text over
:data:`MAX_DOCUMENT_BYTES`) is refused before any JSON is read; JSON with duplicate keys, NaN or
Infinity, or nesting deep enough to exhaust the parser is refused; every error is a
:class:`~agent.errors.DocumentError` whose ``reason`` is a short code and whose ``field`` names
the offending field as a dotted path.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import DocumentError, SignatureError, printable
from agent.fleet.topics import check_id, check_request_id
from agent.update.states import UpdateState
from models.signing import SIGNATURE_ALGORITHM, compute_key_id, signature_from_json

__all__ = [
    "COMMANDS",
    "DESIRED_STATUSES",
    "KINDS",
    "MAX_DOCUMENT_BYTES",
    "MAX_MESSAGE_BYTES",
    "SCHEMA_VERSION",
    "SIGNED_COMMANDS",
    "Applied",
    "Command",
    "Desired",
    "DesiredStatus",
    "Document",
    "ErrorInfo",
    "Event",
    "ModelSpec",
    "Online",
    "Received",
    "Reported",
    "Response",
    "UpdaterStatus",
    "decode",
    "encode",
    "format_time",
    "open_envelope",
    "parse_time",
    "read_message",
    "schema_path",
    "sign",
]

SCHEMA_VERSION = 1
# A desired document with a model is about 500 bytes; a reported one a few kB.
MAX_DOCUMENT_BYTES = 64 * 1024
# The envelope escapes its payload (a quote takes two bytes), so it may be up to twice as large.
MAX_MESSAGE_BYTES = 2 * MAX_DOCUMENT_BYTES + 4096
MAX_INT = 2**63 - 1  # versions and sequences, as the bundle manifest bounds its version
MAX_NAME_CHARS = 100  # as models/manifest.py bounds a model name
MAX_URL_CHARS = 2048
MAX_TEXT_CHARS = 2000  # free text: an error's message, an agent version
# power.wake boosts a sleeping board until the governor sees the requests it was woken for: it
# changes no model or setting, so it may come unsigned, as status.
COMMANDS = ("status", "rollback", "reload", "update", "power.wake")
SIGNED_COMMANDS = frozenset({"rollback", "reload", "update"})  # those that change what runs
DESIRED_STATUSES = ("converged", "applying", "failed", "refused")
# A signed command names when it expires; the device keeps its answer until then, so that a
# replay inside the window is answered again rather than run again. Bounded, so that cache is.
MAX_COMMAND_LIFETIME = datetime.timedelta(days=1)

_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_URL = re.compile(r"(https?|file)://[!-~]+")  # printable ASCII: anything else is %-encoded
_CODE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*")  # an event type, an error reason
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")
_TIME_RULE = "an ISO-8601 UTC time like 2024-05-01T12:00:00.000Z"

D = TypeVar("D", bound="Document")


# -- times ------------------------------------------------------------------------------------

def parse_time(value: object, field_name: str) -> datetime.datetime:
    """An ISO-8601 UTC time (``2024-05-01T12:00:00Z``, optional fraction of up to 6 digits,
    always ``Z``) as an aware datetime.

    Raises:
        DocumentError: (``bad_field``) any other form, or a date that does not exist.
    """
    if not isinstance(value, str) or _TIME.fullmatch(value) is None:
        raise _bad(field_name, _TIME_RULE, value)
    try:
        parsed = datetime.datetime.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise _bad(field_name, _TIME_RULE + " (a date that exists)", value) from None
    fraction = value[20:-1] if len(value) > 20 else ""
    micros = int(fraction.ljust(6, "0")) if fraction else 0
    return parsed.replace(microsecond=micros, tzinfo=datetime.timezone.utc)


def format_time(moment: datetime.datetime) -> str:
    """``moment`` in UTC as the documents write it: milliseconds, or microseconds when the
    time has them (so that parsing and formatting give the time back)."""
    utc = moment.astimezone(datetime.timezone.utc)
    text = utc.strftime("%Y-%m-%dT%H:%M:%S")
    if utc.microsecond % 1000:
        return f"{text}.{utc.microsecond:06d}Z"
    return f"{text}.{utc.microsecond // 1000:03d}Z"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# -- strict JSON --------------------------------------------------------------------------------

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            # Two parsers may keep different ones of two equal keys: a signed document must
            # mean one thing to every reader.
            raise DocumentError("the JSON has a duplicate key", reason="not_json",
                                field=printable(key, 100))
        result[key] = value
    return result


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DocumentError("the JSON has a number out of range", reason="not_json",
                            found=printable(text, 40))
    return value


def _no_constant(text: str) -> Any:
    raise DocumentError("the JSON has NaN or Infinity, which JSON does not allow",
                        reason="not_json", found=text)


def load_json(data: bytes, *, limit: int, what: str) -> Any:
    """Parse UTF-8 JSON of at most ``limit`` bytes, strictly (see the module's docstring).

    Raises:
        DocumentError: ``too_large``, ``not_utf8`` or ``not_json``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DocumentError(f"the {what} is not bytes", reason="not_json",
                            found=type(data).__name__)
    if len(data) > limit:
        raise DocumentError(f"the {what} is too large", reason="too_large",
                            expected=f"at most {limit} bytes", found=f"{len(data)} bytes")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"the {what} is not UTF-8", reason="not_utf8",
                            found=f"byte {exc.start}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except RecursionError:
        raise DocumentError(f"the {what} is nested too deeply", reason="not_json") from None
    except ValueError as exc:  # JSONDecodeError, and int() of a number with too many digits
        raise DocumentError(f"the {what} is not JSON", reason="not_json",
                            found=printable(str(exc), 200)) from None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# -- field checks ------------------------------------------------------------------------------


def _request_id(fields: _Fields) -> str:
    """A document's ``request_id``, checked as topics.check_request_id does."""
    request_id = fields.raw("request_id")
    try:
        check_request_id(request_id)
    except DocumentError:
        raise _bad("request_id", "1-64 characters of [A-Za-z0-9_.:-]", request_id) from None
    return request_id  # type: ignore[no-any-return]

def _bad(field_name: str, expected: str, found: object) -> DocumentError:
    return DocumentError(f"invalid value for '{field_name}'", reason="bad_field",
                         field=field_name, expected=expected, found=_show(found))


def _show(value: object) -> str:
    if isinstance(value, (dict, list)):
        text = _dumps(value)
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif value is None or isinstance(value, bool):
        text = json.dumps(value)
    else:
        text = repr(value)
    return printable(text, 120)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


class _Fields:
    """One JSON object's fields, taken one by one with their checks: every key must be known,
    every required key present, and an error names the field by its dotted path."""

    def __init__(self, value: object, where: str, *, required: Iterable[str],
                 optional: Iterable[str] = ()) -> None:
        if not isinstance(value, dict):
            raise _bad(where or "document", "a JSON object", value)
        self.obj: dict[str, Any] = value
        self.where = where
        required = tuple(required)
        known = {*required, *optional}
        for key in value:
            if key not in known:
                raise DocumentError(f"unknown field '{_join(where, printable(key, 100))}'",
                                    reason="bad_field", field=_join(where, printable(key, 100)),
                                    expected="one of " + ", ".join(sorted(known)))
        for key in required:
            if key not in value:
                raise DocumentError(f"missing field '{_join(where, key)}'", reason="bad_field",
                                    field=_join(where, key))

    def path(self, name: str) -> str:
        return _join(self.where, name)

    def has(self, name: str) -> bool:
        return name in self.obj

    def raw(self, name: str) -> Any:
        return self.obj.get(name)

    def text(self, name: str, *, pattern: re.Pattern[str] | None = None, rule: str = "",
             max_chars: int = MAX_TEXT_CHARS, nullable: bool = False) -> Any:
        value = self.obj.get(name)
        if value is None and nullable:
            return None
        expected = rule or f"a string of at most {max_chars} characters"
        if (not isinstance(value, str) or len(value) > max_chars
                or (pattern is not None and pattern.fullmatch(value) is None)):
            raise _bad(self.path(name), expected + (" or null" if nullable else ""), value)
        return value

    def integer(self, name: str, *, minimum: int, maximum: int = MAX_INT) -> int:
        value = self.obj.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                minimum <= value <= maximum):
            raise _bad(self.path(name), f"an integer from {minimum} to {maximum}", value)
        return value

    def boolean(self, name: str) -> bool:
        value = self.obj.get(name)
        if not isinstance(value, bool):
            raise _bad(self.path(name), "true or false", value)
        return value

    def object(self, name: str, *, nullable: bool = False) -> Any:
        value = self.obj.get(name)
        if value is None and nullable:
            return None
        if not isinstance(value, dict):
            raise _bad(self.path(name), "a JSON object" + (" or null" if nullable else ""),
                       value)
        return value

    def time(self, name: str) -> datetime.datetime:
        return parse_time(self.obj.get(name), self.path(name))

    def fleet_and_device(self) -> tuple[str, str]:
        return self.id("fleet", "fleet"), self.id("device", "device")

    def id(self, name: str, what: str, *, nullable: bool = False) -> Any:
        """A fleet, device or rollout id (agent/fleet/topics.py's rule)."""
        value = self.obj.get(name)
        if value is None and nullable:
            return None
        try:
            return check_id(value, what)
        except DocumentError as exc:
            raise _bad(self.path(name), str(exc.fields.get("expected") or exc.message)
                       + (" or null" if nullable else ""), value) from None


def _header(data: object, kind: str, fields: Iterable[str], optional: Iterable[str] = ()
            ) -> _Fields:
    """A document's fields after its ``kind`` and ``schema_version`` were checked."""
    if not isinstance(data, dict):
        raise _bad("document", "a JSON object", data)
    found_kind = data.get("kind")
    if found_kind != kind:
        raise DocumentError(f"not a {kind} document", reason="wrong_kind", field="kind",
                            expected=kind, found=_show(found_kind))
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DocumentError("unsupported schema version", reason="schema_version",
                            field="schema_version", expected=SCHEMA_VERSION,
                            found=_show(version))
    return _Fields(data, "", required=("kind", "schema_version", "fleet", "device", *fields),
                   optional=optional)


# -- the parts --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A wanted model: ``name``, ``version``, where to fetch its bundle and its sha256."""

    name: str
    version: int
    url: str
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "url": self.url,
                "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: object, where: str = "model") -> ModelSpec:
        fields = _Fields(data, where, required=("name", "version", "url", "sha256"))
        return cls(name=_model_name(fields, "name"),
                   version=fields.integer("version", minimum=1),
                   url=fields.text("url", pattern=_URL, max_chars=MAX_URL_CHARS,
                                   rule=f"an http, https or file URL of at most "
                                        f"{MAX_URL_CHARS} characters"),
                   sha256=fields.text("sha256", pattern=_SHA256,
                                      rule="64 lower-case hex digits"))


def _model_name(fields: _Fields, name: str) -> str:
    return fields.text(name, pattern=_MODEL_NAME, max_chars=MAX_NAME_CHARS,  # type: ignore
                       rule=f"a model name [a-z0-9][a-z0-9._-]* of at most {MAX_NAME_CHARS} "
                            "characters")


@dataclass(frozen=True, kw_only=True)
class ErrorInfo:
    """Why something failed: a short code and the same in words."""

    reason: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_json(cls, data: object, where: str = "error") -> ErrorInfo:
        fields = _Fields(data, where, required=("reason", "message"))
        return cls(reason=fields.text("reason", pattern=_CODE, max_chars=64,
                                      rule="a code [a-z][a-z0-9_]* of at most 64 characters"),
                   message=fields.text("message"))

    @classmethod
    def of(cls, reason: str, message: str) -> ErrorInfo:
        """One made from facts at hand, shortened to the bounds (a long exception text)."""
        code = reason if _CODE.fullmatch(reason) and len(reason) <= 64 else "error"
        return cls(reason=code, message=printable(message, MAX_TEXT_CHARS))


@dataclass(frozen=True, kw_only=True)
class Applied:
    """The model version a device serves; ``sha256`` when the device knows it."""

    name: str
    version: int
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = {"name": self.name, "version": self.version}
        if self.sha256 is not None:
            result["sha256"] = self.sha256
        return result

    @classmethod
    def from_json(cls, data: object, where: str = "applied") -> Applied:
        fields = _Fields(data, where, required=("name", "version"), optional=("sha256",))
        return cls(name=_model_name(fields, "name"), version=fields.integer("version", minimum=1),
                   sha256=fields.text("sha256", pattern=_SHA256, rule="64 lower-case hex digits")
                   if fields.has("sha256") else None)


@dataclass(frozen=True, kw_only=True)
class DesiredStatus:
    """Where a device stands with its newest accepted desired document."""

    version: int
    status: str  # one of DESIRED_STATUSES
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.status not in DESIRED_STATUSES:
            raise _bad("desired.status", "one of " + ", ".join(DESIRED_STATUSES), self.status)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "status": self.status, "reason": self.reason}

    @classmethod
    def from_json(cls, data: object, where: str = "desired") -> DesiredStatus:
        fields = _Fields(data, where, required=("version", "status", "reason"))
        status = fields.raw("status")
        if status not in DESIRED_STATUSES:
            raise _bad(fields.path("status"), "one of " + ", ".join(DESIRED_STATUSES), status)
        return cls(version=fields.integer("version", minimum=1), status=status,
                   reason=fields.text("reason", nullable=True))


_UPDATE_STATES = tuple(state.value for state in UpdateState)


@dataclass(frozen=True, kw_only=True)
class UpdaterStatus:
    """The updater's state as a device reports it."""

    state: str  # an UpdateState value
    update_id: str | None = None
    error: ErrorInfo | None = None
    last_outcome: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "update_id": self.update_id,
                "error": None if self.error is None else self.error.to_json(),
                "last_outcome": self.last_outcome}

    @classmethod
    def from_json(cls, data: object, where: str = "updater") -> UpdaterStatus:
        fields = _Fields(data, where, required=("state", "update_id", "error", "last_outcome"))
        state = fields.raw("state")
        if state not in _UPDATE_STATES:
            raise _bad(fields.path("state"), "one of " + ", ".join(_UPDATE_STATES), state)
        error = fields.raw("error")
        return cls(state=state, update_id=fields.text("update_id", max_chars=200, nullable=True),
                   error=None if error is None else ErrorInfo.from_json(error,
                                                                         fields.path("error")),
                   last_outcome=fields.object("last_outcome", nullable=True))


# -- the documents -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Document:
    """What every document has: its ``fleet`` and ``device`` (the ``kind`` and the schema
    version are the class's)."""

    kind: ClassVar[str]
    fleet: str
    device: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema_version": SCHEMA_VERSION, "fleet": self.fleet,
                "device": self.device, **self._body()}

    def _body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls: type[D], data: object) -> D:
        raise NotImplementedError

    def encode(self) -> bytes:
        """The document as compact UTF-8 JSON.

        Raises:
            DocumentError: (``too_large``) it is over :data:`MAX_DOCUMENT_BYTES`.
        """
        data = _dumps(self.to_json()).encode("utf-8")
        if len(data) > MAX_DOCUMENT_BYTES:
            raise DocumentError(f"the {self.kind} document is too large", reason="too_large",
                                expected=f"at most {MAX_DOCUMENT_BYTES} bytes",
                                found=f"{len(data)} bytes")
        return data


def _free_object(fields: _Fields, name: str, *, nullable: bool = False) -> Any:
    """An object whose content is the producer's own (health, a fingerprint, reserved
    settings): any JSON object, bounded by the document's size."""
    return fields.object(name, nullable=nullable)


@dataclass(frozen=True, kw_only=True)
class Desired(Document):
    """``desired`` (retained, signed): what the device should run. ``version`` is the
    document's own, increasing per device; the device acts on a version higher than the last one
    it accepted. ``model`` None: no change of model is wanted. ``allow_downgrade``: an authorised
    rollback (a model older than the one serving is allowed)."""

    kind: ClassVar[str] = "desired"
    version: int
    issued_at: datetime.datetime
    model: ModelSpec | None = None
    allow_downgrade: bool = False
    rollout: str | None = None
    # Policy keys of [power] (agent/power/policy.py: {"profile": "max", "latency_target_s":
    # 0.03}): the device's policy is its configuration's with these, checked as the file is.
    power: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # reserved

    def _body(self) -> dict[str, Any]:
        return {"version": self.version, "issued_at": format_time(self.issued_at),
                "model": None if self.model is None else self.model.to_json(),
                "allow_downgrade": self.allow_downgrade, "rollout": self.rollout,
                "power": self.power, "settings": self.settings}

    @classmethod
    def from_json(cls, data: object) -> Desired:
        fields = _header(data, cls.kind, ("version", "issued_at", "model", "allow_downgrade",
                                          "rollout", "power", "settings"))
        fleet, device = fields.fleet_and_device()
        model = fields.raw("model")
        rollout = fields.id("rollout", "rollout", nullable=True)
        return cls(fleet=fleet, device=device, version=fields.integer("version", minimum=1),
                   issued_at=fields.time("issued_at"),
                   model=None if model is None else ModelSpec.from_json(model),
                   allow_downgrade=fields.boolean("allow_downgrade"), rollout=rollout,
                   power=_free_object(fields, "power", nullable=True),
                   settings=_free_object(fields, "settings"))


@dataclass(frozen=True, kw_only=True)
class Command(Document):
    """``cmd``: an imperative request, answered by a :class:`Response` with the same
    ``request_id``. Every command but ``status`` must be signed and carry ``expires_at``.
    ``args``: ``{"model": {...}}`` for ``update``, ``{}`` for the others."""

    kind: ClassVar[str] = "cmd"
    request_id: str
    command: str  # one of COMMANDS
    issued_at: datetime.datetime
    args: dict[str, Any] = field(default_factory=dict)
    expires_at: datetime.datetime | None = None

    @property
    def needs_signature(self) -> bool:
        return self.command in SIGNED_COMMANDS

    @property
    def model(self) -> ModelSpec | None:
        """The ``update`` command's model."""
        model = self.args.get("model")
        return None if model is None else ModelSpec.from_json(model, "args.model")

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_id": self.request_id, "command": self.command,
                                "args": self.args, "issued_at": format_time(self.issued_at)}
        if self.expires_at is not None:
            body["expires_at"] = format_time(self.expires_at)
        return body

    @classmethod
    def from_json(cls, data: object) -> Command:
        fields = _header(data, cls.kind, ("request_id", "command", "args", "issued_at"),
                         optional=("expires_at",))
        fleet, device = fields.fleet_and_device()
        request_id = _request_id(fields)
        command = fields.raw("command")
        if command not in COMMANDS:
            raise _bad("command", "one of " + ", ".join(COMMANDS), command)
        args = fields.object("args")
        if command == "update":
            ModelSpec.from_json(_Fields(args, "args", required=("model",)).raw("model"),
                                "args.model")
        else:
            _Fields(args, "args", required=())
        issued_at = fields.time("issued_at")
        expires_at = fields.time("expires_at") if fields.has("expires_at") else None
        if expires_at is None and command in SIGNED_COMMANDS:
            raise DocumentError(f"missing field 'expires_at' (a {command} command must expire)",
                                reason="bad_field", field="expires_at")
        if expires_at is not None:
            if expires_at <= issued_at:
                raise _bad("expires_at", "a time after issued_at", format_time(expires_at))
            if expires_at - issued_at > MAX_COMMAND_LIFETIME:
                raise _bad("expires_at", f"at most {MAX_COMMAND_LIFETIME} after issued_at",
                           format_time(expires_at))
        return cls(fleet=fleet, device=device, request_id=request_id, command=command,
                   args=args, issued_at=issued_at, expires_at=expires_at)


@dataclass(frozen=True, kw_only=True)
class Response(Document):
    """``resp``: a command's answer. ``ok`` with a ``result``, or not with an ``error``;
    ``repeated``: the answer to a request id seen before, given again (the command did not run
    again)."""

    kind: ClassVar[str] = "resp"
    request_id: str
    ok: bool
    answered_at: datetime.datetime
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    repeated: bool = False

    def __post_init__(self) -> None:
        if self.ok == (self.error is not None):
            raise _bad("error", "null when ok, an error when not", self.error)

    def _body(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "ok": self.ok, "result": self.result,
                "error": None if self.error is None else self.error.to_json(),
                "answered_at": format_time(self.answered_at), "repeated": self.repeated}

    @classmethod
    def from_json(cls, data: object) -> Response:
        fields = _header(data, cls.kind, ("request_id", "ok", "result", "error", "answered_at",
                                          "repeated"))
        fleet, device = fields.fleet_and_device()
        request_id = _request_id(fields)
        error = fields.raw("error")
        return cls(fleet=fleet, device=device, request_id=request_id, ok=fields.boolean("ok"),
                   answered_at=fields.time("answered_at"),
                   result=_free_object(fields, "result", nullable=True),
                   error=None if error is None else ErrorInfo.from_json(error),
                   repeated=fields.boolean("repeated"))


@dataclass(frozen=True, kw_only=True)
class Reported(Document):
    """``reported`` (retained): what the device runs and how its updater and health are.
    ``sequence`` increases with every publication, across restarts too."""

    kind: ClassVar[str] = "reported"
    sequence: int
    reported_at: datetime.datetime
    agent_version: str
    updater: UpdaterStatus
    fingerprint: dict[str, Any] = field(default_factory=dict)
    applied: Applied | None = None
    desired: DesiredStatus | None = None
    health: dict[str, Any] = field(default_factory=dict)
    # The power governor's state, point in force, power and hottest temperature; absent (None)
    # where the device does not govern power.
    power: dict[str, Any] | None = None

    def _body(self) -> dict[str, Any]:
        body = {"sequence": self.sequence, "reported_at": format_time(self.reported_at),
                "agent_version": self.agent_version, "fingerprint": self.fingerprint,
                "applied": None if self.applied is None else self.applied.to_json(),
                "desired": None if self.desired is None else self.desired.to_json(),
                "updater": self.updater.to_json(), "health": self.health}
        if self.power is not None:
            body["power"] = self.power
        return body

    @classmethod
    def from_json(cls, data: object) -> Reported:
        fields = _header(data, cls.kind, ("sequence", "reported_at", "agent_version",
                                          "fingerprint", "applied", "desired", "updater",
                                          "health"), optional=("power",))
        fleet, device = fields.fleet_and_device()
        applied, desired = fields.raw("applied"), fields.raw("desired")
        return cls(fleet=fleet, device=device, sequence=fields.integer("sequence", minimum=0),
                   reported_at=fields.time("reported_at"),
                   agent_version=fields.text("agent_version", max_chars=64),
                   fingerprint=_free_object(fields, "fingerprint"),
                   applied=None if applied is None else Applied.from_json(applied),
                   desired=None if desired is None else DesiredStatus.from_json(desired),
                   updater=UpdaterStatus.from_json(fields.raw("updater")),
                   health=_free_object(fields, "health"),
                   power=_free_object(fields, "power") if fields.has("power") else None)


@dataclass(frozen=True, kw_only=True)
class Event(Document):
    """``events``: one thing that happened (``update.state``, ``update.progress``,
    ``desired.refused``, ``cmd.refused``...), its facts in ``detail``."""

    kind: ClassVar[str] = "event"
    at: datetime.datetime
    type: str
    detail: dict[str, Any] = field(default_factory=dict)

    def _body(self) -> dict[str, Any]:
        return {"at": format_time(self.at), "type": self.type, "detail": self.detail}

    @classmethod
    def from_json(cls, data: object) -> Event:
        fields = _header(data, cls.kind, ("at", "type", "detail"))
        fleet, device = fields.fleet_and_device()
        return cls(fleet=fleet, device=device, at=fields.time("at"),
                   type=fields.text("type", pattern=_CODE, max_chars=64,
                                    rule="a dotted code like update.state"),
                   detail=_free_object(fields, "detail"))


@dataclass(frozen=True, kw_only=True)
class Online(Document):
    """``online`` (retained): whether the device is connected; its Last Will is the same
    document with ``online`` false."""

    kind: ClassVar[str] = "online"
    online: bool
    since: datetime.datetime
    agent_version: str

    def _body(self) -> dict[str, Any]:
        return {"online": self.online, "since": format_time(self.since),
                "agent_version": self.agent_version}

    @classmethod
    def from_json(cls, data: object) -> Online:
        fields = _header(data, cls.kind, ("online", "since", "agent_version"))
        fleet, device = fields.fleet_and_device()
        return cls(fleet=fleet, device=device, online=fields.boolean("online"),
                   since=fields.time("since"),
                   agent_version=fields.text("agent_version", max_chars=64))


AnyDocument = Union[Desired, Command, Response, Reported, Event, Online]
KINDS: dict[str, type[Document]] = {cls.kind: cls for cls in (Desired, Command, Response,
                                                              Reported, Event, Online)}


def document_from_json(data: object, expect: type[D] | None = None) -> Document:
    """The document ``data`` (parsed JSON) holds, of the class ``expect`` when given.

    Raises:
        DocumentError: ``unknown_kind``, ``wrong_kind``, ``schema_version``, ``bad_field``.
    """
    if not isinstance(data, dict):
        raise _bad("document", "a JSON object", data)
    kind = data.get("kind")
    if expect is not None:
        return expect.from_json(data)
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DocumentError("unknown document kind", reason="unknown_kind", field="kind",
                            expected=", ".join(KINDS), found=_show(kind))
    return cls.from_json(data)


def encode(document: Document) -> bytes:
    """``document`` as compact UTF-8 JSON (:meth:`Document.encode`)."""
    return document.encode()


def decode(data: bytes, expect: type[D] | None = None) -> Any:
    """Parse an unsigned document (at most :data:`MAX_DOCUMENT_BYTES`), of ``expect``'s kind
    when given.

    Raises:
        DocumentError: it is too large, not UTF-8 JSON, or not a valid document.
    """
    return document_from_json(load_json(data, limit=MAX_DOCUMENT_BYTES, what="document"),
                              expect)


# -- the signed envelope ------------------------------------------------------------------------

def sign(document: Document, private_key: Ed25519PrivateKey) -> bytes:
    """``document`` in a signed envelope (see the module's docstring), as UTF-8 JSON bytes."""
    payload = document.encode()
    envelope = {"payload": payload.decode("utf-8"), "signature": {
        "algorithm": SIGNATURE_ALGORITHM,
        "key_id": compute_key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(payload)).decode("ascii")}}
    return _dumps(envelope).encode("utf-8")


@dataclass(frozen=True)
class Received:
    """A message's document, and the key id that signed it (None: it came unsigned)."""

    document: Any  # an AnyDocument; Any so callers need no cast after checking the class
    key_id: str | None

    @property
    def signed(self) -> bool:
        return self.key_id is not None


def _is_envelope(data: object) -> bool:
    return isinstance(data, dict) and "kind" not in data and (
        "payload" in data or "signature" in data)


def open_envelope(data: bytes, trusted_keys: Iterable[Ed25519PublicKey],
                  expect: type[D] | None = None) -> Received:
    """Verify a signed envelope and parse the document it signs.

    Raises:
        DocumentError: ``too_large``, ``not_json``, ``bad_envelope`` (not an envelope, or its
            signature part is malformed), ``no_trusted_keys``, ``unknown_key`` (signed by a key
            not trusted), ``bad_signature``; then whatever parsing the payload raises.
    """
    parsed = load_json(data, limit=MAX_MESSAGE_BYTES, what="message")
    if not _is_envelope(parsed):
        raise DocumentError("the message is not a signed envelope", reason="unsigned",
                            expected="{\"payload\": ..., \"signature\": ...}")
    return _open(parsed, trusted_keys, expect)


def read_message(data: bytes, trusted_keys: Iterable[Ed25519PublicKey],
                 expect: type[D] | None = None) -> Received:
    """A message that may be signed (an envelope, verified) or not (a plain document): the
    caller decides whether its kind needed the signature.

    Raises:
        DocumentError: as :func:`open_envelope`, or as :func:`decode` for a plain document.
    """
    parsed = load_json(data, limit=MAX_MESSAGE_BYTES, what="message")
    if _is_envelope(parsed):
        return _open(parsed, trusted_keys, expect)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError("the document is too large", reason="too_large",
                            expected=f"at most {MAX_DOCUMENT_BYTES} bytes",
                            found=f"{len(data)} bytes")
    return Received(document_from_json(parsed, expect), None)


def _open(envelope: dict[str, Any], trusted_keys: Iterable[Ed25519PublicKey],
          expect: type[D] | None) -> Received:
    fields = _Fields(envelope, "", required=("payload", "signature"))
    payload_text = fields.raw("payload")
    if not isinstance(payload_text, str):
        raise DocumentError("the envelope's payload is not a string", reason="bad_envelope",
                            field="payload", found=_show(payload_text))
    signature_part = fields.raw("signature")
    if isinstance(signature_part, dict):
        unknown = sorted(set(signature_part) - {"algorithm", "key_id", "signature"})
        if unknown:
            raise DocumentError("unknown field in the envelope's signature", reason="bad_envelope",
                                field=f"signature.{printable(unknown[0], 100)}")
    try:
        signature = signature_from_json(signature_part)
    except SignatureError as exc:
        name = exc.fields.get("field")
        raise DocumentError(f"the envelope's signature is malformed: {exc.message}",
                            reason="bad_envelope",
                            field="signature" + (f".{name}" if name else "")) from None
    keys_by_id = {compute_key_id(key): key for key in trusted_keys}
    if not keys_by_id:
        raise DocumentError("no fleet keys are trusted, so no signed document can be accepted",
                            reason="no_trusted_keys", key_id=signature.key_id)
    key = keys_by_id.get(signature.key_id)
    if key is None:
        raise DocumentError("the document is signed by a key that is not trusted",
                            reason="unknown_key", field="signature.key_id",
                            key_id=signature.key_id, trusted=",".join(sorted(keys_by_id)))
    payload = payload_text.encode("utf-8", errors="surrogatepass")
    try:
        key.verify(signature.signature, payload)
    except InvalidSignature:
        raise DocumentError("the signature does not match the payload", reason="bad_signature",
                            field="signature.signature", key_id=signature.key_id) from None
    # Verified: the bytes are the signer's, so parsing them is as safe as parsing our own.
    document = document_from_json(load_json(payload, limit=MAX_DOCUMENT_BYTES, what="payload"),
                                  expect)
    return Received(document, signature.key_id)


# -- the schemas ---------------------------------------------------------------------------------

def schema_path(kind: str) -> Path:
    """The JSON Schema file of a document kind (``desired``...) or of ``envelope``, as shipped
    in the package (``agent/fleet/schemas/<kind>.schema.json``)."""
    if kind not in KINDS and kind != "envelope":
        raise DocumentError("unknown document kind", reason="unknown_kind",
                            expected=", ".join((*KINDS, "envelope")), found=_show(kind))
    return Path(str(resources.files("agent.fleet") / "schemas" / f"{kind}.schema.json"))


def load_schema(kind: str) -> Mapping[str, Any]:
    """A kind's JSON Schema, parsed."""
    return json.loads(schema_path(kind).read_text(encoding="utf-8"))  # type: ignore[no-any-return]
