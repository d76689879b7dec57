"""Inference backends, selected by name.

``BACKENDS`` maps a configuration name to the class's import path; modules are imported only when
chosen, so a board without TensorRT (or a host without ONNX Runtime) never imports them. ``auto``
picks TensorRT when both TensorRT and pycuda import and a CUDA device answers, else ONNX Runtime.
"""

from __future__ import annotations

import importlib
import logging

from agent.backends.base import (
    Backend,
    BackendOptions,
    ModelArtifacts,
    StagedBatch,
    TensorInfo,
)
from agent.deps import is_tensorrt
from agent.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = {
    "onnxruntime": "agent.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "agent.backends.tensorrt:TensorRTBackend",
}
BACKEND_CHOICES = ("auto", *BACKENDS)

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "Backend",
    "BackendOptions",
    "ModelArtifacts",
    "StagedBatch",
    "TensorInfo",
    "backend_class",
    "resolve_backend_name",
]


def tensorrt_available() -> bool:
    """True when real TensorRT and pycuda import and a CUDA device is present."""
    try:
        import tensorrt  # type: ignore[import-not-found]
    except ImportError:
        return False
    if not is_tensorrt(tensorrt):
        return False
    try:
        import pycuda.driver as cuda  # type: ignore[import-not-found]

        cuda.init()
        return bool(cuda.Device.count())
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA driver error without a GPU
        # TensorRT is installed, so this is a board that should use it: say why it will not.
        log.warning("TensorRT is installed but unusable (%s); serving with ONNX Runtime. "
                    "Build pycuda against the board's CUDA (see README)", exc)
        return False


def resolve_backend_name(name: str) -> str:
    """Turn ``auto`` into a concrete backend name; reject unknown names."""
    if name == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if name not in BACKENDS:
        raise ConfigError("unknown backend", key="serving.backend", expected=list(BACKEND_CHOICES),
                          found=name)
    return name


def backend_class(name: str) -> type[Backend]:
    """The Backend subclass for a configuration name (``auto`` resolved first)."""
    module_name, _, class_name = BACKENDS[resolve_backend_name(name)].partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls
