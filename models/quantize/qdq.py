"""The INT8 QDQ format TensorRT accepts, and the quantizer that produces it.

The format (checked by :func:`check_qdq_format` after every quantization):

- symmetric INT8 for activations and weights: every zero point is 0 (TensorRT rejects others);
- per-channel weight scales (axis 0 of a Conv weight: output channels);
- weights stay float initializers behind a QuantizeLinear/DequantizeLinear pair, which is what
  TensorRT 8.5's ONNX parser expects, and biases stay float (TensorRT rejects an INT32
  DequantizeLinear);
- a dedicated Q/DQ pair for every consumer of a tensor, so ONNX Runtime's CPU provider can fuse
  each ``DQ -> op -> Q`` group into one integer kernel (TensorRT does not care either way).

Quantization is done with onnxruntime.quantization (``quantize_static`` in QDQ format). Ranges are
calibrated once (entropy, percentile or min-max) and cached, so the mixed-precision search can
re-quantize with different layers excluded without calibrating again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.deps import require
from agent.errors import CalibrationError, InternalError, QuantizationError
from agent.fsutil import atomic_write_bytes
from models.calibration import CalibrationReader, CalibrationSet
from models.onnx_model import graph_links

if TYPE_CHECKING:
    from models.quantize.search import QuantizeConfig

log = logging.getLogger(__name__)


CALIBRATION_METHODS = ("entropy", "percentile", "minmax")
# Layers the mixed-precision search may keep out of INT8: the ones that carry the arithmetic.
CANDIDATE_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add")


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
        atomic_write_bytes(raw_path, float_model)
        self._pre_process(raw_path)
        self.float_model = onnx.load(str(self.float_path))
        self.candidates = [
            (node.name, node.op_type)
            for node in self.float_model.graph.node
            if node.op_type in CANDIDATE_OP_TYPES
        ]
        names = [node.name for node in self.float_model.graph.node]
        if len(set(names)) != len(names) or any(not name for name in names):
            raise QuantizationError("every node of the model needs a unique, non-empty name")
        self._neighbours = _candidate_neighbours(self.float_model, {name for name, _ in self.candidates})
        self.calibration_seconds = 0.0

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
        kept_out = set(excluded)
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
        from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

        # quantize_static would build the entropy calibrator with 128 histogram bins and 128
        # quantized bins, which leaves no threshold to search (it degenerates to min-max). TensorRT's
        # entropy calibrator uses 2048 bins folded into 128, so do the same here.
        options = {
            "symmetric": True,
            "num_bins": 2048,
            "num_quantized_bins": 128,
            "percentile": self.config.percentile,
        }
        reader = CalibrationReader(self.calibration, self.config.batch_size, self.config.progress,
                                   fixed_batch=self.config.fixed_batch)
        started = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # ORT prints its progress to stdout
            calibrator = create_calibrator(
                self.float_path,
                None,
                augmented_model_path=str(self.workdir / "augmented.onnx"),
                calibrate_method=self._method(),
                extra_options=options,
            )
            try:
                calibrator.collect_data(reader)
            except Exception as exc:  # ORT raises plain Exceptions for input mismatches
                raise CalibrationError(f"calibration data does not fit the model: {exc}") from exc
            ranges = calibrator.compute_data()
        save_tensors_data(ranges, self.cache_path)
        self.calibration_seconds = time.perf_counter() - started

    def quantize(
        self, *, exclude: Sequence[str] = (), only: Sequence[str] | None = None
    ) -> bytes:
        """A QDQ model with ``exclude`` kept in float (or only the layers ``only`` quantized)."""
        q = self._quantization
        if only is not None:
            excluded = [name for name, _ in self.candidates if name not in set(only)]
        else:
            excluded = list(exclude)
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
                    per_channel=True,
                    reduce_range=False,
                    activation_type=q.QuantType.QInt8,
                    weight_type=q.QuantType.QInt8,
                    calibrate_method=self._method(),
                    nodes_to_exclude=self.expand_exclusions(excluded),
                    calibration_cache_path=str(self.cache_path),
                    extra_options={
                        "ActivationSymmetric": True,
                        "WeightSymmetric": True,
                        "AddQDQPairToWeight": True,
                        "QuantizeBias": False,
                        "DedicatedQDQPair": True,
                    },
                )
        except (ValueError, RuntimeError) as exc:
            raise QuantizationError(f"ONNX Runtime quantization failed: {exc}") from exc
        model_bytes = output_path.read_bytes()
        check_qdq_format(model_bytes)
        return model_bytes


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
    from onnx import numpy_helper

    model = onnx.load_from_string(model_bytes)
    initializers = {init.name: init for init in model.graph.initializer}
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
