"""The device's model store (design §5.2): installed versions, their engine caches, the pointer.

Layout under the state directory::

    models/<name>/<version>/    an extracted, verified bundle: manifest.json, manifest.sig,
                                model.onnx, optional engines/<fingerprint>.plan, ...
                                Immutable once installed.
    engines/<name>/<version>/   plans and timing caches built on this device by the TensorRT
                                backend; the store only creates it and deletes it with the version
    current                     the pointer: {"schema_version": 1,
                                              "current": {"name": ..., "version": ...} | null,
                                              "previous": {"name": ..., "version": ...} | null}

Crash safety comes from doing every change as one rename:

- a version is extracted into a hidden staging directory beside its final name and renamed into
  place only when every member's hash matched (``VerifiedBundle.extract``);
- a version is deleted by renaming it to a hidden name first, then removing that;
- the pointer is written to a temporary file, fsynced, renamed over ``current`` and the directory
  fsynced (agent/fsutil.py).

So after a crash or power loss ``models/`` holds only complete versions; what a crash can leave is
hidden staging or deletion directories, a pointer temporary file, or an engine cache whose version is
gone, and opening the store removes them. Bytes can still rot on disk: :meth:`ModelStore.load`
re-hashes every file and re-checks the signature before a version is served.

A fresh state directory gets a pointer naming nothing; after that a missing or unreadable pointer is
an error, never "no model", so a damaged store is reported instead of silently serving nothing.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__
from agent.backends.base import ModelArtifacts
from agent.errors import BundleError, ConfigError, SignatureError, StoreError
from agent.fsutil import atomic_write_text, fsync_dir
from models.bundle import open_bundle
from models.manifest import (
    MANIFEST_MEMBER,
    MAX_VERSION,
    SIGNATURE_MEMBER,
    check_compatibility,
    parse_manifest_bytes,
    validate_manifest,
)
from models.signing import compute_key_id, parse_signature_document, verify_manifest

log = logging.getLogger(__name__)

MODELS_DIR = "models"
ENGINE_CACHE_DIR = "engines"
POINTER_FILE = "current"
POINTER_SCHEMA_VERSION = 1
MIN_KEEP_VERSIONS = 2  # the current version and the previous one, for rollback

_CHUNK_BYTES = 1024 * 1024
# Metadata files are small; anything far larger is not one of ours, so do not read it whole.
_MAX_METADATA_BYTES = 1024 * 1024
# Left free beyond a bundle's own size when installing: the filesystem and the engine cache need room.
_FREE_SPACE_MARGIN_BYTES = 64 * 1024 * 1024
# The manifest's rule for model names (models/manifest.py); it also keeps names safe as path parts.
_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_VERSION_DIR = re.compile(r"[1-9][0-9]*")
# Hidden directories the store and VerifiedBundle.extract create beside a version directory.
_STAGING_DIR = re.compile(r"\.[1-9][0-9]*\.(extract|delete)-.+")
# The temporary file atomic_write_text creates beside the pointer.
_POINTER_TEMP = re.compile(re.escape(f".{POINTER_FILE}.") + r".+\.tmp")


@dataclass(frozen=True, order=True)
class ModelRef:
    """One model version by name, as the pointer records it."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}


class ModelStore:
    """Installed model versions under ``state_dir``, and which one is current.

    Opening the store creates its layout when absent and removes what a crash left behind (see the
    module docstring). Mutating methods are serialised by a lock, so the updater and a control
    command may call them from different threads. One daemon owns a state directory.

    Args:
        state_dir: The state directory (``state_dir`` in the configuration).
        trusted_keys: Public keys whose signatures are accepted, at install and at every load.
        keep_versions: How many versions :meth:`garbage_collect` keeps (at least 2).

    Raises:
        ConfigError: ``keep_versions`` is below 2.
        StoreError: the state directory cannot be created or written.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        trusted_keys: Sequence[Ed25519PublicKey],
        keep_versions: int = MIN_KEEP_VERSIONS,
    ) -> None:
        if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or (
            keep_versions < MIN_KEEP_VERSIONS
        ):
            raise ConfigError(
                "invalid value for 'store.keep_versions'",
                key="store.keep_versions",
                expected=f"an integer >= {MIN_KEEP_VERSIONS}",
                found=keep_versions,
            )
        self.state_dir = Path(state_dir)
        self.keep_versions = keep_versions
        self._trusted_keys = tuple(trusted_keys)
        self._lock = threading.RLock()
        self._models_dir = self.state_dir / MODELS_DIR
        self._engines_dir = self.state_dir / ENGINE_CACHE_DIR
        self._pointer_path = self.state_dir / POINTER_FILE
        with self._lock:
            self._open()

    # -- reading --------------------------------------------------------------------------------

    def current(self) -> ModelArtifacts | None:
        """The current version (None when none was ever activated), read without re-hashing.

        Call :meth:`load` with its name and version to verify it before serving it.

        Raises:
            StoreError: the pointer is missing or corrupt, or names a version that is not installed.
        """
        current, _ = self._read_pointer()
        return None if current is None else self._installed(current, role="current")

    def previous(self) -> ModelArtifacts | None:
        """The version :meth:`rollback` would return to, or None.

        Raises:
            StoreError: as :meth:`current`.
        """
        _, previous = self._read_pointer()
        return None if previous is None else self._installed(previous, role="previous")

    def names(self) -> list[str]:
        """The names of the installed models, sorted."""
        return sorted(
            entry.name
            for entry in _scan(self._models_dir)
            if _MODEL_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )

    def versions(self, name: str) -> list[int]:
        """The installed versions of ``name``, ascending (empty for an unknown name).

        Raises:
            StoreError: ``name`` is not a valid model name.
        """
        _check_name(name)
        return sorted(
            int(entry.name)
            for entry in _scan(self._models_dir / name)
            if _VERSION_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )

    def load(self, name: str, version: int) -> ModelArtifacts:
        """An installed version, verified again as if it had just arrived.

        The signature of ``manifest.json`` is checked against the trusted keys, the manifest is
        validated and checked against this agent's version, and every artifact's size and sha256
        are compared with the manifest. A file corrupted on disk, cut short by a power loss, or
        edited is reported by name.

        Raises:
            StoreError: the version is not installed, or a file is missing, unreadable, of the wrong
                size or hash, or the manifest no longer verifies.
        """
        ref = _ref(name, version)
        directory = self._require_installed(ref)
        manifest_path = directory / MANIFEST_MEMBER
        signature_path = directory / SIGNATURE_MEMBER
        manifest_bytes = _read_small(manifest_path)
        signature_bytes = _read_small(signature_path)
        if not self._trusted_keys:
            raise StoreError("no trusted public keys: every installed model is re-verified at "
                             "start; pass --pubkey or set trust.public_keys", path=manifest_path)
        try:
            verify_manifest(manifest_bytes, signature_bytes, self._trusted_keys)
        except SignatureError as exc:
            raise StoreError(
                "installed manifest no longer verifies (manifest.json or manifest.sig changed on "
                "disk, or the signing key is no longer trusted)",
                path=manifest_path,
                signature=signature_path,
                reason=exc.message,
                key_id=exc.fields.get("key_id"),
            ) from exc
        manifest = self._parse_manifest(manifest_bytes, manifest_path, ref)
        try:
            check_compatibility(manifest, __version__)
        except BundleError as exc:
            raise StoreError(
                f"installed version cannot run on this agent: {exc.message}",
                path=manifest_path,
                **exc.fields,
            ) from exc
        for member in sorted(manifest["artifacts"]):
            _verify_file(directory / member, manifest["artifacts"][member])
        return self._artifacts(ref, directory, manifest)

    def engine_cache_dir(self, name: str, version: int) -> Path:
        """The engine cache directory of an installed version, created if absent.

        Raises:
            StoreError: the version is not installed, or the directory cannot be created.
        """
        ref = _ref(name, version)
        self._require_installed(ref)
        return self._engine_dir(ref, create=True)

    # -- changing -------------------------------------------------------------------------------

    def install(self, bundle_path: Path) -> ModelArtifacts:
        """Verify a bundle and install its version (not activated).

        The bundle is verified completely first (signature, then every artifact hash, then
        compatibility with this agent), then extracted atomically. Installing a version that is
        already installed with the identical manifest changes nothing and returns the installed
        version, verified; one whose installed copy fails verification (a file damaged on disk)
        is replaced from the bundle.

        Returns:
            The installed version.

        Raises:
            SignatureError: the bundle is unsigned or not signed by a trusted key.
            BundleError: the bundle is unsafe, tampered with, or needs a newer agent; or extracting
                it failed. Nothing is installed.
            StoreError: this version is installed with a different manifest (versions are
                immutable), or there is not enough free space.
        """
        bundle = open_bundle(Path(bundle_path), self._trusted_keys, agent_version=__version__)
        manifest = bundle.manifest
        ref = ModelRef(manifest["name"], manifest["version"])
        with self._lock:
            directory = self._version_dir(ref)
            if directory.exists() or directory.is_symlink():
                if self._publishes_other_content(directory, bundle.read_member(MANIFEST_MEMBER)):
                    raise StoreError(
                        "this version is already installed with a different manifest; "
                        "versions are immutable, so publish the change as a new version",
                        name=ref.name,
                        version=ref.version,
                        path=directory,
                    )
                try:
                    installed = self.load(ref.name, ref.version)
                except (StoreError, BundleError, SignatureError) as exc:
                    # The same publication, but a file of it is damaged on disk (or its manifest
                    # no longer verifies): the verified bundle repairs it.
                    log.warning("the installed copy of %s is damaged (%s); replacing it from "
                                "the bundle", ref, exc)
                    self._delete_version(ref)
                else:
                    log.info("%s is already installed", ref)
                    return installed
            self._check_free_space(manifest)
            # A cache left by an earlier install of this name and version must not outlive it.
            self._remove_tree(self._engine_dir(ref, create=False))
            _make_dir(directory.parent)
            bundle.extract(directory)
            log.info("installed %s (signed by key %s)", ref, bundle.key_id)
            return self._artifacts(ref, directory, manifest)

    def _publishes_other_content(self, directory: Path, manifest_bytes: bytes) -> bool:
        """Whether an installed version holds a different, intact publication than
        ``manifest_bytes``: its manifest differs and is not merely damaged. Damaged means
        unreadable, or signed by a trusted key whose signature no longer matches; a manifest
        signed by a key no longer trusted is taken as intact (nothing shows it is not), so
        versions stay immutable across key rotations."""
        try:
            installed = _read_small(directory / MANIFEST_MEMBER)
            signature = parse_signature_document(_read_small(directory / SIGNATURE_MEMBER))
        except (StoreError, SignatureError):
            return False  # unreadable: damage, repaired from the bundle
        if installed == manifest_bytes:
            return False
        trusted = {compute_key_id(key): key for key in self._trusted_keys}
        key = trusted.get(signature.key_id)
        if key is None:
            return True
        try:
            key.verify(signature.signature, installed)
        except InvalidSignature:
            return False  # changed on disk after it was signed: damage
        return True

    def activate(self, name: str, version: int) -> ModelArtifacts:
        """Make an installed version current; the current one becomes the previous one.

        Activating the current version changes nothing. An unreadable pointer is replaced (with a
        warning), so activating a known-good version is the way out of a damaged pointer.

        Raises:
            StoreError: the version is not installed, or the pointer cannot be written.
        """
        ref = _ref(name, version)
        with self._lock:
            artifacts = self._installed(ref, role="requested")
            try:
                current, _ = self._read_pointer()
            except StoreError as exc:
                log.warning("replacing an unreadable pointer: %s", exc)
                current = None
            if current != ref:
                self._write_pointer(ref, current)
                log.info("activated %s (previous: %s)", ref, current or "none")
            return artifacts

    def rollback(self) -> ModelArtifacts:
        """Make the previous version current again.

        Afterwards there is no previous version: a second rollback (a redelivered command, say)
        fails instead of swinging back to the version that was just abandoned.

        Returns:
            The version now current.

        Raises:
            StoreError: there is no previous version, it is no longer installed, or the pointer is
                unreadable or cannot be written.
        """
        with self._lock:
            current, previous = self._read_pointer()
            if previous is None:
                raise StoreError(
                    "nothing to roll back to: there is no previous version",
                    current=str(current) if current else None,
                )
            artifacts = self._installed(previous, role="previous")
            self._write_pointer(previous, None)
            log.warning("rolled back from %s to %s", current, previous)
            return artifacts

    def garbage_collect(self, *, pinned: Iterable[ModelRef] = ()) -> list[ModelRef]:
        """Delete installed versions (and their engine caches) beyond ``keep_versions``.

        The current and previous versions, and any ``pinned`` ones (a version the updater has
        staged but not yet activated), are never deleted. The remaining slots go to the newest
        other versions, those of the current model first.

        Returns:
            The versions deleted.

        Raises:
            StoreError: the pointer is unreadable (nothing is deleted while the current version is
                unknown), or a deletion fails.
        """
        with self._lock:
            current, previous = self._read_pointer()
            protected = {ref for ref in (current, previous, *pinned) if ref is not None}
            installed = [
                ModelRef(name, version) for name in self.names() for version in self.versions(name)
            ]
            current_name = current.name if current is not None else None
            others = sorted(
                (ref for ref in installed if ref not in protected),
                key=lambda ref: (ref.name == current_name, ref.version),
                reverse=True,
            )
            slots = max(0, self.keep_versions - len(protected.intersection(installed)))
            doomed = others[slots:]
            for ref in doomed:
                self._delete_version(ref)
                log.info("deleted %s", ref)
            return doomed

    # -- internals ------------------------------------------------------------------------------

    def close(self) -> None:
        """Let go of the state directory (another process may open it then)."""
        self._release()

    def _open(self) -> None:
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise StoreError("the state directory is not a directory", path=self.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                "cannot create the model store", path=self.state_dir, reason=exc.strerror
            ) from exc
        self._release = weakref.finalize(self, _unlock_state_dir, _lock_state_dir(self.state_dir))
        try:
            fresh = not self._models_dir.exists() and not _exists(self._pointer_path)
            if fresh:
                # The pointer first: a store whose models/ exists has written one.
                self._write_pointer(None, None)
            for directory in (self._models_dir, self._engines_dir):
                if not directory.is_dir():
                    directory.mkdir()
                    fsync_dir(self.state_dir)
        except OSError as exc:
            raise StoreError(
                "cannot create the model store", path=self.state_dir, reason=exc.strerror
            ) from exc
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        try:
            self._remove_leftovers_now()
        except StoreError as exc:  # a read-only disk (remounted after errors) can still serve
            log.warning("could not remove what an interrupted operation left behind: %s", exc)

    def _remove_leftovers_now(self) -> None:
        for entry in _scan(self.state_dir):
            if _POINTER_TEMP.fullmatch(entry.name):
                log.info("removing an unfinished pointer write: %s", entry.path)
                _unlink(Path(entry.path))
        for name_entry in _scan(self._models_dir):
            for entry in _scan(Path(name_entry.path)):
                if _STAGING_DIR.fullmatch(entry.name):
                    log.info("removing an unfinished install or deletion: %s", entry.path)
                    self._remove_tree(Path(entry.path))
        for name_entry in _scan(self._engines_dir):
            for entry in _scan(Path(name_entry.path)):
                orphan = bool(_VERSION_DIR.fullmatch(entry.name)) and not (
                    self._models_dir / name_entry.name / entry.name
                ).is_dir()
                if orphan or _STAGING_DIR.fullmatch(entry.name):
                    log.info("removing the engine cache of a deleted version: %s", entry.path)
                    self._remove_tree(Path(entry.path))

    def _read_pointer(self) -> tuple[ModelRef | None, ModelRef | None]:
        path = self._pointer_path
        try:
            data = _read_small(path)
        except StoreError as exc:
            if not _exists(path):
                raise StoreError(
                    "the current-version pointer is missing from an initialised store (deleted or "
                    "lost); activate a version to recreate it",
                    path=path,
                ) from exc
            raise
        try:
            document = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._corrupt_pointer(f"not UTF-8 JSON: {exc}") from exc
        except RecursionError:
            raise self._corrupt_pointer("nested too deeply") from None
        if not isinstance(document, dict):
            raise self._corrupt_pointer("not a JSON object")
        if document.get("schema_version") != POINTER_SCHEMA_VERSION:
            raise self._corrupt_pointer(f"schema_version is not {POINTER_SCHEMA_VERSION}")
        return self._pointer_entry(document, "current"), self._pointer_entry(document, "previous")

    def _pointer_entry(self, document: dict[str, Any], field: str) -> ModelRef | None:
        value = document.get(field)
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "version"}:
            raise self._corrupt_pointer(f"'{field}' is not null or {{name, version}}")
        try:
            return _ref(value["name"], value["version"])
        except StoreError as exc:
            raise self._corrupt_pointer(f"'{field}': {exc}") from exc

    def _corrupt_pointer(self, reason: str) -> StoreError:
        return StoreError(
            "the current-version pointer is corrupt; activate a version to replace it",
            path=self._pointer_path,
            reason=reason,
        )

    def _write_pointer(self, current: ModelRef | None, previous: ModelRef | None) -> None:
        document = {
            "schema_version": POINTER_SCHEMA_VERSION,
            "current": current.to_json() if current else None,
            "previous": previous.to_json() if previous else None,
        }
        try:
            atomic_write_text(self._pointer_path, json.dumps(document, indent=2) + "\n")
        except OSError as exc:
            raise StoreError(
                "cannot write the current-version pointer",
                path=self._pointer_path,
                reason=exc.strerror,
            ) from exc

    def _version_dir(self, ref: ModelRef) -> Path:
        return self._models_dir / ref.name / str(ref.version)

    def _engine_dir(self, ref: ModelRef, *, create: bool) -> Path:
        directory = self._engines_dir / ref.name / str(ref.version)
        if create:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    "cannot create the engine cache directory", path=directory, reason=exc.strerror
                ) from exc
        return directory

    def _require_installed(self, ref: ModelRef, role: str = "requested") -> Path:
        directory = self._version_dir(ref)
        if directory.is_symlink() or not directory.is_dir():
            raise StoreError(
                f"the {role} version is not installed",
                name=ref.name,
                version=ref.version,
                path=directory,
            )
        return directory

    def _installed(self, ref: ModelRef, *, role: str) -> ModelArtifacts:
        """An installed version from its manifest, without re-hashing (see :meth:`load`)."""
        directory = self._require_installed(ref, role)
        manifest_path = directory / MANIFEST_MEMBER
        manifest = self._parse_manifest(_read_small(manifest_path), manifest_path, ref)
        return self._artifacts(ref, directory, manifest)

    def _parse_manifest(self, data: bytes, path: Path, ref: ModelRef) -> dict[str, Any]:
        try:
            manifest = parse_manifest_bytes(data)
            validate_manifest(manifest)
        except BundleError as exc:
            raise StoreError(
                f"installed manifest is invalid: {exc.message}", path=path, **exc.fields
            ) from exc
        found = ModelRef(manifest["name"], manifest["version"])
        if found != ref:
            raise StoreError(
                "installed manifest describes another version",
                path=path,
                expected=str(ref),
                found=str(found),
            )
        return manifest

    def _artifacts(
        self, ref: ModelRef, directory: Path, manifest: dict[str, Any]
    ) -> ModelArtifacts:
        return ModelArtifacts(
            name=ref.name,
            version=ref.version,
            directory=directory,
            manifest=manifest,
            engine_cache_dir=self._engine_dir(ref, create=False),  # made by the TensorRT cache
        )

    def _check_free_space(self, manifest: dict[str, Any]) -> None:
        needed_bytes = sum(int(entry["size"]) for entry in manifest["artifacts"].values())
        needed_bytes += _FREE_SPACE_MARGIN_BYTES
        try:
            free_bytes = shutil.disk_usage(self._models_dir).free
        except OSError:
            return  # cannot tell; extraction reports a full disk cleanly anyway
        if free_bytes < needed_bytes:
            raise StoreError(
                "not enough free space to install the bundle",
                path=self._models_dir,
                expected=f">= {needed_bytes} bytes free",
                found=f"{free_bytes} bytes free",
            )

    def _delete_version(self, ref: ModelRef) -> None:
        # Renamed out of the way first, so a crash mid-removal leaves a hidden directory that the
        # next start removes, never a half-deleted version under its real name.
        for directory in (self._version_dir(ref), self._engine_dir(ref, create=False)):
            if not _exists(directory):
                continue
            doomed = directory.with_name(f".{ref.version}.delete-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(directory, doomed)
            except OSError as exc:
                raise StoreError(
                    "cannot delete an installed version", path=directory, reason=exc.strerror
                ) from exc
            fsync_dir(directory.parent)
            self._remove_tree(doomed)
            try:
                directory.parent.rmdir()  # the model's last version: drop its directory too
            except OSError:
                pass

    @staticmethod
    def _remove_tree(path: Path) -> None:
        if not _exists(path):
            return
        try:
            if path.is_symlink() or not path.is_dir():
                path.unlink()
            else:
                shutil.rmtree(path)
        except OSError as exc:
            raise StoreError("cannot remove from the store", path=path, reason=exc.strerror) from exc


# --------------------------------------------------------------------------------------------------
# Helpers


# One lock per state directory and process: a second daemon (or a control command) on the same
# directory is refused instead of racing this one's installs and clean-ups. Stores opened twice
# in one process share it.
LOCK_FILE = "lock"
_held: dict[str, list[int]] = {}  # real path -> [fd, users]
_held_guard = threading.Lock()


def remove_store(state_dir: Path) -> None:
    """Delete a model store's state directory (nothing when there is none), under its lock.

    Raises:
        StoreError: another edge-agent process holds the directory (``pid`` names it), or its
            lock cannot be taken.
    """
    if not Path(state_dir).is_dir():
        return
    key = _lock_state_dir(Path(state_dir))
    try:
        shutil.rmtree(state_dir, ignore_errors=True)
    finally:
        _unlock_state_dir(key)


def _lock_state_dir(state_dir: Path) -> str:
    key = os.path.realpath(state_dir)
    path = os.path.join(key, LOCK_FILE)
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            return key
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            writable = True
        except OSError as first:
            try:  # a read-only disk: lock what is there, write nothing
                fd, writable = os.open(path, os.O_RDONLY), False
            except OSError:
                # The first failure says why (permission denied), not the fallback's (no file).
                log.warning("cannot lock the state directory (%s); not guarding it",
                            first.strerror)
                _held[key] = [-1, 1]
                return key
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise StoreError("the state directory is in use by another edge-agent process",
                                 path=key, pid=holder) from None
            raise StoreError("cannot lock the state directory", path=key,
                             reason=exc.strerror) from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = [fd, 1]
    return key


def _unlock_state_dir(key: str) -> None:
    with _held_guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            if entry[0] >= 0:
                os.close(entry[0])  # releases the flock


def _ref(name: object, version: object) -> ModelRef:
    """A checked reference: the name and version become path parts, so both are validated."""
    checked_name = _check_name(name)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise StoreError("invalid model version", expected=f"an integer from 1 to {MAX_VERSION}",
                         found=repr(version))
    return ModelRef(checked_name, version)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or _MODEL_NAME.fullmatch(name) is None:
        raise StoreError(
            "invalid model name", expected="a slug [a-z0-9][a-z0-9._-]*", found=repr(name)
        )
    return name


def _read_small(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_METADATA_BYTES + 1)
    except FileNotFoundError as exc:
        raise StoreError("installed file is missing", path=path) from exc
    except OSError as exc:
        raise StoreError("cannot read from the store", path=path, reason=exc.strerror) from exc
    if len(data) > _MAX_METADATA_BYTES:
        raise StoreError("file is too large to be store metadata", path=path)
    return data


def _verify_file(path: Path, entry: dict[str, Any]) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError as exc:
        raise StoreError("installed file is missing", path=path) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError("installed file was replaced by a symbolic link", path=path) from exc
        raise StoreError("cannot read installed file", path=path, reason=exc.strerror) from exc
    with os.fdopen(fd, "rb") as handle:
        file_stat = os.fstat(handle.fileno())
        if not stat.S_ISREG(file_stat.st_mode):
            raise StoreError("installed file is not a regular file", path=path)
        if file_stat.st_size != entry["size"]:
            raise StoreError(
                "installed file has the wrong size (corrupted or cut short on disk)",
                path=path,
                expected=f"{entry['size']} bytes",
                found=f"{file_stat.st_size} bytes",
            )
        digest = hashlib.sha256()
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise StoreError(
            "installed file does not match its manifest hash (corrupted on disk)",
            path=path,
            expected=entry["sha256"],
            found=digest.hexdigest(),
        )


def _make_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError("cannot create a store directory", path=directory,
                         reason=exc.strerror) from exc
    fsync_dir(directory.parent)


def _scan(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise StoreError("cannot list a store directory", path=directory,
                         reason=exc.strerror) from exc


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreError("cannot remove from the store", path=path, reason=exc.strerror) from exc
