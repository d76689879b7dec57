"""The build report's sections (export, quantization, accuracy, host speed), its JSON encoding,
and the summary printed on the terminal."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from models.ort import int8_kernels
from models.pipeline.frames import _frame_inputs, frame_size
from models.pipeline.options import BuildOptions, BuildResult
from models.quantize import QuantizeResult, finite_or_none
from models.quantize.search import MOSTLY_KEPT_OUT


def _export_report(exported: Any) -> dict[str, Any]:
    return {
        "opset": 17,
        "input_shape": list(exported.input_shape),
        "dynamic_spatial": exported.dynamic_spatial,
        "node_counts_before": exported.node_counts_before,
        "node_counts_after": exported.node_counts_after,
        "max_abs_error_vs_torch": exported.max_abs_error,
        "checks": exported.checks,
        "seconds": round(exported.seconds, 2),
    }


def _quantization_report(result: QuantizeResult, options: BuildOptions) -> dict[str, Any]:
    return {
        "format": "QDQ, symmetric INT8, per-channel weights, float bias",
        "calibration": result.calibration,
        "accuracy_budget": options.accuracy_budget,
        "fp16_layers": result.fp16_layers,
        "int8_layer_count": len(result.int8_layers),
        "candidate_layers": result.candidate_count,
        "fp16_throughout": result.fp16_throughout,
        "sensitivity": [layer.to_dict() for layer in result.sensitivity],
        **({} if result.sensitivity else {
            "sensitivity_note": "not measured: the fully INT8 model passed every judge"}),
        "search": result.search_trace,
        "search_summary": result.search,
        "node_counts": result.node_counts,
        "seconds": {name: round(value, 2) for name, value in result.seconds.items()},
    }


def _budget_reference(meta: dict[str, Any]) -> float | None:
    """After pruning, the accuracy budget is counted from the unpruned model: it covers what
    pruning and INT8 cost together, which is what the operator asked to bound."""
    if meta.get("pruned_torch_metric") is None:
        return None
    return float(meta["fp32_torch_metric"])


def _accuracy_report(result: QuantizeResult, meta: dict[str, Any],
                     options: BuildOptions) -> dict[str, Any]:
    """The accuracy section: the primary judge's scores under the names readers know (metric,
    fp32, int8_all_layers, int8; drop and budget for agreement metrics), and every judge
    (``judges``: per output, its judge and why, its tolerance, its scores and whether it
    passed) with the samples they judged."""
    digits = 5 if result.metric_name == "cosine" else 3
    accuracy: dict[str, Any] = {
        "metric": result.metric_name,
        "metric_description": result.metric_description,
        "dataset": meta["dataset"],
        "samples": meta.get("samples"),
        "fp32": finite_or_none(result.float_metric, digits),
        "int8_all_layers": finite_or_none(result.full_int8_metric, digits),
        "int8": finite_or_none(result.int8_metric, digits),
        "fp16_layers": len(result.fp16_layers),
        "judges": result.judges,
        # Every output of the final model against FP32, on the judged samples.
        "outputs": [output.to_dict() for output in result.outputs],
    }
    if result.metric_name in ("top1", "agreement", "evaluator"):
        accuracy.update({
            # The drop the budget holds: from the unpruned model when pruning ran, else FP32.
            "drop": round(result.budget_drop, 3),
            "int8_drop": round(result.drop, 3),
            "budget": options.accuracy_budget,
            "budget_from": "FP32 (ONNX)",
        })
    if meta.get("fp32_torch_metric") is not None:
        accuracy["fp32_unpruned"] = round(meta["fp32_torch_metric"], 3)
    if meta.get("pruned_torch_metric") is not None:
        accuracy["pruned_fp32"] = round(meta["pruned_torch_metric"], 3)
        accuracy["drop_vs_unpruned"] = accuracy["drop"]  # the budgeted drop counts from it
        accuracy["budget_from"] = "unpruned FP32 (PyTorch)"
    return accuracy


def _warnings(result: QuantizeResult, meta: dict[str, Any], speed: dict[str, Any]) -> list[str]:
    """The report's warnings: the held-out split's, the quantization's, and a plain one with the
    speed it costs where most layers are kept out of INT8."""
    warnings = list((meta.get("samples") or {}).get("warnings", [])) + list(result.warnings)
    kept_out, candidates = len(result.fp16_layers), result.candidate_count
    if candidates and kept_out / candidates > MOSTLY_KEPT_OUT and not result.fp16_throughout:
        warnings.append(
            f"{kept_out} of {candidates} layers ({kept_out / candidates:.0%}) are kept out of "
            f"INT8 (FP16 on the board): the INT8 model runs at {speed['int8_speedup']:.2f}x "
            "the FP32 model's speed on this host; check the judges (--output-metric, "
            "--accuracy-budget) before deploying it as an INT8 build")
    return warnings


def _speed_report(float_bytes: bytes, int8_bytes: bytes, meta: dict[str, Any],
                  options: BuildOptions) -> dict[str, Any]:
    frame = frame_size(meta, options)
    feeds = _frame_inputs(meta, meta.get("fixed_batch") or options.opt_batch, frame)
    fp32 = _speed(float_bytes, feeds, options.threads)
    int8 = _speed(int8_bytes, feeds, options.threads)
    return {
        "where": f"this host's CPU, ONNX Runtime, {options.threads} threads",
        "input_shape": list(feeds[meta["input_name"]][0]),
        "fp32_img_s": round(fp32, 2),
        "int8_img_s": round(int8, 2),
        "int8_speedup": round(int8 / fp32, 2),
        # Without VNNI an x86 CPU runs INT8 through ONNX Runtime's slower exact kernels
        # (models/ort.py), so the host's INT8 gain says little about a Jetson's.
        "int8_kernels": int8_kernels(),
        "note": "TensorRT speed is measured on the device; see `edge-agent bench`",
    }


def _speed(model_bytes: bytes, inputs: dict[str, tuple[tuple[int, ...], str]],
           threads: int) -> float:
    """Images per second of an ONNX model on this host (median latency over about a second),
    fed random inputs of the given shapes and dtypes."""
    from models.ort import create_session
    from models.timing import time_call

    session = create_session(model_bytes, threads=threads)
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape).astype(dtype) for name, (shape, dtype) in inputs.items()}
    latencies = time_call(lambda: session.run(None, feed), 1.0, 5)
    return next(iter(inputs.values()))[0][0] / statistics.median(latencies)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def format_summary(result: BuildResult) -> str:
    """A readable summary of a build for the terminal."""
    report = result.report
    accuracy = report["accuracy"]
    quantization = report["quantization"]
    lines = [
        f"bundle   {result.bundle_path}",
        f"report   {result.report_path}",
        f"model    {report['name']} v{report['version']}  (signed by key {report['signing_key_id']})",
        f"accuracy ({accuracy['metric']}, {accuracy['dataset']})",
    ]
    if "fp32_unpruned" in accuracy:
        lines.append(f"  FP32 (PyTorch)     {accuracy['fp32_unpruned']:.2f}")
    if "pruned_fp32" in accuracy:
        lines.append(f"  pruned FP32        {accuracy['pruned_fp32']:.2f}")
    lines += _judges_table(accuracy.get("judges", []))
    fp16, candidates = quantization["fp16_layers"], quantization.get("candidate_layers")
    layers = f"{len(fp16)} of {candidates}" if candidates else f"{len(fp16)}"
    if quantization.get("fp16_throughout"):
        lines.append(f"  FP16 throughout    no layer in INT8 ({layers} layer(s) kept out, "
                     "accepted by --allow-no-int8)")
    elif "drop" in accuracy:
        lines.append(f"  INT8, mixed        {accuracy['int8']:.2f}  (drop {accuracy['drop']:.2f} "
                     f"from {accuracy['budget_from']}, budget {accuracy['budget']:.2f}, "
                     f"{layers} layer(s) in FP16)")
    else:
        lines.append(f"  INT8, mixed        {layers} layer(s) in FP16, every judge above passed")
    if "int8_onnxruntime_served" in accuracy:
        served = _score_text(accuracy["metric"], accuracy["int8_onnxruntime_served"])
        lines.append(f"  INT8, served (CPU) {served}  (ONNX Runtime folds ReLUs into a finer "
                     "UINT8 step; TensorRT runs the model judged above)")
    if fp16:
        shown = ", ".join(fp16[:12]) + (f", ... {len(fp16) - 12} more" if len(fp16) > 12 else "")
        lines.append("  FP16 layers: " + shown)
    model = report.get("model")
    if model:
        size = next((key.split("_")[-1] for key in model if key.startswith("macs_")), "")
        line = f"size     {model['params'] / 1e6:.2f} M params, {model[f'macs_{size}'] / 1e9:.2f} GMACs at {size}"
        if "pruned_params" in model:
            line += (f" -> pruned {model['pruned_params'] / 1e6:.2f} M params, "
                     f"{model[f'pruned_macs_{size}'] / 1e9:.2f} GMACs")
        lines.append(line)
    export = report.get("export", {})
    if export:
        before = sum(export["node_counts_before"].values())
        after = sum(export["node_counts_after"].values())
        lines.append(f"graph    {before} nodes exported -> {after} after BN folding and clean-up")
    lines += _profile_lines(report.get("engine_profile"))
    speed = report["speed"]
    kernels = speed.get("int8_kernels", "default")
    kernels_note = "" if kernels == "default" else f"; INT8 kernels: {kernels}"
    lines.append(
        f"speed    {speed['where']}, input {'x'.join(map(str, speed['input_shape']))}: "
        f"FP32 {speed['fp32_img_s']:.1f} img/s, INT8 {speed['int8_img_s']:.1f} img/s "
        f"({speed['int8_speedup']:.2f}x{kernels_note})"
    )
    timings = report["timings_s"]
    within = report.get("timings_within", {})
    nested = {name for names in within.values() for name in names}

    def timing(name: str) -> str:
        parts = ", ".join(timing(inner) for inner in within.get(name, []))
        return f"{name} {timings[name]:.1f}s" + (f" ({parts})" if parts else "")

    lines.append("time     " + ", ".join(timing(name) for name in timings if name not in nested))
    for warning in report.get("warnings", []):
        lines.append(f"warning  {warning}")
    return "\n".join(lines)


def _profile_lines(section: dict[str, Any] | None) -> list[str]:
    """The engine profile's spans and how they were chosen, with what running the model found."""
    if not section:
        return []
    spans = ", ".join(f"{axis} {'/'.join(map(str, span))}"
                      for axis, span in section["profile"].items())
    how = {"probed": f"found by running the model: {section.get('runs')} runs, "
                     f"{section.get('seconds', 0.0):.1f}s",
           "given": "given with --profile-shape"}.get(section["chosen"], section["chosen"])
    return [f"profile  {spans} (min/opt/max; {how})",
            *(f"  {line}" for line in section.get("found", []))]


def _judges_table(judges: list[dict[str, Any]]) -> list[str]:
    """One row per judge: the output, its judge, its tolerance, the FP32, fully INT8 and final
    scores, and whether it passed."""
    if not judges:
        return []
    rows = [("output", "judge", "held to", "FP32", "INT8 all", "final", "")]
    for judge in judges:
        kind = judge["judge"]
        rows.append((str(judge["output"] if judge["output"] is not None else "(all)"), kind,
                     judge["tolerance"], _score_text(kind, judge["fp32"]),
                     _score_text(kind, judge["int8_all_layers"]), _score_text(kind, judge["int8"]),
                     ("pass" if judge["passed"] else "FAIL") if judge["held"] else ""))
    widths = [min(max(len(row[column]) for row in rows), 32) for column in range(len(rows[0]))]
    return ["  " + "  ".join(cell[:32].ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]


def _score_text(kind: str, value: float | None) -> str:
    """A judge's score as the summary prints it (None: not finite, an SQNR of an exact copy)."""
    if value is None:
        return "exact" if kind == "sqnr" else "n/a"
    if kind == "cosine":
        return f"{value:.4f}"
    if kind == "sqnr":
        return f"{value:.1f} dB"
    return f"{value:.2f}"
