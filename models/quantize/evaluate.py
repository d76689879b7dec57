"""How a model is judged against the FP32 one: its score (top-1 against labels, or agreement
with the FP32 outputs without them) and the fidelity measures (SQNR, cosine) the INT8 search
ranks layers by and reports per output.

Models run through ONNX Runtime's CPU provider (:func:`model_outputs`), as the QDQ model is
written, so the score is the one the bundle's model earns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.errors import InternalError
from models.ort import create_session

log = logging.getLogger(__name__)


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
        fixed_batch, batch_axes: How the model takes and returns batches, passed to
            :func:`all_model_outputs` (outputs are always compared batch first).
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
        fixed_batch: int | None = None,
        batch_axes: dict[str, int] | None = None,
    ) -> None:
        if labels is None and reference is None:
            raise InternalError("an evaluator needs labels or reference outputs")
        self.inputs = inputs
        self.labels = labels
        self.reference = reference
        self.batch_size = batch_size
        self.threads = threads
        self.judgement = judgement
        self.fixed_batch = fixed_batch
        self.batch_axes = batch_axes
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
                             threads=self.threads, fixed_batch=self.fixed_batch,
                             batch_axes=self.batch_axes)

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


def warn_about_unjudged_outputs(outputs: Sequence[OutputFidelity]) -> None:
    """Warn about outputs the budget did not judge that INT8 left far from FP32."""
    for output in outputs:
        if not output.judged and output.sqnr_db < POOR_OUTPUT_SQNR_DB:
            log.warning("output %r follows FP32 poorly in INT8 (SQNR %.1f dB, cosine %.4f) and the "
                        "accuracy budget judges only the first output: check it on your data, or "
                        "keep the layers that feed it out of INT8", output.name, output.sqnr_db,
                        output.cosine)


def output_fidelity(float_model: bytes, int8_model: bytes, inputs: dict[str, np.ndarray],
                    threads: int = 2, *, fixed_batch: int | None = None,
                    batch_axes: dict[str, int] | None = None) -> list[OutputFidelity]:
    """SQNR and cosine of every output of ``int8_model`` against ``float_model`` on ``inputs``
    (``fixed_batch``, ``batch_axes``: see :func:`all_model_outputs`).

    The accuracy budget scores the first output only; for a model with several (boxes and
    scores, logits and embeddings) this is what shows whether the others survived INT8.
    """
    reference = all_model_outputs(float_model, inputs, threads=threads, fixed_batch=fixed_batch,
                                  batch_axes=batch_axes)
    quantized = all_model_outputs(int8_model, inputs, threads=threads, fixed_batch=fixed_batch,
                                  batch_axes=batch_axes)
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
