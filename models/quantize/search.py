"""The mixed-precision search: which layers stay out of INT8 so the accuracy budget holds.

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

import logging
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
    cosine_similarity,
    output_fidelity,
    sqnr_db,
    warn_about_unjudged_outputs,
)
from models.quantize.qdq import CALIBRATION_METHODS, QdqQuantizer, quantized_layers

log = logging.getLogger(__name__)


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
    float_metric, reference = _float_baseline(float_model, evaluator, config)
    quantizer = QdqQuantizer(float_model, calibration, config, workdir)

    full_metric = _quantize_fully(quantizer, evaluator, float_metric)
    timings["calibration_s"] = quantizer.calibration_seconds

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
    timings.update(quantizer.seconds)  # calibration_s, quantize_static_s, variants_s
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


def _float_baseline(float_model: bytes, evaluator: Evaluator,
                    config: QuantizeConfig) -> tuple[float, float]:
    """The float model's metric and the one the budget is counted from; refused when the float
    model alone already spends more than the budget."""
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
    return float_metric, reference


def _quantize_fully(quantizer: QdqQuantizer, evaluator: Evaluator, float_metric: float) -> float:
    """The metric of the model with every candidate layer in INT8 (this calibrates)."""
    full_int8 = quantizer.quantize()
    full_outputs = evaluator.outputs(full_int8)
    full_metric = evaluator.score(full_outputs)
    log.info(
        "calibrated %d samples (%s) in %.1f s; fully INT8 %s %.2f vs FP32 %.2f",
        len(quantizer.calibration),
        quantizer.config.method,
        quantizer.calibration_seconds,
        evaluator.metric_name,
        full_metric,
        float_metric,
    )
    return full_metric


def _subset(evaluator: Evaluator, samples: int) -> Evaluator:
    inputs = {name: array[:samples] for name, array in evaluator.inputs.items()}
    labels = evaluator.labels[:samples] if evaluator.labels is not None else None
    reference = evaluator.reference[:samples] if evaluator.reference is not None else None
    return Evaluator(inputs, labels, reference, evaluator.batch_size, evaluator.threads,
                     judgement=evaluator.judgement)
