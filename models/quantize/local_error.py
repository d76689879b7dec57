"""Per-layer sensitivity in one pass, for models with too many layers to quantize one at a time.

Quantizing each candidate layer alone costs a session and an evaluation per layer: for the
PP-OCRv4 recognizer (148 candidates) that is about 8 s a layer on this 2-core host, some 20
minutes before the search starts. This module ranks the layers from two runs instead: the FP32
model and the fully quantized one, each with every candidate's input and output tensors exposed.
A layer's own share of the INT8 error is how much signal-to-noise it loses between its inputs
(the worst of them) and its output: the noise its quantized inputs and weights add on top of what
reached it. The ranking only orders the layers for the bisection, which then judges real models,
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
    """Each candidate layer's loss of SQNR (dB) from its worst input to its output in the fully
    quantized model ``int8_bytes`` against ``float_model`` (the quantizer's float ModelProto),
    on ``inputs``; the layers losing most first. ``LayerSensitivity.sqnr_db`` is the layer
    output's SQNR there and ``output`` names the measure ("local")."""
    onnx = require("onnx", extra="host", purpose="per-layer sensitivity")
    candidates_by_name = dict(candidates)
    wanted = set(candidates_by_name)
    initializers = {init.name for init in float_model.graph.initializer}
    layer_io: dict[str, tuple[list[str], str]] = {}
    for node in float_model.graph.node:
        if node.name in wanted and node.output:
            data = [name for name in node.input if name and name not in initializers]
            layer_io[node.name] = (data, node.output[0])
    tensors = sorted({name for data, output in layer_io.values() for name in (*data, output)})
    graph_inputs = {value.name for value in float_model.graph.input}
    exposed = [name for name in tensors if name not in graph_inputs]
    int8_model = onnx.load_from_string(int8_bytes)
    signal, noise = _error_powers(_exposing(onnx, float_model, exposed),
                                  _exposing(onnx, int8_model, exposed), exposed, inputs,
                                  threads, fixed_batch)

    def sqnr(name: str) -> float:
        if name in graph_inputs or name not in signal:
            return CLEAN_SQNR_DB
        if noise[name] == 0.0:
            return CLEAN_SQNR_DB
        return min(CLEAN_SQNR_DB, 10.0 * math.log10(max(signal[name], 1e-30) / noise[name]))

    ranked = []
    for name, (data, output) in layer_io.items():
        incoming = min((sqnr(tensor) for tensor in data), default=CLEAN_SQNR_DB)
        outgoing = sqnr(output)
        ranked.append((incoming - outgoing, LayerSensitivity(
            name, candidates_by_name[name], outgoing, float("nan"), "local")))
    ranked.sort(key=lambda entry: (-entry[0], entry[1].name))
    return [layer for _, layer in ranked]


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


def _error_powers(float_bytes: bytes, int8_bytes: bytes, names: Sequence[str],
                  inputs: dict[str, np.ndarray], threads: int, fixed_batch: int | None
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """Sum of squares of each tensor in the FP32 run and of its INT8 error, over ``inputs`` in
    small chunks (exactly ``fixed_batch`` rows where the graph needs it, the last chunk filled
    with repeated samples)."""
    float_session = create_session(float_bytes, threads=threads, fold_relu=False)
    int8_session = create_session(int8_bytes, threads=threads, fold_relu=False)
    count = len(next(iter(inputs.values())))
    chunk = fixed_batch or CHUNK_SAMPLES
    signal = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    for start in range(0, count, chunk):
        rows = np.arange(start, start + chunk) % count if fixed_batch else slice(start, start + chunk)
        feed = {name: array[rows] for name, array in inputs.items()}
        want = float_session.run(list(names), feed)
        got = int8_session.run(list(names), feed)
        for name, reference, test in zip(names, want, got):
            reference = np.asarray(reference, dtype=np.float64)
            signal[name] += float(np.sum(reference ** 2))
            noise[name] += float(np.sum((reference - np.asarray(test, dtype=np.float64)) ** 2))
    return signal, noise
