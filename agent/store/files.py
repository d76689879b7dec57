"""File operations of the model store, each failure a :class:`~agent.errors.StoreError` that
names the path: small metadata reads, checking an installed file against its manifest entry,
listing, creating and removing."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from agent.errors import StoreError
from agent.fsutil import FileTooLargeError, fsync_dir, read_bounded, stream_sha256

# Metadata files are small; anything far larger is not one of ours, so do not read it whole.
MAX_METADATA_BYTES = 1024 * 1024


def read_small(path: Path) -> bytes:
    """A metadata file (a manifest, its signature, the pointer) of the store."""
    try:
        return read_bounded(path, MAX_METADATA_BYTES)
    except FileNotFoundError as exc:
        raise StoreError("installed file is missing", path=path) from exc
    except FileTooLargeError:
        raise StoreError("file is too large to be store metadata", path=path) from None
    except OSError as exc:
        raise StoreError("cannot read from the store", path=path, reason=exc.strerror) from exc


def verify_file(path: Path, entry: dict[str, Any]) -> None:
    """Check an installed file against its manifest entry (``size`` and ``sha256``): a file
    corrupted on disk, cut short by a power loss, edited, or replaced by a link is named."""
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
        digest, _ = stream_sha256(handle)
    if digest != entry["sha256"]:
        raise StoreError(
            "installed file does not match its manifest hash (corrupted on disk)",
            path=path,
            expected=entry["sha256"],
            found=digest,
        )


def make_dir(directory: Path) -> None:
    """Create ``directory`` (and its parents) durably, if absent."""
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


def scan(directory: Path) -> list[os.DirEntry[str]]:
    """The entries of ``directory``; none when it does not exist."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise StoreError("cannot list a store directory", path=directory,
                         reason=exc.strerror) from exc


def exists(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling symbolic link included."""
    return path.exists() or path.is_symlink()


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreError("cannot remove from the store", path=path, reason=exc.strerror) from exc


def remove_tree(path: Path) -> None:
    """Remove a file, link or directory tree; nothing when absent."""
    if not exists(path):
        return
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as exc:
        raise StoreError("cannot remove from the store", path=path, reason=exc.strerror) from exc
