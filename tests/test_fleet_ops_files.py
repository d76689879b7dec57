"""The operator's artifact side: ``publish`` into an artifact directory and its index, and
``serve``'s Range / ETag / If-Range / 416 semantics, checked over real HTTP and with the device's
own resuming downloader (agent/update/download.py) through a proxy that cuts answers short."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.errors import FleetError, SignatureError
from agent.fleet.ops.artifacts import INDEX_NAME, bundle_url, load_index, publish_bundle
from agent.fleet.ops.fileserver import serve_directory
from agent.fsutil import atomic_write_bytes
from agent.update.download import DownloadPolicy, download

pytest.importorskip("onnx")

from tests.tiny_models import make_bundle  # noqa: E402 - needs onnx


# -- publish -----------------------------------------------------------------------------------

def test_publish_verifies_copies_and_indexes_a_bundle_once(tmp_path: Path) -> None:
    bundle, key = make_bundle(tmp_path, name="tiny", version=3)
    artifacts = tmp_path / "artifacts"
    entry, new = publish_bundle(bundle, artifacts, [key.public_key()])
    assert new
    assert entry.path == "tiny/3/tiny-3.bundle"
    published = artifacts / entry.path
    assert published.read_bytes() == bundle.read_bytes()
    assert entry.sha256 == hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert entry.size == bundle.stat().st_size
    index = load_index(artifacts)
    assert index.get("tiny", 3) == entry
    on_disk = json.loads((artifacts / INDEX_NAME).read_text())
    assert on_disk["format"] == 1 and on_disk["bundles"][0]["sha256"] == entry.sha256
    # The same bytes again: nothing changes.
    again, new_again = publish_bundle(bundle, artifacts, [key.public_key()])
    assert not new_again and again == entry
    assert bundle_url("https://cdn.example/b/", entry) == (
        "https://cdn.example/b/tiny/3/tiny-3.bundle")


def test_publish_refuses_other_bytes_under_a_published_version(tmp_path: Path) -> None:
    first, key = make_bundle(tmp_path / "a", version=1)
    other, _ = make_bundle(tmp_path / "b", version=1, seed=7, key=key)
    artifacts = tmp_path / "artifacts"
    entry, _ = publish_bundle(first, artifacts, [key.public_key()])
    with pytest.raises(FleetError, match="published already with other bytes"):
        publish_bundle(other, artifacts, [key.public_key()])
    assert (artifacts / entry.path).read_bytes() == first.read_bytes()
    assert load_index(artifacts).entries == (entry,)
    second, _ = make_bundle(tmp_path / "c", version=2, key=key)
    publish_bundle(second, artifacts, [key.public_key()])
    assert [e.version for e in load_index(artifacts).entries] == [1, 2]


def test_publish_writes_nothing_for_a_bundle_signed_by_an_untrusted_key(tmp_path: Path) -> None:
    bundle, _ = make_bundle(tmp_path, version=1)
    _, other_key = make_bundle(tmp_path / "other", version=1)
    artifacts = tmp_path / "artifacts"
    with pytest.raises(SignatureError, match="unknown signing key"):
        publish_bundle(bundle, artifacts, [other_key.public_key()])
    assert not (artifacts / INDEX_NAME).exists()
    assert not any(path.suffix == ".bundle" for path in artifacts.rglob("*"))


def test_publish_without_keys_is_refused(tmp_path: Path) -> None:
    bundle, _ = make_bundle(tmp_path)
    with pytest.raises(FleetError, match="public keys"):
        publish_bundle(bundle, tmp_path / "artifacts", [])


# -- serve -------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[Path, int]]:
    """A served directory holding one 3 MiB file (and a hidden lock file)."""
    root = tmp_path / "root"
    (root / "m" / "1").mkdir(parents=True)
    atomic_write_bytes(root / "m" / "1" / "m-1.bundle", os.urandom(3 * 1024 * 1024 + 17))
    (root / ".index.lock").write_bytes(b"")
    stop = asyncio.Event()
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_directory(root, host="127.0.0.1", port=0, stop=stop,
                                               started=started))
    port = await asyncio.wait_for(started, 10)
    try:
        yield root, port
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _get(port: int, path: str, headers: dict[str, str] | None = None,
         method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()


async def _fetch(port: int, path: str, headers: dict[str, str] | None = None,
                 method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    # http.client blocks: off the loop that runs the server.
    return await asyncio.get_running_loop().run_in_executor(None, _get, port, path, headers,
                                                            method)


FILE = "/m/1/m-1.bundle"


def test_serve_answers_ranges_under_a_matching_strong_etag_only(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            data = (root / FILE[1:]).read_bytes()
            status, headers, got = await _fetch(port, FILE)
            assert status == 200 and got == data
            etag = headers["etag"]
            assert etag.startswith('"') and not etag.startswith("W/")
            assert headers["accept-ranges"] == "bytes"
            assert int(headers["content-length"]) == len(data)

            status, headers, got = await _fetch(port, FILE, {"Range": "bytes=1000-",
                                                             "If-Range": etag})
            assert status == 206 and got == data[1000:]
            assert headers["content-range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
            assert headers["etag"] == etag

            status, _, got = await _fetch(port, FILE, {"Range": "bytes=10-19"})
            assert status == 206 and got == data[10:20]
            status, _, got = await _fetch(port, FILE, {"Range": "bytes=-5"})
            assert status == 206 and got == data[-5:]

            # An If-Range that does not match (another version, a weak tag): the whole file.
            for other in ('"0-0-0"', f"W/{etag}"):
                status, headers, got = await _fetch(port, FILE, {"Range": "bytes=1000-",
                                                                 "If-Range": other})
                assert status == 200 and got == data and "content-range" not in headers

            # Several ranges: RFC 9110 lets a server send the whole file instead; it does.
            status, _, got = await _fetch(port, FILE, {"Range": "bytes=0-1,5-6"})
            assert status == 200 and got == data

    asyncio.run(body())


def test_serve_answers_416_for_a_range_past_the_end(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            size = (root / FILE[1:]).stat().st_size
            for wanted in (f"bytes={size}-", f"bytes={size + 100}-{size + 200}", "bytes=-0"):
                status, headers, _ = await _fetch(port, FILE, {"Range": wanted})
                assert status == 416, wanted
                assert headers["content-range"] == f"bytes */{size}"

    asyncio.run(body())


def test_serve_head_conditional_and_hidden_paths(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            size = (root / FILE[1:]).stat().st_size
            status, headers, got = await _fetch(port, FILE, None, "HEAD")
            assert status == 200 and got == b"" and int(headers["content-length"]) == size
            status, _, _ = await _fetch(port, FILE, {"If-None-Match": headers["etag"]})
            assert status == 304
            (root.parent / "secret").write_text("no")
            (root / "m" / "link").symlink_to(root.parent / "secret")
            for path in ("/.index.lock", "/m/../../secret", "/m/link", "/m", "/missing", "/"):
                status, _, _ = await _fetch(port, path)
                assert status == 404, path

    asyncio.run(body())


def test_a_file_replaced_under_its_path_gets_a_new_etag(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            _, before, _ = await _fetch(port, FILE, None, "HEAD")
            atomic_write_bytes(root / FILE[1:], b"x" * 100)
            status, after, got = await _fetch(port, FILE, {"Range": "bytes=50-",
                                                           "If-Range": before["etag"]})
            assert after["etag"] != before["etag"]
            assert status == 200 and got == b"x" * 100

    asyncio.run(body())


# -- the device's downloader against serve, through a proxy that cuts the first answer ---------

class CuttingProxy:
    """A TCP proxy in front of the server: the first answer is cut after ``cut_bytes`` of body
    (a link dropping mid-download); later ones pass whole. Each request's head and each answer's
    status line are recorded. ``before_second`` runs before the second request is forwarded."""

    def __init__(self, upstream_port: int, cut_bytes: int, before_second: Any = None) -> None:
        self.upstream_port = upstream_port
        self.cut_bytes = cut_bytes
        self.before_second = before_second
        self.requests: list[str] = []
        self.statuses: list[str] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            number = len(self.requests)
            self.requests.append(head.decode("latin-1"))
            if number == 1 and self.before_second is not None:
                self.before_second()
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1",
                                                                 self.upstream_port)
            up_writer.write(head)
            await up_writer.drain()
            answer_head = await up_reader.readuntil(b"\r\n\r\n")
            self.statuses.append(answer_head.split(b"\r\n", 1)[0].decode("latin-1"))
            writer.write(answer_head)
            budget = self.cut_bytes if number == 0 else None
            while budget is None or budget > 0:
                chunk = await up_reader.read(65536 if budget is None else min(65536, budget))
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
                if budget is not None:
                    budget -= len(chunk)
            up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _policy() -> DownloadPolicy:
    return DownloadPolicy(deadline_s=30, retry_initial_s=0.05, retry_max_s=0.1,
                          stall_timeout_s=5, progress_interval_s=0.05)


def _header(head: str, name: str) -> str | None:
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def test_the_device_downloader_resumes_from_serve_with_range_and_if_range(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            data = (root / FILE[1:]).read_bytes()
            cut = 1024 * 1024
            proxy = CuttingProxy(port, cut)
            proxy_port = await proxy.start()
            try:
                result = await download(f"http://127.0.0.1:{proxy_port}{FILE}",
                                        tmp_path / "got.bundle", policy=_policy(),
                                        expected_sha256=hashlib.sha256(data).hexdigest(),
                                        expected_size=len(data))
            finally:
                await proxy.close()
            assert (tmp_path / "got.bundle").read_bytes() == data
            assert result.attempts == 2
            assert result.transferred_bytes == len(data)  # nothing fetched twice
            assert [line.split()[1] for line in proxy.statuses] == ["200", "206"]
            _, headers, _ = await _fetch(port, FILE, None, "HEAD")
            assert _header(proxy.requests[1], "Range") == f"bytes={cut}-"
            assert _header(proxy.requests[1], "If-Range") == headers["etag"]

    asyncio.run(body())


def test_the_downloader_never_splices_a_file_replaced_between_attempts(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (root, port):
            new_data = os.urandom(2 * 1024 * 1024 + 5)

            def replace() -> None:  # a new file under the same path, as a re-publish would
                atomic_write_bytes(root / FILE[1:], new_data)

            proxy = CuttingProxy(port, 512 * 1024, before_second=replace)
            proxy_port = await proxy.start()
            try:
                result = await download(f"http://127.0.0.1:{proxy_port}{FILE}",
                                        tmp_path / "got.bundle", policy=_policy(),
                                        expected_sha256=hashlib.sha256(new_data).hexdigest())
            finally:
                await proxy.close()
            assert (tmp_path / "got.bundle").read_bytes() == new_data
            # If-Range failed on the server: the whole new file, never spliced onto the part.
            assert [line.split()[1] for line in proxy.statuses] == ["200", "200"]
            assert result.resumed_from_bytes == 0

    asyncio.run(body())
