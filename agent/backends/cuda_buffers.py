"""CUDA buffers for the TensorRT backend: a device handle, a stream and a pool of buffer sets.

Two ways to hand a batch to the GPU, chosen per device (:func:`choose_host_memory`):

* **mapped (zero copy)**: on a Jetson the CPU and the GPU share one DRAM (the device reports
  ``INTEGRATED == 1``). Page-locked host memory allocated with ``DEVICEMAP`` has a device address,
  so TensorRT reads the inputs where the batcher wrote them and writes the outputs where the caller
  reads them: no copy at all.
* **pinned + async copies**: on a discrete GPU every access to mapped memory would cross PCIe, so
  each tensor has a page-locked host buffer and a device buffer, and a batch's bytes (only as many
  as the actual batch needs) are copied with ``memcpy_htod_async``/``memcpy_dtoh_async`` on the
  backend's stream.

:class:`BufferPool` holds ``sets`` buffer sets (one batch running while the next is staged), each
sized once for the largest batch and profile shape, and reused for every call.

CUDA sits behind the small :class:`CudaDevice` protocol: :class:`PycudaDevice` on hardware, a fake
on host memory in the tests (tests/fakes/fake_tensorrt.py). pycuda is imported only by
:meth:`PycudaDevice.open`; it is built on the board (README), so it has no pip extra.

Contexts: :class:`PycudaDevice` retains the device's *primary* context (the one the CUDA runtime,
and so TensorRT, uses) and pushes it around every call with :meth:`CudaDevice.scope`, because the
backend may be driven from another thread than the one that created it. ``pycuda.autoinit`` is
not used: it creates a second, private context bound to the importing thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from agent.backends.base import SlotPool
from agent.deps import require
from agent.errors import EngineError, InternalError

log = logging.getLogger(__name__)

HOST_MEMORY_MODES = ("auto", "mapped", "pinned")


# --------------------------------------------------------------------------------------------
# The CUDA seam


@dataclass(frozen=True, eq=False)
class HostMemory:
    """Page-locked host memory: ``array`` is its bytes; ``device_ptr`` is the address the GPU
    uses for the same bytes when the memory is mapped (zero copy), else None."""

    array: np.ndarray
    device_ptr: int | None
    free: Callable[[], None]  # idempotent; works from any thread, context current or not


@dataclass(frozen=True, eq=False)
class DeviceMemory:
    """A device allocation of ``nbytes`` at ``ptr``."""

    ptr: int
    nbytes: int
    free: Callable[[], None]  # idempotent; works from any thread, context current or not


class CudaStream(Protocol):
    """A CUDA stream: ``handle`` is what ``execute_async_v3`` takes."""

    @property
    def handle(self) -> int: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class CudaDevice(Protocol):
    """What the buffer pool and the TensorRT backend need from CUDA on one device.

    Every method except ``scope`` and ``close`` expects the device's context to be current, i.e.
    to run inside ``with device.scope():``.
    """

    @property
    def name(self) -> str: ...

    @property
    def compute_capability(self) -> str: ...  # "8.7"

    @property
    def multiprocessors(self) -> int: ...  # 16 on an AGX Orin, 8 on an Orin NX

    @property
    def integrated(self) -> bool: ...  # shares DRAM with the CPU (a Jetson)

    @property
    def can_map_host_memory(self) -> bool: ...

    def scope(self) -> AbstractContextManager[None]: ...

    def create_stream(self) -> CudaStream: ...

    def alloc_host(self, nbytes: int, *, mapped: bool) -> HostMemory: ...

    def alloc_device(self, nbytes: int) -> DeviceMemory: ...

    def copy_to_device_async(self, dst_ptr: int, src: np.ndarray, stream: CudaStream) -> None: ...

    def copy_to_host_async(self, dst: np.ndarray, src_ptr: int, stream: CudaStream) -> None: ...

    def close(self) -> None: ...


def choose_host_memory(device: CudaDevice, wanted: str = "auto") -> bool:
    """Whether buffers on ``device`` are mapped (True) or pinned with copies (False).

    ``auto`` maps on an integrated GPU only: there the GPU reads the same DRAM either way, while on
    a discrete GPU a kernel reading mapped memory pulls every byte across PCIe.

    Raises:
        EngineError: ``wanted`` is not a known mode, or ``mapped`` on a device that cannot map.
    """
    if wanted not in HOST_MEMORY_MODES:
        raise EngineError("unknown host memory mode", key="host_memory", expected=list(HOST_MEMORY_MODES),
                          found=wanted)
    if wanted == "pinned":
        return False
    if wanted == "mapped":
        if not device.can_map_host_memory:
            raise EngineError("this CUDA device cannot map host memory", key="host_memory",
                              device=device.name)
        return True
    return device.integrated and device.can_map_host_memory


# --------------------------------------------------------------------------------------------
# pycuda


class PycudaStream:
    """A pycuda stream owned by the :class:`PycudaDevice` that created it."""

    def __init__(self, device: PycudaDevice, stream: Any) -> None:
        self._device = device
        self._stream: Any = stream

    @property
    def handle(self) -> int:
        return int(self.raw.handle)

    @property
    def raw(self) -> Any:
        """The pycuda ``Stream`` (for pycuda calls that take a stream object)."""
        if self._stream is None:
            raise InternalError("CUDA stream used after close()")
        return self._stream

    def synchronize(self) -> None:
        with self._device.errors("cuStreamSynchronize"):
            self.raw.synchronize()

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            # pycuda destroys the stream when the last reference goes; with our context current,
            # that works from any thread.
            with self._device.scope():
                del stream


class PycudaDevice:
    """One CUDA device through pycuda, with its retained primary context. Use :meth:`open`."""

    def __init__(self, driver: ModuleType, device: Any, context: Any) -> None:
        self._driver = driver
        self._device = device
        self._context: Any = context  # owned: one retain of the primary context, released by close()
        self._name = str(device.name())
        major, minor = device.compute_capability()
        self._compute_capability = f"{major}.{minor}"
        attribute = driver.device_attribute
        self._multiprocessors = int(device.get_attribute(attribute.MULTIPROCESSOR_COUNT))
        self._integrated = bool(device.get_attribute(attribute.INTEGRATED))
        self._can_map = bool(device.get_attribute(attribute.CAN_MAP_HOST_MEMORY))

    @classmethod
    def open(cls, device_id: int = 0) -> PycudaDevice:
        """Initialise CUDA and retain the primary context of device ``device_id``.

        Raises:
            MissingDependencyError: pycuda is not installed.
            EngineError: no such device, or the driver fails.
        """
        driver = require("pycuda.driver", extra="",
                         purpose="the TensorRT backend's CUDA buffers (pycuda is built on the board)")
        try:
            driver.init()
            count = driver.Device.count()
            if not 0 <= device_id < count:
                raise EngineError("no such CUDA device", device_id=device_id, devices=count)
            device = driver.Device(device_id)
            context = device.retain_primary_context()
        except driver.Error as exc:
            raise EngineError("cannot open the CUDA device", device_id=device_id, reason=str(exc)) from exc
        return cls(driver, device, context)

    @property
    def name(self) -> str:
        return self._name

    @property
    def compute_capability(self) -> str:
        return self._compute_capability

    @property
    def multiprocessors(self) -> int:
        return self._multiprocessors

    @property
    def integrated(self) -> bool:
        return self._integrated

    @property
    def can_map_host_memory(self) -> bool:
        return self._can_map

    @contextlib.contextmanager
    def errors(self, call: str) -> Iterator[None]:
        """Turn pycuda's errors into EngineError naming the call."""
        try:
            yield
        except self._driver.Error as exc:
            raise EngineError("CUDA call failed", call=call, device=self._name, reason=str(exc)) from exc

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this device's context current on the calling thread (nestable)."""
        if self._context is None:
            raise InternalError("CUDA device used after close()")
        with self.errors("cuCtxPushCurrent"):
            self._context.push()
        try:
            yield
        finally:
            with self.errors("cuCtxPopCurrent"):
                self._driver.Context.pop()

    def create_stream(self) -> PycudaStream:
        with self.errors("cuStreamCreate"):
            return PycudaStream(self, self._driver.Stream())

    def alloc_host(self, nbytes: int, *, mapped: bool) -> HostMemory:
        flags = self._driver.host_alloc_flags.DEVICEMAP if mapped else 0
        with self.errors("cuMemHostAlloc"):
            array = self._driver.pagelocked_empty((nbytes,), np.uint8, mem_flags=flags)
        allocation = array.base
        device_ptr = None
        if mapped:
            # No MAP_HOST context flag is needed: with unified addressing (every 64-bit platform,
            # Jetsons included) page-locked memory is mapped into the device's address space.
            with self.errors("cuMemHostGetDevicePointer"):
                device_ptr = int(allocation.get_device_pointer())
        return HostMemory(array=array, device_ptr=device_ptr, free=self._freer(allocation, "cuMemFreeHost"))

    def alloc_device(self, nbytes: int) -> DeviceMemory:
        with self.errors("cuMemAlloc"):
            allocation = self._driver.mem_alloc(nbytes)
        return DeviceMemory(ptr=int(allocation), nbytes=nbytes, free=self._freer(allocation, "cuMemFree"))

    def _freer(self, allocation: Any, call: str) -> Callable[[], None]:
        freed = False

        def free() -> None:
            nonlocal freed
            if freed:
                return
            freed = True
            # pycuda frees in the allocating context; pushing it first lets another thread free.
            with self.scope(), self.errors(call):
                allocation.free()

        return free

    def copy_to_device_async(self, dst_ptr: int, src: np.ndarray, stream: CudaStream) -> None:
        with self.errors("cuMemcpyHtoDAsync"):
            self._driver.memcpy_htod_async(dst_ptr, src, self._raw_stream(stream))

    def copy_to_host_async(self, dst: np.ndarray, src_ptr: int, stream: CudaStream) -> None:
        with self.errors("cuMemcpyDtoHAsync"):
            self._driver.memcpy_dtoh_async(dst, src_ptr, self._raw_stream(stream))

    def _raw_stream(self, stream: CudaStream) -> Any:
        if not isinstance(stream, PycudaStream) or stream._device is not self:
            raise InternalError("a stream from another CUDA device")
        return stream.raw

    def close(self) -> None:
        """Release the primary context (idempotent). Everything allocated must be freed first."""
        context, self._context = self._context, None
        if context is None:
            return
        with self.errors("cuDevicePrimaryCtxRelease"):
            context.push()
            context.detach()
        # pycuda's detach releases the primary context and drops it from pycuda's own stack, but
        # cuDevicePrimaryCtxRelease (unlike cuCtxDetach) leaves it current in the driver's stack of
        # this thread; pop it so that the thread is left as it was found.
        _pop_driver_context(int(context.handle))


def _pop_driver_context(handle: int) -> None:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")  # already loaded by pycuda: this only finds it
    except OSError:
        return
    current = ctypes.c_void_p()
    if libcuda.cuCtxGetCurrent(ctypes.byref(current)) == 0 and (current.value or 0) == handle:
        libcuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


# --------------------------------------------------------------------------------------------
# The buffer pool


@dataclass(frozen=True)
class TensorSpec:
    """An engine I/O tensor as the pool allocates it: ``max_shape`` is the largest it can be
    (the maximum batch times the profile's largest shape, batch axis first)."""

    name: str
    dtype: np.dtype[Any]
    max_shape: tuple[int, ...]
    is_input: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "max_shape", tuple(int(dim) for dim in self.max_shape))
        if any(dim < 0 for dim in self.max_shape):
            raise InternalError(f"tensor {self.name}: buffer shape must be fully known, got {self.max_shape}")

    @property
    def capacity(self) -> int:
        """Elements the buffer holds."""
        return int(np.prod(self.max_shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class _TensorBuffer:
    spec: TensorSpec
    host: np.ndarray  # flat, spec.dtype, spec.capacity elements of page-locked memory
    device_ptr: int  # where the GPU reads or writes this tensor
    separate_device: bool  # True when device_ptr is a device allocation that needs copies


class BufferPool:
    """``sets`` buffer sets for one engine's inputs and outputs. Use :meth:`allocate`.

    The pool owns every allocation in it; :meth:`close` frees them (idempotent). Views handed out
    by :meth:`host_view` must not be used after that.
    """

    def __init__(self, device: CudaDevice, specs: Sequence[TensorSpec], *, sets: int,
                 mapped: bool) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise InternalError(f"tensor names repeat: {names}")
        if sets < 1:
            raise InternalError(f"a buffer pool needs at least one set, got {sets}")
        self.device = device
        self.specs = tuple(specs)
        self.mapped = mapped
        self._set_count = sets
        self._sets: list[dict[str, _TensorBuffer]] = []
        self._frees: list[Callable[[], None]] = []
        self._slots = SlotPool(sets)

    @classmethod
    def allocate(cls, device: CudaDevice, specs: Sequence[TensorSpec], *, sets: int,
                 mapped: bool) -> BufferPool:
        """Allocate ``sets`` buffer sets on ``device`` (its context must be current).

        Raises:
            EngineError: an allocation fails; whatever was allocated before is freed.
        """
        pool = cls(device, specs, sets=sets, mapped=mapped)
        try:
            for _ in range(sets):
                pool._sets.append({spec.name: pool._allocate(spec) for spec in pool.specs})
        except BaseException:
            pool.close()
            raise
        log.debug("buffer pool: %d set(s) of %d tensor(s), %.1f MiB each, %s", sets, len(pool.specs),
                  pool.set_nbytes / 2**20, "mapped" if mapped else "pinned + device")
        return pool

    def _allocate(self, spec: TensorSpec) -> _TensorBuffer:
        # A zero-sized tensor still gets one element: CUDA refuses empty allocations.
        nbytes = max(spec.nbytes, spec.dtype.itemsize)
        host = self.device.alloc_host(nbytes, mapped=self.mapped)
        self._frees.append(host.free)
        typed = host.array[:nbytes].view(spec.dtype)
        if self.mapped:
            if host.device_ptr is None:
                raise EngineError("mapped host memory has no device address", tensor=spec.name)
            return _TensorBuffer(spec, typed, host.device_ptr, separate_device=False)
        device_memory = self.device.alloc_device(nbytes)
        self._frees.append(device_memory.free)
        return _TensorBuffer(spec, typed, device_memory.ptr, separate_device=True)

    @property
    def sets(self) -> int:
        return self._set_count

    @property
    def set_nbytes(self) -> int:
        """Bytes of one buffer set (host side; the same again on the device when not mapped)."""
        return sum(spec.nbytes for spec in self.specs)

    def acquire(self, timeout_s: float | None = None) -> int:
        """A free buffer set's index; blocks until one is free."""
        return self._slots.acquire(timeout_s)

    def release(self, slot: int) -> None:
        self._slots.release(slot)

    def _buffer(self, slot: int, name: str) -> _TensorBuffer:
        if not 0 <= slot < len(self._sets):
            raise InternalError(f"buffer set {slot} does not exist (pool closed?)")
        try:
            return self._sets[slot][name]
        except KeyError:
            raise InternalError(f"no buffer for tensor {name!r}") from None

    def host_view(self, slot: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The first ``prod(shape)`` elements of a tensor's host buffer, shaped ``shape``.

        Raises:
            EngineError: ``shape`` does not fit the buffer (an output the engine made larger than
                its maximum-profile size).
        """
        buffer = self._buffer(slot, name)
        count = int(np.prod(shape, dtype=np.int64))
        if count > buffer.spec.capacity or any(dim < 0 for dim in shape):
            raise EngineError("tensor does not fit its buffer", tensor=name, shape=list(shape),
                              maximum=list(buffer.spec.max_shape))
        return buffer.host[:count].reshape(shape)

    def device_pointer(self, slot: int, name: str) -> int:
        """The address TensorRT reads or writes the tensor at (``set_tensor_address``)."""
        return self._buffer(slot, name).device_ptr

    def to_device(self, slot: int, shapes: Mapping[str, tuple[int, ...]], stream: CudaStream) -> None:
        """Enqueue the copies of the inputs in ``shapes`` to the device (nothing when mapped)."""
        for name, shape in shapes.items():
            buffer = self._buffer(slot, name)
            if buffer.separate_device:
                self.device.copy_to_device_async(buffer.device_ptr, self.host_view(slot, name, shape),
                                                 stream)

    def to_host(self, slot: int, shapes: Mapping[str, tuple[int, ...]], stream: CudaStream) -> None:
        """Enqueue the copies of the outputs in ``shapes`` back to the host (nothing when mapped)."""
        for name, shape in shapes.items():
            buffer = self._buffer(slot, name)
            if buffer.separate_device:
                self.device.copy_to_host_async(self.host_view(slot, name, shape), buffer.device_ptr,
                                               stream)

    def close(self) -> None:
        """Free every allocation (idempotent; the device's context need not be current)."""
        frees, self._frees = self._frees, []
        self._sets = []
        errors = []
        for free in reversed(frees):
            try:
                free()
            except EngineError as exc:  # keep freeing the rest; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]
