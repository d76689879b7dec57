"""What every inference backend shares: tensor descriptions, staged batches and the base class.

A backend runs one model on one execution instance (an ONNX Runtime session, or a TensorRT execution
context with its CUDA stream). The batcher drives it in three steps so that the next batch can be
assembled while the current one runs:

1. ``stage(batch_size, sample_shapes)`` hands out a :class:`StagedBatch`: writable input arrays that
   live in the backend's own preallocated buffers (page-locked or mapped host memory for TensorRT,
   plain host memory bound through I/O binding for ONNX Runtime). The caller copies each request
   straight into its rows, so a request's bytes are copied once on their way to the model.
2. ``run(batch)`` executes it and returns output arrays that are views of the backend's output
   buffers, valid until the batch is released.
3. ``batch.release()`` gives the buffers back to the pool.

``stage`` and ``release`` may be called from another thread than ``run``; ``run`` is called by one
thread at a time per instance. ``infer`` wraps the three steps for callers that have whole arrays.

Ownership: a backend owns every session, engine, context, stream and buffer it creates in
``activate``, and ``deactivate`` frees all of them, so a hot swap leaves nothing behind.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import numpy as np

from agent.errors import InputError, InternalError, ModelError

# KServe v2 datatype names <-> numpy dtypes (BYTES is not a tensor type a vision model uses).
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_DATATYPE_OF = {dtype: name for name, dtype in DATATYPES.items()}


def datatype_of(dtype: np.dtype[Any] | str) -> str:
    """The KServe datatype name of a numpy dtype (``float32`` -> ``FP32``)."""
    try:
        return _DATATYPE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ModelError("tensor element type has no KServe datatype", found=str(dtype)) from None


@dataclass(frozen=True)
class TensorInfo:
    """One model input or output as clients see it.

    ``shape`` includes the batch axis, as -1: first for inputs and most outputs, elsewhere for
    an output whose model puts it there (``batch_axis``: a ``[T, B, C]`` recognizer output has
    it on axis 1); other dynamic axes are -1 too. ``limits``, when given, bounds one sample's
    shape (without the batch axis): ``(smallest, largest)``, as an engine's optimization profile
    or a bundle's ``engine_profile`` does.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    limits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    batch_axis: int = 0

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise ModelError("unsupported tensor datatype", tensor=self.name, found=self.datatype)
        if not 0 <= self.batch_axis < len(self.shape) or self.shape[self.batch_axis] != -1:
            raise ModelError(f"axis {self.batch_axis} must be the dynamic batch axis",
                             tensor=self.name, found=list(self.shape))

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample (without the batch axis), -1 where dynamic."""
        return self.shape[:self.batch_axis] + self.shape[self.batch_axis + 1:]

    def batch_shape(self, rows: int, sample_shape: tuple[int, ...] | None = None
                    ) -> tuple[int, ...]:
        """The shape of ``rows`` samples of ``sample_shape`` (default: this tensor's), the rows
        on the batch axis."""
        sample = self.sample_shape if sample_shape is None else tuple(sample_shape)
        return sample[:self.batch_axis] + (rows,) + sample[self.batch_axis:]

    def check_sample_shape(self, shape: tuple[int, ...]) -> None:
        """Raise InputError unless ``shape`` (one sample, no batch axis) fits this tensor."""
        expected = self.sample_shape
        if len(shape) != len(expected) or any(
            want not in (-1, got) or got <= 0 for want, got in zip(expected, shape)
        ):
            raise InputError("input shape does not match the model (shapes per sample, "
                             "without the batch axis)", input=self.name,
                             expected=list(expected), found=list(shape))
        if self.limits is not None:
            low, high = self.limits
            if any(not lo <= got <= hi for lo, got, hi in zip(low, shape, high)):
                raise InputError("input shape is outside the range the model is built for",
                                 input=self.name, found=list(shape), smallest=list(low),
                                 largest=list(high))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def batch_rows(array: np.ndarray, start: int, stop: int, axis: int = 0) -> np.ndarray:
    """Rows ``start:stop`` of ``array`` on its batch axis ``axis`` (a view)."""
    index: list[slice] = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return array[tuple(index)]


def frame_shape(sample_shape: tuple[int, ...], height: int, width: int) -> tuple[int, ...] | None:
    """``sample_shape`` with its last two dynamic axes (height, width) set; None when another
    axis is still dynamic."""
    shape = list(sample_shape)
    dynamic = [index for index, size in enumerate(shape) if size == -1]
    for index, size in zip(dynamic[-2:], (height, width)):
        shape[index] = size
    return None if -1 in shape else tuple(shape)


@dataclass(frozen=True)
class ModelArtifacts:
    """An installed model version, as the store hands it to a backend."""

    name: str
    version: int
    directory: Path
    manifest: Mapping[str, Any]
    engine_cache_dir: Path  # where TensorRT plans and timing caches built on this device are kept

    @property
    def onnx_path(self) -> Path:
        return self.directory / "model.onnx"

    @property
    def max_batch(self) -> int:
        return int(self.manifest.get("max_batch", 1))

    @property
    def opt_batch(self) -> int:
        return int(self.manifest.get("opt_batch", 1))

    @property
    def fixed_batch(self) -> int | None:
        """The one batch size the model's graph runs at (the manifest's ``fixed_batch``), None
        when it takes any: backends pad smaller batches to it."""
        value = self.manifest.get("fixed_batch")
        return None if value is None else int(value)

    @property
    def output_batch_axes(self) -> dict[str, int]:
        """Output name to the axis that carries the batch, for outputs where it is not axis 0
        (the manifest's ``output_batch_axes``)."""
        axes = self.manifest.get("output_batch_axes") or {}
        return {str(name): int(axis) for name, axis in axes.items()}

    def prebuilt_engines(self) -> dict[str, Path]:
        """Plans shipped in the bundle, keyed by device fingerprint."""
        engines = self.manifest.get("engines") or {}
        return {key: self.directory / str(member) for key, member in engines.items()}


@dataclass(frozen=True)
class BackendOptions:
    """Settings every backend understands; backend-specific ones live in ``extra``."""

    max_batch_size: int = 32
    threads: int = 0  # intra-op CPU threads; 0 = the library's choice
    buffer_sets: int = 2  # staged batches per instance: one running, one being assembled
    device_id: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Polled during long work in activate() (a TensorRT engine build): True ends it early with
    # StopRequested. The daemon sets it when it is asked to stop while starting.
    stop_requested: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InternalError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.buffer_sets < 1:
            raise InternalError(f"buffer_sets must be >= 1, got {self.buffer_sets}")


class StagedBatch:
    """Input arrays for one batch, living in a backend's buffer set; release when done."""

    def __init__(self, batch_size: int, inputs: dict[str, np.ndarray], slot: int,
                 on_release: Callable[[int], None]) -> None:
        self.batch_size = batch_size
        self.inputs = inputs
        self.slot = slot
        self._on_release: Callable[[int], None] | None = on_release

    def release(self) -> None:
        """Return the buffers to the pool (idempotent)."""
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release(self.slot)

    def __enter__(self) -> StagedBatch:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SlotPool:
    """A fixed number of buffer sets handed out one at a time (thread-safe)."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._cond = threading.Condition()

    def acquire(self, timeout_s: float | None = None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                raise InternalError("no free buffer set: more batches staged than buffer_sets")
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self._cond:
            if slot in self._free:
                raise InternalError(f"buffer set {slot} released twice")
            self._free.append(slot)
            self._cond.notify()


class Backend(ABC):
    """Runs one model on one execution instance. Use as a context manager or call
    ``activate``/``deactivate`` explicitly."""

    #: The name used in configuration (``backend = "onnxruntime"``).
    kind: ClassVar[str]

    def __init__(self, artifacts: ModelArtifacts, options: BackendOptions) -> None:
        self.artifacts = artifacts
        self.options = options
        self._active = False

    # -- lifecycle ----------------------------------------------------------------------

    @abstractmethod
    def activate(self) -> None:
        """Load the model and allocate buffers. Raises ModelError/EngineError on failure and
        then holds nothing."""

    @abstractmethod
    def deactivate(self) -> None:
        """Free everything ``activate`` made. Safe to call twice or after a failed activate."""

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> Backend:  # noqa: PYI034 - typing.Self needs Python 3.11
        self.activate()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.deactivate()

    # -- description --------------------------------------------------------------------

    @property
    @abstractmethod
    def inputs(self) -> tuple[TensorInfo, ...]:
        """Model inputs (valid once active)."""

    @property
    @abstractmethod
    def outputs(self) -> tuple[TensorInfo, ...]:
        """Model outputs (valid once active)."""

    @property
    def max_batch_size(self) -> int:
        fixed = self.artifacts.fixed_batch
        return self.options.max_batch_size if fixed is None else min(self.options.max_batch_size,
                                                                      fixed)

    @property
    def output_batch_axes(self) -> dict[str, int]:
        """Output name to its batch axis (0 where not listed): a batch's outputs are cut into
        requests on it."""
        return self.artifacts.output_batch_axes

    def padded_batch(self, batch_size: int) -> int:
        """The rows a batch of ``batch_size`` samples runs with: the bundle's fixed batch when
        it has one (the rows past ``batch_size`` are padding: computed, then dropped by
        :meth:`real_rows`), else ``batch_size``."""
        return self.artifacts.fixed_batch or batch_size

    def real_rows(self, outputs: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
        """``outputs`` of a padded batch cut to its first ``batch_size`` rows (views), each on
        its own batch axis."""
        if self.padded_batch(batch_size) == batch_size:
            return outputs
        axes = self.output_batch_axes
        return {name: batch_rows(value, 0, batch_size, axes.get(name, 0))
                for name, value in outputs.items()}

    def describe(self) -> dict[str, Any]:
        """Facts for logs and the model config endpoint (provider, device, precision...)."""
        return {"backend": self.kind}

    # -- inference ----------------------------------------------------------------------

    @abstractmethod
    def stage(self, batch_size: int, sample_shapes: Mapping[str, tuple[int, ...]]) -> StagedBatch:
        """Buffers for a batch of ``batch_size`` samples whose per-sample input shapes are given.

        Blocks until a buffer set is free. Raises InputError when a shape does not fit the
        model or the engine's profile.
        """

    @abstractmethod
    def run(self, batch: StagedBatch) -> dict[str, np.ndarray]:
        """Execute a staged batch; the outputs are views valid until ``batch.release()``."""

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run whole arrays (batch axis first) and return owned output arrays."""
        self._require_active()
        names = {info.name for info in self.inputs}
        if set(inputs) != names:
            raise InputError("inputs do not match the model", expected=sorted(names),
                             found=sorted(inputs))
        sizes = {int(np.shape(array)[0]) if np.ndim(array) else 0 for array in inputs.values()}
        if len(sizes) != 1 or (batch_size := sizes.pop()) < 1:
            raise InputError("all inputs need the same non-zero batch size", found=sorted(sizes))
        if batch_size > self.max_batch_size:
            raise InputError("batch is larger than the backend's maximum", found=batch_size,
                             maximum=self.max_batch_size)
        batch = self.stage(batch_size, {name: tuple(np.shape(a)[1:]) for name, a in inputs.items()})
        try:
            for name, array in inputs.items():
                np.copyto(batch.inputs[name], array, casting="same_kind")
            return {name: np.array(value, copy=True) for name, value in self.run(batch).items()}
        finally:
            batch.release()

    def _require_active(self) -> None:
        if not self._active:
            raise InternalError(f"{self.kind} backend used before activate() or after deactivate()")

    def check_stage_request(self, batch_size: int,
                            sample_shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Validate a stage() call against the inputs (shared by the backends)."""
        self._require_active()
        if not 1 <= batch_size <= self.max_batch_size:
            raise InputError("batch size out of range", found=batch_size,
                             maximum=self.max_batch_size)
        for info in self.inputs:
            if info.name not in sample_shapes:
                raise InputError("missing input", input=info.name)
            info.check_sample_shape(tuple(sample_shapes[info.name]))
        extra = set(sample_shapes) - {info.name for info in self.inputs}
        if extra:
            raise InputError("unknown input", found=sorted(extra))
