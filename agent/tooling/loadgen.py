"""A KServe v2 HTTP load generator: closed loop (N workers) and open loop (Poisson arrivals).

``edge-agent bench serve`` uses it to measure our daemon and, with the same client code, Triton
(PyTriton) serving the same model, so the two numbers differ only by the server.

On a Jetson the generator shares the CPU with the server it measures, so it keeps its own work per
request small: each sample's whole HTTP request is built once, requests go over keep-alive
connections of :mod:`agent.tooling.httpconn` (an asyncio protocol with the ``httptools``
parser) on one event loop, and the bookkeeping is two ``perf_counter`` readings and an append. Responses are
still checked (status, then the output tensors decoded) so that a failing server shows up as
counted errors, never as fast answers.

Needs only numpy and httptools (no torch, no ONNX Runtime) and runs on Python 3.10+.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from agent.errors import ConfigError
from agent.tooling.httpconn import ConnectionPool, Endpoint, ResponseError, prepare

HEADER_LENGTH = "Inference-Header-Content-Length"

# KServe v2 datatypes with a fixed element size, as little-endian numpy types. BYTES (length-
# prefixed strings) and BF16 (no numpy type) are not needed for vision models and are refused.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

# Error kinds, the keys of ``LoadResult.errors``; an HTTP error is "http_<status>".
ERROR_TIMEOUT = "timeout"
ERROR_CONNECTION = "connection"
ERROR_DECODE = "decode"
ERROR_MISMATCH = "mismatch"
ERROR_DROPPED = "dropped"

STATS_TIMEOUT_S = 2.0

Verifier = Callable[[int, Mapping[str, np.ndarray]], bool]
"""``verify(sample_index, outputs) -> bool``; False counts the request as a "mismatch" error."""


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


@dataclass(frozen=True, kw_only=True)
class ServerBreakdown:
    """Where the server says the time went, per request, over the measured window.

    From the difference of two ``/v2/models/{m}/stats`` readings (Triton's statistics extension).
    Triton charges a whole batch's compute time to every request in it, so ``compute_*`` is close to
    the time of one batch, not a share of it.
    """

    requests: int
    executions: int
    mean_batch_size: float | None
    queue_ms: float
    compute_input_ms: float
    compute_infer_ms: float
    compute_output_ms: float

    @property
    def compute_ms(self) -> float:
        return self.compute_input_ms + self.compute_infer_ms + self.compute_output_ms


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """One measured window.

    ``sent`` counts requests started in the window. In closed loop, ``completed`` and ``errors``
    count requests that started and finished inside it; in open loop, every arrival scheduled in
    the window is accounted for (completed, an error, or "dropped" at the in-flight cap), including
    requests that finish while the generator drains.
    """

    mode: str
    concurrency: int | None
    rate_per_s: float | None
    duration_s: float
    sent: int
    completed: int
    errors: dict[str, int]
    qps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None
    server: ServerBreakdown | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``server`` is null when the server has no statistics endpoint."""
        document = asdict(self)
        if self.server is not None:
            document["server"]["compute_ms"] = self.server.compute_ms
        return document


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time so far of the given processes (all their threads), from /proc; a
    process that has gone counts nothing. Both serve benchmarks read a server's CPU with it."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def percentiles(values: Sequence[float], percents: Sequence[float]) -> list[float]:
    """The given percentiles of ``values``, interpolating linearly between the closest ranks.

    This is numpy's default (``method="linear"``): percentile ``p`` of ``n`` sorted values sits at
    position ``(n - 1) * p / 100``.

    Raises:
        ValueError: ``values`` is empty or a percent is outside 0..100.
    """
    if not values:
        raise ValueError("percentiles of an empty sequence")
    ordered = sorted(values)
    last = len(ordered) - 1
    result = []
    for percent in percents:
        if not 0.0 <= percent <= 100.0:
            raise ValueError(f"percent must be within 0..100, got {percent}")
        position = last * percent / 100.0
        lower = math.floor(position)
        upper = min(lower + 1, last)
        weight = position - lower
        result.append(ordered[lower] + (ordered[upper] - ordered[lower]) * weight)
    return result


def encode_request(
    input_name: str, array: np.ndarray, *, datatype: str, outputs: Sequence[str] = ()
) -> tuple[bytes, int]:
    """An infer request body in the binary tensor extension and the length of its JSON header."""
    raw = np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": input_name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
        ]
    }
    if outputs:
        header["outputs"] = [
            {"name": name, "parameters": {"binary_data": True}} for name in outputs
        ]
    else:
        header["parameters"] = {"binary_data_output": True}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + raw, len(encoded)


def decode_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The output tensors of an infer response, binary or JSON.

    Args:
        body: The whole response body.
        header_length: The ``Inference-Header-Content-Length`` value, or None when the response
            is plain JSON.

    Raises:
        ValueError: The body is not a well-formed response (bad JSON, unknown datatype, a binary
            tensor that does not fit the body or its shape).
    """
    if header_length is None:
        header = json.loads(body)
        offset = len(body)
    else:
        if not 0 < header_length <= len(body):
            raise ValueError(f"header length {header_length} outside a body of {len(body)} bytes")
        header = json.loads(body[:header_length])
        offset = header_length
    outputs: dict[str, np.ndarray] = {}
    try:
        for output in header["outputs"]:
            dtype = DATATYPES.get(output["datatype"])
            if dtype is None:
                raise ValueError(f"unsupported output datatype {output['datatype']!r}")
            shape = [int(dim) for dim in output["shape"]]
            size = (output.get("parameters") or {}).get("binary_data_size")
            if size is None:
                array = np.asarray(output["data"], dtype=dtype).reshape(shape)
            else:
                if offset + size > len(body) or size % dtype.itemsize:
                    raise ValueError(f"binary output {output['name']!r} does not fit the body")
                count = size // dtype.itemsize
                array = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
                offset += size
            outputs[output["name"]] = array
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed infer response: {exc!r}") from exc
    return outputs


def expect_argmax(labels: Sequence[int | Sequence[int]], *, output: str | None = None) -> Verifier:
    """A verifier that the argmax over the last axis matches ``labels[sample_index]``.

    Args:
        labels: Per sample, the expected class (or one class per row of a batched sample).
        output: The output to check; the first one in the response when None.
    """
    expected = [np.atleast_1d(np.asarray(label)).ravel() for label in labels]

    def verify(index: int, outputs: Mapping[str, np.ndarray]) -> bool:
        scores = outputs[output] if output is not None else next(iter(outputs.values()), None)
        if scores is None:
            return False
        return np.array_equal(np.argmax(scores, axis=-1).ravel(), expected[index])

    return verify


def server_breakdown(
    before: Mapping[str, int] | None, after: Mapping[str, int] | None
) -> ServerBreakdown | None:
    """Per-request averages between two readings of :func:`stats_totals`; None without both."""
    if before is None or after is None:
        return None

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    def mean_ms(stat: str) -> float:
        count = delta(f"{stat}_count")
        return delta(f"{stat}_ns") / count / 1e6 if count > 0 else 0.0

    requests = delta("success_count")
    if requests <= 0:
        return None
    executions = delta("execution_count")
    inferences = delta("inference_count")
    return ServerBreakdown(
        requests=requests,
        executions=executions,
        mean_batch_size=inferences / executions if executions > 0 else None,
        queue_ms=mean_ms("queue"),
        compute_input_ms=mean_ms("compute_input"),
        compute_infer_ms=mean_ms("compute_infer"),
        compute_output_ms=mean_ms("compute_output"),
    )


def stats_totals(document: Mapping[str, Any], model: str) -> dict[str, int] | None:
    """Counters of ``model`` summed over its versions in a ``/stats`` response; None if absent."""
    entries = [entry for entry in document.get("model_stats", []) if entry.get("name") == model]
    if not entries:
        return None
    totals: Counter[str] = Counter()
    for entry in entries:
        # Triton's HTTP endpoint writes counters as numbers; protobuf-to-JSON writes uint64 as
        # strings. int() reads both.
        totals["inference_count"] += int(entry.get("inference_count", 0))
        totals["execution_count"] += int(entry.get("execution_count", 0))
        stats = entry.get("inference_stats") or {}
        for name in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            stat = stats.get(name) or {}
            totals[f"{name}_count"] += int(stat.get("count", 0))
            totals[f"{name}_ns"] += int(stat.get("ns", 0))
    return dict(totals)


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
