"""The TensorRT backend: one deserialized engine, one execution context and one CUDA stream per
instance, with the buffers of agent/backends/cuda_buffers.py (zero copy on a Jetson). Which plan
it runs is agent/backends/tensorrt/plans.py's business.

I/O uses the name-based tensor API only (TensorRT 8.5 and later; the only one in 10.x and 11.x):
``set_input_shape`` and ``set_tensor_address`` per tensor, then ``execute_async_v3`` on this
instance's stream.

``options.extra`` keys: ``host_memory`` (``auto``, ``mapped`` or ``pinned``; see
cuda_buffers.choose_host_memory) and the engine build settings ``workspace_bytes``, ``dla_core``,
``gpu_fallback``, ``optimization_level``, ``strict_precision`` (models.engine.EngineBuildConfig,
which validates them). Other keys are ignored.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from agent import deps
from agent.backends.base import (
    Backend,
    BackendOptions,
    ModelArtifacts,
    StagedBatch,
    TensorInfo,
    batch_rows,
    datatype_of,
)
from agent.backends.cuda_buffers import (
    BufferPool,
    CudaDevice,
    CudaStream,
    PycudaDevice,
    TensorSpec,
    choose_host_memory,
)
from agent.backends.tensorrt.plans import EngineLoader, EngineSource, TensorRTLog
from agent.errors import EngineError, InputError, InternalError
from models.engine import init_plugins

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

_PURPOSE = "the TensorRT backend (TensorRT comes with JetPack, e.g. the python3-libnvinfer package)"

# TensorRT DataType member names -> numpy; the others (BF16, FP8, INT4, ...) have no numpy dtype.
_NUMPY_DTYPES = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "UINT8": np.uint8,
}


def require_tensorrt() -> ModuleType:
    return deps.require_tensorrt(_PURPOSE)


def _output_info(name: str, datatype: str, shape: tuple[int, ...], batch_axis: int) -> TensorInfo:
    """An engine output as clients see it: its batch axis dynamic."""
    dims = list(shape)
    dims[batch_axis] = -1
    return TensorInfo(name, datatype, tuple(dims), batch_axis=batch_axis)


def _dims(dims: trt.Dims) -> tuple[int, ...]:
    # Dims supports len() and indexing; the stubs declare no __iter__.
    return tuple(int(dims[index]) for index in range(len(dims)))


class TensorRTBackend(Backend):
    """A TensorRT engine on one CUDA device.

    Args:
        artifacts, options: As for every backend (``options.extra``: see the module docstring).
        open_device: Opens the CUDA device by index; the default is pycuda
            (:meth:`PycudaDevice.open`). Tests pass a fake on host memory.
        root: Filesystem root for ``etc/nv_tegra_release`` (part of the device fingerprint).
    """

    kind = "tensorrt"

    def __init__(self, artifacts: ModelArtifacts, options: BackendOptions, *,
                 open_device: Callable[[int], CudaDevice] | None = None, root: Path = Path("/")) -> None:
        super().__init__(artifacts, options)
        self._open_device = open_device or PycudaDevice.open
        self._root = Path(root)
        # Owned by this instance: created by activate() in this order, freed by deactivate() in
        # the reverse order with the device's context current.
        self._device: CudaDevice | None = None  # one retain of the device's primary context
        self._stream: CudaStream | None = None  # the one stream every batch of this instance runs on
        self._log: TensorRTLog | None = None
        self._runtime: trt.Runtime | None = None  # must outlive the engine
        self._engine: trt.ICudaEngine | None = None
        self._context: trt.IExecutionContext | None = None  # the one execution context
        self._pool: BufferPool | None = None  # every host and device buffer
        self._source: EngineSource | None = None
        self._inputs: tuple[TensorInfo, ...] = ()
        self._outputs: tuple[TensorInfo, ...] = ()
        self._profile: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # input -> (min, max)
        self._max_batch = options.max_batch_size
        # The batch every run uses when the engine's batch axis is static (DLA engines): smaller
        # batches are padded to it, and the padding rows' outputs dropped.
        self._padded_batch: int | None = None
        # run() and deactivate() exclude each other; stage()/release only touch the staged table.
        self._run_lock = threading.Lock()
        self._staged_lock = threading.Lock()
        self._staged: dict[int, int] = {}  # slot -> batch size, for batches staged and not released

    # -- lifecycle ----------------------------------------------------------------------

    def activate(self) -> None:
        if self._active:
            return
        require_tensorrt()
        try:
            self._activate()
        except BaseException:
            self.deactivate()
            raise
        self._active = True
        source = self._source
        log.info("tensorrt backend active: %s v%d, %s plan %s, %s buffers, max batch %d",
                 self.artifacts.name, self.artifacts.version, source.origin if source else "?",
                 source.path if source else "?", "mapped" if self._pool and self._pool.mapped else "pinned",
                 self._max_batch)

    def _activate(self) -> None:
        import tensorrt as trt

        device = self._device = self._open_device(self.options.device_id)
        mapped = choose_host_memory(device, str(self.options.extra.get("host_memory", "auto")))
        with device.scope():
            self._stream = device.create_stream()
            self._log = TensorRTLog()
            init_plugins()
            self._runtime = trt.Runtime(self._log.logger)
            dla_core = self.options.extra.get("dla_core")
            if dla_core is not None:
                self._runtime.DLA_core = int(dla_core)  # the core a DLA engine runs on
            loader = EngineLoader(self.artifacts, self.options, deserialize=self._deserialize,
                                  trt_log=self._log, root=self._root)
            self._engine, self._source = loader.load(trt.__version__, device)
            self._context = self._engine.create_execution_context()
            if self._context is None:
                raise EngineError("TensorRT could not create an execution context",
                                  messages=self._log.take_errors())
            specs = self._read_engine_io()
            self._pool = BufferPool.allocate(device, specs, sets=self.options.buffer_sets, mapped=mapped)

    def deactivate(self) -> None:
        with self._run_lock:
            self._active = False
            with self._staged_lock:
                self._staged.clear()
            device, self._device = self._device, None
            if device is None:
                return
            try:
                with device.scope():
                    self._release_in_context()
            except Exception as exc:  # noqa: BLE001 - a broken context must not keep the rest alive
                log.error("freeing the TensorRT backend's CUDA resources failed: %s", exc)
            finally:
                # Whatever failed above, drop every reference so that nothing outlives this call.
                self._pool = self._context = self._engine = self._runtime = None
                self._stream = None
                self._log = None
                self._source = None
                try:
                    device.close()
                except Exception as exc:  # noqa: BLE001
                    log.error("releasing the CUDA device failed: %s", exc)

    def _release_in_context(self) -> None:
        stream = self._stream
        if stream is not None:
            try:
                stream.synchronize()  # nothing may still be reading or writing the buffers
            except Exception as exc:  # noqa: BLE001 - free the rest whatever this does
                log.error("tensorrt backend: cannot synchronize the stream: %s", exc)
        if self._pool is not None:
            try:
                self._pool.close()
            except Exception as exc:  # noqa: BLE001
                log.error("tensorrt backend: cannot free the buffers: %s", exc)
        # TensorRT objects go with their last reference: the context, then the engine, then the
        # runtime, while the context is current (they free device memory as they go).
        self._context = None
        self._engine = None
        self._runtime = None
        if stream is not None:
            try:
                stream.close()
            except Exception as exc:  # noqa: BLE001
                log.error("tensorrt backend: cannot destroy the stream: %s", exc)

    # -- engine ---------------------------------------------------------------------------

    def _deserialize(self, plan: bytes) -> trt.ICudaEngine | None:
        if self._runtime is None or self._log is None:
            raise InternalError("deserialize before the TensorRT runtime exists")
        self._log.take_errors()
        try:
            engine = self._runtime.deserialize_cuda_engine(plan)
        except (RuntimeError, TypeError, ValueError) as exc:  # some releases raise rather than log
            self._log.note_error(str(exc))
            return None
        return engine  # None when TensorRT refused it (the reason is in its log)

    def _read_engine_io(self) -> list[TensorSpec]:
        """Describe the engine's tensors and size their buffers for the largest batch and shapes."""
        import tensorrt as trt

        engine, context = self._engine, self._context
        if engine is None or context is None or self._log is None:
            raise InternalError("engine I/O read before the engine is loaded")
        names = [engine.get_tensor_name(index) for index in range(engine.num_io_tensors)]
        input_names = [name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT]
        output_names = [name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT]
        dtypes: dict[str, np.dtype[Any]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        fixed, axes = self.artifacts.fixed_batch, self.artifacts.output_batch_axes
        for name in input_names + output_names:
            type_name = engine.get_tensor_dtype(name).name
            if type_name not in _NUMPY_DTYPES:
                raise EngineError("engine tensor type not supported by this backend", tensor=name,
                                  found=type_name, supported=sorted(_NUMPY_DTYPES))
            dtypes[name] = np.dtype(_NUMPY_DTYPES[type_name])
            shapes[name] = _dims(engine.get_tensor_shape(name))
            axis = axes.get(name, 0)
            # A graph that runs at one batch size (the manifest's fixed_batch) may have it
            # static: clients see the axis as dynamic, and smaller batches are padded.
            if not axis < len(shapes[name]) or shapes[name][axis] not in (-1, fixed):
                raise EngineError(f"the engine needs a dynamic batch axis (axis {axis}), or the "
                                  "bundle's fixed_batch", tensor=name, found=list(shapes[name]),
                                  fixed_batch=fixed)
        profile: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for name in input_names:
            low, _, high = (_dims(dims) for dims in engine.get_tensor_profile_shape(name, 0))
            profile[name] = (low, high)
        self._profile = profile
        self._max_batch = min([self.options.max_batch_size] + [high[0] for _, high in profile.values()])
        # A static batch axis (every input's profile min and max the same batch): a DLA engine,
        # or a graph that runs at one batch size only (the manifest's fixed_batch).
        batch_bounds = {bound[0] for low, high in profile.values() for bound in (low, high)}
        self._padded_batch = batch_bounds.pop() if len(batch_bounds) == 1 else None
        if fixed is not None and self._padded_batch != fixed:
            raise EngineError("the engine's batch range is not the bundle's fixed batch",
                              fixed_batch=fixed, found=sorted(batch_bounds))
        if self._padded_batch is not None:
            log.info("the engine takes batch %d only: smaller batches are padded to it",
                     self._padded_batch)
        rows = max(self._max_batch, self._padded_batch or 0)
        largest = {name: (rows, *high[1:]) for name, (_, high) in profile.items()}
        for name, shape in largest.items():
            if not context.set_input_shape(name, shape):
                raise EngineError("TensorRT refused the profile's largest input shape", tensor=name,
                                  shape=list(shape), messages=self._log.take_errors())
        for name in output_names:
            largest[name] = _dims(context.get_tensor_shape(name))
            if any(dim < 0 for dim in largest[name]):
                raise EngineError("output shape depends on the data, which this backend does not support",
                                  tensor=name, found=list(largest[name]))
        self._inputs = tuple(TensorInfo(name, datatype_of(dtypes[name]), (-1, *shapes[name][1:]),
                                        (profile[name][0][1:], profile[name][1][1:]))
                             for name in input_names)
        self._outputs = tuple(_output_info(name, datatype_of(dtypes[name]), shapes[name],
                                           axes.get(name, 0))
                              for name in output_names)
        return [TensorSpec(name, dtypes[name], largest[name], is_input=name in profile)
                for name in input_names + output_names]

    # -- description --------------------------------------------------------------------

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return self._outputs

    @property
    def max_batch_size(self) -> int:
        """The smaller of ``options.max_batch_size`` and the engine profile's maximum batch."""
        return self._max_batch

    @property
    def engine_source(self) -> EngineSource | None:
        return self._source

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"backend": self.kind, "buffer_sets": self.options.buffer_sets}
        if self._source is not None:
            facts.update(engine=self._source.origin, plan=str(self._source.path),
                         fingerprint=self._source.fingerprint)
        if self._device is not None:
            facts.update(device=self._device.name, compute_capability=self._device.compute_capability,
                         multiprocessors=self._device.multiprocessors)
        if self._pool is not None:
            facts["host_memory"] = "mapped" if self._pool.mapped else "pinned"
        return facts

    # -- inference ----------------------------------------------------------------------

    def stage(self, batch_size: int, sample_shapes: Mapping[str, tuple[int, ...]]) -> StagedBatch:
        self.check_stage_request(batch_size, sample_shapes)
        shapes = {info.name: (batch_size, *sample_shapes[info.name]) for info in self._inputs}
        for name, shape in shapes.items():
            low, high = self._profile[name]
            if self._padded_batch is not None:
                low = (1, *low[1:])  # padded up to the engine's batch in run()
            if any(not lo <= dim <= hi for lo, dim, hi in zip(low, shape, high, strict=True)):
                raise InputError("input shape is outside the engine's optimization profile", input=name,
                                 found=list(shape), minimum=list(low), maximum=list(high))
        pool = self._pool
        if pool is None:
            raise InternalError("tensorrt backend staged a batch without buffers")
        slot = pool.acquire()
        with self._staged_lock:
            self._staged[slot] = batch_size
        inputs = {name: pool.host_view(slot, name, shape) for name, shape in shapes.items()}
        return StagedBatch(batch_size, inputs, slot, functools.partial(self._release, pool))

    def _release(self, pool: BufferPool, slot: int) -> None:
        # A batch staged before a deactivate() goes back to the pool it came from, not a newer one.
        if pool is self._pool:
            with self._staged_lock:
                self._staged.pop(slot, None)
        pool.release(slot)

    def run(self, batch: StagedBatch) -> dict[str, np.ndarray]:
        with self._run_lock:
            self._require_active()
            with self._staged_lock:
                staged = self._staged.get(batch.slot)
            device, stream, context = self._device, self._stream, self._context
            pool, trt_log = self._pool, self._log
            if (staged != batch.batch_size or device is None or stream is None or context is None
                    or pool is None or trt_log is None):
                raise InternalError("run() on a batch that is not staged on this backend")
            input_shapes = {info.name: tuple(batch.inputs[info.name].shape) for info in self._inputs}
            if self._padded_batch is not None:
                # Rows past the batch hold whatever an earlier batch left: computed, then dropped.
                input_shapes = {name: (self._padded_batch, *shape[1:])
                                for name, shape in input_shapes.items()}
            with device.scope():
                for name, shape in input_shapes.items():
                    if not context.set_input_shape(name, shape):
                        raise InputError("TensorRT refused the input shape", input=name, found=list(shape),
                                         messages=trt_log.take_errors())
                output_shapes = {info.name: _dims(context.get_tensor_shape(info.name))
                                 for info in self._outputs}
                # Checked before the launch: TensorRT would write past a buffer that is too small.
                outputs = {name: pool.host_view(batch.slot, name, shape)
                           for name, shape in output_shapes.items()}
                for spec in pool.specs:
                    if not context.set_tensor_address(spec.name, pool.device_pointer(batch.slot, spec.name)):
                        raise EngineError("TensorRT refused a tensor address", tensor=spec.name,
                                          messages=trt_log.take_errors())
                pool.to_device(batch.slot, input_shapes, stream)
                if not context.execute_async_v3(stream.handle):
                    raise EngineError("TensorRT could not run the batch", batch=batch.batch_size,
                                      messages=trt_log.take_errors())
                pool.to_host(batch.slot, output_shapes, stream)
                stream.synchronize()
            if self._padded_batch is not None:
                axes = self.output_batch_axes
                return {name: batch_rows(array, 0, batch.batch_size, axes.get(name, 0))
                        for name, array in outputs.items()}
            return outputs
