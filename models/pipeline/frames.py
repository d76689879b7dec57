"""Image sizes: the deployment frame of a model that takes any height and width, the inputs at a
frame, the check that the model runs at the engine profile's frame sizes, and the engine profile
itself (the batch and frame ranges a TensorRT engine is built for)."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.errors import ConfigError, ModelError, first_line
from models.pipeline.options import EXAMPLE_FRAME, BuildOptions


def frame_size(meta: dict[str, Any], options: BuildOptions) -> tuple[int, int] | None:
    """The deployment frame (height, width) of a model whose first input takes any size, else
    None (see :attr:`BuildOptions.frame_size`): the given one, 224 x 224 for the example models,
    or the calibration samples' size."""
    calibrated = _calibrated_frame(meta)
    if not meta["dynamic_hw"] or calibrated is None:
        return None
    if options.frame_size is not None:
        return (int(options.frame_size[0]), int(options.frame_size[1]))
    if options.model is not None:
        return EXAMPLE_FRAME
    return calibrated


def _sample_shape(meta: dict[str, Any], name: str) -> tuple[int, ...]:
    return next(tuple(shape) for input_name, _, shape in meta["inputs"] if input_name == name)


def _calibrated_frame(meta: dict[str, Any]) -> tuple[int, int] | None:
    """The first input's height and width in the calibration samples; None when it is no image."""
    from models.onnx_model import spatial_axes

    axes = spatial_axes(meta["layouts"].get(meta["input_name"]))
    if axes is None:
        return None
    sample = _sample_shape(meta, meta["input_name"])  # no batch axis: one less than the input's
    return int(sample[axes[0] - 1]), int(sample[axes[1] - 1])


def _check_frame_option(meta: dict[str, Any], options: BuildOptions) -> None:
    """Refuse --frame-size for a model whose first input has a fixed height and width."""
    if options.frame_size is not None and not meta["dynamic_hw"]:
        raise ConfigError("--frame-size is for models whose input takes any height and width; "
                          "this one's is fixed", key="--frame-size", input=meta["input_name"],
                          shape=list(_sample_shape(meta, meta["input_name"])))


def _frame_inputs(meta: dict[str, Any], batch: int, frame: tuple[int | None, int | None] | None
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every input's shape and dtype for ``batch`` samples at ``frame``: the calibration samples'
    shape, with the dynamic height and width of the first input, and of every other image input
    calibrated at the same size as it (an aligned depth map, a mask), set to ``frame`` (whose
    entry for a fixed axis is not used)."""
    from models.onnx_model import spatial_axes

    first_hw = _calibrated_frame(meta)
    feeds = {}
    for name, dtype, sample_shape in meta["inputs"]:
        shape = [batch, *sample_shape]
        axes = spatial_axes(meta["layouts"].get(name))
        if frame is not None and axes is not None and first_hw is not None and tuple(
                sample_shape[axis - 1] for axis in axes) == first_hw:
            for axis_name, axis, side in zip(("height", "width"), axes, frame):
                if axis_name in meta["dynamic_hw"] and side is not None:
                    shape[axis] = side
        feeds[name] = (tuple(shape), dtype)
    return feeds


def check_frame_sizes(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions) -> None:
    """Run the FP32 model once at the engine profile's frame sizes beyond the calibration size
    (the optimum and the largest), so that a model that cannot take them (a network that needs
    multiples of 64, or inputs that must match) is refused now, not after calibration or in the
    board's engine build.

    Raises:
        ModelError: the model fails at one of the sizes (names it and ONNX Runtime's reason).
    """
    from models.ort import create_session

    profile = _engine_profile(meta, options)
    if "height" not in profile and "width" not in profile:
        return
    session = create_session(float_bytes, threads=options.threads, fold_relu=False)
    rng = np.random.default_rng(0)
    for role, index in (("optimum", 1), ("largest", 2)):
        frame = (profile.get("height", [None] * 3)[index], profile.get("width", [None] * 3)[index])
        feeds = _frame_inputs(meta, meta.get("fixed_batch") or 1, frame)
        try:
            feed = {name: rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
                    for name, (shape, dtype) in feeds.items()}
            session.run(None, feed)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            shapes = ", ".join(f"{name} {list(shape)}" for name, (shape, _) in feeds.items())
            reason = first_line(exc)
            if isinstance(exc, MemoryError) or "bad_alloc" in reason or "allocate" in reason:
                raise ModelError(f"this host has not enough memory to run the model at the "
                                 f"engine profile's {role} frame size ({shapes}); give a smaller "
                                 "--frame-size (the largest is twice it)",
                                 reason=reason) from None
            raise ModelError(f"the model does not run at the engine profile's {role} frame size "
                             f"({shapes}); give --frame-size with a size it accepts",
                             reason=reason) from None


def _engine_profile(meta: dict[str, Any], options: BuildOptions) -> dict[str, list[int]]:
    """The shape ranges a TensorRT engine for this bundle is built for: batch from 1 to
    ``max_batch`` tuned at ``opt_batch`` and, for models that take any image size, each dynamic
    one of height and width from the smaller of the calibration and deployment sizes to the larger
    of twice the deployment size and the calibration size, tuned at the deployment size
    (:func:`frame_size`). A graph that runs at one batch size only (``meta["fixed_batch"]``)
    gets just that one."""
    fixed = meta.get("fixed_batch")
    profile = {"batch": [fixed] * 3 if fixed else [1, options.opt_batch, options.max_batch]}
    frame, calibrated_frame = frame_size(meta, options), _calibrated_frame(meta)
    if frame is None or calibrated_frame is None:
        return profile
    for axis_name, deployed, calibrated in zip(("height", "width"), frame, calibrated_frame):
        if axis_name in meta["dynamic_hw"]:
            profile[axis_name] = [min(calibrated, deployed), deployed,
                                  max(2 * deployed, calibrated)]
    return profile
