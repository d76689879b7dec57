"""Fetching a bundle: resumable, verified, bounded in time and size.

A board's link drops, stalls for minutes and comes back; a file server replaces a bundle while a
board is half way through it; a disk fills up. :func:`download` keeps what arrived in a partial
file beside the destination (``<destination>.part``) with a small JSON sidecar naming the source
and the server's validator (a strong ETag, else Last-Modified), so a retry, and a new process
after a SIGKILL or power loss, goes on from where the bytes stopped with ``Range`` and
``If-Range``. The server answers ``If-Range`` with the whole file when it has changed, so two
versions are never spliced together; a ranged answer that does not start where the part ends is
never appended either. The destination appears (fsync, atomic rename) only once every byte has
arrived and the sha256 and size match what the caller expects.

Failures carry a stable ``reason`` (:class:`agent.errors.DownloadError`): ``bad_source``,
``bad_request``, ``not_found``, ``unreadable``, ``http_error``, ``too_large``, ``size_mismatch``,
``hash_mismatch``, ``disk_full``, ``write_error``, ``unreachable`` (the source stayed unreachable
past the deadline) and ``deadline`` (bytes were flowing, too slowly to finish in time). The part is
kept for ``unreachable``, ``deadline`` and cancellation, which a later call resumes; the other
failures mean it can never become right, so it is removed. The updater calls
:func:`discard_partial` when it gives up on a bundle.

The transfer runs in a thread of its own, with the standard library's ``http.client``: reading
sockets, hashing and writing a file of gigabytes are blocking work that must not run on the
daemon's serving event loop, and a thread that owns the whole transfer keeps them off it with no
hand-over per chunk. Plain socket timeouts give the stall detection, and cancelling the awaiting
task shuts the socket down from the loop's side, which ends a blocked read at once (aiohttp would
bring its own loop-side reads and still need a thread for hashing and writes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import errno
import hashlib
import http.client
import json
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

from agent import __version__
from agent.update.priority import lower_this_thread
from agent.errors import ConfigError, DownloadError, first_line
from agent.fsutil import atomic_write_text, fsync_dir

__all__ = [
    "DownloadPolicy",
    "DownloadProgress",
    "DownloadResult",
    "discard_partial",
    "display_source",
    "download",
    "download_blocking",
    "partial_files",
]

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"
SIDECAR_SUFFIX = ".part.json"
SIDECAR_FORMAT = 1
SIDECAR_MAX_BYTES = 64 * 1024
CHUNK_BYTES = 256 * 1024
MAX_REDIRECTS = 5
# How long a cancelled download waits for its thread to close the part file before the
# cancellation goes on; a thread stuck in a DNS lookup finishes on its own, writing nothing more.
CANCEL_GRACE_S = 0.5
RETRY_STATUSES = frozenset({408, 429})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
NOT_FOUND_STATUSES = frozenset({404, 410})
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True, kw_only=True)
class DownloadPolicy:
    """Bounds on one download.

    Attributes:
        deadline_s: Time from the call to giving up; past it the download ends with
            ``unreachable`` (or ``deadline`` while bytes are still flowing), keeping the part.
        connect_timeout_s: Time to open one connection.
        stall_timeout_s: Time without a byte after which an attempt counts as failed.
        retry_initial_s: First backoff bound; each failed attempt doubles it (full jitter: the
            wait is uniform between zero and the bound), an attempt that moved bytes resets it.
        retry_max_s: Largest backoff bound, and the most a server's Retry-After is honoured.
        max_bytes: The largest file accepted.
        progress_interval_s: Least time between two progress reports.
    """

    deadline_s: float = 3600.0
    connect_timeout_s: float = 10.0
    stall_timeout_s: float = 30.0
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    max_bytes: int = 4 * 1024**3
    progress_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("deadline_s", "connect_timeout_s", "stall_timeout_s", "retry_initial_s",
                     "retry_max_s", "max_bytes", "progress_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"download policy: {name} must be a number above zero",
                                  key=name, found=value)
        if self.retry_max_s < self.retry_initial_s:
            raise ConfigError("download policy: retry_max_s must not be below retry_initial_s",
                              key="retry_max_s", found=self.retry_max_s,
                              retry_initial_s=self.retry_initial_s)


@dataclass(frozen=True)
class DownloadProgress:
    """Where a download stands: bytes in the part so far, the file's size when the source told
    it, where the current attempt resumed from, which attempt it is (from 1) and its rate."""

    received_bytes: int
    total_bytes: int | None
    resumed_from_bytes: int
    attempt: int
    bytes_per_s: float


@dataclass(frozen=True)
class DownloadResult:
    """A finished download: the verified file, its size and sha256, the requests it took, the
    bytes reused from a part an earlier call left, and the bytes this call moved (a resumed or
    clean download moves little more than the file's size)."""

    path: Path
    size_bytes: int
    sha256: str
    attempts: int
    resumed_from_bytes: int
    transferred_bytes: int


def partial_files(destination: Path) -> tuple[Path, Path]:
    """The partial file and its sidecar that a download to ``destination`` keeps."""
    destination = Path(destination)
    return (destination.with_name(destination.name + PART_SUFFIX),
            destination.with_name(destination.name + SIDECAR_SUFFIX))


def discard_partial(destination: Path) -> None:
    """Remove what an unfinished download to ``destination`` left (nothing there is fine)."""
    for path in partial_files(destination):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fsync_dir(Path(destination).parent)


def display_source(source: str) -> str:
    """``source`` as it may be printed or journalled: no user name or password, no query (where
    presigned URLs keep their tokens), no fragment."""
    try:
        parts = urlsplit(source)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    if parts.scheme not in ("http", "https"):
        return parts.path if parts.scheme == "file" else source
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{'***@' if '@' in parts.netloc else ''}{host}{f':{port}' if port else ''}"
    return f"{parts.scheme}://{netloc}{parts.path}{'?...' if parts.query else ''}"


async def download(source: str, destination: Path, *, policy: DownloadPolicy,
                   expected_sha256: str | None = None, expected_size: int | None = None,
                   on_progress: Callable[[DownloadProgress], None] | None = None
                   ) -> DownloadResult:
    """Fetch ``source`` to ``destination``, resuming a part an earlier call left.

    Args:
        source: An ``http://``, ``https://`` or ``file://`` URL, or an absolute path.
        destination: Where the verified file appears; its directory also holds the part.
        policy: Time, retry and size bounds.
        expected_sha256: The file's sha256 (hex) when the caller knows it.
        expected_size: The file's size in bytes when the caller knows it; also a size cap.
        on_progress: Called on the caller's event loop, at most once per
            ``policy.progress_interval_s`` and once at the end.

    Raises:
        DownloadError: with ``reason`` saying why (see the module's docstring).
        asyncio.CancelledError: the awaiting task was cancelled; the transfer stops within about
            a second and the part stays for a later call.
    """
    parsed, expected_sha256 = _check_request(source, expected_sha256, expected_size)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[DownloadResult] = loop.create_future()
    # Whatever the thread ends with is read, even after a cancellation stopped waiting for it.
    future.add_done_callback(lambda done: done.cancelled() or done.exception())

    def report(progress: DownloadProgress) -> None:
        if on_progress is not None:
            _call_soon(loop, _report_progress, on_progress, progress)

    transfer = _Transfer(parsed, Path(destination), policy=policy,
                         expected_sha256=expected_sha256, expected_size=expected_size,
                         report=report)

    def work() -> None:
        lower_this_thread()
        try:
            result = transfer.run()
        except BaseException as exc:  # handed to the awaiting task, which raises it
            _call_soon(loop, _settle, future, None, exc)
        else:
            _call_soon(loop, _settle, future, result, None)

    threading.Thread(target=work, name=f"download {parsed.display}", daemon=True).start()
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        transfer.cancel()
        await asyncio.wait([future], timeout=CANCEL_GRACE_S)
        raise


def download_blocking(source: str, destination: Path, *, policy: DownloadPolicy,
                      expected_sha256: str | None = None, expected_size: int | None = None,
                      on_progress: Callable[[DownloadProgress], None] | None = None
                      ) -> DownloadResult:
    """:func:`download` on the calling thread, for the update's file worker process
    (agent/update/fileworker.py): ``on_progress`` is called on this thread, and the download
    ends only by itself (its deadline bounds it); the process is killed to stop it sooner,
    which keeps the part, as a crash would.

    Raises:
        DownloadError: as :func:`download`.
    """
    parsed, expected_sha256 = _check_request(source, expected_sha256, expected_size)
    transfer = _Transfer(parsed, Path(destination), policy=policy,
                         expected_sha256=expected_sha256, expected_size=expected_size,
                         report=on_progress or (lambda progress: None))
    return transfer.run()


def _check_request(source: str, expected_sha256: str | None,
                   expected_size: int | None) -> tuple[_Source, str | None]:
    parsed = _parse_source(source)
    if expected_sha256 is not None:
        expected_sha256 = expected_sha256.lower()
        if not SHA256_HEX.fullmatch(expected_sha256):
            raise DownloadError("the expected sha256 is not 64 hexadecimal digits",
                                reason="bad_request", url=parsed.display, found=expected_sha256)
    if expected_size is not None and (isinstance(expected_size, bool) or expected_size < 0):
        raise DownloadError("the expected size must be a number of bytes",
                            reason="bad_request", url=parsed.display, found=expected_size)
    return parsed, expected_sha256


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
        loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[DownloadResult], result: DownloadResult | None,
            exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _report_progress(on_progress: Callable[[DownloadProgress], None],
                     progress: DownloadProgress) -> None:
    try:
        on_progress(progress)
    except Exception:  # a broken progress display must not end the download
        log.exception("download progress callback failed")


@dataclass(frozen=True)
class _Source:
    kind: str  # "http" or "file"
    url: str  # as given (http) or the local path (file)
    display: str


def _parse_source(source: str) -> _Source:
    def bad(why: str) -> DownloadError:
        shown = display_source(source) if isinstance(source, str) else repr(source)
        return DownloadError(f"cannot download from this source: {why}", reason="bad_source",
                             url=shown)

    if not isinstance(source, str) or not source.strip():
        raise bad("it is empty")
    if source.startswith("/"):
        return _Source("file", source, source)
    try:
        parts = urlsplit(source)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as exc:
        raise bad(f"unparsable URL ({exc})") from None
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise bad("the URL names no host")
        return _Source("http", source, display_source(source))
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise bad("a file:// URL must name a local file (file:///path)")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise bad("a file:// URL needs an absolute path")
        return _Source("file", path, path)
    if not parts.scheme:
        raise bad("a relative path (give an absolute path or a URL)")
    raise bad(f"unsupported scheme {parts.scheme!r} (http, https or file)")


class _Retry(Exception):
    """An attempt failed in a way that another attempt may not (a dropped connection, a 5xx)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 immediate: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.immediate = immediate


class _Cancelled(Exception):
    """The awaiting task was cancelled."""


@dataclass
class _Body:
    """One answer's body: where it starts in the file, the file's total size when known, the
    validator naming this version of the file, and how to read and close it."""

    start_bytes: int
    total_bytes: int | None
    validator: str | None
    read: Callable[[int], bytes]
    close: Callable[[], None]


def _write_part(handle: BinaryIO, data: bytes) -> None:
    """Append ``data`` to the part (the seam where tests make the disk fill up).

    The part is unbuffered: what was hashed is in the kernel's hands, so a process killed right
    after leaves it on disk for the next one.
    """
    view = memoryview(data)
    while view:
        written = handle.write(view)
        view = view[written or 0:]


class _Transfer:
    """One download, run in a thread: the retry loop, one request per attempt, the part file.

    ``_offset`` bytes are in the part and ``_digest`` has hashed exactly those; ``_validator``
    and ``_total`` describe the version of the file they belong to (also in the sidecar).
    """

    def __init__(self, source: _Source, destination: Path, *, policy: DownloadPolicy,
                 expected_sha256: str | None, expected_size: int | None,
                 report: Callable[[DownloadProgress], None]) -> None:
        self._source = source
        self._destination = destination
        self._part, self._sidecar = partial_files(destination)
        self._policy = policy
        self._expected_sha256 = expected_sha256
        self._expected_size = expected_size
        self._cap_bytes = policy.max_bytes if expected_size is None else min(policy.max_bytes,
                                                                              expected_size)
        self._report = report
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        # The attempt's socket, kept apart: the connection forgets it once a response that ends
        # with the connection has taken it over.
        self._socket: socket.socket | None = None
        self._offset = 0
        self._digest = hashlib.sha256()
        self._validator: str | None = None
        self._total: int | None = None
        self._transferred = 0
        self._attempt = 0
        self._attempt_start = (0, 0.0)  # offset and monotonic time at the attempt's first byte
        self._last_report_s = float("-inf")
        self._deadline = 0.0

    # -- the loop side -------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the transfer from another thread: a blocked read ends at once."""
        self._cancelled.set()
        with self._lock:
            sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # -- the thread side -----------------------------------------------------------------------

    def run(self) -> DownloadResult:
        policy = self._policy
        self._deadline = time.monotonic() + policy.deadline_s
        self._load_partial()
        resumed_from = self._offset
        backoff_s = policy.retry_initial_s
        last_error = "no attempt made"
        while True:
            if self._total is not None and self._offset == self._total:
                return self._finish(resumed_from)  # complete on disk: a crash before the rename
            if time.monotonic() >= self._deadline:
                raise self._unreachable(last_error)
            self._attempt += 1
            moved_before = self._transferred
            try:
                self._fetch()
                return self._finish(resumed_from)
            except _Retry as retry:
                last_error = str(retry)
                if retry.immediate:
                    continue
                if self._transferred > moved_before:
                    backoff_s = policy.retry_initial_s
                wait_s = random.uniform(0.0, backoff_s)
                if retry.retry_after_s is not None:
                    wait_s = min(retry.retry_after_s, policy.retry_max_s)
                backoff_s = min(backoff_s * 2, policy.retry_max_s)
                if time.monotonic() + wait_s >= self._deadline:
                    raise self._unreachable(last_error) from None
                log.info("download of %s: attempt %d failed (%s); next in %.2f s",
                         self._source.display, self._attempt, last_error, wait_s)
                if self._cancelled.wait(wait_s):
                    raise _Cancelled() from None

    def _fetch(self) -> None:
        """One attempt: open the source at the part's end and append what it sends."""
        if self._offset and self._validator is None:
            self._restart()  # nothing proves the part belongs to the file the server has now
        body = self._open_http() if self._source.kind == "http" else self._open_file()
        try:
            if body.start_bytes == 0 and self._offset:
                self._restart()
            self._check_size(body.total_bytes)
            if body.start_bytes == 0:
                self._begin(body.validator, body.total_bytes)
            self._attempt_start = (self._offset, time.monotonic())
            self._maybe_report()
            handle = self._open_part()
            try:
                self._receive(body, handle)
            finally:
                self._close_part(handle)
        finally:
            body.close()

    def _receive(self, body: _Body, handle: BinaryIO) -> None:
        while True:
            if time.monotonic() > self._deadline:
                raise DownloadError(
                    f"download did not finish within {self._policy.deadline_s:g} s; "
                    f"the part is kept for a later attempt",
                    reason="deadline", url=self._source.display, received_bytes=self._offset,
                    total_bytes=self._total, attempts=self._attempt)
            try:
                chunk = body.read(CHUNK_BYTES)
            except (OSError, http.client.HTTPException) as exc:
                self._check_cancelled()
                raise _Retry(self._read_failure(exc)) from None
            self._check_cancelled()
            if not chunk:
                break
            if self._offset + len(chunk) > self._cap_bytes:
                discard_partial(self._destination)
                raise self._too_large(f"the body grew past {self._cap_bytes} bytes")
            self._guarded_write(_write_part, handle, chunk)
            self._digest.update(chunk)
            self._offset += len(chunk)
            self._transferred += len(chunk)
            self._maybe_report()
        if self._total is None:
            self._total = self._offset  # no length announced: the end of the body is the end
        elif self._offset < self._total:
            raise _Retry(f"the body ended after {self._offset} of {self._total} bytes")

    def _read_failure(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return (f"no data for {self._policy.stall_timeout_s:g} s after "
                    f"{self._offset} bytes")
        return f"connection lost after {self._offset} bytes: {first_line(exc)}"

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise _Cancelled()

    # -- sources -------------------------------------------------------------------------------

    def _timeouts(self) -> tuple[float, float]:
        remaining_s = max(0.001, self._deadline - time.monotonic())
        return (min(self._policy.connect_timeout_s, remaining_s),
                min(self._policy.stall_timeout_s, remaining_s))

    def _open_http(self) -> _Body:
        offset = self._offset
        url = self._source.url
        origin = urlsplit(url)
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            response = self._request(parts, offset, same_origin=(parts.scheme, parts.netloc)
                                     == (origin.scheme, origin.netloc))
            status = response.status
            if status in REDIRECT_STATUSES and response.getheader("Location"):
                response.close()
                url = urljoin(url, response.getheader("Location", ""))
                target = urlsplit(url)
                if target.scheme not in ("http", "https") or not target.hostname:
                    raise self._http_error(
                        f"redirected to a location that is not an HTTP URL ({display_source(url)})",
                        status)
                continue
            return self._answer(response, offset)
        raise self._http_error(f"more than {MAX_REDIRECTS} redirects", 0)

    def _request(self, parts: SplitResult, offset: int, *,
                 same_origin: bool) -> http.client.HTTPResponse:
        connect_s, stall_s = self._timeouts()
        host = parts.hostname or ""
        connection: http.client.HTTPConnection
        if parts.scheme == "https":
            connection = http.client.HTTPSConnection(host, parts.port, timeout=connect_s,
                                                     context=ssl.create_default_context())
        else:
            connection = http.client.HTTPConnection(host, parts.port, timeout=connect_s)
        with self._lock:
            self._close_connection()
            self._connection = connection
        headers = {"Accept-Encoding": "identity", "User-Agent": f"edge-agent/{__version__}"}
        if offset and self._validator is not None:
            headers["Range"] = f"bytes={offset}-"
            headers["If-Range"] = self._validator
        if same_origin and parts.username is not None:
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            connection.connect()
            with self._lock:
                self._socket = connection.sock
            self._check_cancelled()
            if connection.sock is not None:
                connection.sock.settimeout(stall_s)
            connection.request("GET", target, headers=headers)
            return connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self._check_cancelled()
            if isinstance(exc, TimeoutError):
                raise _Retry(f"no answer within {connect_s:g} s") from None
            raise _Retry(f"cannot reach {host}: {first_line(exc)}") from None

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        self._socket = None

    def _answer(self, response: http.client.HTTPResponse, offset: int) -> _Body:
        """Turn a response into a body to append, or raise what it means."""
        status = response.status

        def close() -> None:
            response.close()
            with self._lock:
                self._close_connection()

        def refuse(error: BaseException) -> BaseException:
            close()
            return error

        if status == 200:
            return _Body(0, _content_length(response), _validator_of(response),
                         response.read1, close)
        if status == 206:
            found = CONTENT_RANGE.fullmatch((response.getheader("Content-Range") or "").strip())
            start = int(found.group(1)) if found else -1
            total = int(found.group(3)) if found and found.group(3) != "*" else None
            validator = _validator_of(response)
            if offset == 0:
                raise refuse(self._http_error("a partial answer to a request for the whole file",
                                              status))
            if (start != offset or (total is not None and self._total is not None
                                    and total != self._total)
                    or (validator is not None and validator != self._validator)):
                # Not the bytes that follow the part: never appended. Start over from zero.
                self._restart()
                raise refuse(_Retry(f"a ranged answer that does not continue the part "
                                    f"(asked from byte {offset}, got "
                                    f"{response.getheader('Content-Range')!r})", immediate=True))
            return _Body(offset, total if total is not None else self._total, self._validator,
                         response.read1, close)
        if status == 416 and offset:
            self._restart()
            raise refuse(_Retry("the server cannot serve the part's continuation (416); "
                                "starting over", immediate=True))
        if status >= 500 or status in RETRY_STATUSES:
            retry_after_s = _retry_after_s(response.getheader("Retry-After"))
            raise refuse(_Retry(f"HTTP {status} {response.reason}"
                                + (f" (Retry-After {retry_after_s:g} s)"
                                   if retry_after_s is not None else ""),
                                retry_after_s=retry_after_s))
        discard_partial(self._destination)
        if status in NOT_FOUND_STATUSES:
            raise refuse(DownloadError(f"the source has no such file (HTTP {status})",
                                       reason="not_found", url=self._source.display,
                                       status=status))
        raise refuse(self._http_error(f"unexpected answer HTTP {status} {response.reason}",
                                      status))

    def _http_error(self, what: str, status: int) -> DownloadError:
        return DownloadError(f"the server's answer cannot be used: {what}", reason="http_error",
                             url=self._source.display, status=status or None)

    def _open_file(self) -> _Body:
        path = Path(self._source.url)
        try:
            handle = open(path, "rb")
            info = os.fstat(handle.fileno())
        except (FileNotFoundError, NotADirectoryError):
            discard_partial(self._destination)
            raise DownloadError("no such file to copy", reason="not_found",
                                url=self._source.display) from None
        except (PermissionError, IsADirectoryError) as exc:
            discard_partial(self._destination)
            raise DownloadError(f"cannot read the file to copy: {first_line(exc)}",
                                reason="unreadable", url=self._source.display) from None
        except OSError as exc:  # a USB stick being re-plugged, a share reconnecting
            raise _Retry(f"cannot open {path}: {first_line(exc)}") from None
        validator = f"file {info.st_size} {info.st_mtime_ns}"
        start = self._offset if self._offset and validator == self._validator else 0
        handle.seek(start)
        position = [start]

        def read(size: int) -> bytes:
            chunk = handle.read(min(size, info.st_size - position[0]))
            position[0] += len(chunk)
            return chunk

        return _Body(start, info.st_size, validator, read, handle.close)

    # -- the part file -------------------------------------------------------------------------

    def _load_partial(self) -> None:
        """Take up a part an earlier call left, when its sidecar shows it belongs to this source;
        anything else there is removed. (Whether the source still has the same file is the
        server's answer to If-Range.)"""
        try:
            with open(self._sidecar, "rb") as handle:
                record = json.loads(handle.read(SIDECAR_MAX_BYTES))
            matches = (isinstance(record, dict) and record.get("format") == SIDECAR_FORMAT
                       and record.get("source_sha256") == _sha256_text(self._source.url)
                       and isinstance(record.get("validator"), str))
            total = record.get("total_bytes") if matches else None
            if not matches or not (total is None or isinstance(total, int)):
                raise ValueError("the sidecar is for another source or malformed")
            digest = hashlib.sha256()
            size = 0
            with open(self._part, "rb") as part:
                while chunk := part.read(CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
            if total is not None and size > total:
                raise ValueError("the part is longer than the file")
        except (OSError, ValueError):
            discard_partial(self._destination)
            return
        self._offset, self._digest = size, digest
        self._validator, self._total = record["validator"], total
        log.info("download of %s resumes from a part of %d bytes",
                 self._source.display, self._offset)

    def _restart(self) -> None:
        """Forget the part: it will be rewritten from byte zero. The sidecar goes first, so a
        crash here never leaves old bytes under a new validator."""
        discard_partial(self._destination)
        self._offset, self._digest = 0, hashlib.sha256()
        self._validator, self._total = None, None

    def _begin(self, validator: str | None, total: int | None) -> None:
        """Record which version of the file a fresh part holds, before its first byte."""
        self._validator, self._total = validator, total
        record = {"format": SIDECAR_FORMAT, "source": self._source.display,
                  "source_sha256": _sha256_text(self._source.url), "validator": validator,
                  "total_bytes": total}
        if validator is not None:  # without one, a part can never be resumed: no sidecar
            self._guarded_write(lambda: atomic_write_text(self._sidecar, json.dumps(record),
                                                          mode=0o600))

    def _check_size(self, total: int | None) -> None:
        if total is None:
            return
        if total > self._cap_bytes:
            discard_partial(self._destination)
            raise self._too_large(f"the source announces {total} bytes, over the limit of "
                                  f"{self._cap_bytes}")
        if self._expected_size is not None and total != self._expected_size:
            discard_partial(self._destination)
            raise DownloadError("the source's file is not of the expected size",
                                reason="size_mismatch", url=self._source.display,
                                expected=self._expected_size, found=total)

    def _open_part(self) -> BinaryIO:
        def open_part() -> BinaryIO:
            self._part.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._part, os.O_WRONLY | os.O_CREAT, 0o600)
            # fdopen does not truncate: the part's bytes stay
            handle = os.fdopen(fd, "wb", buffering=0)
            handle.truncate(self._offset)
            handle.seek(self._offset)
            return handle

        return self._guarded_write(open_part)

    def _close_part(self, handle: BinaryIO) -> None:
        def close() -> None:
            try:
                handle.flush()
                os.fsync(handle.fileno())
            finally:
                handle.close()

        self._guarded_write(close)

    def _guarded_write(self, action: Callable[..., Any], *args: Any) -> Any:
        """Run a write to the part, sidecar or destination; a failure removes the partial files
        and ends the download (a full disk does not empty itself by retrying)."""
        try:
            return action(*args)
        except OSError as exc:
            discard_partial(self._destination)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise DownloadError(
                "the disk is full" if full else f"cannot write the download: {first_line(exc)}",
                reason="disk_full" if full else "write_error", url=self._source.display,
                path=self._part, received_bytes=self._offset) from exc

    def _finish(self, resumed_from: int) -> DownloadResult:
        """Check the complete part and rename it to the destination."""
        sha256 = self._digest.hexdigest()
        if self._expected_sha256 is not None and sha256 != self._expected_sha256:
            discard_partial(self._destination)
            raise DownloadError("the downloaded file's sha256 is not the expected one",
                                reason="hash_mismatch", url=self._source.display,
                                expected=self._expected_sha256, found=sha256)
        if self._expected_size is not None and self._offset != self._expected_size:
            discard_partial(self._destination)
            raise DownloadError("the downloaded file is not of the expected size",
                                reason="size_mismatch", url=self._source.display,
                                expected=self._expected_size, found=self._offset)

        def publish() -> None:
            os.replace(self._part, self._destination)
            fsync_dir(self._destination.parent)

        self._guarded_write(publish)
        discard_partial(self._destination)
        self._last_report_s = float("-inf")
        self._maybe_report()
        return DownloadResult(path=self._destination, size_bytes=self._offset, sha256=sha256,
                              attempts=self._attempt, resumed_from_bytes=resumed_from,
                              transferred_bytes=self._transferred)

    # -- reports and errors --------------------------------------------------------------------

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report_s < self._policy.progress_interval_s:
            return
        self._last_report_s = now
        start_offset, start_s = self._attempt_start
        elapsed_s = now - start_s
        rate = (self._offset - start_offset) / elapsed_s if elapsed_s > 0 else 0.0
        self._report(DownloadProgress(self._offset, self._total, start_offset,
                                      max(self._attempt, 1), rate))

    def _too_large(self, what: str) -> DownloadError:
        return DownloadError(f"the file is too large: {what}", reason="too_large",
                             url=self._source.display, limit_bytes=self._cap_bytes)

    def _unreachable(self, last_error: str) -> DownloadError:
        return DownloadError(
            f"the source stayed unreachable for {self._policy.deadline_s:g} s "
            f"({self._attempt} attempts); last error: {last_error}",
            reason="unreachable", url=self._source.display, attempts=self._attempt,
            last_error=last_error, kept_partial_bytes=self._offset)


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.getheader("Content-Length")
    return int(value) if value is not None and value.strip().isdigit() else None


def _validator_of(response: http.client.HTTPResponse) -> str | None:
    """The strong ETag, else Last-Modified: what If-Range may carry (a weak ETag may not)."""
    etag = (response.getheader("ETag") or "").strip()
    if etag and not etag.startswith("W/"):
        return etag
    return (response.getheader("Last-Modified") or "").strip() or None


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After as seconds from now: a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _sha256_text(text: str) -> str:
    # The sidecar names its source by hash: a presigned URL's token stays off the disk.
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
