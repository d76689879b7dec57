"""A fake Jetson for the TensorRT backend's tests: the strict fake TensorRT in ``sys.modules``, a
board root with its L4T release, fake CUDA devices on host memory, and the tiny QDQ model's
artifacts with a reference from ONNX Runtime."""

from __future__ import annotations

import gc
import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.backends.base import BackendOptions, ModelArtifacts
from agent.backends.tensorrt import TensorRTBackend
from models.fingerprint import DeviceFingerprint, read_l4t_release
from tests.fakes.fake_tensorrt import FakeCudaDevice, make_fake_tensorrt, state_of

VERSION = "10.3.0.30"
TEGRA_RELEASE = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: x\n"
PROFILE = {"batch": [1, 2, 4], "height": [8, 16, 32], "width": [8, 16, 32]}


class Board:
    """A fake TensorRT in ``sys.modules``, a fake board root and the fake CUDA devices opened."""

    def __init__(self, trt: types.ModuleType, root: Path, *, integrated: bool) -> None:
        self.trt = trt
        self.state = state_of(trt)
        self.root = root
        self.integrated = integrated
        self.can_map_host_memory = True
        self.devices: list[FakeCudaDevice] = []

    def open_device(self, device_id: int) -> FakeCudaDevice:
        device = FakeCudaDevice(self.state.gpu, integrated=self.integrated,
                                can_map_host_memory=self.can_map_host_memory)
        self.devices.append(device)
        return device

    @property
    def key(self) -> str:
        return DeviceFingerprint(trt_version=self.trt.__version__, compute_capability="8.7",
                                 l4t_release=read_l4t_release(self.root), multiprocessors=16).key()

    def backend(self, artifacts: ModelArtifacts, **options: Any) -> TensorRTBackend:
        return TensorRTBackend(artifacts, BackendOptions(**options), open_device=self.open_device,
                               root=self.root)


def make_board(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, version: str = VERSION,
               integrated: bool = True) -> Board:
    trt = make_fake_tensorrt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "nv_tegra_release").write_text(TEGRA_RELEASE)
    return Board(trt, root, integrated=integrated)


def make_artifacts(tmp_path: Path, *, conv1_in_fp16: bool = False, engines: dict[str, str] | None = None,
                   **manifest: Any) -> ModelArtifacts:
    from tests.fakes.onnx_models import qdq_conv_model  # needs onnx: importorskip it first

    directory = tmp_path / "bundle"
    directory.mkdir(exist_ok=True)
    model = qdq_conv_model(directory / "model.onnx", conv1_in_fp16=conv1_in_fp16)
    values: dict[str, Any] = {
        "name": "tiny",
        "version": 3,
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, -1, -1], "layout": "NCHW"}],
        "outputs": [{"name": "features", "dtype": "float32", "shape": [-1, 4, -1, -1]}],
        "precision": {"int8_layers": ["conv0"], "fp16_layers": ["conv1"], "fp32_layers": []},
        "max_batch": 4,
        "opt_batch": 2,
        "engine_profile": PROFILE,
        "artifacts": {"model.onnx": {"sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                                     "size": model.stat().st_size}},
        "engines": engines or {},
    }
    values.update(manifest)
    return ModelArtifacts(name="tiny", version=3, directory=directory, manifest=values,
                          engine_cache_dir=tmp_path / "engine-cache")


def reference(artifacts: ModelArtifacts, images: np.ndarray) -> np.ndarray:
    """The model's outputs from ONNX Runtime on the model file itself."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(artifacts.onnx_path), providers=["CPUExecutionProvider"])
    result: np.ndarray = session.run(["features"], {"images": images})[0]
    return result


def live_objects(board: Board) -> dict[str, int]:
    """The fake TensorRT objects still alive, by class."""
    gc.collect()
    return {name: count for name, count in board.state.live.items() if count}
