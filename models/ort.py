"""ONNX Runtime sessions configured for QDQ INT8 models (torch-free; used on host and device).

ONNX Runtime's CPU provider turns ``DQ -> Conv -> Q`` groups into ``QLinearConv`` only when every
DequantizeLinear feeds a single node. The quantizer emits a dedicated Q/DQ pair per consumer for
that reason, but the CommonSubexpressionElimination pass merges those identical pairs back into
shared ones, and the convolutions on a residual branch then run in float after a dequantize. On
ResNet-18 at 224x224 (2 threads, ORT 1.32) disabling that one pass took INT8 from about 63 to about
140 images/s; float models are not affected measurably.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.deps import require

DISABLED_FOR_QDQ = ("CommonSubexpressionElimination",)


def create_session(
    model: bytes | Path | str,
    *,
    threads: int = 2,
    profile: bool = False,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    spin: bool = True,
) -> Any:
    """An ``onnxruntime.InferenceSession`` with ``threads`` intra-op threads (0 = ORT's default)
    on the given execution providers (CPU by default); ``spin=False`` lets idle worker threads
    sleep instead of busy-waiting."""
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
    source = str(model) if isinstance(model, Path) else model
    return ort.InferenceSession(
        source,
        options,
        providers=list(providers),
        disabled_optimizers=list(DISABLED_FOR_QDQ),
    )
