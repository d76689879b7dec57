"""The input sizes a model takes, found by running it (models/input_sizes.py), the engine profile
chosen from them or given with --profile-shape (models/pipeline/profile.py, profile_shape.py), and
builds of small ONNX models whose sizes are constrained the ways published models are."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from agent.cli import main  # noqa: E402
from agent.errors import ConfigError, ModelError  # noqa: E402
from models.bundle import inspect_bundle  # noqa: E402
from models.input_sizes import (SizeRuns, find_largest, find_stride,  # noqa: E402
                                probe_sizes)
from models.pipeline import (BuildOptions, ProfileShape, choose_engine_profile,  # noqa: E402
                             parse_profile_shape)
from models.signing import write_keypair  # noqa: E402
from tests.helpers import write_samples  # noqa: E402
from tests.tiny_models import tiny_classifier  # noqa: E402


# --- tiny models whose sizes are constrained ----------------------------------------------------



# `edge-agent build` needs the host extra (torch), which the device-side pass on Python 3.10 lacks.
needs_build = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="edge-agent build needs the host extra")

def _save(path: Path, nodes, inputs, outputs, initializers, *, opset: int = 17) -> Path:
    model = helper.make_model(helper.make_graph(nodes, path.stem, inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def fixed_height_model(path: Path, height: int = 48) -> Path:
    """A text recognizer's shape: [N, 1, H, W] -> conv -> each column's features folded into one
    vector (a Reshape that needs 4 * H == 4 * ``height``) -> per-column scores [N, W, 6]. The
    graph says H is dynamic; only ``height`` runs. Any width runs."""
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(np.array([0, 0, 4 * height], np.int64), "fold"),
        numpy_helper.from_array(rng.normal(0, 0.2, (4 * height, 6)).astype(np.float32), "fc_w"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "conv_w"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("Transpose", ["relu"], ["columns"], perm=[0, 3, 1, 2]),
        helper.make_node("Reshape", ["columns", "fold"], ["folded"]),
        helper.make_node("MatMul", ["folded", "fc_w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
    ]
    return _save(path, nodes,
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, "h", "w"])],
                 [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", "w", 6])],
                 initializers)


def stride_model(path: Path, *, batch: int | str = "n") -> Path:
    """A dense predictor's shape: three stride-2 convs, upsampled x8 and added to a 1x1 conv of
    the input (a skip connection): only heights and widths that are multiples of 8 run."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
                    for name, shape in (("w1", (4, 3, 3, 3)), ("w2", (4, 4, 3, 3)),
                                        ("w3", (4, 4, 3, 3)), ("skip_w", (4, 3, 1, 1)))]
    initializers.append(numpy_helper.from_array(np.array([1, 1, 8, 8], np.float32), "scales"))
    down = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["d1"], **down),
        helper.make_node("Relu", ["d1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["d2"], **down),
        helper.make_node("Relu", ["d2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["d3"], **down),
        helper.make_node("Resize", ["d3", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Conv", ["x", "skip_w"], ["skip"]),
        helper.make_node("Add", ["up", "skip"], ["y"]),
    ]
    return _save(path, nodes,
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, "h", "w"])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, "h", "w"])],
                 initializers)


def _meta(shape: tuple[int, ...], *, name: str = "x", dynamic=("height", "width"),
          fixed_batch: int | None = None) -> dict:
    return {"input_name": name, "inputs": [(name, "float32", shape)], "layouts": {name: "NCHW"},
            "dynamic_hw": list(dynamic), "fixed_batch": fixed_batch}


def _options(**changes) -> BuildOptions:
    return BuildOptions(out_dir=Path("out"), onnx=Path("m.onnx"), calib_dir=Path("c"), **changes)


def _profile(model: Path, meta: dict, **changes) -> dict:
    return choose_engine_profile(model.read_bytes(), meta, _options(threads=1, **changes))


# --- the search, with runners whose rules are known ---------------------------------------------


def _multiples(stride: int, low: int = 1, high: int = 10**6):
    return lambda size: size % stride == 0 and low <= size <= high


@pytest.mark.parametrize("size, rule, expected", [
    (320, _multiples(32), 32),
    (640, _multiples(64), 64),
    (48, _multiples(1), 1),
    (48, _multiples(16), 16),
    (48, lambda size: size == 48, None),
    (48, _multiples(1, high=50), 1),  # a narrow range of any size is not a fixed axis
    (24, _multiples(8, low=24), 8),  # nothing below runs: found upwards
    (1, _multiples(1), 1),
])
def test_the_stride_is_found_in_a_handful_of_runs(size, rule, expected):
    tried = []

    def runs_at(candidate):
        tried.append(candidate)
        return rule(candidate)

    assert find_stride(runs_at, size) == expected
    assert len(tried) <= 6


def test_the_largest_size_is_the_bound_or_bisected_to_a_size_that_ran():
    tried = []

    def runs_at(size):
        tried.append(size)
        return size <= 80

    assert find_largest(runs_at, 48, 96, 1) == 80
    assert tried[0] == 96 and len(tried) <= 7
    assert find_largest(_multiples(32, high=1000), 320, 1280, 32) == 992
    assert find_largest(_multiples(1), 48, 96, 1) == 96


def _frame_runner(rule):
    """A runner for probe_sizes: ``rule(height, width)`` says whether the frame runs."""
    def run(frame):
        return None if rule(frame["height"], frame["width"]) else "Reshape: cannot reshape"
    return run


def test_a_fixed_height_and_a_stride_width_are_named_as_such():
    runs = SizeRuns(_frame_runner(lambda height, width: height == 48 and width % 8 == 0))
    frame = {"height": 48, "width": 320}
    findings = probe_sizes(runs, frame, frame, {"height": 96, "width": 640})
    assert findings.ok
    assert findings.axes["height"].span == [48, 48, 48]
    assert findings.axes["width"].span == [320, 320, 640]
    assert findings.lines() == ["height: fixed at 48 (16, 47, 49 and 80 fail)",
                                "width: multiples of 8 from 320 to 640 (the largest tried)"]
    assert findings.runs <= 12


def test_a_largest_frame_the_host_has_no_memory_for_shrinks_the_span():
    def rule(height, width):
        if height * width > 48 * 48:
            raise MemoryError
        return True

    def run(frame):
        try:
            rule(frame["height"], frame["width"])
        except MemoryError:
            return "onnxruntime::BFCArena: std::bad_alloc"
        return None

    frame = {"height": 32, "width": 32}
    findings = probe_sizes(SizeRuns(run), frame, frame, {"height": 64, "width": 64})
    assert findings.ok
    # Each axis alone runs at 64 (64 x 32 fits); both at once does not: halfway is 48 x 48.
    assert [findings.axes[name].largest for name in ("height", "width")] == [48, 48]
    assert any(note.startswith("the frame height 64 x width 64 failed (onnxruntime::BFCArena: "
                               "std::bad_alloc): shrunk towards height 32 x width 32")
               for note in findings.notes)


def test_a_deployment_frame_off_the_stride_is_not_run():
    runs = SizeRuns(_frame_runner(lambda height, width: height % 32 == 0 and width % 32 == 0))
    findings = probe_sizes(runs, {"height": 640, "width": 640}, {"height": 500, "width": 640},
                           {"height": 1000, "width": 1280})
    assert findings.deployed_failure == "its height must be a multiple of 32, not 500"
    assert (500, 640) not in {(dict(key)["height"], dict(key)["width"]) for key in runs.outcomes}


# --- the engine profile of real (tiny) ONNX models -------------------------------------------


def test_a_height_the_graph_needs_is_fixed_in_the_profile(tmp_path, caplog):
    model = fixed_height_model(tmp_path / "rec.onnx")
    with caplog.at_level("INFO", logger="models.pipeline.profile"):
        section = _profile(model, _meta((1, 48, 40)))
    assert section["chosen"] == "probed"
    assert section["profile"] == {"batch": [1, 8, 32], "height": [48, 48, 48], "width": [40, 40, 80]}
    assert section["axes"]["height"]["fixed"] and section["axes"]["width"]["stride"] == 1
    assert "input sizes: height: fixed at 48 (16, 47, 49 and 80 fail)" in caplog.messages
    assert section["runs"] <= 16


def test_a_frame_the_fixed_height_cannot_take_names_one_it_can(tmp_path):
    model = fixed_height_model(tmp_path / "rec.onnx")
    with pytest.raises(ModelError) as raised:
        _profile(model, _meta((1, 48, 40)), frame_size=(96, 200))
    message = str(raised.value)
    assert "deployment frame (x [1, 1, 96, 200]): its height is fixed at 48, not 96" in message
    assert "give --frame-size 48x200, which runs" in message


def test_a_stride_is_kept_in_the_profile(tmp_path):
    model = stride_model(tmp_path / "dense.onnx")
    section = _profile(model, _meta((3, 24, 32)), frame_size=(40, 64))
    assert section["profile"]["height"] == [24, 40, 80]
    assert section["profile"]["width"] == [32, 64, 128]
    assert section["found"][0].startswith("height: multiples of 8 from 24 to 80")
    with pytest.raises(ModelError, match="its height must be a multiple of 8, not 30; give "
                                         "--frame-size 32x64, which runs"):
        _profile(model, _meta((3, 24, 32)), frame_size=(30, 64))


def test_a_fixed_batch_is_the_profiles_batch_and_the_probes(tmp_path):
    model = stride_model(tmp_path / "two.onnx", batch=2)
    section = _profile(model, _meta((3, 16, 16), fixed_batch=2))
    # The probe ran at batch 2 (the graph refuses batch 1), and the profile holds only it.
    assert section["profile"] == {"batch": [2, 2, 2], "height": [16, 16, 32], "width": [16, 16, 32]}


def test_the_probe_runs_on_real_samples_resized(tmp_path):
    from models.pipeline.profile import _input_at

    sample = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4)
    resized = _input_at(sample, (2, 1, 6, 2), "float32", np.random.default_rng(0))
    assert resized.shape == (2, 1, 6, 2)
    np.testing.assert_array_equal(resized[0, 0], [[0, 2], [0, 2], [4, 6], [4, 6], [8, 10], [8, 10]])
    np.testing.assert_array_equal(resized[1], resized[0])  # the first sample, for every row


# --- --profile-shape -------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("x:1x3x48", "takes NAME:MIN,OPT,MAX"),
    ("1x3x48x80,8x3x48x320,32x3x48x1280", "takes NAME:MIN,OPT,MAX"),
    ("x:1x3xAx80,8x3x48x320,32x3x48x1280", "takes NAME:MIN,OPT,MAX"),
    (":1x3,1x3,1x3", "needs an input name before the colon"),
    ("x:1x3,1x3x4,1x3", "must have the same number of axes"),
    ("x:0x3,1x3,1x3", "every size must be at least 1"),
    ("x:1x3x48x800,8x3x48x320,32x3x48x1280",
     "axis 3 must satisfy min <= opt <= max, not 800, 320, 1280 "
     "(e.g. x:1x3x48x320,8x3x48x800,32x3x48x1280)"),
])
def test_bad_profile_shapes_are_refused_with_an_example(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_profile_shape(text)


def test_a_profile_shape_parses_like_trtexecs():
    shape = parse_profile_shape("input:0:1x3x48x80,8x3x48x320,32x3x48x1280")
    assert shape == ProfileShape("input:0", (1, 3, 48, 80), (8, 3, 48, 320), (32, 3, 48, 1280))
    assert shape.batch == [1, 8, 32] and shape.text() == "input:0:1x3x48x80,8x3x48x320,32x3x48x1280"


@pytest.mark.parametrize("shapes, batches, message", [
    (["x:1x3,8x3,32x3", "x:1x3,8x3,32x3"], {}, "names an input twice"),
    (["x:1x3,8x3,32x3", "y:1x3,4x3,32x3"], {}, "every input's batch .* must be the same"),
    (["x:2x3,8x3,32x3"], {"max_batch": 32, "opt_batch": 8}, "the smallest batch must be 1"),
    (["x:1x3,8x3,32x3"], {"max_batch": 16, "opt_batch": 8},
     r"sets the batch range \(1..8..32\): leave out --max-batch"),
])
def test_profile_shapes_that_disagree_are_refused(shapes, batches, message):
    parsed = tuple(parse_profile_shape(text) for text in shapes)
    batches = batches or {"max_batch": parsed[0].batch[2], "opt_batch": parsed[0].batch[1]}
    with pytest.raises(ConfigError, match=message):
        _options(profile_shapes=parsed, **batches)


def _given(shape: str) -> BuildOptions:
    parsed = parse_profile_shape(shape)
    return _options(profile_shapes=(parsed,), max_batch=parsed.batch[2], opt_batch=parsed.batch[1],
                    threads=1)


@pytest.mark.parametrize("shape, message", [
    ("y:1x1x48x40,8x1x48x40,32x1x48x80",
     r"names 'y', which is not an input of the model \(its inputs: x\)"),
    ("x:1x48x40,8x48x40,32x48x80", r"x has 3 axes; the input has 4 \(\[\?, 1, \?, \?\]\)"),
    ("x:1x3x48x40,8x3x48x40,32x3x48x80",
     r"axis 1 is fixed at 1 in the model .*; e.g. x:1x1x48x40,8x1x48x40,32x1x48x80"),
])
def test_profile_shapes_that_do_not_fit_the_model_are_refused(tmp_path, shape, message):
    model = fixed_height_model(tmp_path / "rec.onnx")
    with pytest.raises(ConfigError, match=message):
        choose_engine_profile(model.read_bytes(), _meta((1, 48, 40)), _given(shape))


def test_a_fixed_batch_must_be_the_profile_shapes_batch(tmp_path):
    model = stride_model(tmp_path / "two.onnx", batch=2)
    with pytest.raises(ConfigError, match=r"the model's batch is fixed at 2; give it as min, opt "
                                          r"and max \(e.g. x:2x3x16x16,2x3x16x16,2x3x16x16\)"):
        choose_engine_profile(model.read_bytes(), _meta((3, 16, 16), fixed_batch=2),
                              _given("x:1x3x16x16,2x3x16x16,2x3x16x16"))


def test_a_given_profile_is_run_and_a_failing_one_names_one_that_runs(tmp_path):
    model = fixed_height_model(tmp_path / "rec.onnx")
    meta = _meta((1, 48, 40))
    section = choose_engine_profile(model.read_bytes(), meta,
                                    _given("x:1x1x48x16,4x1x48x40,16x1x48x120"))
    assert section["chosen"] == "given"
    assert meta["engine_profile"] == {"batch": [1, 4, 16], "height": [48, 48, 48],
                                      "width": [16, 40, 120]}
    with pytest.raises(ModelError) as raised:
        choose_engine_profile(model.read_bytes(), _meta((1, 48, 40)),
                              _given("x:1x1x48x16,4x1x48x40,16x1x96x120"))
    message = str(raised.value)
    assert ("does not run with x [1, 1, 96, 120] (the --profile-shape max's height and width, "
            "at batch 1)") in message
    assert "try --profile-shape x:1x1x48x16,4x1x48x40,16x1x48x120, which runs" in message


# --- builds ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "signing.key"
    write_keypair(path)
    return path


def _samples(directory: Path, shape: tuple[int, ...]) -> Path:
    rng = np.random.default_rng(0)
    return write_samples(directory, rng.uniform(0, 1, (16, *shape)).astype(np.float32))


QUICK = ["--calib-samples", "16", "--calib-method", "minmax", "--accuracy-budget", "100",
         "--threads", "1"]


def _build(model: Path, calib: Path, keys: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    """Build ``model`` quickly (16 samples, min-max ranges, any drop allowed: random weights) and
    return the bundle's manifest and the report."""
    assert main(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                 "--out", str(out), *QUICK, *extra]) == 0
    manifest = inspect_bundle(out / f"{model.stem}-1.bundle")["manifest"]
    return manifest, json.loads((out / "report.json").read_text())


@needs_build
def test_a_model_of_fixed_height_builds_and_its_engine_gets_that_height(
        tmp_path, keys, monkeypatch, capsys):
    import sys

    import models.engine.builder as builder
    from agent.backends.base import ModelArtifacts
    from agent.backends.tensorrt import engine_build_config
    from models.bundle import open_bundle
    from models.engine import profile_shapes
    from models.fingerprint import GpuModel
    from models.signing import load_public_key
    from tests.fakes.fake_tensorrt import decode_plan, make_fake_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt("10.3.0.30"))
    monkeypatch.setattr(builder, "cuda_gpu_model", lambda: GpuModel("8.7", 16))
    model = fixed_height_model(tmp_path / "rec.onnx")
    out = tmp_path / "out"
    manifest, report = _build(model, _samples(tmp_path / "c", (1, 48, 40)), keys, out, "--engine")
    assert manifest["engine_profile"] == {"batch": [1, 8, 32], "height": [48, 48, 48],
                                          "width": [40, 40, 80]}
    assert report["engine_profile"]["chosen"] == "probed"
    assert report["engine_profile"]["found"][0] == "height: fixed at 48 (16, 47, 49 and 80 fail)"
    assert "profile  batch 1/8/32, height 48/48/48, width 40/40/80" in capsys.readouterr().out
    bundle = open_bundle(out / "rec-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    plan = decode_plan(bundle.read_member(next(iter(manifest["engines"].values()))))
    assert plan["profiles"] == [{"x": {"min": [1, 1, 48, 40], "opt": [8, 1, 48, 40],
                                       "max": [32, 1, 48, 80]}}]
    # The daemon's own engine build reads the same profile from the manifest.
    artifacts = ModelArtifacts(name="rec", version=1, directory=tmp_path, manifest=manifest,
                               engine_cache_dir=tmp_path / "engines")
    ranges, _ = profile_shapes({"x": [-1, 1, -1, -1]}, engine_build_config(artifacts, {}))
    assert ranges["x"].max == (32, 1, 48, 80)


@needs_build
def test_a_model_that_needs_multiples_of_8_builds_with_a_profile_on_them(tmp_path, keys):
    model = stride_model(tmp_path / "dense.onnx")
    manifest, report = _build(model, _samples(tmp_path / "c", (3, 24, 32)), keys, tmp_path / "out",
                              "--frame-size", "40x64")
    assert manifest["engine_profile"] == {"batch": [1, 8, 32], "height": [24, 40, 80],
                                          "width": [32, 64, 128]}
    assert report["engine_profile"]["axes"]["width"]["stride"] == 8
    assert report["speed"]["input_shape"] == [8, 3, 40, 64]


@needs_build
def test_a_model_of_any_size_builds_with_twice_its_frame(tmp_path, keys):
    model = tiny_classifier(tmp_path / "any.onnx")
    manifest, report = _build(model, _samples(tmp_path / "c", (3, 20, 28)), keys, tmp_path / "out")
    assert manifest["engine_profile"] == {"batch": [1, 8, 32], "height": [20, 20, 40],
                                          "width": [28, 28, 56]}
    assert report["engine_profile"]["found"] == ["height: any size from 20 to 40 (the largest tried)",
                                                 "width: any size from 28 to 56 (the largest tried)"]


def _fails(args: list[str], capfd) -> str:
    status = main(args)
    lines = capfd.readouterr().err.strip().splitlines()
    assert status != 0 and lines[-1].startswith("edge-agent: error:"), lines
    # One line: no traceback, and no ONNX Runtime log of the runs that failed on the way.
    assert [line for line in lines if "error" in line.lower()] == [lines[-1]], lines
    assert not any("onnxruntime" in line.lower() for line in lines[:-1]), lines
    return lines[-1]


@needs_build
def test_profile_shape_on_the_command_line_sets_the_profile_and_the_batch(tmp_path, keys, capfd):
    model = fixed_height_model(tmp_path / "rec.onnx")
    calib = _samples(tmp_path / "c", (1, 48, 40))
    args = ["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
            "--out", str(tmp_path / "out"), *QUICK]
    err = _fails([*args, "--profile-shape", "x:1x1x48x16,4x1x48x40,16x1x96x120"], capfd)
    assert "the --profile-shape max's height and width" in err
    way_out = re.search(r"try --profile-shape (\S+), which runs", err).group(1)
    assert way_out == "x:1x1x48x16,4x1x48x40,16x1x48x120"
    err = _fails([*args, "--profile-shape", f"{way_out}", "--max-batch", "32"], capfd)
    assert "sets the batch range (1..4..16): leave out --max-batch and --opt-batch" in err
    assert "takes NAME:MIN,OPT,MAX" in _fails([*args, "--profile-shape", "x:1x1x48"], capfd)
    assert _outputs(tmp_path / "out") == set()
    # The way out the error named works; --max-batch and --opt-batch come from it.
    manifest, report = _build(model, calib, keys, tmp_path / "out", "--profile-shape", way_out)
    assert manifest["engine_profile"] == {"batch": [1, 4, 16], "height": [48, 48, 48],
                                          "width": [16, 40, 120]}
    assert (manifest["max_batch"], manifest["opt_batch"]) == (16, 4)
    assert report["engine_profile"]["chosen"] == "given"
    assert report["engine_profile"]["given"] == [way_out]
    assert report["speed"]["input_shape"] == [4, 1, 48, 40]  # the opt is the deployment frame


def _outputs(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()} if directory.exists() else set()


def test_sizes_one_more_than_a_multiple_keep_their_phase():
    # An old DeepLab export takes 513 x 513 and 32n + 1 in general (align_corners arithmetic).
    runs = SizeRuns(_frame_runner(lambda height, width: height % 32 == 1 and width % 32 == 1))
    frame = {"height": 513, "width": 513}
    findings = probe_sizes(runs, frame, frame, {"height": 1026, "width": 1026})
    assert findings.axes["height"].span == [513, 513, 1025]
    assert findings.lines()[0] == "height: 32n + 1 from 513 to 1025 (the largest tried)"
    findings = probe_sizes(runs, frame, {"height": 500, "width": 513}, frame)
    assert findings.deployed_failure == "its height must be 32n + 1, not 500"


def image_and_depth_model(path: Path) -> Path:
    """RGB and an aligned depth map of any (but the same) size, concatenated, and a 1x1 conv."""
    weight = numpy_helper.from_array(np.full((2, 4, 1, 1), 0.25, np.float32), "w")
    nodes = [helper.make_node("Concat", ["image", "depth"], ["both"], axis=1),
             helper.make_node("Conv", ["both", "w"], ["y"])]
    return _save(path, nodes,
                 [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, "h", "w"]),
                  helper.make_tensor_value_info("depth", TensorProto.FLOAT, ["n", 1, "h", "w"])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, "h", "w"])],
                 [weight])


def _two_inputs() -> dict:
    return {"input_name": "image",
            "inputs": [("image", "float32", (3, 16, 16)), ("depth", "float32", (1, 16, 16))],
            "layouts": {"image": "NCHW", "depth": "NCHW"}, "dynamic_hw": ["height", "width"]}


def _given_all(*texts: str) -> BuildOptions:
    shapes = tuple(parse_profile_shape(text) for text in texts)
    return _options(profile_shapes=shapes, max_batch=shapes[0].batch[2],
                    opt_batch=shapes[0].batch[1], threads=1)


def test_profile_shapes_of_several_inputs_must_agree_with_the_first(tmp_path):
    model = image_and_depth_model(tmp_path / "rgbd.onnx").read_bytes()
    image = "image:1x3x16x16,2x3x32x32,4x3x64x64"
    section = choose_engine_profile(model, _two_inputs(),
                                    _given_all(image, "depth:1x1x16x16,2x1x32x32,4x1x64x64"))
    assert section["profile"] == {"batch": [1, 2, 4], "height": [16, 32, 64],
                                  "width": [16, 32, 64]}
    with pytest.raises(ConfigError, match="must be depth:1x1x16x16,2x1x32x32,4x1x64x64: the "
                                          "engine profile gives every input image's batch"):
        choose_engine_profile(model, _two_inputs(),
                              _given_all(image, "depth:1x1x16x16,2x1x32x32,4x1x48x48"))
    with pytest.raises(ConfigError, match="must give the first input 'image': the engine "
                                          "profile's height and width are its "
                                          r"\(e.g. image:1x3x16x16,2x3x16x16,4x3x16x16"):
        choose_engine_profile(model, _two_inputs(),
                              _given_all("depth:1x1x16x16,2x1x32x32,4x1x64x64"))


def test_a_profile_shape_for_a_model_of_fixed_size_sets_its_batch(tmp_path):
    model = tiny_classifier(tmp_path / "fixed.onnx", static_hw=16).read_bytes()
    meta = _meta((3, 16, 16), name="input", dynamic=())
    section = choose_engine_profile(model, meta,
                                    _given_all("input:1x3x16x16,4x3x16x16,8x3x16x16"))
    assert section["profile"] == {"batch": [1, 4, 8]}
    assert section["checked"] == "batch only"
    with pytest.raises(ConfigError, match="axis 2 is fixed at 16 in the model"):
        choose_engine_profile(model, meta, _given_all("input:1x3x16x16,4x3x32x32,8x3x32x32"))
