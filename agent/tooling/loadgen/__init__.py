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

Modules: ``loops`` (the target, closed and open loop, the sweep), ``messages`` (request and
response bodies, answer checks), ``measures`` (results, the server's breakdown, percentiles, CPU).
"""

from agent.tooling.loadgen.loops import Target, run_closed_loop, run_open_loop, sweep_closed_loop
from agent.tooling.loadgen.measures import (
    ERROR_CONNECTION,
    ERROR_DECODE,
    ERROR_DROPPED,
    ERROR_MISMATCH,
    ERROR_TIMEOUT,
    LoadResult,
    ServerBreakdown,
    cpu_seconds,
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
    expect_argmax,
)

__all__ = [
    "DATATYPES",
    "ERROR_CONNECTION",
    "ERROR_DECODE",
    "ERROR_DROPPED",
    "ERROR_MISMATCH",
    "ERROR_TIMEOUT",
    "HEADER_LENGTH",
    "LoadResult",
    "ServerBreakdown",
    "Target",
    "Verifier",
    "cpu_seconds",
    "decode_response",
    "encode_request",
    "expect_argmax",
    "percentiles",
    "run_closed_loop",
    "run_open_loop",
    "server_breakdown",
    "stats_totals",
    "sweep_closed_loop",
]
