"""Tiny real ONNX models, built with the ``onnx`` helper API (no torch), for the engine builder tests.

The main one is what the quantizer emits for a small CNN: QuantizeLinear/DequantizeLinear on the
activation and a per-channel DequantizeLinear on the weight of ``conv0`` (symmetric INT8, zero
points 0), then ``relu0`` and a float ``conv1`` that the precision plan keeps in FP16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13  # per-channel DequantizeLinear (axis) needs opset 13
IR_VERSION = 8
CHANNELS_IN = 3
CHANNELS_MID = 8
CHANNELS_OUT = 4


def qdq_conv_model(
    path: Path,
    *,
    batch: int | str = "batch",
    height: int | str = "height",
    width: int | str = "width",
    conv1_in_fp16: bool = False,
    extra_op: str | None = None,
) -> Path:
    """Write the QDQ model to ``path`` and return it.

    Args:
        batch, height, width: A number for a static axis, a name for a dynamic one.
        conv1_in_fp16: Wrap ``conv1`` in Casts so that it computes in FP16 in the graph itself
            (what ModelOpt AutoCast produces; strongly typed TensorRT needs this).
        extra_op: Append a node named ``mystery0`` of this op type (domain ``com.example``), e.g.
            one TensorRT has no importer for.
    """
    rng = np.random.default_rng(0)
    weight = rng.normal(0.0, 0.2, size=(CHANNELS_MID, CHANNELS_IN, 3, 3)).astype(np.float32)
    weight_scale = (np.abs(weight).reshape(CHANNELS_MID, -1).max(axis=1) / 127.0).astype(np.float32)
    weight_q = np.clip(np.round(weight / weight_scale[:, None, None, None]), -127, 127).astype(np.int8)
    float_type = np.float16 if conv1_in_fp16 else np.float32
    initializers = [
        numpy_helper.from_array(np.array(0.02, dtype=np.float32), "images_scale"),
        numpy_helper.from_array(np.array(0, dtype=np.int8), "images_zero_point"),
        numpy_helper.from_array(weight_q, "conv0_weight_q"),
        numpy_helper.from_array(weight_scale, "conv0_weight_scale"),
        numpy_helper.from_array(np.zeros(CHANNELS_MID, dtype=np.int8), "conv0_weight_zero_point"),
        numpy_helper.from_array(rng.normal(0, 0.1, CHANNELS_MID).astype(np.float32), "conv0_bias"),
        numpy_helper.from_array(
            rng.normal(0, 0.2, (CHANNELS_OUT, CHANNELS_MID, 1, 1)).astype(float_type), "conv1_weight"
        ),
        numpy_helper.from_array(rng.normal(0, 0.1, CHANNELS_OUT).astype(float_type), "conv1_bias"),
    ]
    nodes = [
        helper.make_node(
            "QuantizeLinear",
            ["images", "images_scale", "images_zero_point"],
            ["images_q"],
            name="quant_input",
        ),
        helper.make_node(
            "DequantizeLinear",
            ["images_q", "images_scale", "images_zero_point"],
            ["images_dq"],
            name="dequant_input",
        ),
        helper.make_node(
            "DequantizeLinear",
            ["conv0_weight_q", "conv0_weight_scale", "conv0_weight_zero_point"],
            ["conv0_weight"],
            name="dequant_weight",
            axis=0,
        ),
        helper.make_node(
            "Conv",
            ["images_dq", "conv0_weight", "conv0_bias"],
            ["conv0_out"],
            name="conv0",
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["conv0_out"], ["relu0_out"], name="relu0"),
    ]
    last = "features" if extra_op is None else "conv1_out"
    if conv1_in_fp16:
        nodes += [
            helper.make_node("Cast", ["relu0_out"], ["relu0_half"], name="to_half", to=TensorProto.FLOAT16),
            helper.make_node(
                "Conv", ["relu0_half", "conv1_weight", "conv1_bias"], ["conv1_half"], name="conv1"
            ),
            helper.make_node("Cast", ["conv1_half"], [last], name="to_float", to=TensorProto.FLOAT),
        ]
    else:
        nodes.append(
            helper.make_node("Conv", ["relu0_out", "conv1_weight", "conv1_bias"], [last], name="conv1")
        )
    opsets = [helper.make_opsetid("", OPSET)]
    if extra_op is not None:
        nodes.append(
            helper.make_node(extra_op, [last], ["features"], name="mystery0", domain="com.example")
        )
        opsets.append(helper.make_opsetid("com.example", 1))
    graph = helper.make_graph(
        nodes,
        "qdq_conv",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, CHANNELS_IN, height, width])],
        [
            helper.make_tensor_value_info(
                "features", TensorProto.FLOAT, [batch, CHANNELS_OUT, height, width]
            )
        ],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=opsets, producer_name="jetson-edge-agent-tests")
    model.ir_version = IR_VERSION
    path = Path(path)
    onnx.save(model, str(path))
    return path
