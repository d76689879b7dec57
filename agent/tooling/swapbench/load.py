"""Closed-loop load paced to a rate, with every request's times, answering version and outcome
kept, so that the benchmark can later ask which requests overlapped a swap and which version
answered when.

``workers`` clients each send a request, wait for its answer, then wait for their next slot
(one every ``workers / rate_per_s`` seconds, the workers' slots spread evenly): never more than
``workers`` requests in flight (closed loop), and about ``rate_per_s`` of them a second while the
daemon keeps up. A worker whose answer came after its next slot sends at once, so a stall shows
up as latency, not as a lower rate hidden from the figures.

The load runs on its own event loop in a thread of this process (:class:`PacedLoad`), while the
benchmark's main thread drives the updates over the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass

import numpy as np

from agent.tooling.httpconn import ConnectionPool, Endpoint, ResponseError, prepare
from agent.tooling.loadgen import (
    ERROR_CONNECTION,
    ERROR_DECODE,
    ERROR_TIMEOUT,
    HEADER_LENGTH,
    decode_response,
    encode_request,
)

# The outcome of an answer whose outputs hold NaN or Inf (a misbehaving version served it).
NON_FINITE = "non_finite"
OK = "ok"


@dataclass(frozen=True)
class Record:
    """One request: when it was sent and answered (``perf_counter`` seconds), the version that
    answered (None without an answer), and ``ok``, ``non_finite`` or an error kind."""

    started_s: float
    finished_s: float
    version: int | None
    outcome: str
    negative: bool  # it carried a frame of negative mean

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def failed(self) -> bool:
        return self.outcome not in (OK, NON_FINITE)


def frames(count: int, shape: tuple[int, ...], *, seed: int = 1) -> list[np.ndarray]:
    """``count`` frames (batch of one) of positive values: a healthy canary sees these."""
    rng = np.random.default_rng(seed)
    return [np.abs(rng.normal(size=(1, *shape))).astype(np.float32) for _ in range(count)]


class PacedLoad:
    """The paced closed loop (module docstring) against ``/v2/models/{model}/infer``.

    Args:
        base_url: The daemon, ``http://127.0.0.1:PORT``.
        model: The model's name.
        input_name: Its input tensor.
        samples: Frames sent in turn; their negation is sent while :attr:`negative` is set.
        rate_per_s: Requests a second, over all workers.
        workers: Requests in flight at most.
        timeout_s: A request unanswered this long counts as a ``timeout`` failure.
    """

    def __init__(self, *, base_url: str, model: str, input_name: str,
                 samples: list[np.ndarray], rate_per_s: float, workers: int,
                 timeout_s: float = 30.0) -> None:
        if not rate_per_s > 0 or workers < 1:
            raise ValueError(f"need a positive rate and workers, got {rate_per_s}, {workers}")
        self.endpoint = Endpoint.parse(base_url)
        self.rate_per_s = rate_per_s
        self.workers = workers
        self.timeout_s = timeout_s
        self.records: list[Record] = []  # appended by the load's thread only
        self.negative = threading.Event()
        path = f"/v2/models/{model}/infer"
        self._requests: dict[bool, list[bytes]] = {}
        for negative in (False, True):
            self._requests[negative] = []
            for sample in samples:
                body, header_length = encode_request(input_name, -sample if negative else sample,
                                                     datatype="FP32")
                self._requests[negative].append(prepare(
                    self.endpoint, "POST", path, body=body,
                    headers={"Content-Type": "application/octet-stream",
                             HEADER_LENGTH: str(header_length)}))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    # -- the thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="swap-bench-load", daemon=True)
        self._thread.start()

    def stop(self) -> list[Record]:
        """Stop sending, wait for the requests in flight, and return every record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)
            if self._thread.is_alive():
                raise RuntimeError("the load generator did not stop")
        if self._failure is not None:
            raise RuntimeError("the load generator failed") from self._failure
        return self.records

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._failure = exc

    async def _run(self) -> None:
        with contextlib.closing(ConnectionPool(self.endpoint, timeout_s=self.timeout_s)) as pool:
            period_s = self.workers / self.rate_per_s
            first_s = time.perf_counter()
            await asyncio.gather(*(self._worker(pool, first_s + period_s * index / self.workers,
                                                period_s, index)
                                   for index in range(self.workers)))

    async def _worker(self, pool: ConnectionPool, slot_s: float, period_s: float,
                      index: int) -> None:
        count = 0
        while not self._stop.is_set():
            delay = slot_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            negative = self.negative.is_set()
            requests = self._requests[negative]
            request = requests[(index + count * self.workers) % len(requests)]
            started = time.perf_counter()
            version, outcome = await self._send(pool, request)
            finished = time.perf_counter()
            self.records.append(Record(started, finished, version, outcome, negative))
            count += 1
            # The next slot, or now when this answer came after it (never a burst to catch up).
            slot_s = max(slot_s + period_s, finished)

    async def _send(self, pool: ConnectionPool, request: bytes) -> tuple[int | None, str]:
        try:
            response = await pool.request(request)
        except (asyncio.TimeoutError, TimeoutError):
            return None, ERROR_TIMEOUT
        except OSError:
            return None, ERROR_CONNECTION
        except ResponseError:
            return None, ERROR_DECODE
        if response.status != 200:
            return None, f"http_{response.status}"
        text = response.headers.get(HEADER_LENGTH.lower())
        try:
            header_length = int(text) if text else None
            outputs = decode_response(response.body, header_length)
            header = json.loads(response.body[:header_length] if header_length
                                else response.body)
            version = int(header["model_version"])
        except (ValueError, KeyError, TypeError):
            return None, ERROR_DECODE
        finite = all(np.isfinite(value).all() for value in outputs.values()
                     if value.dtype.kind == "f")
        return version, OK if finite else NON_FINITE


__all__ = ["NON_FINITE", "OK", "PacedLoad", "Record", "frames"]
