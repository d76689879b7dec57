"""The KServe v2 load generator against a small in-test server speaking the binary extension.

The server answers ``scores = 2 * input`` after a configurable delay, can refuse every k-th request
with 503, and keeps Triton-style statistics. Bounds on rates and latencies are deliberately loose:
these tests check accounting (what counts as completed, failed, dropped), not the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

web = pytest.importorskip("aiohttp.web")

from agent.errors import ConfigError  # noqa: E402
from agent.tooling.loadgen import (  # noqa: E402
    HEADER_LENGTH,
    LoadResult,
    Target,
    decode_response,
    encode_request,
    expect_argmax,
    percentiles,
    run_closed_loop,
    run_open_loop,
    server_breakdown,
    stats_totals,
    sweep_closed_loop,
)

MODEL = "tiny"
# Two samples whose argmax differs, so a verifier can tell them apart.
SAMPLES = (
    np.array([[0.0, 3.0, 1.0, 2.0]], dtype=np.float32),
    np.array([[5.0, 0.0, 0.0, 1.0]], dtype=np.float32),
)
LABELS = (1, 0)


class FakeServer:
    """A KServe-like model server: binary in, binary out, a delay, optional 503s and stats."""

    def __init__(self, *, delay_s: float = 0.0, fail_every: int = 0, stats: bool = True) -> None:
        self.delay_s = delay_s
        self.fail_every = fail_every
        self.stats = stats
        self.received = 0
        self.last_header: dict | None = None
        self.success_count = 0
        self.compute_ns = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        if self.stats:
            app.router.add_get("/v2/models/{model}/stats", self.statistics)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        self.received += 1
        number = self.received
        body = await request.read()
        header_length = int(request.headers[HEADER_LENGTH])
        header = json.loads(body[:header_length])
        self.last_header = header
        spec = header["inputs"][0]
        array = np.frombuffer(body, dtype="<f4", offset=header_length).reshape(spec["shape"])
        if self.fail_every and number % self.fail_every == 0:
            return web.json_response({"error": "queue is full"}, status=503)
        started_ns = time.perf_counter_ns()
        await asyncio.sleep(self.delay_s)
        raw = (array * 2).astype("<f4").tobytes()
        reply = {
            "model_name": request.match_info["model"],
            "outputs": [
                {
                    "name": "scores",
                    "datatype": "FP32",
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
        }
        encoded = json.dumps(reply).encode()
        self.success_count += 1
        self.compute_ns += time.perf_counter_ns() - started_ns
        return web.Response(
            body=encoded + raw,
            headers={HEADER_LENGTH: str(len(encoded))},
            content_type="application/octet-stream",
        )

    async def statistics(self, request: web.Request) -> web.Response:
        count = self.success_count
        stats = {
            "success": {"count": count, "ns": self.compute_ns},
            "queue": {"count": count, "ns": count * 1_000_000},  # 1 ms each
            "compute_input": {"count": count, "ns": 0},
            "compute_infer": {"count": count, "ns": self.compute_ns},
            "compute_output": {"count": count, "ns": 0},
        }
        # Batches of two, so the mean batch size has a known value.
        document = {
            "model_stats": [
                {
                    "name": request.match_info["model"],
                    "version": "1",
                    "inference_count": count,
                    "execution_count": count // 2,
                    "inference_stats": stats,
                }
            ]
        }
        return web.json_response(document)


@asynccontextmanager
async def serving(server: FakeServer) -> AsyncIterator[str]:
    # Handlers are cancelled when their client gives up, and cleanup does not wait for stragglers,
    # so a test of timeouts does not sit out the fake's delay.
    runner = web.AppRunner(
        server.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1
    )
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def target(base_url: str, **overrides: object) -> Target:
    return Target(base_url=base_url, model=MODEL, input_name="x", samples=SAMPLES, **overrides)


def closed(server: FakeServer, *, concurrency: int, duration_s: float, **target_args: object) -> LoadResult:
    async def scenario() -> LoadResult:
        async with serving(server) as url:
            return await run_closed_loop(
                target(url, **target_args),
                concurrency=concurrency,
                duration_s=duration_s,
                warmup_s=0.2,
                timeout_s=2.0,
            )

    return asyncio.run(scenario())


def open_loop(server: FakeServer, **load_args: object) -> LoadResult:
    async def scenario() -> LoadResult:
        async with serving(server) as url:
            return await run_open_loop(target(url), warmup_s=0.1, **load_args)

    return asyncio.run(scenario())


# --- percentiles -----------------------------------------------------------------------------


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [10.0, 1.0, 7.0, 3.0, 2.0, 9.0, 4.0, 8.0, 6.0, 5.0]  # 1..10, shuffled
    assert percentiles(values, [0, 50, 90, 99, 100]) == pytest.approx([1.0, 5.5, 9.1, 9.91, 10.0])
    assert percentiles([4.0], [0, 50, 100]) == [4.0, 4.0, 4.0]
    assert percentiles([1.0, 3.0], [25]) == [1.5]


def test_percentiles_agree_with_numpy_default() -> None:
    values = np.random.default_rng(0).exponential(size=257).tolist()
    wanted = [1, 33.3, 50, 90, 99, 99.9]
    assert percentiles(values, wanted) == pytest.approx(np.percentile(values, wanted).tolist())


@pytest.mark.parametrize(("values", "percent"), [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentiles_reject_bad_arguments(values: list[float], percent: float) -> None:
    with pytest.raises(ValueError):
        percentiles(values, [percent])


# --- wire format -------------------------------------------------------------------------------


def test_request_encoding_uses_the_binary_extension() -> None:
    array = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    body, header_length = encode_request("x", array, datatype="FP32", outputs=["scores"])
    header = json.loads(body[:header_length])
    assert header["inputs"] == [
        {"name": "x", "shape": [1, 2, 3], "datatype": "FP32", "parameters": {"binary_data_size": 24}}
    ]
    assert header["outputs"] == [{"name": "scores", "parameters": {"binary_data": True}}]
    assert np.frombuffer(body[header_length:], dtype="<f4").tolist() == list(range(6))
    # Without named outputs every output is asked for in binary.
    body, header_length = encode_request("x", array.astype(np.float64), datatype="FP16")
    header = json.loads(body[:header_length])
    assert header["parameters"] == {"binary_data_output": True}
    assert len(body) - header_length == 12


def test_response_decoding_reads_binary_and_json_outputs() -> None:
    logits = np.array([[0.5, -1.0, 2.0]], dtype="<f4")
    labels = np.array([2], dtype="<i8")
    header = {
        "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 12}},
            {"name": "label", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}},
            {"name": "score", "datatype": "FP64", "shape": [1], "data": [0.75]},
        ]
    }
    encoded = json.dumps(header).encode()
    outputs = decode_response(encoded + logits.tobytes() + labels.tobytes(), len(encoded))
    assert outputs["logits"].tolist() == logits.tolist()
    assert outputs["label"].tolist() == [2]
    assert outputs["score"].tolist() == [0.75]
    # Whole-body JSON, as a server answers without the binary extension.
    plain = {"outputs": [{"name": "label", "datatype": "INT64", "shape": [2], "data": [3, 4]}]}
    assert decode_response(json.dumps(plain).encode(), None)["label"].tolist() == [3, 4]


TRUNCATED_HEADER = json.dumps(
    {"outputs": [{"name": "y", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}}]}
).encode()


@pytest.mark.parametrize(
    "body_and_length",
    [
        (b"not json", None),
        (b'{"error": "boom"}', None),
        (TRUNCATED_HEADER + bytes(8), len(TRUNCATED_HEADER)),  # 16 bytes promised, 8 sent
        (b'{"outputs":[{"name":"y","datatype":"BYTES","shape":[1],"data":["a"]}]}', None),
        (b"{}", 40),
    ],
)
def test_response_decoding_rejects_malformed_bodies(body_and_length: tuple[bytes, int | None]) -> None:
    with pytest.raises(ValueError):
        decode_response(*body_and_length)


def test_server_breakdown_averages_the_difference_of_two_readings() -> None:
    def reading(count: int, queue_ns: int, infer_ns: int, executions: int) -> dict:
        stats = {
            "success": {"count": count, "ns": 0},
            "queue": {"count": count, "ns": queue_ns},
            "compute_infer": {"count": str(count), "ns": str(infer_ns)},
        }
        entry = {"name": "m", "inference_count": count, "execution_count": executions, "inference_stats": stats}
        other = {"name": "other", "inference_count": 999, "execution_count": 1, "inference_stats": {}}
        return {"model_stats": [entry, other]}

    before = stats_totals(reading(10, 10_000_000, 50_000_000, 5), "m")
    after = stats_totals(reading(30, 70_000_000, 250_000_000, 10), "m")
    breakdown = server_breakdown(before, after)
    assert breakdown is not None
    assert breakdown.requests == 20
    assert breakdown.executions == 5
    assert breakdown.mean_batch_size == pytest.approx(4.0)
    assert breakdown.queue_ms == pytest.approx(3.0)
    assert breakdown.compute_infer_ms == pytest.approx(10.0)
    assert breakdown.compute_input_ms == 0.0
    assert stats_totals({"model_stats": []}, "m") is None
    assert server_breakdown(before, None) is None
    assert server_breakdown(before, before) is None  # no requests in the window


# --- closed loop -----------------------------------------------------------------------------------


def test_closed_loop_counts_and_latencies() -> None:
    server = FakeServer(delay_s=0.02)
    result = closed(server, concurrency=4, duration_s=0.8, outputs=("scores",))

    assert result.mode == "closed" and result.concurrency == 4
    assert result.errors == {}
    # Four workers over 20 ms answers: at most about 200/s, and far more than a serial client.
    assert 40 <= result.qps <= 220
    assert result.completed == pytest.approx(result.qps * 0.8)
    assert result.completed <= result.sent <= result.completed + 4
    assert 20.0 <= result.p50_ms <= result.p90_ms <= result.p99_ms <= result.max_ms
    assert 20.0 <= result.mean_ms <= result.max_ms < 2000.0
    # Requests carried the binary input and asked for the named output in binary.
    assert server.last_header["inputs"][0]["parameters"] == {"binary_data_size": 16}
    assert server.last_header["outputs"] == [{"name": "scores", "parameters": {"binary_data": True}}]
    # The stats reading covers the window: the fake charges 1 ms of queue per request.
    assert result.server is not None
    assert result.server.queue_ms == pytest.approx(1.0)
    assert result.server.mean_batch_size == pytest.approx(2.0, rel=0.2)
    assert 15.0 <= result.server.compute_infer_ms <= result.p50_ms + 5.0
    # The two readings are taken near, not at, the window's edges.
    assert abs(result.server.requests - result.completed) <= max(8, result.completed // 5)
    document = json.loads(json.dumps(result.to_dict()))
    assert document["server"]["compute_ms"] == pytest.approx(result.server.compute_ms)


def test_closed_loop_counts_errors_by_status() -> None:
    result = closed(FakeServer(fail_every=3), concurrency=2, duration_s=0.5)

    assert set(result.errors) == {"http_503"}
    failed = result.errors["http_503"]
    # Exactly every third request fails; the window edges cut at most a few off either count.
    assert failed > 10
    assert abs(2 * failed - result.completed) <= 6
    assert result.error_count == failed
    assert result.sent >= result.completed + failed


def test_closed_loop_verifies_predictions() -> None:
    good = closed(FakeServer(), concurrency=1, duration_s=0.3, verify=expect_argmax(LABELS))
    assert good.errors == {} and good.completed > 0

    wrong = closed(FakeServer(), concurrency=1, duration_s=0.3, verify=expect_argmax(LABELS[::-1]))
    assert wrong.completed == 0
    assert set(wrong.errors) == {"mismatch"}


def test_closed_loop_tolerates_a_server_without_stats() -> None:
    result = closed(FakeServer(stats=False), concurrency=1, duration_s=0.2)
    assert result.completed > 0 and result.errors == {}
    assert result.server is None
    assert json.loads(json.dumps(result.to_dict()))["server"] is None


def test_closed_loop_counts_timeouts() -> None:
    async def scenario() -> LoadResult:
        async with serving(FakeServer(delay_s=1.0)) as url:
            return await run_closed_loop(
                target(url), concurrency=2, duration_s=0.5, warmup_s=0.0, timeout_s=0.1
            )

    result = asyncio.run(scenario())
    # Two workers giving up after 0.1 s each, for 0.5 s: about ten timeouts, no answers.
    assert set(result.errors) == {"timeout"}
    assert result.errors["timeout"] >= 4
    assert result.completed == 0 and result.qps == 0.0
    assert result.p50_ms is None and result.max_ms is None
    assert json.loads(json.dumps(result.to_dict()))["p99_ms"] is None


def test_closed_loop_counts_refused_connections() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the run: nothing listens there

    async def scenario() -> LoadResult:
        return await run_closed_loop(
            target(f"http://127.0.0.1:{port}"), concurrency=1, duration_s=0.2, warmup_s=0.0
        )

    result = asyncio.run(scenario())
    assert result.completed == 0
    assert set(result.errors) == {"connection"}
    assert result.server is None


def test_sweep_runs_each_level_in_turn() -> None:
    async def start() -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(FakeServer(delay_s=0.01).app(), access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"

    # The sweep runs its own event loop, so the server gets one of its own in a thread.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, url = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)
    seen: list[int] = []
    try:
        results = sweep_closed_loop(
            target(url),
            [1, 3],
            duration_s=0.3,
            warmup_s=0.05,
            on_result=lambda result: seen.append(result.concurrency or 0),
        )
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    assert seen == [1, 3]
    assert [result.concurrency for result in results] == [1, 3]
    assert all(result.completed > 0 and not result.errors for result in results)
    # Three workers on a 10 ms server answer more than one does.
    assert results[1].qps > results[0].qps


# --- open loop ---------------------------------------------------------------------------------------


def test_open_loop_honours_the_rate_roughly() -> None:
    result = open_loop(FakeServer(delay_s=0.005), rate_per_s=100.0, duration_s=1.0, seed=3)

    assert result.mode == "open" and result.rate_per_s == 100.0 and result.concurrency is None
    # A Poisson count with mean 100 has a standard deviation of 10; the bounds are five of them.
    assert 50 <= result.sent <= 150
    assert result.errors == {}
    assert result.completed == result.sent  # the drain waits for every request in the window
    assert result.qps == pytest.approx(result.sent / 1.0)
    assert result.p50_ms >= 5.0
    assert result.server is not None and result.server.requests >= result.completed - 2


def test_open_loop_drops_arrivals_at_the_in_flight_cap() -> None:
    result = open_loop(
        FakeServer(delay_s=0.1, stats=False), rate_per_s=100.0, duration_s=0.5, max_in_flight=1, seed=1
    )
    # One request at a time, 100 ms each: about five are sent and the other arrivals are dropped.
    assert 2 <= result.sent <= 8
    assert result.errors.get("dropped", 0) >= 20
    assert result.completed == result.sent
    assert result.server is None


def test_open_loop_schedule_is_repeatable() -> None:
    first = open_loop(FakeServer(stats=False), rate_per_s=50.0, duration_s=0.4, seed=7)
    second = open_loop(FakeServer(stats=False), rate_per_s=50.0, duration_s=0.4, seed=7)
    assert first.sent == second.sent


# --- configuration -----------------------------------------------------------------------------------


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        Target(base_url="http://x", model=MODEL, input_name="x", samples=())
    with pytest.raises(ConfigError):
        target("http://x", datatype="BYTES")
    with pytest.raises(ConfigError):
        asyncio.run(run_closed_loop(target("http://x"), concurrency=0, duration_s=1.0))
    with pytest.raises(ConfigError):
        asyncio.run(run_open_loop(target("http://x"), rate_per_s=0.0, duration_s=1.0))
    assert math.isclose(percentiles([1.0, 2.0], [50])[0], 1.5)


def test_cpu_seconds_counts_live_processes_and_skips_gone_ones() -> None:
    import os
    import time

    from agent.tooling.loadgen import cpu_seconds

    before = cpu_seconds([os.getpid()])
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = cpu_seconds([os.getpid(), 2**22 + 12345])  # above the default pid_max: never alive
    assert after - before >= 0.03
