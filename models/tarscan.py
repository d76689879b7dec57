"""Safe low-level reading of a bundle's tar: the header scan, then member bytes by byte range.

Bundles arrive over the network on the device, so every tar header is scanned first and anything
unsafe or unexpected is refused (absolute paths, ``..``, links, devices, duplicates, oversized or
unknown members, oversized extended headers, a missing end of archive) before any content is read.

Member contents are read by byte range from the file (``offset_data``/``size`` of the scanned
header), never through ``tarfile``'s extraction, so no name from the archive ever becomes a path on
disk except the fixed names a bundle allows (models/manifest.py).
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.errors import BundleError
from agent.fsutil import stream_sha256
from models.manifest import ENGINES_DIR, METADATA_MEMBERS, is_allowed_member_name

MEBIBYTE = 1024 * 1024
GIBIBYTE = 1024 * MEBIBYTE
TAR_BLOCK_BYTES = 512
# tar header types that carry metadata for the next member and that tarfile reads whole into memory.
_EXTENDED_HEADER_TYPES = frozenset({b"x", b"g", b"L", b"K"})
# Entry types whose size tarfile does not skip (it reads the next header straight after them): hard
# and symbolic links, devices, directories and FIFOs.
_DATALESS_TYPES = frozenset({b"1", b"2", b"3", b"4", b"5", b"6"})


@dataclass(frozen=True)
class BundleLimits:
    """Bounds applied while scanning a bundle, before any content is read.

    Attributes:
        max_metadata_bytes: Largest ``manifest.json``/``manifest.sig`` (they are read into memory),
            and largest extended tar header.
        max_member_bytes: Largest other member.
        max_total_bytes: Largest sum of all member sizes.
        max_members: Most tar entries (files and directories).
    """

    max_metadata_bytes: int = 1 * MEBIBYTE
    max_member_bytes: int = 4 * GIBIBYTE
    max_total_bytes: int = 16 * GIBIBYTE
    max_members: int = 64


DEFAULT_LIMITS = BundleLimits()


@dataclass(frozen=True)
class Member:
    """A regular file in the bundle, located by byte range in the tar file."""

    name: str
    offset_data: int
    size: int


def open_bundle_file(path: Path) -> BinaryIO:
    """Open a bundle for binary reading; the caller closes it.

    Raises:
        BundleError: the file does not exist or cannot be opened.
    """
    try:
        return open(path, "rb")
    except FileNotFoundError as exc:
        raise BundleError("bundle not found", path=path) from exc
    except OSError as exc:
        raise BundleError("cannot read bundle", path=path, reason=exc.strerror) from exc


def scan_members(handle: BinaryIO, path: Path, limits: BundleLimits) -> dict[str, Member]:
    """Scan every tar header and return the regular members; refuse anything unsafe.

    Raises:
        BundleError: not a tar ("not a bundle"), truncated, or a member that is unsafe, unknown,
            duplicated or too large (the error names the member).
    """
    file_size_bytes = os.fstat(handle.fileno()).st_size
    _check_extended_headers(handle, path, limits)
    handle.seek(0)
    try:
        tar = tarfile.open(fileobj=handle, mode="r:")
    except (tarfile.TarError, EOFError, ValueError) as exc:
        raise BundleError("not a bundle: not an uncompressed tar file", path=path) from exc
    except (MemoryError, RecursionError) as exc:  # a header the guard above missed
        raise BundleError("not a bundle: a tar header too large or too deeply chained",
                          path=path) from exc

    members: dict[str, Member] = {}
    seen_names: set[str] = set()
    total_bytes = 0
    entry_count = 0
    archive_end = 0
    while True:
        try:
            info = tar.next()
        except (tarfile.TarError, EOFError, ValueError) as exc:
            raise BundleError("truncated or corrupt bundle", path=path, reason=str(exc)) from exc
        except (MemoryError, RecursionError) as exc:  # a header the guard above missed
            raise BundleError("corrupt bundle: a tar header too large or too deeply chained",
                              path=path) from exc
        if info is None:
            break
        entry_count += 1
        if entry_count > limits.max_members:
            raise BundleError("too many members", path=path, expected=f"<= {limits.max_members}")
        name = info.name
        _check_member_name(name, path)
        _check_member_type(info, path)
        if name in seen_names:
            raise BundleError("duplicate member", path=path, member=_shown(name))
        seen_names.add(name)
        if info.isdir():
            # tarfile reads the next header straight after a directory's, whatever its size says.
            archive_end = max(archive_end, info.offset_data)
            continue
        if not is_allowed_member_name(name):
            raise BundleError("unexpected member", path=path, member=_shown(name))
        limit_bytes = (
            limits.max_metadata_bytes if name in METADATA_MEMBERS else limits.max_member_bytes
        )
        if info.size > limit_bytes:
            raise BundleError(
                "member is too large",
                path=path,
                member=name,
                expected=f"<= {limit_bytes} bytes",
                found=f"{info.size} bytes",
            )
        total_bytes += info.size
        if total_bytes > limits.max_total_bytes:
            raise BundleError(
                "bundle is too large in total",
                path=path,
                expected=f"<= {limits.max_total_bytes} bytes",
            )
        if info.offset_data + info.size > file_size_bytes:
            raise BundleError("truncated bundle: member data is cut off", path=path, member=name)
        members[name] = Member(name=name, offset_data=info.offset_data, size=info.size)
        archive_end = max(archive_end, info.offset_data + _round_up_to_block(info.size))
    _check_archive_end(handle, path, archive_end)
    return members


def _shown(name: str) -> str:
    """A member name fit for a one-line error (control characters escaped)."""
    return name if name.isprintable() else ascii(name)


def _check_member_name(name: str, path: Path) -> None:
    shown = _shown(name)
    if "\x00" in name:
        raise BundleError("member name contains a NUL byte", path=path, member=shown)
    if "\\" in name:
        raise BundleError("member name contains a backslash", path=path, member=shown)
    if name.startswith("/"):
        raise BundleError("member has an absolute path", path=path, member=shown)
    parts = name.split("/")
    if ".." in parts:
        raise BundleError("member path has a '..' component", path=path, member=shown)
    if any(part in ("", ".") for part in parts):
        raise BundleError("member path has an empty or '.' component", path=path, member=shown)


def _check_member_type(info: tarfile.TarInfo, path: Path) -> None:
    name = _shown(info.name)
    if info.issym():
        raise BundleError(
            "member is a symbolic link", path=path, member=name, target=_shown(info.linkname)
        )
    if info.islnk():
        raise BundleError(
            "member is a hard link", path=path, member=name, target=_shown(info.linkname)
        )
    if info.ischr() or info.isblk():
        raise BundleError("member is a device file", path=path, member=name)
    if info.isfifo():
        raise BundleError("member is a FIFO", path=path, member=name)
    if info.isdir():
        if info.name != ENGINES_DIR:
            raise BundleError("unexpected directory member", path=path, member=name)
        return
    # tarfile counts GNU sparse files as regular; their data is not one contiguous byte range.
    if not info.isfile() or info.issparse():
        raise BundleError("member is not a regular file", path=path, member=name)


def _check_extended_headers(handle: BinaryIO, path: Path, limits: BundleLimits) -> None:
    """Refuse oversized pax / GNU long-name headers before tarfile reads them whole into memory."""
    offset = 0
    # A member has at most a few extension headers in front of it; more is a flood, not a bundle.
    max_headers = 4 * (limits.max_members + 1)
    for header_count in range(max_headers + 1):
        if header_count == max_headers:
            raise BundleError("too many tar headers", path=path, expected=f"<= {max_headers}")
        handle.seek(offset)
        header = handle.read(TAR_BLOCK_BYTES)
        if len(header) < TAR_BLOCK_BYTES or not _header_checksum_ok(header):
            return  # end of archive, or something tarfile itself will report
        size_bytes = _header_size(header)
        if size_bytes is None:
            return
        entry_type = header[156:157]
        if entry_type in _EXTENDED_HEADER_TYPES and size_bytes > limits.max_metadata_bytes:
            raise BundleError(
                "extended tar header is too large",
                path=path,
                offset=offset,
                expected=f"<= {limits.max_metadata_bytes} bytes",
            )
        # tarfile skips no data after these, so a size on one would put this walk out of step
        # with tarfile's (and hide what follows from it): no honest tar writes one.
        name = header[:100].split(b"\x00", 1)[0]
        if size_bytes and (entry_type in _DATALESS_TYPES
                           or (entry_type == b"\x00" and name.endswith(b"/"))):
            raise BundleError("corrupt bundle: a link, device or directory entry declares data",
                              path=path, offset=offset, found=f"{size_bytes} bytes")
        offset += TAR_BLOCK_BYTES + _round_up_to_block(size_bytes)


def _header_number(field: bytes) -> int | None:
    """A numeric header field read the way tarfile reads it (octal up to NUL, or base-256)."""
    if field[0] & 0x80:  # GNU base-256, used for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\x00", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def _header_size(header: bytes) -> int | None:
    return _header_number(header[124:136])


_HIGH_BYTES = bytes(range(128, 256))


def _header_checksum_ok(header: bytes) -> bool:
    # tarfile accepts the unsigned and the signed byte sum (old tars wrote the latter), so must we,
    # or this guard would stop early where tarfile goes on reading.
    stored = _header_number(header[148:156])
    blanked = header[:148] + b" " * 8 + header[156:]
    unsigned_sum = sum(blanked)
    # Each byte above 127 counts 256 less when signed; counted in C (a generator over the 512
    # bytes was most of a header check's time, and the daemon opens a bundle three times).
    high_bytes = len(blanked) - len(blanked.translate(None, _HIGH_BYTES))
    signed_sum = unsigned_sum - 256 * high_bytes
    return stored in (unsigned_sum, signed_sum)


def _check_archive_end(handle: BinaryIO, path: Path, archive_end: int) -> None:
    # tarfile silently stops at a cut-off or garbled header after the first member; a whole tar
    # ends with zero blocks, so demand one where the last member ends.
    handle.seek(archive_end)
    block = handle.read(TAR_BLOCK_BYTES)
    if len(block) < TAR_BLOCK_BYTES:
        raise BundleError("truncated bundle: the tar has no end-of-archive marker", path=path)
    if block.count(0) != TAR_BLOCK_BYTES:
        raise BundleError("corrupt bundle: unreadable tar header", path=path, offset=archive_end)


def _round_up_to_block(size_bytes: int) -> int:
    return -(-size_bytes // TAR_BLOCK_BYTES) * TAR_BLOCK_BYTES


def read_range(handle: BinaryIO, member: Member, path: Path) -> bytes:
    """Read a (small) member's bytes whole; ``path`` only names the bundle in errors.

    Raises:
        BundleError: the file ends before the member does.
    """
    handle.seek(member.offset_data)
    data = handle.read(member.size)
    if len(data) != member.size:
        raise BundleError("truncated bundle: member data is cut off", path=path, member=member.name)
    return data


def hash_range(
    handle: BinaryIO, member: Member, path: Path, sink: BinaryIO | None = None
) -> str:
    """Stream a member's bytes through sha256 (and into ``sink``); return the hex digest."""
    handle.seek(member.offset_data)
    digest, size_bytes = stream_sha256(handle, size=member.size, sink=sink)
    if size_bytes < member.size:
        raise BundleError(
            "truncated bundle: member data is cut off", path=path, member=member.name
        )
    return digest
