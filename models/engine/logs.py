"""TensorRT's loggers, and its plugin library (which keeps the logger it was given).

A build logs through :func:`make_logger`, which keeps warnings and errors in a
:class:`LogCapture` for the build's error reports and warnings; :func:`forwarding_logger` is the
plain one the runtime uses. :func:`init_plugins` registers TensorRT's standard plugins once per
process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


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


def make_logger(capture: LogCapture) -> trt.ILogger:
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
