"""The artifact directory: verified bundles under stable paths, and the index that ``deploy`` reads.

    <dir>/index.json                          the index (below)
    <dir>/<name>/<version>/<name>-<version>.bundle

``publish`` verifies a bundle (signature with the given public keys, manifest, every member's
hash) before anything is written, copies it under a temporary name in its final directory, fsyncs
it and renames it into place, then rewrites the index the same way. A name and version are
published once: the same bytes again is a no-op, different bytes under a published name and
version are refused, so a path in the directory never changes content. That is what lets a CDN or
a browser cache a bundle forever and what keeps a device's resumed download (``If-Range``) from
ever meeting a different file under the same URL.

The index (``index.json``, format 1) lists every bundle::

    {"format": 1, "bundles": [{"name": "resnet8", "version": 4, "sha256": "<hex>",
      "size": 123456, "path": "resnet8/4/resnet8-4.bundle", "key_id": "<16 hex>",
      "published_at": "2025-01-01T00:00:00Z"}]}

``path`` is relative to the directory and uses ``/``: the URL a device fetches is the artifact
base URL joined with it, whatever serves the directory (``fleet serve``, nginx, an object store).
"""

from __future__ import annotations

import datetime
import json
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.errors import FleetError, InputError
from agent.fleet.ops.locking import locked
from agent.fsutil import atomic_output_file, atomic_write_text, read_bounded, sha256_file
from models.bundle import open_bundle

__all__ = [
    "INDEX_NAME",
    "ArtifactIndex",
    "IndexEntry",
    "bundle_url",
    "load_index",
    "publish_bundle",
]

INDEX_NAME = "index.json"
LOCK_NAME = ".index.lock"
INDEX_FORMAT = 1
MAX_INDEX_BYTES = 64 * 1024 * 1024
BUNDLE_SUFFIX = ".bundle"


@dataclass(frozen=True, kw_only=True)
class IndexEntry:
    """One published bundle."""

    name: str
    version: int
    sha256: str
    size: int
    path: str
    key_id: str
    published_at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: object, where: Path) -> IndexEntry:
        if not isinstance(raw, dict):
            raise InputError("an index entry is not an object", path=where, found=raw)
        try:
            entry = cls(name=raw["name"], version=raw["version"], sha256=raw["sha256"],
                        size=raw["size"], path=raw["path"], key_id=raw["key_id"],
                        published_at=raw["published_at"])
        except KeyError as exc:
            raise InputError("an index entry lacks a field", path=where,
                             field=exc.args[0]) from None
        if (not isinstance(entry.name, str) or isinstance(entry.version, bool)
                or not isinstance(entry.version, int) or not isinstance(entry.sha256, str)
                or not isinstance(entry.size, int) or not isinstance(entry.path, str)
                or entry.path.startswith("/") or ".." in entry.path.split("/")):
            raise InputError("an index entry is malformed", path=where, entry=raw)
        return entry


@dataclass(frozen=True)
class ArtifactIndex:
    """The index of an artifact directory."""

    directory: Path
    entries: tuple[IndexEntry, ...]

    def find(self, name: str, version: int) -> IndexEntry | None:
        return next((entry for entry in self.entries
                     if entry.name == name and entry.version == version), None)

    def get(self, name: str, version: int) -> IndexEntry:
        """The entry of ``name`` version ``version``.

        Raises:
            FleetError: it was never published here.
        """
        entry = self.find(name, version)
        if entry is None:
            known = sorted(entry.version for entry in self.entries if entry.name == name)
            raise FleetError("this model version is not in the artifact index; publish it "
                             "first ('edge-agent fleet publish')", reason="not_published",
                             model=name, version=version,
                             index=self.directory / INDEX_NAME,
                             published_versions=",".join(map(str, known)) or "none")
        return entry

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.entries, key=lambda entry: (entry.name, entry.version))
        return {"format": INDEX_FORMAT, "bundles": [entry.to_json() for entry in ordered]}


def load_index(directory: Path) -> ArtifactIndex:
    """The index of ``directory`` (empty when there is none yet).

    Raises:
        InputError: the index exists but cannot be read or is malformed.
    """
    directory = Path(directory)
    path = directory / INDEX_NAME
    try:
        data = read_bounded(path, MAX_INDEX_BYTES)
    except FileNotFoundError:
        return ArtifactIndex(directory, ())
    except OSError as exc:
        raise InputError(f"cannot read the artifact index: {exc}", path=path) from exc
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise InputError(f"the artifact index is not JSON: {exc}", path=path) from exc
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT \
            or not isinstance(document.get("bundles"), list):
        raise InputError("the artifact index is not a format-1 index", path=path)
    return ArtifactIndex(directory, tuple(IndexEntry.from_json(raw, path)
                                          for raw in document["bundles"]))


def relative_path(name: str, version: int) -> str:
    return f"{name}/{version}/{name}-{version}{BUNDLE_SUFFIX}"


def bundle_url(base_url: str, entry: IndexEntry) -> str:
    """The URL a device fetches ``entry`` from, given the URL the artifact directory is served
    under (``https://files.example/bundles`` or with a trailing slash)."""
    if not base_url:
        raise FleetError("no artifact base URL is configured ([artifacts] base_url in "
                         "fleet.toml, or --base-url)", reason="no_base_url")
    return base_url.rstrip("/") + "/" + quote(entry.path)


def publish_bundle(bundle: Path, directory: Path, trusted_keys: Iterable[Ed25519PublicKey]
                   ) -> tuple[IndexEntry, bool]:
    """Verify ``bundle`` and add it to the artifact directory.

    Returns:
        The index entry, and whether it was new (False: the same bytes were already there).

    Raises:
        SignatureError, BundleError: the bundle fails verification; nothing is written.
        FleetError: the name and version are published already with other bytes.
        InputError: the artifact directory or its index cannot be written or read.
    """
    bundle, directory = Path(bundle), Path(directory)
    keys = list(trusted_keys)
    if not keys:
        raise FleetError("publishing needs the public keys bundles are signed with "
                         "(--pubkey, or [artifacts] bundle_keys in fleet.toml)", reason="no_keys")
    verified = open_bundle(bundle, keys)
    manifest = verified.manifest
    name, version = manifest["name"], manifest["version"]
    sha256, size = sha256_file(bundle)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot make the artifact directory: {exc}", path=directory) from exc
    # Two publishes at once must not each rewrite the index without the other's entry.
    with locked(directory / LOCK_NAME):
        return _add(bundle, directory, name, version, sha256, size, verified.key_id)


def _add(bundle: Path, directory: Path, name: str, version: int, sha256: str, size: int,
         key_id: str) -> tuple[IndexEntry, bool]:
    index = load_index(directory)
    existing = index.find(name, version)
    if existing is not None:
        if existing.sha256 == sha256 and (directory / existing.path).is_file():
            return existing, False
        if existing.sha256 != sha256:
            raise FleetError("this name and version are published already with other bytes; "
                             "a published version never changes (give the new build a new "
                             "version)", reason="duplicate_version", model=name, version=version,
                             published_sha256=existing.sha256, bundle_sha256=sha256,
                             path=directory / existing.path)
    entry = IndexEntry(name=name, version=version, sha256=sha256, size=size,
                       path=relative_path(name, version), key_id=key_id,
                       published_at=_utc_now())
    target = directory / entry.path
    try:
        with atomic_output_file(target) as temporary:
            shutil.copyfile(bundle, temporary)
            copied_sha256, copied_size = sha256_file(temporary)
            if (copied_sha256, copied_size) != (sha256, size):
                raise FleetError("the bundle changed while it was being published",
                                 reason="changed", path=bundle, expected=sha256,
                                 found=copied_sha256)
        entries = [other for other in index.entries if (other.name, other.version)
                   != (name, version)] + [entry]
        atomic_write_text(directory / INDEX_NAME,
                          json.dumps(ArtifactIndex(directory, tuple(entries)).to_json(),
                                     indent=2) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write the artifact directory: {exc}", path=directory) from exc
    return entry, True


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

