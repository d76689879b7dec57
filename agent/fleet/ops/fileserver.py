"""``fleet serve DIR``: a static file server for an artifact directory, with what a resuming
download needs: ``Range`` (one range), a strong ``ETag``, ``If-Range``, and ``416`` with
``Content-Range: bytes */SIZE`` for a range that starts past the end.

aiohttp does the HTTP; the semantics are ours, because aiohttp's ``FileResponse`` (3.x) reads
``If-Range`` only as a date: a client resuming with an entity tag (as agent/update/download.py
does) would be sent the requested range of whatever file is now at the path, and a careful client
only notices from the ETag on the answer. Here the file is opened once, its ETag comes from that
open file's ``fstat`` (inode, mtime in ns, size), and the same open file is what is sent, so the
validator and the bytes always belong together even when a publish renames a new file over the
path mid-request.

For a fleet beyond a lab, serve the directory with nginx, an object store or a CDN instead
(docs/fleet.md): they do the same.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from aiohttp import web

__all__ = ["CHUNK_BYTES", "make_app", "serve_directory"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
# A published bundle's path never changes content (artifacts.py): caches may keep it forever.
_IMMUTABLE = "public, max-age=31536000, immutable"


class _Unsatisfiable(Exception):
    pass


def _etag(info: os.stat_result) -> str:
    return f'"{info.st_ino:x}-{info.st_mtime_ns:x}-{info.st_size:x}"'


def _if_range_holds(value: str | None, etag: str, info: os.stat_result) -> bool:
    """Whether a Range may be honoured under ``If-Range`` (RFC 9110 §13.1.5): an entity tag must
    match strongly (a weak one never does); a date must be the file's Last-Modified exactly."""
    if value is None:
        return True
    value = value.strip()
    if value.startswith(('"', "W/")):
        return value == etag
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return False
    return int(when.timestamp()) == int(info.st_mtime)


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """The one range ``header`` asks for, as (start, end exclusive), or None when it is to be
    ignored (malformed, several ranges: RFC 9110 lets a server answer those with the whole file).

    Raises:
        _Unsatisfiable: the range starts at or past the end (416).
    """
    found = _RANGE.fullmatch(header.strip().replace(" ", ""))
    if found is None:
        return None
    first, last = found.groups()
    if not first and not last:
        return None
    if not first:  # the last N bytes
        count = int(last)
        if count == 0 or size == 0:
            raise _Unsatisfiable()
        return max(0, size - count), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise _Unsatisfiable()
    end = min(int(last) + 1, size) if last else size
    return start, end


def _resolve(root: Path, relative: str) -> Path | None:
    """The file ``relative`` names under ``root``, or None: no hidden names (lock and temporary
    files start with a dot), nothing outside the root through ``..`` or a link."""
    parts = [part for part in relative.split("/") if part]
    if not parts or any(part.startswith(".") or "\\" in part or "\x00" in part
                        for part in parts):
        return None
    candidate = root.joinpath(*parts)
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if root != real and root not in real.parents:
        return None
    return real


def _open(path: Path) -> tuple[BinaryIO, os.stat_result] | None:
    try:
        handle = open(path, "rb")
    except OSError:
        return None
    info = os.fstat(handle.fileno())
    if not stat.S_ISREG(info.st_mode):
        handle.close()
        return None
    return handle, info


def make_app(root: Path) -> web.Application:
    """The aiohttp application serving the files under ``root`` (GET and HEAD)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise NotADirectoryError(str(root))

    async def handle(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        path = _resolve(root, request.match_info["path"])
        opened = await loop.run_in_executor(None, _open, path) if path is not None else None
        if opened is None:
            raise web.HTTPNotFound(text="no such file\n")
        handle, info = opened
        try:
            return await _answer(request, handle, info)
        finally:
            await loop.run_in_executor(None, handle.close)

    app = web.Application()
    app.router.add_get("/{path:.*}", handle)  # HEAD too
    return app


async def _answer(request: web.Request, handle: BinaryIO, info: os.stat_result
                  ) -> web.StreamResponse:
    size, etag = info.st_size, _etag(info)
    headers = {
        "ETag": etag,
        "Last-Modified": email.utils.formatdate(info.st_mtime, usegmt=True),
        "Accept-Ranges": "bytes",
        "Content-Type": ("application/json" if request.path.endswith(".json")
                         else "application/octet-stream"),
        "Cache-Control": _IMMUTABLE if request.path.endswith(".bundle") else "no-cache",
    }
    if_none_match = request.headers.get("If-None-Match")
    if if_none_match is not None and (if_none_match.strip() == "*" or etag in [
            tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]):
        return web.Response(status=304, headers=headers)
    start, end, status = 0, size, 200
    range_header = request.headers.get("Range")
    if range_header is not None and _if_range_holds(request.headers.get("If-Range"), etag, info):
        try:
            wanted = _byte_range(range_header, size)
        except _Unsatisfiable:
            headers["Content-Range"] = f"bytes */{size}"
            return web.Response(status=416, headers=headers)
        if wanted is not None:
            start, end = wanted
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    response = web.StreamResponse(status=status, headers=headers)
    response.content_length = end - start
    await response.prepare(request)
    if request.method == "GET":
        loop = asyncio.get_running_loop()
        fd = handle.fileno()
        offset = start
        while offset < end:
            chunk = await loop.run_in_executor(None, os.pread, fd,
                                               min(CHUNK_BYTES, end - offset), offset)
            if not chunk:  # the file was truncated under us: end the answer short
                break
            await response.write(chunk)
            offset += len(chunk)
    await response.write_eof()
    return response


async def serve_directory(root: Path, *, host: str, port: int,
                          stop: asyncio.Event | None = None,
                          started: asyncio.Future[int] | None = None) -> None:
    """Serve ``root`` until ``stop`` is set (or the task is cancelled).

    Args:
        started: Given the bound port once the server listens (``port=0`` picks a free one).
    """
    runner = web.AppRunner(make_app(root), access_log=log)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        log.info("serving %s on http://%s:%d/", root, host, bound)
        if started is not None and not started.done():
            started.set_result(bound)
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()
