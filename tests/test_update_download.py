"""Bundle downloads (agent.update.download) against a real HTTP server in a thread that honours
Range, If-Range and ETag, with faults injected per request: drops, a file changed between
attempts, stalls, error statuses, a server ignoring Range, lying lengths; a part left by a process
killed with SIGKILL; cancellation; file:// copies; a full disk at the write seam."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.errors import ConfigError, DownloadError
from agent.update import download as download_module
from agent.update.download import (
    DownloadPolicy,
    DownloadProgress,
    discard_partial,
    download,
    partial_files,
)

CONTENT = random.Random(16).randbytes(600_000)
NEW_CONTENT = random.Random(17).randbytes(500_000)
CUT = 100_000  # where injected drops and stalls cut the body

FAST = DownloadPolicy(deadline_s=3.0, connect_timeout_s=0.5, stall_timeout_s=0.3,
                      retry_initial_s=0.01, retry_max_s=0.05, max_bytes=10_000_000,
                      progress_interval_s=0.05)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Fault:
    """How the server answers one request: a bare status, the body cut at byte ``cut`` of the
    file (then the connection closes, or stalls with ``stall``), Range ignored, a 206 that does
    not continue the part, no Content-Length, or the file replaced by ``change_to`` first."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cut: int | None = None
    stall: bool = False
    ignore_range: bool = False
    bad_range: bool = False
    no_length: bool = False
    change_to: bytes | None = None
    trickle_s: float = 0.0  # a pause after every 20 kB of the body


class Served:
    """The file the test server serves, its ETag, the faults still to inject (one per request,
    then clean answers) and every request's path and headers."""

    def __init__(self, content: bytes) -> None:
        self.content = content
        self.version = 1
        self.plan: list[Fault] = []
        self.always: Fault | None = None
        self.requests: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.url = ""
        self.base = ""

    @property
    def etag(self) -> str:
        return f'"v{self.version}"'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection; a body ends where it says

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        served: Served = self.server.served  # type: ignore[attr-defined]
        with served.lock:
            headers = {name.lower(): value for name, value in self.headers.items()}
            served.requests.append({"path": self.path, **headers})
            fault = served.plan.pop(0) if served.plan else (served.always or Fault())
            if fault.change_to is not None:
                served.content, served.version = fault.change_to, served.version + 1
            content, etag = served.content, served.etag
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/bundle")
            self.end_headers()
            return
        if not self.path.startswith("/bundle"):
            self.send_error(404)
            return
        if fault.status is not None:
            self.send_response(fault.status)
            for name, value in fault.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, start = 200, 0
        asked = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if asked and not fault.ignore_range and if_range in (None, etag):
            start = int(asked.removeprefix("bytes=").rstrip("-"))
            if start >= len(content):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(content)}")
                self.end_headers()
                return
            status = 206
        if fault.bad_range:
            status, start = 206, 0
        self.send_response(status)
        self.send_header("ETag", etag)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        if not fault.no_length:
            self.send_header("Content-Length", str(len(content) - start))
        self.end_headers()
        end = len(content) if fault.cut is None else max(start, fault.cut)
        step = 20_000 if fault.trickle_s else end - start
        for offset in range(start, end, max(step, 1)):
            self.wfile.write(content[offset:min(offset + step, end)])
            self.wfile.flush()
            if fault.trickle_s and served.release.wait(fault.trickle_s):
                return
        if fault.stall:
            served.release.wait(5.0)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up on purpose


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served(CONTENT)
    server = _Server(("127.0.0.1", 0), _Handler)
    server.served = served  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    served.base = f"http://127.0.0.1:{server.server_port}"
    served.url = f"{served.base}/bundle"
    try:
        yield served
    finally:
        served.release.set()
        server.shutdown()
        server.server_close()


def fetch(source: str, destination: Path, **kwargs: object):
    kwargs.setdefault("policy", FAST)
    return asyncio.run(download(source, destination, **kwargs))  # type: ignore[arg-type]


def fails(source: str, destination: Path, **kwargs: object) -> DownloadError:
    with pytest.raises(DownloadError) as caught:
        fetch(source, destination, **kwargs)
    return caught.value


def no_partials(destination: Path) -> bool:
    return not any(path.exists() for path in partial_files(destination))


def test_downloads_and_verifies_a_file(served: Served, tmp_path: Path) -> None:
    destination = tmp_path / "deep" / "bundle.tar"
    result = fetch(served.url, destination, expected_sha256=sha256(CONTENT).upper(),
                   expected_size=len(CONTENT))
    assert destination.read_bytes() == CONTENT
    assert (result.path, result.size_bytes, result.sha256) == (destination, len(CONTENT),
                                                                sha256(CONTENT))
    assert (result.attempts, result.resumed_from_bytes, result.transferred_bytes) == (
        1, 0, len(CONTENT))
    assert "range" not in served.requests[0]
    assert served.requests[0]["accept-encoding"] == "identity"
    assert no_partials(destination)


def test_a_dropped_connection_resumes_with_range(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT)]
    result = fetch(served.url, tmp_path / "b", expected_sha256=sha256(CONTENT))
    assert (tmp_path / "b").read_bytes() == CONTENT
    second = served.requests[1]
    assert (second["range"], second["if-range"]) == (f"bytes={CUT}-", '"v1"')
    assert result.attempts == 2
    assert result.transferred_bytes == len(CONTENT)  # nothing fetched twice


def test_a_file_changed_between_attempts_is_never_spliced(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT), Fault(change_to=NEW_CONTENT)]
    result = fetch(served.url, tmp_path / "b")
    assert served.requests[1]["if-range"] == '"v1"'  # it asked to resume; the server said no
    assert (tmp_path / "b").read_bytes() == NEW_CONTENT
    assert result.sha256 == sha256(NEW_CONTENT)
    assert result.transferred_bytes == CUT + len(NEW_CONTENT)


def test_a_changed_file_fails_the_expected_hash(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT), Fault(change_to=NEW_CONTENT)]
    error = fails(served.url, tmp_path / "b", expected_sha256=sha256(CONTENT))
    assert error.reason == "hash_mismatch"
    assert error.fields["found"] == sha256(NEW_CONTENT)
    assert not (tmp_path / "b").exists() and no_partials(tmp_path / "b")


def test_a_ranged_answer_that_does_not_continue_the_part_is_not_appended(
        served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT), Fault(bad_range=True)]
    result = fetch(served.url, tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == CONTENT
    assert "range" in served.requests[1] and "range" not in served.requests[2]
    assert result.attempts == 3


def test_a_server_ignoring_range_restarts_from_zero(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT), Fault(ignore_range=True)]
    result = fetch(served.url, tmp_path / "b", expected_sha256=sha256(CONTENT))
    assert "range" in served.requests[1]
    assert (tmp_path / "b").read_bytes() == CONTENT
    assert result.transferred_bytes == CUT + len(CONTENT)


def test_a_stalled_server_is_a_failed_attempt(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT, stall=True)]
    started = time.monotonic()
    result = fetch(served.url, tmp_path / "b")
    assert time.monotonic() - started < 2.0
    assert result.attempts == 2
    assert served.requests[1]["range"] == f"bytes={CUT}-"
    assert (tmp_path / "b").read_bytes() == CONTENT


@pytest.mark.parametrize(("status", "reason"), [(404, "not_found"), (410, "not_found"),
                                                (403, "http_error")])
def test_missing_and_refused_files_are_not_retried(served: Served, tmp_path: Path, status: int,
                                                   reason: str) -> None:
    served.always = Fault(status=status)
    error = fails(served.url, tmp_path / "b")
    assert (error.reason, error.fields["status"]) == (reason, status)
    assert len(served.requests) == 1
    assert f"HTTP {status}" in str(error)


def test_a_server_error_is_retried(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(status=500), Fault(status=429)]
    result = fetch(served.url, tmp_path / "b")
    assert result.attempts == 3
    assert (tmp_path / "b").read_bytes() == CONTENT


def test_retry_after_is_honoured_within_the_backoff_bound(served: Served, tmp_path: Path) -> None:
    served.plan = [Fault(status=503, headers={"Retry-After": "100"})]
    policy = DownloadPolicy(deadline_s=3.0, stall_timeout_s=0.5, retry_initial_s=0.01,
                            retry_max_s=0.3)
    started = time.monotonic()
    fetch(served.url, tmp_path / "b", policy=policy)
    waited_s = time.monotonic() - started
    assert 0.3 <= waited_s < 1.5  # jitter alone would have waited at most 0.01 s


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/bundle"


@pytest.mark.parametrize("where", ["closed_port", "always_503"])
def test_an_unreachable_source_ends_at_the_deadline(served: Served, tmp_path: Path,
                                                    where: str) -> None:
    served.always = Fault(status=503)
    url = closed_port_url() if where == "closed_port" else served.url
    policy = DownloadPolicy(deadline_s=0.4, connect_timeout_s=0.2, stall_timeout_s=0.2,
                            retry_initial_s=0.01, retry_max_s=0.05)
    started = time.monotonic()
    error = fails(url, tmp_path / "b", policy=policy)
    assert time.monotonic() - started < 1.0
    assert error.reason == "unreachable"
    assert error.fields["attempts"] >= 2
    expected = "cannot reach 127.0.0.1" if where == "closed_port" else "HTTP 503"
    assert expected in error.fields["last_error"] and expected in str(error)


def test_a_truncated_body_keeps_the_part_for_a_later_call(served: Served, tmp_path: Path) -> None:
    served.always = Fault(cut=CUT)  # every answer's body stops at CUT: Content-Length lies
    policy = DownloadPolicy(deadline_s=0.4, stall_timeout_s=0.2, retry_initial_s=0.01,
                            retry_max_s=0.05)
    error = fails(served.url, tmp_path / "b", policy=policy)
    # Mostly the deadline passes between attempts (unreachable, with the cut as the last
    # error); on a loaded machine it can pass inside an attempt's short body (deadline).
    assert error.reason in ("unreachable", "deadline"), error
    if error.reason == "unreachable":
        assert f"ended after {CUT} of {len(CONTENT)} bytes" in error.fields["last_error"]
    part, sidecar = partial_files(tmp_path / "b")
    assert part.read_bytes() == CONTENT[:CUT] and sidecar.exists()
    served.always = None
    result = fetch(served.url, tmp_path / "b", expected_sha256=sha256(CONTENT))
    assert result.resumed_from_bytes == CUT
    assert (tmp_path / "b").read_bytes() == CONTENT


def test_a_transfer_too_slow_for_the_deadline_ends_keeping_the_part(served: Served,
                                                                  tmp_path: Path) -> None:
    served.always = Fault(trickle_s=0.05)
    policy = DownloadPolicy(deadline_s=0.4, stall_timeout_s=0.3)
    error = fails(served.url, tmp_path / "b", policy=policy)
    assert error.reason == "deadline" and error.fields["attempts"] == 1
    kept = partial_files(tmp_path / "b")[0].stat().st_size
    assert 0 < kept < len(CONTENT) and error.fields["received_bytes"] == kept


def test_a_body_growing_past_the_cap_is_stopped(served: Served, tmp_path: Path) -> None:
    served.always = Fault(no_length=True)
    policy = DownloadPolicy(deadline_s=3.0, stall_timeout_s=0.5, max_bytes=300_000)
    error = fails(served.url, tmp_path / "b", policy=policy)
    assert error.reason == "too_large" and error.fields["limit_bytes"] == 300_000
    assert no_partials(tmp_path / "b") and not (tmp_path / "b").exists()


@pytest.mark.parametrize(("max_bytes", "expected_size", "reason"), [
    (len(CONTENT) - 1, None, "too_large"),
    (10_000_000, len(CONTENT) - 1, "too_large"),
    (10_000_000, len(CONTENT) + 1, "size_mismatch"),
])
def test_an_announced_size_is_checked_before_reading(served: Served, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     max_bytes: int, expected_size: int | None,
                                                     reason: str) -> None:
    written: list[int] = []
    monkeypatch.setattr(download_module, "_write_part",
                        lambda handle, data: written.append(len(data)))
    policy = DownloadPolicy(deadline_s=3.0, max_bytes=max_bytes)
    error = fails(served.url, tmp_path / "b", policy=policy, expected_size=expected_size)
    assert error.reason == reason
    assert written == [] and len(served.requests) == 1
    assert no_partials(tmp_path / "b")


def test_a_wrong_expected_hash_removes_the_part(served: Served, tmp_path: Path) -> None:
    error = fails(served.url, tmp_path / "b", expected_sha256="0" * 64)
    assert error.reason == "hash_mismatch"
    assert (error.fields["expected"], error.fields["found"]) == ("0" * 64, sha256(CONTENT))
    assert len(served.requests) == 1
    assert no_partials(tmp_path / "b") and not (tmp_path / "b").exists()


def wait_for_part(destination: Path, size: int, timeout_s: float = 5.0) -> None:
    part = partial_files(destination)[0]
    limit = time.monotonic() + timeout_s
    while not (part.exists() and part.stat().st_size >= size):
        if time.monotonic() > limit:
            raise AssertionError(f"the part never reached {size} bytes")
        time.sleep(0.01)


def test_a_download_killed_with_sigkill_resumes_in_a_new_process(served: Served,
                                                                 tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT, stall=True)]
    destination = tmp_path / "b"
    script = ("import asyncio, sys; from pathlib import Path; "
              "from agent.update.download import DownloadPolicy, download; "
              "asyncio.run(download(sys.argv[1], Path(sys.argv[2]), "
              "policy=DownloadPolicy(stall_timeout_s=30)))")
    repo = Path(__file__).resolve().parents[1]
    process = subprocess.Popen([sys.executable, "-c", script, served.url, str(destination)],
                               env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        wait_for_part(destination, CUT)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
    assert process.returncode == -signal.SIGKILL
    result = fetch(served.url, destination, expected_sha256=sha256(CONTENT))
    assert served.requests[1]["range"] == f"bytes={CUT}-"
    assert (result.resumed_from_bytes, result.transferred_bytes) == (CUT, len(CONTENT) - CUT)
    assert destination.read_bytes() == CONTENT
    assert no_partials(destination)


def test_cancelling_during_a_stall_returns_fast_and_keeps_the_part(served: Served,
                                                                  tmp_path: Path) -> None:
    served.plan = [Fault(cut=CUT, stall=True)]
    destination = tmp_path / "b"
    policy = DownloadPolicy(deadline_s=30.0, stall_timeout_s=30.0)
    part, sidecar = partial_files(destination)

    async def scenario() -> float:
        task = asyncio.create_task(download(served.url, destination, policy=policy))
        limit = time.monotonic() + 5.0
        while not (part.exists() and part.stat().st_size >= CUT) and time.monotonic() < limit:
            await asyncio.sleep(0.01)
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0
    # The transfer's thread has ended too: its blocked read was cut, not left to the stall.
    for thread in threading.enumerate():
        if thread.name.startswith("download "):
            thread.join(0.5)
            assert not thread.is_alive()
    assert part.read_bytes() == CONTENT[:CUT] and sidecar.exists()
    served.release.set()
    result = fetch(served.url, destination)
    assert result.resumed_from_bytes == CUT and destination.read_bytes() == CONTENT


def test_a_part_of_another_source_is_not_resumed(served: Served, tmp_path: Path) -> None:
    served.always = Fault(cut=CUT)
    with pytest.raises(DownloadError):
        fetch(f"{served.url}?other", tmp_path / "b",
              policy=DownloadPolicy(deadline_s=0.2, retry_initial_s=0.5, retry_max_s=0.5))
    assert partial_files(tmp_path / "b")[0].stat().st_size == CUT
    served.always = None
    first = len(served.requests)
    result = fetch(served.url, tmp_path / "b")
    assert served.requests[first]["path"] == "/bundle" and "range" not in served.requests[first]
    assert result.resumed_from_bytes == 0 and (tmp_path / "b").read_bytes() == CONTENT


def test_discard_partial_removes_the_part_and_sidecar(served: Served, tmp_path: Path) -> None:
    served.always = Fault(cut=CUT)
    with pytest.raises(DownloadError):
        fetch(served.url, tmp_path / "b",
              policy=DownloadPolicy(deadline_s=0.2, retry_initial_s=0.5, retry_max_s=0.5))
    assert all(path.exists() for path in partial_files(tmp_path / "b"))
    discard_partial(tmp_path / "b")
    discard_partial(tmp_path / "b")  # nothing left: still fine
    assert no_partials(tmp_path / "b")


def test_progress_is_reported_on_the_loop_at_a_bounded_rate(served: Served,
                                                           tmp_path: Path) -> None:
    served.content = random.Random(18).randbytes(3_000_000)  # a dozen chunks
    threads: list[int] = []
    seen: list[DownloadProgress] = []

    def on_progress(progress: DownloadProgress) -> None:
        threads.append(threading.get_ident())
        seen.append(progress)

    policy = DownloadPolicy(deadline_s=3.0, progress_interval_s=10.0)
    fetch(served.url, tmp_path / "b", policy=policy, on_progress=on_progress)
    assert len(seen) == 2  # the attempt's start, then the end: not one per chunk
    assert seen[0].received_bytes == 0 and seen[0].total_bytes == 3_000_000
    assert seen[-1].received_bytes == seen[-1].total_bytes == 3_000_000
    assert seen[-1].attempt == 1 and seen[-1].bytes_per_s > 0
    assert set(threads) == {threading.get_ident()}


def test_a_redirect_is_followed(served: Served, tmp_path: Path) -> None:
    fetch(f"{served.base}/redirect", tmp_path / "b")
    assert [request["path"] for request in served.requests] == ["/redirect", "/bundle"]
    assert (tmp_path / "b").read_bytes() == CONTENT


def test_errors_print_no_credentials_or_query(served: Served, tmp_path: Path) -> None:
    url = served.base.replace("http://", "http://fleet:s3cret@") + "/missing?token=hush"
    error = fails(url, tmp_path / "b")
    assert error.reason == "not_found"
    assert served.requests[0]["authorization"].startswith("Basic ")
    assert "s3cret" not in str(error) and "hush" not in str(error)
    assert "/missing" in str(error)


def test_file_sources_are_copied(tmp_path: Path) -> None:
    source = tmp_path / "usb" / "bundle.tar"
    source.parent.mkdir()
    source.write_bytes(CONTENT)
    for index, given in enumerate([source.as_uri(), str(source)]):
        result = fetch(given, tmp_path / f"copy{index}", expected_sha256=sha256(CONTENT))
        assert (tmp_path / f"copy{index}").read_bytes() == CONTENT
        assert result.sha256 == sha256(CONTENT)
    error = fails((tmp_path / "usb" / "gone.tar").as_uri(), tmp_path / "copy")
    assert error.reason == "not_found" and "gone.tar" in str(error)


@pytest.mark.parametrize(("code", "reason"), [(errno.ENOSPC, "disk_full"),
                                              (errno.EIO, "write_error")])
def test_a_write_failure_removes_the_partial_files(served: Served, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, code: int,
                                                   reason: str) -> None:
    calls: list[int] = []

    def failing_write(handle, data: bytes) -> None:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(code, os.strerror(code))
        handle.write(data)

    monkeypatch.setattr(download_module, "_write_part", failing_write)
    error = fails(served.url, tmp_path / "b")
    assert error.reason == reason
    assert len(served.requests) == 1  # not retried
    assert no_partials(tmp_path / "b") and not (tmp_path / "b").exists()


@pytest.mark.parametrize("source", ["ftp://host/bundle.tar", "http:///bundle.tar",
                                    "relative/bundle.tar", "file://otherhost/bundle.tar",
                                    "file:relative.tar", "", "http://host:port/bundle.tar"])
def test_bad_sources_are_refused(tmp_path: Path, source: str) -> None:
    error = fails(source, tmp_path / "b")
    assert error.reason == "bad_source"
    assert "cannot download from this source" in str(error)


def test_bad_expectations_and_policies_are_refused(tmp_path: Path) -> None:
    error = fails("http://127.0.0.1:9/b", tmp_path / "b", expected_sha256="abc")
    assert error.reason == "bad_request"
    with pytest.raises(ConfigError) as caught:
        DownloadPolicy(stall_timeout_s=0)
    assert caught.value.fields["key"] == "stall_timeout_s"
    with pytest.raises(ConfigError):
        DownloadPolicy(retry_initial_s=5.0, retry_max_s=1.0)
