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
from models.quantize import QuantizeResult


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
        "sensitivity": [layer.to_dict() for layer in result.sensitivity],
        "search": result.search_trace,
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
    accuracy: dict[str, Any] = {
        "metric": result.metric_name,
        "metric_description": result.metric_description,
        "dataset": meta["dataset"],
        "fp32": round(result.float_metric, 3),
        "int8_all_layers": round(result.full_int8_metric, 3),
        "int8": round(result.int8_metric, 3),
        # The drop the budget holds: from the unpruned model when pruning ran, else from FP32.
        "drop": round(result.budget_drop, 3),
        "int8_drop": round(result.drop, 3),
        "budget": options.accuracy_budget,
        "budget_from": "FP32 (ONNX)",
        "fp16_layers": len(result.fp16_layers),
        # Every output of the final model against FP32, on the sensitivity samples.
        "outputs": [output.to_dict() for output in result.outputs],
    }
    if meta.get("fp32_torch_metric") is not None:
        accuracy["fp32_unpruned"] = round(meta["fp32_torch_metric"], 3)
    if meta.get("pruned_torch_metric") is not None:
        accuracy["pruned_fp32"] = round(meta["pruned_torch_metric"], 3)
        accuracy["drop_vs_unpruned"] = accuracy["drop"]  # the budgeted drop counts from it
        accuracy["budget_from"] = "unpruned FP32 (PyTorch)"
    return accuracy


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
    lines += [
        f"  FP32 (ONNX)        {accuracy['fp32']:.2f}",
        f"  INT8, all layers   {accuracy['int8_all_layers']:.2f}",
        f"  INT8, mixed        {accuracy['int8']:.2f}  (drop {accuracy['drop']:.2f} from "
        f"{accuracy['budget_from']}, budget {accuracy['budget']:.2f}, "
        f"{accuracy['fp16_layers']} layer(s) in FP16)",
    ]
    if "int8_onnxruntime_served" in accuracy:
        lines.append(f"  INT8, served (CPU) {accuracy['int8_onnxruntime_served']:.2f}  (ONNX Runtime "
                     "folds ReLUs into a finer UINT8 step; TensorRT runs the line above)")
    if len(accuracy.get("outputs", [])) > 1:
        lines.append("  outputs, INT8 against FP32: " + ", ".join(
            f"{output['name']} "
            + ("n/a" if output["sqnr_db"] is None else f"{output['sqnr_db']:.1f} dB")
            + ("" if output["judged_by_budget"] else " (not budgeted)")
            for output in accuracy["outputs"]))
    fp16 = report["quantization"]["fp16_layers"]
    if fp16:
        lines.append("  FP16 layers: " + ", ".join(fp16))
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
