"""The mixed-precision search: which layers stay out of INT8 so that every judge holds.

The search evaluates the fully quantized model first (it passes: done). Otherwise it evaluates
the model with every candidate layer kept out of INT8: if even that fails, the budget or a
tolerance cannot be met by any layer set (the metric or the budget is wrong, not INT8) and the
search stops at once with :class:`BudgetUnreachableError`. Otherwise it measures each layer's
sensitivity (that layer alone in INT8, on a few samples: the worst judged output's SQNR), orders
the layers most sensitive first, and bisects on how many of them, a prefix of that order, to keep
out of INT8: ``ceil(log2(n))`` evaluations for ``n`` layers, not ``n``. A few of the kept-out
layers are then tried back in INT8 (bounded by :attr:`QuantizeConfig.refine_evaluations`).
``QuantizeConfig.search_time_s`` bounds sensitivity and search together: when it runs out the
smallest passing layer set found so far is taken, and the result says so.

The budget is counted from ``QuantizeConfig.reference_metric`` when given: the build passes the
unpruned model's top-1 after pruning, so pruning and INT8 together stay within one budget.
Kept-out layers are recorded in the bundle's precision plan as FP16 layers: TensorRT runs them
in FP16 on the board, and they are judged so here (:mod:`models.quantize.fp16`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import ConfigError, QuantizationError
from models.calibration import CalibrationSet
from models.quantize.evaluate import (
    Evaluator,
    LayerSensitivity,
    OutputFidelity,
    Verdict,
    fidelity,
    finite_or_none,
    warn_about_unjudged_outputs,
)
from models.quantize.fp16 import emulate_fp16, float_tensors
from models.quantize.judges import OutputJudge
from models.quantize.local_error import local_sensitivity
from models.quantize.measures import cosine_score, sqnr_db
from models.quantize.qdq import CALIBRATION_METHODS, QdqQuantizer, quantized_layers
from models.quantize.ranges import ENTROPY_MIN_VALUES

log = logging.getLogger(__name__)

# More than this share of the candidate layers kept out of INT8 is worth a warning: the bundle
# then runs mostly in FP16 and gains little from INT8.
MOSTLY_KEPT_OUT = 0.5
# Where even every layer kept out of INT8 fails, the per-layer table for the error is measured
# for at most this long (the search has nothing left to find).
UNREACHABLE_TABLE_S = 30.0
# The most time the per-layer sensitivity may take quantizing layers one at a time (estimated from
# the evaluations so far) before the one-pass measure of models.quantize.local_error ranks them.
EXACT_SENSITIVITY_S = 60.0


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
    # The one batch size the model's graph runs at (models.batch_axis), None for any: the
    # calibration then feeds chunks of exactly that many samples.
    fixed_batch: int | None = None
    # Samples each layer's sensitivity is measured on (None: as few as give the held outputs
    # 4,096 values, from 8 to 64): the ranking needs only the order of the layers, which a few
    # samples give (the judges then decide on every held-out sample), and one inference a layer
    # is most of what the ranking costs (YOLOv8n at 320 x 320: 1.3 s for 8 samples, 4 s for 32,
    # on 2 busy cores).
    sensitivity_samples: int | None = None
    # Bound on sensitivity and search together (None: unbounded); see the module docstring.
    search_time_s: float | None = None
    # Kept-out layers tried back in INT8 after the bisection.
    refine_evaluations: int = 2
    # A model with no layer left in INT8 is refused unless this is set (then it is FP16 throughout).
    allow_no_int8: bool = False
    # Entropy calibration of tensors with fewer values than this over all calibration samples
    # falls back to the values seen (models.quantize.ranges.ENTROPY_MIN_VALUES).
    entropy_min_values: int = ENTROPY_MIN_VALUES
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
        if self.search_time_s is not None and not self.search_time_s > 0:
            raise ConfigError("--search-time must be a positive number of seconds",
                              key="--search-time", found=self.search_time_s)
        if (self.sensitivity_samples is not None and self.sensitivity_samples < 1
                or self.refine_evaluations < 0):
            raise ConfigError("sensitivity samples must be >= 1 and refine evaluations >= 0",
                              found=(self.sensitivity_samples, self.refine_evaluations))


@dataclass
class QuantizeResult:
    model_bytes: bytes
    metric_name: str
    float_metric: float  # the primary judge's scores (Evaluator.primary)
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
    # Every output of the final model against FP32 (see evaluate.fidelity).
    outputs: list[OutputFidelity] = field(default_factory=list)
    metric_description: str = ""  # how the primary judge compares outputs
    # Every judge: what it is, why, its tolerance, its FP32, fully INT8 and final scores, pass.
    judges: list[dict[str, Any]] = field(default_factory=list)
    candidate_count: int = 0  # layers the search could keep out of INT8
    judged_samples: int = 0
    # How the search went: evaluations, whether it was cut short by its time limit, and what it
    # would have tried next.
    search: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def drop(self) -> float:
        """What INT8 cost against the float model it was given."""
        return self.float_metric - self.int8_metric

    @property
    def budget_drop(self) -> float:
        """The drop the budget was held to: from the reference (the unpruned model, if pruned)."""
        return self.reference_metric - self.int8_metric

    @property
    def fp16_throughout(self) -> bool:
        """No layer runs in INT8 (accepted only with ``allow_no_int8``)."""
        return not self.int8_layers

    def precision_plan(self) -> dict[str, list[str]]:
        return {"int8_layers": self.int8_layers, "fp16_layers": self.fp16_layers, "fp32_layers": []}


class BudgetUnreachableError(QuantizationError):
    """Even with every candidate layer kept out of INT8 the judges fail: no layer set can meet
    the budget, so the metric, a tolerance or the budget is wrong, not INT8.

    Attributes:
        judges: Each judge's report entry (scores fully INT8 and with every layer kept out).
        sensitivity: The per-layer table measured for the error (possibly partial).
    """

    def __init__(self, message: str, *, judges: list[dict[str, Any]],
                 sensitivity: list[LayerSensitivity], **fields: Any) -> None:
        super().__init__(message, **fields)
        self.judges = judges
        self.sensitivity = sensitivity


class _Clock:
    """The search's time limit (None: none)."""

    def __init__(self, limit_s: float | None) -> None:
        self.started = time.perf_counter()
        self.limit_s = limit_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return math.inf if self.limit_s is None else self.limit_s - self.elapsed()


@dataclass
class _Candidate:
    kept_out: list[str]
    model_bytes: bytes  # empty for a set evaluated before that is not the best one
    verdict: Verdict
    outputs: dict[str, np.ndarray] | None  # kept for the best candidate only (memory)


class _Search:
    """Evaluates layer sets against the judges; keeps the trace, the timing and the smallest
    passing set found so far. A set evaluated before is answered from memory."""

    def __init__(self, quantizer: QdqQuantizer, evaluator: Evaluator, baseline: tuple[float, ...],
                 config: QuantizeConfig, reference_metric: float | None) -> None:
        self.quantizer = quantizer
        self.evaluator = evaluator
        self.baseline = baseline
        self.config = config
        self.reference_metric = reference_metric
        self.trace: list[dict[str, Any]] = []
        self.best: _Candidate | None = None
        self.seconds: list[float] = []
        self.expected_steps = 1
        self._verdicts: dict[frozenset[str], Verdict] = {}
        self._floats = float_tensors(quantizer.float_model)

    def evaluated(self, kept_out: Sequence[str]) -> bool:
        return frozenset(kept_out) in self._verdicts

    def evaluate(self, kept_out: Sequence[str], note: str = "") -> _Candidate:
        key = frozenset(kept_out)
        if key in self._verdicts:
            if self.best is not None and frozenset(self.best.kept_out) == key:
                return self.best
            return _Candidate(list(kept_out), b"", self._verdicts[key], None)
        started = time.perf_counter()
        calibrated_before = self.quantizer.calibration_seconds
        model_bytes = self.quantizer.quantize(exclude=list(kept_out))
        outputs = self.evaluator.outputs(emulate_fp16(model_bytes, kept_out, self._floats))
        verdict = self.evaluator.verdict(self.evaluator.scores(outputs), self.baseline,
                                         self.config.accuracy_budget, self.reference_metric)
        # The first quantization calibrates: that is no part of what each evaluation takes.
        seconds = time.perf_counter() - started - (self.quantizer.calibration_seconds
                                                   - calibrated_before)
        self.seconds.append(seconds)
        self._verdicts[key] = verdict
        candidate = _Candidate(list(kept_out), model_bytes, verdict, outputs)
        if verdict.ok and (self.best is None or len(kept_out) < len(self.best.kept_out)):
            self.best = candidate
        step = len(self.trace) + 1
        self.expected_steps = max(self.expected_steps, step)
        self.trace.append({
            "step": step,
            "kept_out": len(kept_out),
            "scores": {judge.name: finite_or_none(score, 4)
                       for judge, score in zip(self.evaluator.judges, verdict.scores)},
            "passed": verdict.ok,
            "seconds": round(seconds, 2),
            **({"note": note} if note else {}),
        })
        left = (self.expected_steps - step) * float(np.mean(self.seconds[-4:]))
        log.info("mixed precision: step %d of ~%d, %d of %d layers kept out of INT8 -> %s (%s)%s; "
                 "est. %.0f s left", step, self.expected_steps, len(kept_out),
                 len(self.quantizer.candidates), "pass" if verdict.ok else "fail",
                 self.describe(verdict), f" [{note}]" if note else "", left)
        return candidate

    def describe(self, verdict: Verdict) -> str:
        """The held judges' scores, the failing ones marked."""
        parts = []
        for judge, score, passed in zip(self.evaluator.judges, verdict.scores, verdict.passed):
            if judge.held:
                parts.append(f"{judge.name or 'output'} {judge.kind} {_shown(score)}"
                             + ("" if passed else " FAILS"))
        return ", ".join(parts)

    def mean_seconds(self) -> float:
        return float(np.mean(self.seconds)) if self.seconds else 0.0


def _shown(score: float) -> str:
    if not np.isfinite(score):
        return str(score)
    return f"{score:.4f}" if abs(score) <= 1.0 else f"{score:.2f}"


def measure_sensitivity(
    quantizer: QdqQuantizer,
    evaluator: Evaluator,
    float_outputs: dict[str, np.ndarray] | None = None,
    progress: bool = False,
    time_limit_s: float | None = None,
) -> tuple[list[LayerSensitivity], bool]:
    """Quantize each candidate layer alone and measure how far the outputs held by a judge move
    (the worst output's SQNR); most sensitive first.

    Stops when ``time_limit_s`` runs out: the layers left unmeasured (SQNR NaN in the table)
    rank as a median measured layer. Returns the table and whether every layer was measured.
    """
    reference = float_outputs if float_outputs is not None else evaluator.reference
    if reference is None:
        raise QuantizationError("sensitivity needs the FP32 outputs")
    # The held outputs, each measured as its judge sees it (a concatenated head by its worst
    # part); the user's evaluator alone holds every output.
    watched: dict[str, OutputJudge | None] = {
        judge.name: judge for judge in evaluator.judges
        if judge.held and isinstance(judge, OutputJudge) and judge.name in reference}
    watched = watched or dict.fromkeys(reference)
    started = time.perf_counter()
    layers: Any = quantizer.candidates
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(layers, desc="layer sensitivity", unit="layer", leave=False)
        layers = bar
    results: list[LayerSensitivity] = []
    next_report = 0.1
    total = len(quantizer.candidates)
    for index, (name, op_type) in enumerate(layers):
        elapsed = time.perf_counter() - started
        if time_limit_s is not None and index and elapsed + elapsed / index > time_limit_s:
            log.warning("layer sensitivity stopped at its time limit after %d of %d layers "
                        "(%.0f s); the rest rank as a median measured layer", index, total,
                        elapsed)
            break
        outputs = evaluator.outputs(quantizer.quantize(only=[name]))
        measured = [(judge.parts_sqnr(reference[output], outputs[output]) if judge else
                     sqnr_db(reference[output], outputs[output]), output)
                    for output, judge in watched.items()]
        worst_sqnr, worst = min(measured, key=lambda entry: (entry[0], entry[1]))
        results.append(LayerSensitivity(name, op_type, worst_sqnr,
                                        cosine_score(reference[worst], outputs[worst]), worst))
        done = (index + 1) / total
        if bar is None and done >= next_report and index + 1 < total:
            elapsed = time.perf_counter() - started
            log.info("layer sensitivity: %d of %d layers, est. %.0f s left", index + 1, total,
                     elapsed / (index + 1) * (total - index - 1))
            next_report = done + 0.1
    if bar is not None:
        bar.close()
    measured_names = {layer.name for layer in results}
    unmeasured = [LayerSensitivity(name, op_type, float("nan"), float("nan"), "")
                  for name, op_type in quantizer.candidates if name not in measured_names]
    return rank_layers(results, unmeasured), not unmeasured


def rank_layers(measured: Sequence[LayerSensitivity], unmeasured: Sequence[LayerSensitivity]
                ) -> list[LayerSensitivity]:
    """Most sensitive first (lowest SQNR; a NaN from an output holding NaN counts as the
    lowest). Layers a time limit left unmeasured rank as a median measured one, after it:
    nothing says they are harmless (a detector's last layers, measured last, are often the
    ones INT8 hurts)."""
    scores = [layer.sqnr_db for layer in measured if not math.isnan(layer.sqnr_db)]
    median = float(np.median(scores)) if scores else 0.0

    def key(entry: tuple[bool, LayerSensitivity]) -> tuple[float, bool, str]:
        known, layer = entry
        if not known:
            return median, True, layer.name
        return (-math.inf if math.isnan(layer.sqnr_db) else layer.sqnr_db), False, layer.name

    entries = [(True, layer) for layer in measured] + [(False, layer) for layer in unmeasured]
    return [layer for _, layer in sorted(entries, key=key)]


def search_mixed_precision(
    quantizer: QdqQuantizer,
    evaluator: Evaluator,
    ranking: Sequence[str],
    config: QuantizeConfig,
    *,
    baseline: tuple[float, ...] | None = None,
    reference_metric: float | None = None,
    clock: Any = None,
    search: _Search | None = None,
) -> tuple[list[str], bytes, Verdict, list[dict[str, Any]], dict[str, Any]]:
    """The fewest layers of ``ranking`` (most sensitive first), as a prefix, to keep out of INT8
    so that every judge holds; found by bisection between the fully quantized model (failing)
    and every layer of ``ranking`` kept out, then refined (see the module docstring).

    Returns:
        (kept-out layers, their QDQ model, its verdict, the trace, a summary of the search).

    Raises:
        BudgetUnreachableError: even every layer kept out fails.
    """
    clock = clock or _Clock(config.search_time_s)
    if search is None:
        baseline = baseline if baseline is not None else evaluator.baseline()
        search = _Search(quantizer, evaluator, baseline, config, reference_metric)
    ranking = list(ranking)
    count = len(ranking)
    endpoints = sum(not search.evaluated(kept_out) for kept_out in ([], ranking))
    search.expected_steps = len(search.trace) + endpoints + _bisection_steps(count) + min(
        config.refine_evaluations, max(count - 1, 0))
    first = search.evaluate([], "fully INT8")
    if first.verdict.ok:
        return [], first.model_bytes, first.verdict, search.trace, _summary(search, [], None)
    everything = search.evaluate(ranking, "every layer kept out")
    if not everything.verdict.ok:
        raise _unreachable(search, everything)
    # Invariant: a prefix of ``low`` layers fails, one of ``high`` passes.
    low, high = 0, count
    stopped = None
    while high - low > 1:
        middle = (low + high) // 2
        if clock.remaining() < search.mean_seconds():
            stopped = {"reason": f"the search time limit ({config.search_time_s:g} s) ran out",
                       "next": f"{middle} layers kept out (between {low}, failing, and {high}, "
                               "passing)"}
            break
        candidate = search.evaluate(ranking[:middle], f"bisect {low}..{high}")
        if candidate.verdict.ok:
            high = middle
        else:
            low = middle
    kept_out = ranking[:high]
    # Refinement: the last layer of the prefix is needed (one fewer failed); the ones before it
    # may not be. Least sensitive first, a bounded number of tries.
    tries = 0
    for name in reversed(kept_out[:-1]):
        if stopped is not None or tries >= config.refine_evaluations:
            break
        if clock.remaining() < search.mean_seconds():
            stopped = {"reason": f"the search time limit ({config.search_time_s:g} s) ran out",
                       "next": f"putting {name} back in INT8"}
            break
        tries += 1
        trial = [layer for layer in kept_out if layer != name]
        if search.evaluate(trial, f"{name} back in INT8").verdict.ok:
            kept_out = trial
    best = search.best
    assert best is not None  # every layer kept out passed
    return (best.kept_out, best.model_bytes, best.verdict, search.trace,
            _summary(search, best.kept_out, stopped))


def sensitivity_samples(evaluator: Evaluator, config: QuantizeConfig) -> int:
    """How many samples layer sensitivity is measured on (see
    :attr:`QuantizeConfig.sensitivity_samples`)."""
    if config.sensitivity_samples is not None:
        return config.sensitivity_samples
    reference = evaluator.reference or {}
    values = sum(int(np.prod(array.shape[1:])) for array in reference.values()) or 1
    return int(min(max(math.ceil(4096 / values), 8), 64))


def _bisection_steps(count: int) -> int:
    return math.ceil(math.log2(count)) if count > 1 else 0


def _summary(search: _Search, kept_out: list[str], stopped: dict[str, Any] | None
             ) -> dict[str, Any]:
    return {"evaluations": len(search.trace), "kept_out": len(kept_out),
            "candidates": len(search.quantizer.candidates),
            "seconds": round(float(np.sum(search.seconds)), 2),
            "stopped_by_time": stopped is not None, **({"stopped": stopped} if stopped else {})}


def _unreachable(search: _Search, everything: _Candidate) -> BudgetUnreachableError:
    """The error for a budget no layer set meets, with the per-output scores and the per-layer
    table (measured now, briefly: it shows where INT8 hurts, though the metric is the problem)."""
    evaluator, budget = search.evaluator, search.config.accuracy_budget
    scores_full = search.trace[0]["scores"] if search.trace else {}
    failing = []
    for judge, score, passed in zip(evaluator.judges, everything.verdict.scores,
                                    everything.verdict.passed):
        if not passed:
            failing.append(f"{judge.name or 'output'}: {judge.kind} {_shown(score)} with every "
                           f"layer kept out, needs {judge.limit_text(budget)}")
    sensitivity, complete = measure_sensitivity(
        search.quantizer, evaluator.subset(sensitivity_samples(evaluator, search.config)),
        progress=search.config.progress, time_limit_s=UNREACHABLE_TABLE_S)
    log.warning("per-layer sensitivity (that layer alone in INT8), most sensitive first%s:\n%s",
                "" if complete else " (partial)", format_sensitivity(sensitivity))
    judges = [{**judge.to_dict(), "tolerance": judge.limit_text(budget),
               "int8_all_layers": scores_full.get(judge.name),
               "every_layer_kept_out": finite_or_none(score, 4)}
              for judge, score in zip(evaluator.judges, everything.verdict.scores)]
    worst = ", ".join(f"{layer.name} {_shown(layer.sqnr_db)} dB"
                      for layer in sensitivity[:5] if np.isfinite(layer.sqnr_db))
    return BudgetUnreachableError(
        "the accuracy budget cannot be met even with every layer kept out of INT8: the metric, "
        "a tolerance (--output-metric) or the budget is wrong, not INT8 ("
        + "; ".join(failing) + ")",
        judges=judges, sensitivity=sensitivity, most_sensitive=worst or None,
        evaluations=len(search.trace))


def format_sensitivity(sensitivity: Sequence[LayerSensitivity], limit: int = 40) -> str:
    """The per-layer table as text (the first ``limit`` rows)."""
    rows = [f"  {'layer':<40} {'op':<14} {'SQNR dB':>8} {'cosine':>8}  output"]
    for layer in sensitivity[:limit]:
        sqnr = "n/a" if not np.isfinite(layer.sqnr_db) else f"{layer.sqnr_db:8.2f}"
        cosine = "n/a" if not np.isfinite(layer.cosine) else f"{layer.cosine:8.5f}"
        rows.append(f"  {layer.name[:40]:<40} {layer.op_type:<14} {sqnr:>8} {cosine:>8}  "
                    f"{layer.output}")
    if len(sensitivity) > limit:
        rows.append(f"  ... {len(sensitivity) - limit} more")
    return "\n".join(rows)


def too_few_predictions(evaluator: Evaluator, budget: float) -> list[str]:
    """Warnings for agreement judges where one changed prediction already costs more than the
    budget (only models that change none of them pass)."""
    warnings = []
    for judge in evaluator.judges:
        predictions = evaluator.predictions(judge)
        limit = budget if judge.tolerance is None else judge.tolerance
        if judge.held and predictions and 100.0 / predictions > limit:
            counted = ("samples" if predictions == evaluator.samples else
                       "sample positions")
            warnings.append(
                f"{judge.name or 'the output'}: with {predictions} evaluation {counted} one "
                f"changed prediction costs {100.0 / predictions:.2f} points, more than the "
                f"{limit:.2f}-point budget: only models that change no prediction pass, which "
                "may keep many layers out of INT8 (give more samples, or a larger "
                "--accuracy-budget)")
            log.warning("%s", warnings[-1])
    return warnings


def warn_if_too_few_predictions(evaluator: Evaluator, budget: float) -> None:
    """Log :func:`too_few_predictions` (kept for callers of the earlier name)."""
    too_few_predictions(evaluator, budget)


def quantize_model(
    float_model: bytes,
    calibration: CalibrationSet,
    evaluator: Evaluator,
    config: QuantizeConfig,
    workdir: Path,
) -> QuantizeResult:
    """Calibrate, judge the fully quantized model and, where it fails, find the mixed-precision
    plan (see the module docstring). ``evaluator``'s reference outputs, where it has them, are
    ``float_model``'s.

    Raises:
        BudgetUnreachableError: no layer set meets the judges.
        QuantizationError: the float model is already below the reference by more than the
            budget, or no layer is left in INT8 and ``config.allow_no_int8`` is not set.
    """
    onnx = require("onnx", extra="host", purpose="INT8 quantization")
    from models.export import node_counts

    timings: dict[str, float] = {}
    started = time.perf_counter()
    if evaluator.reference is None:  # labels only: the other outputs are judged against FP32
        evaluator = evaluator.with_reference(evaluator.outputs(float_model))
    baseline = evaluator.baseline()
    reference = _reference_metric(evaluator, baseline, config)
    warnings = too_few_predictions(evaluator, config.accuracy_budget)
    quantizer = QdqQuantizer(float_model, calibration, config, workdir)
    search = _Search(quantizer, evaluator, baseline, config, config.reference_metric)
    candidates = [name for name, _ in quantizer.candidates]
    search.expected_steps = 2 + _bisection_steps(len(candidates)) + config.refine_evaluations
    full = search.evaluate([], "fully INT8")
    timings["calibration_s"] = quantizer.calibration_seconds
    log.info("calibrated %d samples (%s) in %.1f s; fully INT8: %s", len(calibration),
             config.method, quantizer.calibration_seconds, search.describe(full.verdict))
    clock = _Clock(config.search_time_s)
    sensitivity: list[LayerSensitivity] = []
    summary: dict[str, Any]
    if not full.verdict.ok and not candidates:
        raise _unreachable(search, full)  # nothing to keep out of INT8: the model is as it is
    if full.verdict.ok:
        kept_out: list[str] = []
        final = full
        summary = _summary(search, [], None)
    else:
        final, kept_out, sensitivity, summary = _mixed(search, clock, evaluator, config,
                                                       candidates, timings)
    if summary.get("stopped"):
        warnings.append(f"the mixed-precision search stopped early: {summary['stopped']['reason']}"
                        f"; it took the smallest passing layer set found ({len(kept_out)} kept "
                        f"out of INT8); next it would have tried "
                        f"{summary['stopped']['next']}")
        log.warning("%s", warnings[-1])
    int8_layers = quantized_layers(final.model_bytes, kept_out=set(kept_out))
    if not int8_layers:
        warnings.append(_no_int8(candidates, kept_out, config, summary))
    held = {judge.name for judge in evaluator.judges
            if judge.held and isinstance(judge, OutputJudge)}
    if evaluator.custom is not None:
        held |= set(evaluator.reference or {}) - {judge.name for judge in evaluator.judges
                                                  if isinstance(judge, OutputJudge)}
    final_outputs = final.outputs if final.outputs is not None else evaluator.outputs(
        final.model_bytes)
    outputs = fidelity(evaluator.reference or {}, final_outputs, held)
    warnings += warn_about_unjudged_outputs(outputs)
    timings.update(quantizer.seconds)  # calibration_s, quantize_static_s, variants_s
    timings["total_s"] = time.perf_counter() - started
    return QuantizeResult(
        model_bytes=final.model_bytes,
        metric_name=evaluator.metric_name,
        metric_description=evaluator.metric_description,
        float_metric=baseline[0],
        full_int8_metric=full.verdict.primary,
        int8_metric=final.verdict.primary,
        int8_layers=int8_layers,
        fp16_layers=kept_out,
        sensitivity=sensitivity,
        search_trace=search.trace,
        calibration=calibration.to_manifest(config.method),
        node_counts=node_counts(onnx.load_from_string(final.model_bytes)),
        reference_metric=reference,
        seconds=timings,
        outputs=outputs,
        judges=judge_table(evaluator, baseline, full.verdict, final.verdict,
                           config.accuracy_budget),
        candidate_count=len(candidates),
        judged_samples=evaluator.samples,
        search=summary,
        warnings=warnings,
    )


def _mixed(search: _Search, clock: _Clock, evaluator: Evaluator, config: QuantizeConfig,
           candidates: list[str], timings: dict[str, float]
           ) -> tuple[_Candidate, list[str], list[LayerSensitivity], dict[str, Any]]:
    """The fully quantized model failed: check that keeping every layer out passes, rank the
    layers and bisect."""
    everything = search.evaluate(candidates, "every layer kept out")
    if not everything.verdict.ok:
        raise _unreachable(search, everything)
    sensitivity_started = time.perf_counter()
    # Leave the bisection its share of the time limit: one evaluation per halving.
    reserve = (_bisection_steps(len(candidates)) + 1) * search.mean_seconds()
    limit = None if config.search_time_s is None else max(clock.remaining() - reserve, 0.0)
    subset = evaluator.subset(sensitivity_samples(evaluator, config))
    # One evaluation per layer, on the subset: beyond EXACT_SENSITIVITY_S, rank the layers in one
    # run by each one's own INT8 error on clean inputs instead (models.quantize.local_error).
    estimate = len(candidates) * search.mean_seconds() * subset.samples / max(evaluator.samples, 1)
    if estimate > EXACT_SENSITIVITY_S:
        log.info("layer sensitivity in one run (each layer's own INT8 error on clean inputs): "
                 "quantizing the %d layers one at a time would take about %.0f s",
                 len(candidates), estimate)
        sensitivity = local_sensitivity(search.quantizer.float_model,
                                        search.quantizer.quantize(exclude=[]),
                                        search.quantizer.candidates, subset.inputs,
                                        threads=evaluator.threads,
                                        fixed_batch=evaluator.fixed_batch)
    else:
        sensitivity, _ = measure_sensitivity(search.quantizer, subset,
                                             progress=config.progress, time_limit_s=limit)
    timings["sensitivity_s"] = time.perf_counter() - sensitivity_started
    search_started = time.perf_counter()
    kept_out, _, _, _, summary = search_mixed_precision(
        search.quantizer, evaluator, [layer.name for layer in sensitivity], config,
        clock=clock, search=search)
    timings["search_s"] = time.perf_counter() - search_started
    best = search.best
    assert best is not None and best.kept_out == kept_out  # search_mixed_precision returns it
    return best, kept_out, sensitivity, summary


def _reference_metric(evaluator: Evaluator, baseline: tuple[float, ...],
                      config: QuantizeConfig) -> float:
    """What the primary judge's drop is counted from; refused when the float model alone
    already spends more than the budget."""
    float_metric = baseline[0]
    if config.reference_metric is None or evaluator.primary.kind != "top1":
        return float_metric  # the reference is a top-1 (the unpruned model's)
    reference = config.reference_metric
    if reference - float_metric > config.accuracy_budget:
        raise QuantizationError(
            "the float model is already further below the reference than the accuracy budget "
            "allows, before any INT8 (prune less, or fine-tune longer)",
            reference=round(reference, 3),
            float_metric=round(float_metric, 3),
            budget=config.accuracy_budget,
        )
    return reference


def _no_int8(candidates: list[str], kept_out: list[str], config: QuantizeConfig,
             summary: dict[str, Any]) -> str:
    """No layer is left in INT8: refused unless ``allow_no_int8``; else the warning."""
    if not candidates:
        reason = ("the model has no layer INT8 can run (Conv, ConvTranspose, Gemm, MatMul, "
                  "Add)")
    elif summary.get("stopped"):
        reason = ("the search stopped at its time limit with only every layer kept out of "
                  "INT8 passing (give a longer --search-time)")
    else:
        reason = (f"every one of the {len(candidates)} layers had to be kept out of INT8 to "
                  "meet the budget")
    if not config.allow_no_int8:
        raise QuantizationError(
            f"no layer runs in INT8, so this is not an INT8 build: {reason}; loosen "
            "--accuracy-budget or a --output-metric tolerance, check the judges in the log, or "
            "give --allow-no-int8 to build an FP16 bundle", kept_out=len(kept_out))
    message = f"no layer runs in INT8: the bundle's model is FP16 throughout ({reason})"
    log.warning("%s", message)
    return message


def judge_table(evaluator: Evaluator, baseline: Sequence[float], full: Verdict, final: Verdict,
                budget: float) -> list[dict[str, Any]]:
    """Each judge's report entry: what it is and why, its tolerance, its FP32, fully INT8 and
    final scores, and whether the final model passes it."""
    table = []
    for index, judge in enumerate(evaluator.judges):
        entry = judge.to_dict()
        entry.update({
            "tolerance": judge.limit_text(budget),
            "fp32": finite_or_none(baseline[index], 4),
            "int8_all_layers": finite_or_none(full.scores[index], 4),
            "int8": finite_or_none(final.scores[index], 4),
            "passed": final.passed[index],
        })
        table.append(entry)
    return table
