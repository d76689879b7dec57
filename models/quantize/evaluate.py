"""How a model is judged against the FP32 one: every output by the judge that suits it
(:mod:`models.quantize.judges`), over samples held out from calibration (or against labels), and
the fidelity measures (SQNR, cosine) the INT8 search ranks layers by and reports per output.

Models run through ONNX Runtime's CPU provider (:func:`all_model_outputs`), as the QDQ model is
written, so the scores are the ones the bundle's model earns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.errors import InternalError
from models.ort import create_session
from models.quantize.judges import CustomJudge, Judge, OutputJudge, choose_judges
from models.quantize.measures import cosine_score, sqnr_db

log = logging.getLogger(__name__)


def finite_or_none(value: float, digits: int) -> float | None:
    """``value`` rounded, or None (JSON null) where it is not finite: an SQNR is infinite when
    the INT8 output equals the float one (nothing quantized on its path), and an output holding
    infinities gives NaN; JSON has neither."""
    return round(value, digits) if np.isfinite(value) else None


@dataclass(frozen=True)
class LayerSensitivity:
    """How much INT8 in this layer alone moves the model's outputs: the worst held output's SQNR
    (``output``) and its cosine."""

    name: str
    op_type: str
    sqnr_db: float
    cosine: float
    output: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op_type": self.op_type,
            "sqnr_db": finite_or_none(self.sqnr_db, 2),
            "cosine": finite_or_none(self.cosine, 6),
            "worst_output": self.output,
        }


@dataclass(frozen=True)
class OutputFidelity:
    """How closely one output of the INT8 model follows the FP32 model's."""

    name: str
    sqnr_db: float
    cosine: float
    judged: bool  # a held judge looked at this output

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sqnr_db": finite_or_none(self.sqnr_db, 2),
            "cosine": finite_or_none(self.cosine, 6),
            "judged_by_budget": self.judged,
        }


# Below this an output's quantization noise is over a tenth of its power: worth a warning when
# no held judge looked at that output.
POOR_OUTPUT_SQNR_DB = 10.0
# Scores are compared with their limits with this slack, so that a drop of exactly the budget
# (2 flips of 200 against a 1-point budget) passes despite rounding.
_SLACK = 1e-9


@dataclass(frozen=True)
class Verdict:
    """Every judge's score of one candidate and whether each holds its tolerance."""

    scores: tuple[float, ...]
    passed: tuple[bool, ...]

    @property
    def ok(self) -> bool:
        return all(self.passed)

    @property
    def primary(self) -> float:
        return self.scores[0]


class Evaluator:
    """Judges a model's outputs on fixed samples, every output by its own judge.

    Args:
        inputs: Input name to an N x ... array (the judged samples).
        labels: Integer labels of the samples: the first output is judged by top-1 against them.
        reference: The FP32 model's outputs on ``inputs``, by name in the graph's order; the
            other outputs are judged against them. ``None`` (with labels only): only the first
            output's top-1 is known until :meth:`with_reference` is given the FP32 outputs.
        judges: One per output (and the user's evaluator, first); default: as
            :func:`~models.quantize.judges.choose_judges` picks from the outputs' shapes and
            values (a 4-D output's classes on ``class_axis``).
        fixed_batch, batch_axes: How the model takes and returns batches, passed to
            :func:`all_model_outputs` (outputs are always compared batch first).
    """

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        labels: np.ndarray | None = None,
        reference: Mapping[str, np.ndarray] | None = None,
        batch_size: int = 128,
        threads: int = 2,
        *,
        judges: Sequence[Judge] | None = None,
        class_axis: int = 1,
        fixed_batch: int | None = None,
        batch_axes: dict[str, int] | None = None,
    ) -> None:
        if labels is None and reference is None:
            raise InternalError("an evaluator needs labels or reference outputs")
        if reference is not None and not isinstance(reference, Mapping):
            raise InternalError("reference outputs are a dict of output name to array")
        self.inputs = inputs
        self.labels = labels
        self.reference = dict(reference) if reference is not None else None
        self.batch_size = batch_size
        self.threads = threads
        self.fixed_batch = fixed_batch
        self.batch_axes = batch_axes
        if judges is not None:
            self.judges: list[Judge] = list(judges)
        elif self.reference is not None:
            self.judges = choose_judges(self.reference, labels=labels is not None,
                                        class_axis=class_axis)
        else:
            self.judges = [OutputJudge("", "top1", "labels given: top-1 of the first output")]
        if not self.judges:
            raise InternalError("an evaluator needs at least one judge")

    @property
    def samples(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    @property
    def primary(self) -> Judge:
        """The judge whose score is the build's headline metric: the user's evaluator, else
        top-1 against the labels, else the first output's judge."""
        return self.judges[0]

    @property
    def metric_name(self) -> str:
        kind = self.primary.kind
        return "agreement" if kind in ("classes", "decision", "exact") else kind

    @property
    def metric_description(self) -> str:
        return str(self.primary.describe())

    @property
    def custom(self) -> CustomJudge | None:
        return next((judge for judge in self.judges if isinstance(judge, CustomJudge)), None)

    def with_reference(self, reference: Mapping[str, np.ndarray]) -> Evaluator:
        """This evaluator with the FP32 outputs ``reference`` to judge against (itself when it has
        them already): every output gets its judge."""
        if self.reference is not None:
            return self
        return Evaluator(self.inputs, self.labels, reference, self.batch_size, self.threads,
                         fixed_batch=self.fixed_batch, batch_axes=self.batch_axes)

    def subset(self, samples: int) -> Evaluator:
        """The same judges on the first ``samples`` samples."""
        if samples >= self.samples:
            return self
        inputs = {name: array[:samples] for name, array in self.inputs.items()}
        labels = self.labels[:samples] if self.labels is not None else None
        reference = ({name: array[:samples] for name, array in self.reference.items()}
                     if self.reference is not None else None)
        return Evaluator(inputs, labels, reference, self.batch_size, self.threads,
                         judges=self.judges, fixed_batch=self.fixed_batch,
                         batch_axes=self.batch_axes)

    def outputs(self, model_bytes: bytes, *, fold_relu: bool = False) -> dict[str, np.ndarray]:
        """Every output of the model for every sample (``fold_relu``: as ONNX Runtime serves it,
        see :func:`model_outputs`)."""
        return all_model_outputs(model_bytes, self.inputs, self.batch_size, fold_relu=fold_relu,
                                 threads=self.threads, fixed_batch=self.fixed_batch,
                                 batch_axes=self.batch_axes)

    def scores(self, outputs: Mapping[str, np.ndarray]) -> tuple[float, ...]:
        """Every judge's score of ``outputs`` (all of the model's, by name)."""
        reference = self.reference if self.reference is not None else {}
        return tuple(judge.score(reference, outputs, self.labels) for judge in self.judges)

    def score(self, outputs: Mapping[str, np.ndarray]) -> float:
        """The primary judge's score of ``outputs``."""
        return float(self.primary.score(self.reference or {}, outputs, self.labels))

    def baseline(self) -> tuple[float, ...]:
        """The FP32 model's scores: 100 for agreement with itself, a cosine of 1, its top-1 and
        its score by the user's evaluator."""
        if self.reference is None:
            raise InternalError("the baseline needs the FP32 outputs (with_reference)")
        return self.scores(self.reference)

    def verdict(self, scores: Sequence[float], baseline: Sequence[float], budget: float,
                reference_metric: float | None = None) -> Verdict:
        """Whether each held judge's score is within its tolerance: a drop from ``baseline`` of
        at most its tolerance (``budget`` by default; a primary top-1's drop counted from
        ``reference_metric`` when given, the unpruned model's top-1 after pruning), or at
        least its minimum."""
        passed = []
        for index, (judge, score, base) in enumerate(zip(self.judges, scores, baseline)):
            if not judge.held:
                passed.append(True)
            elif judge.agreement:
                start = base
                if reference_metric is not None and index == 0 and judge.kind == "top1":
                    start = reference_metric
                limit = budget if judge.tolerance is None else judge.tolerance
                passed.append(start - score <= limit + _SLACK)
            else:
                minimum = judge.tolerance
                if minimum is None:
                    raise InternalError(f"fidelity judge {judge.name!r} has no minimum")
                passed.append(score >= minimum - _SLACK)
        return Verdict(tuple(float(score) for score in scores), tuple(passed))

    def predictions(self, judge: Judge) -> int:
        """How many predictions an agreement judge counts (0 for others): one per sample, per
        position for class maps, per value for decisions and exact agreement."""
        if not isinstance(judge, OutputJudge) or not judge.agreement:
            return 0
        if judge.kind == "top1" or self.reference is None:
            return self.samples
        shape = next(iter(self.reference.values())).shape if not judge.name else \
            self.reference[judge.name].shape
        if judge.kind == "classes" and judge.axis is not None:
            return int(np.prod([size for axis, size in enumerate(shape) if axis != judge.axis]))
        if judge.kind == "decision" and judge.dense:
            # An F1 counts the positions above the threshold (FP32's, at least).
            want = self.reference[judge.name] if judge.name else next(iter(self.reference.values()))
            return int(np.count_nonzero(want > judge.threshold))
        return int(np.prod(shape))

    def __call__(self, model_bytes: bytes) -> float:
        """The primary judge's score of the model."""
        return self.score(self.outputs(model_bytes))


def model_outputs(model_bytes: bytes, inputs: dict[str, np.ndarray], batch_size: int = 128, *,
                  fold_relu: bool = False, threads: int = 2, fixed_batch: int | None = None,
                  batch_axes: dict[str, int] | None = None) -> np.ndarray:
    """The model's first output for every sample of ``inputs``, run in batches (batch first;
    ``fixed_batch`` and ``batch_axes`` as for :func:`all_model_outputs`).

    Accuracy is judged on the QDQ model exactly as the bundle carries it (and TensorRT runs it),
    so ONNX Runtime's ReLU folding is off by default: that speed rewrite for the CPU quantizes
    post-ReLU tensors at a finer step than the model (:mod:`models.ort_relu`), which moves a few
    predictions (the demo bundle: 2 of 1,797 digits). ``fold_relu=True`` gives the outputs as the
    daemon's ONNX Runtime backend serves them.
    """
    outputs = all_model_outputs(model_bytes, inputs, batch_size, fold_relu=fold_relu,
                                threads=threads, first_only=True, fixed_batch=fixed_batch,
                                batch_axes=batch_axes)
    return next(iter(outputs.values()))


def all_model_outputs(model_bytes: bytes, inputs: dict[str, np.ndarray], batch_size: int = 128,
                      *, fold_relu: bool = False, threads: int = 2, first_only: bool = False,
                      fixed_batch: int | None = None, batch_axes: dict[str, int] | None = None
                      ) -> dict[str, np.ndarray]:
    """Every output of the model by name (in the graph's order) for every sample of ``inputs``,
    each with the batch on axis 0.

    Args:
        fixed_batch: The one batch size the model's graph runs at (see models.batch_axis), or
            None for any: samples then run in chunks of exactly that many rows, the last chunk
            padded with copies of its last sample, and the padding rows' outputs dropped.
        batch_axes: Output name to the axis that follows the input batch (default 0, for names
            not given): results are cut and joined on it, and returned with it moved to axis 0
            (a ``[T, B, C]`` output comes back as ``[B, T, C]``).
    """
    session = create_session(model_bytes, fold_relu=fold_relu, threads=threads)
    names = [output.name for output in session.get_outputs()]
    if first_only:
        names = names[:1]
    axes = batch_axes or {}
    count = next(iter(inputs.values())).shape[0]
    chunk = fixed_batch or batch_size
    parts: list[list[np.ndarray]] = [[] for _ in names]
    for start in range(0, count, chunk):
        feed = {name: array[start : start + chunk] for name, array in inputs.items()}
        rows = min(chunk, count - start)
        if fixed_batch is not None and rows < fixed_batch:
            padding = np.full(fixed_batch - rows, rows - 1)
            feed = {name: np.concatenate([array, array[padding]]) for name, array in feed.items()}
        for part, name, value in zip(parts, names, session.run(names, feed)):
            part.append(np.moveaxis(value, axes.get(name, 0), 0)[:rows])
    return {name: np.concatenate(part, axis=0) for name, part in zip(names, parts)}


def fidelity(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
             judged: set[str]) -> list[OutputFidelity]:
    """SQNR and cosine of every output of ``candidate`` against ``reference`` (``judged``: the
    outputs a held judge looks at)."""
    return [OutputFidelity(name, sqnr_db(want, candidate[name]), cosine_score(want, candidate[name]),
                           judged=name in judged)
            for name, want in reference.items()]


def output_fidelity(float_model: bytes, int8_model: bytes, inputs: dict[str, np.ndarray],
                    threads: int = 2, *, fixed_batch: int | None = None,
                    batch_axes: dict[str, int] | None = None) -> list[OutputFidelity]:
    """SQNR and cosine of every output of ``int8_model`` against ``float_model`` on ``inputs``
    (each marked judged: without judges, each is what it is compared by; ``fixed_batch``,
    ``batch_axes``: see :func:`all_model_outputs`)."""
    reference = all_model_outputs(float_model, inputs, threads=threads, fixed_batch=fixed_batch,
                                  batch_axes=batch_axes)
    quantized = all_model_outputs(int8_model, inputs, threads=threads, fixed_batch=fixed_batch,
                                  batch_axes=batch_axes)
    return fidelity(reference, quantized, set(reference))


def warn_about_unjudged_outputs(outputs: Sequence[OutputFidelity]) -> list[str]:
    """Warn about outputs no held judge looked at that INT8 left far from FP32; returns the
    warnings."""
    warnings = []
    for output in outputs:
        if not output.judged and output.sqnr_db < POOR_OUTPUT_SQNR_DB:
            warnings.append(f"output {output.name!r} follows FP32 poorly in INT8 (SQNR "
                            f"{output.sqnr_db:.1f} dB, cosine {output.cosine:.4f}) and no held "
                            "judge looks at it: check it on your data, or hold it with "
                            f"--output-metric {output.name}=cosine")
            log.warning("%s", warnings[-1])
    return warnings
