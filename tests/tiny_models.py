"""A tiny real image classifier as ONNX (built without torch) and signed bundles of it, for the
serving tests: input ``input`` FP32 [batch, 3, H, W] (any H, W), output ``logits`` FP32 [batch, 10].
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from agent.backends.base import ModelArtifacts, StagedBatch
from agent.backends.onnxruntime import OnnxRuntimeBackend
from models.bundle import pack_bundle
from models.signing import generate_private_key

CLASSES = 10


# How a tiny classifier can misbehave, for the updater's tests: ``nan`` answers NaN always;
# ``nan_on_negative`` answers NaN for inputs of negative mean (a model that passes a canary fed
# positive images and breaks later); ``slow`` computes the same logits after a detour of about
# 10 ms of CPU a sample, ``very_slow`` after one of about 50 ms.
FAULTS = ("nan", "nan_on_negative", "slow", "very_slow")


def tiny_classifier(path: Path, *, seed: int = 0, static_hw: int | None = None,
                    fault: str | None = None) -> Path:
    """Conv 3x3 -> ReLU -> global average pool -> fully connected, with fixed random weights
    (and the ``fault`` of :data:`FAULTS` asked for)."""
    rng = np.random.default_rng(seed)
    hw: list[int | str] = [static_hw, static_hw] if static_hw else ["height", "width"]
    initializers = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "conv_b"),
        numpy_helper.from_array(rng.normal(0, 0.5, (CLASSES, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, CLASSES).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    if fault is not None:
        nodes[-1].output[0] = "clean"
        nodes.extend(_fault_nodes(fault, initializers))
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, *hw])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _fault_nodes(fault: str, initializers: list[Any]) -> list[Any]:
    """Nodes from ``clean`` (the logits) to ``logits`` that add the fault."""
    if fault == "nan":
        initializers.append(numpy_helper.from_array(np.array(np.nan, np.float32), "nan"))
        return [helper.make_node("Add", ["clean", "nan"], ["logits"])]
    if fault == "nan_on_negative":
        # 0 * sqrt(mean(input)): 0 for a positive mean, NaN for a negative one.
        initializers.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
        return [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1, 2, 3], keepdims=0),
                helper.make_node("Sqrt", ["mean"], ["root"]),
                helper.make_node("Mul", ["root", "zero"], ["nothing"]),
                helper.make_node("Unsqueeze", ["nothing", "axis"], ["column"]),
                helper.make_node("Add", ["clean", "column"], ["logits"])] + [
            _constant(initializers, "axis", np.array([1], np.int64))]
    if fault in ("slow", "very_slow"):
        # A chain of large matrix products that cancels out: the same logits, much later.
        size, steps = 1024, 60 if fault == "slow" else 300
        initializers.append(numpy_helper.from_array(np.eye(size, dtype=np.float32), "eye"))
        initializers.append(numpy_helper.from_array(
            np.zeros((CLASSES, size), np.float32), "widen"))
        nodes = [helper.make_node("MatMul", ["clean", "widen"], ["wide0"])]
        for step in range(steps):
            nodes.append(helper.make_node("MatMul", [f"wide{step}", "eye"], [f"wide{step + 1}"]))
        initializers.append(numpy_helper.from_array(
            np.zeros((size, CLASSES), np.float32), "narrow"))
        nodes += [helper.make_node("MatMul", [f"wide{steps}", "narrow"], ["detour"]),
                  helper.make_node("Add", ["clean", "detour"], ["logits"])]
        return nodes
    raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")


def _constant(initializers: list[Any], name: str, value: np.ndarray) -> Any:
    initializers.append(numpy_helper.from_array(value, name))
    return helper.make_node("Identity", [name], [f"{name}_copy"])


def reference_logits(path: Path, images: np.ndarray) -> np.ndarray:
    """The model run directly with ONNX Runtime, for comparison."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input": images.astype(np.float32)})[0]


def tiny_manifest(name: str = "tiny", version: int = 1, *, max_batch: int = 32,
                  opt_batch: int = 8) -> dict[str, Any]:
    return {
        "name": name,
        "version": version,
        "inputs": [{"name": "input", "dtype": "float32", "shape": [-1, 3, -1, -1], "layout": "NCHW"}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [-1, CLASSES]}],
        "preprocessing": {"resize": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3,
                          "channel_order": "RGB"},
        "precision": {"int8_layers": [], "fp16_layers": [], "fp32_layers": ["conv", "fc"]},
        "max_batch": max_batch,
        "opt_batch": opt_batch,
        "engine_profile": {"batch": [1, opt_batch, max_batch], "height": [8, 16, 64],
                           "width": [8, 16, 64]},
        "calibration": {"method": "minmax", "samples": 1, "data_sha256": "00" * 32},
        "accuracy": {},
        "engines": {},
        "min_agent_version": "0.1.0",
    }


def make_bundle(directory: Path, *, name: str = "tiny", version: int = 1, seed: int = 0,
                key: Any = None, fault: str | None = None,
                manifest_extra: Mapping[str, Any] | None = None) -> tuple[Path, Any]:
    """A signed bundle of the tiny classifier (``manifest_extra`` added to its manifest);
    returns (bundle path, private key)."""
    key = key or generate_private_key()
    label = f"{name}-{version}" + (f"-{fault}" if fault else "") + (f"-s{seed}" if seed else "")
    work = directory / f"src-{label}"
    onnx_path = tiny_classifier(work / "model.onnx", seed=seed, fault=fault)
    bundle = directory / f"{label}.bundle"
    pack_bundle(bundle, {**tiny_manifest(name, version), **(manifest_extra or {})},
                {"model.onnx": onnx_path}, key)
    return bundle, key


def artifacts_for(onnx_path: Path, *, name: str = "tiny", version: int = 1,
                  engine_cache: Path | None = None) -> ModelArtifacts:
    """ModelArtifacts for a bare model file (backend tests that need no store)."""
    directory = onnx_path.parent
    if onnx_path.name != "model.onnx":
        raise ValueError("the store names the model file model.onnx")
    manifest = tiny_manifest(name, version)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return ModelArtifacts(name, version, directory, manifest,
                          engine_cache or directory / "engines-cache")


class GatedBackend(OnnxRuntimeBackend):
    """A real ORT backend whose run waits for the test to open the gate; it can also fail batches
    that contain the marker value -999."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.events: list[str] = []
        self.running = threading.Event()

    def stage(self, batch_size: int, sample_shapes: Mapping[str, tuple[int, ...]]) -> StagedBatch:
        self.events.append(f"stage{batch_size}")
        return super().stage(batch_size, sample_shapes)

    def run(self, batch: StagedBatch) -> dict[str, np.ndarray]:
        self.events.append("run-start")
        self.running.set()
        if not self.gate.wait(10):
            raise RuntimeError("test gate never opened")
        if (batch.inputs["input"] == -999).any():
            raise RuntimeError("poisoned batch")
        result = super().run(batch)
        self.events.append("run-end")
        return result
