"""The load generator's HTTP/1.1 client (agent.tooling.httpconn) against a raw socket server whose
bytes each test scripts: framing, keep-alive and close, bad answers, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

pytest.importorskip("httptools")

from agent.errors import ConfigError
from agent.tooling.httpconn import ConnectionPool, Endpoint, ResponseError, prepare

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Tag: a\r\n\r\nhello"

Reply = Callable[[bytes], "bytes | None"]  # request bytes -> response bytes (None: no answer)


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


@asynccontextmanager
async def scripted(reply: Reply, *, byte_by_byte: bool = False,
                   close_after: bool = False) -> AsyncIterator[tuple[Endpoint, dict]]:
    """A server answering each request with ``reply(request)``; counts connections and
    requests."""
    seen: dict = {"connections": 0, "requests": []}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while (request := await _read_request(reader)) is not None:
                seen["requests"].append(request)
                answer = reply(request)
                if answer is None:
                    await asyncio.sleep(10)
                    return
                if byte_by_byte:
                    for index in range(len(answer)):
                        writer.write(answer[index:index + 1])
                        await writer.drain()
                else:
                    writer.write(answer)
                    await writer.drain()
                if close_after:
                    return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Endpoint("127.0.0.1", port), seen
    finally:
        server.close()


@asynccontextmanager
async def pool_on(reply: Reply, *, timeout_s: float = 5.0, **server: bool
                  ) -> AsyncIterator[tuple[Endpoint, dict, ConnectionPool]]:
    async with scripted(reply, **server) as (endpoint, seen):
        pool = ConnectionPool(endpoint, timeout_s=timeout_s)
        try:
            yield endpoint, seen, pool
        finally:
            pool.close()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_endpoint_parsing() -> None:
    assert Endpoint.parse("http://127.0.0.1:8000") == Endpoint("127.0.0.1", 8000)
    assert Endpoint.parse("http://localhost/") == Endpoint("localhost", 80)
    assert Endpoint.parse("http://[::1]:9000").authority == "[::1]:9000"
    for bad in ("https://127.0.0.1:8000", "127.0.0.1:8000", "http://host:8000/v2",
                "http://host:notaport"):
        with pytest.raises(ConfigError):
            Endpoint.parse(bad)


def test_prepared_request_bytes() -> None:
    endpoint = Endpoint("127.0.0.1", 8000)
    request = prepare(endpoint, "POST", "/v2/models/my model/infer", body=b"abc",
                      headers={"X-A": "1"})
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.split(b"\r\n") == [b"POST /v2/models/my%20model/infer HTTP/1.1",
                                   b"Host: 127.0.0.1:8000", b"X-A: 1", b"Content-Length: 3"]
    assert body == b"abc"
    assert b"Content-Length" not in prepare(endpoint, "GET", "/v2")
    with pytest.raises(ConfigError, match="line break"):
        prepare(endpoint, "GET", "/", headers={"X-A": "1\r\nX-B: 2"})


def test_keep_alive_reuses_one_connection() -> None:
    async def scenario() -> None:
        async with pool_on(lambda request: OK) as (endpoint, seen, pool):
            request = prepare(endpoint, "POST", "/x", body=b"12345")
            for _ in range(5):
                response = await pool.request(request)
                assert (response.status, response.body) == (200, b"hello")
                assert response.headers["x-tag"] == "a"
        assert seen["connections"] == 1
        assert seen["requests"] == [request] * 5

    run(scenario())


def test_concurrent_requests_open_one_connection_each() -> None:
    async def scenario() -> None:
        async with pool_on(lambda request: OK) as (endpoint, seen, pool):
            request = prepare(endpoint, "GET", "/x")
            for _ in range(3):
                answers = await asyncio.gather(*(pool.request(request) for _ in range(4)))
                assert [answer.body for answer in answers] == [b"hello"] * 4
        assert seen["connections"] == 4  # reused across the three rounds

    run(scenario())


def test_chunked_and_split_responses_are_assembled() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
               b"Inference-Header-Content-Length: 2\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")

    async def scenario() -> None:
        async with pool_on(lambda request: chunked, byte_by_byte=True) as (endpoint, _, pool):
            response = await pool.request(prepare(endpoint, "GET", "/x"))
        assert response.body == b"abcde"
        assert response.headers["inference-header-content-length"] == "2"

    run(scenario())


def test_connection_close_is_honoured() -> None:
    closing = b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbusy"

    async def scenario() -> None:
        async with pool_on(lambda request: closing, close_after=True) as (endpoint, seen, pool):
            for _ in range(3):
                response = await pool.request(prepare(endpoint, "GET", "/x"))
                assert (response.status, response.body) == (503, b"busy")
        assert seen["connections"] == 3

    run(scenario())


def test_body_until_close_is_read() -> None:
    async def scenario() -> None:
        until_close = b"HTTP/1.0 200 OK\r\n\r\nall of it"
        async with pool_on(lambda request: until_close, close_after=True) as (endpoint, _, pool):
            response = await pool.request(prepare(endpoint, "GET", "/x"))
        assert response.body == b"all of it"

    run(scenario())


def test_garbage_answer_is_a_response_error() -> None:
    async def scenario() -> None:
        async with pool_on(lambda request: b"SMTP ready\r\n\r\n") as (endpoint, _, pool):
            with pytest.raises(ResponseError, match="malformed HTTP response"):
                await pool.request(prepare(endpoint, "GET", "/x"))

    run(scenario())


def test_answer_cut_short_is_a_connection_error() -> None:
    async def scenario() -> None:
        async with pool_on(lambda request: OK[:-2], close_after=True) as (endpoint, _, pool):
            with pytest.raises(ConnectionError):
                await pool.request(prepare(endpoint, "GET", "/x"))

    run(scenario())


def test_timeout_closes_the_connection_and_the_next_request_gets_a_new_one() -> None:
    answers = iter([None, OK])

    async def scenario() -> None:
        async with pool_on(lambda request: next(answers), timeout_s=0.2) as (endpoint, seen, pool):
            request = prepare(endpoint, "GET", "/x")
            with pytest.raises(TimeoutError):
                await pool.request(request)
            response = await pool.request(request)
        assert response.body == b"hello"
        assert seen["connections"] == 2

    run(scenario())


def test_refused_connection_is_an_os_error() -> None:
    async def scenario() -> None:
        async with scripted(lambda request: OK) as (endpoint, _):
            pass  # closed again: nothing listens on the port now
        with pytest.raises(OSError):
            await ConnectionPool(endpoint, timeout_s=2).request(prepare(endpoint, "GET", "/x"))

    run(scenario())
