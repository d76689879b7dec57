"""ONNX Runtime sessions configured for QDQ INT8 models (torch-free; used on host and device).

ONNX Runtime's CPU provider turns ``DQ -> Conv -> Q`` groups into ``QLinearConv`` only when every
DequantizeLinear feeds a single node. The quantizer emits a dedicated Q/DQ pair per consumer for
that reason, but the CommonSubexpressionElimination pass merges those identical pairs back into
shared ones, and the convolutions on a residual branch then run in float after a dequantize. On
ResNet-18 at 224x224 (2 threads, ORT 1.32) disabling that one pass took INT8 from about 63 to about
140 images/s; float models are not affected measurably.

On x86-64 CPUs without VNNI (AVX2, or AVX-512 without VNNI) sessions ask for exact integer
arithmetic (``session.x64quantprecision``): there ONNX Runtime's fast U8S8 kernels add pairs of 8-bit
products in 16 bits and saturate; the precise mode uses U8U8 kernels that accumulate exactly, as
TensorRT does. VNNI kernels accumulate in 32 bits, so those CPUs keep the default kernels: on an
Intel Xeon with AVX-512 VNNI and AMX (ORT 1.30) they were exact on the saturating case of
``tests/test_ort_relu.py``, and the precise mode there would cost 3.2x (ResNet-18 INT8, 224x224,
batch 8, 2 threads: 53-57 instead of 159-180 images/s), which is why it is not asked for everywhere.
The saturation is not a rounding detail: on an AVX2 EPYC (ORT 1.32) it took the example ResNet-18's
INT8 top-1 from 99.2 to 95.3 and a small CNN's from 96.7 to 80.3, so the mixed-precision search kept
layers out of INT8 for an artefact of the host's CPU that no Jetson has. The exact kernels cost
speed on such CPUs only (ResNet-18 INT8 at 224, batch 8: about 50 instead of 65 images/s); on VNNI
CPUs and on ARM the option changes nothing.

When the ``onnx`` package is present, sessions also fold ReLUs into INT8 quantization
(:mod:`models.ort_relu`), an ONNX Runtime-only rewrite that the bundle's model never carries.
"""

from __future__ import annotations

import io
import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from agent.deps import require
from models.onnx_model import graph_links
from models.onnx_wire import Malformed, initializer_spans

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
    # Errors reach the caller as exceptions (which the tools print as one line); at level 3
    # (errors) a failed run would also print ONNX Runtime's own coloured copy of it first.
    options.log_severity_level = 4
    options.enable_profiling = profile
    exact_int8 = int8_may_saturate()
    if exact_int8:
        options.add_session_config_entry("session.x64quantprecision", "1")
    if not spin:
        # Idle intra-op threads busy-wait for the next op by default. Alone on a machine that is
        # fastest, but beside a server's event loop on few cores the spinning steals the CPU the
        # loop needs (2 cores, ResNet-18 INT8 over HTTP at concurrency 64: 228 -> 325 req/s).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = _rewrite_for_ort(model, fold_relu=fold_relu, unshare=exact_int8)
    source = str(source) if isinstance(source, Path) else source
    return ort.InferenceSession(
        source,
        options,
        providers=list(providers),
        disabled_optimizers=list(DISABLED_FOR_QDQ),
    )


def int8_may_saturate(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None) -> bool:
    """Whether ONNX Runtime's default INT8 kernels saturate on this CPU: x86-64 without VNNI (see
    the module docstring). When the CPU flags cannot be read, assume they do: the exact kernels
    are only slower, never wrong."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return False
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return not {"avx512_vnni", "avx_vnni"} & set(flags)


def int8_kernels() -> str:
    """How ONNX Runtime runs INT8 on this CPU, for reports and logs."""
    return "exact U8U8 (no VNNI on this CPU)" if int8_may_saturate() else "default"


def _rewrite_for_ort(model: bytes | Path | str, *, fold_relu: bool = True,
                     unshare: bool = False) -> bytes | Path | str:
    """The model with ReLUs folded into INT8 quantization (``fold_relu``) and weights' shared zero
    points copied (``unshare``, needed by the exact kernels), or unchanged when nothing applies
    (or ``onnx`` is not installed: the device extra does not need it)."""
    if not fold_relu and not unshare:
        return model
    if not _may_quantize(model):
        return model
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
    folded = fold_relu_into_quantize(proto) if fold_relu else 0
    unshared = _unshare_zero_points(proto) if unshare else 0
    if not folded and not unshared:
        return model
    log.debug("for ONNX Runtime: folded %d ReLU(s) into INT8 quantization, gave %d weight(s) "
              "a zero point of their own", folded, unshared)
    return proto.SerializeToString()


# The walk around the weights reads one field in about 1 us, the scan 16 KiB (both in Python on
# the development VM): a model with more fields than one per 16 KiB is scanned whole.
_BYTES_PER_FIELD = 16 << 10


def _may_quantize(model: bytes | Path | str) -> bool:
    """Whether the model's bytes name the QuantizeLinear op, which any graph with such a node
    stores as plain text; False lets a float model skip the full parse (about 50 ms holding the
    GIL for a 48 MB model on this project's CI machine, beside the serving threads during an
    update). The graph's initializers are skipped unread
    (:func:`models.onnx_wire.initializer_spans`: a tensor holds no node), so a float model costs
    the reading of its graph's keys and lengths, not a scan of its weights under the GIL (for a
    40 MB model on the development VM 0.9 ms of the daemon's CPU instead of 18-19.5, while a
    candidate loads beside the serving threads). Bytes that are not a protobuf
    message, and graphs of more fields than one per 16 KiB (many small nodes: reading around their
    weights would cost more), are scanned whole, in 1 MiB pieces so the GIL is let go between
    them. A model that cannot be read is True: the parse after reports it as before."""
    needle = b"QuantizeLinear"
    try:
        with io.BytesIO(model) if isinstance(model, bytes) else open(model, "rb") as file:
            size = file.seek(0, io.SEEK_END)
            try:
                # About 1 us a field: a graph of many small nodes is scanned whole instead.
                found = initializer_spans(file, max_fields=max(256, size // _BYTES_PER_FIELD))
            except Malformed:
                found = None
            weights = found or []
            start = 0
            for weights_start, weights_end in [*weights, (size, size)]:
                if _names(file, needle, start, weights_start):
                    return True
                start = weights_end
            return False
    except OSError:
        return True


def _names(file: BinaryIO, needle: bytes, start: int, end: int) -> bool:
    """Whether ``needle`` lies within bytes ``start`` to ``end`` of ``file`` (read in 1 MiB
    pieces)."""
    piece = 1 << 20
    file.seek(start)
    tail = b""
    left = end - start
    while left > 0 and (chunk := file.read(min(piece, left))):
        left -= len(chunk)
        if needle in tail + chunk[:len(needle) - 1] or needle in chunk:
            return True
        tail = chunk[-(len(needle) - 1):]
    return False


def _unshare_zero_points(model: Any) -> int:
    """Give every weight's Q/DQ pair a zero-point initializer of its own; returns how many weights
    got a copy.

    With exact INT8 arithmetic on a CPU without VNNI, ONNX Runtime converts each convolution's INT8
    weights and their zero point to UINT8, and fails the session ("Attempt to replace the existing
    tensor") when two weights share one zero-point initializer. Quantizers give each weight its
    own, but hand-made or merged graphs often share a single zero. Activations are left alone.
    """
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    producer, _ = graph_links(model.graph)

    def weight_of(node: Any) -> str | None:
        """The weight initializer a Q/DQ node quantizes (directly or through its Q), else None."""
        if node.input[0] in initializers:
            return node.input[0]
        source = producer.get(node.input[0])
        if (node.op_type == "DequantizeLinear" and source is not None
                and source.op_type == "QuantizeLinear" and source.input[0] in initializers):
            return source.input[0]
        return None

    owner: dict[str, str] = {}  # zero-point initializer -> the weight that keeps it
    copies: dict[tuple[str, str], str] = {}
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        zero_point, weight = node.input[2], weight_of(node)
        if zero_point not in initializers or weight is None:
            continue
        if owner.setdefault(zero_point, weight) == weight:
            continue
        if (zero_point, weight) not in copies:
            copy = model.graph.initializer.add()
            copy.CopyFrom(initializers[zero_point])
            copy.name = f"{zero_point}__{weight}"
            copies[(zero_point, weight)] = copy.name
        node.input[2] = copies[(zero_point, weight)]
    return len(copies)
