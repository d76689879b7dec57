"""The TensorRT engine builder, run against the strict fake TensorRT of each supported version.

A real QDQ ONNX model (tests/fakes/onnx_models.py) goes through the fake's ONNX parser, so layer
names, tensor types and parser errors come from a real graph; the fake's plan records what the
builder configured, which is what these tests assert on.
"""

from __future__ import annotations

import ctypes.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnx")

from agent.errors import ConfigError, EngineError, MissingDependencyError  # noqa: E402
from models.fingerprint import (  # noqa: E402
    DeviceFingerprint,
    GpuModel,
    cuda_gpu_model,
    read_l4t_release,
)
from models.engine import (  # noqa: E402
    EngineBuildCancelled,
    EngineBuildConfig,
    EngineBuildResult,
    ShapeRange,
    build_engine,
    profile_shapes,
)
from tests.fakes.fake_tensorrt import decode_plan, make_fake_tensorrt, state_of  # noqa: E402
from tests.fakes.onnx_models import qdq_conv_model  # noqa: E402

VERSIONS = ("8.5.2.2", "8.6.1.6", "10.3.0.30", "11.0.0.11")
WEAKLY_TYPED = ("8.5.2.2", "10.3.0.30")
TEGRA_RELEASE_R36 = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n"
)


def orin() -> GpuModel:
    return GpuModel("8.7", multiprocessors=16)  # an AGX Orin 64GB


@pytest.fixture
def install_fake(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], types.ModuleType]:
    def install(version: str) -> types.ModuleType:
        fake = make_fake_tensorrt(version)
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        return fake

    return install


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return qdq_conv_model(tmp_path / "model.onnx")


def config(**overrides: Any) -> EngineBuildConfig:
    values: dict[str, Any] = dict(
        opt_batch=4,
        max_batch=8,
        min_height=32,
        opt_height=224,
        max_height=512,
        min_width=32,
        opt_width=224,
        max_width=512,
    )
    values.update(overrides)
    return EngineBuildConfig(**values)


def build(
    onnx_path: Path, build_config: EngineBuildConfig, root: Path
) -> tuple[EngineBuildResult, dict[str, Any]]:
    result = build_engine(onnx_path, build_config, gpu=orin, root=root)
    return result, decode_plan(result.plan)


def layer(plan: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [entry for entry in plan["layers"] if entry["name"] == name]
    assert len(matches) == 1, f"layer {name!r} not in {[entry['name'] for entry in plan['layers']]}"
    return matches[0]


# --- per-version network and builder flags ------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_network_and_precision_flags_follow_the_tensorrt_version(
    version: str, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake(version)
    result, plan = build(model, config(), tmp_path)
    major = int(version.split(".")[0])
    assert result.tensorrt_version == version
    if major == 8:
        assert plan["network"]["flags"] == 1  # 1 << EXPLICIT_BATCH
    else:
        assert plan["network"]["flags"] == 0
    if major < 11:
        assert {"INT8", "FP16"} <= set(plan["builder_flags"])
        assert not plan["network"]["strongly_typed"]
    else:
        assert plan["network"]["strongly_typed"]
        assert plan["builder_flags"] == []
    assert layer(plan, "conv0")["effective"] == "INT8"
    assert plan["plugins_initialised"]


def test_precision_flags_follow_the_config(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    _, plan = build(model, config(fp16=False), tmp_path)
    assert plan["builder_flags"] == ["INT8"]
    assert layer(plan, "relu0")["effective"] == "FLOAT"


def test_int8_off_on_a_qdq_model_fails_with_tensorrts_message(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    with pytest.raises(EngineError) as caught:
        build(model, config(int8=False), tmp_path)
    assert any("INT8" in message for message in caught.value.fields["messages"])


def test_strongly_typed_tensorrt_warns_that_precision_flags_are_ignored(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("11.0.0.11")
    result, plan = build(model, config(fp16=False), tmp_path)
    assert plan["builder_flags"] == []
    assert any("strong typing" in warning for warning in result.warnings)


# --- FP16 fallback layers ------------------------------------------------------------------------


@pytest.mark.parametrize("version", WEAKLY_TYPED)
def test_fp16_fallback_layers_are_constrained_to_half(
    version: str, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake(version)
    _, plan = build(model, config(fp16_layers=("conv1",)), tmp_path)
    conv1 = layer(plan, "conv1")
    assert conv1["precision"] == "HALF"
    assert conv1["output_types"] == {"0": "HALF"}
    assert conv1["effective"] == "HALF"
    assert "OBEY_PRECISION_CONSTRAINTS" in plan["builder_flags"]
    assert "PREFER_PRECISION_CONSTRAINTS" not in plan["builder_flags"]
    # Only the named layer is pinned; the rest stay INT8 or the builder's choice.
    assert layer(plan, "relu0")["precision"] is None
    assert layer(plan, "relu0")["effective"] == "UNCONSTRAINED"
    assert layer(plan, "conv0")["effective"] == "INT8"


def test_non_strict_precision_prefers_instead_of_obeying(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    _, plan = build(model, config(fp16_layers=("conv1",), strict_precision=False), tmp_path)
    assert "PREFER_PRECISION_CONSTRAINTS" in plan["builder_flags"]
    assert "OBEY_PRECISION_CONSTRAINTS" not in plan["builder_flags"]
    assert layer(plan, "conv1")["effective"] == "HALF"


def test_without_fallback_layers_no_constraint_flag_is_set(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    _, plan = build(model, config(), tmp_path)
    assert not {"OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"} & set(plan["builder_flags"])


@pytest.mark.parametrize("version", ("8.5.2.2", "10.3.0.30", "11.0.0.11"))
def test_unknown_fallback_layer_is_an_error(
    version: str, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake(version)
    with pytest.raises(EngineError) as caught:
        build(model, config(fp16_layers=("conv1", "conv9")), tmp_path)
    assert caught.value.fields["missing"] == ["conv9"]
    assert "conv1" in caught.value.fields["layers"]


def test_strongly_typed_tensorrt_refuses_fallback_layers_that_are_float_in_the_graph(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("11.0.0.11")
    with pytest.raises(EngineError) as caught:
        build(model, config(fp16_layers=("conv1",)), tmp_path)
    assert "FP16 in the ONNX" in str(caught.value)
    assert caught.value.fields["layers"] == ["conv1 (FLOAT)"]


def test_strongly_typed_tensorrt_accepts_fallback_layers_cast_to_fp16_in_the_graph(
    install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("11.0.0.11")
    model = qdq_conv_model(tmp_path / "autocast.onnx", conv1_in_fp16=True)
    _, plan = build(model, config(fp16_layers=("conv1",)), tmp_path)
    assert layer(plan, "conv1")["effective"] == "HALF"
    assert layer(plan, "conv1")["precision"] is None  # nothing was set per layer: the graph decides
    assert layer(plan, "conv0")["effective"] == "INT8"


# --- optimization profile ----------------------------------------------------------------------


def test_profile_covers_dynamic_batch_and_spatial_axes(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    result, plan = build(model, config(min_batch=2), tmp_path)
    assert plan["inputs"] == {"images": [-1, 3, -1, -1]}
    assert plan["profiles"] == [
        {"images": {"min": [2, 3, 32, 32], "opt": [4, 3, 224, 224], "max": [8, 3, 512, 512]}}
    ]
    assert result.profile == {
        "images": ShapeRange(min=(2, 3, 32, 32), opt=(4, 3, 224, 224), max=(8, 3, 512, 512))
    }


def test_static_axes_keep_their_value(
    install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    model = qdq_conv_model(tmp_path / "static.onnx", height=64, width=96)
    _, plan = build(model, config(), tmp_path)
    assert plan["profiles"] == [
        {"images": {"min": [1, 3, 64, 96], "opt": [4, 3, 64, 96], "max": [8, 3, 64, 96]}}
    ]


def test_static_batch_is_kept_with_a_warning(
    install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    model = qdq_conv_model(tmp_path / "batch1.onnx", batch=1)
    result, plan = build(model, config(), tmp_path)
    assert plan["profiles"][0]["images"]["max"] == [1, 3, 512, 512]
    assert any("static batch of 1" in warning for warning in result.warnings)


def test_dynamic_spatial_axis_without_a_range_is_an_error(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    with pytest.raises(EngineError) as caught:
        build(model, EngineBuildConfig(opt_batch=1, max_batch=1), tmp_path)
    assert caught.value.fields["input"] == "images"
    assert caught.value.fields["axis"] == 2
    assert "height" in str(caught.value)


def test_profile_shapes_places_height_and_width_by_layout() -> None:
    nhwc = config(layout="NHWC", opt_height=100, opt_width=200)
    ranges, warnings = profile_shapes({"x": [-1, -1, -1, 3], "scale": [1]}, nhwc)
    assert ranges["x"] == ShapeRange(min=(1, 32, 32, 3), opt=(4, 100, 200, 3), max=(8, 512, 512, 3))
    assert ranges["scale"] == ShapeRange(min=(1,), opt=(1,), max=(1,))
    assert warnings == []


def test_profile_shapes_rejects_other_dynamic_axes() -> None:
    with pytest.raises(EngineError) as caught:
        profile_shapes({"tokens": [-1, -1]}, config())
    assert caught.value.fields["axis"] == 1


# --- timing cache ----------------------------------------------------------------------------------


def test_timing_cache_round_trip(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    cache_path = tmp_path / "cache" / "timing.cache"
    first, first_plan = build(model, config(timing_cache_path=cache_path), tmp_path)
    assert first_plan["timing_cache"] == {"hits": 0, "entries_before": 0}
    assert cache_path.read_bytes() == first.timing_cache

    second, second_plan = build(model, config(timing_cache_path=cache_path), tmp_path)
    layers = len(second_plan["layers"])
    assert second_plan["timing_cache"] == {"hits": layers, "entries_before": layers}
    assert second.warnings == []


def test_timing_cache_is_returned_without_a_path(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    result, _ = build(model, config(), tmp_path)
    assert result.timing_cache
    assert not list(tmp_path.glob("*.cache"))


def test_timing_cache_from_another_device_is_replaced(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    cache_path = tmp_path / "timing.cache"
    install_fake("10.3.0.30")
    build(model, config(timing_cache_path=cache_path), tmp_path)
    old_cache = cache_path.read_bytes()

    xavier = install_fake("10.3.0.30")
    state_of(xavier).compute_capability = "7.2"
    result, plan = build(model, config(timing_cache_path=cache_path), tmp_path)
    assert plan["timing_cache"]["entries_before"] == 0
    assert any("another device" in warning for warning in result.warnings)
    assert cache_path.read_bytes() != old_cache


def test_corrupt_timing_cache_is_replaced(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    cache_path = tmp_path / "timing.cache"
    cache_path.write_bytes(b"\x00garbage")
    result, plan = build(model, config(timing_cache_path=cache_path), tmp_path)
    assert plan["timing_cache"]["entries_before"] == 0
    assert any("corrupt" in warning for warning in result.warnings)
    assert cache_path.read_bytes() == result.timing_cache


@pytest.mark.parametrize("strict", (True, False))
def test_an_ignored_fp16_constraint_fails_a_strict_build(
    strict: bool, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    state_of(install_fake("8.5.2.2")).no_kernel_in_constrained_precision = {"conv1"}
    if strict:
        with pytest.raises(EngineError) as caught:
            build(model, config(fp16_layers=("conv1",)), tmp_path)
        assert "not the model the bundle's accuracy report measured" in str(caught.value)
        [message] = caught.value.fields["messages"]
        assert "No implementation of layer conv1 obeys the requested constraints" in message
    else:
        result, plan = build(model, config(fp16_layers=("conv1",), strict_precision=False), tmp_path)
        assert any("conv1 obeys the requested constraints" in warning for warning in result.warnings)


# --- DLA ------------------------------------------------------------------------------------------

# DLA runs static shapes only.
STATIC = dict(min_batch=4, opt_batch=4, max_batch=4, min_height=224, max_height=224, min_width=224,
              max_width=224)


def test_dla_refuses_a_dynamic_profile() -> None:
    with pytest.raises(ConfigError) as caught:
        config(dla_core=0)
    assert "DLA runs static shapes only" in str(caught.value)
    assert caught.value.fields == {"key": "batch range", "found": [1, 4, 8]}
    with pytest.raises(ConfigError, match="height range"):
        config(dla_core=0, min_batch=4, max_batch=4)
    assert config(dla_core=0, **STATIC).profile_spans() == {
        "batch": (4, 4, 4), "height": (224, 224, 224), "width": (224, 224, 224)}


def test_fake_tensorrt_keeps_a_dynamic_dla_build_off_the_dla(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    # The strictness the builder's refusal answers: TensorRT itself puts every layer on the GPU
    # (GPU_FALLBACK) or fails the build when a DLA profile has ranges.
    trt = install_fake("10.3.0.30")
    state_of(trt).num_dla_cores = 1
    for fallback in (True, False):
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        assert trt.OnnxParser(network, logger).parse(model.read_bytes())
        build_config = builder.create_builder_config()
        build_config.set_flag(trt.BuilderFlag.INT8)
        build_config.default_device_type = trt.DeviceType.DLA
        build_config.DLA_core = 0
        if fallback:
            build_config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
        profile = builder.create_optimization_profile()
        profile.set_shape(network.get_input(0).name, (1, 3, 32, 32), (4, 3, 64, 64), (8, 3, 64, 64))
        build_config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, build_config)
        if fallback:
            assert state_of(trt).builds[-1]["device"]["layers_on"] == "GPU"
        else:
            assert plan is None


def test_dla_on_a_device_without_dla_is_an_error(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    with pytest.raises(EngineError) as caught:
        build(model, config(dla_core=0, **STATIC), tmp_path)
    assert "no DLA" in str(caught.value)
    assert caught.value.fields["available"] == 0


def test_dla_core_must_exist(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    state_of(install_fake("10.3.0.30")).num_dla_cores = 2
    with pytest.raises(EngineError) as caught:
        build(model, config(dla_core=2, **STATIC), tmp_path)
    assert caught.value.fields == {"dla_core": 2, "available": 2}


@pytest.mark.parametrize("gpu_fallback", (True, False))
def test_dla_build_targets_the_core(
    gpu_fallback: bool, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    state_of(install_fake("8.5.2.2")).num_dla_cores = 2
    _, plan = build(model, config(dla_core=1, gpu_fallback=gpu_fallback, **STATIC), tmp_path)
    assert plan["device"] == {"default_device_type": "DLA", "DLA_core": 1, "layers_on": "DLA"}
    assert ("GPU_FALLBACK" in plan["builder_flags"]) is gpu_fallback


def test_gpu_build_leaves_the_device_alone(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    _, plan = build(model, config(), tmp_path)
    assert plan["device"]["default_device_type"] == "GPU"
    assert "GPU_FALLBACK" not in plan["builder_flags"]


# --- workspace and optimization level --------------------------------------------------------------


def test_workspace_limit(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    _, plan = build(model, config(workspace_bytes=256 << 20), tmp_path)
    assert plan["memory_pools"] == {"WORKSPACE": 256 << 20}
    _, plan = build(model, config(workspace_bytes=None), tmp_path)
    assert plan["memory_pools"] == {}


@pytest.mark.parametrize("version", ("8.6.1.6", "10.3.0.30", "11.0.0.11"))
def test_optimization_level_is_set_where_it_exists(
    version: str, install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake(version)
    result, plan = build(model, config(optimization_level=5), tmp_path)
    assert plan["optimization_level"] == 5
    assert not any("optimization_level" in warning for warning in result.warnings)


def test_optimization_level_is_skipped_with_a_warning_on_8_5(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("8.5.2.2")
    result, plan = build(model, config(optimization_level=5), tmp_path)
    assert "optimization_level" not in plan
    assert any("8.6+" in warning for warning in result.warnings)


# --- errors from the model and the build -------------------------------------------------------------


@pytest.mark.parametrize("version", ("10.3.0.30", "11.0.0.11"))
def test_parser_errors_name_the_node(
    version: str, install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake(version)
    model = qdq_conv_model(tmp_path / "odd.onnx", extra_op="FancyOp")
    with pytest.raises(EngineError) as caught:
        build(model, config(), tmp_path)
    assert caught.value.fields["path"] == model
    (error,) = caught.value.fields["errors"]
    assert error.startswith("node 6 'mystery0' (FancyOp): UNSUPPORTED_NODE: ")


def test_parser_errors_on_8_5_get_the_node_name_from_the_model(
    install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("8.5.2.2")
    model = qdq_conv_model(tmp_path / "odd.onnx", extra_op="FancyOp")
    with pytest.raises(EngineError) as caught:
        build(model, config(), tmp_path)
    (error,) = caught.value.fields["errors"]
    assert error.startswith("node 6 'mystery0': UNSUPPORTED_NODE: ")


@pytest.mark.parametrize("content", (b"\xff\xff\xff\xff", b"not an onnx model"))
def test_corrupt_onnx_is_reported_by_the_parser(
    content: bytes, install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(content)
    with pytest.raises(EngineError) as caught:
        build(broken, config(), tmp_path)
    (error,) = caught.value.fields["errors"]
    assert error.startswith("MODEL_DESERIALIZE_FAILED: ")


def test_truncated_onnx_is_an_error(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(EngineError) as caught:
        build(truncated, config(), tmp_path)
    assert caught.value.fields["path"] == truncated


@pytest.mark.parametrize("kind", ("missing", "directory", "empty"))
def test_unreadable_onnx_names_the_file(
    kind: str, install_fake: Callable[[str], types.ModuleType], tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    path = tmp_path / "model.onnx"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    with pytest.raises(EngineError) as caught:
        build(path, config(), tmp_path)
    assert caught.value.fields["path"] == path
    assert str(path) in str(caught.value)


def test_build_failure_surfaces_tensorrts_messages(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    fake = install_fake("10.3.0.30")
    state_of(
        fake
    ).fail_build_with = "Requested amount of GPU memory (1073741824 bytes) could not be allocated"
    cache_path = tmp_path / "timing.cache"
    with pytest.raises(EngineError) as caught:
        build(model, config(timing_cache_path=cache_path), tmp_path)
    assert "could not build" in str(caught.value)
    assert caught.value.fields["messages"] == [state_of(fake).fail_build_with]
    assert not cache_path.exists()


@pytest.mark.parametrize("version", ("10.3.0.30", "11.0.0.11"))
def test_build_progress_is_logged_through_the_progress_monitor(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path, version: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    fake = install_fake(version)
    with caplog.at_level("INFO", logger="models.engine"):
        result, _ = build(model, config(), tmp_path)
    assert result.plan
    calls = state_of(fake).progress_calls
    assert calls[0] == ("start", "Building engine", None, 1)
    assert ("finish", "Building engine") == calls[-1]
    messages = [record.getMessage() for record in caplog.records]
    assert "engine build: Building engine (1 step(s))" in messages
    assert any(message.startswith("engine build: Building engine done in") for message in messages)
    # Nested phases are DEBUG: an INFO log shows the top level only.
    assert not any("Timing layers" in message for message in messages)


@pytest.mark.parametrize("version", ("10.3.0.30", "11.0.0.11"))
def test_a_stop_request_ends_the_build_early(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path, version: str
) -> None:
    fake = install_fake(version)
    state = state_of(fake)
    polled: list[int] = []

    def stop_after_first_step() -> bool:
        polled.append(1)
        return len(polled) > 1

    cache_path = tmp_path / "timing.cache"
    with pytest.raises(EngineBuildCancelled) as caught:
        build_engine(model, config(timing_cache_path=cache_path), gpu=orin,
                     root=tmp_path, stop_requested=stop_after_first_step)
    assert "stopped on request" in str(caught.value)
    assert isinstance(caught.value, EngineError)
    # TensorRT was told to stop at the second step: no further steps, no engine, no cache.
    steps = [call for call in state.progress_calls if call[0] == "step"]
    assert steps == [("step", "Timing layers", 0), ("step", "Timing layers", 1)]
    assert state.builds == [] and not cache_path.exists()


def test_a_failing_stop_check_does_not_reach_tensorrt(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")

    def broken() -> bool:
        raise OSError("cannot read the stop flag")

    # Raised into TensorRT's noexcept C++ callback, this would abort the process: the monitor
    # logs it and the build goes on.
    result = build_engine(model, config(), gpu=orin, root=tmp_path,
                          stop_requested=broken)
    assert result.plan


def test_an_interrupt_inside_a_progress_callback_stops_the_build_and_is_raised_after(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    """Ctrl-C (or the CLI's SIGTERM handler) can fire while TensorRT is inside a Python callback
    on the building thread. It must not cross into TensorRT's noexcept C++ (the process would
    abort): the build is stopped, and the interrupt is raised once TensorRT has returned."""
    fake = install_fake("10.3.0.30")

    def interrupted() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_engine(model, config(), gpu=orin, root=tmp_path,
                     stop_requested=interrupted)
    state = state_of(fake)
    assert [call for call in state.progress_calls if call[0] == "step"] == [
        ("step", "Timing layers", 0)]
    assert state.builds == []


def test_tensorrt_8_5_builds_to_the_end_without_a_progress_monitor(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    fake = install_fake("8.5.2.2")
    assert not hasattr(fake, "IProgressMonitor")
    result = build_engine(model, config(), gpu=orin, root=tmp_path,
                          stop_requested=lambda: True)
    assert result.plan and state_of(fake).progress_calls == []


def test_unsupported_tensorrt_version_is_an_error(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    fake = install_fake("8.5.2.2")
    setattr(fake, "__version__", "8.4.3.1")  # noqa: B010 - a module attribute mypy cannot see
    with pytest.raises(EngineError) as caught:
        build(model, config(), tmp_path)
    assert "8.5" in str(caught.value)


def test_missing_tensorrt_names_jetpack(
    monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes ``import tensorrt`` raise ImportError
    with pytest.raises(MissingDependencyError) as caught:
        build(model, config(), tmp_path)
    assert "JetPack" in str(caught.value)


def test_stub_namespace_package_is_not_mistaken_for_tensorrt(
    monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path
) -> None:
    # What ``import tensorrt`` yields where only tensorrt-stubs is installed.
    namespace = types.ModuleType("tensorrt")
    namespace.__path__ = [str(tmp_path / "site-packages" / "tensorrt")]
    monkeypatch.setitem(sys.modules, "tensorrt", namespace)
    with pytest.raises(MissingDependencyError) as caught:
        build(model, config(), tmp_path)
    assert "not TensorRT but an empty namespace package" in str(caught.value)
    assert str(tmp_path / "site-packages" / "tensorrt") in str(caught.value)


# --- configuration validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"opt_batch": 0}, "opt_batch"),
        ({"opt_batch": 16}, "opt_batch"),
        ({"min_batch": 0}, "min_batch"),
        ({"opt_batch": True}, "opt_batch"),
        ({"max_height": None}, "max_height"),
        ({"opt_width": 1024}, "opt_width"),
        ({"layout": "CHW"}, "layout"),
        ({"workspace_bytes": 0}, "workspace_bytes"),
        ({"dla_core": -1}, "dla_core"),
        ({"optimization_level": 6}, "optimization_level"),
        ({"int8": "yes"}, "int8"),
        ({"fp16_layers": ("conv1", "conv1")}, "fp16_layers"),
        ({"fp16_layers": ("conv1",), "fp16": False}, "fp16_layers"),
        ({"fp16_layers": "conv1"}, "fp16_layers"),
        ({"fp16_layers": ("",)}, "fp16_layers"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(**overrides)
    assert caught.value.fields["key"] == key


def test_config_normalises_sequences_and_paths(tmp_path: Path) -> None:
    built = config(fp16_layers=["conv1"], timing_cache_path=str(tmp_path / "t.cache"))
    assert built.fp16_layers == ("conv1",)
    assert built.timing_cache_path == tmp_path / "t.cache"


# --- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_from_the_board(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    root = tmp_path / "board"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text(TEGRA_RELEASE_R36)
    result, _ = build(model, config(), root)
    assert result.fingerprint == DeviceFingerprint(
        trt_version="10.3.0.30", compute_capability="8.7", l4t_release="36.4.3", multiprocessors=16
    )
    assert result.fingerprint.key() == "trt10.3.0.30-sm87-mp16-l4t36.4.3"


def test_fingerprint_off_a_jetson_has_no_l4t(
    install_fake: Callable[[str], types.ModuleType], model: Path, tmp_path: Path
) -> None:
    install_fake("10.3.0.30")
    result = build_engine(model, config(), gpu=lambda: GpuModel("9.0", 132), root=tmp_path)
    assert result.fingerprint.key() == "trt10.3.0.30-sm90-mp132"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (TEGRA_RELEASE_R36, "36.4.3"),
        (
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: x\n",
            "35.4.1",
        ),
        ("# R32(release), REVISION: 6.1, GCID: 27863751, BOARD: t186ref, EABI:aarch64\n", "32.6.1"),
        ("# R36 (release), REVISION: 4.0\n", "36.4.0"),
        ("not a release file\n", None),
        ("", None),
    ],
)
def test_read_l4t_release(content: str, expected: str | None, tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text(content)
    assert read_l4t_release(tmp_path) == expected


def test_read_l4t_release_off_a_jetson(tmp_path: Path) -> None:
    assert read_l4t_release(tmp_path) is None


@pytest.mark.parametrize(
    "fields",
    [
        {"trt_version": "10.3.0", "compute_capability": "sm87"},
        {"trt_version": "10.3.0", "compute_capability": "8.7", "l4t_release": "R36"},
        {"trt_version": "10/3", "compute_capability": "8.7"},
    ],
)
def test_fingerprint_rejects_malformed_parts(fields: dict[str, str]) -> None:
    with pytest.raises(EngineError):
        DeviceFingerprint(**fields)


def test_fingerprint_key_is_filesystem_safe() -> None:
    key = DeviceFingerprint(trt_version="10.0.0+ea", compute_capability="8.7").key()
    assert key == "trt10.0.0_ea-sm87"


def test_orin_modules_of_one_architecture_get_different_fingerprints() -> None:
    # Every Orin is sm87; the multiprocessor count tells an AGX (16) from an NX or Nano (8, 4).
    keys = {DeviceFingerprint.of("10.3.0.30", GpuModel("8.7", count), "36.4.3").key()
            for count in (16, 8, 4)}
    assert keys == {f"trt10.3.0.30-sm87-mp{count}-l4t36.4.3" for count in (16, 8, 4)}
    with pytest.raises(EngineError, match="multiprocessor count"):
        DeviceFingerprint(trt_version="10.3.0.30", compute_capability="8.7", multiprocessors=0)


def test_gpu_model_without_a_driver_is_a_clear_error() -> None:
    with pytest.raises(EngineError) as caught:
        cuda_gpu_model(library="libcuda-does-not-exist.so.1")
    assert "CUDA driver" in str(caught.value)


@pytest.mark.gpu
def test_gpu_model_from_the_real_driver() -> None:
    if ctypes.util.find_library("cuda") is None:
        pytest.skip("no CUDA driver library on this machine")
    gpu = cuda_gpu_model()
    major, minor = (int(part) for part in gpu.compute_capability.split("."))
    assert major >= 5 and minor >= 0
    assert gpu.multiprocessors is not None and gpu.multiprocessors >= 1
    print(f"\nCUDA driver: compute {gpu.compute_capability}, {gpu.multiprocessors} multiprocessors")
