"""The engine builder with a real TensorRT: run on a Jetson (``pytest -m tensorrt``).

Deselected by default and skipped where TensorRT is absent. It never runs against the fake: a
``tensorrt`` module that is the fake, or the empty namespace package that ``tensorrt-stubs``
leaves behind, is refused before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from models.engine import EngineBuildCancelled, EngineBuildConfig, build_engine

pytestmark = pytest.mark.tensorrt


def _real_tensorrt() -> ModuleType:
    trt = pytest.importorskip("tensorrt")
    if getattr(trt, "_is_fake_tensorrt", False):
        pytest.fail("the fake TensorRT is in sys.modules; a fake test leaked it")
    if not hasattr(trt, "Builder"):
        pytest.skip("'tensorrt' here is only the namespace package left by tensorrt-stubs, not TensorRT")
    return trt


def _model(tmp_path: Path, strongly_typed: bool) -> Path:
    pytest.importorskip("onnx")
    from tests.fakes.onnx_models import qdq_conv_model

    return qdq_conv_model(tmp_path / "model.onnx", conv1_in_fp16=strongly_typed)


def _config(tmp_path: Path, **overrides: object) -> EngineBuildConfig:
    values: dict[str, object] = dict(
        opt_batch=2,
        max_batch=4,
        min_height=16,
        opt_height=32,
        max_height=64,
        min_width=16,
        opt_width=32,
        max_width=64,
        workspace_bytes=256 << 20,
        fp16_layers=("conv1",),
        timing_cache_path=tmp_path / "timing.cache",
    )
    values.update(overrides)
    return EngineBuildConfig(**values)  # type: ignore[arg-type]


def test_real_engine_builds_and_deserializes(tmp_path: Path) -> None:
    trt = _real_tensorrt()
    strongly_typed = int(trt.__version__.split(".")[0]) >= 11
    model = _model(tmp_path, strongly_typed)

    result = build_engine(model, _config(tmp_path))
    assert result.fingerprint.trt_version == trt.__version__
    assert (tmp_path / "timing.cache").read_bytes() == result.timing_cache

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(result.plan)
    assert engine is not None
    names = {engine.get_tensor_name(index) for index in range(engine.num_io_tensors)}
    assert names == {"images", "features"}
    assert engine.get_tensor_mode("images") == trt.TensorIOMode.INPUT
    low, opt, high = engine.get_tensor_profile_shape("images", 0)
    assert [list(low), list(opt), list(high)] == [[1, 3, 16, 16], [2, 3, 32, 32], [4, 3, 64, 64]]

    # The second build loads the first's timing cache without a mismatch warning.
    again = build_engine(model, _config(tmp_path))
    assert not any("timing cache" in warning for warning in again.warnings)


def test_real_build_reports_progress_and_stops_on_request(tmp_path: Path) -> None:
    """TensorRT 10+: the progress monitor is called, and a stop request ends the build."""
    trt = _real_tensorrt()
    if not hasattr(trt, "IProgressMonitor"):
        pytest.skip(f"TensorRT {trt.__version__} has no progress monitor")
    model = _model(tmp_path, int(trt.__version__.split(".")[0]) >= 11)
    polls: list[int] = []

    def stop_at_the_first_step() -> bool:
        polls.append(1)
        return True

    with pytest.raises(EngineBuildCancelled):
        build_engine(model, _config(tmp_path, timing_cache_path=None),
                     stop_requested=stop_at_the_first_step)
    assert polls == [1]  # once told to stop, the monitor answers without asking again


def test_real_dla_build(tmp_path: Path) -> None:
    trt = _real_tensorrt()
    if trt.Builder(trt.Logger()).num_DLA_cores == 0:
        pytest.skip("this device has no DLA")
    model = _model(tmp_path, int(trt.__version__.split(".")[0]) >= 11)
    # DLA runs static shapes only (a range would put every layer on the GPU).
    static = dict(min_batch=2, max_batch=2, min_height=32, max_height=32, min_width=32, max_width=32)
    result = build_engine(model, _config(tmp_path, dla_core=0, gpu_fallback=True, **static))
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    runtime.DLA_core = 0
    engine = runtime.deserialize_cuda_engine(result.plan)
    assert engine is not None
    low, opt, high = engine.get_tensor_profile_shape("images", 0)
    assert list(low) == list(opt) == list(high) == [2, 3, 32, 32]


def test_real_backend_builds_caches_and_matches_onnx_runtime(tmp_path: Path) -> None:
    """On a board: the TensorRT backend builds the engine on first use, caches it, serves batches
    through pycuda buffers (mapped on a Jetson) and agrees with ONNX Runtime within INT8 error."""
    _real_tensorrt()
    pytest.importorskip("pycuda.driver")
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    from agent.backends.base import BackendOptions, ModelArtifacts
    from agent.backends.tensorrt import TensorRTBackend

    directory = tmp_path / "bundle"
    directory.mkdir()
    trt = _real_tensorrt()
    _model(directory, int(trt.__version__.split(".")[0]) >= 11)
    manifest = {
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, -1, -1], "layout": "NCHW"}],
        "outputs": [{"name": "features", "dtype": "float32", "shape": [-1, 4, -1, -1]}],
        "precision": {"int8_layers": ["conv0"], "fp16_layers": ["conv1"], "fp32_layers": []},
        "max_batch": 4, "opt_batch": 2, "engines": {},
        "engine_profile": {"batch": [1, 2, 4], "height": [16, 32, 64], "width": [16, 32, 64]},
    }
    artifacts = ModelArtifacts("tiny", 1, directory, manifest, tmp_path / "engines")
    images = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = session.run(["features"], {"images": images})[0]
    for _ in range(2):  # the second activation loads the cached plan
        backend = TensorRTBackend(artifacts, BackendOptions(max_batch_size=4))
        with backend:
            got = backend.infer({"images": images})["features"]
        np.testing.assert_allclose(got, expected, rtol=0.05, atol=0.05)
    assert list((tmp_path / "engines").glob("*.plan"))


def test_real_parser_errors_name_the_node(tmp_path: Path) -> None:
    """An operator TensorRT has no importer for: the error names the node (on 8.5 through the
    ONNX file, which needs the onnx package on the board)."""
    _real_tensorrt()
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from agent.errors import EngineError

    graph = helper.make_graph(
        [helper.make_node("Relu", ["images"], ["r"], name="relu0"),
         helper.make_node("NoSuchOp", ["r"], ["features"], name="mystery", domain="com.example")],
        "unsupported",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [-1, 3, 16, 16])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [-1, 3, 16, 16])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    path = tmp_path / "unsupported.onnx"
    onnx.save(model, str(path))
    with pytest.raises(EngineError) as caught:
        build_engine(path, EngineBuildConfig(opt_batch=1, max_batch=2, timing_cache_path=None))
    errors = caught.value.fields["errors"]
    assert any("mystery" in error for error in errors), errors
