"""The TensorRT backend against the strict fake TensorRT and a fake CUDA device on host memory.

The fake plan carries the ONNX model and the fake engine really computes: it reads its inputs from
the addresses the backend gives ``set_tensor_address``, runs the model with ONNX Runtime and writes
the outputs back, and it refuses addresses the fake GPU cannot reach. So a backend that bound the
wrong buffer, skipped or misordered a copy, or mixed up shapes gives wrong numbers or an error
here; results are compared with ONNX Runtime on the model file itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from agent.backends import backend_class  # noqa: E402
from agent.backends.base import BackendOptions, ModelArtifacts  # noqa: E402
from agent.backends.tensorrt import TensorRTBackend, engine_build_config  # noqa: E402
from agent.errors import (  # noqa: E402
    ConfigError,
    EngineError,
    InputError,
    InternalError,
    MissingDependencyError,
    StopRequested,
)
from models.fingerprint import DeviceFingerprint, GpuModel  # noqa: E402
from models.engine import build_engine  # noqa: E402
from tests.fakes.fake_tensorrt import decode_plan  # noqa: E402
from tests.fakes.trt_board import (  # noqa: E402
    VERSION,
    Board,
    live_objects,
    make_artifacts,
    make_board,
    reference,
)

@pytest.fixture
def board(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Board:
    return make_board(monkeypatch, tmp_path)


@pytest.fixture
def artifacts(tmp_path: Path) -> ModelArtifacts:
    return make_artifacts(tmp_path)


# --- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("integrated", [True, False], ids=["jetson-mapped", "discrete-pinned"])
@pytest.mark.parametrize("version", ["8.5.2.2", VERSION, "11.0.0.11"])
def test_results_equal_onnx_runtime_on_the_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 integrated: bool, version: str) -> None:
    board = make_board(monkeypatch, tmp_path, version=version, integrated=integrated)
    # TensorRT 11 is strongly typed: the FP16 fallback must already be FP16 in the graph.
    artifacts = make_artifacts(tmp_path, conv1_in_fp16=version.startswith("11."))
    rng = np.random.default_rng(7)
    with board.backend(artifacts, max_batch_size=8) as backend:
        assert backend.max_batch_size == 4  # the profile's maximum, below the option's 8
        for batch, height, width in [(1, 16, 16), (4, 32, 32), (3, 8, 24), (2, 16, 16)]:
            images = rng.normal(size=(batch, 3, height, width)).astype(np.float32)
            outputs = backend.infer({"images": images})
            np.testing.assert_allclose(outputs["features"], reference(artifacts, images), rtol=1e-6, atol=1e-6)
        device = board.devices[0]
    assert board.state.executions == 4
    if integrated:
        assert device.copies == []  # zero copy: the engine worked in the staged buffers themselves
    else:
        # Only the actual batch's bytes cross, not the whole maximum-size buffer.
        assert device.copies[:2] == [("to_device", 1 * 3 * 16 * 16 * 4), ("to_host", 1 * 4 * 16 * 16 * 4)]
        assert len(device.copies) == 8


@pytest.mark.parametrize("integrated", [True, False], ids=["jetson-mapped", "discrete-pinned"])
def test_a_dla_engine_runs_its_static_batch_with_smaller_batches_padded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, integrated: bool) -> None:
    board = make_board(monkeypatch, tmp_path, integrated=integrated)
    board.state.num_dla_cores = 2
    artifacts = make_artifacts(tmp_path)  # profile batch [1, 2, 4], frames 8..32, optimum 16
    rng = np.random.default_rng(3)
    with board.backend(artifacts, max_batch_size=8, extra={"dla_core": 1}) as backend:
        [build] = board.state.builds
        assert build["device"] == {"default_device_type": "DLA", "DLA_core": 1, "layers_on": "DLA"}
        assert backend._runtime is not None and backend._runtime.DLA_core == 1
        assert backend.max_batch_size == 2
        for batch in (1, 2, 1):
            images = rng.normal(size=(batch, 3, 16, 16)).astype(np.float32)
            outputs = backend.infer({"images": images})
            assert outputs["features"].shape == (batch, 4, 16, 16)
            np.testing.assert_allclose(outputs["features"], reference(artifacts, images),
                                       rtol=1e-6, atol=1e-6)
        with pytest.raises(InputError, match="outside the range the model is built for"):
            backend.stage(1, {"images": (3, 32, 32)})  # the engine is built for 16x16 only
    assert board.state.executions == 3


@pytest.mark.parametrize("integrated", [True, False], ids=["jetson-mapped", "discrete-pinned"])
def test_staged_buffers_are_reused_and_outputs_are_views_until_release(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, artifacts: ModelArtifacts, integrated: bool) -> None:
    board = make_board(monkeypatch, tmp_path, integrated=integrated)
    rng = np.random.default_rng(1)
    with board.backend(artifacts, buffer_sets=2) as backend:
        device = board.devices[0]
        allocations = device.allocations
        assert allocations == (2 if integrated else 4) * 2  # 2 sets x (images, features) x (host[, device])
        first = backend.stage(2, {"images": (3, 16, 16)})
        second = backend.stage(4, {"images": (3, 32, 32)})
        assert first.inputs["images"].shape == (2, 3, 16, 16)
        assert not np.shares_memory(first.inputs["images"], second.inputs["images"])
        addresses = {}
        for round_ in range(3):
            images = rng.normal(size=(2, 3, 16, 16)).astype(np.float32)
            first.inputs["images"][...] = images
            outputs = backend.run(first)
            np.testing.assert_allclose(outputs["features"], reference(artifacts, images), rtol=1e-6, atol=1e-6)
            addresses[round_] = (first.inputs["images"].ctypes.data, outputs["features"].ctypes.data)
            first.release()
            first = backend.stage(2, {"images": (3, 16, 16)})
        # The same set comes back and the same memory serves every round; nothing new is allocated.
        assert len(set(addresses.values())) == 1
        assert device.allocations == allocations
        first.release()
        second.release()
        with pytest.raises(InternalError):
            backend.run(second)  # released: its buffers may already hold another batch


def test_run_from_a_worker_thread(board: Board, artifacts: ModelArtifacts) -> None:
    images = np.random.default_rng(2).normal(size=(3, 3, 16, 16)).astype(np.float32)
    results: dict[str, Any] = {}
    with board.backend(artifacts) as backend:
        batch = backend.stage(3, {"images": (3, 16, 16)})
        batch.inputs["images"][...] = images

        def work() -> None:
            try:
                results["features"] = backend.run(batch)["features"].copy()
            except Exception as exc:  # noqa: BLE001 - handed to the main thread
                results["error"] = exc

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        batch.release()
    assert "error" not in results, results.get("error")
    np.testing.assert_allclose(results["features"], reference(artifacts, images), rtol=1e-6, atol=1e-6)


# --- which plan runs ---------------------------------------------------------------------------


def bundle_plan(board: Board, artifacts: ModelArtifacts, key: str, plan: bytes | None = None) -> ModelArtifacts:
    """The artifacts with a prebuilt plan for ``key`` (built by the fake builder unless given)."""
    if plan is None:
        plan = build_engine(artifacts.onnx_path, engine_build_config(artifacts, {}),
                            gpu=lambda: GpuModel("8.7", 16), root=board.root).plan
    member = f"engines/{key}.plan"
    (artifacts.directory / "engines").mkdir(exist_ok=True)
    (artifacts.directory / member).write_bytes(plan)
    engines = {**artifacts.manifest["engines"], key: member}
    return ModelArtifacts(name=artifacts.name, version=artifacts.version, directory=artifacts.directory,
                          manifest={**artifacts.manifest, "engines": engines},
                          engine_cache_dir=artifacts.engine_cache_dir)


def test_the_bundle_plan_for_this_fingerprint_is_used(board: Board, artifacts: ModelArtifacts) -> None:
    other = DeviceFingerprint(trt_version="8.5.2.2", compute_capability="7.2", l4t_release="35.4.1").key()
    artifacts = bundle_plan(board, artifacts, other, plan=b"not for this device")
    artifacts = bundle_plan(board, artifacts, board.key)
    board.state.builds.clear()
    with board.backend(artifacts) as backend:
        source = backend.engine_source
        assert source is not None and source.origin == "bundle"
        assert source.path == artifacts.directory / f"engines/{board.key}.plan"
        assert backend.describe()["fingerprint"] == board.key == "trt10.3.0.30-sm87-mp16-l4t36.4.3"
    assert board.state.builds == []  # nothing built on the device
    assert not artifacts.engine_cache_dir.exists() or not any(artifacts.engine_cache_dir.glob("*.plan"))


def test_a_bundle_with_plans_for_other_devices_only_builds_here(board: Board, artifacts: ModelArtifacts) -> None:
    other = DeviceFingerprint(trt_version="10.3.0.30", compute_capability="8.7", l4t_release="36.3.0",
                              multiprocessors=16).key()
    artifacts = bundle_plan(board, artifacts, other)
    # A plan from an Orin NX (8 multiprocessors) is not used on this AGX (16), nor one from a
    # fingerprint without the count (a bundle from before it was part of the key).
    nx = DeviceFingerprint(trt_version="10.3.0.30", compute_capability="8.7", l4t_release="36.4.3",
                           multiprocessors=8).key()
    artifacts = bundle_plan(board, artifacts, nx)
    unsized = DeviceFingerprint(trt_version="10.3.0.30", compute_capability="8.7",
                                l4t_release="36.4.3").key()
    artifacts = bundle_plan(board, artifacts, unsized)
    board.state.builds.clear()
    with board.backend(artifacts) as backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
    assert len(board.state.builds) == 1


def test_a_bundle_plan_tensorrt_refuses_is_skipped_with_a_warning(
        board: Board, artifacts: ModelArtifacts, caplog: pytest.LogCaptureFixture) -> None:
    artifacts = bundle_plan(board, artifacts, board.key, plan=b"FAKE-TRT-PLAN\n{truncated")
    board.state.builds.clear()
    with caplog.at_level(logging.WARNING), board.backend(artifacts) as backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
    assert any("refused the bundle's plan" in record.getMessage() and "Magic tag" in record.getMessage()
               for record in caplog.records)
    assert len(board.state.builds) == 1


def test_first_use_builds_caches_and_the_next_activate_reuses(board: Board, artifacts: ModelArtifacts) -> None:
    bundle_cache = b"FAKE-TRT-TIMING-CACHE\n" + json.dumps(
        {"key": f"{VERSION}|sm8.7", "entries": ["conv0|CONVOLUTION|INT8"]}).encode()
    (artifacts.directory / "timing.cache").write_bytes(bundle_cache)
    backend = TensorRTBackend(artifacts, BackendOptions(extra={"workspace_bytes": 64 << 20}),
                              open_device=board.open_device, root=board.root)
    with backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
    cache = artifacts.engine_cache_dir
    plan_path = cache / f"{board.key}.plan"
    assert plan_path.is_file() and (cache / f"{board.key}.timing.cache").is_file()
    record = json.loads((cache / f"{board.key}.plan.json").read_text())
    assert record["plan_sha256"] == hashlib.sha256(plan_path.read_bytes()).hexdigest()
    assert record["model_sha256"] == artifacts.manifest["artifacts"]["model.onnx"]["sha256"]
    assert not [path for path in cache.iterdir() if path.name.endswith(".tmp")]

    # What was built follows the manifest and the options.
    (build,) = board.state.builds
    assert build["profiles"] == [{"images": {"min": [1, 3, 8, 8], "opt": [2, 3, 16, 16], "max": [4, 3, 32, 32]}}]
    assert build["memory_pools"] == {"WORKSPACE": 64 << 20}
    conv1 = next(layer for layer in build["layers"] if layer["name"] == "conv1")
    assert conv1["precision"] == "HALF"
    assert build["timing_cache"]["hits"] == 1  # the bundle's timing cache seeded the build

    again = TensorRTBackend(artifacts, BackendOptions(extra={"workspace_bytes": 64 << 20}),
                            open_device=board.open_device, root=board.root)
    with again:
        assert again.engine_source is not None and again.engine_source.origin == "cache"
        assert again.engine_source.path == plan_path
    assert len(board.state.builds) == 1


def test_changed_build_settings_or_model_rebuild_the_cached_plan(board: Board, tmp_path: Path) -> None:
    artifacts = make_artifacts(tmp_path)
    with board.backend(artifacts):
        pass
    with board.backend(artifacts, extra={"optimization_level": 2}) as backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
    assert board.state.builds[-1]["optimization_level"] == 2
    changed = make_artifacts(tmp_path, artifacts={"model.onnx": {"sha256": "0" * 64, "size": 1}})
    with board.backend(changed, extra={"optimization_level": 2}) as backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
    assert len(board.state.builds) == 3


@pytest.mark.parametrize("damage", ["torn-file", "refused-by-tensorrt"])
def test_a_damaged_cached_plan_is_discarded_and_rebuilt(
        board: Board, artifacts: ModelArtifacts, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    with board.backend(artifacts):
        pass
    plan_path = artifacts.engine_cache_dir / f"{board.key}.plan"
    record_path = artifacts.engine_cache_dir / f"{board.key}.plan.json"
    if damage == "torn-file":
        plan_path.write_bytes(plan_path.read_bytes()[:100])
    else:
        # A plan TensorRT will not load although its record is intact (here: made for another GPU).
        plan = plan_path.read_bytes().replace(b'"compute_capability": "8.7"', b'"compute_capability": "8.6"')
        plan_path.write_bytes(plan)
        record = json.loads(record_path.read_text())
        record_path.write_text(json.dumps({**record, "plan_sha256": hashlib.sha256(plan).hexdigest()}))
    with caplog.at_level(logging.WARNING), board.backend(artifacts) as backend:
        assert backend.engine_source is not None and backend.engine_source.origin == "built"
        images = np.ones((1, 3, 8, 8), np.float32)
        np.testing.assert_allclose(backend.infer({"images": images})["features"], reference(artifacts, images),
                                   rtol=1e-6, atol=1e-6)
    expected = "does not match its recorded sha256" if damage == "torn-file" else "incompatible device"
    assert any(expected in record.getMessage() for record in caplog.records)
    assert len(board.state.builds) == 2
    assert decode_plan(plan_path.read_bytes())["compute_capability"] == "8.7"  # the good plan replaced it


def test_a_build_that_fails_is_an_engine_error_and_leaves_nothing(board: Board, artifacts: ModelArtifacts) -> None:
    board.state.fail_build_with = "Internal Error (Could not find any implementation for node conv0.)"
    backend = board.backend(artifacts)
    with pytest.raises(EngineError) as error:
        backend.activate()
    assert "Could not find any implementation" in str(error.value)
    assert not backend.active
    assert live_objects(board) == {}
    assert board.state.gpu.live_regions == 0 and board.state.gpu.open_streams == 0
    assert board.devices[0].closed
    assert not (artifacts.engine_cache_dir / f"{board.key}.plan").exists()


def test_a_stop_request_ends_the_engine_build_and_leaves_nothing(board: Board,
                                                                  artifacts: ModelArtifacts) -> None:
    stop = threading.Event()
    board.state.on_build_step = lambda step: stop.set() if step == 0 else None
    backend = TensorRTBackend(artifacts, BackendOptions(stop_requested=stop.is_set),
                              open_device=board.open_device, root=board.root)
    with pytest.raises(StopRequested) as error:
        backend.activate()
    assert "stopped on request" in str(error.value)
    assert board.state.builds == []
    assert not backend.active
    assert live_objects(board) == {}
    assert board.state.gpu.live_regions == 0 and board.state.gpu.open_streams == 0
    assert board.devices[0].closed
    assert not (artifacts.engine_cache_dir / f"{board.key}.plan").exists()
    # Started again without the request, it builds and caches the engine as usual.
    board.state.on_build_step = None
    with board.backend(artifacts) as again:
        assert again.active
    assert (artifacts.engine_cache_dir / f"{board.key}.plan").exists()


def test_a_daemon_asked_to_stop_while_building_gives_up_the_start(
        board: Board, artifacts: ModelArtifacts, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """SIGTERM during a first start's engine build (minutes on a board) ends the start within a
    build step instead of after the build: the daemon's stop request reaches TensorRT."""
    from agent import runtime
    from agent.daemon import Daemon
    from agent.config import load_config

    monkeypatch.setattr(TensorRTBackend, "__init__", _board_backend_init(board))
    config = load_config(None, env={}, overrides={"state_dir": tmp_path / "state",
                                                  "serving.backend": "tensorrt",
                                                  "serving.instances": 2})
    daemon = Daemon(config)
    try:
        board.state.on_build_step = lambda step: daemon.request_stop() if step == 0 else None
        policy = runtime.batch_policy(config, artifacts)
        with pytest.raises(StopRequested):
            runtime.start_backends(config, artifacts, policy,
                                   daemon._stop_requested.is_set)
        assert board.state.builds == [] and live_objects(board) == {}
        assert len(board.devices) == 1  # the second instance was never started
        # With the request already made, not even the first instance starts.
        with pytest.raises(StopRequested):
            runtime.start_backends(config, artifacts, policy, lambda: True)
        assert len(board.devices) == 1
    finally:
        daemon.close()


def _board_backend_init(board: Board) -> Any:
    original = TensorRTBackend.__init__

    def init(self: TensorRTBackend, artifacts: ModelArtifacts, options: BackendOptions,
             **_: Any) -> None:
        original(self, artifacts, options, open_device=board.open_device, root=board.root)

    return init


# --- shapes ------------------------------------------------------------------------------------


def test_shapes_outside_the_profile_are_input_errors(board: Board, artifacts: ModelArtifacts) -> None:
    with board.backend(artifacts) as backend:
        with pytest.raises(InputError) as error:
            backend.stage(1, {"images": (3, 40, 16)})
        assert error.value.fields["largest"] == [3, 32, 32]
        assert error.value.fields["found"] == [3, 40, 16]
        # The API checks requests against the same limits before they are queued.
        info = backend.inputs[0]
        assert info.limits is not None and info.limits[1] == (3, 32, 32)
        with pytest.raises(InputError):
            backend.stage(1, {"images": (3, 4, 16)})  # below the minimum height
        with pytest.raises(InputError):
            backend.stage(5, {"images": (3, 16, 16)})  # above the profile's maximum batch
        with pytest.raises(InputError):
            backend.stage(1, {"images": (4, 16, 16)})  # the model has 3 channels
        with pytest.raises(InputError):
            backend.infer({"images": np.zeros((2, 3, 64, 64), np.float32)})
        # A refused request takes no buffer set: both are still free.
        batches = [backend.stage(1, {"images": (3, 8, 8)}) for _ in range(2)]
        for batch in batches:
            batch.release()


def test_engine_io_is_described_and_buffers_sized_for_the_largest_batch(
        board: Board, artifacts: ModelArtifacts) -> None:
    with board.backend(artifacts, max_batch_size=3) as backend:
        assert [info.to_json() for info in backend.inputs] == [
            {"name": "images", "datatype": "FP32", "shape": [-1, 3, -1, -1]}]
        assert [info.to_json() for info in backend.outputs] == [
            {"name": "features", "datatype": "FP32", "shape": [-1, 4, -1, -1]}]
        assert backend.max_batch_size == 3
        pool = backend._pool
        assert pool is not None
        assert {spec.name: spec.max_shape for spec in pool.specs} == {"images": (3, 3, 32, 32),
                                                                        "features": (3, 4, 32, 32)}
        assert backend.describe()["host_memory"] == "mapped"


# --- lifecycle ---------------------------------------------------------------------------------


def test_deactivate_frees_everything_and_is_safe_twice(board: Board, artifacts: ModelArtifacts) -> None:
    backend = board.backend(artifacts)
    backend.activate()
    backend.infer({"images": np.zeros((2, 3, 8, 8), np.float32)})
    assert live_objects(board) == {"Runtime": 1, "ICudaEngine": 1, "IExecutionContext": 1}
    backend.deactivate()
    assert live_objects(board) == {}
    assert board.state.gpu.live_regions == 0
    assert board.state.gpu.open_streams == 0
    device = board.devices[0]
    assert device.allocations == 0 and device.closed
    backend.deactivate()
    with pytest.raises(InternalError):
        backend.infer({"images": np.zeros((1, 3, 8, 8), np.float32)})


def test_hot_swap_leaves_the_new_instance_alone(board: Board, artifacts: ModelArtifacts) -> None:
    old = board.backend(artifacts)
    old.activate()
    new = board.backend(artifacts)
    new.activate()
    staged = old.stage(1, {"images": (3, 8, 8)})
    old.deactivate()
    staged.release()  # a batch staged before the swap goes back to the old, closed pool harmlessly
    images = np.random.default_rng(3).normal(size=(2, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(new.infer({"images": images})["features"], reference(artifacts, images),
                               rtol=1e-6, atol=1e-6)
    assert live_objects(board) == {"Runtime": 1, "ICudaEngine": 1, "IExecutionContext": 1}
    new.deactivate()
    assert live_objects(board) == {} and board.state.gpu.live_regions == 0


# --- options and dependencies ------------------------------------------------------------------


def test_host_memory_option(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, artifacts: ModelArtifacts) -> None:
    board = make_board(monkeypatch, tmp_path, integrated=True)
    with board.backend(artifacts, extra={"host_memory": "pinned"}) as backend:
        backend.infer({"images": np.zeros((1, 3, 8, 8), np.float32)})
        assert backend.describe()["host_memory"] == "pinned"
    assert [kind for kind, _ in board.devices[0].copies] == ["to_device", "to_host"]
    board.can_map_host_memory = False
    with pytest.raises(EngineError, match="cannot map host memory"):
        board.backend(artifacts, extra={"host_memory": "mapped"}).activate()
    with pytest.raises(EngineError, match="unknown host memory mode"):
        board.backend(artifacts, extra={"host_memory": "zero-copy"}).activate()
    assert live_objects(board) == {} and all(device.closed for device in board.devices)


def test_engine_build_config_reads_the_manifest_and_options(tmp_path: Path) -> None:
    artifacts = make_artifacts(
        tmp_path,
        engine_profile={"batch": [1, 4, 8], "height": [64, 224, 448], "width": [64, 224, 448]},
        inputs=[{"name": "images", "dtype": "float32", "shape": [-1, -1, -1, 3], "layout": "NHWC"}],
    )
    config = engine_build_config(artifacts, {"workspace_bytes": 1 << 28, "providers": ["x"]})
    assert (config.min_batch, config.opt_batch, config.max_batch) == (1, 4, 8)
    assert (config.min_height, config.opt_height, config.max_height) == (64, 224, 448)
    assert config.layout == "NHWC"
    assert config.fp16_layers == ("conv1",)
    assert (config.workspace_bytes, config.dla_core) == (1 << 28, None)
    # DLA runs static shapes: the profile collapses to its optimum.
    config = engine_build_config(artifacts, {"dla_core": 0})
    assert config.dla_core == 0
    assert config.profile_spans() == {"batch": (4, 4, 4), "height": (224, 224, 224),
                                      "width": (224, 224, 224)}

    without_profile = make_artifacts(tmp_path, engine_profile=None, max_batch=16, opt_batch=8)
    config = engine_build_config(without_profile, {})
    assert (config.min_batch, config.opt_batch, config.max_batch) == (1, 8, 16)
    assert config.min_height is None

    with pytest.raises(EngineError, match="engine_profile.height"):
        engine_build_config(make_artifacts(tmp_path, engine_profile={"batch": [1, 2, 4], "height": [8, 16]}), {})
    with pytest.raises(ConfigError) as error:
        engine_build_config(artifacts, {"optimization_level": 9})
    assert error.value.fields["key"] == "optimization_level"


def test_missing_tensorrt_is_a_missing_dependency_error(monkeypatch: pytest.MonkeyPatch,
                                                        artifacts: ModelArtifacts) -> None:
    opened: list[int] = []

    def open_device(device_id: int) -> Any:
        opened.append(device_id)
        raise AssertionError("the device must not be opened without TensorRT")

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    backend = TensorRTBackend(artifacts, BackendOptions(), open_device=open_device)
    with pytest.raises(MissingDependencyError) as error:
        backend.activate()
    assert error.value.module == "tensorrt" and "see README" in str(error.value)

    # What pip's tensorrt-stubs leaves behind: an importable, empty namespace package.
    namespace = types.ModuleType("tensorrt")
    namespace.__path__ = []
    monkeypatch.setitem(sys.modules, "tensorrt", namespace)
    with pytest.raises(MissingDependencyError, match="namespace package"):
        backend.activate()
    assert opened == [] and not backend.active


def test_missing_pycuda_is_a_missing_dependency_error(board: Board, monkeypatch: pytest.MonkeyPatch,
                                                      artifacts: ModelArtifacts) -> None:
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    backend = backend_class("tensorrt")(artifacts, BackendOptions())
    with pytest.raises(MissingDependencyError) as error:
        backend.activate()
    assert error.value.module == "pycuda.driver"
    assert live_objects(board) == {}


def test_fake_cuda_refuses_work_outside_a_context(board: Board) -> None:
    """The fake CUDA device is strict, so the backend tests above prove the context handling."""
    device = board.open_device(0)
    with pytest.raises(RuntimeError, match="without a current context"):
        device.alloc_host(64, mapped=True)
    with device.scope():
        memory = device.alloc_device(64)
        stream = device.create_stream()
    with pytest.raises(RuntimeError, match="without a current context"):
        device.copy_to_device_async(memory.ptr, np.zeros(16, np.float32), stream)
    with device.scope():
        with pytest.raises(RuntimeError, match="outside device memory"):
            device.copy_to_device_async(memory.ptr + 8, np.zeros(16, np.float32), stream)
        stream.close()
    memory.free()
    memory.free()
    assert device.allocations == 0 and board.state.gpu.live_regions == 0
