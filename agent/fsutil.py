"""Files, written crash-safe and read with bounds.

Every output goes to a temporary name in the same directory, is flushed and fsynced, and is then
renamed over the final name; the directory is fsynced so the rename survives a power loss. So
nothing half-written is ever left under a final name.

Reads of files that should be small (metadata, keys, tokens) take no more than their limit, and
file content is hashed in chunks, never held whole.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1024 * 1024


class FileTooLargeError(ValueError):
    """A file that should be small (metadata, a key, a token) is larger than its limit."""


class NotARegularFileError(ValueError):
    """A path that should name a regular file names a device, a socket or the like."""


def read_bounded(path: Path, limit_bytes: int, *, regular_only: bool = False) -> bytes:
    """The whole content of a small file, reading at most ``limit_bytes + 1`` bytes of it.

    Raises:
        OSError: as ``open`` and ``read`` raise it (``FileNotFoundError``, ...).
        FileTooLargeError: the file holds more than ``limit_bytes``.
        NotARegularFileError: ``regular_only`` and the path is not a regular file.
    """
    with open(path, "rb") as handle:
        if regular_only and not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise NotARegularFileError(str(path))
        data = handle.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise FileTooLargeError(f"{path} holds more than {limit_bytes} bytes")
    return data


def stream_sha256(handle: BinaryIO, *, size: int | None = None,
                  sink: BinaryIO | None = None) -> tuple[str, int]:
    """Hash what ``handle`` yields from its position to its end, or ``size`` bytes of it, in
    chunks, copying each chunk to ``sink`` when given.

    Returns:
        The sha256 hex digest and the number of bytes read (fewer than ``size`` when the file
        ends first: the caller decides whether that is an error).
    """
    digest = hashlib.sha256()
    done = 0
    while size is None or done < size:
        chunk = handle.read(CHUNK_BYTES if size is None else min(CHUNK_BYTES, size - done))
        if not chunk:
            break
        digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
        done += len(chunk)
    return digest.hexdigest(), done


def sha256_file(path: Path) -> tuple[str, int]:
    """A file's sha256 hex digest and size, read in chunks."""
    with open(path, "rb") as handle:
        return stream_sha256(handle)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it are durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically with permissions ``mode``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, *, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


@contextlib.contextmanager
def atomic_output_file(path: Path, *, mode: int = 0o644, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was. ``exclusive``:
    never replace an existing ``path`` (``FileExistsError``), even one that appeared while the
    file was being written (another process writing the same name).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp_name)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp_path, mode)
        if exclusive:
            _link_new(tmp_path, path)
        else:
            os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise
    fsync_dir(path.parent)


def _link_new(tmp_path: Path, path: Path) -> None:
    """Give ``tmp_path``'s file the name ``path`` unless that name exists (atomically, with a
    hard link), then drop the temporary name."""
    try:
        os.link(tmp_path, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: check, then rename (a small window)
        if path.exists():
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp_path, path)
        return
    tmp_path.unlink()


@contextlib.contextmanager
def staging_dir(parent: Path, prefix: str = ".staging-") -> Iterator[Path]:
    """A temporary directory under ``parent``, removed on exit whatever happens."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
