"""Image sizes: the deployment frame of a model that takes any height and width, the inputs at a
frame, and the engine profile chosen for them (:mod:`models.pipeline.profile` chooses it)."""

from __future__ import annotations

from typing import Any

from agent.errors import ConfigError, InternalError
from models.pipeline.options import EXAMPLE_FRAME, BuildOptions


def frame_size(meta: dict[str, Any], options: BuildOptions) -> tuple[int, int] | None:
    """The deployment frame (height, width) of a model whose first input takes any size, else
    None (see :attr:`BuildOptions.frame_size`): the given one (or the first input's
    ``--profile-shape`` opt), 224 x 224 for the example models, or the calibration samples'
    size."""
    from models.onnx_model import spatial_axes

    calibrated = _calibrated_frame(meta)
    if not meta["dynamic_hw"] or calibrated is None:
        return None
    given = next((shape for shape in options.profile_shapes
                  if shape.name == meta["input_name"]), None)
    axes = spatial_axes(meta["layouts"].get(meta["input_name"]))
    if given is not None and axes is not None and len(given.opt) > max(axes):
        return given.opt[axes[0]], given.opt[axes[1]]
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


def _engine_profile(meta: dict[str, Any], options: BuildOptions) -> dict[str, list[int]]:
    """The shape ranges a TensorRT engine for this bundle is built for (the manifest's
    ``engine_profile``): chosen by :func:`models.pipeline.profile.choose_engine_profile` before
    calibration, by running the model or from ``--profile-shape``."""
    if "engine_profile" not in meta:
        raise InternalError("the engine profile is used before it is chosen")
    return meta["engine_profile"]
