"""The project's error hierarchy.

Every error a user can cause (bad input, a tampered bundle, a wrong key, a missing optional
dependency) is an :class:`AgentError`. Each carries structured fields (which file, which key,
expected vs found) and prints them, so the CLI can end with one line that names the problem.

A bug of our own is an :class:`InternalError`; it deliberately does *not* derive from
``AgentError`` so that nothing catches it as if it were the user's fault.
"""

from __future__ import annotations

from typing import Any


class AgentError(Exception):
    """Root of every user-facing error.

    Args:
        message: What went wrong, in one sentence.
        **fields: Facts that locate the problem (``path=...``, ``key=...``, ``expected=...``,
            ``found=...``). They are kept on ``self.fields`` and appended to ``str(self)``.
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = {name: value for name, value in fields.items() if value is not None}

    def __str__(self) -> str:
        # Values often come from untrusted input (a bundle's signature file, a request header):
        # escaped and bounded, so an error stays one line and cannot steer a terminal.
        message = printable(self.message, MAX_MESSAGE_CHARS)
        if not self.fields:
            return message
        details = ", ".join(f"{name}={printable(str(value), MAX_FIELD_CHARS)}"
                            for name, value in self.fields.items())
        return f"{message} ({details})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its class, its arguments and its attributes, rebuilt without calling
        # __init__: the default would call ``cls(message)`` and lose the facts (or fail, for a
        # subclass whose ``reason`` is required). The update's file worker (agent/update/
        # fileworker.py) sends its errors back to the daemon so.
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _rebuild_error(cls: type[AgentError], args: tuple[Any, ...],
                   state: dict[str, Any]) -> AgentError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


MAX_MESSAGE_CHARS = 2000
MAX_FIELD_CHARS = 1000


def printable(text: str, limit: int | None = None) -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``, ``\\n``) and, given
    ``limit``, shortened to about that many characters: safe to print on one terminal line."""
    if not text.isprintable():
        text = "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit - 3]}..."
    return text


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``exc``'s message on one line, for an error's ``reason``: its first non-empty line,
    shortened to ``limit`` characters, or the exception's type when it has no message."""
    line = next((text.strip() for text in str(exc).splitlines() if text.strip()), "")
    line = line or type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


class ConfigError(AgentError):
    """A configuration value or command-line argument is invalid."""


class InputError(AgentError):
    """A file or value handed to a command is unusable (missing, corrupt, wrong shape)."""


class ModelError(InputError):
    """A model (PyTorch or ONNX) cannot be loaded, exported or run."""


class CalibrationError(InputError):
    """The calibration data set is empty, malformed or does not match the model."""


class PruningError(AgentError):
    """Pruning cannot be done as asked."""


class QuantizationError(AgentError):
    """INT8 quantization or the mixed-precision search failed."""


class BundleError(AgentError):
    """A bundle is malformed, unsafe to unpack, or fails verification."""


class SignatureError(BundleError):
    """A bundle's signature is missing, invalid, or made with an unknown key."""


class KeyFileError(AgentError):
    """A signing or verification key cannot be read or is of the wrong kind."""


class EngineError(AgentError):
    """A TensorRT engine cannot be built or loaded."""


class StopRequested(AgentError):
    """Long work (an engine build, starting the model's instances) ended early because the
    process was asked to stop."""


class StoreError(AgentError):
    """The on-device model store is inconsistent or cannot be written."""


class UpdateError(AgentError):
    """A model update cannot go on: a download, a verification, a step of the swap failed.

    ``reason`` is a short stable code (``not_found``, ``hash_mismatch``, ``deadline``...) that the
    journal, the metrics (failures by reason) and the fleet side read; the message says it in words.
    """

    def __init__(self, message: str, *, reason: str, **fields: Any) -> None:
        super().__init__(message, reason=reason, **fields)
        self.reason = reason


class DownloadError(UpdateError):
    """A bundle could not be fetched from its source."""


class FleetError(AgentError):
    """Fleet control over MQTT cannot go on: the broker is unreachable or refused us, a publish
    was not acknowledged in time, a fleet document is malformed or unsigned.

    ``reason`` is a short stable code (``timeout``, ``not_authorized``, ``bad_credentials``,
    ``tls``...) that callers and the fleet side read; the message says it in words.
    """

    def __init__(self, message: str, *, reason: str, **fields: Any) -> None:
        super().__init__(message, reason=reason, **fields)
        self.reason = reason


class DocumentError(FleetError):
    """A fleet document or its signed envelope (agent/fleet/documents.py) is refused: malformed,
    too large, of the wrong kind, badly signed, or not meant for this device.

    ``reason`` is a short stable code (``not_json``, ``bad_field``, ``bad_signature``,
    ``unknown_key``...) that the device's ``events`` carry; ``field`` names the offending field
    as a dotted path (``model.sha256``) when one is at fault.
    """

    def __init__(self, message: str, *, reason: str, field: str | None = None,
                 **fields: Any) -> None:
        super().__init__(message, reason=reason, field=field, **fields)
        self.field = field


class ControlError(AgentError):
    """The local control channel to the running daemon cannot be used (no daemon, no permission,
    a malformed request)."""


class PowerError(AgentError):
    """Board power or clock control failed."""


class MissingDependencyError(AgentError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, purpose: str, *, found: str | None = None
                 ) -> None:
        hint = f"pip install 'jetson-edge-agent[{extra}]'" if extra else "see README"
        message = f"{purpose} needs the Python module '{module}' ({hint})"
        if found is not None:
            message += f": {found}"
        super().__init__(message, module=None)
        self.module = module
        self.extra = extra


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that ``finally`` blocks run as for Ctrl-C (the
    CLI's handler raises it; code running an event loop turns the signal into it)."""


class InternalError(Exception):
    """A bug in this project, not a problem with the user's input."""
