"""A strict stand-in for the ``tensorrt`` module: the engine-build and runtime APIs of 8.5.x,
8.6.x, 10.x and 11.x.

``make_fake_tensorrt("10.3.0")`` returns a module object to put in ``sys.modules["tensorrt"]``. It
emulates only what an ONNX-to-engine build and the name-based runtime use, and it is strict so that
a call which would fail on a board fails here too:

* Objects have ``__slots__`` and no constructor where TensorRT has none, so an attribute TensorRT
  does not have cannot be set or read (``layer.precision`` on 11.x raises AttributeError).
* Methods take exactly the parameter names of the real binding (``tests/test_fake_tensorrt_surface``
  checks the 10.x flavour against the ``tensorrt-stubs`` package) and check argument types.
* Version rules: 8.x networks need ``EXPLICIT_BATCH`` or the ONNX parser fails; 8.5 has no
  ``builder_optimization_level``; 8.x parser errors have no ``node_name()``; 11.x networks are
  strongly typed and ``BuilderFlag`` has no INT8/FP16/precision-constraint members.
* ``OnnxParser.parse`` really reads the model with ``onnx``: a layer per node named after the node
  (``node_of_<output>`` when unnamed, as onnx-tensorrt does), tensor types from ONNX shape
  inference, and errors with the node's index, name and operator for unknown ops or broken graphs.
* ``Builder.build_serialized_network`` checks the profile against the network, and returns a
  "plan" that is JSON recording what was configured (flags, profile, per-layer precision, DLA,
  workspace, timing-cache hits) - :func:`decode_plan` reads it back - or ``None`` with an ERROR
  on the logger, as TensorRT does. The plan also carries the I/O tensors and the ONNX model.
* ``Runtime.deserialize_cuda_engine`` refuses (``None`` and an ERROR) a plan that is not a plan, or
  one made by another TensorRT version or for another compute capability. The engine computes:
  ``execute_async_v3`` reads the inputs at the addresses given to ``set_tensor_address``, runs the
  model with ONNX Runtime and writes the outputs back. Addresses must lie in memory the fake GPU
  can reach (:class:`FakeGpu`: what :class:`FakeCudaDevice`, a host-memory stand-in for pycuda,
  allocated as device or mapped memory), so a wrong pointer fails the launch. Shapes are checked
  against the profile; output shapes come from ONNX shape inference. Runtime, engine and context
  objects are counted while alive (``FakeState.live``).

Test knobs and records live on ``fake._state`` (:class:`FakeState`).
"""

from __future__ import annotations

import base64
import importlib.machinery
import ctypes
import json
import sys
import threading
import weakref
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from agent.backends.cuda_buffers import DeviceMemory, HostMemory

PLAN_MAGIC = b"FAKE-TRT-PLAN\n"
CACHE_MAGIC = b"FAKE-TRT-TIMING-CACHE\n"

# ONNX ops the fake parser imports, and the TensorRT layer type each becomes.
_LAYER_TYPES = {
    "Conv": "CONVOLUTION",
    "ConvTranspose": "DECONVOLUTION",
    "Relu": "ACTIVATION",
    "Sigmoid": "ACTIVATION",
    "Clip": "ACTIVATION",
    "LeakyRelu": "ACTIVATION",
    "QuantizeLinear": "QUANTIZE",
    "DequantizeLinear": "DEQUANTIZE",
    "Add": "ELEMENTWISE",
    "Mul": "ELEMENTWISE",
    "Sub": "ELEMENTWISE",
    "Identity": "IDENTITY",
    "Cast": "CAST",
    "Reshape": "SHUFFLE",
    "Flatten": "SHUFFLE",
    "Transpose": "SHUFFLE",
    "MaxPool": "POOLING",
    "AveragePool": "POOLING",
    "GlobalAveragePool": "REDUCE",
    "ReduceMean": "REDUCE",
    "Gemm": "MATRIX_MULTIPLY",
    "MatMul": "MATRIX_MULTIPLY",
    "Softmax": "SOFTMAX",
    "BatchNormalization": "SCALE",
    "Concat": "CONCATENATION",
}

# onnx TensorProto element type -> TensorRT DataType member.
_ONNX_TO_TRT = {
    TensorProto.FLOAT: "FLOAT",
    TensorProto.FLOAT16: "HALF",
    TensorProto.INT8: "INT8",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.BOOL: "BOOL",
    TensorProto.UINT8: "UINT8",
    TensorProto.BFLOAT16: "BF16",
}

_WEAK_TYPING_FLAGS = (
    "FP16",
    "BF16",
    "INT8",
    "FP8",
    "INT4",
    "FP4",
    "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS",
    "DIRECT_IO",
)
_BUILDER_FLAGS_8_5 = (
    "FP16",
    "INT8",
    "DEBUG",
    "GPU_FALLBACK",
    "STRICT_TYPES",
    "REFIT",
    "DISABLE_TIMING_CACHE",
    "TF32",
    "SPARSE_WEIGHTS",
    "SAFETY_SCOPE",
    "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS",
    "DIRECT_IO",
    "REJECT_EMPTY_ALGORITHMS",
    "ENABLE_TACTIC_HEURISTIC",
)
_BUILDER_FLAGS_8_6 = tuple(flag for flag in _BUILDER_FLAGS_8_5 if flag != "ENABLE_TACTIC_HEURISTIC") + (
    "VERSION_COMPATIBLE",
    "EXCLUDE_LEAN_RUNTIME",
    "FP8",
)
_BUILDER_FLAGS_10 = (
    "FP16",
    "BF16",
    "INT8",
    "DEBUG",
    "GPU_FALLBACK",
    "REFIT",
    "DISABLE_TIMING_CACHE",
    "TF32",
    "SPARSE_WEIGHTS",
    "SAFETY_SCOPE",
    "OBEY_PRECISION_CONSTRAINTS",
    "PREFER_PRECISION_CONSTRAINTS",
    "DIRECT_IO",
    "REJECT_EMPTY_ALGORITHMS",
    "VERSION_COMPATIBLE",
    "EXCLUDE_LEAN_RUNTIME",
    "FP8",
    "ERROR_ON_TIMING_CACHE_MISS",
    "DISABLE_COMPILATION_CACHE",
    "WEIGHTLESS",
    "STRIP_PLAN",
    "REFIT_IDENTICAL",
    "WEIGHT_STREAMING",
    "INT4",
    "REFIT_INDIVIDUAL",
    "STRICT_NANS",
    "MONITOR_MEMORY",
    "FP4",
    "EDITABLE_TIMING_CACHE",
    "DISTRIBUTIVE_INDEPENDENCE",
)
_BUILDER_FLAGS_11 = tuple(flag for flag in _BUILDER_FLAGS_10 if flag not in _WEAK_TYPING_FLAGS)


class FakeGpu:
    """What the fake GPU can address (live device allocations and mapped host memory) and which
    streams exist.

    The fake engine reads its inputs from, and writes its outputs to, the addresses given to
    ``set_tensor_address``; an address outside every live region (a host pointer where a device one
    was due, a freed buffer, a buffer too small) fails the launch instead of touching memory.
    """

    def __init__(self) -> None:
        self._regions: dict[int, int] = {}  # start address -> bytes
        self._streams: set[int] = set()
        # Work queued on the fake's own streams, run by synchronize() (as a GPU runs it after the
        # call that queued it returned): reading results without synchronizing reads stale bytes.
        self._pending: dict[int, list[Callable[[], None]]] = {}
        self._next_stream = 0x5000
        self._lock = threading.Lock()
        # One drain at a time runs work, so work runs in the order it was queued and a
        # synchronize returns only once everything queued before it has run.
        self._draining = threading.RLock()

    def map(self, address: int, nbytes: int) -> None:
        with self._lock:
            self._regions[address] = nbytes

    def unmap(self, address: int) -> None:
        with self._lock:
            if self._regions.pop(address, None) is None:
                raise RuntimeError(f"fake GPU: {address:#x} freed twice or never allocated")

    def covers(self, address: int, nbytes: int) -> bool:
        with self._lock:
            return any(
                start <= address and address + nbytes <= start + size
                for start, size in self._regions.items()
            )

    def open_stream(self) -> int:
        with self._lock:
            self._next_stream += 0x10
            self._streams.add(self._next_stream)
            self._pending[self._next_stream] = []
            return self._next_stream

    def enqueue(self, handle: int, work: Callable[[], None]) -> None:
        """Queue ``work`` on a stream the fake opened; on any other (the default stream, or a
        real CUDA stream adopted from elsewhere) it runs at once."""
        with self._lock:
            queue = self._pending.get(handle)
            if queue is not None:
                queue.append(work)
                return
        work()

    def drain(self, handle: int) -> None:
        """Run the work queued on a stream, in order (what synchronizing waits for)."""
        with self._draining:
            while True:
                with self._lock:
                    queue = self._pending.get(handle) or []
                    if not queue:
                        return
                    work = queue.pop(0)
                work()

    def adopt_stream(self, handle: int) -> None:
        """Accept a stream made elsewhere (a real CUDA stream, when the fake engine runs on one)."""
        with self._lock:
            self._streams.add(handle)

    def close_stream(self, handle: int) -> None:
        self.drain(handle)  # destroying a stream lets its queued work finish
        with self._lock:
            self._streams.remove(handle)
            self._pending.pop(handle, None)

    def stream_is_open(self, handle: int) -> bool:
        with self._lock:
            return handle in self._streams

    @property
    def live_regions(self) -> int:
        return len(self._regions)

    @property
    def open_streams(self) -> int:
        return len(self._streams)


class FakeCudaStream:
    """A stream of :class:`FakeCudaDevice`; work on it runs in call order when it is synchronized."""

    def __init__(self, device: FakeCudaDevice, handle: int) -> None:
        self.device = device
        self._handle: int | None = handle

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise RuntimeError("fake CUDA: stream used after close()")
        return self._handle

    def synchronize(self) -> None:
        self.device.require_current("cuStreamSynchronize")
        self.device.gpu.drain(self.handle)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self.device.require_current("cuStreamDestroy")
            self.device.gpu.close_stream(handle)


class FakeCudaDevice:
    """A stand-in for agent.backends.cuda_buffers.PycudaDevice on host memory (no CUDA needed).

    "Device" memory is host memory that only the fake GPU (:class:`FakeGpu`) and the copy calls
    reach; mapped host memory is registered with the fake GPU too, as zero copy works on a board.
    Fresh buffers are filled with 0xFF bytes (NaN in float32), so a result that skipped a copy
    shows. Every call but ``scope``, ``close`` and the frees needs ``scope()`` active on the calling
    thread, as CUDA needs a current context.
    """

    def __init__(
        self,
        gpu: FakeGpu,
        *,
        integrated: bool,
        compute_capability: str = "8.7",
        multiprocessors: int = 16,
        can_map_host_memory: bool = True,
        name: str = "Fake Orin",
    ) -> None:
        self.gpu = gpu
        self.name = name
        self.compute_capability = compute_capability
        self.multiprocessors = multiprocessors
        self.integrated = integrated
        self.can_map_host_memory = can_map_host_memory
        self.closed = False
        self.copies: list[tuple[str, int]] = []  # ("to_device" | "to_host", bytes)
        self.allocations = 0  # live host and device allocations
        self._local = threading.local()
        self._backing: dict[int, np.ndarray] = {}

    def _depth(self) -> int:
        return int(getattr(self._local, "depth", 0))

    @contextmanager
    def scope(self) -> Iterator[None]:
        if self.closed:
            raise RuntimeError("fake CUDA: device used after close()")
        self._local.depth = self._depth() + 1
        try:
            yield
        finally:
            self._local.depth = self._depth() - 1

    def require_current(self, call: str) -> None:
        if self.closed or self._depth() == 0:
            raise RuntimeError(f"fake CUDA: {call} without a current context")

    def create_stream(self) -> FakeCudaStream:
        self.require_current("cuStreamCreate")
        return FakeCudaStream(self, self.gpu.open_stream())

    def _allocate(self, nbytes: int, *, on_gpu: bool) -> tuple[np.ndarray, Any]:
        if nbytes <= 0:
            raise RuntimeError("fake CUDA: allocations must not be empty")
        array = np.full(nbytes, 0xFF, dtype=np.uint8)
        address = int(array.ctypes.data)
        if on_gpu:
            self.gpu.map(address, nbytes)
        self._backing[address] = array
        self.allocations += 1
        freed = False

        def free() -> None:
            nonlocal freed
            if freed:
                return
            freed = True
            if on_gpu:
                self.gpu.unmap(address)
            # A real free unmaps the pages; here a view kept past the free reads NaN instead.
            self._backing.pop(address).fill(0xFF)
            self.allocations -= 1

        return array, free

    def alloc_host(self, nbytes: int, *, mapped: bool) -> HostMemory:
        self.require_current("cuMemHostAlloc")
        array, free = self._allocate(nbytes, on_gpu=mapped)
        return HostMemory(array=array, device_ptr=int(array.ctypes.data) if mapped else None, free=free)

    def alloc_device(self, nbytes: int) -> DeviceMemory:
        self.require_current("cuMemAlloc")
        array, free = self._allocate(nbytes, on_gpu=True)
        return DeviceMemory(ptr=int(array.ctypes.data), nbytes=nbytes, free=free)

    def _check_copy(self, call: str, address: int, host: np.ndarray, stream: Any) -> None:
        self.require_current(call)
        if not isinstance(stream, FakeCudaStream) or stream.device is not self:
            raise RuntimeError(f"fake CUDA: {call} on a stream of another device")
        if not self.gpu.stream_is_open(stream.handle):
            raise RuntimeError(f"fake CUDA: {call} on a destroyed stream")
        if not host.flags.c_contiguous:
            raise RuntimeError(f"fake CUDA: {call} needs a contiguous host buffer")
        if not self.gpu.covers(address, host.nbytes):
            raise RuntimeError(f"fake CUDA: {call} to {address:#x} outside device memory")

    def copy_to_device_async(self, dst_ptr: int, src: np.ndarray, stream: Any) -> None:
        self._check_copy("cuMemcpyHtoDAsync", dst_ptr, src, stream)
        source, nbytes = src.ctypes.data, src.nbytes
        self.gpu.enqueue(stream.handle, lambda: ctypes.memmove(dst_ptr, source, nbytes))
        self.copies.append(("to_device", src.nbytes))

    def copy_to_host_async(self, dst: np.ndarray, src_ptr: int, stream: Any) -> None:
        self._check_copy("cuMemcpyDtoHAsync", src_ptr, dst, stream)
        target, nbytes = dst.ctypes.data, dst.nbytes
        self.gpu.enqueue(stream.handle, lambda: ctypes.memmove(target, src_ptr, nbytes))
        self.copies.append(("to_host", dst.nbytes))

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeState:
    """What a test can set (before building) or read (after) on ``fake._state``."""

    version: str
    num_dla_cores: int = 0
    # When set, every build logs this as an ERROR and returns None.
    fail_build_with: str | None = None
    # Layers with no kernel in the precision they are constrained to: the build goes on in the
    # fastest kernel and logs a warning (as TensorRT 8.x did for some layers under strict types).
    no_kernel_in_constrained_precision: set[str] = field(default_factory=set)
    # Timing caches are keyed by TensorRT version and this (a cache from elsewhere mismatches).
    compute_capability: str = "8.7"
    plugins_initialised: bool = False
    # The logger TensorRT's plugin library was last given. The real library keeps a raw pointer
    # (no keep-alive in the binding) and logs through it when a plugin is looked up or created:
    # once that logger is garbage, the next such log is a use after free (here: an error).
    plugin_logger: Any = None
    builds: list[dict[str, Any]] = field(default_factory=list)
    # Called before each step of a build's "Building engine" phase (one step per layer), with
    # the step number: a test makes the build slow or does something mid-build with it.
    on_build_step: Callable[[int], None] | None = None
    # What the builder told the progress monitor: ("start", phase, parent, steps),
    # ("step", phase, step) and ("finish", phase).
    progress_calls: list[tuple[Any, ...]] = field(default_factory=list)
    # The runtime side: what the fake engine may address, how many runtime objects are alive
    # (by class name), and how many batches ran.
    gpu: FakeGpu = field(default_factory=FakeGpu)
    live: dict[str, int] = field(default_factory=dict)
    executions: int = 0


def decode_plan(plan: bytes) -> dict[str, Any]:
    """The configuration recorded in a plan made by the fake builder."""
    if not plan.startswith(PLAN_MAGIC):
        raise ValueError("not a fake TensorRT plan")
    decoded: dict[str, Any] = json.loads(plan[len(PLAN_MAGIC) :].decode("utf-8"))
    return decoded


def state_of(module: types.ModuleType) -> FakeState:
    """The :class:`FakeState` of a module made by :func:`make_fake_tensorrt`."""
    state = getattr(module, "_state", None)
    if not isinstance(state, FakeState):
        raise TypeError("not a fake tensorrt module")
    return state


def _incompatible(function: str, parameter: str, value: object, expected: str) -> TypeError:
    # pybind11 reports a wrong argument type as a TypeError naming the function.
    return TypeError(
        f"{function}(): incompatible function arguments: {parameter} must be {expected}, "
        f"got {type(value).__name__}"
    )


def _no_constructor(self: object, *args: object, **kwargs: object) -> None:
    raise TypeError(f"tensorrt.{type(self).__name__}: No constructor defined!")


_no_constructor.no_constructor = True  # type: ignore[attr-defined]


def _make(cls: Any, **slots: Any) -> Any:
    """Create an object of a class whose public constructor is disabled."""
    obj = cls.__new__(cls)
    for name, value in slots.items():
        object.__setattr__(obj, name, value)
    return obj


class _FakeEnum:
    """Base of the pybind11-style enums: members are instances with ``name`` and ``value``."""

    __slots__ = ("_name", "_value")
    __members__: dict[str, Any]

    def __init__(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _incompatible(f"{type(self).__name__}.__init__", "value", value, "int")
        names = [name for name, member in type(self).__members__.items() if member._value == value]
        self._name = names[0] if names else "???"
        self._value = value

    @property
    def name(self) -> str:
        return self._name

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._value == self._value  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name}: {self._value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self._name}"


def _make_enum(name: str, members: tuple[str, ...] | dict[str, int]) -> Any:
    values = (
        members if isinstance(members, dict) else {member: index for index, member in enumerate(members)}
    )
    cls: Any = type(name, (_FakeEnum,), {"__slots__": (), "__module__": "tensorrt"})
    cls.__members__ = {}
    for member_name, value in values.items():
        member = cls.__new__(cls)
        member._name = member_name
        member._value = value
        setattr(cls, member_name, member)
        cls.__members__[member_name] = member
    return cls


# TensorRT DataType member -> numpy dtype, for the fake engine's I/O.
_NUMPY_OF = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "UINT8": np.uint8,
}


def _output_shapes(model: bytes, input_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The model's output shapes for these input shapes, by ONNX shape inference (-1 where it
    cannot tell, as for a data-dependent shape)."""
    proto = onnx.load_model_from_string(model)
    for value in proto.graph.input:
        if value.name in input_shapes:
            for dim, extent in zip(value.type.tensor_type.shape.dim, input_shapes[value.name], strict=True):
                dim.Clear()
                dim.dim_value = extent
    for value in proto.graph.output:
        value.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    return {
        value.name: tuple(
            dim.dim_value if dim.HasField("dim_value") else -1 for dim in value.type.tensor_type.shape.dim
        )
        for value in inferred.output
    }


def _as_shape(value: object, function: str, parameter: str) -> tuple[int, ...]:
    """A shape from Dims, list or tuple of ints (pybind11 converts sequences to Dims implicitly)."""
    items: Any = value._dims if hasattr(value, "_dims") else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in items
    ):
        raise _incompatible(function, parameter, value, "Dims")
    return tuple(items)


def make_fake_tensorrt(version: str = "10.3.0") -> types.ModuleType:  # noqa: C901 - one closure per flavour
    """Build a fake ``tensorrt`` module for ``version`` (8.5.x, 8.6.x, 10.x or 11.x)."""
    parts = [int(part) for part in version.split(".")[:2]]
    major, minor = parts[0], parts[1] if len(parts) > 1 else 0
    if not ((major == 8 and minor in (5, 6)) or major in (10, 11)):
        raise ValueError(f"the fake emulates TensorRT 8.5, 8.6, 10.x and 11.x, not {version}")
    explicit_batch_required = major == 8
    strongly_typed_only = major >= 11
    has_optimization_level = (major, minor) >= (8, 6)
    has_node_name = major >= 10
    state = FakeState(version=version)
    trt = types.ModuleType("tensorrt", "Fake TensorRT (tests/fakes/fake_tensorrt.py)")
    # A module in sys.modules without a spec breaks importlib.util.find_spec("tensorrt"), which
    # torch's first import of its compiler stack calls.
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)

    # -- enums ------------------------------------------------------------------------------
    data_types = {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5}
    if has_optimization_level:
        data_types["FP8"] = 6
    if major >= 10:
        data_types.update({"BF16": 7, "INT64": 8, "INT4": 9})
    DataType = _make_enum("DataType", data_types)
    if explicit_batch_required:
        BuilderFlag = _make_enum(
            "BuilderFlag", _BUILDER_FLAGS_8_6 if has_optimization_level else _BUILDER_FLAGS_8_5
        )
        NetworkDefinitionCreationFlag = _make_enum(
            "NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0, "EXPLICIT_PRECISION": 1}
        )
    elif strongly_typed_only:
        BuilderFlag = _make_enum("BuilderFlag", _BUILDER_FLAGS_11)
        NetworkDefinitionCreationFlag = _make_enum(
            "NetworkDefinitionCreationFlag",
            {"STRONGLY_TYPED": 1, "PREFER_JIT_PYTHON_PLUGINS": 2, "PREFER_AOT_PYTHON_PLUGINS": 3},
        )
    else:
        BuilderFlag = _make_enum("BuilderFlag", _BUILDER_FLAGS_10)
        NetworkDefinitionCreationFlag = _make_enum(
            "NetworkDefinitionCreationFlag",
            {
                "EXPLICIT_BATCH": 0,
                "STRONGLY_TYPED": 1,
                "PREFER_JIT_PYTHON_PLUGINS": 2,
                "PREFER_AOT_PYTHON_PLUGINS": 3,
            },
        )
    pools = ["WORKSPACE", "DLA_MANAGED_SRAM", "DLA_LOCAL_DRAM", "DLA_GLOBAL_DRAM"]
    if has_optimization_level:
        pools.append("TACTIC_DRAM")
    if major >= 10:
        pools.append("TACTIC_SHARED_MEMORY")
    MemoryPoolType = _make_enum("MemoryPoolType", tuple(pools))
    DeviceType = _make_enum("DeviceType", ("GPU", "DLA"))
    error_codes = [
        "SUCCESS",
        "INTERNAL_ERROR",
        "MEM_ALLOC_FAILED",
        "MODEL_DESERIALIZE_FAILED",
        "INVALID_VALUE",
        "INVALID_GRAPH",
        "INVALID_NODE",
        "UNSUPPORTED_GRAPH",
        "UNSUPPORTED_NODE",
    ]
    if major >= 10:
        error_codes += [
            "UNSUPPORTED_NODE_ATTR",
            "UNSUPPORTED_NODE_INPUT",
            "UNSUPPORTED_NODE_DATATYPE",
            "UNSUPPORTED_NODE_DYNAMIC",
            "UNSUPPORTED_NODE_SHAPE",
            "REFIT_FAILED",
        ]
    ErrorCode = _make_enum("ErrorCode", tuple(error_codes))
    layer_types = sorted(set(_LAYER_TYPES.values()) | {"CONSTANT"})
    if major == 8:
        layer_types.remove("CAST")  # ICastLayer came with 8.6+; 8.5's parser imports Cast as identity
    LayerType = _make_enum("LayerType", tuple(layer_types))
    Severity = _make_enum("Severity", ("INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE"))

    # -- logging -----------------------------------------------------------------------------
    class ILogger:
        __slots__ = ("_trt_initialised",)

        def __init__(self) -> None:
            self._trt_initialised = True

        def log(self, severity: Any, msg: str) -> None:
            raise RuntimeError('Tried to call pure virtual function "ILogger::log"')

    ILogger.Severity = Severity  # type: ignore[attr-defined]
    for member in Severity.__members__:
        setattr(ILogger, member, getattr(Severity, member))

    class Logger(ILogger):
        __slots__ = ("min_severity",)

        def __init__(self, min_severity: Any = Severity.WARNING) -> None:
            ILogger.__init__(self)
            self.min_severity = min_severity

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(self.min_severity):
                print(f"[TRT] [{severity.name[0]}] {msg}", file=sys.stderr)

    def _check_logger(function: str, logger: object) -> None:
        if not isinstance(logger, ILogger):
            raise _incompatible(function, "logger", logger, "ILogger")
        if not getattr(logger, "_trt_initialised", False):
            raise TypeError(f"{type(logger).__name__}.__init__() must call tensorrt.ILogger.__init__()")

    def _emit(logger: Any, severity: str, message: str) -> None:
        logger.log(getattr(Severity, severity), message)

    # -- progress (10.0+) ---------------------------------------------------------------------------
    class IProgressMonitor:
        # Abstract like ILogger: a subclass overrides all three and calls the base __init__.
        __slots__ = ("_trt_initialised",)

        def __init__(self) -> None:
            self._trt_initialised = True

        def phase_start(self, phase_name: str, parent_phase: str, num_steps: int) -> None:
            raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::phaseStart"')

        def step_complete(self, phase_name: str, step: int) -> bool:
            raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::stepComplete"')

        def phase_finish(self, phase_name: str) -> None:
            raise RuntimeError('Tried to call pure virtual function "IProgressMonitor::phaseFinish"')

    def _run_build_phases(config: Any, steps: int) -> bool:
        """Report a build's progress to the config's monitor; False when it asked to stop.

        Like TensorRT, the monitor is called from the building thread and a step that returns
        False ends the phase early (phase_finish still comes) and the build returns None."""
        monitor = config._progress_monitor
        record = state.progress_calls.append
        outer, inner = "Building engine", "Timing layers"
        if monitor is not None:
            monitor.phase_start(outer, None, 1)
            record(("start", outer, None, 1))
            monitor.phase_start(inner, outer, steps)
            record(("start", inner, outer, steps))
        completed = True
        for step in range(steps):
            if state.on_build_step is not None:
                state.on_build_step(step)
            if monitor is None:
                continue
            go_on = monitor.step_complete(inner, step)
            record(("step", inner, step))
            if not isinstance(go_on, bool):
                raise TypeError("IProgressMonitor.step_complete must return bool")
            if not go_on:
                completed = False
                break
        if monitor is not None:
            monitor.phase_finish(inner)
            record(("finish", inner))
            if completed:
                monitor.step_complete(outer, 0)
                record(("step", outer, 0))
            monitor.phase_finish(outer)
            record(("finish", outer))
        return completed

    # -- shapes and tensors ------------------------------------------------------------------------
    class Dims:
        __slots__ = ("_dims",)
        MAX_DIMS = 8

        def __init__(self, shape: Any = None) -> None:
            self._dims = (
                ()
                if shape is None
                else _as_shape(list(shape) if isinstance(shape, tuple) else shape, "Dims.__init__", "shape")
            )
            if len(self._dims) > self.MAX_DIMS:
                raise ValueError(f"Dims supports at most {self.MAX_DIMS} dimensions")

        def __len__(self) -> int:
            return len(self._dims)

        def __getitem__(self, index: int) -> int:
            if not isinstance(index, int):
                raise _incompatible("Dims.__getitem__", "index", index, "int")
            return self._dims[index]

        def __eq__(self, other: object) -> bool:
            if isinstance(other, Dims):
                return self._dims == other._dims
            return isinstance(other, (list, tuple)) and tuple(other) == self._dims

        __hash__ = None  # type: ignore[assignment]

        def __repr__(self) -> str:
            return repr(self._dims)

    class ITensor:
        __slots__ = ("_name", "_dtype", "_shape", "_is_input", "_is_output", "_producer")
        _name: str
        _dtype: Any
        _shape: tuple[int, ...]
        _is_input: bool
        _is_output: bool
        _producer: Any
        __init__ = _no_constructor

        @property
        def name(self) -> str:
            return self._name

        @name.setter
        def name(self, value: str) -> None:
            if not isinstance(value, str):
                raise _incompatible("ITensor.name", "value", value, "str")
            self._name = value

        @property
        def dtype(self) -> Any:
            return self._dtype

        @property
        def shape(self) -> Any:
            return Dims(list(self._shape))

        @property
        def is_network_input(self) -> bool:
            return bool(self._is_input)

        @property
        def is_network_output(self) -> bool:
            return bool(self._is_output)

        @property
        def is_shape_tensor(self) -> bool:
            return False

    # -- layers ------------------------------------------------------------------------------------
    class _LayerBase:
        __slots__ = ("_name", "_type", "_inputs", "_outputs", "_quantized", "_precision", "_output_types")
        _name: str
        _type: Any
        _inputs: list[Any]
        _outputs: list[Any]
        _quantized: bool
        _precision: Any
        _output_types: dict[int, Any]
        __init__ = _no_constructor

        @property
        def name(self) -> str:
            return self._name

        @name.setter
        def name(self, value: str) -> None:
            if not isinstance(value, str):
                raise _incompatible("ILayer.name", "value", value, "str")
            self._name = value

        @property
        def type(self) -> Any:
            return self._type

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        @property
        def num_outputs(self) -> int:
            return len(self._outputs)

        def get_input(self, index: int) -> Any:
            return self._inputs[index] if 0 <= index < len(self._inputs) else None

        def get_output(self, index: int) -> Any:
            return self._outputs[index] if 0 <= index < len(self._outputs) else None

    def _check_index(layer: Any, function: str, index: object) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise _incompatible(function, "index", index, "int")
        if not 0 <= index < len(layer._outputs):
            raise IndexError(f"{function}: output index {index} out of range")
        return index

    def _check_dtype(function: str, parameter: str, value: object) -> None:
        if not isinstance(value, DataType):
            raise _incompatible(function, parameter, value, "DataType")

    if strongly_typed_only:

        class ILayer(_LayerBase):
            # 11.x: strong typing only; precision and output types come from the graph.
            __slots__ = ()
    else:

        class ILayer(_LayerBase):  # type: ignore[no-redef]
            __slots__ = ()

            @property
            def precision(self) -> Any:
                return self._precision if self._precision is not None else DataType.FLOAT

            @precision.setter
            def precision(self, value: Any) -> None:
                _check_dtype("ILayer.precision", "value", value)
                self._precision = value

            @property
            def precision_is_set(self) -> bool:
                return self._precision is not None

            def reset_precision(self) -> None:
                self._precision = None

            def set_output_type(self, index: int, dtype: Any) -> None:
                _check_dtype("ILayer.set_output_type", "dtype", dtype)
                self._output_types[_check_index(self, "ILayer.set_output_type", index)] = dtype

            def get_output_type(self, index: int) -> Any:
                index = _check_index(self, "ILayer.get_output_type", index)
                return self._output_types.get(index, self._outputs[index].dtype)

            def output_type_is_set(self, index: int) -> bool:
                return _check_index(self, "ILayer.output_type_is_set", index) in self._output_types

            def reset_output_type(self, index: int) -> None:
                self._output_types.pop(_check_index(self, "ILayer.reset_output_type", index), None)

    # -- network -----------------------------------------------------------------------------------
    class INetworkDefinition:
        __slots__ = (
            "_flags",
            "_explicit_batch",
            "_strongly_typed",
            "_inputs",
            "_outputs",
            "_layers",
            "_layer_names",
            "_suffix",
            "_parsed",
            "_name",
            "_model",
        )
        _flags: int
        _explicit_batch: bool
        _strongly_typed: bool
        _inputs: list[Any]
        _outputs: list[Any]
        _layers: list[Any]
        _layer_names: set[str]
        _suffix: int
        _parsed: bool
        _name: str
        _model: bytes | None
        __init__ = _no_constructor

        @property
        def name(self) -> str:
            return self._name

        @name.setter
        def name(self, value: str) -> None:
            self._name = value

        @property
        def flags(self) -> int:
            return self._flags

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        @property
        def num_outputs(self) -> int:
            return len(self._outputs)

        @property
        def num_layers(self) -> int:
            return len(self._layers)

        def get_input(self, index: int) -> Any:
            return self._inputs[index] if 0 <= index < len(self._inputs) else None

        def get_output(self, index: int) -> Any:
            return self._outputs[index] if 0 <= index < len(self._outputs) else None

        def get_layer(self, index: int) -> Any:
            return self._layers[index] if 0 <= index < len(self._layers) else None

        def get_flag(self, flag: Any) -> bool:
            if not isinstance(flag, NetworkDefinitionCreationFlag):
                raise _incompatible(
                    "INetworkDefinition.get_flag", "flag", flag, "NetworkDefinitionCreationFlag"
                )
            return bool(self._flags & (1 << int(flag)))

        def add_input(self, name: str, dtype: Any, shape: Any) -> Any:
            if not isinstance(name, str):
                raise _incompatible("INetworkDefinition.add_input", "name", name, "str")
            _check_dtype("INetworkDefinition.add_input", "dtype", dtype)
            tensor = _make(
                ITensor,
                _name=name,
                _dtype=dtype,
                _shape=_as_shape(shape, "INetworkDefinition.add_input", "shape"),
                _is_input=True,
                _is_output=False,
                _producer=None,
            )
            self._inputs.append(tensor)
            return tensor

        def mark_output(self, tensor: Any) -> None:
            if not isinstance(tensor, ITensor):
                raise _incompatible("INetworkDefinition.mark_output", "tensor", tensor, "ITensor")
            tensor._is_output = True
            self._outputs.append(tensor)

    if major == 8:

        def _has_implicit_batch_dimension(self: Any) -> bool:
            return not self._explicit_batch

        INetworkDefinition.has_implicit_batch_dimension = property(  # type: ignore[attr-defined]
            _has_implicit_batch_dimension
        )

    def _add_layer(
        network: Any,
        base_name: str,
        layer_type: str,
        inputs: list[Any],
        outputs: list[tuple[str, Any, tuple[int, ...]]],
        quantized: bool,
    ) -> Any:
        # onnx-tensorrt names a node's layer after the node and uniquifies a clash with "_<n>".
        name = base_name
        while name in network._layer_names:
            name = f"{base_name}_{network._suffix}"
            network._suffix += 1
        network._layer_names.add(name)
        layer = _make(
            ILayer,
            _name=name,
            _type=getattr(LayerType, layer_type),
            _inputs=inputs,
            _outputs=[],
            _quantized=quantized,
            _precision=None,
            _output_types={},
        )
        for tensor_name, dtype, shape in outputs:
            layer._outputs.append(
                _make(
                    ITensor,
                    _name=tensor_name,
                    _dtype=dtype,
                    _shape=shape,
                    _is_input=False,
                    _is_output=False,
                    _producer=layer,
                )
            )
        network._layers.append(layer)
        return layer

    # -- parser ------------------------------------------------------------------------------------
    class _ParserErrorBase:
        __slots__ = ("_code", "_desc", "_node", "_node_name", "_node_operator")
        _code: Any
        _desc: str
        _node: int
        _node_name: str
        _node_operator: str
        __init__ = _no_constructor

        def code(self) -> Any:
            return self._code

        def desc(self) -> str:
            return self._desc

        def node(self) -> int:
            return self._node

        def file(self) -> str:
            return "ModelImporter.cpp"

        def func(self) -> str:
            return "parseGraph"

        def line(self) -> int:
            return 0

        def __str__(self) -> str:
            where = f"In node {self._node} " if self._node >= 0 else ""
            return f"{where}{self._code.name}: {self._desc}"

    if has_node_name:

        class ParserError(_ParserErrorBase):
            __slots__ = ()

            def node_name(self) -> str:
                return self._node_name

            def node_operator(self) -> str:
                return self._node_operator

            def local_function_stack(self) -> list[str]:
                return []

            def local_function_stack_size(self) -> int:
                return 0
    else:

        class ParserError(_ParserErrorBase):  # type: ignore[no-redef]
            # 8.x IParserError: code, desc, file, line, func and node (an index) only.
            __slots__ = ()

    class OnnxParser:
        __slots__ = ("_network", "_logger", "_errors")

        def __init__(self, network: Any, logger: Any) -> None:
            if not isinstance(network, INetworkDefinition):
                raise _incompatible("OnnxParser.__init__", "network", network, "INetworkDefinition")
            _check_logger("OnnxParser.__init__", logger)
            self._network = network
            self._logger = logger
            self._errors: list[Any] = []

        @property
        def num_errors(self) -> int:
            return len(self._errors)

        def get_error(self, index: int) -> Any:
            if not 0 <= index < len(self._errors):
                raise IndexError(f"parser error index {index} out of range")
            return self._errors[index]

        def clear_errors(self) -> None:
            self._errors = []

        def supports_operator(self, op_name: str) -> bool:
            return op_name in _LAYER_TYPES or op_name == "Constant"

        def _fail(
            self, code: str, desc: str, node: int = -1, node_name: str = "", operator: str = ""
        ) -> bool:
            self._errors.append(
                _make(
                    ParserError,
                    _code=getattr(ErrorCode, code),
                    _desc=desc,
                    _node=node,
                    _node_name=node_name,
                    _node_operator=operator,
                )
            )
            _emit(
                self._logger,
                "ERROR",
                f"ModelImporter: {desc}" + (f" (node {node} '{node_name}')" if node >= 0 else ""),
            )
            return False

        def parse(self, model: Any, path: str | None = None) -> bool:
            if not isinstance(model, (bytes, bytearray, memoryview)):
                raise _incompatible("OnnxParser.parse", "model", model, "buffer")
            if path is not None and not isinstance(path, str):
                raise _incompatible("OnnxParser.parse", "path", path, "str")
            self._errors = []
            _plugin_log("looking up plugin creators for the network's nodes")
            network = self._network
            if not network._explicit_batch:
                return self._fail(
                    "INVALID_VALUE",
                    "this ONNX parser only supports networks with an explicit "
                    "batch dimension; create the network with the EXPLICIT_BATCH flag",
                )
            try:
                proto = onnx.load_model_from_string(bytes(model))
            except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
                return self._fail("MODEL_DESERIALIZE_FAILED", f"failed to parse the ONNX model ({exc})")
            graph = proto.graph
            if not graph.node:
                return self._fail("INVALID_GRAPH", "the ONNX model has no nodes")
            try:
                inferred = onnx.shape_inference.infer_shapes(proto).graph
            except Exception:  # noqa: BLE001 - fall back to the declared types only
                inferred = graph
            types_by_name: dict[str, int] = {}
            shapes_by_name: dict[str, tuple[int, ...]] = {}
            for info in list(inferred.value_info) + list(inferred.output) + list(inferred.input):
                tensor_type = info.type.tensor_type
                types_by_name[info.name] = tensor_type.elem_type
                if tensor_type.HasField("shape"):
                    shapes_by_name[info.name] = tuple(
                        dim.dim_value if dim.HasField("dim_value") else -1 for dim in tensor_type.shape.dim
                    )
            known: dict[str, Any] = {}
            weights = {initializer.name for initializer in graph.initializer}
            for value in graph.input:
                if value.name in weights:
                    continue
                elem_type = value.type.tensor_type.elem_type
                if elem_type not in _ONNX_TO_TRT or not hasattr(DataType, _ONNX_TO_TRT[elem_type]):
                    return self._fail(
                        "UNSUPPORTED_GRAPH", f"input '{value.name}' has an unsupported data type"
                    )
                dims = tuple(
                    dim.dim_value if dim.HasField("dim_value") else -1
                    for dim in value.type.tensor_type.shape.dim
                )
                known[value.name] = network.add_input(
                    value.name, getattr(DataType, _ONNX_TO_TRT[elem_type]), dims
                )
            dequantized: set[str] = set()
            for index, node in enumerate(graph.node):
                name = node.name or (f"node_of_{node.output[0]}" if node.output else "")
                if node.op_type == "Constant":
                    weights.update(node.output)
                    continue
                if node.domain not in ("", "ai.onnx") or node.op_type not in _LAYER_TYPES:
                    _emit(
                        self._logger,
                        "INFO",
                        f"No importer registered for op: {node.op_type}. Attempting to import as plugin.",
                    )
                    return self._fail(
                        "UNSUPPORTED_NODE",
                        f"no importer or plugin for op '{node.op_type}'",
                        index,
                        name,
                        node.op_type,
                    )
                layer_inputs = []
                for input_name in node.input:
                    if not input_name or input_name in weights:
                        continue
                    if input_name not in known:
                        return self._fail(
                            "INVALID_GRAPH",
                            f"input '{input_name}' is produced by no node",
                            index,
                            name,
                            node.op_type,
                        )
                    layer_inputs.append(known[input_name])
                outputs = []
                for output_name in node.output:
                    elem_type = types_by_name.get(output_name, TensorProto.FLOAT)
                    if node.op_type == "QuantizeLinear":
                        elem_type = TensorProto.INT8
                    dtype = getattr(DataType, _ONNX_TO_TRT.get(elem_type, "FLOAT"), DataType.FLOAT)
                    outputs.append((output_name, dtype, shapes_by_name.get(output_name, ())))
                layer_type = _LAYER_TYPES[node.op_type]
                if layer_type == "CAST" and not hasattr(LayerType, "CAST"):
                    layer_type = "IDENTITY"
                quantized = any(input_name in dequantized for input_name in node.input)
                layer = _add_layer(network, name, layer_type, layer_inputs, outputs, quantized)
                for tensor in layer._outputs:
                    known[tensor.name] = tensor
                if node.op_type == "DequantizeLinear":
                    dequantized.update(node.output)
            for value in graph.output:
                if value.name not in known:
                    return self._fail(
                        "INVALID_GRAPH", f"graph output '{value.name}' is produced by no node"
                    )
                network.mark_output(known[value.name])
            network._parsed = True
            network._model = bytes(model)
            return True

    # -- builder configuration -----------------------------------------------------------------------
    class IOptimizationProfile:
        __slots__ = ("_shapes",)
        _shapes: dict[str, tuple[tuple[int, ...], ...]]
        __init__ = _no_constructor

        def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002 - real names
            if not isinstance(input, str):
                raise _incompatible("IOptimizationProfile.set_shape", "input", input, "str")
            shapes = [
                _as_shape(value, "IOptimizationProfile.set_shape", label)
                for value, label in ((min, "min"), (opt, "opt"), (max, "max"))
            ]
            low, mid, high = shapes
            if not len(low) == len(mid) == len(high):
                raise RuntimeError(f"set_shape('{input}'): min, opt and max must have the same rank")
            if any(dim < 0 for shape in shapes for dim in shape):
                raise RuntimeError(f"set_shape('{input}'): dimensions must not be negative")
            if any(not a <= b <= c for a, b, c in zip(low, mid, high, strict=True)):
                raise RuntimeError(f"set_shape('{input}'): need min <= opt <= max on every axis")
            self._shapes[input] = (low, mid, high)

        def get_shape(self, input: str) -> list[Any]:  # noqa: A002 - real name
            return [Dims(list(shape)) for shape in self._shapes.get(input, ())]

    class ITimingCache:
        __slots__ = ("_key", "_entries")
        _key: str
        _entries: set[str]
        __init__ = _no_constructor

        def serialize(self) -> Any:
            body = json.dumps({"key": self._key, "entries": sorted(self._entries)}).encode("utf-8")
            return _host_memory(CACHE_MAGIC + body)

        def combine(self, input_cache: Any, ignore_mismatch: bool) -> bool:
            if not isinstance(input_cache, ITimingCache):
                raise _incompatible("ITimingCache.combine", "input_cache", input_cache, "ITimingCache")
            if input_cache._key != self._key and not ignore_mismatch:
                return False
            self._entries |= input_cache._entries
            return True

        def reset(self) -> bool:
            self._entries = set()
            return True

    def _cache_key() -> str:
        return f"{version}|sm{state.compute_capability}"

    class IHostMemory(bytes):
        # Real IHostMemory exposes the buffer protocol; a bytes subclass is how Python 3.10/3.11
        # can do that without C code.
        __slots__ = ()

        def __new__(cls, *args: object, **kwargs: object) -> IHostMemory:
            raise TypeError("tensorrt.IHostMemory: No constructor defined!")

        @property
        def nbytes(self) -> int:
            return len(self)

        @property
        def dtype(self) -> Any:
            return DataType.UINT8

    def _host_memory(data: bytes) -> Any:
        return bytes.__new__(IHostMemory, data)

    class _BuilderConfigBase:
        __slots__ = (
            "_flags",
            "_pools",
            "_default_device_type",
            "_dla_core",
            "_optimization_level",
            "_profiles",
            "_timing_cache",
            "_logger",
            "_progress_monitor",
        )
        _flags: int
        _pools: dict[str, int]
        _default_device_type: Any
        _dla_core: int
        _optimization_level: int | None
        _profiles: list[dict[str, tuple[tuple[int, ...], ...]]]
        _timing_cache: Any
        _logger: Any
        __init__ = _no_constructor

        def _check_flag(self, function: str, flag: object) -> None:
            if not isinstance(flag, BuilderFlag):
                raise _incompatible(function, "flag", flag, "BuilderFlag")

        def set_flag(self, flag: Any) -> None:
            self._check_flag("IBuilderConfig.set_flag", flag)
            self._flags |= 1 << int(flag)

        def clear_flag(self, flag: Any) -> None:
            self._check_flag("IBuilderConfig.clear_flag", flag)
            self._flags &= ~(1 << int(flag))

        def get_flag(self, flag: Any) -> bool:
            self._check_flag("IBuilderConfig.get_flag", flag)
            return bool(self._flags & (1 << int(flag)))

        @property
        def flags(self) -> int:
            return self._flags

        @flags.setter
        def flags(self, value: int) -> None:
            self._flags = value

        def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
            if not isinstance(pool, MemoryPoolType):
                raise _incompatible("IBuilderConfig.set_memory_pool_limit", "pool", pool, "MemoryPoolType")
            if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 0:
                raise _incompatible(
                    "IBuilderConfig.set_memory_pool_limit", "pool_size", pool_size, "int >= 0"
                )
            self._pools[pool.name] = pool_size

        def get_memory_pool_limit(self, pool: Any) -> int:
            if not isinstance(pool, MemoryPoolType):
                raise _incompatible("IBuilderConfig.get_memory_pool_limit", "pool", pool, "MemoryPoolType")
            return int(self._pools.get(pool.name, 1 << 34))

        @property
        def default_device_type(self) -> Any:
            return self._default_device_type

        @default_device_type.setter
        def default_device_type(self, value: Any) -> None:
            if not isinstance(value, DeviceType):
                raise _incompatible("IBuilderConfig.default_device_type", "value", value, "DeviceType")
            self._default_device_type = value

        @property
        def DLA_core(self) -> int:  # noqa: N802 - TensorRT's spelling
            return self._dla_core

        @DLA_core.setter
        def DLA_core(self, value: int) -> None:  # noqa: N802
            if isinstance(value, bool) or not isinstance(value, int):
                raise _incompatible("IBuilderConfig.DLA_core", "value", value, "int")
            self._dla_core = value

        @property
        def num_optimization_profiles(self) -> int:
            return len(self._profiles)

        def add_optimization_profile(self, profile: Any) -> int:
            if not isinstance(profile, IOptimizationProfile):
                raise _incompatible(
                    "IBuilderConfig.add_optimization_profile", "profile", profile, "IOptimizationProfile"
                )
            if not profile._shapes:
                return -1
            self._profiles.append({name: tuple(shapes) for name, shapes in profile._shapes.items()})
            return len(self._profiles) - 1

        def create_timing_cache(self, serialized_timing_cache: Any) -> Any:
            if not isinstance(serialized_timing_cache, (bytes, bytearray, memoryview)):
                raise _incompatible(
                    "IBuilderConfig.create_timing_cache",
                    "serialized_timing_cache",
                    serialized_timing_cache,
                    "buffer",
                )
            blob = bytes(serialized_timing_cache)
            if not blob:
                return _make(ITimingCache, _key=_cache_key(), _entries=set())
            try:
                if not blob.startswith(CACHE_MAGIC):
                    raise ValueError("bad magic")
                body = json.loads(blob[len(CACHE_MAGIC) :].decode("utf-8"))
                return _make(ITimingCache, _key=str(body["key"]), _entries=set(body["entries"]))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                # createTimingCache returns nullptr on a blob it cannot read.
                _emit(self._logger, "ERROR", "Failed to deserialize the timing cache")
                return None

        def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
            if not isinstance(cache, ITimingCache):
                raise _incompatible("IBuilderConfig.set_timing_cache", "cache", cache, "ITimingCache")
            if not isinstance(ignore_mismatch, bool):
                raise _incompatible(
                    "IBuilderConfig.set_timing_cache", "ignore_mismatch", ignore_mismatch, "bool"
                )
            if cache._key != _cache_key() and not ignore_mismatch:
                _emit(
                    self._logger,
                    "ERROR",
                    "Timing cache was created on a different device or TensorRT version",
                )
                return False
            self._timing_cache = cache
            return True

        def get_timing_cache(self) -> Any:
            return self._timing_cache

    class _ProgressMonitorProperty:
        # IBuilderConfig.progress_monitor came with TensorRT 10.0.
        __slots__ = ()

        @property
        def progress_monitor(self: Any) -> Any:
            return self._progress_monitor

        @progress_monitor.setter
        def progress_monitor(self: Any, value: Any) -> None:
            if not isinstance(value, IProgressMonitor):
                raise _incompatible("IBuilderConfig.progress_monitor", "value", value,
                                    "IProgressMonitor")
            if not getattr(value, "_trt_initialised", False):
                raise TypeError(f"{type(value).__name__}.__init__() must call "
                                "tensorrt.IProgressMonitor.__init__()")
            self._progress_monitor = value

    class _OptimizationLevelProperty:
        # IBuilderConfig.builder_optimization_level came with TensorRT 8.6.
        __slots__ = ()

        @property
        def builder_optimization_level(self: Any) -> int:
            return 3 if self._optimization_level is None else self._optimization_level

        @builder_optimization_level.setter
        def builder_optimization_level(self: Any, value: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _incompatible("IBuilderConfig.builder_optimization_level", "value", value, "int")
            self._optimization_level = value

    # 8.5: neither; 8.6: an optimization level; 10.x and 11.x: both.
    config_features: list[type] = []
    if major >= 10:
        config_features.append(_ProgressMonitorProperty)
    if has_optimization_level:
        config_features.append(_OptimizationLevelProperty)

    class IBuilderConfig(*config_features, _BuilderConfigBase):  # type: ignore[misc]
        __slots__ = ()

    # -- builder -----------------------------------------------------------------------------------
    class Builder:
        __slots__ = ("_logger",)

        def __init__(self, logger: Any) -> None:
            _check_logger("Builder.__init__", logger)
            self._logger = logger

        @property
        def num_DLA_cores(self) -> int:  # noqa: N802 - TensorRT's spelling
            return state.num_dla_cores

        def create_network(self, flags: int = 0) -> Any:
            if isinstance(flags, bool) or not isinstance(flags, int):
                raise _incompatible("Builder.create_network", "flags", flags, "int")
            known_bits = 0
            for member in NetworkDefinitionCreationFlag.__members__.values():
                known_bits |= 1 << int(member)
            if flags & ~known_bits:
                raise ValueError(f"create_network: unknown flag bits {flags & ~known_bits:#x}")
            if explicit_batch_required:
                explicit = bool(flags & (1 << int(NetworkDefinitionCreationFlag.EXPLICIT_BATCH)))
            else:
                explicit = True  # implicit batch is gone in 10.x; the flag is accepted and ignored
            strongly_typed = strongly_typed_only or (
                hasattr(NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
                and bool(flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)))
            )
            return _make(
                INetworkDefinition,
                _flags=flags,
                _explicit_batch=explicit,
                _strongly_typed=strongly_typed,
                _inputs=[],
                _outputs=[],
                _layers=[],
                _layer_names=set(),
                _suffix=0,
                _parsed=False,
                _name="network",
                _model=None,
            )

        def create_builder_config(self) -> Any:
            return _make(
                IBuilderConfig,
                _flags=0,
                _pools={},
                _default_device_type=DeviceType.GPU,
                _dla_core=-1,
                _optimization_level=None,
                _profiles=[],
                _timing_cache=None,
                _logger=self._logger,
                _progress_monitor=None,
            )

        def create_optimization_profile(self) -> Any:
            return _make(IOptimizationProfile, _shapes={})

        def build_serialized_network(self, network: Any, config: Any) -> Any:
            if not isinstance(network, INetworkDefinition):
                raise _incompatible(
                    "Builder.build_serialized_network", "network", network, "INetworkDefinition"
                )
            if not isinstance(config, IBuilderConfig):
                raise _incompatible("Builder.build_serialized_network", "config", config, "IBuilderConfig")
            problem = _build_problem(network, config)
            if problem is None and state.fail_build_with is not None:
                problem = state.fail_build_with
            if problem is not None:
                _emit(self._logger, "ERROR", problem)
                return None
            if not _run_build_phases(config, len(network._layers)):
                _emit(self._logger, "ERROR", "Engine build was cancelled by the progress monitor")
                return None
            record = _record_build(network, config, self._logger)
            state.builds.append(record)
            return _host_memory(PLAN_MAGIC + json.dumps(record, sort_keys=True).encode("utf-8"))

    def _flag_set(config: Any, name: str) -> bool:
        return hasattr(BuilderFlag, name) and config.get_flag(getattr(BuilderFlag, name))

    def _build_problem(network: Any, config: Any) -> str | None:
        if not network._layers:
            return "Network must have at least one layer"
        if not network._outputs:
            return "Network must have at least one output"
        dynamic = [tensor for tensor in network._inputs if -1 in tensor._shape]
        if dynamic and not config._profiles:
            return "Network has dynamic or shape inputs, but no optimization profile has been defined."
        for profile_index, profile in enumerate(config._profiles):
            for tensor in network._inputs:
                shapes = profile.get(tensor._name)
                if shapes is None:
                    if -1 in tensor._shape:
                        return (
                            f"Optimization profile {profile_index} does not define input '{tensor._name}'"
                        )
                    continue
                for shape in shapes:
                    if len(shape) != len(tensor._shape):
                        return (
                            f"Optimization profile {profile_index}: input '{tensor._name}' has rank "
                            f"{len(tensor._shape)}, profile gives {len(shape)}"
                        )
                    for axis, (fixed, given) in enumerate(zip(tensor._shape, shape, strict=True)):
                        if fixed >= 0 and fixed != given:
                            return (
                                f"Optimization profile {profile_index}: input '{tensor._name}' axis "
                                f"{axis} is static ({fixed}) but the profile gives {given}"
                            )
            unknown = sorted(set(profile) - {tensor._name for tensor in network._inputs})
            if unknown:
                return f"Optimization profile {profile_index} names unknown inputs {unknown}"
        if not network._strongly_typed:
            has_qdq = any(layer._type.name in ("QUANTIZE", "DEQUANTIZE") for layer in network._layers)
            if has_qdq and not _flag_set(config, "INT8"):
                return "Network contains Q/DQ layers but the INT8 builder flag is not set"
        if config._default_device_type == DeviceType.DLA:
            if not 0 <= config._dla_core < state.num_dla_cores:
                return (
                    f"DLA core {config._dla_core} is not available (this device has {state.num_dla_cores})"
                )
            if _dla_shapes_dynamic(config) and not _flag_set(config, "GPU_FALLBACK"):
                return "DLA does not support dynamic shapes and GPU fallback is not enabled"
        return None

    def _dla_shapes_dynamic(config: Any) -> bool:
        # DLA runs static shapes only: a profile whose min and max differ keeps every layer off it.
        return any(shapes[0] != shapes[2] for profile in config._profiles for shapes in profile.values())

    def _effective_precision(network: Any, config: Any, layer: Any) -> str:
        """The precision a layer runs in; "UNCONSTRAINED" where TensorRT may pick HALF or FLOAT."""
        if layer._type.name in ("QUANTIZE", "DEQUANTIZE"):
            return str(layer._outputs[0].dtype.name)
        if network._strongly_typed:
            # Q/DQ-fed layers fuse into INT8 kernels; everything else runs in its graph type.
            if layer._quantized:
                return "INT8"
            return str(layer._outputs[0].dtype.name) if layer._outputs else "FLOAT"
        constrained = _flag_set(config, "OBEY_PRECISION_CONSTRAINTS") or _flag_set(
            config, "PREFER_PRECISION_CONSTRAINTS"
        )
        if layer._precision is not None and constrained:
            return str(layer._precision.name)
        if layer._quantized and _flag_set(config, "INT8"):
            return "INT8"
        # With FP16 enabled and no constraint, TensorRT picks per layer whatever is fastest.
        return "UNCONSTRAINED" if _flag_set(config, "FP16") else "FLOAT"

    def _record_build(network: Any, config: Any, logger: Any) -> dict[str, Any]:
        constrained = _flag_set(config, "OBEY_PRECISION_CONSTRAINTS") or _flag_set(
            config, "PREFER_PRECISION_CONSTRAINTS"
        )
        layers = []
        for layer in network._layers:
            if (
                constrained
                and layer._precision is not None
                and layer._name in state.no_kernel_in_constrained_precision
            ):
                _emit(
                    logger,
                    "WARNING",
                    f"No implementation of layer {layer._name} obeys the requested constraints in "
                    "strict mode. No conforming implementation was found i.e. requested layer "
                    "computation precision and output precision types are ignored, using the "
                    "fastest implementation.",
                )
                layer._precision = None
            if (
                not network._strongly_typed
                and (layer._precision is not None or layer._output_types)
                and not constrained
            ):
                _emit(
                    logger,
                    "WARNING",
                    f"Layer '{layer._name}': precision or output type set without "
                    "OBEY_PRECISION_CONSTRAINTS or PREFER_PRECISION_CONSTRAINTS; it is ignored",
                )
            layers.append(
                {
                    "name": layer._name,
                    "type": layer._type.name,
                    "precision": None if layer._precision is None else layer._precision.name,
                    "output_types": {
                        str(index): dtype.name for index, dtype in sorted(layer._output_types.items())
                    },
                    "effective": _effective_precision(network, config, layer),
                }
            )
        cache = config._timing_cache
        timing: dict[str, int] | None = None
        if cache is not None:
            keys = {f"{layer['name']}|{layer['type']}|{layer['effective']}" for layer in layers}
            timing = {"hits": len(keys & cache._entries), "entries_before": len(cache._entries)}
            cache._entries |= keys
        record: dict[str, Any] = {
            "trt_version": version,
            "network": {
                "flags": network._flags,
                "explicit_batch": network._explicit_batch,
                "strongly_typed": network._strongly_typed,
            },
            "builder_flags": sorted(name for name in BuilderFlag.__members__ if _flag_set(config, name)),
            "memory_pools": dict(config._pools),
            "device": {
                "default_device_type": config._default_device_type.name,
                "DLA_core": config._dla_core,
                # Where the layers landed: on DLA only with static shapes (else all on the GPU).
                "layers_on": (
                    "DLA"
                    if config._default_device_type == DeviceType.DLA and not _dla_shapes_dynamic(config)
                    else "GPU"
                ),
            },
            "profiles": [
                {
                    name: {"min": list(shapes[0]), "opt": list(shapes[1]), "max": list(shapes[2])}
                    for name, shapes in profile.items()
                }
                for profile in config._profiles
            ],
            "inputs": {tensor._name: list(tensor._shape) for tensor in network._inputs},
            "compute_capability": state.compute_capability,
            "io": [
                {
                    "name": tensor._name,
                    "mode": mode,
                    "dtype": tensor._dtype.name,
                    "shape": list(tensor._shape),
                }
                for mode, tensors in (("INPUT", network._inputs), ("OUTPUT", network._outputs))
                for tensor in tensors
            ],
            "onnx": base64.b64encode(network._model or b"").decode("ascii"),
            "layers": layers,
            "timing_cache": timing,
            "plugins_initialised": state.plugins_initialised,
        }
        if has_optimization_level:
            record["optimization_level"] = config._optimization_level
        _emit(logger, "INFO", f"Engine built with {len(layers)} layers")
        return record

    # -- runtime -----------------------------------------------------------------------------------
    TensorIOMode = _make_enum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})

    def _track(obj: Any) -> None:
        name = type(obj).__qualname__
        state.live[name] = state.live.get(name, 0) + 1
        object.__setattr__(obj, "_tracked", True)

    def _untrack(obj: Any) -> None:
        # Objects are counted while alive, so a test can see that nothing outlives a deactivate.
        if getattr(obj, "_tracked", False):
            object.__setattr__(obj, "_tracked", False)
            state.live[type(obj).__qualname__] -= 1

    class Runtime:
        __slots__ = ("_dla_core", "_logger", "_tracked")

        def __init__(self, logger: Any) -> None:
            _check_logger("Runtime.__init__", logger)
            self._logger = logger
            self._dla_core = 0
            _track(self)

        @property
        def DLA_core(self) -> int:  # noqa: N802 - TensorRT's spelling
            return self._dla_core

        @DLA_core.setter
        def DLA_core(self, value: int) -> None:  # noqa: N802
            if not isinstance(value, int) or isinstance(value, bool):
                raise _incompatible("Runtime.DLA_core", "value", value, "int")
            self._dla_core = value

        @property
        def num_DLA_cores(self) -> int:  # noqa: N802
            return state.num_dla_cores

        def __del__(self) -> None:
            _untrack(self)

        def deserialize_cuda_engine(self, serialized_engine: Any) -> Any:
            if not isinstance(serialized_engine, (bytes, bytearray, memoryview)):
                raise _incompatible(
                    "Runtime.deserialize_cuda_engine", "serialized_engine", serialized_engine, "buffer"
                )
            _plugin_log("deserializing the engine's plugins")
            try:
                record = decode_plan(bytes(serialized_engine))
                io = [
                    (entry["name"], entry["mode"], entry["dtype"], tuple(entry["shape"]))
                    for entry in record["io"]
                ]
                model = base64.b64decode(record["onnx"])
            except (ValueError, KeyError, TypeError):
                # deserializeCudaEngine returns nullptr on a plan it cannot read.
                _emit(
                    self._logger,
                    "ERROR",
                    "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                    "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)",
                )
                return None
            if record.get("trt_version") != version:
                _emit(
                    self._logger,
                    "ERROR",
                    "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error "
                    "(The engine plan file is not compatible with this version of TensorRT, expecting "
                    f"library version {version} got {record.get('trt_version')}, please rebuild.)",
                )
                return None
            if record.get("compute_capability") != state.compute_capability:
                _emit(
                    self._logger,
                    "ERROR",
                    "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error "
                    "(The engine plan file is generated on an incompatible device, expecting compute "
                    f"{state.compute_capability} got compute {record.get('compute_capability')}, "
                    "please rebuild.)",
                )
                return None
            profile: dict[str, tuple[tuple[int, ...], ...]] = {}
            for name, mode, _dtype, shape in io:
                if mode != "INPUT":
                    continue
                ranges = (record["profiles"] or [{}])[0].get(name)
                profile[name] = (
                    (shape, shape, shape)
                    if ranges is None
                    else (tuple(ranges["min"]), tuple(ranges["opt"]), tuple(ranges["max"]))
                )
            engine = _make(
                ICudaEngine,
                _io={name: (mode, getattr(DataType, dtype), shape) for name, mode, dtype, shape in io},
                _profile=profile,
                _model=model,
                _session=None,
                _shapes_cache={},
                _logger=self._logger,
            )
            _track(engine)
            return engine

    class ICudaEngine:
        __slots__ = ("_io", "_logger", "_model", "_profile", "_session", "_shapes_cache", "_tracked")
        _io: dict[str, tuple[str, Any, tuple[int, ...]]]
        _profile: dict[str, tuple[tuple[int, ...], ...]]
        _model: bytes
        _session: Any
        _shapes_cache: dict[tuple[Any, ...], dict[str, tuple[int, ...]]]
        _logger: Any
        __init__ = _no_constructor

        def __del__(self) -> None:
            _untrack(self)

        @property
        def name(self) -> str:
            return "network"

        @property
        def num_io_tensors(self) -> int:
            return len(self._io)

        @property
        def num_optimization_profiles(self) -> int:
            return 1

        def _entry(self, function: str, name: object) -> tuple[str, Any, tuple[int, ...]] | None:
            if not isinstance(name, str):
                raise _incompatible(function, "name", name, "str")
            entry = self._io.get(name)
            if entry is None:
                _emit(
                    self._logger,
                    "ERROR",
                    f"{function}: Error Code 3: API Usage Error (tensor '{name}' "
                    "is not an input or output of the network)",
                )
            return entry

        def get_tensor_name(self, index: int) -> Any:
            if isinstance(index, bool) or not isinstance(index, int):
                raise _incompatible("ICudaEngine.get_tensor_name", "index", index, "int")
            names = list(self._io)
            return names[index] if 0 <= index < len(names) else None

        def get_tensor_mode(self, name: str) -> Any:
            entry = self._entry("ICudaEngine.get_tensor_mode", name)
            return TensorIOMode.NONE if entry is None else getattr(TensorIOMode, entry[0])

        def get_tensor_dtype(self, name: str) -> Any:
            entry = self._entry("ICudaEngine.get_tensor_dtype", name)
            return DataType.FLOAT if entry is None else entry[1]

        def get_tensor_shape(self, name: str) -> Any:
            entry = self._entry("ICudaEngine.get_tensor_shape", name)
            return Dims([] if entry is None else list(entry[2]))

        def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Any]:
            if isinstance(profile_index, bool) or not isinstance(profile_index, int):
                raise _incompatible(
                    "ICudaEngine.get_tensor_profile_shape", "profile_index", profile_index, "int"
                )
            entry = self._entry("ICudaEngine.get_tensor_profile_shape", name)
            if entry is None or entry[0] != "INPUT" or profile_index != 0:
                raise RuntimeError(
                    f"get_tensor_profile_shape: '{name}' has no shapes in profile {profile_index}"
                )
            return [Dims(list(shape)) for shape in self._profile[name]]

        def create_execution_context(self, strategy: Any = None) -> Any:
            context = _make(IExecutionContext, _engine=self, _shapes={}, _addresses={})
            _track(context)
            return context

        def _output_shapes(self, input_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
            key = tuple(sorted(input_shapes.items()))
            if key not in self._shapes_cache:
                self._shapes_cache[key] = _output_shapes(self._model, input_shapes)
            return self._shapes_cache[key]

        def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if self._session is None:
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.log_severity_level = 3
                # TensorRT accumulates INT8 products exactly; so must the stand-in (on x86-64
                # without VNNI, ONNX Runtime's default INT8 kernels saturate: models/ort.py).
                options.add_session_config_entry("session.x64quantprecision", "1")
                self._session = onnxruntime.InferenceSession(
                    self._model, options, providers=["CPUExecutionProvider"]
                )
            names = [name for name, entry in self._io.items() if entry[0] == "OUTPUT"]
            return dict(zip(names, self._session.run(names, inputs), strict=True))

    class IExecutionContext:
        __slots__ = ("_addresses", "_engine", "_shapes", "_tracked")
        _engine: Any
        _shapes: dict[str, tuple[int, ...]]
        _addresses: dict[str, int]
        __init__ = _no_constructor

        def __del__(self) -> None:
            _untrack(self)

        @property
        def engine(self) -> Any:
            return self._engine

        @property
        def all_binding_shapes_specified(self) -> bool:
            return all(
                name in self._shapes for name, entry in self._engine._io.items() if entry[0] == "INPUT"
            )

        def _fail(self, message: str) -> bool:
            _emit(self._engine._logger, "ERROR", message)
            return False

        def set_input_shape(self, name: str, shape: Any) -> bool:
            dims = _as_shape(shape, "IExecutionContext.set_input_shape", "shape")
            entry = self._engine._entry("IExecutionContext.set_input_shape", name)
            if entry is None or entry[0] != "INPUT":
                return self._fail(f"IExecutionContext::setInputShape: '{name}' is not an input tensor")
            low, _, high = self._engine._profile[name]
            if len(dims) != len(entry[2]) or any(
                not lo <= dim <= hi for lo, dim, hi in zip(low, dims, high, strict=True)
            ):
                return self._fail(
                    "IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter check "
                    f"failed, condition: satisfyProfile. Set dimension {list(dims)} for tensor {name} does "
                    f"not satisfy any optimization profiles. Valid range: {list(low)} .. {list(high)})"
                )
            self._shapes[name] = dims
            return True

        def _output_shapes(self) -> dict[str, tuple[int, ...]] | None:
            if not self.all_binding_shapes_specified:
                return None
            return self._engine._output_shapes(dict(self._shapes))

        def get_tensor_shape(self, name: str) -> Any:
            entry = self._engine._entry("IExecutionContext.get_tensor_shape", name)
            if entry is None:
                return Dims([])
            if entry[0] == "INPUT":
                return Dims(list(self._shapes.get(name, entry[2])))
            outputs = self._output_shapes()
            return Dims(list(entry[2] if outputs is None else outputs[name]))

        def set_tensor_address(self, name: str, memory: int) -> bool:
            if isinstance(memory, bool) or not isinstance(memory, int):
                raise _incompatible("IExecutionContext.set_tensor_address", "memory", memory, "int")
            if self._engine._entry("IExecutionContext.set_tensor_address", name) is None:
                return False
            self._addresses[name] = memory
            return True

        def get_tensor_address(self, name: str) -> int:
            return self._addresses.get(name, 0)

        def execute_async_v3(self, stream_handle: int) -> bool:
            if isinstance(stream_handle, bool) or not isinstance(stream_handle, int):
                raise _incompatible(
                    "IExecutionContext.execute_async_v3", "stream_handle", stream_handle, "int"
                )
            if stream_handle == 0:
                _emit(
                    self._engine._logger,
                    "WARNING",
                    "Using default stream in enqueueV3() may lead to "
                    "performance issues due to additional calls to cudaStreamSynchronize() by TensorRT",
                )
            elif not state.gpu.stream_is_open(stream_handle):
                return self._fail("IExecutionContext::enqueueV3: CUDA error 400: invalid resource handle")
            output_shapes = self._output_shapes()
            if output_shapes is None:
                return self._fail(
                    "IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Not all input "
                    "shapes are specified)"
                )
            shapes = {**self._shapes, **output_shapes}
            for name, (mode, dtype, _) in self._engine._io.items():
                address = self._addresses.get(name)
                if address is None:
                    return self._fail(
                        f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Address "
                        f"is not set for {mode.lower()} tensor {name})"
                    )
                nbytes = (
                    int(np.prod(shapes[name], dtype=np.int64)) * np.dtype(_NUMPY_OF[dtype.name]).itemsize
                )
                if not state.gpu.covers(address, nbytes):
                    return self._fail(
                        f"IExecutionContext::enqueueV3: CUDA error 700: an illegal memory "
                        f"access was encountered (tensor {name} at {address:#x})"
                    )
            addresses = dict(self._addresses)
            # The kernels run later, when the stream gets to them: inputs are read then.
            state.gpu.enqueue(stream_handle, lambda: self._compute(shapes, addresses))
            state.executions += 1
            return True

        def _compute(self, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int]) -> None:
            inputs = {}
            for name, (mode, dtype, _) in self._engine._io.items():
                if mode == "INPUT":
                    count = int(np.prod(shapes[name], dtype=np.int64))
                    array = np.ctypeslib.as_array(
                        (ctypes.c_char * (count * np.dtype(_NUMPY_OF[dtype.name]).itemsize)).from_address(
                            addresses[name]
                        )
                    )
                    inputs[name] = array.view(_NUMPY_OF[dtype.name]).reshape(shapes[name]).copy()
            for name, value in self._engine._run(inputs).items():
                dtype = self._engine._io[name][1]
                result = np.ascontiguousarray(value, dtype=_NUMPY_OF[dtype.name])
                if result.shape != shapes[name]:
                    # A kernel cannot fail its launch after the fact; a test sees the shape.
                    raise RuntimeError(
                        f"fake engine: output {name} is {result.shape}, expected {shapes[name]}"
                    )
                ctypes.memmove(addresses[name], result.ctypes.data, result.nbytes)

    def init_libnvinfer_plugins(logger: Any, namespace: str) -> bool:
        _check_logger("init_libnvinfer_plugins", logger)
        if not isinstance(namespace, str):
            raise _incompatible("init_libnvinfer_plugins", "namespace", namespace, "str")
        state.plugins_initialised = True
        state.plugin_logger = weakref.ref(logger)
        _plugin_log("Registered plugin creators")
        return True

    def _plugin_log(message: str) -> None:
        if state.plugin_logger is None:
            return
        logger = state.plugin_logger()
        if logger is None:
            raise RuntimeError(
                "use after free: the logger given to init_libnvinfer_plugins has been destroyed, "
                "and TensorRT's plugin library still logs through it"
            )
        _emit(logger, "VERBOSE", f"Plugin library: {message}")

    public: dict[str, Any] = {
        "__version__": version,
        "DataType": DataType,
        "BuilderFlag": BuilderFlag,
        "NetworkDefinitionCreationFlag": NetworkDefinitionCreationFlag,
        "MemoryPoolType": MemoryPoolType,
        "DeviceType": DeviceType,
        "ErrorCode": ErrorCode,
        "LayerType": LayerType,
        "ILogger": ILogger,
        "Logger": Logger,
        "Dims": Dims,
        "ITensor": ITensor,
        "ILayer": ILayer,
        "INetworkDefinition": INetworkDefinition,
        "ParserError": ParserError,
        "OnnxParser": OnnxParser,
        "IOptimizationProfile": IOptimizationProfile,
        "ITimingCache": ITimingCache,
        "IHostMemory": IHostMemory,
        "IBuilderConfig": IBuilderConfig,
        "Builder": Builder,
        **({"IProgressMonitor": IProgressMonitor} if major >= 10 else {}),
        "TensorIOMode": TensorIOMode,
        "Runtime": Runtime,
        "ICudaEngine": ICudaEngine,
        "IExecutionContext": IExecutionContext,
        "init_libnvinfer_plugins": init_libnvinfer_plugins,
    }
    aliases = {
        "float32": "FLOAT",
        "float16": "HALF",
        "int8": "INT8",
        "int32": "INT32",
        "bool": "BOOL",
        "uint8": "UINT8",
        "fp8": "FP8",
        "bfloat16": "BF16",
        "int64": "INT64",
        "int4": "INT4",
    }
    for alias, member in aliases.items():
        if hasattr(DataType, member):
            public[alias] = getattr(DataType, member)
    for name, value in public.items():
        if isinstance(value, type):
            value.__module__ = "tensorrt"
            value.__qualname__ = name
        setattr(trt, name, value)
    trt._state = state  # type: ignore[attr-defined]
    trt._is_fake_tensorrt = True  # type: ignore[attr-defined]
    return trt
