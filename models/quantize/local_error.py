"""Per-layer sensitivity in one pass, for models with too many layers to quantize one at a time.

Quantizing each candidate layer alone costs a session and an evaluation per layer: for the
PP-OCRv4 recognizer (148 candidates) that is about 8 s a layer on this 2-core host, some 20
minutes before the search starts. This module ranks the layers from one run instead: the FP32
model with, beside each candidate layer, a copy that reads the same FP32 tensors through the
Q/DQ pairs the fully quantized model gives that layer. The copy's error is the layer's own INT8
error on clean inputs (error propagated from earlier layers left out, which would hide a late
layer's own noise behind what reached it). The ranking only orders the layers for the bisection, which then judges real models,
so a proxy that gets the order roughly right costs a few extra evaluations at worst.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from agent.deps import require
from models.ort import create_session
from models.quantize.evaluate import LayerSensitivity

log = logging.getLogger(__name__)

# An input that carries no quantization error yet (a graph input, a constant) has an infinite
# SQNR; it is counted as this, so a first layer's loss is finite and comparable.
CLEAN_SQNR_DB = 100.0
CHUNK_SAMPLES = 4  # samples per run: the exposed tensors of a batch stay small


def local_sensitivity(float_model: Any, int8_bytes: bytes, candidates: Sequence[tuple[str, str]],
                      inputs: dict[str, np.ndarray], *, threads: int = 2,
                      fixed_batch: int | None = None) -> list[LayerSensitivity]:
    """Each candidate layer's own INT8 error on clean inputs: its output in ``float_model`` (the
    quantizer's float ModelProto) against a copy of it that reads the same FP32 tensors through
    the Q/DQ pairs the fully quantized model ``int8_bytes`` puts before it (activation scales and
    per-channel weight scales), on ``inputs``; as an SQNR in dB (``LayerSensitivity.sqnr_db``;
    ``output`` names the measure, "local"), the noisiest layers first. A layer whose Q/DQ inputs
    cannot be traced back to FP32 tensors is ranked first, as if it were the most sensitive."""
    onnx = require("onnx", extra="host", purpose="per-layer sensitivity")
    combined, pairs = _with_local_copies(onnx, float_model, onnx.load_from_string(int8_bytes),
                                         candidates)
    names = [tensor for pair in pairs.values() for tensor in pair]
    measured = _error_powers(_exposing(onnx, combined, names), pairs, inputs, threads,
                             fixed_batch) if pairs else {}
    ranked = []
    for name, op_type in candidates:
        sqnr = measured.get(name, float("nan"))
        ranked.append(LayerSensitivity(name, op_type, sqnr, float("nan"), "local"))
    ranked.sort(key=lambda layer: (-math.inf if math.isnan(layer.sqnr_db) else layer.sqnr_db,
                                   layer.name))
    return ranked


def _with_local_copies(onnx: Any, float_model: Any, int8_model: Any,
                       candidates: Sequence[tuple[str, str]]) -> tuple[Any, dict[str, tuple[str, str]]]:
    """``float_model`` with a copy of each candidate layer whose inputs pass through the Q/DQ
    pairs ``int8_model`` gives that layer, fed from the FP32 tensors; and each traced layer's
    (FP32 output, copy's output)."""
    combined = onnx.ModelProto()
    combined.CopyFrom(float_model)
    graph = combined.graph
    known = {value.name for value in graph.input} | {init.name for init in graph.initializer}
    known |= {output for node in graph.node for output in node.output}
    int8_initializers = {init.name: init for init in int8_model.graph.initializer}
    producers = {output: node for node in int8_model.graph.node for output in node.output}
    float_nodes = {node.name: node for node in float_model.graph.node}
    int8_nodes = {node.name: node for node in int8_model.graph.node}

    def needs(tensor: str) -> bool:
        """Bring an initializer of the INT8 model along; False where the tensor is unknown."""
        if tensor in known or not tensor:
            return True
        if tensor in int8_initializers:
            graph.initializer.append(int8_initializers[tensor])
            known.add(tensor)
            return True
        return False

    pairs: dict[str, tuple[str, str]] = {}
    for name, _ in candidates:
        node, reference = int8_nodes.get(name), float_nodes.get(name)
        if node is None or reference is None or not reference.output:
            continue
        added: list[Any] = []
        copied_inputs: list[str] = []
        for index, tensor in enumerate(node.input):
            dequantize = producers.get(tensor)
            if dequantize is None or dequantize.op_type != "DequantizeLinear":
                copied_inputs.append(tensor)
                if not needs(tensor):
                    break
                continue
            quantize = producers.get(dequantize.input[0])
            if quantize is None or quantize.op_type != "QuantizeLinear" or not all(
                    needs(part) for part in (*quantize.input, *dequantize.input[1:])):
                break
            stem = f"{name}__local{index}"
            added.append(onnx.helper.make_node("QuantizeLinear", list(quantize.input),
                                               [f"{stem}_q"], name=f"{stem}_q"))
            added[-1].attribute.extend(quantize.attribute)
            added.append(onnx.helper.make_node(
                "DequantizeLinear", [f"{stem}_q", *dequantize.input[1:]], [f"{stem}_dq"],
                name=f"{stem}_dq"))
            added[-1].attribute.extend(dequantize.attribute)
            copied_inputs.append(f"{stem}_dq")
        else:
            copy = onnx.helper.make_node(node.op_type, copied_inputs, [f"{name}__local_out"],
                                         name=f"{name}__local", domain=node.domain)
            copy.attribute.extend(node.attribute)
            graph.node.extend([*added, copy])
            pairs[name] = (reference.output[0], f"{name}__local_out")
    return combined, pairs


def _exposing(onnx: Any, model: Any, names: Sequence[str]) -> bytes:
    """``model`` with the tensors ``names`` added as graph outputs (FP32, shape left open)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {output.name for output in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.helper.make_tensor_value_info(
                name, onnx.TensorProto.FLOAT, None))
    return copy.SerializeToString()


def _error_powers(model_bytes: bytes, pairs: dict[str, tuple[str, str]],
                  inputs: dict[str, np.ndarray], threads: int, fixed_batch: int | None
                  ) -> dict[str, float]:
    """Each layer's SQNR (dB) of its copy's output against its FP32 output, summed over
    ``inputs`` in small chunks (exactly ``fixed_batch`` rows where the graph needs it, the last
    chunk filled with repeated samples)."""
    session = create_session(model_bytes, threads=threads, fold_relu=False)
    names = [tensor for pair in pairs.values() for tensor in pair]
    count = len(next(iter(inputs.values())))
    chunk = fixed_batch or CHUNK_SAMPLES
    signal = dict.fromkeys(pairs, 0.0)
    noise = dict.fromkeys(pairs, 0.0)
    for start in range(0, count, chunk):
        rows = np.arange(start, start + chunk) % count if fixed_batch else slice(start, start + chunk)
        values = dict(zip(names, session.run(names, {name: array[rows]
                                                     for name, array in inputs.items()})))
        for layer, (reference_name, copy_name) in pairs.items():
            reference = np.asarray(values[reference_name], dtype=np.float64)
            signal[layer] += float(np.sum(reference ** 2))
            noise[layer] += float(np.sum((reference - values[copy_name]) ** 2))
    return {layer: CLEAN_SQNR_DB if noise[layer] == 0.0 else min(
        CLEAN_SQNR_DB, 10.0 * math.log10(max(signal[layer], 1e-30) / noise[layer]))
        for layer in pairs}
