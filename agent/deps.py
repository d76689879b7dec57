"""Optional dependencies, imported where they are used.

``require("onnxruntime", extra="device", purpose="the ONNX Runtime backend")`` returns the module
or raises :class:`~agent.errors.MissingDependencyError` naming the extra that installs it. TensorRT
and pycuda have no extra: JetPack provides TensorRT, and pycuda is built on the board (README).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from agent.errors import MissingDependencyError


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise an error that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # Only a missing top-level module is "not installed"; an ImportError raised from inside an
        # installed package is a broken install and must surface as it is.
        missing = getattr(exc, "name", None)
        if missing is not None and module.split(".")[0] != missing.split(".")[0]:
            raise
        raise MissingDependencyError(module, extra, purpose) from exc


def is_tensorrt(module: ModuleType) -> bool:
    """Whether an imported ``tensorrt`` is TensorRT: pip's tensorrt-stubs installs a bare
    ``tensorrt/`` folder of .pyi files, which Python imports as an empty namespace package."""
    return hasattr(module, "Builder") and hasattr(module, "Runtime")


def require_tensorrt(purpose: str) -> ModuleType:
    """The real TensorRT module, or an error that says what is importable instead."""
    module = require("tensorrt", extra="", purpose=purpose)
    if not is_tensorrt(module):
        where = ", ".join(getattr(module, "__path__", [])) or "?"
        raise MissingDependencyError(
            "tensorrt", "", purpose, found=f"the importable 'tensorrt' at {where} is not "
            "TensorRT but an empty namespace package (tensorrt-stubs leaves one)")
    return module
