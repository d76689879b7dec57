"""The ``current`` pointer: which installed version is served and which one a rollback returns to.

``state_dir/current`` holds ``{"schema_version": 1, "current": {"name": ..., "version": ...} |
null, "previous": ... | null}``. It is written to a temporary file beside it, fsynced, renamed over
it and the directory fsynced (agent/fsutil.py), so a power loss leaves the old pointer or the new
one, never a mix. A pointer that is unreadable or of another schema is reported as corrupt, never
taken for "no model".

Model names and versions become path parts under the state directory, so every reference is
checked on the way in (:func:`model_ref`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import StoreError
from agent.fsutil import atomic_write_text
from agent.store.files import exists, read_small
from models.manifest import MAX_VERSION

POINTER_FILE = "current"
POINTER_SCHEMA_VERSION = 1
# The temporary file atomic_write_text creates beside the pointer.
POINTER_TEMP = re.compile(re.escape(f".{POINTER_FILE}.") + r".+\.tmp")
# The manifest's rule for model names (models/manifest.py); it also keeps names safe as path parts.
MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True, order=True)
class ModelRef:
    """One model version by name, as the pointer records it."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}


def model_ref(name: object, version: object) -> ModelRef:
    """A checked reference: the name and version become path parts, so both are validated.

    Raises:
        StoreError: the name is not a model name, or the version not an integer in range.
    """
    checked_name = check_name(name)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise StoreError("invalid model version", expected=f"an integer from 1 to {MAX_VERSION}",
                         found=repr(version))
    return ModelRef(checked_name, version)


def check_name(name: object) -> str:
    if not isinstance(name, str) or MODEL_NAME.fullmatch(name) is None:
        raise StoreError(
            "invalid model name", expected="a slug [a-z0-9][a-z0-9._-]*", found=repr(name)
        )
    return name


def read_pointer(path: Path) -> tuple[ModelRef | None, ModelRef | None]:
    """The current and previous versions the pointer names.

    Raises:
        StoreError: the pointer is missing (from a store that has one) or corrupt.
    """
    try:
        data = read_small(path)
    except StoreError as exc:
        if not exists(path):
            raise StoreError(
                "the current-version pointer is missing from an initialised store (deleted or "
                "lost); activate a version to recreate it",
                path=path,
            ) from exc
        raise
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(path, f"not UTF-8 JSON: {exc}") from exc
    except RecursionError:
        raise _corrupt(path, "nested too deeply") from None
    if not isinstance(document, dict):
        raise _corrupt(path, "not a JSON object")
    if document.get("schema_version") != POINTER_SCHEMA_VERSION:
        raise _corrupt(path, f"schema_version is not {POINTER_SCHEMA_VERSION}")
    return _entry(path, document, "current"), _entry(path, document, "previous")


def write_pointer(path: Path, current: ModelRef | None, previous: ModelRef | None) -> None:
    """Replace the pointer atomically.

    Raises:
        StoreError: it cannot be written.
    """
    document = {
        "schema_version": POINTER_SCHEMA_VERSION,
        "current": current.to_json() if current else None,
        "previous": previous.to_json() if previous else None,
    }
    try:
        atomic_write_text(path, json.dumps(document, indent=2) + "\n")
    except OSError as exc:
        raise StoreError(
            "cannot write the current-version pointer",
            path=path,
            reason=exc.strerror,
        ) from exc


def _entry(path: Path, document: dict[str, Any], field: str) -> ModelRef | None:
    value = document.get(field)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "version"}:
        raise _corrupt(path, f"'{field}' is not null or {{name, version}}")
    try:
        return model_ref(value["name"], value["version"])
    except StoreError as exc:
        raise _corrupt(path, f"'{field}': {exc}") from exc


def _corrupt(path: Path, reason: str) -> StoreError:
    return StoreError(
        "the current-version pointer is corrupt; activate a version to replace it",
        path=path,
        reason=reason,
    )
