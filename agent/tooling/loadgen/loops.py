"""The load itself: the request target, closed loop (N workers, each sending its next request
when the last is answered), open loop (Poisson arrivals at a fixed rate), and a sweep over
concurrencies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from agent.errors import ConfigError
from agent.tooling.httpconn import ConnectionPool, Endpoint, ResponseError, prepare
from agent.tooling.loadgen.measures import (
    ERROR_CONNECTION,
    ERROR_DECODE,
    ERROR_DROPPED,
    ERROR_MISMATCH,
    ERROR_TIMEOUT,
    LoadResult,
    ServerBreakdown,
    percentiles,
    server_breakdown,
    stats_totals,
)
from agent.tooling.loadgen.messages import (
    DATATYPES,
    HEADER_LENGTH,
    Verifier,
    decode_response,
    encode_request,
)

STATS_TIMEOUT_S = 2.0  # one statistics reading, before or after a window


@dataclass(frozen=True, kw_only=True, eq=False)  # samples are arrays: no element-wise ==
class Target:
    """What to send, and where.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        model: The model name used in ``/v2/models/{model}/infer``.
        input_name: The model's input tensor.
        samples: One or more input tensors, batch dimension included; the request shape is the
            sample's shape. Requests cycle through them in order.
        datatype: The KServe datatype of the input; samples are converted to it once.
        outputs: Outputs to request (all in binary); empty asks for every output in binary.
        verify: An optional check of each decoded response.
        headers: Extra headers sent with every request (``Authorization: Bearer ...`` for a
            server with a token).
    """

    base_url: str
    model: str
    input_name: str
    samples: tuple[np.ndarray, ...]
    datatype: str = "FP32"
    outputs: tuple[str, ...] = ()
    verify: Verifier | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ConfigError("a load target needs at least one input sample", model=self.model)
        if self.datatype not in DATATYPES:
            raise ConfigError(
                "unsupported input datatype", found=self.datatype, expected=", ".join(DATATYPES)
            )


class _Client:
    """Prepared requests over a keep-alive connection pool; ``infer`` returns an error kind or
    None."""

    def __init__(self, pool: ConnectionPool, target: Target) -> None:
        self._pool = pool
        self._target = target
        endpoint = pool.endpoint
        self._requests = []
        for sample in target.samples:
            body, header_length = encode_request(
                target.input_name, sample, datatype=target.datatype, outputs=target.outputs
            )
            headers = {**target.headers, "Content-Type": "application/octet-stream",
                       HEADER_LENGTH: str(header_length)}
            self._requests.append(prepare(endpoint, "POST", f"/v2/models/{target.model}/infer",
                                          body=body, headers=headers))
        self._stats_request = prepare(endpoint, "GET", f"/v2/models/{target.model}/stats",
                                      headers=target.headers)
        self._next = 0

    def next_index(self) -> int:
        index = self._next
        self._next = (index + 1) % len(self._requests)
        return index

    async def infer(self, index: int) -> str | None:
        try:
            response = await self._pool.request(self._requests[index])
        except (asyncio.TimeoutError, TimeoutError):
            return ERROR_TIMEOUT
        except OSError:
            return ERROR_CONNECTION
        except ResponseError:
            return ERROR_DECODE
        if response.status != 200:
            return f"http_{response.status}"
        header_length = response.headers.get(HEADER_LENGTH.lower())
        try:
            outputs = decode_response(response.body,
                                      int(header_length) if header_length else None)
        except ValueError:
            return ERROR_DECODE
        verify = self._target.verify
        if verify is not None and not verify(index, outputs):
            return ERROR_MISMATCH
        return None

    async def stats(self) -> dict[str, int] | None:
        """The model's statistics counters, or None when the server has no such endpoint."""
        try:
            response = await self._pool.request(self._stats_request, timeout_s=STATS_TIMEOUT_S)
            if response.status != 200:
                return None
            return stats_totals(json.loads(response.body), self._target.model)
        except (asyncio.TimeoutError, TimeoutError, OSError, ResponseError, ValueError,
                AttributeError):
            return None


def _pool(target: Target, timeout_s: float) -> ConnectionPool:
    return ConnectionPool(Endpoint.parse(target.base_url), timeout_s=timeout_s)


def _check_window(duration_s: float, warmup_s: float) -> None:
    if duration_s <= 0:
        raise ConfigError("the measured duration must be positive", duration_s=duration_s)
    if warmup_s < 0:
        raise ConfigError("the warm-up must not be negative", warmup_s=warmup_s)


def _result(
    *,
    mode: str,
    concurrency: int | None,
    rate_per_s: float | None,
    duration_s: float,
    sent: int,
    latencies_s: list[float],
    errors: Counter[str],
    server: ServerBreakdown | None,
) -> LoadResult:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean_ms: float | None = None
    max_ms: float | None = None
    if latencies_s:
        p50, p90, p99 = (value * 1e3 for value in percentiles(latencies_s, (50, 90, 99)))
        mean_ms = sum(latencies_s) / len(latencies_s) * 1e3
        max_ms = max(latencies_s) * 1e3
    return LoadResult(
        mode=mode,
        concurrency=concurrency,
        rate_per_s=rate_per_s,
        duration_s=duration_s,
        sent=sent,
        completed=len(latencies_s),
        errors=dict(sorted(errors.items())),
        qps=len(latencies_s) / duration_s,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=mean_ms,
        max_ms=max_ms,
        server=server,
    )


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_closed_loop(
    target: Target,
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 30.0,
    server_stats: bool = True,
) -> LoadResult:
    """``concurrency`` workers, each sending its next request as soon as the previous one answers.

    Requests run for ``warmup_s`` unrecorded, then ``duration_s`` measured; only requests that
    start and finish inside the measured window count, so ``qps`` is completions per second of it.

    Args:
        target: What to send and where.
        concurrency: Number of workers (requests in flight).
        duration_s: Length of the measured window.
        warmup_s: Unrecorded load before it (connections, server warm-up, batcher steady state).
        timeout_s: Per-request limit; a slower answer is a "timeout" error.
        server_stats: Read ``/v2/models/{m}/stats`` at both ends of the window.
    """
    if concurrency < 1:
        raise ConfigError("concurrency must be at least 1", concurrency=concurrency)
    _check_window(duration_s, warmup_s)
    # The statistics reads get a connection of their own: the pool opens one when all are busy.
    with contextlib.closing(_pool(target, timeout_s)) as pool:
        client = _Client(pool, target)
        latencies_s: list[float] = []
        errors: Counter[str] = Counter()
        sent = 0
        window_start = time.perf_counter() + warmup_s
        window_end = window_start + duration_s

        async def worker() -> None:
            nonlocal sent
            while True:
                started = time.perf_counter()
                if started >= window_end:
                    return
                error = await client.infer(client.next_index())
                finished = time.perf_counter()
                if started < window_start:
                    continue
                sent += 1
                if finished > window_end:
                    continue
                if error is None:
                    latencies_s.append(finished - started)
                else:
                    errors[error] += 1

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            await _sleep_until(window_start)
            before = await client.stats() if server_stats else None
            await _sleep_until(window_end)
            after = await client.stats() if server_stats and before is not None else None
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
    return _result(
        mode="closed",
        concurrency=concurrency,
        rate_per_s=None,
        duration_s=duration_s,
        sent=sent,
        latencies_s=latencies_s,
        errors=errors,
        server=server_breakdown(before, after),
    )


async def run_open_loop(
    target: Target,
    *,
    rate_per_s: float,
    duration_s: float,
    warmup_s: float = 1.0,
    max_in_flight: int = 256,
    timeout_s: float = 10.0,
    seed: int = 0,
    server_stats: bool = True,
) -> LoadResult:
    """Poisson arrivals at ``rate_per_s``, each sent without waiting for earlier ones to answer.

    An arrival that finds ``max_in_flight`` requests outstanding is not sent and counts as
    "dropped". When the schedule ends, the requests still in flight are awaited (each bounded by
    ``timeout_s``), so every arrival in the window is accounted for. Latency runs from the moment a
    request is sent; if the event loop falls behind the schedule, the late arrivals go out at once,
    which keeps the mean rate but bunches them.

    Args:
        target: What to send and where.
        rate_per_s: Mean arrival rate.
        duration_s: Length of the measured window.
        warmup_s: Unrecorded arrivals before it, at the same rate.
        max_in_flight: Bound on outstanding requests (and on connections).
        timeout_s: Per-request limit; a slower answer is a "timeout" error.
        seed: Seed of the arrival process, for repeatable schedules.
        server_stats: Read ``/v2/models/{m}/stats`` before the window and after the drain.
    """
    if rate_per_s <= 0:
        raise ConfigError("the request rate must be positive", rate_per_s=rate_per_s)
    if max_in_flight < 1:
        raise ConfigError("max_in_flight must be at least 1", max_in_flight=max_in_flight)
    _check_window(duration_s, warmup_s)
    arrivals = random.Random(seed)
    with contextlib.closing(_pool(target, timeout_s)) as pool:
        client = _Client(pool, target)
        latencies_s: list[float] = []
        errors: Counter[str] = Counter()
        sent = 0
        pending: set[asyncio.Task[None]] = set()

        async def send(index: int, measured: bool) -> None:
            started = time.perf_counter()
            error = await client.infer(index)
            finished = time.perf_counter()
            if not measured:
                return
            if error is None:
                latencies_s.append(finished - started)
            else:
                errors[error] += 1

        start = time.perf_counter()
        window_start = start + warmup_s
        window_end = window_start + duration_s
        before = None
        arrival = start
        try:
            while True:
                arrival += arrivals.expovariate(rate_per_s)
                if arrival >= window_end:
                    break
                if before is None and server_stats and arrival >= window_start:
                    before = await client.stats()
                await _sleep_until(arrival)
                measured = arrival >= window_start
                if len(pending) >= max_in_flight:
                    if measured:
                        errors[ERROR_DROPPED] += 1
                    continue
                if measured:
                    sent += 1
                task = asyncio.get_running_loop().create_task(send(client.next_index(), measured))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await _sleep_until(window_end)
            if pending:
                await asyncio.gather(*pending)
            after = await client.stats() if before is not None else None
        finally:
            for task in pending:
                task.cancel()
    return _result(
        mode="open",
        concurrency=None,
        rate_per_s=rate_per_s,
        duration_s=duration_s,
        sent=sent,
        latencies_s=latencies_s,
        errors=errors,
        server=server_breakdown(before, after),
    )


def sweep_closed_loop(
    target: Target,
    concurrencies: Sequence[int],
    *,
    duration_s: float,
    warmup_s: float = 1.0,
    timeout_s: float = 30.0,
    server_stats: bool = True,
    on_result: Callable[[LoadResult], None] | None = None,
) -> list[LoadResult]:
    """Closed-loop windows at each concurrency in turn, on one event loop (a blocking call)."""

    async def sweep() -> list[LoadResult]:
        results = []
        for concurrency in concurrencies:
            result = await run_closed_loop(
                target,
                concurrency=concurrency,
                duration_s=duration_s,
                warmup_s=warmup_s,
                timeout_s=timeout_s,
                server_stats=server_stats,
            )
            if on_result is not None:
                on_result(result)
            results.append(result)
        return results

    return asyncio.run(sweep())
