"""A real inference server on a free loopback port, run on its own event loop thread, for tests
that talk to it with stock clients (tritonclient, plain HTTP); and the tests' tiny classifier
on a real ONNX Runtime backend (the ``backend`` fixture: import it into the test module)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.api.server import InferenceServer
from agent.backends.base import Backend, BackendOptions
from agent.batcher import BatchPolicy
from agent.serving import ModelService

T = TypeVar("T")


class ServerThread:
    """Runs an InferenceServer for one model; ``call`` runs a coroutine on its loop."""

    def __init__(self, backends: Sequence[Backend], policy: BatchPolicy, *, name: str = "tiny",
                 version: int = 1, token: str | None = None, max_body_bytes: int = 64 << 20,
                 shm_root: Path = Path("/dev/shm")) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service = ModelService(name, version, backends, policy)
        self.server = InferenceServer({name: self.service}, port=0, token=token,
                                      max_body_bytes=max_body_bytes, shm_root=shm_root)

        async def start() -> int:
            self.service.start()
            return await self.server.start()

        self.port = self.call(start())
        self.url = f"127.0.0.1:{self.port}"
        self.stopped = False

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def call_soon(self, function: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(function)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.call(self.server.stop(drain=True))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        for backend in self.service.backends:
            backend.deactivate()


@pytest.fixture()
def backend(tmp_path: Path) -> Iterator[Backend]:
    """The tiny classifier on an active ONNX Runtime backend (batches of 8 at most, one thread),
    deactivated after the test. The module using it skips without onnxruntime."""
    from agent.backends.onnxruntime import OnnxRuntimeBackend
    from tests.tiny_models import artifacts_for, tiny_classifier

    made = OnnxRuntimeBackend(artifacts_for(tiny_classifier(tmp_path / "m" / "model.onnx")),
                              BackendOptions(max_batch_size=8, threads=1))
    made.activate()
    yield made
    made.deactivate()
