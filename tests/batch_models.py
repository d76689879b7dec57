"""Tiny float ONNX models (onnx.helper, no torch) with the batch and opset habits of published
models: an old opset, a constant batch written into the inputs, a Reshape that bakes the batch
in, a ``[T, B, C]`` sequence output, and an operator the version converter cannot convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CHANNELS, MID, CLASSES, SIDE = 3, 4, 3, 8


def _conv(rng: np.random.Generator) -> tuple[list[Any], list[Any]]:
    """``images`` -> Conv ``conv`` -> Relu ``relu``: [B, MID, SIDE, SIDE] as ``relu_out``."""
    initializers = [
        numpy_helper.from_array(rng.normal(0, 0.5, (MID, CHANNELS, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, MID).astype(np.float32), "conv_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["images", "conv_w", "conv_b"], ["conv_out"], name="conv",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu_out"], name="relu"),
    ]
    return nodes, initializers


def _model(nodes: list[Any], initializers: list[Any], batch: int | str, output: Any,
           opset: int) -> Any:
    graph = helper.make_graph(
        nodes, "batch_test",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, CHANNELS, SIDE, SIDE])],
        [output], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def classifier(*, opset: int = 17, batch: int | str = "N", flatten_to: int | None = None,
               seed: int = 0) -> Any:
    """Conv -> ReLU -> global average pool -> Squeeze (axes an attribute below opset 13, an
    input from 13) -> Gemm: ``logits`` [batch, CLASSES]. ``flatten_to``: a Reshape to the
    constant ``[flatten_to, -1]`` instead of the Squeeze, which bakes that batch in (at another
    batch the Gemm gets the wrong width and fails)."""
    rng = np.random.default_rng(seed)
    nodes, initializers = _conv(rng)
    initializers += [
        numpy_helper.from_array(rng.normal(0, 0.5, (CLASSES, MID)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, CLASSES).astype(np.float32), "fc_b"),
    ]
    nodes.append(helper.make_node("GlobalAveragePool", ["relu_out"], ["pool"], name="pool"))
    if flatten_to is not None:
        initializers.append(numpy_helper.from_array(np.array([flatten_to, -1], np.int64), "flat_shape"))
        nodes.append(helper.make_node("Reshape", ["pool", "flat_shape"], ["flat"], name="flatten"))
    elif opset < 13:
        nodes.append(helper.make_node("Squeeze", ["pool"], ["flat"], name="squeeze", axes=[2, 3]))
    else:
        initializers.append(numpy_helper.from_array(np.array([2, 3], np.int64), "squeeze_axes"))
        nodes.append(helper.make_node("Squeeze", ["pool", "squeeze_axes"], ["flat"], name="squeeze"))
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1))
    output = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, CLASSES])
    return _model(nodes, initializers, batch, output, opset)


def glued_map(batch: int, *, opset: int = 17, seed: int = 0) -> Any:
    """Conv -> ReLU -> Reshape to the constant ``[batch, MID, -1]``: ``map`` [batch, MID, 64],
    as a YOLOX head flattens its grid. At another batch the Reshape still runs, and glues the
    rows of the batch into ``batch`` rows."""
    rng = np.random.default_rng(seed)
    nodes, initializers = _conv(rng)
    initializers.append(numpy_helper.from_array(np.array([batch, MID, -1], np.int64), "grid_shape"))
    nodes.append(helper.make_node("Reshape", ["relu_out", "grid_shape"], ["map"], name="grid"))
    output = helper.make_tensor_value_info("map", TensorProto.FLOAT, [batch, MID, SIDE * SIDE])
    return _model(nodes, initializers, batch, output, opset)


def sequence_scores(*, batch: int | str = "N", seed: int = 0) -> Any:
    """A recognizer's output layout: Conv -> Transpose to [W, B, C, H] -> mean over H ->
    Softmax: ``scores`` [T, batch, MID] with T = SIDE time steps, the batch on axis 1."""
    rng = np.random.default_rng(seed)
    nodes, initializers = _conv(rng)
    nodes += [
        helper.make_node("Transpose", ["relu_out"], ["steps"], name="to_steps", perm=[3, 0, 1, 2]),
        helper.make_node("ReduceMean", ["steps"], ["pooled"], name="pool_height", axes=[3],
                         keepdims=0),
        helper.make_node("Softmax", ["pooled"], ["scores"], name="softmax", axis=2),
    ]
    output = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [SIDE, batch, MID])
    return _model(nodes, initializers, batch, output, 17)


def per_activation_batchnorm(*, seed: int = 0) -> Any:
    """Opset 8: a BatchNormalization ``bn`` with ``spatial=0`` (statistics per activation),
    which ONNX's version converter cannot take past opset 8."""
    rng = np.random.default_rng(seed)
    nodes, initializers = _conv(rng)
    for name in ("bn_scale", "bn_bias", "bn_mean"):
        initializers.append(numpy_helper.from_array(
            rng.normal(0, 0.1, (MID, SIDE, SIDE)).astype(np.float32), name))
    initializers.append(numpy_helper.from_array(np.ones((MID, SIDE, SIDE), np.float32), "bn_var"))
    nodes.append(helper.make_node("BatchNormalization",
                                  ["relu_out", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                                  ["normed"], name="bn", spatial=0))
    output = helper.make_tensor_value_info("normed", TensorProto.FLOAT, ["N", MID, SIDE, SIDE])
    return _model(nodes, initializers, "N", output, 8)


def save(model: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def samples(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` samples for ``images``: real-looking values are not needed, distinct ones are."""
    rng = np.random.default_rng(seed)
    return {"images": rng.standard_normal((count, CHANNELS, SIDE, SIDE)).astype(np.float32)}
