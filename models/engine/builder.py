"""The engine build, one function per phase: parse the ONNX model into a network, configure the
builder (precision flags per TensorRT version, DLA, optimization level, timing cache, the
optimization profile), build and serialize the plan, and save the updated timing cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agent import deps
from agent.errors import EngineError
from agent.fsutil import atomic_write_bytes
from models.engine.config import EngineBuildConfig, ShapeRange, profile_shapes
from models.engine.features import TensorRTFeatures
from models.engine.logs import LogCapture, init_plugins, make_logger
from models.engine.network import (
    apply_fp16_fallback,
    check_fp16_in_graph,
    network_inputs,
    parse_onnx,
    read_onnx,
)
from models.engine.progress import BuildProgress, EngineBuildCancelled, make_progress_monitor
from models.fingerprint import DeviceFingerprint, GpuModel, cuda_gpu_model, read_l4t_release

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


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


def require_tensorrt() -> None:
    """Fail with a clear error unless the real ``tensorrt`` module is importable."""
    deps.require_tensorrt("building a TensorRT engine (TensorRT comes with JetPack, e.g. the "
                          "python3-libnvinfer package, not from pip)")


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
    data = read_onnx(onnx_path)
    require_tensorrt()
    import tensorrt as trt

    features = TensorRTFeatures.from_version(trt.__version__)
    fingerprint = DeviceFingerprint.of(trt.__version__, (gpu or cuda_gpu_model)(),
                                       read_l4t_release(root))
    warnings: list[str] = []
    capture = LogCapture()
    logger = make_logger(capture)
    if not init_plugins():
        warnings.append("TensorRT's plugin library did not initialise; models that need plugins will fail")
    builder = trt.Builder(logger)
    # The parser stays referenced until the build returns: the network's weights belong to it.
    network, parser = parse_onnx(builder, logger, data, onnx_path, features, capture)
    ranges, shape_warnings = profile_shapes(network_inputs(network), config)
    warnings += shape_warnings

    build_config = _builder_config(builder, network, config, features, warnings)
    _load_timing_cache(build_config, config.timing_cache_path, warnings)
    _add_profile(builder, build_config, ranges, capture)
    plan, build_seconds = _build(builder, network, build_config, onnx_path, capture, features,
                                 stop_requested)
    _check_fp16_obeyed(capture, config, features, onnx_path)
    timing_cache = _save_timing_cache(build_config, config.timing_cache_path)

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


def _builder_config(
    builder: trt.Builder,
    network: trt.INetworkDefinition,
    config: EngineBuildConfig,
    features: TensorRTFeatures,
    warnings: list[str],
) -> trt.IBuilderConfig:
    """The builder configuration: workspace, precision, DLA and optimization level."""
    import tensorrt as trt

    build_config = builder.create_builder_config()
    if config.workspace_bytes is not None:
        build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_bytes)
    _set_precision(build_config, network, config, features, warnings)
    _set_dla(builder, build_config, config)
    if config.optimization_level is not None:
        if features.optimization_level:
            build_config.builder_optimization_level = config.optimization_level
        else:
            warnings.append(f"optimization_level needs TensorRT 8.6+; ignored on {trt.__version__}")
    return build_config


def _set_precision(
    build_config: trt.IBuilderConfig,
    network: trt.INetworkDefinition,
    config: EngineBuildConfig,
    features: TensorRTFeatures,
    warnings: list[str],
) -> None:
    """Precision flags and the FP16 fallback layers (weak typing), or a check that the strongly
    typed graph already has them in FP16."""
    import tensorrt as trt

    if features.weak_typing:
        if config.int8:
            build_config.set_flag(trt.BuilderFlag.INT8)
        if config.fp16:
            build_config.set_flag(trt.BuilderFlag.FP16)
        if config.fp16_layers:
            apply_fp16_fallback(network, config.fp16_layers)
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
            check_fp16_in_graph(network, config.fp16_layers)


def _set_dla(builder: trt.Builder, build_config: trt.IBuilderConfig, config: EngineBuildConfig) -> None:
    """Run on the configured DLA core (and let unsupported layers fall back to the GPU)."""
    import tensorrt as trt

    if config.dla_core is None:
        return
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


def _add_profile(
    builder: trt.Builder,
    build_config: trt.IBuilderConfig,
    ranges: dict[str, ShapeRange],
    capture: LogCapture,
) -> None:
    """One optimization profile with every input's shape range."""
    import tensorrt as trt

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


def _build(
    builder: trt.Builder,
    network: trt.INetworkDefinition,
    build_config: trt.IBuilderConfig,
    onnx_path: Path,
    capture: LogCapture,
    features: TensorRTFeatures,
    stop_requested: Callable[[], bool] | None,
) -> tuple[trt.IHostMemory, float]:
    """The serialized plan, and how long the build took in seconds."""
    import tensorrt as trt

    progress = BuildProgress(stop_requested)
    if features.progress_monitor:
        # Kept referenced until the build returns: TensorRT holds only a borrowed pointer.
        monitor = make_progress_monitor(progress)
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
    return plan, build_seconds


def _check_fp16_obeyed(
    capture: LogCapture, config: EngineBuildConfig, features: TensorRTFeatures, onnx_path: Path
) -> None:
    """With strict_precision, refuse an engine that TensorRT built without some FP16 fallback layer."""
    ignored = [message for message in capture.of("WARNING", "ERROR")
               if "obeys the requested constraints" in message]
    if ignored and config.strict_precision and config.fp16_layers and features.weak_typing:
        raise EngineError(
            "TensorRT did not run every FP16 fallback layer in FP16, so the engine is not the "
            "model the bundle's accuracy report measured (strict_precision = false accepts it)",
            path=onnx_path,
            messages=ignored,
        )


def _save_timing_cache(build_config: trt.IBuilderConfig, path: Path | None) -> bytes | None:
    """The build's timing cache, also written to ``path`` when one is configured."""
    timing_cache: bytes | None = None
    serialized_cache = build_config.get_timing_cache().serialize()
    if serialized_cache is not None:
        timing_cache = bytes(serialized_cache)
        if path is not None:
            atomic_write_bytes(path, timing_cache)
    return timing_cache
