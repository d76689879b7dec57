"""INT8 post-training quantization to a QDQ ONNX model that TensorRT accepts, with mixed precision.

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

Mixed precision: each candidate layer is quantized alone to measure how much INT8 hurts it
(SQNR and cosine of the model output against FP32). If the fully quantized model misses the
accuracy budget, the most sensitive layers are kept out of INT8 one by one until it is met; then
every kept-out layer is tried back in INT8 (least sensitive first) and left there if the budget
still holds, so the final set has no layer that can be dropped from it. The budget is counted
from ``QuantizeConfig.reference_metric`` when given: the build passes the unpruned model's top-1
after pruning, so pruning and INT8 together stay within one budget. Kept-out layers are
recorded in the bundle's precision plan as FP16 layers: TensorRT runs them in FP16 on the board.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import CalibrationError, ConfigError, InternalError, QuantizationError
from agent.fsutil import atomic_write_bytes
from models.calibration import CalibrationReader, CalibrationSet
from models.onnx_model import graph_links
from models.ort import create_session

log = logging.getLogger(__name__)

CALIBRATION_METHODS = ("entropy", "percentile", "minmax")
# Layers the mixed-precision search may keep out of INT8: the ones that carry the arithmetic.
CANDIDATE_OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add")


@dataclass(frozen=True)
class QuantizeConfig:
    method: str = "entropy"
    percentile: float = 99.999
    accuracy_budget: float = 1.0  # points of the metric (top-1 or agreement, in percent)
    # What the budget is counted from: the original model's metric when the model being quantized
    # is already a derivative of it (pruned and fine-tuned), so that pruning and INT8 share one
    # budget. None: the float model being quantized.
    reference_metric: float | None = None
    batch_size: int = 32
    sensitivity_samples: int = 256
    progress: bool = True

    def __post_init__(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise ConfigError(
                "unknown calibration method", found=self.method, expected="|".join(CALIBRATION_METHODS)
            )
        if not 0.0 <= self.accuracy_budget <= 100.0:
            raise ConfigError("accuracy budget must be in [0, 100] points", found=self.accuracy_budget)
        if self.reference_metric is not None and not 0.0 <= self.reference_metric <= 100.0:
            raise ConfigError("reference metric must be in [0, 100] points",
                              found=self.reference_metric)
        if not 90.0 < self.percentile <= 100.0:
            raise ConfigError("percentile must be in (90, 100]", found=self.percentile)


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    """Run a block in ``path`` (builds are single-threaded where this is used)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def finite_or_none(value: float, digits: int) -> float | None:
    """``value`` rounded, or None (JSON null) where it is not finite: an SQNR is infinite when
    the INT8 output equals the float one (nothing quantized on its path), and an output holding
    infinities gives NaN; JSON has neither."""
    return round(value, digits) if np.isfinite(value) else None


@dataclass(frozen=True)
class LayerSensitivity:
    name: str
    op_type: str
    sqnr_db: float
    cosine: float
    metric: float  # top-1 or agreement with only this layer in INT8

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op_type": self.op_type,
            "sqnr_db": finite_or_none(self.sqnr_db, 2),
            "cosine": finite_or_none(self.cosine, 6),
            "metric": round(self.metric, 3),
        }


@dataclass(frozen=True)
class OutputFidelity:
    """How closely one output of the INT8 model follows the FP32 model's."""

    name: str
    sqnr_db: float
    cosine: float
    judged: bool  # the accuracy budget was held on this output

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sqnr_db": finite_or_none(self.sqnr_db, 2),
            "cosine": finite_or_none(self.cosine, 6),
            "judged_by_budget": self.judged,
        }


# Below this an output's quantization noise is over a tenth of its power: worth a warning when
# the budget did not look at that output.
POOR_OUTPUT_SQNR_DB = 10.0


@dataclass
class QuantizeResult:
    model_bytes: bytes
    metric_name: str
    float_metric: float
    full_int8_metric: float
    int8_metric: float
    int8_layers: list[str]
    fp16_layers: list[str]
    sensitivity: list[LayerSensitivity]
    search_trace: list[dict[str, Any]]
    calibration: dict[str, Any]
    node_counts: dict[str, int]
    reference_metric: float  # what the budget was counted from (see QuantizeConfig)
    seconds: dict[str, float] = field(default_factory=dict)
    # Every output of the final model against FP32 (see output_fidelity); the budget judges
    # only the first.
    outputs: list[OutputFidelity] = field(default_factory=list)
    metric_description: str = ""  # how the metric compares outputs (Evaluator.metric_description)

    @property
    def drop(self) -> float:
        """What INT8 cost against the float model it was given."""
        return self.float_metric - self.int8_metric

    @property
    def budget_drop(self) -> float:
        """The drop the budget was held to: from the reference (the unpruned model, if pruned)."""
        return self.reference_metric - self.int8_metric

    def precision_plan(self) -> dict[str, list[str]]:
        return {"int8_layers": self.int8_layers, "fp16_layers": self.fp16_layers, "fp32_layers": []}


@dataclass(frozen=True)
class Judgement:
    """How outputs are compared with the FP32 model's when there are no labels.

    ``kind``:
        - ``"classes"``: the class (argmax over ``class_axis``) of each sample, and of each position
          for dense outputs such as segmentation maps (N x C x H x W, or N x H x W x C);
        - ``"binary"``: one channel (a single logit or probability, a binary mask): the decision
          ``output > threshold`` (0 for logits, 0.5 for probabilities in [0, 1]) of each sample
          and position;
        - ``"values"``: one channel with no decision in it (every FP32 output on one side of the
          threshold: depth, a score): 100 x (1 - the relative L2 error), so a 1-point budget
          allows 1% error (about 40 dB SQNR).
    """

    kind: str
    class_axis: int = 1
    threshold: float = 0.0

    @classmethod
    def of(cls, reference: np.ndarray, class_axis: int = 1) -> Judgement:
        """The judgement that suits FP32 outputs ``reference`` whose classes lie on ``class_axis``."""
        if reference.ndim >= 2:
            class_axis = class_axis % reference.ndim
            if class_axis == 0:
                raise InternalError("the class axis cannot be the batch axis")
            if reference.shape[class_axis] > 1:
                return cls("classes", class_axis)
        # One value per sample (N, or N x 1) or per position: a decision, or just values.
        finite = reference[np.isfinite(reference)]
        probabilities = finite.size > 0 and finite.min() >= 0.0 and finite.max() <= 1.0
        threshold = 0.5 if probabilities else 0.0
        decisions = reference > threshold
        if decisions.all() or not decisions.any():
            return cls("values", class_axis)
        return cls("binary", class_axis, threshold)

    def describe(self) -> str:
        if self.kind == "classes":
            return f"agreement of the class (argmax over axis {self.class_axis})"
        if self.kind == "binary":
            return f"agreement of the decision output > {self.threshold:g} (one channel)"
        return "100 x (1 - relative L2 error) against FP32 (one channel, no decision in it)"


class Evaluator:
    """Scores a model on fixed samples: top-1 against labels, or agreement with FP32 outputs.

    Args:
        inputs: Input name to an N x ... array.
        labels: Integer labels; ``None`` means "no labels": outputs are compared with
            ``reference`` (the FP32 model's outputs) as ``judgement`` says (by default the one
            :meth:`Judgement.of` picks, with classes on ``class_axis``).
    """

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        labels: np.ndarray | None = None,
        reference: np.ndarray | None = None,
        batch_size: int = 128,
        threads: int = 2,
        *,
        class_axis: int = 1,
        judgement: Judgement | None = None,
    ) -> None:
        if labels is None and reference is None:
            raise InternalError("an evaluator needs labels or reference outputs")
        self.inputs = inputs
        self.labels = labels
        self.reference = reference
        self.batch_size = batch_size
        self.threads = threads
        self.judgement = judgement
        if labels is None and judgement is None:
            assert reference is not None  # checked above
            self.judgement = Judgement.of(reference, class_axis)

    @property
    def metric_name(self) -> str:
        if self.labels is not None:
            return "top1"
        return "fidelity" if self._kind == "values" else "agreement"

    @property
    def metric_description(self) -> str:
        if self.labels is not None or self.judgement is None:
            return "top-1 against the labels"
        return self.judgement.describe()

    @property
    def _kind(self) -> str | None:
        return None if self.labels is not None or self.judgement is None else self.judgement.kind

    def outputs(self, model_bytes: bytes, *, fold_relu: bool = False) -> np.ndarray:
        """First output of the model for every sample (``fold_relu``: as ONNX Runtime serves it,
        see :func:`model_outputs`)."""
        return model_outputs(model_bytes, self.inputs, self.batch_size, fold_relu=fold_relu,
                             threads=self.threads)

    @property
    def dense(self) -> bool:
        """Judged by agreement at every position of dense outputs (e.g. segmentation maps, or a
        binary mask), not once per sample."""
        return (self._kind in ("classes", "binary") and self.reference is not None
                and self.reference.ndim > 2)

    @property
    def predictions(self) -> int:
        """How many predictions a score counts: one per sample, or one per sample and position
        for dense outputs (0 when outputs are judged by their values)."""
        if self._kind == "values":
            return 0
        if self.dense:
            assert self.reference is not None and self.judgement is not None  # dense says so
            positions = [size for axis, size in enumerate(self.reference.shape)
                         if axis not in (0, self.judgement.class_axis)]
            return int(self.reference.shape[0] * np.prod(positions))
        return len(next(iter(self.inputs.values())))

    def score(self, outputs: np.ndarray) -> float:
        if self.labels is not None:
            return float((top1_classes(outputs) == self.labels).mean() * 100.0)
        assert self.reference is not None and self.judgement is not None  # set in __init__
        judgement, reference = self.judgement, self.reference
        if outputs.shape != reference.shape:
            raise InternalError(f"outputs {list(outputs.shape)} and the FP32 reference "
                                f"{list(reference.shape)} differ in shape")
        if judgement.kind == "values":
            error = float(np.linalg.norm((outputs.astype(np.float64) - reference).ravel()))
            signal = float(np.linalg.norm(reference.astype(np.float64).ravel()))
            if not np.isfinite(error):
                return 0.0
            return float(max(0.0, 100.0 * (1.0 - error / signal))) if signal else (
                100.0 if error == 0.0 else 0.0)
        if judgement.kind == "binary":
            agree = (outputs > judgement.threshold) == (reference > judgement.threshold)
            return float(agree.mean() * 100.0)
        # One argmax over the flattened C x H x W would compare a single pixel per sample.
        agree = outputs.argmax(axis=judgement.class_axis) == reference.argmax(
            axis=judgement.class_axis)
        return float(agree.mean() * 100.0)

    def __call__(self, model_bytes: bytes) -> float:
        return self.score(self.outputs(model_bytes))


def model_outputs(model_bytes: bytes, inputs: dict[str, np.ndarray], batch_size: int = 128, *,
                  fold_relu: bool = False, threads: int = 2) -> np.ndarray:
    """The model's first output for every sample of ``inputs``, run in batches.

    Accuracy is judged on the QDQ model exactly as the bundle carries it (and TensorRT runs it),
    so ONNX Runtime's ReLU folding is off by default: that speed rewrite for the CPU quantizes
    post-ReLU tensors at a finer step than the model (:mod:`models.ort_relu`), which moves a few
    predictions (the demo bundle: 2 of 1,797 digits). ``fold_relu=True`` gives the outputs as the
    daemon's ONNX Runtime backend serves them.
    """
    outputs = all_model_outputs(model_bytes, inputs, batch_size, fold_relu=fold_relu,
                                threads=threads, first_only=True)
    return next(iter(outputs.values()))


def all_model_outputs(model_bytes: bytes, inputs: dict[str, np.ndarray], batch_size: int = 128,
                      *, fold_relu: bool = False, threads: int = 2,
                      first_only: bool = False) -> dict[str, np.ndarray]:
    """Every output of the model by name (in the graph's order) for every sample of ``inputs``."""
    session = create_session(model_bytes, fold_relu=fold_relu, threads=threads)
    names = [output.name for output in session.get_outputs()]
    if first_only:
        names = names[:1]
    count = next(iter(inputs.values())).shape[0]
    parts: list[list[np.ndarray]] = [[] for _ in names]
    for start in range(0, count, batch_size):
        feed = {name: array[start : start + batch_size] for name, array in inputs.items()}
        for part, value in zip(parts, session.run(names, feed)):
            part.append(value)
    return {name: np.concatenate(part, axis=0) for name, part in zip(names, parts)}


def warn_about_unjudged_outputs(outputs: Sequence[OutputFidelity]) -> None:
    """Warn about outputs the budget did not judge that INT8 left far from FP32."""
    for output in outputs:
        if not output.judged and output.sqnr_db < POOR_OUTPUT_SQNR_DB:
            log.warning("output %r follows FP32 poorly in INT8 (SQNR %.1f dB, cosine %.4f) and the "
                        "accuracy budget judges only the first output: check it on your data, or "
                        "keep the layers that feed it out of INT8", output.name, output.sqnr_db,
                        output.cosine)


def output_fidelity(float_model: bytes, int8_model: bytes, inputs: dict[str, np.ndarray],
                    threads: int = 2) -> list[OutputFidelity]:
    """SQNR and cosine of every output of ``int8_model`` against ``float_model`` on ``inputs``.

    The accuracy budget scores the first output only; for a model with several (boxes and
    scores, logits and embeddings) this is what shows whether the others survived INT8.
    """
    reference = all_model_outputs(float_model, inputs, threads=threads)
    quantized = all_model_outputs(int8_model, inputs, threads=threads)
    return [
        OutputFidelity(name, sqnr_db(want, quantized[name]), cosine_similarity(want, quantized[name]),
                       judged=index == 0)
        for index, (name, want) in enumerate(reference.items())
    ]


def top1_classes(outputs: np.ndarray) -> np.ndarray:
    """Predicted class per sample; outputs beyond 2-D are flattened per sample."""
    return outputs.reshape(outputs.shape[0], -1).argmax(axis=1)


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``reference``, in dB."""
    noise = float(np.sum((reference.astype(np.float64) - test) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    if noise == 0.0:
        return float("inf")
    return 10.0 * float(np.log10(max(signal, 1e-30) / noise))


def cosine_similarity(reference: np.ndarray, test: np.ndarray) -> float:
    a = reference.reshape(reference.shape[0], -1).astype(np.float64)
    b = test.reshape(test.shape[0], -1).astype(np.float64)
    numerator = np.sum(a * b, axis=1)
    denominator = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(numerator / np.maximum(denominator, 1e-30)))


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
        # Shape inference and basic graph optimisation, as ONNX Runtime recommends before QDQ.
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
        reader = CalibrationReader(self.calibration, self.config.batch_size, self.config.progress)
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


def measure_sensitivity(
    quantizer: QdqQuantizer,
    evaluator: Evaluator,
    float_outputs: np.ndarray,
    progress: bool = False,
) -> list[LayerSensitivity]:
    """Quantize each candidate layer alone; most sensitive (lowest output SQNR) first."""
    results = []
    layers = quantizer.candidates
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="layer sensitivity", unit="layer", leave=False)
    for name, op_type in layers:
        outputs = evaluator.outputs(quantizer.quantize(only=[name]))
        results.append(
            LayerSensitivity(
                name=name,
                op_type=op_type,
                sqnr_db=sqnr_db(float_outputs, outputs),
                cosine=cosine_similarity(float_outputs, outputs),
                metric=evaluator.score(outputs),
            )
        )
    results.sort(key=lambda layer: (layer.sqnr_db, layer.name))
    return results


def search_mixed_precision(
    quantizer: QdqQuantizer,
    evaluator: Evaluator,
    reference_metric: float,
    ranking: Sequence[str],
    budget: float,
) -> tuple[list[str], bytes, float, list[dict[str, Any]]]:
    """Find a minimal set of layers to keep out of INT8 so that ``reference_metric`` minus the
    metric is at most ``budget``.

    Returns:
        (kept-out layers, their QDQ model, its metric, a trace of every evaluation).
    """
    trace: list[dict[str, Any]] = []

    def evaluate(excluded: list[str]) -> tuple[bytes, float]:
        model_bytes = quantizer.quantize(exclude=excluded)
        metric = evaluator(model_bytes)
        trace.append({"fp16_layers": list(excluded), "metric": round(metric, 3)})
        log.info(
            "mixed precision: %2d layer(s) kept out of INT8 -> %s %.2f (drop %.2f, budget %.2f)",
            len(excluded),
            evaluator.metric_name,
            metric,
            reference_metric - metric,
            budget,
        )
        return model_bytes, metric

    excluded: list[str] = []
    model_bytes, metric = evaluate(excluded)
    for name in ranking:
        if reference_metric - metric <= budget:
            break
        excluded.append(name)
        model_bytes, metric = evaluate(excluded)
    if reference_metric - metric > budget:
        raise QuantizationError(
            "accuracy budget not met even with every candidate layer kept out of INT8",
            budget=budget,
            drop=round(reference_metric - metric, 3),
        )
    # Backward pass: put layers back into INT8 while the budget still holds (least sensitive first).
    for name in list(reversed(excluded[:-1])) if len(excluded) > 1 else []:
        trial = [layer for layer in excluded if layer != name]
        trial_bytes, trial_metric = evaluate(trial)
        if reference_metric - trial_metric <= budget:
            excluded, model_bytes, metric = trial, trial_bytes, trial_metric
    return excluded, model_bytes, metric, trace


def warn_if_too_few_predictions(evaluator: Evaluator, budget: float) -> None:
    """Warn when one changed prediction already costs more than the budget."""
    predictions = evaluator.predictions
    if predictions and 100.0 / predictions > budget:
        counted = "sample positions" if evaluator.dense else "samples"
        log.warning("with %d evaluation %s one changed prediction costs %.2f points, more "
                    "than the %.2f-point budget: only models that change no prediction pass, "
                    "which may keep many layers out of INT8 (give more samples, or a larger "
                    "--accuracy-budget)", predictions, counted, 100.0 / predictions, budget)


def quantize_model(
    float_model: bytes,
    calibration: CalibrationSet,
    evaluator: Evaluator,
    config: QuantizeConfig,
    workdir: Path,
) -> QuantizeResult:
    """Calibrate, measure per-layer sensitivity, and find the mixed-precision plan (see module)."""
    onnx = require("onnx", extra="host", purpose="INT8 quantization")
    from models.export import node_counts

    timings: dict[str, float] = {}
    started = time.perf_counter()
    float_outputs = evaluator.outputs(float_model)
    float_metric = evaluator.score(float_outputs)
    reference = float_metric if config.reference_metric is None else config.reference_metric
    if reference - float_metric > config.accuracy_budget:
        raise QuantizationError(
            "the float model is already further below the reference than the accuracy budget "
            "allows, before any INT8 (prune less, or fine-tune longer)",
            reference=round(reference, 3),
            float_metric=round(float_metric, 3),
            budget=config.accuracy_budget,
        )
    warn_if_too_few_predictions(evaluator, config.accuracy_budget)
    quantizer = QdqQuantizer(float_model, calibration, config, workdir)

    full_int8 = quantizer.quantize()
    timings["calibration_s"] = quantizer.calibration_seconds
    full_outputs = evaluator.outputs(full_int8)
    full_metric = evaluator.score(full_outputs)
    log.info(
        "calibrated %d samples (%s) in %.1f s; fully INT8 %s %.2f vs FP32 %.2f",
        len(calibration),
        config.method,
        quantizer.calibration_seconds,
        evaluator.metric_name,
        full_metric,
        float_metric,
    )

    sensitivity_started = time.perf_counter()
    sensitivity_evaluator = _subset(evaluator, config.sensitivity_samples)
    sensitivity = measure_sensitivity(
        quantizer,
        sensitivity_evaluator,
        sensitivity_evaluator.outputs(float_model),
        progress=config.progress,
    )
    timings["sensitivity_s"] = time.perf_counter() - sensitivity_started

    search_started = time.perf_counter()
    fp16_layers, model_bytes, metric, trace = search_mixed_precision(
        quantizer,
        evaluator,
        reference,
        [layer.name for layer in sensitivity],
        config.accuracy_budget,
    )
    timings["search_s"] = time.perf_counter() - search_started
    outputs = output_fidelity(float_model, model_bytes, sensitivity_evaluator.inputs,
                              threads=evaluator.threads)
    warn_about_unjudged_outputs(outputs)
    timings["total_s"] = time.perf_counter() - started
    if fp16_layers and len(fp16_layers) == len(quantizer.candidates):
        log.warning("no layer could run in INT8 within the accuracy budget: the bundle's model "
                    "is FP16 throughout (%d layers)", len(fp16_layers))
    return QuantizeResult(
        model_bytes=model_bytes,
        metric_name=evaluator.metric_name,
        metric_description=evaluator.metric_description,
        float_metric=float_metric,
        full_int8_metric=full_metric,
        int8_metric=metric,
        int8_layers=quantized_layers(model_bytes, kept_out=set(fp16_layers)),
        fp16_layers=fp16_layers,
        sensitivity=sensitivity,
        search_trace=trace,
        calibration=calibration.to_manifest(config.method),
        node_counts=node_counts(onnx.load_from_string(model_bytes)),
        reference_metric=reference,
        seconds=timings,
        outputs=outputs,
    )


def _subset(evaluator: Evaluator, samples: int) -> Evaluator:
    inputs = {name: array[:samples] for name, array in evaluator.inputs.items()}
    labels = evaluator.labels[:samples] if evaluator.labels is not None else None
    reference = evaluator.reference[:samples] if evaluator.reference is not None else None
    return Evaluator(inputs, labels, reference, evaluator.batch_size, evaluator.threads,
                     judgement=evaluator.judgement)
