"""The model store's API: install, verify, activate, roll back and clean up versions.

See agent/store/__init__.py for the layout under the state directory and how every change stays
crash safe. :class:`ModelStore` is cheap to construct; :meth:`ModelStore.open` takes the state
directory (its lock), lays it out when fresh and removes what a crash left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__
from agent.backends.base import ModelArtifacts
from agent.errors import BundleError, ConfigError, InternalError, SignatureError, StoreError
from agent.fsutil import fsync_dir
from agent.store.files import exists, make_dir, read_small, remove_tree, scan, unlink
from agent.store.lock import lock_state_dir, unlock_state_dir
from agent.store.pointer import (
    MODEL_NAME,
    POINTER_FILE,
    POINTER_TEMP,
    ModelRef,
    check_name,
    model_ref,
    read_pointer,
    write_pointer,
)
from agent.store.verify import parse_installed_manifest, publishes_other_content, verify_installed
from models.bundle import open_bundle
from models.manifest import MANIFEST_MEMBER, check_target

log = logging.getLogger(__name__)

MODELS_DIR = "models"
ENGINE_CACHE_DIR = "engines"
MIN_KEEP_VERSIONS = 2  # the current version and the previous one, for rollback

# Left free beyond a bundle's own size when installing: the filesystem and the engine cache need room.
_FREE_SPACE_MARGIN_BYTES = 64 * 1024 * 1024
_VERSION_DIR = re.compile(r"[1-9][0-9]*")
# Hidden directories the store and VerifiedBundle.extract create beside a version directory.
_STAGING_DIR = re.compile(r"\.[1-9][0-9]*\.(extract|delete)-.+")


class ModelStore:
    """Installed model versions under ``state_dir``, and which one is current.

    Construct it, then :meth:`open` it (or use it as a context manager, which also closes it).
    Mutating methods are serialised by a lock, so the updater and a control command may call them
    from different threads. One process owns a state directory.

    Args:
        state_dir: The state directory (``state_dir`` in the configuration).
        trusted_keys: Public keys whose signatures are accepted, at install and at every load.
        keep_versions: How many versions :meth:`garbage_collect` keeps (at least 2).

    Raises:
        ConfigError: ``keep_versions`` is below 2.
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
        self._release: weakref.finalize | None = None

    # -- opening and closing --------------------------------------------------------------------

    def open(self) -> ModelStore:
        """Take the state directory: lock it, lay it out when fresh (a pointer naming nothing),
        and remove what an interrupted install, deletion or pointer write left behind. Opening
        an open store does nothing. Returns the store.

        Raises:
            StoreError: the state directory is not a directory, cannot be created or written, or
                another process holds it.
        """
        with self._lock:
            if self._release is None or not self._release.alive:
                self._open()
        return self

    def close(self) -> None:
        """Let go of the state directory (another process may open it then)."""
        if self._release is not None:
            self._release()

    def __enter__(self) -> ModelStore:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        if self.state_dir.exists() and not self.state_dir.is_dir():
            raise StoreError("the state directory is not a directory", path=self.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                "cannot create the model store", path=self.state_dir, reason=exc.strerror
            ) from exc
        self._release = weakref.finalize(self, unlock_state_dir, lock_state_dir(self.state_dir))
        try:
            self._lay_out()
        except BaseException:
            self._release()  # not opened: let go of the directory at once
            raise
        self._remove_leftovers()

    def _lay_out(self) -> None:
        try:
            fresh = not self._models_dir.exists() and not exists(self._pointer_path)
            if fresh:
                # The pointer first: a store whose models/ exists has written one.
                write_pointer(self._pointer_path, None, None)
            for directory in (self._models_dir, self._engines_dir):
                if not directory.is_dir():
                    directory.mkdir()
                    fsync_dir(self.state_dir)
        except OSError as exc:
            raise StoreError(
                "cannot create the model store", path=self.state_dir, reason=exc.strerror
            ) from exc

    def _require_open(self) -> None:
        if self._release is None or not self._release.alive:
            raise InternalError("the model store is used before ModelStore.open() (or after "
                                "close())")

    # -- reading --------------------------------------------------------------------------------

    def set_trusted_keys(self, keys: Sequence[Ed25519PublicKey]) -> None:
        """Trust these keys from now on (a configuration reload): later installs and loads are
        checked against them; what is already loaded is not checked again."""
        with self._lock:
            self._trusted_keys = tuple(keys)

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
        self._require_open()
        return sorted(
            entry.name
            for entry in scan(self._models_dir)
            if MODEL_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )

    def versions(self, name: str) -> list[int]:
        """The installed versions of ``name``, ascending (empty for an unknown name).

        Raises:
            StoreError: ``name`` is not a valid model name.
        """
        self._require_open()
        check_name(name)
        return sorted(
            int(entry.name)
            for entry in scan(self._models_dir / name)
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
        ref = model_ref(name, version)
        directory = self._require_installed(ref)
        manifest = verify_installed(directory, ref, self._trusted_keys)
        return self._artifacts(ref, directory, manifest)

    def engine_cache_dir(self, name: str, version: int) -> Path:
        """The engine cache directory of an installed version, created if absent.

        Raises:
            StoreError: the version is not installed, or the directory cannot be created.
        """
        ref = model_ref(name, version)
        self._require_installed(ref)
        return self._engine_dir(ref, create=True)

    # -- changing -------------------------------------------------------------------------------

    def install(self, bundle_path: Path, *, device_class: str | None = None) -> ModelArtifacts:
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
            BundleError: the bundle is unsafe, tampered with, needs a newer agent, or is for
                other devices than ``device_class`` (when given; see
                :func:`models.manifest.check_target`); or extracting it failed. Nothing is
                installed.
            StoreError: this version is installed with a different manifest (versions are
                immutable), or there is not enough free space.
        """
        self._require_open()
        bundle = open_bundle(Path(bundle_path), self._trusted_keys, agent_version=__version__)
        manifest = bundle.manifest
        if device_class is not None:
            check_target(manifest, device_class)
        ref = ModelRef(manifest["name"], manifest["version"])
        with self._lock:
            directory = self._version_dir(ref)
            if exists(directory):
                installed = self._reinstall(ref, directory, bundle.read_member(MANIFEST_MEMBER))
                if installed is not None:
                    return installed
            self._check_free_space(manifest)
            # A cache left by an earlier install of this name and version must not outlive it.
            remove_tree(self._engine_dir(ref, create=False))
            make_dir(directory.parent)
            bundle.extract(directory)
            log.info("installed %s (signed by key %s)", ref, bundle.key_id)
            return self._artifacts(ref, directory, manifest)

    def begin_install(self, manifest: dict[str, Any]) -> Path | None:
        """The first half of an install whose members another process writes (the update's file
        worker, agent/update/fileworker.py): a new, empty staging directory for the version
        ``manifest`` (a verified bundle's) describes, beside where it will be installed, named
        as the start's recovery removes it (``models/<name>/.<version>.extract-<id>``), so
        that a SIGKILL of either process leaves nothing the next :meth:`open` does not clean.
        Write the bundle's members into it (:meth:`VerifiedBundle.write_members
        <models.bundle.VerifiedBundle.write_members>`), then :meth:`finish_install`; or
        :meth:`abandon_install` it.

        Returns:
            The staging directory; None when this version is installed already (call
            :meth:`install`, which tells an intact copy from a damaged one and a different
            publication).

        Raises:
            StoreError: the manifest names no valid model version, there is not enough free
                space, or the directory cannot be made.
        """
        self._require_open()
        ref = model_ref(manifest["name"], manifest["version"])
        with self._lock:
            directory = self._version_dir(ref)
            if exists(directory):
                return None
            self._check_free_space(manifest)
            make_dir(directory.parent)
            staging = directory.with_name(f".{ref.version}.extract-{uuid.uuid4().hex[:12]}")
            try:
                staging.mkdir()
            except OSError as exc:
                raise StoreError("cannot create a staging directory", path=staging,
                                 reason=exc.strerror) from exc
            return staging

    def finish_install(self, staging: Path, manifest: dict[str, Any], manifest_bytes: bytes,
                       key_id: str) -> ModelArtifacts:
        """The second half of :meth:`begin_install`: check what was written into ``staging``
        and rename it into place atomically, under the store's lock. ``manifest`` and
        ``manifest_bytes`` are the verified bundle's (its signature checked over those bytes,
        every member hashed as it was written by the writer); the checks here are that the
        staging directory is the one :meth:`begin_install` made for that version and holds
        exactly that manifest and every artifact at its size. On any error the staging
        directory is removed.

        Raises:
            StoreError: the directory is not a staging directory of this store for that
                version, its manifest differs, an artifact is missing or of the wrong size, the
                version got installed meanwhile, or the rename fails.
        """
        self._require_open()
        staging = Path(staging)
        ref = model_ref(manifest["name"], manifest["version"])
        directory = self._version_dir(ref)
        try:
            with self._lock:
                if staging.parent != directory.parent or not _STAGING_DIR.fullmatch(
                        staging.name) or not staging.name.startswith(f".{ref.version}.extract-"):
                    raise StoreError("not a staging directory of this store for the version",
                                     path=staging, expected=str(ref))
                if read_small(staging / MANIFEST_MEMBER) != manifest_bytes:
                    raise StoreError("the staged manifest differs from the verified one",
                                     path=staging / MANIFEST_MEMBER)
                for member, entry in sorted(manifest["artifacts"].items()):
                    _check_size(staging / member, int(entry["size"]))
                if exists(directory):
                    raise StoreError("the version was installed while it was being staged",
                                     path=directory)
                remove_tree(self._engine_dir(ref, create=False))
                try:
                    os.rename(staging, directory)
                except OSError as exc:
                    raise StoreError("cannot install the staged version", path=directory,
                                     reason=exc.strerror) from exc
                fsync_dir(directory.parent)
        except BaseException:
            self.abandon_install(staging)
            raise
        log.info("installed %s (signed by key %s)", ref, key_id)
        return self._artifacts(ref, directory, manifest)

    def abandon_install(self, staging: Path) -> None:
        """Remove a staging directory of :meth:`begin_install` (gone already: nothing)."""
        try:
            remove_tree(Path(staging))
        except StoreError as exc:
            log.warning("could not remove an unfinished install (the next start does): %s", exc)

    def _reinstall(self, ref: ModelRef, directory: Path,
                   manifest_bytes: bytes) -> ModelArtifacts | None:
        """A version being installed again: the installed copy when it is intact, else None
        once the damaged copy is deleted (the bundle then repairs it).

        Raises:
            StoreError: the installed copy is a different publication of the version.
        """
        if publishes_other_content(directory, manifest_bytes, self._trusted_keys):
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
            return None
        log.info("%s is already installed", ref)
        return installed

    def activate(self, name: str, version: int) -> ModelArtifacts:
        """Make an installed version current; the current one becomes the previous one.

        Activating the current version changes nothing. An unreadable pointer is replaced (with a
        warning), so activating a known-good version is the way out of a damaged pointer.

        Raises:
            StoreError: the version is not installed, or the pointer cannot be written.
        """
        ref = model_ref(name, version)
        with self._lock:
            artifacts = self._installed(ref, role="requested")
            try:
                current, _ = self._read_pointer()
            except StoreError as exc:
                log.warning("replacing an unreadable pointer: %s", exc)
                current = None
            if current != ref:
                write_pointer(self._pointer_path, ref, current)
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
            write_pointer(self._pointer_path, previous, None)
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

    def _remove_leftovers(self) -> None:
        try:
            self._remove_leftovers_now()
        except StoreError as exc:  # a read-only disk (remounted after errors) can still serve
            log.warning("could not remove what an interrupted operation left behind: %s", exc)

    def _remove_leftovers_now(self) -> None:
        for entry in scan(self.state_dir):
            if POINTER_TEMP.fullmatch(entry.name):
                log.info("removing an unfinished pointer write: %s", entry.path)
                unlink(Path(entry.path))
        for name_entry in scan(self._models_dir):
            for entry in scan(Path(name_entry.path)):
                if _STAGING_DIR.fullmatch(entry.name):
                    log.info("removing an unfinished install or deletion: %s", entry.path)
                    remove_tree(Path(entry.path))
        for name_entry in scan(self._engines_dir):
            for entry in scan(Path(name_entry.path)):
                orphan = bool(_VERSION_DIR.fullmatch(entry.name)) and not (
                    self._models_dir / name_entry.name / entry.name
                ).is_dir()
                if orphan or _STAGING_DIR.fullmatch(entry.name):
                    log.info("removing the engine cache of a deleted version: %s", entry.path)
                    remove_tree(Path(entry.path))

    def _read_pointer(self) -> tuple[ModelRef | None, ModelRef | None]:
        self._require_open()
        return read_pointer(self._pointer_path)

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
        self._require_open()
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
        manifest = parse_installed_manifest(read_small(manifest_path), manifest_path, ref)
        return self._artifacts(ref, directory, manifest)

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
            if not exists(directory):
                continue
            doomed = directory.with_name(f".{ref.version}.delete-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(directory, doomed)
            except OSError as exc:
                raise StoreError(
                    "cannot delete an installed version", path=directory, reason=exc.strerror
                ) from exc
            fsync_dir(directory.parent)
            remove_tree(doomed)
            try:
                directory.parent.rmdir()  # the model's last version: drop its directory too
            except OSError:
                pass


def _check_size(path: Path, size_bytes: int) -> None:
    try:
        found = os.lstat(path)
    except OSError as exc:
        raise StoreError("a staged artifact is missing", path=path, reason=exc.strerror) from exc
    if not stat.S_ISREG(found.st_mode) or found.st_size != size_bytes:
        raise StoreError("a staged artifact is not a file of its size", path=path,
                         expected=f"{size_bytes} bytes",
                         found=f"{found.st_size} bytes" if stat.S_ISREG(found.st_mode)
                         else "not a regular file")
