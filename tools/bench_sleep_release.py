"""The first request after a sleep, with ``[power] release_engine_in_sleep`` on and off, measured.

A real daemon (``agent.daemon.Daemon``, in this process) serves the tests' tiny ONNX model on ONNX
Runtime's CPU provider, with ``[power]`` on over a fake Orin Nano board tree
(``power/sim/tree.py``: the real board layer and controller writing plain files, so a board's
clock-change delays are not in the figures). For each setting it lets the board go to sleep
``--sleeps`` times; after each sleep it sends one request through a kept-alive HTTP connection and
times it (the wake, and with the setting on the engine's re-creation, are in it), then a few more
(the awake figure). It reads this process's resident memory (``VmRSS``) while asleep and right
after the wake, and counts requests that failed. ``--weights-mib N`` adds a detour of N MiB of
zero weights to the model (same logits, more memory to release) to show what the release frees
beyond the tiny model's few kilobytes.

Run from the repository root (it builds the model with ``tests/tiny_models.py``):

    .venv/bin/python tools/bench_sleep_release.py --sleeps 8 --out sleep.json
    .venv/bin/python tools/bench_sleep_release.py --sleeps 8 --weights-mib 64

These are this machine's CPU figures, not a board's.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def heavy_model(path: Path, weights_mib: int) -> Path:
    """The tiny classifier with a detour through a square zero matrix of ``weights_mib`` MiB:
    logits + (logits @ widen) @ big @ narrow, all zeros, so the answers do not change."""
    import onnx
    from onnx import numpy_helper

    from tests.tiny_models import CLASSES, tiny_classifier

    tiny_classifier(path)
    model = onnx.load(str(path))
    size = int((weights_mib * 2**20 / 4) ** 0.5)
    graph = model.graph
    graph.node[-1].output[0] = "clean"
    for name, shape in (("widen", (CLASSES, size)), ("big", (size, size)),
                        ("narrow", (size, CLASSES))):
        graph.initializer.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
    graph.node.extend([
        onnx.helper.make_node("MatMul", ["clean", "widen"], ["wide"]),
        onnx.helper.make_node("MatMul", ["wide", "big"], ["wider"]),
        onnx.helper.make_node("MatMul", ["wider", "narrow"], ["detour"]),
        onnx.helper.make_node("Add", ["clean", "detour"], ["logits"]),
    ])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def install(work: Path, weights_mib: int, release: bool) -> Any:
    from agent.config import load_config
    from agent.daemon import Daemon
    from models.bundle import pack_bundle
    from models.signing import load_private_key, write_keypair
    from power.profiles import profile
    from power.sim.tree import write_tree
    from tests.tiny_models import make_bundle, tiny_manifest

    key_path = work / "keys" / "fleet.key"
    key_path.parent.mkdir(parents=True)
    write_keypair(key_path)
    key = load_private_key(key_path)
    if weights_mib > 0:
        onnx_path = heavy_model(work / "src" / "model.onnx", weights_mib)
        bundle = work / "heavy.bundle"
        pack_bundle(bundle, tiny_manifest(), {"model.onnx": onnx_path}, key)
    else:
        bundle, _ = make_bundle(work, key=key)
    tree = write_tree(work / "board", profile("orin-nano"), 6)
    config = load_config(None, env={}, overrides={
        "state_dir": work / "state", "http.port": 0, "serving.backend": "onnxruntime",
        "serving.instances": 1,
        "trust.public_keys": [Path(str(key_path) + ".pub")],
        "power.enabled": True, "power.root": tree.root,
        "power.idle_after_s": 0.05, "power.sleep_after_s": 0.1,
        "power.control_period_s": 0.01, "power.telemetry_period_s": 0.05,
        "power.release_engine_in_sleep": release})
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    return config


class Client:
    """One kept-alive HTTP connection to the daemon's infer endpoint."""

    def __init__(self, port: int) -> None:
        from agent.tooling.loadgen import encode_request

        image = np.random.default_rng(0).normal(size=(1, 3, 16, 16)).astype(np.float32)
        self.body, length = encode_request("input", image, datatype="FP32")
        self.headers = {"Inference-Header-Content-Length": str(length),
                        "Content-Type": "application/octet-stream"}
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def infer(self) -> tuple[float, int]:
        """(seconds, HTTP status) of one request."""
        started = time.perf_counter()
        self.connection.request("POST", "/v2/models/tiny/infer", body=self.body,
                                headers=self.headers)
        response = self.connection.getresponse()
        response.read()
        return time.perf_counter() - started, response.status


async def until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the board did not go to sleep in time")
        await asyncio.sleep(0.01)


def measure(release: bool, sleeps: int, weights_mib: int, settle_s: float) -> dict[str, Any]:
    from agent.batcher.batcher import EngineState
    from agent.daemon import Daemon
    from agent.run import run_foreground

    with tempfile.TemporaryDirectory(prefix="sleep-release-") as scratch:
        config = install(Path(scratch), weights_mib, release)
        daemon = Daemon(config)
        result: dict[str, Any] = {"release_engine_in_sleep": release, "first_ms": [],
                                  "awake_ms": [], "rss_asleep_mib": [], "rss_awake_mib": [],
                                  "wake_ms": [], "restore_ms": [], "failed": 0,
                                  "released_when_asleep": []}

        async def session(port: int) -> None:
            loop = asyncio.get_running_loop()
            power = daemon.power
            assert power is not None
            await until(lambda: power.status()["running"], 30)
            batcher = daemon.services["tiny"].batcher
            client = Client(port)

            def run(count: int, into: str) -> None:
                for _ in range(count):
                    seconds, status = client.infer()
                    if status != 200:
                        result["failed"] += 1
                    result[into].append(seconds * 1000.0)

            await loop.run_in_executor(None, run, 20, "awake_ms")  # warm the connection
            for _ in range(sleeps):
                await until(lambda: power.status()["state"] == "sleeping" and (
                    not release or batcher.engine_state is EngineState.RELEASED), 120)
                await asyncio.sleep(settle_s)  # asleep for a while, as a board would be
                result["released_when_asleep"].append(
                    not any(backend.active for backend in batcher.backends))
                result["rss_asleep_mib"].append(rss_mib())
                await loop.run_in_executor(None, run, 1, "first_ms")
                result["rss_awake_mib"].append(rss_mib())
                status = power.status()
                result["wake_ms"].append((status["last_wake_s"] or 0.0) * 1000.0)
                if release and batcher.last_restore_s is not None:
                    result["restore_ms"].append(batcher.last_restore_s * 1000.0)
                await loop.run_in_executor(None, run, 5, "awake_ms")
            result["engine_releases"] = batcher.engine_releases
            result["engine_restores"] = batcher.engine_restores

        run_foreground(daemon, session=session)
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        ordered = sorted(values)
        return {"median": round(statistics.median(ordered), 3), "max": round(ordered[-1], 3),
                "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}

    drops = [awake - asleep for asleep, awake in zip(result["rss_asleep_mib"],
                                                     result["rss_awake_mib"])]
    return {key: result[key] for key in ("release_engine_in_sleep", "failed",
                                         "released_when_asleep", "engine_releases",
                                         "engine_restores")} | {
        "first_request_ms": stats(result["first_ms"]),
        "awake_request_ms": stats(result["awake_ms"]),
        "wake_ms": stats(result["wake_ms"]),
        "restore_ms": stats(result["restore_ms"]),
        "rss_asleep_mib": stats(result["rss_asleep_mib"]),
        "rss_awake_mib": stats(result["rss_awake_mib"]),
        "rss_back_on_wake_mib": stats(drops),
        "raw": {key: [round(value, 3) for value in result[key]] for key in (
            "first_ms", "rss_asleep_mib", "rss_awake_mib", "restore_ms", "wake_ms")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sleeps", type=int, default=8, help="sleeps per setting (default 8)")
    parser.add_argument("--weights-mib", type=int, default=0,
                        help="extra zero weights in the model, MiB (default 0: the tiny model)")
    parser.add_argument("--settle-s", type=float, default=0.3,
                        help="how long the board stays asleep before the request (default 0.3)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    if args.sleeps < 1 or args.weights_mib < 0 or args.settle_s < 0:
        parser.error("--sleeps must be at least 1, --weights-mib and --settle-s at least 0")
    import logging

    logging.basicConfig(level=logging.WARNING)
    results = {"machine": "this VM's CPU (ONNX Runtime CPU provider), not a board",
               "model": "tests' tiny classifier" + (
                   f" + {args.weights_mib} MiB of zero weights" if args.weights_mib else ""),
               "sleeps": args.sleeps,
               "runs": [summary(measure(release, args.sleeps, args.weights_mib, args.settle_s))
                        for release in (False, True)]}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
