"""What an engine build is asked for: the validated build settings and the optimization profile.

:class:`EngineBuildConfig` checks every value when it is made (a ConfigError names the bad one);
:func:`profile_shapes` turns it and the network's input shapes into the min/opt/max shape of each
input. Nothing here touches TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError, EngineError

LAYOUTS = ("NCHW", "NHWC")
# Documented range of IBuilderConfig.builder_optimization_level (TensorRT 8.6 to 10.x).
OPTIMIZATION_LEVELS = range(0, 6)


@dataclass(frozen=True)
class ShapeRange:
    """The min/opt/max shapes of one network input in the optimization profile."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = {len(self.min), len(self.opt), len(self.max)}
        if len(ranks) != 1:
            raise ConfigError("min, opt and max shapes must have the same rank", found=self)
        for low, mid, high in zip(self.min, self.opt, self.max, strict=True):
            if not 0 < low <= mid <= high:
                raise ConfigError("shape range must satisfy 0 < min <= opt <= max per axis", found=self)


def _check_int(name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is an int subclass; ``opt_batch=True`` is a mistake, not a batch of one.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer", key=name, found=repr(value))
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}", key=name, found=value)


def _check_range(names: tuple[str, str, str], values: tuple[int | None, int | None, int | None]) -> None:
    given = [value is not None for value in values]
    if any(given) and not all(given):
        missing = [name for name, present in zip(names, given, strict=True) if not present]
        raise ConfigError(f"{', '.join(names)} must be given together", key=missing[0])
    if not all(given):
        return
    for name, value in zip(names, values, strict=True):
        _check_int(name, value, minimum=1)
    low, mid, high = values
    if not (low is not None and mid is not None and high is not None and low <= mid <= high):
        raise ConfigError(f"need {names[0]} <= {names[1]} <= {names[2]}", key=names[1], found=values)


@dataclass(frozen=True, kw_only=True)
class EngineBuildConfig:
    """What to build. Cheap to construct; every value is validated here (ConfigError names it).

    Attributes:
        min_batch, opt_batch, max_batch: Range of the batch axis (axis 0) when the model leaves it
            dynamic; TensorRT tunes kernels for ``opt_batch``.
        min_height ... max_width: Ranges of the H and W axes of 4-D inputs that the model leaves
            dynamic (axes picked by ``layout``). Static axes keep the model's value.
        layout: ``"NCHW"`` or ``"NHWC"``: where H and W sit in 4-D inputs.
        workspace_bytes: Cap on the builder's scratch memory; ``None`` keeps TensorRT's default
            (all device memory, which on a Jetson is memory shared with the CPU).
        fp16_layers: ONNX node names to keep out of INT8 (the bundle's precision plan fallback).
        int8, fp16: Builder precision flags (8.5 and 10.x; the graph decides on 11.x).
        strict_precision: Obey the FP16 fallback (build fails if impossible) rather than prefer it.
        dla_core: Run on this DLA core instead of the GPU; ``gpu_fallback`` lets unsupported layers
            run on the GPU.
        optimization_level: ``builder_optimization_level`` (0-5; TensorRT 8.6+).
        timing_cache_path: Timing cache to load before and save after the build.
    """

    min_batch: int = 1
    opt_batch: int
    max_batch: int
    min_height: int | None = None
    opt_height: int | None = None
    max_height: int | None = None
    min_width: int | None = None
    opt_width: int | None = None
    max_width: int | None = None
    layout: str = "NCHW"
    workspace_bytes: int | None = 1 << 30
    fp16_layers: tuple[str, ...] = ()
    int8: bool = True
    fp16: bool = True
    strict_precision: bool = True
    dla_core: int | None = None
    gpu_fallback: bool = True
    optimization_level: int | None = None
    timing_cache_path: Path | None = None

    def profile_spans(self) -> dict[str, tuple[int, int, int]]:
        """``[min, opt, max]`` of each axis the profile sets: batch, and height and width where given."""
        spans = {"batch": (self.min_batch, self.opt_batch, self.max_batch)}
        for axis in ("height", "width"):
            span = tuple(getattr(self, f"{bound}_{axis}") for bound in ("min", "opt", "max"))
            if all(value is not None for value in span):
                spans[axis] = span  # type: ignore[assignment]
        return spans

    def __post_init__(self) -> None:
        _check_range(
            ("min_batch", "opt_batch", "max_batch"), (self.min_batch, self.opt_batch, self.max_batch)
        )
        _check_range(
            ("min_height", "opt_height", "max_height"), (self.min_height, self.opt_height, self.max_height)
        )
        _check_range(
            ("min_width", "opt_width", "max_width"), (self.min_width, self.opt_width, self.max_width)
        )
        if self.layout not in LAYOUTS:
            raise ConfigError(
                f"layout must be one of {', '.join(LAYOUTS)}", key="layout", found=self.layout
            )
        _check_int("workspace_bytes", self.workspace_bytes, minimum=1, optional=True)
        _check_int("dla_core", self.dla_core, minimum=0, optional=True)
        if self.dla_core is not None:
            # DLA has no dynamic shapes: with a range, TensorRT puts every layer on the GPU (with
            # gpu_fallback) or fails, so a "DLA" engine would quietly be a GPU one.
            for axis, span in self.profile_spans().items():
                if len(set(span)) > 1:
                    raise ConfigError(
                        "DLA runs static shapes only: min, opt and max must be equal (a range "
                        "would put every layer on the GPU)", key=f"{axis} range", found=list(span)
                    )
        _check_int("optimization_level", self.optimization_level, minimum=0, optional=True)
        if self.optimization_level is not None and self.optimization_level not in OPTIMIZATION_LEVELS:
            raise ConfigError(
                "optimization_level must be between 0 and 5",
                key="optimization_level",
                found=self.optimization_level,
            )
        for name in ("int8", "fp16", "strict_precision", "gpu_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{name} must be true or false", key=name, found=repr(getattr(self, name))
                )
        layers = self.fp16_layers
        if isinstance(layers, str) or not all(isinstance(name, str) and name for name in layers):
            raise ConfigError(
                "fp16_layers must be a sequence of non-empty ONNX node names",
                key="fp16_layers",
                found=repr(layers),
            )
        duplicates = sorted({name for name in layers if list(layers).count(name) > 1})
        if duplicates:
            raise ConfigError("fp16_layers lists a node twice", key="fp16_layers", found=duplicates)
        object.__setattr__(self, "fp16_layers", tuple(layers))
        if layers and not self.fp16:
            raise ConfigError("fp16_layers needs fp16=True", key="fp16_layers", found=len(layers))
        if self.timing_cache_path is not None:
            object.__setattr__(self, "timing_cache_path", Path(self.timing_cache_path))

    def spatial_range(self, axis: str) -> tuple[int, int, int] | None:
        """``(min, opt, max)`` for ``"height"`` or ``"width"``, or None when not configured."""
        low, mid, high = (getattr(self, f"{part}_{axis}") for part in ("min", "opt", "max"))
        if low is None or mid is None or high is None:
            return None
        return (low, mid, high)


def profile_shapes(
    inputs: Mapping[str, Sequence[int]], config: EngineBuildConfig
) -> tuple[dict[str, ShapeRange], list[str]]:
    """Shape ranges for every network input; dynamic (-1) axes get the configured ranges.

    Args:
        inputs: Each input's shape as the network reports it, with -1 for dynamic axes.
        config: Batch and spatial ranges, and the layout that places H and W.

    Returns:
        The ranges by input name, and warnings (a configured range that a static axis ignores).

    Raises:
        EngineError: if an axis is dynamic and no range covers it.
    """
    ranges: dict[str, ShapeRange] = {}
    warnings: list[str] = []
    batch = (config.min_batch, config.opt_batch, config.max_batch)
    for name, shape in inputs.items():
        low: list[int] = []
        mid: list[int] = []
        high: list[int] = []
        rank = len(shape)
        spatial_axes = {}
        if rank == 4:
            height_axis, width_axis = (2, 3) if config.layout == "NCHW" else (1, 2)
            spatial_axes = {height_axis: "height", width_axis: "width"}
        for axis, dim in enumerate(shape):
            if dim >= 0:
                low.append(dim)
                mid.append(dim)
                high.append(dim)
                if axis == 0 and rank > 1 and dim != config.max_batch and config.max_batch > 1:
                    warnings.append(
                        f"input '{name}' has a static batch of {dim}; max_batch={config.max_batch} ignored"
                    )
                continue
            if axis == 0 and rank > 1:
                axis_range: tuple[int, int, int] | None = batch
            elif axis in spatial_axes:
                axis_range = config.spatial_range(spatial_axes[axis])
                if axis_range is None:
                    label = spatial_axes[axis]
                    raise EngineError(
                        f"input '{name}' has a dynamic {label} axis; set min/opt/max_{label}",
                        input=name,
                        axis=axis,
                        shape=list(shape),
                    )
            else:
                axis_range = None
            if axis_range is None:
                raise EngineError(
                    f"input '{name}' axis {axis} is dynamic and no range covers it "
                    f"(only the batch axis and the H/W axes of {config.layout} inputs get ranges)",
                    input=name,
                    axis=axis,
                    shape=list(shape),
                )
            low.append(axis_range[0])
            mid.append(axis_range[1])
            high.append(axis_range[2])
        ranges[name] = ShapeRange(min=tuple(low), opt=tuple(mid), max=tuple(high))
    return ranges, warnings
