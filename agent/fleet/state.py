"""What the device's control plane keeps on disk, under ``<state_dir>/fleet/``:

=================  ================================================================================
file               content
=================  ================================================================================
``desired.json``   the newest accepted ``desired`` document, as the signed envelope that brought
                   it (verified again when it is loaded: the file is no more trusted than the
                   broker); a broker without persistence forgets retained documents when it
                   restarts, and a device must converge without any broker at all
``state.json``     ``{"schema_version": 1, "sequence_reserved": int, "desired": {"version",
                   "status", "reason"} | null}``: how far ``reported`` sequences may go before
                   another block is reserved, and where the device stands with its desired
``answers.json``   ``{"schema_version": 1, "answers": {"<request_id>": {"state": "running" |
                   "answered", "keep_until", "response": resp | null}}}``: the commands seen and
                   their answers, so that a repeated request id is answered again, never run twice
=================  ================================================================================

Every write is atomic (agent/fsutil.py) and done off the event loop. A file that cannot be
parsed is moved aside (``<name>.corrupt-<time>``) and the device starts without it, as the
updater's journal does: refusing to start would leave a board that no operator can reach.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import DocumentError
from agent.fleet.documents import DESIRED_STATUSES, MAX_MESSAGE_BYTES, format_time, parse_time
from agent.fsutil import FileTooLargeError, atomic_write_bytes, atomic_write_text, read_bounded

__all__ = ["AnswerEntry", "FleetFiles", "SavedState"]

log = logging.getLogger(__name__)

FLEET_DIR = "fleet"
DESIRED_FILE = "desired.json"
STATE_FILE = "state.json"
ANSWERS_FILE = "answers.json"
SCHEMA_VERSION = 1
MAX_STATE_BYTES = 1024 * 1024
# The answers of at most this many commands are kept (a device sees a few a day); beyond it the
# ones kept longest ago go first.
MAX_ANSWERS = 1000
MAX_ANSWERS_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SavedState:
    """``state.json``'s content."""

    sequence_reserved: int = 0
    desired_version: int | None = None
    desired_status: str | None = None
    desired_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        desired = None if self.desired_version is None else {
            "version": self.desired_version, "status": self.desired_status,
            "reason": self.desired_reason}
        return {"schema_version": SCHEMA_VERSION, "sequence_reserved": self.sequence_reserved,
                "desired": desired}

    @classmethod
    def from_json(cls, data: Any) -> SavedState:
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("not a state document of schema 1")
        reserved = data.get("sequence_reserved")
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            raise ValueError("sequence_reserved is not a count")
        desired = data.get("desired")
        if desired is None:
            return cls(sequence_reserved=reserved)
        if not isinstance(desired, dict):
            raise ValueError("desired is not an object")
        version, status, reason = (desired.get(key) for key in ("version", "status", "reason"))
        if (isinstance(version, bool) or not isinstance(version, int)
                or status not in DESIRED_STATUSES
                or not (reason is None or isinstance(reason, str))):
            raise ValueError("desired is not {version, status, reason}")
        return cls(sequence_reserved=reserved, desired_version=version, desired_status=status,
                   desired_reason=reason)


@dataclass(frozen=True)
class AnswerEntry:
    """One command seen: ``running`` from before it ran until its answer was written, then
    ``answered`` with the response document (JSON)."""

    state: str
    keep_until: datetime.datetime
    response: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "keep_until": format_time(self.keep_until),
                "response": self.response}

    @classmethod
    def from_json(cls, data: Any) -> AnswerEntry:
        if not isinstance(data, dict) or data.get("state") not in ("running", "answered"):
            raise ValueError("an answer entry is not {state, keep_until, response}")
        response = data.get("response")
        if not (response is None or isinstance(response, dict)):
            raise ValueError("an answer's response is not an object")
        try:
            keep_until = parse_time(data.get("keep_until"), "keep_until")
        except DocumentError as exc:
            raise ValueError(str(exc)) from None
        return cls(state=data["state"], keep_until=keep_until, response=response)


class FleetFiles:
    """The files above. Every method does blocking I/O: call it from an executor thread."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = Path(state_dir) / FLEET_DIR

    @property
    def desired_path(self) -> Path:
        return self.directory / DESIRED_FILE

    # -- desired.json

    def read_desired(self) -> bytes | None:
        """The stored envelope's bytes, None when there is none (or it is unreadable)."""
        try:
            return read_bounded(self.desired_path, MAX_MESSAGE_BYTES, regular_only=True)
        except FileNotFoundError:
            return None
        except (OSError, FileTooLargeError, ValueError) as exc:
            self._set_aside(self.desired_path, str(exc))
            return None

    def write_desired(self, envelope: bytes) -> None:
        atomic_write_bytes(self.desired_path, envelope, mode=0o600)

    def set_desired_aside(self, problem: str) -> None:
        """Move a stored desired document that no longer verifies out of the way."""
        self._set_aside(self.desired_path, problem)

    # -- state.json

    def read_state(self) -> SavedState:
        data = self._read_json(self.directory / STATE_FILE)
        if data is None:
            return SavedState()
        try:
            return SavedState.from_json(data)
        except ValueError as exc:
            self._set_aside(self.directory / STATE_FILE, str(exc))
            return SavedState()

    def write_state(self, state: SavedState) -> None:
        atomic_write_text(self.directory / STATE_FILE, json.dumps(state.to_json()) + "\n",
                          mode=0o600)

    # -- answers.json

    def read_answers(self) -> dict[str, AnswerEntry]:
        path = self.directory / ANSWERS_FILE
        data = self._read_json(path, limit=MAX_ANSWERS_BYTES)
        if data is None:
            return {}
        try:
            if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError("not an answers document of schema 1")
            answers = data.get("answers")
            if not isinstance(answers, dict):
                raise ValueError("answers is not an object")
            return {str(key): AnswerEntry.from_json(value) for key, value in answers.items()}
        except ValueError as exc:
            self._set_aside(path, str(exc))
            return {}

    def write_answers(self, answers: dict[str, AnswerEntry]) -> None:
        document = {"schema_version": SCHEMA_VERSION,
                    "answers": {key: entry.to_json() for key, entry in answers.items()}}
        atomic_write_text(self.directory / ANSWERS_FILE,
                          json.dumps(document, separators=(",", ":")) + "\n", mode=0o600)

    # -- helpers

    def _read_json(self, path: Path, limit: int = MAX_STATE_BYTES) -> Any:
        try:
            data = read_bounded(path, limit, regular_only=True)
        except FileNotFoundError:
            return None
        except (OSError, FileTooLargeError, ValueError) as exc:
            self._set_aside(path, str(exc))
            return None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            self._set_aside(path, f"not JSON: {exc}")
            return None

    def _set_aside(self, path: Path, problem: str) -> None:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        log.error("%s is unusable (%s); moved aside to %s and started without it", path,
                  problem, aside)
        try:
            path.replace(aside)
        except OSError as exc:
            log.error("could not move %s aside: %s", path, exc)
