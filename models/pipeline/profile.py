"""The engine profile a bundle is built for, chosen before any calibration: the batch range and,
for a model whose first input takes any height or width, the span of each, found by running the
FP32 model (:mod:`models.input_sizes`) or given with ``--profile-shape``
(:mod:`models.pipeline.profile_shape`) and checked by running it.

The profile lands in ``meta["engine_profile"]`` (the manifest's ``engine_profile``: ``batch``,
``height``, ``width`` as ``[min, opt, max]``), and how it was chosen in the report. Every error
here names a way out that was run and works: a ``--frame-size`` or ``--profile-shape`` the model
takes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from agent.errors import ModelError, first_line
from models.input_sizes import (Frame, Runner, SizeFindings, SizeRuns, is_memory_failure, nearest_frame,
                                probe_sizes)
from models.pipeline.frames import _calibrated_frame, _frame_inputs, frame_size
from models.pipeline.options import BuildOptions
from models.pipeline.profile_shape import KEY, ProfileShape, given_profile

log = logging.getLogger(__name__)

AXES = ("height", "width")


def choose_engine_profile(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions,
                          samples: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Choose the engine profile (stored in ``meta["engine_profile"]``) and say how, for the
    report. Runs the FP32 model on the calibration ``samples`` resized to each size (random
    inputs without them), one sample at a time (the batch the graph fixes, if it does).

    Returns:
        The report's section: ``profile``, ``chosen`` (``probed``, ``given`` or ``fixed size``)
        and, when probed, what was found for each axis, the runs and their time.

    Raises:
        ModelError: the model does not run at the deployment frame or a given shape (names a
            ``--frame-size`` or ``--profile-shape`` that does), or not even on one sample.
        ConfigError: a ``--profile-shape`` that does not fit the model.
    """
    if options.profile_shapes:
        section = _given(float_bytes, meta, options, samples)
    elif meta["dynamic_hw"] and _calibrated_frame(meta) is not None:
        section = _probed(float_bytes, meta, options, samples)
    else:
        section = {"chosen": "fixed size", "profile": {"batch": _batch_span(meta, options)}}
    meta["engine_profile"] = section["profile"]
    return section


def _batch_span(meta: dict[str, Any], options: BuildOptions) -> list[int]:
    """A graph that fixes its batch at N gets [N, N, N]; otherwise 1 to --max-batch, tuned at
    --opt-batch."""
    fixed = meta.get("fixed_batch")
    if fixed is not None:
        return [int(fixed)] * 3
    return [1, options.opt_batch, options.max_batch]


def _probed(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions,
            samples: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    calibrated, deployed = _frames(meta, frame_size(meta, options))
    bound = {name: max(2 * deployed[name], calibrated[name]) for name in deployed}
    runs = SizeRuns(_runner(float_bytes, meta, options, samples))
    findings = probe_sizes(runs, calibrated, deployed, bound)
    if findings.base_failure is not None:
        raise _base_failure(meta, findings)
    if findings.deployed_failure is not None:
        raise _deployment_failure(meta, runs, findings, deployed)
    for line in findings.lines():
        log.info("input sizes: %s", line)
    profile: dict[str, Any] = {"batch": _batch_span(meta, options)}
    profile.update({name: axis.span for name, axis in findings.axes.items()})
    return {
        "chosen": "probed",
        "profile": profile,
        "axes": {name: axis.to_report() for name, axis in findings.axes.items()},
        "found": findings.lines(),
        "runs": findings.runs,
        "seconds": round(findings.seconds, 2),
    }


def _given(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions,
           samples: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    """The ``--profile-shape`` profile, checked against the graph, then run at its smallest,
    optimum and largest frames (one sample each: the batch range is the batch check's)."""
    import onnx

    from models.onnx_model import io_specs

    inputs, _ = io_specs(onnx.load_from_string(float_bytes))
    declared = {spec.name: spec.shape for spec in inputs}
    shapes = options.profile_shapes
    profile = given_profile(shapes, meta, declared, frame_given=options.frame_size is not None)
    dynamic = [name for name in AXES if name in profile]
    if dynamic:
        runs = SizeRuns(_runner(float_bytes, meta, options, samples))
        for bound, label in enumerate(("min", "opt", "max")):
            frame = {name: profile[name][bound] for name in dynamic}
            reason = runs.reason(frame)
            if reason is not None:
                raise _given_failure(meta, runs, profile, frame, label, reason)
    return {"chosen": "given", "profile": profile,
            "given": [shape.text() for shape in shapes],
            "checked": "ran at min, opt and max (one sample)" if dynamic else "batch only"}


def _frames(meta: dict[str, Any], deployment: tuple[int, int] | None
            ) -> tuple[dict[str, int], dict[str, int]]:
    """The calibrated and deployment frames of the first input's dynamic axes."""
    calibrated_frame = _calibrated_frame(meta)
    assert calibrated_frame is not None and deployment is not None  # dynamic_hw and an image
    calibrated = {name: size for name, size in zip(AXES, calibrated_frame)
                  if name in meta["dynamic_hw"]}
    deployed = {name: size for name, size in zip(AXES, deployment) if name in calibrated}
    return calibrated, deployed


def _runner(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions,
            samples: Mapping[str, np.ndarray] | None) -> Runner:
    """The FP32 model run at a frame on one sample (the fixed batch, if the graph has one): None
    when it ran, else ONNX Runtime's reason on one line. ONNX Runtime's own log of a failed run
    is silenced: a probe expects failures."""
    from agent.deps import require
    from models.ort import create_session

    ort = require("onnxruntime", extra="host", purpose="edge-agent build")
    session = create_session(float_bytes, threads=options.threads, fold_relu=False)
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4  # fatal only
    batch = int(meta.get("fixed_batch") or 1)
    rng = np.random.default_rng(0)

    def run(frame: Frame) -> str | None:
        feeds = _frame_inputs(meta, batch, (frame.get("height"), frame.get("width")))
        try:
            feed = {name: _input_at(None if samples is None else samples.get(name), shape,
                                    dtype, rng)
                    for name, (shape, dtype) in feeds.items()}
            session.run(None, feed, run_options)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            reason = first_line(exc)
            return f"MemoryError: {reason}" if isinstance(exc, MemoryError) else reason
        return None

    return run


def _input_at(sample: np.ndarray | None, shape: tuple[int, ...], dtype: str,
              rng: np.random.Generator) -> np.ndarray:
    """An input of ``shape``: the first real sample, resized to it by nearest neighbour on every
    axis (a real image keeps a model's data-dependent paths, score thresholds say, as they are
    in use), or random values without one."""
    if sample is None or sample.ndim != len(shape):
        return rng.standard_normal(shape).astype(dtype)
    array = sample[:1]
    for axis, size in enumerate(shape):
        if array.shape[axis] != size:
            array = np.take(array, np.arange(size) * array.shape[axis] // size, axis=axis)
    return np.ascontiguousarray(array, dtype=dtype)


def _shapes(meta: dict[str, Any], frame: Frame) -> str:
    batch = int(meta.get("fixed_batch") or 1)
    feeds = _frame_inputs(meta, batch, (frame.get("height"), frame.get("width")))
    return ", ".join(f"{name} {list(shape)}" for name, (shape, _) in feeds.items())


def _frame_text(meta: dict[str, Any], frame: Frame) -> str:
    """``frame`` as --frame-size takes it (the calibrated size for a fixed axis)."""
    calibrated = _calibrated_frame(meta)
    assert calibrated is not None
    height, width = (frame.get(name, size) for name, size in zip(AXES, calibrated))
    return f"{height}x{width}"


def _base_failure(meta: dict[str, Any], findings: SizeFindings) -> ModelError:
    calibrated = dict(zip(AXES, _calibrated_frame(meta) or ()))
    return ModelError(f"the FP32 model does not run on one calibration sample "
                      f"({_shapes(meta, calibrated)}), so no input size can be chosen for it; the "
                      "samples in --calib-dir must be inputs the model runs on",
                      reason=findings.base_failure)


def _deployment_failure(meta: dict[str, Any], runs: SizeRuns, findings: SizeFindings,
                        deployed: dict[str, int]) -> ModelError:
    """The model cannot take the deployment frame: the error names the nearest frame that runs
    (:func:`models.input_sizes.nearest_frame`)."""
    way_out = _frame_text(meta, nearest_frame(runs, findings, deployed))
    reason = findings.deployed_failure or ""
    if is_memory_failure(reason):
        return ModelError(f"this host has not enough memory to run the model at the deployment "
                          f"frame ({_shapes(meta, deployed)}); give a smaller --frame-size, e.g. "
                          f"--frame-size {way_out}, which runs", reason=reason)
    found = "; ".join(axis.describe_sizes() for axis in findings.axes.values())
    return ModelError(f"the model does not run at the deployment frame "
                      f"({_shapes(meta, deployed)}): {reason}; give --frame-size {way_out}, "
                      f"which runs ({found})")


def _given_failure(meta: dict[str, Any], runs: SizeRuns, profile: Mapping[str, list[int]],
                   frame: dict[str, int], label: str, reason: str) -> ModelError:
    """The model does not run at a --profile-shape frame: the error names the shape and one
    --profile-shape that runs, probed around the given opt (else the calibrated frame) up to
    the given max."""
    first = str(meta["input_name"])
    batch = int(meta.get("fixed_batch") or 1)
    failed = f"{first} {list(_frame_inputs(meta, batch, _pair(frame))[first][0])}"
    calibrated, _ = _frames(meta, _calibrated_frame(meta))
    optimum = {name: span[1] for name, span in profile.items() if name in calibrated}
    deployed = optimum if runs.ok(optimum) else calibrated
    largest = {name: max(span[2], deployed[name]) for name, span in profile.items()
               if name in calibrated}
    findings = probe_sizes(runs, calibrated, deployed, largest)
    if not findings.ok:
        findings = probe_sizes(runs, calibrated, calibrated, largest)
    message = (f"the model does not run with {failed} (the {KEY} {label}'s height and width, "
               f"at batch {batch}): {reason}")
    if findings.ok:
        spans = {name: axis.span for name, axis in findings.axes.items()}
        # The given smallest frame, on the axes' strides, where it runs: what was asked for.
        smallest = {name: min(spans[name][0], axis.on_stride(profile[name][0], "up"))
                    for name, axis in findings.axes.items()}
        if runs.ok(smallest):
            for name, size in smallest.items():
                spans[name][0] = size
        suggestion = ProfileShape(first, *(
            _frame_inputs(meta, size, _pair({name: span[bound] for name, span in spans.items()})
                          )[first][0] for bound, size in enumerate(profile["batch"])))
        message += (f"; try {KEY} {suggestion.text()}, which runs (found: "
                    f"{'; '.join(findings.lines())})")
    return ModelError(message)


def _pair(frame: Frame) -> tuple[int | None, int | None]:
    return frame.get("height"), frame.get("width")
