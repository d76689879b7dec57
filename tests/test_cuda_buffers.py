"""CUDA buffers (agent/backends/cuda_buffers.py).

The ``gpu`` tests run for real on a CUDA machine with pycuda (``pytest -m gpu``; see shared/gpu):
fresh random data, staged into the buffers from request bodies in pieces as the batcher does it,
goes through a trivial kernel in both buffer modes, mapped (zero copy) and pinned + async copies,
for several batch sizes, on reused buffers; the context is driven from other threads; and a timing
table compares mapped, pinned + async and pageable copies for an
8x3x224x224 float32 round trip (printed, never asserted: timing thresholds do not belong in tests).
The tests without the mark check the pool's bookkeeping on the host-memory fake.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.backends.base import BackendOptions, ModelArtifacts
from agent.backends.cuda_buffers import (
    BufferPool,
    DeviceMemory,
    HostMemory,
    PycudaDevice,
    TensorSpec,
    choose_host_memory,
)
from agent.errors import EngineError, InternalError
from agent.scattered import Body, copy_rows
from models.fingerprint import GpuModel

MODES = {"mapped": True, "pinned": False}

KERNEL = r"""
extern "C" __global__ void affine(const float *x, float *y, float scale, float shift,
                                  unsigned long long count)
{
    unsigned long long i = blockIdx.x * (unsigned long long) blockDim.x + threadIdx.x;
    if (i < count)
        y[i] = scale * x[i] + shift;
}
"""
THREADS = 256


# --- on the host-memory fake (no CUDA) -----------------------------------------------------------


@pytest.fixture
def fake_device() -> Any:
    pytest.importorskip("onnx")  # tests/fakes/fake_tensorrt.py parses ONNX
    from tests.fakes.fake_tensorrt import FakeCudaDevice, FakeGpu

    return FakeCudaDevice(FakeGpu(), integrated=False)


def specs(max_batch: int = 4) -> list[TensorSpec]:
    return [TensorSpec("x", np.float32, (max_batch, 3, 8, 8), is_input=True),
            TensorSpec("y", np.float16, (max_batch, 10), is_input=False)]


def test_pool_sizes_sets_for_the_largest_batch_and_copies_only_the_batch(fake_device: Any) -> None:
    with fake_device.scope():
        pool = BufferPool.allocate(fake_device, specs(), sets=2, mapped=False)
        stream = fake_device.create_stream()
        assert pool.set_nbytes == 4 * 3 * 8 * 8 * 4 + 4 * 10 * 2
        assert fake_device.allocations == 2 * 2 * 2  # sets x tensors x (pinned host + device)
        slot = pool.acquire()
        view = pool.host_view(slot, "x", (2, 3, 8, 8))
        view[...] = 1.5
        pool.to_device(slot, {"x": (2, 3, 8, 8)}, stream)
        pool.to_host(slot, {"y": (2, 10)}, stream)
        assert fake_device.copies == [("to_device", 2 * 3 * 8 * 8 * 4), ("to_host", 2 * 10 * 2)]
        assert pool.host_view(slot, "x", (2, 3, 8, 8)).ctypes.data == view.ctypes.data  # same memory
        with pytest.raises(EngineError, match="does not fit"):
            pool.host_view(slot, "y", (5, 10))
        stream.close()
    pool.close()
    pool.close()
    assert fake_device.allocations == 0 and fake_device.gpu.live_regions == 0
    with pytest.raises(InternalError):
        pool.device_pointer(slot, "x")


def test_a_failed_allocation_frees_what_was_allocated(fake_device: Any) -> None:
    calls = {"device": 0}
    allocate_device = fake_device.alloc_device

    def failing_alloc_device(nbytes: int) -> DeviceMemory:
        calls["device"] += 1
        if calls["device"] == 3:
            raise EngineError("CUDA call failed", call="cuMemAlloc", reason="out of memory")
        memory: DeviceMemory = allocate_device(nbytes)
        return memory

    fake_device.alloc_device = failing_alloc_device
    with fake_device.scope(), pytest.raises(EngineError, match="CUDA call failed"):
        BufferPool.allocate(fake_device, specs(), sets=2, mapped=False)
    assert fake_device.allocations == 0 and fake_device.gpu.live_regions == 0


def test_host_memory_choice(fake_device: Any) -> None:
    assert choose_host_memory(fake_device) is False  # discrete: pinned + copies
    fake_device.integrated = True
    assert choose_host_memory(fake_device) is True  # a Jetson: zero copy
    assert choose_host_memory(fake_device, "pinned") is False
    fake_device.can_map_host_memory = False
    assert choose_host_memory(fake_device) is False
    with pytest.raises(EngineError):
        choose_host_memory(fake_device, "mapped")


# --- on a real GPU ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu() -> Iterator[PycudaDevice]:
    pytest.importorskip("pycuda.driver")
    try:
        device = PycudaDevice.open(0)
    except EngineError as exc:
        pytest.skip(f"no usable CUDA device: {exc}")
    yield device
    device.close()


@pytest.fixture(scope="module")
def affine(gpu: PycudaDevice) -> Callable[..., None]:
    """``affine(x_ptr, y_ptr, count, stream, scale=2, shift=1)``: y = scale * x + shift on the GPU."""
    from pycuda.compiler import SourceModule

    with gpu.scope():
        function = SourceModule(KERNEL, no_extern_c=True).get_function("affine")

    def launch(x_ptr: int, y_ptr: int, count: int, stream: Any, scale: float = 2.0, shift: float = 1.0) -> None:
        blocks = (count + THREADS - 1) // THREADS
        function(np.uintp(x_ptr), np.uintp(y_ptr), np.float32(scale), np.float32(shift), np.uint64(count),
                 block=(THREADS, 1, 1), grid=(blocks, 1), stream=stream.raw)

    return launch  # the function keeps its module loaded


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_random_batches_round_trip_through_a_kernel(gpu: PycudaDevice, affine: Callable[..., None],
                                                    mode: str) -> None:
    if MODES[mode] and not gpu.can_map_host_memory:
        pytest.skip("this GPU cannot map host memory")
    rng = np.random.default_rng()
    shape = (3, 32, 32)
    with gpu.scope():
        pool = BufferPool.allocate(gpu, [TensorSpec("x", np.float32, (8, *shape), is_input=True),
                                         TensorSpec("y", np.float32, (8, *shape), is_input=False)],
                                   sets=2, mapped=MODES[mode])
        stream = gpu.create_stream()
    seen: dict[int, set[tuple[int, int, int, int]]] = {0: set(), 1: set()}
    try:
        for round_, batch in enumerate([1, 3, 8, 5, 8, 2]):
            slot = pool.acquire()
            x = pool.host_view(slot, "x", (batch, *shape))
            frames = rng.standard_normal(x.shape, dtype=np.float32)
            # Staged as the batcher stages requests: each frame's bytes arrive in pieces cut at
            # random places (as the HTTP server receives them) and go straight into their row.
            for row, frame in enumerate(frames):
                raw = frame.tobytes()
                cuts = sorted(int(c) for c in rng.integers(1, len(raw), size=round_ % 3))
                body = Body([raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])])
                copy_rows(x[row:row + 1], body.array(0, np.float32, (1, *shape)))
            expected = 2.0 * frames + 1.0
            with gpu.scope():
                pool.to_device(slot, {"x": x.shape}, stream)
                affine(pool.device_pointer(slot, "x"), pool.device_pointer(slot, "y"), x.size, stream)
                pool.to_host(slot, {"y": x.shape}, stream)
                stream.synchronize()
            y = pool.host_view(slot, "y", x.shape)
            np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6, err_msg=f"{mode} round {round_}")
            seen[slot].add((x.ctypes.data, y.ctypes.data, pool.device_pointer(slot, "x"),
                            pool.device_pointer(slot, "y")))
            pool.release(slot)
    finally:
        with gpu.scope():
            stream.close()
        pool.close()
    # Every call reused its set's buffers: one address set per slot, whatever the batch size.
    assert [len(addresses) for addresses in seen.values()] == [1, 1]


@pytest.mark.gpu
def test_the_device_is_driven_from_other_threads(gpu: PycudaDevice) -> None:
    before = _driver_current_context()
    device = PycudaDevice.open(0)  # a second retain: ``gpu`` keeps the primary context alive
    results: dict[str, Any] = {}
    with device.scope():
        pool = BufferPool.allocate(device, [TensorSpec("x", np.float32, (1024,), is_input=True),
                                            TensorSpec("y", np.float32, (1024,), is_input=False)],
                                   sets=1, mapped=False)
        stream = device.create_stream()

    def compute() -> None:
        try:
            from pycuda.compiler import SourceModule

            with device.scope():
                function = SourceModule(KERNEL, no_extern_c=True).get_function("affine")
                x = pool.host_view(0, "x", (1024,))
                x[...] = np.arange(1024, dtype=np.float32)
                pool.to_device(0, {"x": (1024,)}, stream)
                function(np.uintp(pool.device_pointer(0, "x")), np.uintp(pool.device_pointer(0, "y")),
                         np.float32(3.0), np.float32(-1.0), np.uint64(1024), block=(THREADS, 1, 1),
                         grid=(4, 1), stream=stream.raw)
                pool.to_host(0, {"y": (1024,)}, stream)
                stream.synchronize()
                del function  # unloads its module while the context is current on this thread
            results["y"] = pool.host_view(0, "y", (1024,)).copy()
        except Exception as exc:  # noqa: BLE001 - handed to the main thread
            results["error"] = exc

    def free() -> None:
        try:
            with device.scope():
                stream.close()
            pool.close()
        except Exception as exc:  # noqa: BLE001
            results["free_error"] = exc

    for target in (compute, free):
        worker = threading.Thread(target=target)
        worker.start()
        worker.join()
    assert "error" not in results and "free_error" not in results, results
    np.testing.assert_array_equal(results["y"], 3.0 * np.arange(1024, dtype=np.float32) - 1.0)
    device.close()
    device.close()
    assert _driver_current_context() == before  # close() left this thread's context stack as found


def _driver_current_context() -> int:
    libcuda = ctypes.CDLL("libcuda.so.1")
    current = ctypes.c_void_p()
    assert libcuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
    return current.value or 0


@pytest.mark.gpu
def test_auto_mode_follows_the_device(gpu: PycudaDevice) -> None:
    assert choose_host_memory(gpu) is (gpu.integrated and gpu.can_map_host_memory)
    # pycuda and the driver query the fingerprint uses off the device (ctypes) agree on the model.
    from models.fingerprint import cuda_gpu_model

    assert cuda_gpu_model() == GpuModel(gpu.compute_capability, gpu.multiprocessors)
    print(f"\n{gpu.name}: compute {gpu.compute_capability}, {gpu.multiprocessors} multiprocessors, "
          f"integrated={int(gpu.integrated)}, can_map_host_memory={int(gpu.can_map_host_memory)}")


@pytest.mark.gpu
def test_tensorrt_backend_on_pycuda_mapped_buffers(gpu: PycudaDevice, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend end to end on the real GPU's context, stream and mapped buffers; the engine is
    the fake (no TensorRT here), which reads the mapped buffers from the host side (UVA)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from agent.backends.tensorrt import TensorRTBackend
    from tests.fakes.fake_tensorrt import make_fake_tensorrt, state_of
    from tests.fakes.trt_board import make_artifacts, reference

    trt = make_fake_tensorrt("10.3.0.30")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    fake_gpu = state_of(trt).gpu
    state_of(trt).compute_capability = gpu.compute_capability

    class SharedDevice(PycudaDevice):
        """pycuda, with mapped memory and streams announced to the fake engine."""

        def alloc_host(self, nbytes: int, *, mapped: bool) -> HostMemory:
            memory = super().alloc_host(nbytes, mapped=mapped)
            if not mapped:
                return memory
            if memory.device_ptr != memory.array.ctypes.data:
                pytest.skip("mapped memory has another address on the device (no UVA)")
            fake_gpu.map(memory.array.ctypes.data, nbytes)

            def free() -> None:
                fake_gpu.unmap(memory.array.ctypes.data)
                memory.free()

            return HostMemory(array=memory.array, device_ptr=memory.device_ptr, free=free)

        def create_stream(self) -> Any:
            stream = super().create_stream()
            fake_gpu.adopt_stream(stream.handle)
            return stream

    artifacts: ModelArtifacts = make_artifacts(tmp_path)
    backend = TensorRTBackend(artifacts, BackendOptions(extra={"host_memory": "mapped"}),
                              open_device=lambda index: SharedDevice.open(index), root=tmp_path)
    rng = np.random.default_rng()
    with backend:
        for batch in (1, 4, 2):
            images = rng.standard_normal((batch, 3, 16, 24), dtype=np.float32)
            outputs = backend.infer({"images": images})
            np.testing.assert_allclose(outputs["features"], reference(artifacts, images), rtol=1e-6, atol=1e-6)
    assert fake_gpu.live_regions == 0


@pytest.mark.gpu
def test_timing_table(gpu: PycudaDevice, affine: Callable[..., None]) -> None:
    """Mapped vs pinned + async vs pageable, for an 8x3x224x224 float32 round trip through the
    kernel (copy in, y = 2x + 1, copy out). Printed; correctness is asserted, speed is not."""
    import pycuda.driver as cuda

    shape = (8, 3, 224, 224)
    count = int(np.prod(shape))
    warmup, rounds = 5, 50
    rng = np.random.default_rng()
    rows = []
    with gpu.scope():
        stream = gpu.create_stream()
        pools = {mode: BufferPool.allocate(gpu, [TensorSpec("x", np.float32, shape, is_input=True),
                                                 TensorSpec("y", np.float32, shape, is_input=False)],
                                           sets=1, mapped=mapped)
                 for mode, mapped in MODES.items() if mapped is False or gpu.can_map_host_memory}
        pageable_x = np.empty(shape, np.float32)
        pageable_y = np.empty(shape, np.float32)
        device_x, device_y = gpu.alloc_device(pageable_x.nbytes), gpu.alloc_device(pageable_y.nbytes)

        def pooled(pool: BufferPool) -> tuple[Callable[[], None], np.ndarray, np.ndarray]:
            x, y = pool.host_view(0, "x", shape), pool.host_view(0, "y", shape)

            def round_trip() -> None:
                pool.to_device(0, {"x": shape}, stream)
                affine(pool.device_pointer(0, "x"), pool.device_pointer(0, "y"), count, stream)
                pool.to_host(0, {"y": shape}, stream)
                stream.synchronize()

            return round_trip, x, y

        def pageable_round_trip() -> None:
            cuda.memcpy_htod(device_x.ptr, pageable_x)
            affine(device_x.ptr, device_y.ptr, count, stream)
            stream.synchronize()
            cuda.memcpy_dtoh(pageable_y, device_y.ptr)

        cases = {"mapped (zero copy)": pooled(pools["mapped"]) if "mapped" in pools else None,
                 "pinned + async copies": pooled(pools["pinned"]),
                 "pageable copies": (pageable_round_trip, pageable_x, pageable_y)}
        try:
            for label, case in cases.items():
                if case is None:
                    continue
                round_trip, x, y = case
                x[...] = rng.standard_normal(shape, dtype=np.float32)
                for _ in range(warmup):
                    round_trip()
                times_us = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    round_trip()
                    times_us.append((time.perf_counter() - started) * 1e6)
                np.testing.assert_allclose(y, 2.0 * x + 1.0, rtol=1e-6, atol=1e-6, err_msg=label)
                rows.append((label, statistics.median(times_us), min(times_us)))
        finally:
            for pool in pools.values():
                pool.close()
            device_x.free()
            device_y.free()
            stream.close()
    megabytes = 2 * count * 4 / 1e6
    title = (f"{gpu.name} (compute {gpu.compute_capability}, integrated={int(gpu.integrated)}): "
             f"{'x'.join(map(str, shape))} float32 round trip, {megabytes:.1f} MB moved, "
             f"{rounds} rounds after {warmup} warm-up")
    lines = [title, f"{'mode':<24}{'median us':>12}{'best us':>12}{'vs pinned':>12}"]
    pinned = next(median for label, median, _ in rows if label.startswith("pinned"))
    lines += [f"{label:<24}{median:>12.0f}{best:>12.0f}{median / pinned:>11.2f}x" for label, median, best in rows]
    print("\n" + "\n".join(lines))
