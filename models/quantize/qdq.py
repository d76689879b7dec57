"""The INT8 QDQ format TensorRT accepts, and the quantizer that produces it.

The format (checked by :func:`check_qdq_format` after every quantization):

- symmetric INT8 for activations and weights: every zero point is 0 (TensorRT rejects others);
- per-channel weight scales (axis 0 of a Conv weight: output channels);
- weights stay float initializers behind a QuantizeLinear/DequantizeLinear pair, which is what
  TensorRT 8.5's ONNX parser expects, and biases stay float (TensorRT rejects an INT32
  DequantizeLinear);
- a dedicated Q/DQ pair for every consumer of a tensor, so ONNX Runtime's CPU provider can fuse
  each ``DQ -> op -> Q`` group into one integer kernel (TensorRT does not care either way).

Quantization is done with onnxruntime.quantization (``quantize_static`` in QDQ format), once:
ranges are calibrated once (entropy, percentile or min-max, :mod:`models.quantize.ranges`), the
model is quantized once with every layer in INT8, and the mixed-precision search's variants, with
layers kept out of INT8, are derived from that model by editing its graph
(:mod:`models.quantize.variants`) in milliseconds instead of a ``quantize_static`` call each.

Normalizations (LayerNormalization, InstanceNormalization, an unfolded BatchNormalization) are not
quantized: ONNX Runtime would quantize their scale vector as an INT8 weight, per tensor, after
warning that the per-channel axis it picks for it (1) does not exist on a vector (the 81 warnings
of a text recognizer's calibration: its five fused LayerNorms, once per quantize_static call),
and an 8-bit scale vector costs accuracy for no INT8 kernel; NVIDIA's ModelOpt does not quantize
LayerNormalization or InstanceNormalization either. Per-channel weights must be quantized on
their output-channel axis, which :func:`check_qdq_format` checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.deps import require
from agent.errors import CalibrationError, InternalError, QuantizationError
from agent.fsutil import atomic_write_bytes
from models.calibration import CalibrationSet
from models.onnx_model import graph_links
from models.quantize.ranges import (
    bounded_outputs,
    calibration_tensors,
    collect_ranges,
    save_ranges,
)
from models.quantize.variants import QdqVariants

if TYPE_CHECKING:
    from models.quantize.search import QuantizeConfig

log = logging.getLogger(__name__)


CALIBRATION_METHODS = ("entropy", "percentile", "minmax")
# Layers the mixed-precision search may keep out of INT8: the ones that carry the arithmetic.
CANDIDATE_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add")
# Op types quantize_static is not asked to quantize (module docstring).
FLOAT_OP_TYPES = frozenset({"LayerNormalization", "InstanceNormalization", "BatchNormalization",
                            "GroupNormalization"})
_EXTRA_OPTIONS = {
    "ActivationSymmetric": True,
    "WeightSymmetric": True,
    "AddQDQPairToWeight": True,
    "QuantizeBias": False,
    "DedicatedQDQPair": True,
}


@lru_cache(maxsize=1)
def quantized_op_types() -> tuple[str, ...]:
    """The op types quantize_static is asked to quantize: its own default set (every op it has a
    QDQ or QLinear quantizer for) less :data:`FLOAT_OP_TYPES`."""
    registry = require("onnxruntime.quantization.registry", extra="host", purpose="INT8 quantization")
    return tuple(sorted((set(registry.QLinearOpsRegistry) | set(registry.QDQRegistry)) - FLOAT_OP_TYPES))


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    """Run a block in ``path`` (builds are single-threaded where this is used)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


class QdqQuantizer:
    """Calibrates a float ONNX model once, then quantizes it with any set of layers excluded.

    Args:
        float_model: Serialized float ONNX model (BatchNorm folded).
        calibration: Real preprocessed samples.
        config: Quantization settings.
        workdir: A private scratch directory (the caller removes it).
    """

    def __init__(
        self, float_model: bytes, calibration: CalibrationSet, config: QuantizeConfig, workdir: Path
    ) -> None:
        self._quantization = require(
            "onnxruntime.quantization", extra="host", purpose="INT8 quantization"
        )
        onnx = require("onnx", extra="host", purpose="INT8 quantization")
        if len(calibration) == 0:
            raise CalibrationError("calibration set is empty")
        self.config = config
        self.calibration = calibration
        # Absolute: pre-processing runs with the work directory as the current one.
        self.workdir = Path(workdir).resolve()
        self.float_path = self.workdir / "float.onnx"
        self.cache_path = self.workdir / "calibration.json"
        raw_path = self.workdir / "float.raw.onnx"
        # Named before pre-processing too: ONNX Runtime's optimiser refuses duplicate names.
        raw_model = onnx.load_from_string(float_model)
        renamed = _name_nodes(raw_model)
        if renamed:
            log.info("%d unnamed or duplicate-named nodes were given names of their own: the "
                     "precision plan names every layer", renamed)
            float_model = raw_model.SerializeToString()
        del raw_model
        atomic_write_bytes(raw_path, float_model)
        self._pre_process(raw_path)
        self.op_types = quantized_op_types()
        float_model = onnx.load(str(self.float_path))
        renamed = _name_nodes(float_model)  # nodes the optimiser made
        if _unshare_weights(float_model, self.op_types) or renamed:
            onnx.save(float_model, str(self.float_path))
        # Shape-inferred, as quantize_static loads it: calibration needs every tensor's type.
        self.float_model = onnx.shape_inference.infer_shapes(float_model)
        self.candidates = [
            (node.name, node.op_type)
            for node in self.float_model.graph.node
            if node.op_type in CANDIDATE_OP_TYPES
        ]
        self._neighbours = _candidate_neighbours(self.float_model, {name for name, _ in self.candidates})
        self.calibration_seconds = 0.0
        # Seconds spent per phase, for the build's report: calibration_s, quantize_static_s (the
        # one full quantization), variants_s (deriving every model quantize() returned).
        self.seconds = {"calibration_s": 0.0, "quantize_static_s": 0.0, "variants_s": 0.0}
        self.variant_count = 0
        self._variants: QdqVariants | None = None
        # Concats that always stay float (found from the calibrated scales; mismatched_concats).
        self._float_concats: list[str] = []

    def _pre_process(self, raw_path: Path) -> None:
        """Shape inference and basic graph optimisation, as ONNX Runtime recommends before QDQ,
        from ``raw_path`` to :attr:`float_path`."""
        # In the work directory: when its symbolic shape inference gives up, ONNX Runtime saves
        # sym_shape_infer_temp.onnx and a <uuid>.data file into the current directory.
        present = set(self.workdir.iterdir())
        try:
            with _working_directory(self.workdir):
                self._quantization.quant_pre_process(str(raw_path), str(self.float_path))
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises a bare Exception here
            if "symbolic shape inference" not in str(exc):
                raise
            # Its symbolic shape inference gives up on some graphs (a UNet's skip
            # concatenations, for one); ONNX's own shape inference is enough for quantization.
            log.warning("ONNX Runtime's symbolic shape inference could not complete (%s); "
                        "quantizing with ONNX's shape inference only", exc)
            self._quantization.quant_pre_process(str(raw_path), str(self.float_path),
                                                 skip_symbolic_shape=True)
            for leftover in set(self.workdir.iterdir()) - present - {self.float_path}:
                leftover.unlink(missing_ok=True)  # ONNX Runtime's debug copy of the model

    def expand_exclusions(self, excluded: Sequence[str]) -> list[str]:
        """``excluded`` plus every other node (Relu, pooling, ...) whose neighbouring layers are all
        excluded: quantizing such a node alone adds rounding error and saves nothing, and with every
        layer excluded the result is the float model."""
        kept_out = set(excluded) | set(self._float_concats)
        satellites = [
            node
            for node, layers in self._neighbours.items()
            if layers <= kept_out
        ]
        return sorted(kept_out | set(satellites))

    def _method(self) -> Any:
        methods = self._quantization.CalibrationMethod
        return {"entropy": methods.Entropy, "percentile": methods.Percentile, "minmax": methods.MinMax}[
            self.config.method
        ]

    def calibrate(self) -> None:
        """Collect activation ranges on the calibration set and cache them (done once)."""
        started = time.perf_counter()
        tensors = calibration_tensors(self.float_model, self.op_types)
        ranges = collect_ranges(
            self.float_model,
            tensors,
            self.calibration,
            method=self.config.method,
            percentile=self.config.percentile,
            batch_size=self.config.batch_size,
            progress=self.config.progress,
            fixed_batch=self.config.fixed_batch,
            observed=bounded_outputs(self.float_model),
            entropy_min_values=self.config.entropy_min_values,
        )
        save_ranges(ranges, self._method(), self.cache_path)
        self.calibration_seconds = time.perf_counter() - started
        self.seconds["calibration_s"] = self.calibration_seconds
        log.info("calibrated %d tensors on %d samples (%s) in %.1f s", len(tensors),
                 len(self.calibration), self.config.method, self.calibration_seconds)

    def quantize(
        self, *, exclude: Sequence[str] = (), only: Sequence[str] | None = None
    ) -> bytes:
        """A QDQ model with ``exclude`` kept in float (or only the layers ``only`` quantized),
        and with them the other nodes :meth:`expand_exclusions` adds. Derived from the fully
        quantized model (made, and calibrated for, on the first call)."""
        if only is not None:
            excluded = [name for name, _ in self.candidates if name not in set(only)]
        else:
            excluded = list(exclude)
        variants = self._full_model()
        started = time.perf_counter()
        model_bytes = variants.derive(self.expand_exclusions(excluded))
        self.seconds["variants_s"] += time.perf_counter() - started
        self.variant_count += 1
        return model_bytes

    def _full_model(self) -> QdqVariants:
        if self._variants is None:
            if not self.cache_path.exists():
                self.calibrate()
            started = time.perf_counter()
            scales = self._activation_scales()
            self._variants = QdqVariants(self.quantize_with_ort(), self.float_model,
                                         self.op_types, scales)
            self.seconds["quantize_static_s"] = time.perf_counter() - started
            self._float_concats = mismatched_concats(self.float_model, scales)
            if self._float_concats:
                log.info("kept in float: %d Concat(s) joining tensors whose INT8 scales differ "
                         "over %gx (they would share one scale, and the smaller part round to "
                         "0): %s", len(self._float_concats), CONCAT_SCALE_RATIO,
                         ", ".join(self._float_concats))
        return self._variants

    def _activation_scales(self) -> dict[str, np.ndarray]:
        """Each calibrated tensor's INT8 scale, as quantize_static computes it from the cached
        range (symmetric, over [-127, 127])."""
        from onnx import TensorProto
        from onnxruntime.quantization.calibrate import load_tensors_data
        from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType

        qmin, qmax = get_qmin_qmax_for_qType(TensorProto.INT8, symmetric=True)
        scales = {}
        for name, data in load_tensors_data(self.cache_path).items():
            low, high = data.range_value
            _, scale = compute_scale_zp(np.asarray(low), np.asarray(high), qmin, qmax, True)
            scales[name] = np.asarray(scale, dtype=np.float32).squeeze()
        return scales

    def quantize_with_ort(self, *, exclude: Sequence[str] = ()) -> bytes:
        """``quantize_static`` with ``exclude`` (as given) as its nodes_to_exclude: the fully
        quantized model that :meth:`quantize` derives its variants from, and the reference they
        are checked against."""
        q = self._quantization
        if not self.cache_path.exists():
            self.calibrate()
        output_path = self.workdir / "quantized.onnx"
        try:
            with contextlib.redirect_stdout(sys.stderr):
                q.quantize_static(
                    str(self.float_path),
                    str(output_path),
                    None,
                    quant_format=q.QuantFormat.QDQ,
                    op_types_to_quantize=list(self.op_types),
                    per_channel=True,
                    reduce_range=False,
                    activation_type=q.QuantType.QInt8,
                    weight_type=q.QuantType.QInt8,
                    calibrate_method=self._method(),
                    nodes_to_exclude=list(exclude),
                    calibration_cache_path=str(self.cache_path),
                    extra_options=dict(_EXTRA_OPTIONS),
                )
        except (ValueError, RuntimeError) as exc:
            raise QuantizationError(f"ONNX Runtime quantization failed: {exc}") from exc
        model_bytes = output_path.read_bytes()
        check_qdq_format(model_bytes)
        return model_bytes


# A Concat whose inputs' scales differ by more than this stays float: in INT8 its inputs and
# output share one scale, so the smaller input keeps under 127 / ratio levels (8 at 16x).
CONCAT_SCALE_RATIO = 16.0


def mismatched_concats(model: Any, scales: Mapping[str, np.ndarray]) -> list[str]:
    """The Concat nodes of ``model`` whose calibrated inputs' scales (``scales``, per-tensor)
    differ by more than :data:`CONCAT_SCALE_RATIO`: a detector's output joining boxes in pixels
    (scale 2.5) with scores in [0, 1] (scale 0.008) lost every score in INT8."""
    found = []
    for node in model.graph.node:
        if node.op_type != "Concat":
            continue
        values = [float(np.max(scales[name])) for name in node.input
                  if name in scales and np.ndim(scales[name]) == 0]
        values = [value for value in values if value > 0]
        if len(values) >= 2 and max(values) > CONCAT_SCALE_RATIO * min(values):
            found.append(node.name)
    return found


def _name_nodes(model: Any) -> int:
    """Give each node without a name, or with a name an earlier node took, a unique one made
    of its op_type and position (``Conv_12``); returns how many were named.

    The precision plan, the exclusion lists and the per-layer table all name layers, and many
    exporters (and ONNX Runtime's pre-processing) leave nodes unnamed.
    """
    nodes = model.graph.node
    taken = {node.name for node in nodes if node.name}
    seen: set[str] = set()
    renamed = 0
    for index, node in enumerate(nodes):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        name = f"{node.op_type}_{index}"
        while name in taken:
            name += "_"
        node.name = name
        taken.add(name)
        seen.add(name)
        renamed += 1
    return renamed


def _unshare_weights(model: Any, op_types: Collection[str]) -> int:
    """Give every node of ``op_types`` a copy of its own of each float initializer it shares
    with another such node; returns how many copies were made.

    quantize_static gives a weight one Q/DQ pair however many nodes read it, and ONNX Runtime's
    exact INT8 kernels (see :mod:`models.ort`) then fail the session ("Attempt to replace the
    existing tensor") converting that weight once per reader: a text recognizer's attention
    scale, one constant read by two Muls (its graph optimisation merges equal constants), did.
    """
    initializers = {init.name: init for init in model.graph.initializer if init.data_type in (1, 10)}
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.op_type in op_types:
            for name in dict.fromkeys(node.input):
                if name in initializers:
                    readers.setdefault(name, []).append(node)
    taken = set(initializers) | {name for node in model.graph.node for name in node.output}
    copies = 0
    for name, nodes in readers.items():
        for node in nodes[1:]:
            copy_name = f"{name}__{node.name}"
            while copy_name in taken:
                copy_name += "_"
            taken.add(copy_name)
            copy = model.graph.initializer.add()
            copy.CopyFrom(initializers[name])
            copy.name = copy_name
            node.input[:] = [copy_name if item == name else item for item in node.input]
            copies += 1
    return copies


def _candidate_neighbours(model: Any, candidates: set[str]) -> dict[str, frozenset[str]]:
    """For each non-candidate node, the candidate layers it connects to through other
    non-candidate nodes (upstream and downstream)."""
    producers, consumers = graph_links(model.graph)
    neighbours = {}
    for start in model.graph.node:
        if start.name in candidates:
            continue
        found: set[str] = set()
        seen = {start.name}
        stack = [start]
        while stack:
            node = stack.pop()
            linked = [producers[name] for name in node.input if name in producers]
            linked += [c for name in node.output for c in consumers.get(name, [])]
            for other in linked:
                if other.name in candidates:
                    found.add(other.name)
                elif other.name not in seen:
                    seen.add(other.name)
                    stack.append(other)
        neighbours[start.name] = frozenset(found)
    return neighbours


def check_qdq_format(model_bytes: bytes) -> None:
    """Check the invariants TensorRT needs (module docstring); a violation is our bug."""
    onnx = require("onnx", extra="host", purpose="checking QDQ models")
    check_qdq_graph(onnx.load_from_string(model_bytes))


def check_qdq_graph(model: Any) -> None:
    """:func:`check_qdq_format` on a loaded model."""
    from onnx import numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    producers, consumers = graph_links(model.graph)
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if len(node.input) < 3 or node.input[2] not in initializers:
            raise InternalError(f"{node.name}: Q/DQ without a constant zero point")
        zero_point = numpy_helper.to_array(initializers[node.input[2]])
        if zero_point.dtype != np.int8:
            raise InternalError(f"{node.name}: zero point is {zero_point.dtype}, not int8")
        if np.any(zero_point != 0):
            raise InternalError(f"{node.name}: non-zero zero point")
        if node.op_type == "DequantizeLinear" and node.input[0] in initializers:
            raise InternalError(f"{node.name}: weight stored quantized, not as float behind Q/DQ")
        if node.op_type == "DequantizeLinear" and initializers[node.input[2]].dims:
            _check_channel_axis(node, producers, consumers, initializers)


def _check_channel_axis(dequantize: Any, producers: dict[str, Any], consumers: dict[str, list[Any]],
                        initializers: dict[str, Any]) -> None:
    """A per-channel weight must be quantized on its consumer's output-channel axis: 0 for a
    Conv's weight, 1 for a ConvTranspose's, the output columns for a Gemm's or MatMul's."""
    quantize = producers.get(dequantize.input[0])
    weight = initializers.get(quantize.input[0]) if quantize is not None else None
    if weight is None:
        return
    axis = next((attribute.i for attribute in dequantize.attribute if attribute.name == "axis"), 1)
    axis = axis % len(weight.dims)
    for consumer in consumers.get(dequantize.output[0], []):
        if list(consumer.input).index(dequantize.output[0]) != 1:
            continue
        if consumer.op_type in ("Conv", "ConvTranspose"):
            expected = 0 if consumer.op_type == "Conv" else 1
        elif consumer.op_type == "Gemm":
            transposed = any(attribute.name == "transB" and attribute.i for attribute in consumer.attribute)
            expected = 0 if transposed else 1
        elif consumer.op_type == "MatMul":
            expected = len(weight.dims) - 1
        else:
            continue
        if axis != expected:
            raise InternalError(f"{dequantize.name}: {consumer.op_type} weight {weight.name} "
                                f"quantized per channel on axis {axis}, not {expected}")


def quantized_layers(model_bytes: bytes, kept_out: Collection[str] = ()) -> list[str]:
    """Names of the layers that run in INT8: every data input (a Conv/Gemm bias aside) is
    dequantized, and the layer is not one of ``kept_out`` (the precision plan's FP16 layers). A
    kept-out layer may still read only dequantized inputs from INT8 neighbours (an Add joining two
    INT8 branches): it runs in FP16 all the same."""
    onnx = require("onnx", extra="host", purpose="reading QDQ models")
    model = onnx.load_from_string(model_bytes)
    dequantized = {
        output for node in model.graph.node if node.op_type == "DequantizeLinear" for output in node.output
    }
    layers = []
    for node in model.graph.node:
        if node.op_type not in CANDIDATE_OP_TYPES:
            continue
        data_inputs = node.input[:2] if node.op_type in ("Conv", "ConvTranspose", "Gemm") else node.input
        if node.name not in kept_out and all(name in dequantized for name in data_inputs):
            layers.append(node.name)
    return layers
