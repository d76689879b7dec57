"""A first canary in a fresh interpreter, for tests/test_update_daemon.py: run as
``python -m tests.canary_first_use STATE_DIR PUBLIC_KEY`` (the store holding the tests' tiny
model), it prints one JSON line: the canary's verdict and the modules imported while it ran.

A process of its own because what it looks for is first-time work: in the tests' process every
lazily imported module is long loaded. A daemon serves the current version, one request is
answered first (the HTTP path's own first use is not the canary's), then a canary shadows that
version's batches on its own instances through the batcher's tap while requests come, as the
update's canary step does. Its verdict runs on the event loop, where a first-time import holds
every request in flight.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import load_config
from agent.daemon import Daemon
from agent.run import run_foreground
from agent.update.canary import CanaryPolicy, ShadowCanary
from agent.update.priority import LowPriority

REQUESTS = 40


def _infer(port: int, count: int) -> None:
    images = np.ones((1, 3, 16, 16), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "input", "shape": list(images.shape),
                                   "datatype": "FP32", "data": images.ravel().tolist()}]}).encode()
    for _ in range(count):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/tiny/infer",
                                         data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def main(state_dir: Path, public_key: Path) -> dict[str, Any]:
    config = load_config(None, env={}, overrides={
        "state_dir": state_dir, "http.host": "127.0.0.1", "http.port": 0,
        "serving.backend": "onnxruntime", "trust.public_keys": [public_key]})
    daemon = Daemon(config)

    async def session(port: int) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _infer, port, 1)
        service = daemon.services["tiny"]
        worker = LowPriority("first-canary")
        before = set(sys.modules)
        canary = ShadowCanary(service.backends, worker,
                              CanaryPolicy(duration_s=20.0, min_samples=24),
                              old_version=service.version, old_threads=service.version_threads)
        unsubscribe = service.observers.subscribe(canary.old_latency)
        service.batcher.set_tap(canary.tap)
        try:
            requests = loop.run_in_executor(None, _infer, port, REQUESTS)
            verdict = await canary.run()
            await requests
        finally:
            service.batcher.set_tap(None)
            unsubscribe()
            worker.close()
        return {"verdict": verdict.to_json(), "imported": sorted(set(sys.modules) - before)}

    return run_foreground(daemon, session=session)  # type: ignore[no-any-return]


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
