"""``edge-agent build``: trained model -> pruned -> ONNX -> INT8 with mixed precision -> signed bundle.

Everything is produced in a staging directory inside the output directory and moved into place
only when the whole build has succeeded, so a failed or interrupted build leaves no half-written
bundle or report behind. This module runs the stages in order; each concern lives in a module
of its own beside it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from agent import __version__
from agent.deps import require
from agent.errors import KeyFileError
from agent.fsutil import atomic_write_text, fsync_dir, staging_dir
from models.bundle import pack_bundle
from models.calibration import CalibrationSet
from models.pipeline.batching import bundle_batches
from models.pipeline.frames import _check_frame_option, _engine_profile
from models.pipeline.keys import _remove_new_key, _signing_key, _write_new_key
from models.pipeline.options import MIN_AGENT_VERSION, BuildOptions, BuildResult
from models.pipeline.outdir import _bundle_path, _check_before_work, _prepare_out_dir
from models.pipeline.profile import choose_engine_profile
from models.pipeline.report import (_accuracy_report, _budget_reference, _json_default,
                                    _quantization_report, _speed_report, _warnings)
from models.pipeline.sources import _from_onnx, _from_torch
from models.pipeline.stages import _Stages
from models.quantize import (Evaluator, QuantizeConfig, QuantizeResult, finite_or_none,
                             quantize_model)


def build(options: BuildOptions) -> BuildResult:
    """Run the whole pipeline; see the module docstring."""
    _check_before_work(options)
    # The C extensions are imported before any work: Ctrl-C or SIGTERM raises from the signal
    # handler, and an exception raised while onnx's nanobind module initialises aborts the
    # process (no clean-up) instead of unwinding it.
    require("onnx", extra="host", purpose="building bundles")
    require("onnxruntime", extra="device", purpose="building bundles")
    created = _prepare_out_dir(options.out_dir)
    try:
        return _build(options)
    except BaseException:
        if created and not any(options.out_dir.iterdir()):
            options.out_dir.rmdir()
        raise


def _build(options: BuildOptions) -> BuildResult:
    stages = _Stages()
    started = time.perf_counter()
    report: dict[str, Any] = {"agent_version": __version__}
    key, key_id, new_key_path = _signing_key(options)

    with staging_dir(options.out_dir, prefix=f".build-{os.getpid()}-") as work:
        float_bytes, evaluator, calibration, meta = _load_model(options, report, stages)
        name, version, bundle_path = _bundle_path(options)
        quantized = _quantize(float_bytes, evaluator, calibration, meta, options, report, stages,
                              work)
        speed = stages.run("host speed check", _speed_report, float_bytes, quantized.model_bytes,
                           meta, options)
        report["speed"] = speed
        # Earlier stages may have warned already (a fixed batch, models.pipeline.batching).
        report["warnings"] = report.get("warnings", []) + _warnings(quantized, meta, speed)
        files, engines = _model_files(work, quantized, meta, options, stages)

        manifest = _manifest(name, version, quantized, engines, report["accuracy"], meta, options)
        if new_key_path is not None:
            try:  # created exclusively: of two builds into one directory, one makes the pair
                _write_new_key(key, new_key_path)
            except KeyFileError:
                # Another build into this directory made it meanwhile: sign with that one, as
                # this build would have had it started later.
                key, key_id, new_key_path = _signing_key(options)
        try:
            report_text = _finish_report(report, name, version, meta, key_id, stages, started)
            (work / "report.json").write_text(report_text)
            files["report.json"] = work / "report.json"
            final_manifest = pack_bundle(bundle_path, manifest, files, key, overwrite=False)
        except BaseException:
            if new_key_path is not None:  # a failed build leaves no key behind
                _remove_new_key(new_key_path)
            raise
        report_path = options.out_dir / "report.json"
        atomic_write_text(report_path, report_text)
        fsync_dir(options.out_dir)
    return BuildResult(bundle_path, report_path, report, final_manifest)


def _load_model(options: BuildOptions, report: dict[str, Any], stages: _Stages
                ) -> tuple[bytes, Evaluator, CalibrationSet, dict[str, Any]]:
    """The FP32 ONNX model from the source the options name, with the engine profile chosen
    (the sizes it takes, found by running it, or given), its evaluator, calibration set and
    ``meta``."""
    if options.onnx is not None:
        float_bytes, evaluator, calibration, meta = stages.run(
            "load ONNX", _from_onnx, options, report)
    else:
        float_bytes, evaluator, calibration, meta = stages.run(
            "prepare PyTorch model", _from_torch, options, report, stages)
    _check_frame_option(meta, options)
    report["engine_profile"] = stages.run("input sizes", choose_engine_profile, float_bytes,
                                          meta, options, calibration.arrays)
    return float_bytes, evaluator, calibration, meta


def _quantize(float_bytes: bytes, evaluator: Evaluator, calibration: CalibrationSet,
              meta: dict[str, Any], options: BuildOptions, report: dict[str, Any],
              stages: _Stages, work: Path) -> QuantizeResult:
    """INT8 calibration and the mixed-precision search; fills the report's quantization and
    accuracy sections."""
    quantized: QuantizeResult = stages.run(
        "INT8 calibration and mixed precision",
        quantize_model,
        float_bytes,
        calibration,
        evaluator,
        QuantizeConfig(method=options.calib_method, accuracy_budget=options.accuracy_budget,
                       reference_metric=_budget_reference(meta), progress=options.progress,
                       fixed_batch=meta.get("fixed_batch"), search_time_s=options.search_time_s,
                       allow_no_int8=options.allow_no_int8),
        work / "quantize",
    )
    report["quantization"] = _quantization_report(quantized, options)
    report["accuracy"] = _accuracy_report(quantized, meta, options)
    # What a CPU daemon will answer: its ONNX Runtime backend folds ReLUs (models.ort_relu).
    report["accuracy"]["int8_onnxruntime_served"] = finite_or_none(
        evaluator.score(evaluator.outputs(quantized.model_bytes, fold_relu=True)), 4)
    return quantized


def _model_files(work: Path, quantized: QuantizeResult, meta: dict[str, Any],
                 options: BuildOptions, stages: _Stages) -> tuple[dict[str, Path], dict[str, str]]:
    """The bundle's model files written in ``work`` (the INT8 ONNX model and, with --engine, a
    TensorRT engine), and the engines by fingerprint."""
    files = {"model.onnx": work / "model.onnx"}
    files["model.onnx"].write_bytes(quantized.model_bytes)
    engines: dict[str, str] = {}
    if options.build_engine:
        engines = stages.run("TensorRT engine", _build_engine, files, work, quantized,
                             _engine_profile(meta, options),
                             meta["layouts"].get(meta["input_name"]) or "NCHW")
    return files, engines


def _finish_report(report: dict[str, Any], name: str, version: int, meta: dict[str, Any],
                   key_id: str, stages: _Stages, started: float) -> str:
    """The report completed with what the bundle is and what each stage took, as JSON."""
    report.update(
        {
            "name": name,
            "version": version,
            "source": meta["source"],
            "signing_key_id": key_id,
            "timings_s": stages.seconds,
            "timings_within": stages.within,
        }
    )
    report["timings_s"]["total"] = round(time.perf_counter() - started, 2)
    return json.dumps(report, indent=2, sort_keys=True, default=_json_default) + "\n"


def _manifest(name: str, version: int, quantized: QuantizeResult, engines: dict[str, str],
              accuracy: dict[str, Any], meta: dict[str, Any], options: BuildOptions) -> dict[str, Any]:
    """The bundle manifest (design 5.1) without the fields pack_bundle fills in."""
    import onnx

    from models.onnx_model import io_specs

    inputs, outputs = io_specs(onnx.load_from_string(quantized.model_bytes))
    return {
        "name": name,
        "version": version,
        "inputs": [spec.to_manifest(meta["layouts"].get(spec.name)) for spec in inputs],
        "outputs": [spec.to_manifest() for spec in outputs],
        "preprocessing": meta.get("preprocessing"),
        "precision": quantized.precision_plan(),
        **bundle_batches(meta, options),
        "engine_profile": _engine_profile(meta, options),
        "calibration": quantized.calibration,
        "accuracy": accuracy,
        "engines": engines,
        "min_agent_version": MIN_AGENT_VERSION,
        **({"targets": list(options.targets)} if options.targets else {}),
    }


def _build_engine(files: dict[str, Path], work: Path, quantized: QuantizeResult,
                  profile: dict[str, list[int]], layout: str) -> dict[str, str]:
    from models.engine import EngineBuildConfig, build_engine

    unset: list[int | None] = [None, None, None]
    height: list[int | None] = list(profile.get("height") or unset)
    width: list[int | None] = list(profile.get("width") or unset)
    config = EngineBuildConfig(
        layout=layout,
        min_batch=profile["batch"][0],
        opt_batch=profile["batch"][1],
        max_batch=profile["batch"][2],
        min_height=height[0], opt_height=height[1], max_height=height[2],
        min_width=width[0], opt_width=width[1], max_width=width[2],
        fp16_layers=tuple(quantized.fp16_layers),
    )
    result = build_engine(files["model.onnx"], config)
    member = f"engines/{result.fingerprint.key()}.plan"
    path = work / member
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(result.plan)
    files[member] = path
    if result.timing_cache:
        (work / "timing.cache").write_bytes(result.timing_cache)
        files["timing.cache"] = work / "timing.cache"
    return {result.fingerprint.key(): member}
