"""The ONNX Runtime backend: the reference backend on any CPU, and on GPUs through ORT's CUDA or
TensorRT execution providers when the installed build has them.

Batches run through I/O binding: inputs are bound to this instance's preallocated host buffers (the
batcher copies each request straight into them) and outputs with a static per-sample shape are
bound to preallocated buffers too, so no batch is copied twice. Each buffer set is one flat byte
array per tensor that grows to the largest batch seen and is reused afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.backends.base import (
    Backend,
    BackendOptions,
    ModelArtifacts,
    SlotPool,
    StagedBatch,
    TensorInfo,
    datatype_of,
)
from agent.deps import require
from agent.errors import InternalError, ModelError

log = logging.getLogger(__name__)

# ORT's type strings for the element types a vision model uses.
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(uint8)": np.uint8,
    "tensor(int8)": np.int8,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
}
# Preferred order when the build offers them; CPU is always last and always there.
_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def _tensor_info(node: Any, *, batch_axis: int = 0, fixed_batch: int | None = None) -> TensorInfo:
    """A session input's or output's description, its batch on ``batch_axis``: dynamic, or the
    bundle's ``fixed_batch`` (a graph that runs at that batch only; clients see it as dynamic,
    and smaller batches are padded)."""
    dtype = _ORT_TYPES.get(node.type)
    if dtype is None:
        raise ModelError("unsupported tensor element type", tensor=node.name, found=node.type)
    shape = [dim if isinstance(dim, int) and dim > 0 else -1 for dim in node.shape]
    if fixed_batch is not None and batch_axis < len(shape) and shape[batch_axis] == fixed_batch:
        shape[batch_axis] = -1
    if batch_axis >= len(shape) or shape[batch_axis] != -1:
        raise ModelError(f"the model needs a dynamic batch axis (axis {batch_axis}), or the "
                         "bundle's fixed_batch", tensor=node.name, found=list(node.shape),
                         fixed_batch=fixed_batch)
    return TensorInfo(node.name, datatype_of(np.dtype(dtype)), tuple(shape), batch_axis=batch_axis)


def _with_profile_limits(info: TensorInfo, manifest: Mapping[str, Any]) -> TensorInfo:
    """``info`` bounded by the bundle's ``engine_profile`` (``height`` and ``width`` as
    ``[min, opt, max]``, on the input's height and width axes as its ``layout`` places them:
    NHWC or, by default, the last two), so that ONNX Runtime accepts the frame sizes a TensorRT
    engine of the same bundle accepts, and no others."""
    profile = manifest.get("engine_profile")
    sample = info.sample_shape
    if not isinstance(profile, Mapping) or len(sample) < 2:
        return info
    entry = next((tensor for tensor in manifest.get("inputs") or ()
                  if isinstance(tensor, Mapping) and tensor.get("name") == info.name), {})
    from models.onnx_model import spatial_axes

    axes = spatial_axes(entry.get("layout")) if len(sample) == 3 else None
    # The sample has no batch axis; without a known layout, height and width are the last two.
    spatial = tuple(axis - 1 for axis in axes) if axes else (len(sample) - 2, len(sample) - 1)
    low = [1 if dim < 0 else dim for dim in sample]
    high = [sys.maxsize if dim < 0 else dim for dim in sample]
    bounded = False
    for axis_name, axis in zip(("height", "width"), spatial):
        span = profile.get(axis_name)
        if sample[axis] < 0 and isinstance(span, list | tuple) and len(span) == 3:
            low[axis], high[axis] = int(span[0]), int(span[2])
            bounded = True
    return dataclasses.replace(info, limits=(tuple(low), tuple(high))) if bounded else info


def choose_providers(available: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    """Execution providers to ask for: ``wanted`` (checked against ``available``) or the best
    available GPU provider followed by the CPU."""
    if wanted:
        missing = [name for name in wanted if name not in available]
        if missing:
            raise ModelError("execution provider not in this ONNX Runtime build", found=missing,
                             available=list(available))
        return list(wanted)
    return [name for name in _GPU_PROVIDERS if name in available] + ["CPUExecutionProvider"]


class _BufferSet:
    """One batch's worth of input and output buffers (flat bytes, grown on demand)."""

    def __init__(self) -> None:
        self.storage: dict[str, np.ndarray] = {}

    def view(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self.storage.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            # 64-byte alignment suits the vector kernels; grown buffers replace the old ones only
            # between batches (a staged batch holds its own slot).
            raw = np.empty(nbytes + 64, dtype=np.uint8)
            offset = (-raw.ctypes.data) % 64
            buffer = raw[offset:offset + nbytes]
            self.storage[name] = buffer
        return buffer[:nbytes].view(dtype).reshape(shape)


class OnnxRuntimeBackend(Backend):
    """One ONNX Runtime session with its buffer sets.

    ``options.extra``: ``providers`` (a list of ORT execution provider names) to override the
    automatic choice; ``allow_spinning`` (default False) to let idle intra-op threads busy-wait.
    """

    kind = "onnxruntime"

    def __init__(self, artifacts: ModelArtifacts, options: BackendOptions) -> None:
        super().__init__(artifacts, options)
        self._session: Any = None  # owned: created in activate, dropped in deactivate
        self._bindings: list[Any] = []  # one IOBinding per buffer set
        self._buffers: list[_BufferSet] = []
        self._staged: dict[int, int] = {}  # buffer set -> batch size staged in it
        self._slots = SlotPool(options.buffer_sets)
        self._lock = threading.Lock()
        self._inputs: tuple[TensorInfo, ...] = ()
        self._outputs: tuple[TensorInfo, ...] = ()
        self._providers: list[str] = []

    # -- lifecycle ----------------------------------------------------------------------

    def activate(self) -> None:
        if self._active:
            return
        ort = require("onnxruntime", extra="device", purpose="the ONNX Runtime backend")
        from models.ort import create_session, int8_kernels

        path = self.artifacts.onnx_path
        if not path.is_file():
            raise ModelError("model file missing", path=path)
        self._providers = choose_providers(ort.get_available_providers(),
                                           self.options.extra.get("providers"))
        try:
            session = create_session(path, threads=self.options.threads, providers=self._providers,
                                     spin=bool(self.options.extra.get("allow_spinning", False)))
        except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise ModelError(f"ONNX Runtime cannot load the model: {exc}", path=path) from exc
        fixed, axes = self.artifacts.fixed_batch, self.artifacts.output_batch_axes
        try:
            self._inputs = tuple(_with_profile_limits(_tensor_info(node, fixed_batch=fixed),
                                                      self.artifacts.manifest)
                                 for node in session.get_inputs())
            self._outputs = tuple(_tensor_info(node, batch_axis=axes.get(node.name, 0),
                                               fixed_batch=fixed)
                                  for node in session.get_outputs())
        except ModelError as exc:
            raise ModelError(exc.message, path=path, **exc.fields) from None
        self._session = session
        self._bindings = [session.io_binding() for _ in range(self.options.buffer_sets)]
        self._buffers = [_BufferSet() for _ in range(self.options.buffer_sets)]
        self._active = True
        log.info("onnxruntime backend active: %s v%d on %s, %d thread(s), INT8 kernels: %s%s",
                 self.artifacts.name, self.artifacts.version, ",".join(self._providers),
                 self.options.threads, int8_kernels(),
                 f", batch {fixed} only (smaller batches padded)" if fixed else "")

    def deactivate(self) -> None:
        self._active = False
        for binding in self._bindings:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
        self._bindings = []
        self._buffers = []
        self._staged.clear()
        self._session = None

    # -- description --------------------------------------------------------------------

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return self._outputs

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "providers": list(self._providers),
                "threads": self.options.threads}

    # -- inference ----------------------------------------------------------------------

    def stage(self, batch_size: int, sample_shapes: Mapping[str, tuple[int, ...]]) -> StagedBatch:
        self.check_stage_request(batch_size, sample_shapes)
        slot = self._slots.acquire()
        buffers = self._buffers[slot]
        rows = self.padded_batch(batch_size)
        inputs = {}
        for info in self._inputs:
            padded = buffers.view(info.name, info.dtype, (rows, *sample_shapes[info.name]))
            padded[batch_size:] = 0  # padding rows of a fixed batch: computed, then dropped
            inputs[info.name] = padded[:batch_size]
        with self._lock:
            self._staged[slot] = batch_size
        return StagedBatch(batch_size, inputs, slot, self._release)

    def _release(self, slot: int) -> None:
        with self._lock:
            self._staged.pop(slot, None)
        self._slots.release(slot)

    def run(self, batch: StagedBatch) -> dict[str, np.ndarray]:
        self._require_active()
        with self._lock:
            staged = self._staged.get(batch.slot)
        if staged != batch.batch_size:
            raise InternalError("run() on a batch that is not staged on this backend")
        binding = self._bindings[batch.slot]
        buffers = self._buffers[batch.slot]
        rows = self.padded_batch(batch.batch_size)
        for info in self._inputs:
            array = batch.inputs[info.name]  # the first rows of a buffer of ``rows`` rows
            binding.bind_input(info.name, "cpu", 0, array.dtype, [rows, *array.shape[1:]],
                               array.ctypes.data)
        preallocated: dict[str, np.ndarray] = {}
        for info in self._outputs:
            if -1 in info.sample_shape:
                binding.bind_output(info.name, "cpu")  # ORT allocates: shape known only after run
            else:
                out = buffers.view("out:" + info.name, info.dtype, info.batch_shape(rows))
                binding.bind_output(info.name, "cpu", 0, out.dtype, list(out.shape),
                                    out.ctypes.data)
                preallocated[info.name] = out
        self._session.run_with_iobinding(binding)
        if len(preallocated) == len(self._outputs):
            return self.real_rows(preallocated, batch.batch_size)
        produced = binding.get_outputs()
        results: dict[str, np.ndarray] = {}
        for info, value in zip(self._outputs, produced):
            mine = preallocated.get(info.name)
            results[info.name] = value.numpy() if mine is None else mine
        return self.real_rows(results, batch.batch_size)
