"""Build a TensorRT engine from the bundle's QDQ INT8 ONNX model, on the device that will run it.

An engine only runs on the GPU and TensorRT version it was built with, so the device builds it from
``model.onnx`` on first use and caches it under ``engines/<fingerprint>.plan`` (design 5.1). This
package does that build for the TensorRT releases JetPack ships:

* 8.5 (JetPack 5.1): weakly typed network created with ``EXPLICIT_BATCH``; INT8 and FP16 builder
  flags; the bundle's FP16 fallback layers get a per-layer precision that the builder must obey.
* 10.x (JetPack 6 and 7): the same, without ``EXPLICIT_BATCH`` (implicit batch is gone). The weak
  typing APIs were deprecated in 10.12 but still work.
* 11.x: every network is strongly typed and the precision flags are gone; the precision comes from
  the graph (Q/DQ nodes and FP16 casts). FP16 fallback layers must therefore already be FP16 in
  the ONNX (ModelOpt AutoCast does that on the host); the builder checks it and refuses otherwise.

``tensorrt`` is imported inside the functions that use it (JetPack provides it; it is never a pip
dependency), so importing this package needs neither TensorRT nor torch. The calls are written
against the ``tensorrt-stubs`` type stubs and checked with mypy (tools/trt_stubs.py).

The modules:

* config.py: the build settings (:class:`EngineBuildConfig`) and the optimization profile's shapes;
* features.py: what the installed TensorRT version has (:class:`TensorRTFeatures`);
* logs.py: TensorRT's loggers and its plugin library;
* network.py: the network from the ONNX model, and the FP16 fallback layers in it;
* progress.py: the build's progress monitor, and stopping a build on request;
* builder.py: the builder configuration and the build itself (:func:`build_engine`).

The device fingerprint that names the plan is models/fingerprint.py, which the runtime uses too.
"""

from __future__ import annotations

from models.engine.builder import EngineBuildResult, build_engine, require_tensorrt
from models.engine.config import (
    LAYOUTS,
    OPTIMIZATION_LEVELS,
    EngineBuildConfig,
    ShapeRange,
    profile_shapes,
)
from models.engine.features import TensorRTFeatures
from models.engine.logs import LogCapture, forwarding_logger, init_plugins
from models.engine.progress import EngineBuildCancelled

__all__ = [
    "LAYOUTS",
    "OPTIMIZATION_LEVELS",
    "EngineBuildCancelled",
    "EngineBuildConfig",
    "EngineBuildResult",
    "LogCapture",
    "ShapeRange",
    "TensorRTFeatures",
    "build_engine",
    "forwarding_logger",
    "init_plugins",
    "profile_shapes",
    "require_tensorrt",
]
