"""ONNX Runtime sessions configured for QDQ INT8 models (torch-free; used on host and device).

ONNX Runtime's CPU provider turns ``DQ -> Conv -> Q`` groups into ``QLinearConv`` only when every
DequantizeLinear feeds a single node. The quantizer emits a dedicated Q/DQ pair per consumer for
that reason, but the CommonSubexpressionElimination pass merges those identical pairs back into
shared ones, and the convolutions on a residual branch then run in float after a dequantize. On
ResNet-18 at 224x224 (2 threads, ORT 1.32) disabling that one pass took INT8 from about 63 to about
140 images/s; float models are not affected measurably.

When the ``onnx`` package is present, sessions also fold ReLUs into INT8 quantization
(:mod:`models.ort_relu`), an ONNX Runtime-only rewrite that the bundle's model never carries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.deps import require

log = logging.getLogger(__name__)

DISABLED_FOR_QDQ = ("CommonSubexpressionElimination",)


def create_session(
    model: bytes | Path | str,
    *,
    threads: int = 2,
    profile: bool = False,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    spin: bool = True,
    fold_relu: bool = True,
) -> Any:
    """An ``onnxruntime.InferenceSession`` with ``threads`` intra-op threads (0 = ORT's default)
    on the given execution providers (CPU by default); ``spin=False`` lets idle worker threads
    sleep instead of busy-waiting; ``fold_relu`` applies :func:`models.ort_relu.fold_relu_into_quantize`
    to INT8 QDQ models (when ``onnx`` is installed)."""
    ort = require("onnxruntime", extra="device", purpose="running ONNX models")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    options.enable_profiling = profile
    if not spin:
        # Idle intra-op threads busy-wait for the next op by default. Alone on a machine that is
        # fastest, but beside a server's event loop on few cores the spinning steals the CPU the
        # loop needs (2 cores, ResNet-18 INT8 over HTTP at concurrency 64: 228 -> 325 req/s).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = _fold_relus(model) if fold_relu else model
    source = str(source) if isinstance(source, Path) else source
    return ort.InferenceSession(
        source,
        options,
        providers=list(providers),
        disabled_optimizers=list(DISABLED_FOR_QDQ),
    )


def _fold_relus(model: bytes | Path | str) -> bytes | Path | str:
    """The model with ReLUs folded into INT8 quantization, or unchanged when nothing applies (or
    ``onnx`` is not installed: the device extra does not need it)."""
    try:
        import onnx
    except ImportError:
        return model
    from models.ort_relu import fold_relu_into_quantize

    try:
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
    except Exception:  # noqa: BLE001 - ONNX Runtime reports unreadable models itself
        return model
    if not any(node.op_type == "QuantizeLinear" for node in proto.graph.node):
        return model
    folded = fold_relu_into_quantize(proto)
    if not folded:
        return model
    log.debug("folded %d ReLU(s) into INT8 quantization for ONNX Runtime", folded)
    return proto.SerializeToString()
