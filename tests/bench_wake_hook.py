"""What the batcher's wake hook costs when the board is awake: requests/s through one batcher on
ONNX Runtime (the tests' tiny classifier) with no hook set, and with the power service's hook set
but not armed (the board awake: the common case once power is on). Run as
``python -m tests.bench_wake_hook [--requests N] [--clients C] [--rounds R]``; it prints a table
and the ratio, and writes JSON with ``--json FILE``.

Rounds alternate the two settings so drift on a shared machine hits both alike; the figure is
the median over rounds. A third row arms the hook every ``--arm-every`` requests with a hook
that returns at once: the cost of a wake's own round trip, not of a board's clock change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.backends.base import BackendOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import Batcher, BatchPolicy
from tests.tiny_models import artifacts_for, tiny_classifier


async def _one_round(batcher: Batcher, requests: int, clients: int, mode: str,
                     arm_every: int) -> float:
    sample = {"input": np.zeros((1, 3, 16, 16), np.float32)}

    async def hook() -> None:
        return None

    batcher.set_wake_hook(None if mode == "unset" else hook)
    remaining = [requests]
    sent = [0]

    async def client() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            sent[0] += 1
            if mode == "armed" and sent[0] % arm_every == 0:
                batcher.arm_wake()
            await batcher.submit(sample)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return requests / (time.perf_counter() - started)


async def _measure(requests: int, clients: int, rounds: int, arm_every: int
                   ) -> dict[str, list[float]]:
    directory = Path(tempfile.mkdtemp(prefix="wakebench-"))
    backend = OnnxRuntimeBackend(artifacts_for(tiny_classifier(directory / "model.onnx")),
                                 BackendOptions(max_batch_size=8, threads=1))
    backend.activate()
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    batcher.start()
    results: dict[str, list[float]] = {"unset": [], "set_awake": [], "armed": []}
    try:
        await _one_round(batcher, requests // 4, clients, "unset", arm_every)  # warm-up
        for _ in range(rounds):
            for mode in ("unset", "set_awake", "armed"):
                results[mode].append(await _one_round(batcher, requests, clients, mode,
                                                      arm_every))
    finally:
        await batcher.stop()
        backend.deactivate()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--arm-every", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = asyncio.run(_measure(args.requests, args.clients, args.rounds, args.arm_every))
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    print(f"{'hook':<12} {'requests/s (median)':>20} {'min':>10} {'max':>10}")
    for mode, values in results.items():
        print(f"{mode:<12} {medians[mode]:>20.0f} {min(values):>10.0f} {max(values):>10.0f}")
    ratio = medians["set_awake"] / medians["unset"]
    print(f"set-but-awake / unset: {ratio:.3f}; armed every {args.arm_every}: "
          f"{medians['armed'] / medians['unset']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)},
                                         "requests_per_s": results, "medians": medians,
                                         "ratio_set_awake_over_unset": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
