"""How each output of a model is judged against the FP32 model's outputs.

Every output gets a judge chosen by what it is (:func:`choose_judges`, the rules in order):

1. the user's choice for it (``--output-metric NAME=METRIC[:TOLERANCE]``, :class:`OutputMetric`);
2. with labels, the first output: top-1 against the labels;
3. integers (decoded indices, a class id): exact agreement of every value;
4. a Softmax or LogSoftmax in the graph (found walking back from the output through ops that
   keep its shape, and through Transposes, whose permutation moves the axis): the class on the
   softmax's axis, for every sample and position (N x C scores, N x T x C sequences,
   N x C x H x W maps);
5. a Sigmoid: probabilities, judged by their decisions (``> 0.5``); a ReLU: non-negative values
   with no decision at 0 (a heatmap, features), regression;
6. one channel (N, N x 1, N x 1 x H x W, ...): the decision ``> 0.5`` for values in [0, 1],
   ``> 0`` for logits;
7. in a model where rules 3-5 told another output's kind (its class scores are there), the
   outputs they did not tell are regression: boxes, offsets, landmarks, embeddings;
8. an output concatenated from heads (a Concat before it: boxes beside their scores) is
   regression too;
9. class scores without a softmax (unless a Reshape merged other axes into them): 2-D N x C,
   4-D maps in their layout (classes on the channel axis), and 3-D sequences out of a linear
   layer (classes on the last axis);
10. anything else is regression.

Decisions (rules 5, 6) need some FP32 values on each side of the threshold; where all are on one
side there is no decision to keep, and the output is judged as regression. One decision per
sample is judged by the share kept; decisions at every position (a text or segmentation mask) by
the F1 score of the positions above the threshold, since a mask that is empty almost everywhere
agrees at 99.9% of its positions even when INT8 loses every object in it. Regression is judged
by fidelity: the cosine of each sample's values (mean over samples; steadied for mostly-zero
maps, see :func:`~models.quantize.measures.cosine_score`), or the SQNR where a sample is one
value (the cosine of one number is its sign); an output a Concat joined from heads is measured
on each head and the worst counts (boxes in pixels beside scores in [0, 1]: a cosine of the
whole is the boxes', and INT8 rounding every score of a YOLOv8 head to zero left it at 0.9993).

Agreement judges (top-1, classes, decisions, exact, the user's evaluator) hold a drop of at most
the accuracy budget from the FP32 model's score; fidelity judges hold a minimum. The user's
evaluator (``--evaluator module:callable``, :class:`CustomJudge`) scores the candidate's outputs
against the FP32 outputs with a task metric (mAP, 100 - character error rate).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from agent.errors import ConfigError, InternalError, QuantizationError, first_line
from models.quantize.graph_facts import OutputFacts
from models.quantize.measures import (
    cosine_score,
    decision_f1,
    split_parts,
    sqnr_db,
    top1_classes,
)

log = logging.getLogger(__name__)

# Judges that count a share of predictions kept (points, 0-100) and hold a drop from FP32.
AGREEMENT_KINDS = ("top1", "classes", "decision", "exact", "evaluator")
# Judges that measure how close the values stay, and hold a minimum.
FIDELITY_KINDS = ("cosine", "sqnr")

# Fully INT8, the regression outputs of the published models this was checked on kept a mean
# cosine per sample of 0.9937 (a CRNN's logits, 19 dB) to 0.9996 (a YOLOX head's boxes, 30 dB);
# broken conversions fell to 0.81 (the CRNN calibrated on inputs 20 times too small) and 0.15
# (a YOLOv8 head's scores, all rounded to zero in the output's one INT8 range). 0.99 (about
# 17 dB) passes the former and fails the latter; the target for held-out samples is 0.98.
DEFAULT_MIN_COSINE = 0.99
DEFAULT_MIN_SQNR_DB = 20.0

# Metrics a user may name in --output-metric (see :class:`OutputMetric`).
USER_METRICS = ("agreement", "top1", "decision", "exact", "cosine", "sqnr", "ignore")

# --- the user's choices --------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputMetric:
    """The user's judge for one output: ``--output-metric NAME=METRIC[:TOLERANCE]``.

    Metrics (:data:`USER_METRICS`), and what the tolerance means:
        - ``agreement[:DROP]``: the agreement judge that suits the output (its class, its
          decision, exact for integers), at most DROP points below FP32 (default: the
          accuracy budget);
        - ``top1[:DROP]``: the class (argmax) on the softmax's axis, a 4-D output's channel
          axis, else the last axis, at every position; against the labels where given;
        - ``decision[:DROP]``: the decision ``> 0.5`` (values in [0, 1]) or ``> 0``;
        - ``exact[:DROP]``: every value equal;
        - ``cosine[:MIN]``: mean cosine per sample of at least MIN (default 0.99);
        - ``sqnr[:MIN]``: signal-to-quantization-noise ratio of at least MIN dB (default 20);
        - ``ignore``: reported, not held.
    """

    output: str
    metric: str
    tolerance: float | None = None

    def __post_init__(self) -> None:
        key = "--output-metric"
        if self.metric not in USER_METRICS:
            raise ConfigError(f"unknown output metric: choose one of {', '.join(USER_METRICS)}",
                              key=key, output=self.output, found=self.metric)
        value = self.tolerance
        if value is None:
            return
        if self.metric == "ignore":
            raise ConfigError("'ignore' takes no tolerance", key=key, output=self.output)
        if not math.isfinite(value):
            raise ConfigError("the tolerance must be a finite number", key=key,
                              output=self.output, found=value)
        if self.metric == "cosine" and not -1.0 <= value <= 1.0:
            raise ConfigError("a cosine tolerance is a minimum in [-1, 1]", key=key,
                              output=self.output, found=value)
        if self.metric in ("agreement", "top1", "decision", "exact") and not 0.0 <= value <= 100.0:
            raise ConfigError(f"a {self.metric} tolerance is the largest drop from FP32, in "
                              "[0, 100] points", key=key, output=self.output, found=value)

    @classmethod
    def parse(cls, text: str) -> OutputMetric:
        """``NAME=METRIC[:TOLERANCE]``; the name may hold ``:`` and ``=`` (``logits:0`` from
        TensorFlow exports): the metric follows the last ``=``."""
        name, sep, spec = text.rpartition("=")
        if not sep or not name or not spec:
            raise ConfigError("give --output-metric as NAME=METRIC[:TOLERANCE] (e.g. "
                              "boxes=cosine:0.99)", key="--output-metric", found=text)
        metric, sep, tolerance_text = spec.partition(":")
        tolerance = None
        if sep:
            try:
                tolerance = float(tolerance_text)
            except ValueError:
                raise ConfigError("the tolerance after ':' must be a number",
                                  key="--output-metric", found=text) from None
        return cls(name, metric.strip().lower(), tolerance)


# --- judges --------------------------------------------------------------------------------------


class Judge(Protocol):
    """What the evaluator needs of a judge: its name, kind, whether it is held, its tolerance
    (None: the accuracy budget), and its score of candidate outputs against FP32 ones."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def held(self) -> bool: ...

    @property
    def tolerance(self) -> float | None: ...

    @property
    def agreement(self) -> bool: ...

    def score(self, reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
              labels: np.ndarray | None) -> float: ...

    def describe(self) -> str: ...

    def limit_text(self, budget: float) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class OutputJudge:
    """How one output is judged (see the module docstring).

    Attributes:
        name: The output's name ("" with labels and no FP32 outputs yet: the first output).
        kind: One of :data:`AGREEMENT_KINDS` (but ``"evaluator"``) or :data:`FIDELITY_KINDS`.
        reason: Why this judge suits the output, for the report.
        axis: The class axis (``top1`` and ``classes``); for fidelity judges with ``parts``,
            the axis the parts lie along.
        threshold: The decision threshold (``decision``).
        dense: A decision at every position, judged by the F1 score of the positions above the
            threshold (:func:`~models.quantize.measures.decision_f1`), not their share.
        parts: Sizes along ``axis`` of the heads a Concat joined into the output (boxes beside
            class scores): fidelity is measured on each and the worst counts.
        tolerance: Largest drop in points (agreement) or minimum score (fidelity); None: the
            accuracy budget (agreement) or the default minimum (fidelity).
        held: Whether the build must meet the tolerance (``ignore``, or a user's evaluator
            deciding, make it a report only).
        chosen_by: ``"auto"`` or ``"--output-metric"``.
    """

    name: str
    kind: str
    reason: str
    axis: int | None = None
    threshold: float = 0.0
    dense: bool = False
    parts: tuple[int, ...] = ()
    tolerance: float | None = None
    held: bool = True
    chosen_by: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in AGREEMENT_KINDS + FIDELITY_KINDS or self.kind == "evaluator":
            raise InternalError(f"unknown judge kind {self.kind!r}")
        if self.kind == "cosine" and self.tolerance is None:
            object.__setattr__(self, "tolerance", DEFAULT_MIN_COSINE)
        if self.kind == "sqnr" and self.tolerance is None:
            object.__setattr__(self, "tolerance", DEFAULT_MIN_SQNR_DB)

    @property
    def agreement(self) -> bool:
        return self.kind in AGREEMENT_KINDS

    def score(self, reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
              labels: np.ndarray | None) -> float:
        got = _pick(candidate, self.name)
        if self.kind == "top1":
            if labels is None:
                raise InternalError("a top-1 judge needs labels")
            return float((top1_classes(got, self.axis) == labels).mean() * 100.0)
        want = _pick(reference, self.name)
        if got.shape != want.shape:
            # INT8 changed a data-dependent shape (a count of detections): nothing agrees.
            return float("-inf") if self.kind == "sqnr" else 0.0
        if self.kind == "classes":
            assert self.axis is not None  # set for classes judges by their makers
            return float((got.argmax(axis=self.axis) == want.argmax(axis=self.axis)).mean() * 100.0)
        if self.kind == "decision":
            if self.dense:
                return decision_f1(want, got, self.threshold)
            return float(((got > self.threshold) == (want > self.threshold)).mean() * 100.0)
        if self.kind == "exact":
            equal = got == want
            if want.dtype.kind == "f":
                equal |= np.isnan(got) & np.isnan(want)
            return float(equal.mean() * 100.0) if equal.size else 100.0
        measure = cosine_score if self.kind == "cosine" else sqnr_db
        if self.parts and self.axis is not None:
            return min(measure(want_part, got_part) for want_part, got_part in zip(
                split_parts(want, self.axis, self.parts), split_parts(got, self.axis, self.parts)))
        return measure(want, got)

    def parts_sqnr(self, reference: np.ndarray, candidate: np.ndarray) -> float:
        """The SQNR of this output, of its worst concatenated part where it has parts (what the
        search ranks layers by)."""
        if not self.parts or self.axis is None:
            return sqnr_db(reference, candidate)
        return min(sqnr_db(want, got) for want, got in zip(
            split_parts(reference, self.axis, self.parts),
            split_parts(candidate, self.axis, self.parts)))

    def describe(self) -> str:
        what = {
            "top1": ("top-1 against the labels" + (f" (argmax over axis {self.axis})"
                                                   if self.axis is not None else "")),
            "classes": f"agreement of the class (argmax over axis {self.axis})",
            "decision": (f"F1 of the positions where output > {self.threshold:g}" if self.dense
                         else f"agreement of the decision output > {self.threshold:g}"),
            "exact": "exact agreement of every value",
            "cosine": "mean cosine per sample against FP32",
            "sqnr": "SQNR against FP32 (dB)",
        }[self.kind]
        if self.parts:
            what += (f", of each of the {len(self.parts)} concatenated parts on axis "
                     f"{self.axis} (the worst)")
        return what

    def limit_text(self, budget: float) -> str:
        """The tolerance as the report and summary print it."""
        if not self.held:
            return "not held"
        if self.agreement:
            return f"drop <= {budget if self.tolerance is None else self.tolerance:.2f}"
        assert self.tolerance is not None  # fidelity judges always get one
        return (f">= {self.tolerance:.4g}" if self.kind == "cosine"
                else f">= {self.tolerance:.1f} dB")

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"output": self.name, "judge": self.kind,
                                 "description": self.describe(), "why": self.reason,
                                 "chosen_by": self.chosen_by, "held": self.held}
        if self.kind in ("classes", "top1"):
            entry["axis"] = self.axis
        if self.kind == "decision":
            entry["threshold"] = self.threshold
            entry["f1_of_positions"] = self.dense
        if self.parts:
            entry.update({"axis": self.axis, "parts": list(self.parts)})
        return entry


def _pick(outputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if not name:
        return next(iter(outputs.values()))
    if name not in outputs:
        raise InternalError(f"no output {name!r} among {list(outputs)}")
    return outputs[name]


class CustomJudge:
    """The user's own evaluator, ``module:callable``: called with the FP32 outputs, the
    candidate's outputs (dicts of output name to an array over the judged samples) and the labels
    (None without them), it returns a score, higher is better (mAP, 100 - CER). Its drop from
    its FP32 score (``evaluator(fp32, fp32, labels)``) is held to the accuracy budget."""

    kind = "evaluator"
    held = True
    tolerance: float | None = None
    agreement = True

    def __init__(self, spec: str, function: Callable[..., Any]) -> None:
        self.name = spec
        self.function = function

    @classmethod
    def load(cls, spec: str) -> CustomJudge:
        """Import ``module:callable`` (as ``--user-model`` is; the module on ``sys.path``)."""
        from agent.errors import ModelError
        from models.loader import resolve_callable

        module, sep, attribute = spec.partition(":")
        if not sep or not module or not attribute:
            raise ConfigError("give --evaluator as MODULE:CALLABLE (e.g. my_metrics:map50)",
                              key="--evaluator", found=spec)
        try:
            return cls(spec, resolve_callable(spec))
        except ModelError as exc:
            raise ConfigError(f"cannot load the evaluator: {exc.message}", key="--evaluator",
                              evaluator=spec) from exc

    def score(self, reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
              labels: np.ndarray | None) -> float:
        try:
            value = self.function(_read_only(reference), _read_only(candidate), labels)
        except Exception as exc:  # noqa: BLE001 - the user's code failed
            raise QuantizationError(f"the evaluator '{self.name}' failed: "
                                    f"{type(exc).__name__}: {first_line(exc)} (it is called as "
                                    "evaluator(fp32_outputs, candidate_outputs, labels) with dicts "
                                    "of output name to array, and labels or None)",
                                    key="--evaluator") from exc
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(()).item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            shown = (f"an array of shape {list(value.shape)}" if isinstance(value, np.ndarray)
                     else f"{type(value).__name__} {value!r}"[:120])
            raise QuantizationError(f"the evaluator '{self.name}' returned {shown}; it must "
                                    "return one number, higher is better", key="--evaluator")
        if not math.isfinite(float(value)):
            raise QuantizationError(f"the evaluator '{self.name}' returned {float(value)}; it "
                                    "must return a finite number", key="--evaluator")
        return float(value)

    def describe(self) -> str:
        return f"the evaluator {self.name} (higher is better)"

    def limit_text(self, budget: float) -> str:
        return f"drop <= {budget:.2f}"

    def to_dict(self) -> dict[str, Any]:
        return {"output": None, "judge": "evaluator", "description": self.describe(),
                "why": "--evaluator", "chosen_by": "--evaluator", "held": True}


def _read_only(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Views the user's code cannot write into (the FP32 outputs are judged again later)."""
    views = {}
    for name, array in outputs.items():
        view = array.view()
        view.flags.writeable = False
        views[name] = view
    return views


# --- the choice ----------------------------------------------------------------------------------


def choose_judges(reference: Mapping[str, np.ndarray], *, labels: bool = False,
                  facts: Mapping[str, OutputFacts] | None = None,
                  overrides: Sequence[OutputMetric] = (), custom: CustomJudge | None = None,
                  class_axis: int = 1) -> list[Judge]:
    """A judge for every output of ``reference`` (the FP32 outputs by name, in the graph's
    order), by the rules of the module docstring; the user's evaluator first when given (it
    decides, and outputs it does not name in ``overrides`` are reported only).

    Args:
        labels: Labels are given: the first output is judged by top-1 against them.
        facts: What the graph tells about each output (:func:`output_facts`); without it,
            shapes and values decide (a 4-D output's classes on ``class_axis``).
        overrides: The user's judges for some outputs.

    Raises:
        ConfigError: an override names no output of the model, or one output twice.
    """
    names = list(reference)
    chosen: dict[str, OutputMetric] = {}
    for override in overrides:
        if override.output not in reference:
            raise ConfigError("--output-metric names no output of the model",
                              key="--output-metric", found=override.output,
                              outputs=", ".join(names))
        if override.output in chosen:
            raise ConfigError("--output-metric names this output twice", key="--output-metric",
                              output=override.output)
        chosen[override.output] = override
    facts = facts or {}
    told = {name for name in names
            if _told(reference[name], facts.get(name, OutputFacts()))}
    judges: list[Judge] = [custom] if custom is not None else []
    for index, name in enumerate(names):
        fact = facts.get(name) or OutputFacts(layout=_default_layout(reference[name], class_axis))
        labelled = labels and index == 0
        automatic = _automatic(name, reference[name], fact, labelled=labelled,
                               regression_only=bool(told - {name}))
        if name in chosen:
            judge = _user_judge(chosen[name], automatic, reference[name], fact, labelled)
        elif custom is not None:
            judge = replace(automatic, held=False)
        else:
            judge = automatic
        judges.append(judge)
    return judges


def _default_layout(array: np.ndarray, class_axis: int) -> str | None:
    if array.ndim != 4:
        return None
    return "NHWC" if class_axis % 4 == 3 else "NCHW"


def _told(array: np.ndarray, fact: OutputFacts) -> bool:
    """The graph or the dtype tells what the output is (rules 3-5 of the module docstring)."""
    return array.dtype.kind in "biu" or fact.activation in ("softmax", "sigmoid")


def _softmax_axis(array: np.ndarray, fact: OutputFacts) -> int | None:
    """The axis a softmax ending ``array`` runs over, where it is one axis."""
    if fact.activation != "softmax" or fact.axis is None or array.ndim < 2:
        return None
    axis = fact.axis % array.ndim
    if fact.flattened and axis != array.ndim - 1:
        return None  # over several axes at once
    return axis


def _class_axis(array: np.ndarray, fact: OutputFacts) -> int:
    """Where the classes of ``array`` lie: the softmax's axis, a 4-D layout's channel axis, else
    the last axis."""
    axis = _softmax_axis(array, fact)
    if axis is not None:
        return axis
    if array.ndim == 4:
        return 3 if fact.layout == "NHWC" else 1
    return max(array.ndim - 1, 1)


def _automatic(name: str, array: np.ndarray, fact: OutputFacts, *, labelled: bool,
               regression_only: bool) -> OutputJudge:
    """The judge rules 2-10 of the module docstring give output ``name``."""
    if labelled:
        return OutputJudge(name, "top1", "labels given: top-1 of the first output",
                           axis=_class_axis(array, fact) if array.ndim > 1 else None)
    if array.dtype.kind in "biu":
        return OutputJudge(name, "exact", f"{array.dtype} values (indices, ids): exact agreement")
    softmax_axis = _softmax_axis(array, fact)
    if softmax_axis is not None:
        axis = softmax_axis
        if axis != 0 and array.shape[axis] > 1:
            where = ("per sample" if array.ndim == 2
                     else "at every position")
            return OutputJudge(name, "classes", f"softmax over axis {axis}: class scores, the "
                               f"class judged {where}", axis=axis)
    if fact.activation == "sigmoid":
        return _decision_or_fidelity(name, array, "sigmoid: probabilities", threshold=0.5)
    if fact.activation == "relu":
        return _fidelity(name, array, "a ReLU ends it (non-negative values, a heatmap or "
                                      "features): regression", fact)
    channel_axis = _class_axis(array, fact)
    if array.ndim <= 1 or array.shape[channel_axis] == 1:
        return _decision_or_fidelity(name, array, _one_channel(array, fact))
    if regression_only:
        return _fidelity(name, array, "no softmax or sigmoid ends it while they end the model's "
                                      "other outputs: regression (boxes, offsets, embeddings)",
                         fact)
    if fact.source == "Concat":
        return _fidelity(name, array, "concatenated heads (e.g. boxes beside their scores): "
                                      "regression", fact)
    if fact.source_size is not None and array.ndim in (2, 3) and (
            fact.source_size != int(np.prod(array.shape[1:]))):
        return _fidelity(name, array, f"reshaped after its last layer ({fact.source}, "
                                      f"{fact.source_size} values a sample, into "
                                      f"{list(array.shape[1:])}): no class axis can be told")
    if array.ndim == 2:
        return OutputJudge(name, "classes", "2-D scores, no softmax in the graph: class logits, "
                           "the class judged per sample", axis=1)
    if array.ndim == 4:
        layout = fact.layout or "NCHW"
        return OutputJudge(name, "classes", f"4-D map read as {layout}: the class on axis "
                           f"{channel_axis} at every position", axis=channel_axis)
    if array.ndim == 3 and fact.source in ("MatMul", "Gemm"):
        return OutputJudge(name, "classes", f"3-D scores from a linear layer ({fact.source}): "
                           "the class on the last axis at every position", axis=2)
    return _fidelity(name, array, f"{array.ndim}-D values with no class axis told: regression",
                     fact)


def _one_channel(array: np.ndarray, fact: OutputFacts) -> str:
    if array.ndim <= 2:
        return "one value per sample"
    if array.ndim == 4:
        return f"4-D one channel ({fact.layout or 'NCHW'})"
    return f"{array.ndim}-D, one channel"


def _decision_or_fidelity(name: str, array: np.ndarray, why: str,
                          threshold: float | None = None) -> OutputJudge:
    """Judged by its decision where FP32 values lie on both sides of the threshold (0.5 for
    probabilities, 0 for logits), else by fidelity."""
    finite = array[np.isfinite(array)]
    if threshold is None:
        probabilities = finite.size > 0 and finite.min() >= 0.0 and finite.max() <= 1.0
        threshold = 0.5 if probabilities else 0.0
        why += ", probabilities" if probabilities else ", logits"
    decisions = finite > threshold
    if decisions.all() or not decisions.any():
        return _fidelity(name, array, f"{why}, every FP32 value on one side of {threshold:g}: "
                                      "no decision to keep")
    dense = int(np.prod(array.shape[1:])) > 1
    if not dense:
        return OutputJudge(name, "decision", f"{why}: the decision > {threshold:g} per sample",
                           threshold=threshold)
    return OutputJudge(name, "decision", f"{why}: the decision > {threshold:g} at every "
                       "position, by the F1 score of where it holds", threshold=threshold, dense=True)


def _fidelity(name: str, array: np.ndarray, why: str,
              fact: OutputFacts | None = None) -> OutputJudge:
    """Cosine per sample, or SQNR where a sample is one value (its cosine is only its sign); of
    each concatenated part (``fact.parts``) where the parts fit the output."""
    axis, parts = _parts(array, fact)
    if parts:
        why += f"; each of the parts {' + '.join(map(str, parts))} on axis {axis} on its own"
    if array.ndim <= 1 or int(np.prod(array.shape[1:])) == 1:
        return OutputJudge(name, "sqnr", f"{why}; one value per sample: SQNR", axis=axis,
                           parts=parts)
    return OutputJudge(name, "cosine", why, axis=axis, parts=parts)


def _parts(array: np.ndarray, fact: OutputFacts | None) -> tuple[int | None, tuple[int, ...]]:
    """The axis and sizes of the concatenated parts of ``array`` (none where they do not fit)."""
    if fact is None or fact.parts is None:
        return None, ()
    axis, sizes = fact.parts
    axis %= max(array.ndim, 1)
    if axis == 0 or sum(sizes) != array.shape[axis]:
        return None, ()
    return axis, sizes


def _user_judge(metric: OutputMetric, automatic: OutputJudge, array: np.ndarray,
                fact: OutputFacts, labelled: bool) -> OutputJudge:
    """The judge ``--output-metric`` asks for (see :class:`OutputMetric`)."""
    why = f"--output-metric {metric.output}={metric.metric}"
    if metric.metric == "ignore":
        return replace(automatic, held=False, chosen_by="--output-metric",
                       reason=f"{why} (the automatic judge, reported only)")
    one_channel = array.ndim <= 1 or array.shape[_class_axis(array, fact)] == 1
    judge: OutputJudge
    if metric.metric in ("cosine", "sqnr"):
        axis, parts = _parts(array, fact)
        judge = OutputJudge(metric.output, metric.metric, why, axis=axis, parts=parts)
    elif metric.metric == "exact":
        judge = OutputJudge(metric.output, metric.metric, why)
    elif metric.metric == "agreement" and automatic.agreement:
        judge = replace(automatic, reason=f"{why}: {automatic.reason}")
    elif metric.metric == "decision" or (metric.metric == "agreement" and one_channel):
        finite = array[np.isfinite(array)]
        probabilities = finite.size > 0 and finite.min() >= 0.0 and finite.max() <= 1.0
        judge = OutputJudge(metric.output, "decision", why,
                            threshold=0.5 if probabilities else 0.0,
                            dense=int(np.prod(array.shape[1:])) > 1)
    elif array.ndim < 2:
        raise ConfigError("top-1 needs an output with a class axis; this one has one value per "
                          "sample (try decision or sqnr)", key="--output-metric",
                          output=metric.output, shape=list(array.shape))
    else:
        axis = _class_axis(array, fact)
        judge = (OutputJudge(metric.output, "top1", f"{why}, against the labels", axis=axis)
                 if labelled else
                 OutputJudge(metric.output, "classes", f"{why}: the class on axis {axis}",
                             axis=axis))
    return replace(judge, chosen_by="--output-metric",
                   tolerance=metric.tolerance if metric.tolerance is not None else (
                       None if judge.agreement else judge.tolerance))
