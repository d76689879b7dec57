"""Build a TensorRT engine from the bundle's QDQ INT8 ONNX model, on the device that will run it.

An engine only runs on the GPU and TensorRT version it was built with, so the device builds it from
``model.onnx`` on first use and caches it under ``engines/<fingerprint>.plan`` (design 5.1). This
module does that build for the TensorRT releases JetPack ships:

* 8.5 (JetPack 5.1): weakly typed network created with ``EXPLICIT_BATCH``; INT8 and FP16 builder
  flags; the bundle's FP16 fallback layers get a per-layer precision that the builder must obey.
* 10.x (JetPack 6 and 7): the same, without ``EXPLICIT_BATCH`` (implicit batch is gone). The weak
  typing APIs were deprecated in 10.12 but still work.
* 11.x: every network is strongly typed and the precision flags are gone; the precision comes from
  the graph (Q/DQ nodes and FP16 casts). FP16 fallback layers must therefore already be FP16 in
  the ONNX (ModelOpt AutoCast does that on the host); the builder checks it and refuses otherwise.

``tensorrt`` is imported inside the functions that use it (JetPack provides it; it is never a pip
dependency), so importing this module needs neither TensorRT nor torch. The calls are written
against the ``tensorrt-stubs`` type stubs and checked with mypy (tools/trt_stubs.py).

The device fingerprint that names the plan is models/fingerprint.py, which the runtime uses too.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from agent import deps
from agent.errors import ConfigError, EngineError, StopRequested
from agent.fsutil import atomic_write_bytes
from models.fingerprint import DeviceFingerprint, GpuModel, cuda_gpu_model, read_l4t_release

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

LAYOUTS = ("NCHW", "NHWC")
# Documented range of IBuilderConfig.builder_optimization_level (TensorRT 8.6 to 10.x).
OPTIMIZATION_LEVELS = range(0, 6)


# --------------------------------------------------------------------------------------------
# Configuration


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


# --------------------------------------------------------------------------------------------
# TensorRT version rules


@dataclass(frozen=True)
class TensorRTFeatures:
    """The version-dependent parts of the build API, decided from ``trt.__version__``."""

    version: tuple[int, int, int]
    # 8.x: the ONNX parser only accepts networks created with EXPLICIT_BATCH.
    needs_explicit_batch: bool
    # < 11: BuilderFlag.INT8/FP16, layer.precision and the precision-constraint flags exist.
    weak_typing: bool
    # 8.6+: IBuilderConfig.builder_optimization_level.
    optimization_level: bool
    # 10.0+: IBuilderConfig.progress_monitor (progress reports, and a build that can be stopped).
    progress_monitor: bool = False

    @classmethod
    def from_version(cls, text: str) -> TensorRTFeatures:
        match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
        if match is None:
            raise EngineError("cannot parse the TensorRT version", found=text)
        version = (int(match[1]), int(match[2]), int(match[3] or 0))
        if version < (8, 5, 0):
            raise EngineError("TensorRT 8.5 (JetPack 5.1) or newer is needed", found=text)
        if version[0] in (9,) or version[0] > 11:
            # 9.x was a data-centre-only line and 12+ does not exist yet; the 11.x rules
            # (strong typing) are the safer guess for anything newer than 10.
            log.warning(
                "TensorRT %s is not a tested release; applying the %s rules",
                text,
                "10.x" if version[0] == 9 else "11.x",
            )
        return cls(
            version=version,
            needs_explicit_batch=version[0] < 10,
            weak_typing=version[0] < 11,
            optimization_level=version >= (8, 6, 0),
            progress_monitor=version >= (10, 0, 0),
        )


# --------------------------------------------------------------------------------------------
# Build


@dataclass(frozen=True)
class EngineBuildResult:
    """A built engine and what it was built for."""

    plan: bytes
    fingerprint: DeviceFingerprint
    timing_cache: bytes | None
    build_seconds: float
    tensorrt_version: str
    profile: dict[str, ShapeRange] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class LogCapture:
    """TensorRT logger messages kept for error reports; also forwarded to Python logging."""

    messages: list[tuple[str, str]] = field(default_factory=list)

    def add(self, severity: str, message: str) -> None:
        level = {
            "INTERNAL_ERROR": logging.ERROR,
            "ERROR": logging.ERROR,
            "WARNING": logging.WARNING,
            "INFO": logging.DEBUG,
        }.get(severity, logging.DEBUG)
        log.log(level, "TensorRT: %s", message)
        if severity in ("INTERNAL_ERROR", "ERROR", "WARNING"):
            self.messages.append((severity, message))

    def of(self, *severities: str) -> list[str]:
        return [message for severity, message in self.messages if severity in severities]


def require_tensorrt() -> None:
    """Fail with a clear error unless the real ``tensorrt`` module is importable."""
    deps.require_tensorrt("building a TensorRT engine (TensorRT comes with JetPack, e.g. the "
                          "python3-libnvinfer package, not from pip)")


# TensorRT's plugin library keeps a raw pointer to the logger ``init_libnvinfer_plugins`` was given
# (the binding adds no keep-alive) and logs through it whenever a plugin is looked up or created,
# long after the call: a per-build logger freed when the build returns would be used after free
# by the next deserialize. So the plugins are registered once per process, with a logger that
# lives as long as the process. Keyed by module, because tests swap fake TensorRT modules in.
_plugin_registrations: dict[ModuleType, tuple[object, bool]] = {}  # module -> (logger, ok)
_plugin_lock = threading.Lock()


def init_plugins() -> bool:
    """Register TensorRT's standard plugins (once per process); False if the library refused."""
    import tensorrt as trt

    with _plugin_lock:
        if trt not in _plugin_registrations:
            logger = forwarding_logger(logging.getLogger(__name__ + ".plugins"))
            ok = bool(trt.init_libnvinfer_plugins(logger, ""))
            _plugin_registrations[trt] = (logger, ok)
            if not ok:
                log.warning("TensorRT's plugin library did not initialise; models that need "
                            "plugins will fail")
        return _plugin_registrations[trt][1]


def forwarding_logger(target: logging.Logger,
                      on_error: Callable[[str], None] | None = None) -> trt.ILogger:
    """A TensorRT logger that writes to ``target`` (TensorRT's INFO at DEBUG) and hands every
    error to ``on_error``."""
    import tensorrt as trt

    levels = {
        trt.ILogger.INTERNAL_ERROR: logging.ERROR,
        trt.ILogger.ERROR: logging.ERROR,
        trt.ILogger.WARNING: logging.WARNING,
        trt.ILogger.INFO: logging.DEBUG,
    }

    class _ForwardingLogger(trt.ILogger):
        def __init__(self) -> None:
            # pybind11 requires the base __init__ when a Python class overrides ILogger.
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            level = levels.get(severity, logging.DEBUG)
            target.log(level, "TensorRT: %s", msg)
            if on_error is not None and level >= logging.ERROR:
                on_error(msg)

    return _ForwardingLogger()


def _make_logger(capture: LogCapture) -> trt.ILogger:
    import tensorrt as trt

    severities = {
        trt.ILogger.INTERNAL_ERROR: "INTERNAL_ERROR",
        trt.ILogger.ERROR: "ERROR",
        trt.ILogger.WARNING: "WARNING",
        trt.ILogger.INFO: "INFO",
        trt.ILogger.VERBOSE: "VERBOSE",
    }

    class _CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            # pybind11 requires the base __init__ when a Python class overrides ILogger.
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            capture.add(severities.get(severity, "VERBOSE"), msg)

    return _CapturingLogger()


class EngineBuildCancelled(EngineError, StopRequested):
    """The build was stopped on request (the daemon is shutting down) before it finished."""


class _BuildProgress:
    """What a build's progress monitor saw: whether it asked TensorRT to stop, and an interrupt
    (Ctrl-C, or SIGTERM turned into one by the CLI) that arrived inside a callback."""

    def __init__(self, stop_requested: Callable[[], bool] | None) -> None:
        self.stop_requested = stop_requested
        self.cancelled = threading.Event()
        # TensorRT may report steps from several threads at once: the stop question is asked
        # by one at a time, so a stop is seen once and never asked again.
        self._asking = threading.Lock()
        self.interrupt: BaseException | None = None
        self.phase_started: dict[str, tuple[float, bool]] = {}  # name -> (start, top-level)

    def guarded(self, callback: Callable[[], bool]) -> bool:
        """Run a callback for TensorRT: nothing may escape into its C++ caller (declared
        noexcept, it would abort the process). A failure is logged and the build goes on; an
        interrupt stops the build and is raised again once TensorRT has returned."""
        try:
            return callback()
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("engine build: a progress callback failed; building on")
            return True
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit
            if self.interrupt is None:
                self.interrupt = exc
            self.cancelled.set()
            return False

    def should_go_on(self) -> bool:
        with self._asking:
            if self.cancelled.is_set():
                return False
            if self.stop_requested is not None and self.stop_requested():
                log.info("engine build: stop requested, asking TensorRT to end the build")
                self.cancelled.set()
                return False
            return True

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> bool:
        top = parent_phase is None
        self.phase_started[phase_name] = (time.monotonic(), top)
        log.log(logging.INFO if top else logging.DEBUG, "engine build: %s (%d step(s))",
                phase_name, num_steps)
        return True

    def phase_finish(self, phase_name: str) -> bool:
        started = self.phase_started.pop(phase_name, None)
        if started is not None:
            log.log(logging.INFO if started[1] else logging.DEBUG, "engine build: %s done in %.1f s",
                    phase_name, time.monotonic() - started[0])
        return True


def _make_progress_monitor(progress: _BuildProgress) -> trt.IProgressMonitor:
    """A TensorRT progress monitor that logs the build's phases (top-level ones at INFO, with how
    long they took) and stops the build when ``progress.stop_requested`` says so. TensorRT calls
    it from its own threads and from the building one; every call goes through
    ``progress.guarded``."""
    import tensorrt as trt

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            # pybind11 requires the base __init__ when a Python class overrides the interface.
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name: str, parent_phase: str, num_steps: int) -> None:
            progress.guarded(lambda: progress.phase_start(phase_name, parent_phase, num_steps))

        def step_complete(self, phase_name: str, step: int) -> bool:
            return progress.guarded(progress.should_go_on)

        def phase_finish(self, phase_name: str) -> None:
            progress.guarded(lambda: progress.phase_finish(phase_name))

    return _Monitor()


def _dims(dims: trt.Dims) -> list[int]:
    # Dims supports len() and indexing; the stubs declare no __iter__.
    return [dims[index] for index in range(len(dims))]


def _onnx_node_names(model: bytes) -> list[str] | None:
    """Node names by index, for parsers (8.x) whose errors carry only the index. Best effort."""
    try:
        import onnx
    except ImportError:
        return None
    try:
        graph = onnx.load_model_from_string(model).graph
    except Exception:  # noqa: BLE001 - a model TensorRT could not parse may not load here either
        return None
    return [node.name for node in graph.node]


def _parse_errors(parser: trt.OnnxParser, model: bytes) -> list[str]:
    node_names: list[str] | None = None
    described: list[str] = []
    for index in range(parser.num_errors):
        error: trt.ParserError = parser.get_error(index)
        node = error.node()
        where = ""
        if node >= 0:
            # node_name()/node_operator() exist from TensorRT 10 on; 8.x errors carry the index only.
            if hasattr(error, "node_name"):
                name, operator = error.node_name(), error.node_operator()
            else:
                if node_names is None:
                    node_names = _onnx_node_names(model) or []
                name = node_names[node] if node < len(node_names) else ""
                operator = ""
            where = (
                f"node {node}"
                + (f" '{name}'" if name else "")
                + (f" ({operator})" if operator else "")
                + ": "
            )
        # str() of a pybind11 enum reads "ErrorCode.UNSUPPORTED_NODE"; keep the member name.
        code = str(error.code()).rsplit(".", 1)[-1]
        described.append(f"{where}{code}: {error.desc()}")
    return described


def _layers_by_name(network: trt.INetworkDefinition) -> dict[str, trt.ILayer]:
    return {layer.name: layer for layer in (network.get_layer(i) for i in range(network.num_layers))}


def _fp16_layers(network: trt.INetworkDefinition, names: Sequence[str]) -> list[trt.ILayer]:
    """The layers for the ONNX nodes in ``names``.

    Assumption (read in onnx-tensorrt's ``ImporterContext::registerLayer`` and ``getNodeName``,
    not verified on a board): the parser names the main layer of each node after the ONNX node
    name (``node_of_<first output>`` for an unnamed node), uniquified with a ``_<n>`` suffix only
    on a clash; helper layers a node may add get other names. Only exact matches are used, so a
    helper layer of a fallback node is left to TensorRT's choice.
    """
    layers = _layers_by_name(network)
    missing = [name for name in names if name not in layers]
    if missing:
        raise EngineError(
            "FP16 fallback layers not found among the parsed network's layers",
            missing=missing,
            layers=sorted(layers)[:20],
        )
    return [layers[name] for name in names]


def _apply_fp16_fallback(network: trt.INetworkDefinition, names: Sequence[str]) -> None:
    import tensorrt as trt

    for layer in _fp16_layers(network, names):
        layer.precision = trt.float16
        for index in range(layer.num_outputs):
            # Only float outputs take a float16 output type; a shape or index output must not.
            if layer.get_output(index).dtype in (trt.float32, trt.float16):
                layer.set_output_type(index, trt.float16)


def _check_fp16_in_graph(network: trt.INetworkDefinition, names: Sequence[str]) -> None:
    """On strongly typed networks (11.x) the fallback layers must already compute in FP16.

    Assumption: in a strongly typed network the tensor types are inferred while the network is
    built, so ``ITensor.dtype`` already reports the graph's type before the engine is built.
    """
    import tensorrt as trt

    not_fp16 = []
    for layer in _fp16_layers(network, names):
        dtypes = [layer.get_output(index).dtype for index in range(layer.num_outputs)]
        if not any(dtype == trt.float16 for dtype in dtypes):
            not_fp16.append(f"{layer.name} ({', '.join(dtype.name for dtype in dtypes)})")
    if not_fp16:
        raise EngineError(
            "TensorRT 11 builds strongly typed networks: the FP16 fallback layers must already be "
            "FP16 in the ONNX (convert it on the host, e.g. ModelOpt AutoCast with these nodes, "
            "before bundling)",
            layers=not_fp16,
        )


def _load_timing_cache(config: trt.IBuilderConfig, path: Path | None, warnings: list[str]) -> None:
    blob = b""
    if path is not None and path.exists():
        try:
            blob = path.read_bytes()
        except OSError as exc:
            warnings.append(f"timing cache {path} unreadable ({exc}); starting an empty one")
    cache = config.create_timing_cache(blob)
    # A corrupt blob makes createTimingCache return nullptr (None here); the cache only speeds
    # the build up, so start afresh rather than fail.
    if cache is None and blob:
        warnings.append(f"timing cache {path} is corrupt; starting an empty one")
        cache = config.create_timing_cache(b"")
    if cache is None:
        raise EngineError("TensorRT could not create a timing cache")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        # A cache from another device or TensorRT build; with ignore_mismatch=False TensorRT refuses it.
        warnings.append(
            f"timing cache {path} was made on another device or TensorRT; starting an empty one"
        )
        if not config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False):
            raise EngineError("TensorRT refused an empty timing cache")


def _read_onnx(onnx_path: Path) -> bytes:
    try:
        data = Path(onnx_path).read_bytes()
    except FileNotFoundError:
        raise EngineError("ONNX model not found", path=onnx_path) from None
    except IsADirectoryError:
        raise EngineError("ONNX model path is a directory", path=onnx_path) from None
    except OSError as exc:
        raise EngineError(
            "cannot read the ONNX model", path=onnx_path, reason=exc.strerror or str(exc)
        ) from None
    if not data:
        raise EngineError("ONNX model file is empty", path=onnx_path)
    return data


def build_engine(
    onnx_path: Path,
    config: EngineBuildConfig,
    *,
    gpu: Callable[[], GpuModel] | None = None,
    root: Path = Path("/"),
    stop_requested: Callable[[], bool] | None = None,
) -> EngineBuildResult:
    """Build a serialized TensorRT engine from a QDQ INT8 ONNX model.

    Args:
        onnx_path: The bundle's ``model.onnx`` (external weights, if any, beside it).
        config: Shapes, precision and device options.
        gpu: Returns the GPU's model (compute capability and multiprocessor count); the default
            asks the CUDA driver for device 0.
        root: Filesystem root for ``etc/nv_tegra_release`` (a temporary tree in tests).
        stop_requested: Polled after each step of the build (TensorRT 10.0+, through
            ``IProgressMonitor``); when it returns True the build ends early with
            :class:`EngineBuildCancelled`. TensorRT 8.5 cannot stop a build: it runs to the end.

    Returns:
        The plan with its fingerprint, the updated timing cache and warnings worth showing.

    Raises:
        MissingDependencyError: TensorRT is not installed.
        EngineError: the file is unreadable, the parser rejects the model (errors name the nodes),
            the configuration does not fit the model or device, or the build fails (with
            TensorRT's own messages).
        EngineBuildCancelled: ``stop_requested`` stopped the build.
    """
    data = _read_onnx(onnx_path)
    require_tensorrt()
    import tensorrt as trt

    features = TensorRTFeatures.from_version(trt.__version__)
    fingerprint = DeviceFingerprint.of(trt.__version__, (gpu or cuda_gpu_model)(),
                                       read_l4t_release(root))
    warnings: list[str] = []
    capture = LogCapture()
    logger = _make_logger(capture)
    if not init_plugins():
        warnings.append("TensorRT's plugin library did not initialise; models that need plugins will fail")
    builder = trt.Builder(logger)

    flags = 0
    if features.needs_explicit_batch:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(data, str(onnx_path)):
        raise EngineError(
            "TensorRT's ONNX parser rejected the model",
            path=onnx_path,
            errors=_parse_errors(parser, data) or capture.of("ERROR", "INTERNAL_ERROR"),
        )

    inputs: dict[str, list[int]] = {}
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        if tensor.is_shape_tensor:
            raise EngineError("shape-tensor inputs are not supported", input=tensor.name)
        inputs[tensor.name] = _dims(tensor.shape)
    ranges, shape_warnings = profile_shapes(inputs, config)
    warnings += shape_warnings

    build_config = builder.create_builder_config()
    if config.workspace_bytes is not None:
        build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_bytes)

    if features.weak_typing:
        if config.int8:
            build_config.set_flag(trt.BuilderFlag.INT8)
        if config.fp16:
            build_config.set_flag(trt.BuilderFlag.FP16)
        if config.fp16_layers:
            _apply_fp16_fallback(network, config.fp16_layers)
            # OBEY by default: the bundle's accuracy report was measured with these layers in
            # FP16, so an engine that quietly ran them otherwise would not be the model that was
            # validated. PREFER (strict_precision=False) trades that for a build that cannot fail.
            build_config.set_flag(
                trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS
                if config.strict_precision
                else trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS
            )
    else:
        if not (config.int8 and config.fp16):
            warnings.append(
                f"int8={config.int8}, fp16={config.fp16} ignored: TensorRT {trt.__version__} takes "
                "precision from the graph (strong typing)"
            )
        if config.fp16_layers:
            _check_fp16_in_graph(network, config.fp16_layers)

    if config.dla_core is not None:
        available = builder.num_DLA_cores
        if config.dla_core >= available:
            raise EngineError(
                "DLA core does not exist on this device" if available else "this device has no DLA",
                dla_core=config.dla_core,
                available=available,
            )
        build_config.default_device_type = trt.DeviceType.DLA
        build_config.DLA_core = config.dla_core
        if config.gpu_fallback:
            build_config.set_flag(trt.BuilderFlag.GPU_FALLBACK)

    if config.optimization_level is not None:
        if features.optimization_level:
            build_config.builder_optimization_level = config.optimization_level
        else:
            warnings.append(f"optimization_level needs TensorRT 8.6+; ignored on {trt.__version__}")

    _load_timing_cache(build_config, config.timing_cache_path, warnings)

    profile = builder.create_optimization_profile()
    for name, shape_range in ranges.items():
        try:
            profile.set_shape(
                name,
                trt.Dims(list(shape_range.min)),
                trt.Dims(list(shape_range.opt)),
                trt.Dims(list(shape_range.max)),
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise EngineError(
                "TensorRT rejected the input's shape range", input=name, range=shape_range, reason=str(exc)
            ) from None
    if build_config.add_optimization_profile(profile) < 0:
        raise EngineError(
            "TensorRT rejected the optimization profile",
            profile=ranges,
            messages=capture.of("ERROR", "INTERNAL_ERROR"),
        )

    progress = _BuildProgress(stop_requested)
    if features.progress_monitor:
        # Kept referenced until the build returns: TensorRT holds only a borrowed pointer.
        monitor = _make_progress_monitor(progress)
        build_config.progress_monitor = monitor
    elif stop_requested is not None:
        log.debug("TensorRT %s has no progress monitor: this build cannot be stopped early",
                  trt.__version__)

    started = time.monotonic()
    plan = builder.build_serialized_network(network, build_config)
    build_seconds = time.monotonic() - started
    if progress.interrupt is not None:
        raise progress.interrupt
    if plan is None and progress.cancelled.is_set():
        raise EngineBuildCancelled("engine build stopped on request", path=onnx_path,
                                   after_s=round(build_seconds, 1))
    if plan is None:
        raise EngineError(
            "TensorRT could not build the engine",
            path=onnx_path,
            messages=capture.of("ERROR", "INTERNAL_ERROR") or ["(TensorRT logged no error)"],
        )

    ignored = [message for message in capture.of("WARNING", "ERROR")
               if "obeys the requested constraints" in message]
    if ignored and config.strict_precision and config.fp16_layers and features.weak_typing:
        raise EngineError(
            "TensorRT did not run every FP16 fallback layer in FP16, so the engine is not the "
            "model the bundle's accuracy report measured (strict_precision = false accepts it)",
            path=onnx_path,
            messages=ignored,
        )

    timing_cache: bytes | None = None
    serialized_cache = build_config.get_timing_cache().serialize()
    if serialized_cache is not None:
        timing_cache = bytes(serialized_cache)
        if config.timing_cache_path is not None:
            atomic_write_bytes(config.timing_cache_path, timing_cache)

    warnings += [f"TensorRT: {message}" for message in capture.of("WARNING")]
    return EngineBuildResult(
        plan=bytes(plan),
        fingerprint=fingerprint,
        timing_cache=timing_cache,
        build_seconds=build_seconds,
        tensorrt_version=trt.__version__,
        profile=ranges,
        warnings=warnings,
    )
