"""Kept-out layers judged as the board runs them: in FP16.

TensorRT runs the layers the precision plan keeps out of INT8 in FP16. ONNX Runtime on this host
would run them in FP32, which judges a layer set more kindly than the board will, and makes
"every layer kept out" the FP32 model itself (no tolerance would ever be out of its reach).
:func:`emulate_fp16` rounds the kept-out layers' weights and outputs to FP16 in the model that is
judged; the bundle's model keeps its FP32 weights (TensorRT converts them itself).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import numpy as np

from agent.deps import require

log = logging.getLogger(__name__)


def float_tensors(model: Any) -> set[str]:
    """Names of the FP32 tensors of ``model`` (an ONNX ModelProto), by shape inference: the
    outputs :func:`emulate_fp16` may round (an Add on int64 shapes must be left alone)."""
    onnx = require("onnx", extra="host", purpose="FP16 emulation")
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types; fall back to what is told
        log.debug("shape inference for FP16 emulation failed: %s", exc)
        inferred = model
    graph = inferred.graph
    values = [*graph.value_info, *graph.output, *graph.input]
    return {value.name for value in values
            if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


def emulate_fp16(model_bytes: bytes, layers: Collection[str], floats: Collection[str]) -> bytes:
    """``model_bytes`` with the FP32 weights of the nodes named ``layers`` rounded to FP16, and
    each of their outputs named in ``floats`` (:func:`float_tensors`) rounded through a pair of
    Casts (ONNX Runtime keeps such a pair; tensor names stay as they were)."""
    if not layers:
        return model_bytes
    onnx = require("onnx", extra="host", purpose="FP16 emulation")
    from onnx import helper, numpy_helper

    float_type, half_type = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    model = onnx.load_from_string(model_bytes)
    initializers = {init.name: init for init in model.graph.initializer}
    kept_out, rounded = set(layers), set()
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        if node.name not in kept_out:
            continue
        for name in node.input:
            init = initializers.get(name)
            if init is None or init.data_type != float_type or name in rounded:
                continue
            half = numpy_helper.to_array(init).astype(np.float16).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(half, name))
            rounded.add(name)
        for index, name in enumerate(node.output):
            if not name or name not in floats:
                continue
            node.output[index] = f"{name}__fp32"
            nodes.append(helper.make_node("Cast", [f"{name}__fp32"], [f"{name}__fp16"],
                                          to=half_type, name=f"{node.name}__to_fp16_{index}"))
            nodes.append(helper.make_node("Cast", [f"{name}__fp16"], [name], to=float_type,
                                          name=f"{node.name}__from_fp16_{index}"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return bytes(model.SerializeToString())
