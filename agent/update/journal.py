"""The updater's journal: what it is doing, what it did, and which bundles it refuses.

``state_dir/update-journal.json`` is one JSON document::

    {"schema_version": 1,
     "state": "canary", "entered_at": "2024-05-01T12:00:00.000Z",
     "update": {"id", "kind": "update" | "rollback", "source", "expected": {name, version, sha256},
                "bundle": {name, version, sha256} | null (known once verified), "attempt",
                "requested_at", "committed": bool, "allow_downgrade": bool} | null,
     "pending": an outcome | null (what rolling-back ends in: failed, or idle after a cancel),
     "history": [{"at", "update_id", "from", "to", "reason", "detail"}, ...] (bounded, oldest
                 first; an entry whose "from" equals its "to" is a note, not a transition),
     "bundles": {"<sha256>": {"name", "version", "sha256", "attempts", "failures",
                              "last_reason", "refused_at" | null}},
     "last_outcome": {"update_id", "kind", "result", "reason", "state", "detail", "at",
                      "bundle"} | null}

Times are wall clock, ISO-8601 UTC. Every write goes to a temporary file beside the journal, is
fsynced, renamed over it and the directory fsynced (agent/fsutil.py), so a crash or power loss
leaves the old document or the new one, never a mix; a temporary file a crash left is removed at
the next load.

A journal that cannot be read or parsed (corrupt, empty, truncated, not ours) must never stop the
daemon: :meth:`Journal.load` moves it aside (``update-journal.json.corrupt-<time>``, kept for
forensics), and the updater starts idle and reports it. A journal of a newer schema (written by a
newer agent, before a downgrade of the agent itself) is treated the same way, moved aside as
``.schema-<n>-<time>``: this agent cannot know what that schema's states mean, and refusing to
start would leave the board without updates at all. Only the refusals and the history are lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import InternalError
from agent.fsutil import FileTooLargeError, atomic_write_text, fsync_dir, read_bounded
from agent.update.states import UpdateState

__all__ = [
    "JOURNAL_FILE",
    "SCHEMA_VERSION",
    "BundleAttempts",
    "BundleId",
    "Event",
    "Journal",
    "JournalDoc",
    "JournalLoad",
    "Outcome",
    "UpdateRecord",
    "utc_now",
]

log = logging.getLogger(__name__)

JOURNAL_FILE = "update-journal.json"
SCHEMA_VERSION = 1
MAX_JOURNAL_BYTES = 4 * 1024 * 1024
_JOURNAL_TEMP = re.compile(re.escape(f".{JOURNAL_FILE}.") + r".+\.tmp")
_SHA256 = re.compile(r"[0-9a-f]{64}")

KINDS = ("update", "rollback")
RESULTS = ("committed", "failed", "cancelled", "already_current", "rolled_back", "interrupted")


def utc_now() -> str:
    """The wall clock now, ISO-8601 UTC with milliseconds (``2024-05-01T12:00:00.000Z``)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


class JournalFormatError(ValueError):
    """The journal's content is not a journal of this schema (the message says where)."""


@dataclass(frozen=True, kw_only=True)
class BundleId:
    """What is known about a bundle: from the request (any of the three), or verified (all)."""

    name: str | None = None
    version: int | None = None
    sha256: str | None = None

    def matches(self, other: BundleId | None) -> bool:
        """Whether both name the same bundle: the same sha256, or the same name and version."""
        if other is None:
            return False
        if self.sha256 is not None and other.sha256 is not None:
            return self.sha256 == other.sha256
        return (self.name is not None and self.version is not None
                and (self.name, self.version) == (other.name, other.version))

    def is_known(self) -> bool:
        """Whether the bundle can be recognised at all (a sha256, or a name and a version)."""
        return self.sha256 is not None or (self.name is not None and self.version is not None)

    def __str__(self) -> str:
        label = f"{self.name or '?'} v{self.version if self.version is not None else '?'}"
        return f"{label} ({self.sha256[:12]})" if self.sha256 else label

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: object, where: str) -> BundleId:
        obj = _object(data, where)
        sha256 = _opt(obj, "sha256", str, where)
        if sha256 is not None and _SHA256.fullmatch(sha256) is None:
            raise JournalFormatError(f"{where}.sha256 is not a sha256 hex digest")
        return cls(name=_opt(obj, "name", str, where), version=_opt(obj, "version", int, where),
                   sha256=sha256)


@dataclass(frozen=True, kw_only=True)
class UpdateRecord:
    """The update in progress (or the last one, in ``failed``)."""

    update_id: str
    kind: str  # "update", or "rollback" for an operator rollback from a resting state
    source: str  # a path or URL; empty for a rollback
    expected: BundleId  # what the request said it wants
    bundle: BundleId | None  # what verification found (for a rollback: the version reverted)
    attempt: int  # 1, and one more each time a restart resumes it
    requested_at: str
    committed: bool = False  # the pointer was switched to the bundle
    # An authorised downgrade (a signed fleet document asked for it): the bundle may be older
    # than the version serving. Journalled, so that a resumed attempt keeps it.
    allow_downgrade: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"id": self.update_id, "kind": self.kind, "source": self.source,
                "expected": self.expected.to_json(),
                "bundle": None if self.bundle is None else self.bundle.to_json(),
                "attempt": self.attempt, "requested_at": self.requested_at,
                "committed": self.committed, "allow_downgrade": self.allow_downgrade}

    @classmethod
    def from_json(cls, data: object, where: str) -> UpdateRecord:
        obj = _object(data, where)
        kind = _req(obj, "kind", str, where)
        if kind not in KINDS:
            raise JournalFormatError(f"{where}.kind is {kind!r}, not one of {KINDS}")
        bundle = obj.get("bundle")
        return cls(update_id=_req(obj, "id", str, where), kind=kind,
                   source=_req(obj, "source", str, where),
                   expected=BundleId.from_json(obj.get("expected"), f"{where}.expected"),
                   bundle=None if bundle is None else BundleId.from_json(bundle, f"{where}.bundle"),
                   attempt=_req(obj, "attempt", int, where),
                   requested_at=_req(obj, "requested_at", str, where),
                   committed=_req(obj, "committed", bool, where),
                   # Absent in journals written before it existed.
                   allow_downgrade=_opt(obj, "allow_downgrade", bool, where) or False)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One entry of the history: a transition, or a note when ``from_state == to_state``."""

    at: str
    update_id: str | None
    from_state: UpdateState
    to_state: UpdateState
    reason: str | None = None  # a short code: "deadline", "superseded", "interrupted_by_restart"
    detail: str | None = None  # the same in words

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "update_id": self.update_id, "from": self.from_state.value,
                "to": self.to_state.value, "reason": self.reason, "detail": self.detail}

    @classmethod
    def from_json(cls, data: object, where: str) -> Event:
        obj = _object(data, where)
        return cls(at=_req(obj, "at", str, where), update_id=_opt(obj, "update_id", str, where),
                   from_state=_state(obj, "from", where), to_state=_state(obj, "to", where),
                   reason=_opt(obj, "reason", str, where), detail=_opt(obj, "detail", str, where))


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How an update ended."""

    update_id: str
    kind: str
    result: str  # one of RESULTS
    reason: str | None  # the failure's code, "superseded", ...
    state: UpdateState  # the state it failed, was cancelled or ended in
    detail: str | None
    at: str
    bundle: BundleId | None

    def to_json(self) -> dict[str, Any]:
        return {"update_id": self.update_id, "kind": self.kind, "result": self.result,
                "reason": self.reason, "state": self.state.value, "detail": self.detail,
                "at": self.at, "bundle": None if self.bundle is None else self.bundle.to_json()}

    @classmethod
    def from_json(cls, data: object, where: str) -> Outcome:
        obj = _object(data, where)
        result = _req(obj, "result", str, where)
        if result not in RESULTS:
            raise JournalFormatError(f"{where}.result is {result!r}, not one of {RESULTS}")
        bundle = obj.get("bundle")
        return cls(update_id=_req(obj, "update_id", str, where), kind=_req(obj, "kind", str, where),
                   result=result, reason=_opt(obj, "reason", str, where),
                   state=_state(obj, "state", where), detail=_opt(obj, "detail", str, where),
                   at=_req(obj, "at", str, where),
                   bundle=None if bundle is None else BundleId.from_json(bundle, f"{where}.bundle"))


@dataclass(frozen=True, kw_only=True)
class BundleAttempts:
    """The attempts budget of one verified bundle."""

    name: str
    version: int
    sha256: str
    attempts: int = 0  # updates that got this bundle verified
    failures: int = 0  # of those, how many failed from staged on (counted against the budget)
    last_reason: str | None = None
    refused_at: str | None = None  # set when failures reached the budget

    @property
    def bundle(self) -> BundleId:
        return BundleId(name=self.name, version=self.version, sha256=self.sha256)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256,
                "attempts": self.attempts, "failures": self.failures,
                "last_reason": self.last_reason, "refused_at": self.refused_at}

    @classmethod
    def from_json(cls, data: object, where: str) -> BundleAttempts:
        obj = _object(data, where)
        sha256 = _req(obj, "sha256", str, where)
        if _SHA256.fullmatch(sha256) is None:
            raise JournalFormatError(f"{where}.sha256 is not a sha256 hex digest")
        return cls(name=_req(obj, "name", str, where), version=_req(obj, "version", int, where),
                   sha256=sha256, attempts=_req(obj, "attempts", int, where),
                   failures=_req(obj, "failures", int, where),
                   last_reason=_opt(obj, "last_reason", str, where),
                   refused_at=_opt(obj, "refused_at", str, where))


@dataclass(kw_only=True)
class JournalDoc:
    """The journal's content; the updater changes it, then writes all of it."""

    state: UpdateState = UpdateState.IDLE
    entered_at: str = field(default_factory=utc_now)
    update: UpdateRecord | None = None
    pending: Outcome | None = None
    history: list[Event] = field(default_factory=list)
    bundles: dict[str, BundleAttempts] = field(default_factory=dict)
    last_outcome: Outcome | None = None

    def to_json(self, *, history: bool = True) -> dict[str, Any]:
        """The document as JSON data; without ``history`` it has no ``history`` key at all."""
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "state": self.state.value,
            "entered_at": self.entered_at,
            "update": None if self.update is None else self.update.to_json(),
            "pending": None if self.pending is None else self.pending.to_json(),
            "bundles": {key: entry.to_json() for key, entry in self.bundles.items()},
            "last_outcome": None if self.last_outcome is None else self.last_outcome.to_json(),
        }
        if history:
            data["history"] = [event.to_json() for event in self.history]
        return data

    @classmethod
    def from_json(cls, data: object) -> JournalDoc:
        """Parse a document of :data:`SCHEMA_VERSION` (the caller checked the version)."""
        obj = _object(data, "journal")
        update, pending, outcome = obj.get("update"), obj.get("pending"), obj.get("last_outcome")
        history = obj.get("history")
        if not isinstance(history, list):
            raise JournalFormatError("journal.history is not a list")
        bundles = _object(obj.get("bundles"), "journal.bundles")
        doc = cls(
            state=_state(obj, "state", "journal"),
            entered_at=_req(obj, "entered_at", str, "journal"),
            update=None if update is None else UpdateRecord.from_json(update, "journal.update"),
            pending=None if pending is None else Outcome.from_json(pending, "journal.pending"),
            history=[Event.from_json(item, f"journal.history[{index}]")
                     for index, item in enumerate(history)],
            bundles={key: BundleAttempts.from_json(item, f"journal.bundles[{key!r}]")
                     for key, item in bundles.items()},
            last_outcome=None if outcome is None else Outcome.from_json(outcome,
                                                                        "journal.last_outcome"),
        )
        if doc.state not in (UpdateState.IDLE, UpdateState.FAILED) and doc.update is None:
            raise JournalFormatError(
                f"journal.state is {doc.state.value} but no update is recorded")
        return doc


@dataclass(frozen=True)
class JournalLoad:
    """What :meth:`Journal.load` found."""

    doc: JournalDoc
    existed: bool  # a journal was there (readable or not)
    moved_aside: Path | None = None  # where an unusable journal was put
    problem: str | None = None  # why it was unusable, in words


class Journal:
    """Reads and writes ``state_dir/update-journal.json``.

    Args:
        state_dir: The state directory (the store's).
        history_limit: How many history entries a write keeps (the newest).
    """

    def __init__(self, state_dir: Path, *, history_limit: int = 200) -> None:
        self.path = Path(state_dir) / JOURNAL_FILE
        self.history_limit = history_limit
        self._event_text: dict[int, tuple[Event, str]] = {}  # each entry's text, encoded once

    def load(self, *, recover: bool = False) -> JournalLoad:
        """The journal's document; a fresh idle one when there is none or it is unusable. Never
        raises for the file's content; only for a bug.

        Args:
            recover: Only for the updater's own start, before anything writes: also remove the
                temporary files of writes a crash interrupted and move an unusable journal
                aside. Any other reader (a status command, a test polling a running daemon)
                leaves the directory alone, since a temporary file may be a write in flight.
        """
        if recover:
            self._remove_temporaries()
        try:
            raw = read_bounded(self.path, MAX_JOURNAL_BYTES, regular_only=True)
        except FileNotFoundError:
            return JournalLoad(JournalDoc(), existed=False)
        except (OSError, FileTooLargeError, ValueError) as exc:
            return self._unusable("corrupt", f"the journal cannot be read: {exc}", recover)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            return self._unusable("corrupt", f"the journal is not valid JSON: {exc}", recover)
        schema = data.get("schema_version") if isinstance(data, dict) else None
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            return self._unusable(f"schema-{schema}",
                                  f"the journal has schema {schema}, newer than this agent's "
                                  f"{SCHEMA_VERSION}", recover)
        if schema != SCHEMA_VERSION:
            return self._unusable("corrupt", f"the journal's schema_version is {schema!r}, "
                                             f"expected {SCHEMA_VERSION}", recover)
        try:
            doc = JournalDoc.from_json(data)
        except JournalFormatError as exc:
            return self._unusable("corrupt", f"the journal is malformed: {exc}", recover)
        return JournalLoad(doc, existed=True)

    def write(self, doc: JournalDoc) -> None:
        """Write ``doc`` crash-safe (:meth:`encode`, then :meth:`write_encoded`).

        Raises:
            OSError: the state directory cannot be written (disk full, read-only).
        """
        self.write_encoded(self.encode(doc))

    def encode(self, doc: JournalDoc) -> str:
        """``doc`` as the journal's text, first dropping all but the newest ``history_limit``
        history entries (from ``doc`` itself, so memory stays bounded too).

        The updater encodes on its event loop at every transition, and the history is most of
        the document (200 entries: about 1 ms to encode whole with an indent, every request
        waiting meanwhile). So each entry is encoded once, on one line of its own, and kept;
        a write encodes only the small head and the entries new since the last one.
        """
        del doc.history[:-self.history_limit]
        known: dict[int, tuple[Event, str]] = self._event_text
        encoded: dict[int, tuple[Event, str]] = {}
        texts = []
        for event in doc.history:
            # By identity (an Event's own hash is slow Python): the cache holds the event, so
            # its id cannot be reused while it is there.
            entry = known.get(id(event))
            if entry is None or entry[0] is not event:
                entry = (event, json.dumps(event.to_json(), separators=(", ", ": ")))
            encoded[id(event)] = entry
            texts.append(entry[1])
        self._event_text = encoded
        head = json.dumps(doc.to_json(history=False), indent=1)
        if not head.endswith("\n}"):
            raise InternalError("the journal's head did not encode as an indented object")
        entries = ",\n  ".join(texts)
        history = f"[\n  {entries}\n ]" if doc.history else "[]"
        return f'{head[:-2]},\n "history": {history}\n}}\n'

    def write_encoded(self, text: str) -> None:
        """Write text from :meth:`encode` crash-safe; a thread may do it, off the event loop.

        Raises:
            OSError: the state directory cannot be written (disk full, read-only).
        """
        atomic_write_text(self.path, text, mode=0o600)

    def _remove_temporaries(self) -> None:
        try:
            entries = list(os.scandir(self.path.parent))
        except OSError:
            return
        for entry in entries:
            if _JOURNAL_TEMP.fullmatch(entry.name):
                log.info("removing an unfinished journal write: %s", entry.path)
                try:
                    os.unlink(entry.path)
                except OSError as exc:
                    log.warning("could not remove %s: %s", entry.path, exc)

    def _unusable(self, label: str, problem: str, recover: bool) -> JournalLoad:
        if recover:
            return self._set_aside(label, problem)
        return JournalLoad(JournalDoc(), existed=True, problem=problem)

    def _set_aside(self, label: str, problem: str) -> JournalLoad:
        stamp = utc_now().replace(":", "").replace("-", "")
        target = self.path.with_name(f"{self.path.name}.{label}-{stamp}")
        try:
            os.replace(self.path, target)
            fsync_dir(self.path.parent)
        except OSError as exc:
            # The next write replaces it anyway; starting idle matters more than forensics.
            log.error("%s; could not move it aside (%s), starting idle", problem, exc)
            return JournalLoad(JournalDoc(), existed=True, problem=problem)
        log.error("%s; moved it aside to %s and starting idle", problem, target)
        return JournalLoad(JournalDoc(), existed=True, moved_aside=target, problem=problem)


# -- parsing helpers: every mismatch is a JournalFormatError that says where --------------------

def _object(data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise JournalFormatError(f"{where} is not an object")
    return data


def _req(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    # bool is an int to Python; a journal's counters and versions never are booleans.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise JournalFormatError(f"{where}.{key} is {value!r}, expected a {kind.__name__}")
    return value


def _opt(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    return None if obj.get(key) is None else _req(obj, key, kind, where)


def _state(obj: dict[str, Any], key: str, where: str) -> UpdateState:
    value = _req(obj, key, str, where)
    try:
        return UpdateState(value)
    except ValueError:
        raise JournalFormatError(f"{where}.{key} is {value!r}, not an update state") from None
