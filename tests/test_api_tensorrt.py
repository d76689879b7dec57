"""The TensorRT backend behind the batcher and the HTTP API, on the strict fake TensorRT and fake
CUDA device (no GPU here): staged batches from the staging thread, runs on the run thread, mapped
(Jetson) and pinned (discrete GPU) buffers; results equal to ONNX Runtime on the same model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
http = pytest.importorskip("tritonclient.http")

from agent.batcher import BatchPolicy
from tests.serving_fixtures import ServerThread
from tests.fakes.trt_board import make_artifacts, make_board, reference


@pytest.mark.parametrize("integrated", [True, False], ids=["jetson-mapped", "discrete-pinned"])
def test_tensorrt_backend_serves_batched_requests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  integrated: bool) -> None:
    board = make_board(monkeypatch, tmp_path, integrated=integrated)
    artifacts = make_artifacts(tmp_path)
    backend = board.backend(artifacts, max_batch_size=4)
    backend.activate()
    running = ServerThread([backend], BatchPolicy(max_batch_size=4, max_queue_delay_us=20_000),
                           name="tiny", version=3)
    try:
        images = np.random.default_rng(4).normal(size=(8, 3, 16, 16)).astype(np.float32)

        def one(index: int) -> np.ndarray:
            client = http.InferenceServerClient(running.url)
            tensor = http.InferInput("images", [1, 3, 16, 16], "FP32")
            tensor.set_data_from_numpy(images[index:index + 1])
            return client.infer("tiny", [tensor]).as_numpy("features")[0]

        with ThreadPoolExecutor(8) as pool:
            results = np.stack(list(pool.map(one, range(8))))
        np.testing.assert_allclose(results, reference(artifacts, images), rtol=1e-4, atol=1e-4)
        stats = running.service.stats()
        assert stats["execution_count"] < stats["inference_count"] == 8
        config = http.InferenceServerClient(running.url).get_model_config("tiny")
        assert config["platform"] == "tensorrt_plan"
        assert config["instance_group"][0]["kind"] == "KIND_GPU"
    finally:
        running.stop()
