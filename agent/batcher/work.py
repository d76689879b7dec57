"""A batch's work: the queued requests it is made of, the instance that runs it, and the two
steps each instance's worker threads do (stage the inputs into the instance's buffers, then run
and split the outputs), timed where they happen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.backends.base import Backend, batch_rows
from agent.batcher.policy import InferenceResult
from agent.errors import InputError
from agent.scattered import DeferredArray, copy_rows


@dataclass(eq=False)
class Request:
    """One queued request, until it is answered."""

    inputs: Mapping[str, np.ndarray | DeferredArray]
    batch_size: int
    shape_key: tuple[tuple[str, tuple[int, ...]], ...]
    priority: int
    arrival: float
    deadline: float | None
    future: asyncio.Future[InferenceResult]
    sequence: int = 0
    started: bool = False  # its batch began to run (set by the run thread)
    timer: asyncio.TimerHandle | None = None  # answers a deadline passed while it is staged
    version: int | None = None  # of the instance its batch went to
    after_wake: bool = False  # it waited for a wake or restore (RequestDone.after_wake)
    resumed: float = 0.0  # when dispatch resumed after the wake or restore it waited for


@dataclass(eq=False)
class Instance:
    """One backend instance and its two worker threads (staging, running)."""

    backend: Backend
    index: int
    version: int  # the model version it serves
    stage_pool: ThreadPoolExecutor
    run_pool: ThreadPoolExecutor
    outstanding: int = 0  # batches staged or running
    running: int = 0  # batches past staging: running, or next to run
    retired: bool = False
    thread_ids: set[int] = field(default_factory=set)  # of its two worker threads, once started
    # CPU seconds its run thread spent releasing and restoring the engine (sleep), and running
    # the first batch of a restored engine (a session's first run allocates): not serving
    engine_cpu_s: float = 0.0
    restored: bool = False  # its engine was restored and has run no batch since


def stage(backend: Backend, batch: list[Request]
           ) -> tuple[Any, dict[int, InputError], float]:
    """Copy a batch's requests into the instance's buffers (worker thread). A request whose
    input cannot be read (a shared memory region its client shrank) gets zeros in its rows and
    its error in the returned ``{position in batch: error}``; the others run. Also returns how
    long the copy took."""
    started = time.monotonic()
    total = sum(request.batch_size for request in batch)
    shapes = dict(batch[0].shape_key)
    staged = backend.stage(total, shapes)
    failed: dict[int, InputError] = {}
    try:
        for name, target in staged.inputs.items():
            row = 0
            for index, request in enumerate(batch):
                rows = request.batch_size
                if index not in failed:
                    try:
                        copy_rows(target[row:row + rows], request.inputs[name])
                    except InputError as exc:
                        failed[index] = exc
                if index in failed:
                    target[row:row + rows] = 0
                row += rows
    except BaseException:
        staged.release()
        raise
    return staged, failed, time.monotonic() - started


@dataclass(frozen=True)
class Ran:
    """A batch's run, measured in its worker thread."""

    outputs: list[dict[str, np.ndarray]]  # per request, owned arrays
    started: float  # monotonic time the run began
    compute_s: float  # the backend's run
    split_s: float  # cutting the outputs into per-request arrays


def run_and_split(backend: Backend, staged: Any, batch: list[Request]) -> Ran:
    """Run a staged batch and cut the outputs into owned per-request arrays (worker thread).
    The times are measured here, so that a staged batch's wait for the running one counts as
    queue time, not compute."""
    for request in batch:
        request.started = True  # from now on its deadline waits for the result
    started = time.monotonic()
    outputs = backend.run(staged)
    ran = time.monotonic()
    results: list[dict[str, np.ndarray]] = []
    axes = backend.output_batch_axes  # where an output carries the batch on another axis than 0
    row = 0
    for request in batch:
        rows = request.batch_size
        results.append({name: np.array(batch_rows(value, row, row + rows, axes.get(name, 0)),
                                       copy=True)
                        for name, value in outputs.items()})
        row += rows
    return Ran(results, started, ran - started, time.monotonic() - ran)
