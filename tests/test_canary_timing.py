"""The canary's latency gate on a real ONNX Runtime backend: the new version's first run of each
batch size (where ONNX Runtime plans its memory) must not count as the version being slow, and a
version slow on every run still must."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.backends.base import BackendOptions, StagedBatch
from agent.batcher.batcher import Tapped
from agent.update.canary import CanaryPolicy, ShadowCanary
from agent.update.priority import LowPriority

pytest.importorskip("onnxruntime")

from agent.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from tests.tiny_models import artifacts_for, tiny_classifier  # noqa: E402

DETOUR_S = 0.02


class Detour(OnnxRuntimeBackend):
    """The real backend, plus a delay on the first run of each batch size (``first_only``) or
    on every run."""

    def __init__(self, *args: Any, first_only: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_only = first_only
        self.seen: set[int] = set()

    def run(self, batch: StagedBatch) -> dict[str, np.ndarray]:
        size = int(batch.inputs["input"].shape[0])
        if not self.first_only or size not in self.seen:
            time.sleep(DETOUR_S)
        self.seen.add(size)
        return super().run(batch)


def _verdict(tmp_path: Path, *, first_only: bool) -> Any:
    artifacts = artifacts_for(tiny_classifier(tmp_path / "model.onnx"))
    options = BackendOptions(max_batch_size=8, threads=1)
    old = OnnxRuntimeBackend(artifacts, options)
    new = Detour(artifacts, options, first_only=first_only)
    old.activate()
    new.activate()
    worker = LowPriority("canary-test")
    rng = np.random.default_rng(0)
    # Four batch sizes once each, then one again: 11 samples, five batches.
    taps = []
    for size in (1, 2, 3, 4, 1):
        images = np.abs(rng.normal(size=(size, 3, 16, 16))).astype(np.float32)
        logits = old.infer({"input": images})["logits"]
        taps.append(Tapped(version=1, requests=[({"input": images[i:i + 1]},
                                                 {"logits": logits[i:i + 1]})
                                                for i in range(size)],
                           compute_s=DETOUR_S / 4, samples=size))
    policy = CanaryPolicy(duration_s=10.0, min_samples=11, queue_batches=8)
    canary = ShadowCanary([new], worker, policy, old_version=1)

    async def judge() -> Any:
        for tapped in taps:
            canary.tap(tapped)
        return await canary.run()

    try:
        return asyncio.run(judge())
    finally:
        worker.close()
        old.deactivate()
        new.deactivate()


def test_a_first_run_of_each_batch_size_does_not_make_a_healthy_version_slow(
        tmp_path: Path) -> None:
    verdict = _verdict(tmp_path, first_only=True)
    assert verdict.passed and verdict.reason == "ok", verdict.describe()
    assert verdict.figures["batches"] == 5


def test_a_version_slow_on_every_run_is_still_refused(tmp_path: Path) -> None:
    verdict = _verdict(tmp_path, first_only=False)
    assert (verdict.passed, verdict.reason) == (False, "slow"), verdict.describe()
