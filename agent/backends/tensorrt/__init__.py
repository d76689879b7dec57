"""The TensorRT backend, split as Polygraphy splits its backends: finding or building the plan
(``plans``: the bundle's plan for this device's fingerprint, else one cached on the device, else a
build from ``model.onnx``, cached) apart from running it (``backend``: one engine, execution
context and CUDA stream per instance, on pycuda buffers).
"""

from agent.backends.tensorrt.backend import TensorRTBackend, require_tensorrt
from agent.backends.tensorrt.plans import (
    BUILD_OPTION_KEYS,
    EngineCache,
    EngineLoader,
    EngineSource,
    engine_build_config,
)

__all__ = [
    "BUILD_OPTION_KEYS",
    "EngineCache",
    "EngineLoader",
    "EngineSource",
    "TensorRTBackend",
    "engine_build_config",
    "require_tensorrt",
]
