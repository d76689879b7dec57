"""End-to-end builds with the small example model, and the bad inputs the build must refuse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from agent.cli import main  # noqa: E402
from models.bundle import inspect_bundle, open_bundle  # noqa: E402
from models.data import load_digits_splits  # noqa: E402
from models.signing import load_public_key, write_keypair  # noqa: E402
from tests.helpers import write_samples  # noqa: E402

MODEL = "smallcnn-digits"
FAST = ["--calib-samples", "128", "--threads", "2"]


def _outputs(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()} if directory.exists() else set()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "signing.key"
    write_keypair(path)
    return path


@pytest.fixture(scope="module")
def digits_onnx(tmp_path_factory):
    """A float ONNX digits classifier plus a calibration directory of real samples."""
    from models.checkpoints import load_example
    from models.export import export_onnx

    root = tmp_path_factory.mktemp("onnx")
    train_split, _ = load_digits_splits(16)
    model = load_example(MODEL)
    exported = export_onnx(model, torch.from_numpy(train_split.images[:2]))
    path = root / "digits.onnx"
    path.write_bytes(exported.model_bytes)
    write_samples(root / "calib", train_split.images[:96])
    return path, root / "calib"


def test_build_example_makes_a_verified_bundle_and_report(tmp_path, keys, capsys):
    out = tmp_path / "out"
    # The budget is 1.5 points, not the default 1: pruning alone costs this small CNN about 0.6
    # of them, and ONNX Runtime's INT8 kernels round differently by CPU (AVX2, AVX-512 VNNI), so
    # with 1 point left a machine may find no layer it can keep in INT8 (one held-out digit is
    # 0.28 points). Whether the search then keeps some layers out depends on that CPU too.
    status = main(["build", "--model", MODEL, "--key", str(keys), "--out", str(out), *FAST,
                   "--prune", "0.5", "--round-to", "8", "--finetune-epochs", "2",
                   "--accuracy-budget", "1.5"])
    assert status == 0
    summary = capsys.readouterr().out
    assert "smallcnn-digits-1.bundle" in summary and "INT8" in summary
    assert _outputs(out) == {"smallcnn-digits-1.bundle", "report.json"}

    bundle = open_bundle(out / "smallcnn-digits-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    manifest = bundle.manifest
    assert manifest["name"] == MODEL and manifest["version"] == 1
    assert manifest["inputs"][0]["shape"] == [-1, 3, -1, -1]
    assert manifest["calibration"]["samples"] == 128
    assert manifest["precision"]["int8_layers"]
    assert manifest["accuracy"]["drop"] <= manifest["accuracy"]["budget"]
    assert manifest["engine_profile"] == {"batch": [1, 8, 32], "height": [16, 224, 448],
                                          "width": [16, 224, 448]}

    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"]["metric"] == "top1"
    for key in ("fp32_unpruned", "pruned_fp32", "int8_all_layers", "int8"):
        assert 0.0 <= report["accuracy"][key] <= 100.0
    assert report["model"]["pruned_params"] < report["model"]["params"]
    # Pruning and INT8 share one budget, counted from the unpruned model.
    assert report["accuracy"]["budget_from"] == "unpruned FP32 (PyTorch)"
    assert report["accuracy"]["drop"] == pytest.approx(
        report["accuracy"]["fp32_unpruned"] - report["accuracy"]["int8"], abs=2e-3)
    assert report["accuracy"]["drop"] <= report["accuracy"]["budget"]
    assert report["export"]["node_counts_before"]["BatchNormalization"] == 4
    assert "BatchNormalization" not in report["export"]["node_counts_after"]
    assert report["pruning"]["layers"]
    assert report["speed"]["int8_img_s"] > 0
    assert report["speed"]["int8_kernels"] in ("default", "exact U8U8 (no VNNI on this CPU)")
    assert json.loads(bundle.read_member("report.json")) == report

    # The model in the bundle really is the INT8 model: it runs and classifies the held-out digits.
    extracted = bundle.extract(tmp_path / "installed")
    from models.quantize import Evaluator

    _, held_out = load_digits_splits(16)
    accuracy = Evaluator({"input": held_out.images}, held_out.labels)((extracted / "model.onnx").read_bytes())
    assert accuracy == pytest.approx(report["accuracy"]["int8"], abs=1e-3)
    # ... and the report's "served" figure is what the daemon's ONNX Runtime session answers.
    from models.ort import create_session

    session = create_session(extracted / "model.onnx")  # as agent/backends/onnxruntime.py does
    served = session.run(None, {"input": held_out.images})[0].argmax(axis=1)
    assert 100.0 * float((served == held_out.labels).mean()) == pytest.approx(
        report["accuracy"]["int8_onnxruntime_served"], abs=1e-3)
    assert "INT8, served (CPU)" in summary
    # Nested stages are shown inside the stage that ran them, not added beside it.
    assert report["timings_within"] == {
        "prepare PyTorch model": ["load trained model", "prune channels", "export ONNX"]}
    time_line = next(line for line in summary.splitlines() if line.startswith("time"))
    assert "prepare PyTorch model " in time_line and "s (load trained model " in time_line
    assert time_line.count("export ONNX") == 1

    # A second build gets the next version.
    assert main(["build", "--model", MODEL, "--key", str(keys), "--out", str(out), *FAST]) == 0
    assert "smallcnn-digits-2.bundle" in _outputs(out)


def test_build_from_onnx_uses_agreement_without_labels(tmp_path, keys, digits_onnx, caplog):
    model_path, calib = digits_onnx
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="agent.cli.build"):
        assert main(["build", "--onnx", str(model_path), "--calib-dir", str(calib), "--key",
                     str(keys), "--out", str(out), "--calib-samples", "96", "--json",
                     "--finetune-epochs", "3", "--round-to", "8",
                     "--target", "orin-nano-8gb", "--target", "orin-nx-16gb"]) == 0
    # Pruning settings without pruning change nothing, and the build says so.
    assert ["--round-to, --finetune-epochs only apply when pruning (--prune or "
            "--prune-target-macs): ignored"] == [record.getMessage() for record in caplog.records
                                                 if record.name == "agent.cli.build"]
    report = json.loads((out / "report.json").read_text())
    assert report["accuracy"]["metric"] == "agreement"
    assert report["accuracy"]["fp32"] == 100.0
    assert report["name"] == "digits"
    # Without labels, samples held out from calibration judge: the directory's 96 are fewer
    # than --calib-samples 96 plus 32, so 32 are held out.
    assert report["quantization"]["calibration"]["samples"] == 64
    assert report["accuracy"]["samples"]["judged"] == 32
    assert report["accuracy"]["dataset"].startswith("32 held-out samples")
    assert any("64 calibrate and the last 32 judge" in warning for warning in report["warnings"])
    # The device classes it is for are in the signed manifest.
    from models.bundle import inspect_bundle

    bundle = next(out.glob("digits-*.bundle"))
    assert inspect_bundle(bundle)["manifest"]["targets"] == ["orin-nano-8gb", "orin-nx-16gb"]


def test_a_build_with_relative_paths(tmp_path, keys, digits_onnx, monkeypatch):
    # The README's commands use relative paths (--out out/); quantization's pre-processing runs
    # in the work directory, which once made them resolve a second time, under it.
    import shutil

    model_path, calib = digits_onnx
    shutil.copy(model_path, tmp_path / "digits.onnx")
    shutil.copytree(calib, tmp_path / "calib")
    shutil.copy(keys, tmp_path / "fleet.key")
    monkeypatch.chdir(tmp_path)
    assert main(["build", "--onnx", "digits.onnx", "--calib-dir", "calib", "--key", "fleet.key",
                 "--out", "out", "--calib-samples", "48", "--accuracy-budget", "5"]) == 0
    assert _outputs(tmp_path / "out") == {"digits-1.bundle", "report.json"}


def test_build_without_a_key_generates_one_beside_the_bundle(tmp_path):
    out = tmp_path / "out"
    assert main(["build", "--model", MODEL, "--out", str(out), *FAST]) == 0
    assert {"signing.key", "signing.key.pub"} <= _outputs(out)
    open_bundle(out / f"{MODEL}-1.bundle", [load_public_key(out / "signing.key.pub")])


def test_a_key_pair_made_meanwhile_by_another_build_is_used(tmp_path, monkeypatch):
    # Two builds into one fresh directory without --key: the later one signed with a pair it
    # could not write at the end ("key file already exists"), after all its work.
    import models.pipeline.orchestrate as pipeline
    from models.signing import write_keypair

    out = tmp_path / "out"
    real = pipeline._speed_report

    def another_build_finishes_first(*args, **kwargs):
        write_keypair(out / "signing.key")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_speed_report", another_build_finishes_first)
    assert main(["build", "--model", MODEL, "--out", str(out), *FAST]) == 0
    open_bundle(out / f"{MODEL}-1.bundle", [load_public_key(out / "signing.key.pub")])


def test_a_missing_public_key_beside_the_directorys_key_is_written(tmp_path):
    # The demo rebuilds with OUT/signing.key when the .pub went missing: without the .pub,
    # nothing could verify the new bundle.
    from models.signing import generate_private_key, write_private_key

    out = tmp_path / "out"
    out.mkdir()
    write_private_key(out / "signing.key", generate_private_key())
    assert main(["build", "--model", MODEL, "--out", str(out), *FAST]) == 0
    open_bundle(out / f"{MODEL}-1.bundle", [load_public_key(out / "signing.key.pub")])


def test_a_frame_the_host_has_no_memory_for_is_named_as_such(monkeypatch):
    import models.ort
    from agent.errors import ModelError
    from models.pipeline import BuildOptions, choose_engine_profile

    class OutOfMemory:  # has memory for frames of up to 64 x 64 pixels
        def run(self, outputs, feed, *options):
            if np.prod(next(iter(feed.values())).shape[2:]) > 64 * 64:
                raise RuntimeError("onnxruntime::BFCArena: std::bad_alloc")

    monkeypatch.setattr(models.ort, "create_session", lambda *args, **kwargs: OutOfMemory())
    meta = {"input_name": "input", "inputs": [("input", "float32", (3, 32, 32))],
            "layouts": {"input": "NCHW"}, "dynamic_hw": ["height", "width"]}
    options = BuildOptions(out_dir=Path("out"), onnx=Path("m.onnx"), calib_dir=Path("c"),
                           frame_size=(4096, 4096))
    with pytest.raises(ModelError, match=r"not enough memory to run the model at the deployment "
                                         r"frame \(input \[1, 3, 4096, 4096\]\); give a smaller "
                                         "--frame-size") as raised:
        choose_engine_profile(b"", meta, options)
    # The frame it names does run: it fits this host's memory, and is more than the samples'.
    height, width = map(int, re.search(r"e\.g\. --frame-size (\d+)x(\d+), which runs",
                                       str(raised.value)).groups())
    assert 32 * 32 < height * width <= 64 * 64


def test_a_failed_build_without_a_key_leaves_no_key_behind(tmp_path, capsys):
    out = tmp_path / "out"
    err = _fails(["build", "--onnx", str(tmp_path / "missing.onnx"), "--calib-dir", str(tmp_path),
                  "--out", str(out)], capsys)
    assert "ONNX model not found" in err
    assert _outputs(out) == set()


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be at least 1"),
    (["--prune", "0.5", "--finetune-epochs", "-1"], "--finetune-epochs must be at least 0"),
    (["--prune", "0.5", "--round-to", "0"], "--round-to must be at least 1"),
    (["--prune-target-macs", "-1"], "--prune-target-macs must be a positive"),
    (["--prune", "0.95"], "prune ratio must be in [0, 0.9]"),
    (["--prune", "0.5", "--prune-target-macs", "0.5"], "not both"),
    (["--prune", "0", "--prune-target-macs", "0.5"], "not both"),
    (["--max-batch", "5000"], "--max-batch must be at most 4096"),
    (["--accuracy-budget", "-1"], "--accuracy-budget must be in [0, 100]"),
    (["--accuracy-budget", "nan"], "--accuracy-budget must be in [0, 100]"),
    (["--calib-dir", "."], "--calib-dir is for --user-model and --onnx"),
    (["--calib-preprocess", "spec.json"], "--calib-preprocess needs --calib-dir"),
    (["--checkpoint", "weights.pt"], "--checkpoint is for --user-model"),
    (["--engine"], "TensorRT"),
])
def test_bad_build_settings_are_refused_before_any_work(tmp_path, args, message, capsys):
    out = tmp_path / "out"
    err = _fails(["build", "--model", MODEL, "--out", str(out), *args], capsys)
    assert message in err
    assert _outputs(out) == set()


def test_an_existing_bundle_version_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    existing = out / f"{MODEL}-1.bundle"
    existing.write_bytes(b"someone else's bundle")
    err = _fails(["build", "--model", MODEL, "--out", str(out), "--version", "1",
                  "--prune", "0.5"], capsys)
    assert "bundle already exists" in err
    assert existing.read_bytes() == b"someone else's bundle"
    assert _outputs(out) == {existing.name}


def test_a_bundle_that_appears_during_the_build_is_not_replaced(tmp_path, capsys, monkeypatch):
    """Two builds into one --out pick the same next version; the one that finishes second must
    fail rather than replace the first one's bundle, and it takes its new key pair with it."""
    from models.pipeline import orchestrate as pipeline

    out = tmp_path / "out"
    real_speed_report = pipeline._speed_report

    def speed_report_while_another_build_finishes(*args, **kwargs):
        (out / f"{MODEL}-1.bundle").write_bytes(b"the other build's bundle")
        return real_speed_report(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_speed_report", speed_report_while_another_build_finishes)
    err = _fails(["build", "--model", MODEL, "--out", str(out), *FAST], capsys)
    assert "bundle already exists" in err
    assert (out / f"{MODEL}-1.bundle").read_bytes() == b"the other build's bundle"
    assert _outputs(out) == {f"{MODEL}-1.bundle"}  # no key pair, report or temporary file


def test_pruning_that_removes_nothing_keeps_the_trained_weights(tmp_path, keys, capsys, caplog):
    # SmallCNN has no layer wider than 64 channels: rounding widths to 64 leaves nothing to cut.
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="models.pipeline"):
        assert main(["build", "--model", MODEL, "--key", str(keys), "--out", str(out), *FAST,
                     "--prune", "0.5", "--round-to", "64"]) == 0
    assert any("pruning removed no channels" in record.getMessage() for record in caplog.records)
    report = json.loads((out / "report.json").read_text())
    # Not fine-tuned: the "pruned" model is the trained checkpoint, so it scores the same.
    assert report["accuracy"]["pruned_fp32"] == report["accuracy"]["fp32_unpruned"]


def _fails(args: list[str], capsys) -> str:
    status = main(args)
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert status != 0
    errors = [line for line in err_lines if "error" in line.lower()]
    assert errors == [err_lines[-1]] and err_lines[-1].startswith("edge-agent: error:")
    return err_lines[-1]


def test_corrupt_and_truncated_onnx_are_refused_cleanly(tmp_path, keys, digits_onnx, capsys):
    model_path, calib = digits_onnx
    data = model_path.read_bytes()
    for name, content in (("garbage.onnx", b"this is not a model"), ("cut.onnx", data[: len(data) // 3])):
        bad = tmp_path / name
        bad.write_bytes(content)
        out = tmp_path / f"out-{name}"
        err = _fails(["build", "--onnx", str(bad), "--calib-dir", str(calib), "--key", str(keys),
                      "--out", str(out)], capsys)
        assert name in err
        assert _outputs(out) == set()  # nothing half-written, no staging directory left


def test_empty_calibration_set_is_refused(tmp_path, keys, digits_onnx, capsys):
    model_path, _ = digits_onnx
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    err = _fails(["build", "--onnx", str(model_path), "--calib-dir", str(empty), "--key", str(keys),
                  "--out", str(out)], capsys)
    assert "calibration set is empty" in err
    assert _outputs(out) == set()


def test_mismatched_input_names_are_refused(tmp_path, keys, digits_onnx, capsys):
    model_path, _ = digits_onnx
    calib = tmp_path / "calib"
    calib.mkdir()
    for index in range(4):
        np.savez(calib / f"s{index}.npz", image=np.zeros((3, 16, 16), np.float32))
    err = _fails(["build", "--onnx", str(model_path), "--calib-dir", str(calib), "--key", str(keys),
                  "--out", str(tmp_path / "out")], capsys)
    assert "input names" in err and "image" in err


@pytest.mark.parametrize("ratio", ["1.5", "-0.1", "1.0"])
def test_prune_ratio_out_of_range_is_refused(tmp_path, keys, ratio, capsys):
    out = tmp_path / "out"
    err = _fails(["build", "--model", MODEL, "--prune", ratio, "--key", str(keys), "--out", str(out)], capsys)
    assert "ratio" in err and ratio in err
    assert _outputs(out) == set()


def test_wrong_kind_of_key_is_refused(tmp_path, keys, capsys):
    out = tmp_path / "out"
    err = _fails(["build", "--model", MODEL, "--key", f"{keys}.pub", "--out", str(out)], capsys)
    assert "signing.key.pub" in err
    assert _outputs(out) == set()


def test_engine_option_puts_a_plan_for_this_device_in_the_bundle(tmp_path, keys, monkeypatch):
    """TensorRT is faked at its module seam and the GPU at the driver query; the rest is real."""
    import sys

    import models.engine.builder as builder
    from models.fingerprint import GpuModel
    from tests.fakes.fake_tensorrt import decode_plan, make_fake_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt("10.3.0.30"))
    monkeypatch.setattr(builder, "cuda_gpu_model", lambda: GpuModel("8.7", 16))
    out = tmp_path / "out"
    assert main(["build", "--model", MODEL, "--key", str(keys), "--out", str(out), *FAST, "--engine"]) == 0
    bundle = open_bundle(out / f"{MODEL}-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    (fingerprint, member), = bundle.manifest["engines"].items()
    assert fingerprint.startswith("trt10.3.0.30-sm87") and member == f"engines/{fingerprint}.plan"
    plan = decode_plan(bundle.read_member(member))
    assert plan["profiles"] == [
        {"input": {"min": [1, 3, 16, 16], "opt": [8, 3, 224, 224], "max": [32, 3, 448, 448]}}
    ]


def make_small_cnn():
    """A user's model factory, as ``--user-model tests.test_pipeline:make_small_cnn`` names it."""
    from models.zoo.small_cnn import SmallCNN

    return SmallCNN(num_classes=10)


def test_build_from_a_user_pytorch_model(tmp_path, keys, digits_onnx):
    from models.checkpoints import load_example

    _, calib = digits_onnx
    checkpoint = tmp_path / "user.pt"
    torch.save(load_example(MODEL).state_dict(), checkpoint)
    out = tmp_path / "out"
    assert main(["build", "--user-model", "tests.test_pipeline:make_small_cnn", "--checkpoint",
                 str(checkpoint), "--calib-dir", str(calib), "--key", str(keys), "--out", str(out),
                 "--calib-samples", "96"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["name"] == "make_small_cnn"
    assert report["accuracy"]["metric"] == "agreement"
    assert report["export"]["dynamic_spatial"]


def make_two_headed_cnn():
    """A user model with two outputs (a dict): logits and class probabilities."""
    from torch import nn

    class TwoHeaded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_small_cnn()

        def forward(self, x):
            logits = self.body(x)
            return {"logits": logits, "probabilities": logits.softmax(dim=1)}

    return TwoHeaded()


def test_build_from_a_user_model_with_two_outputs(tmp_path, keys, digits_onnx, capsys):
    from models.checkpoints import load_example

    _, calib = digits_onnx
    model = make_two_headed_cnn()
    model.body.load_state_dict(load_example(MODEL).state_dict())
    checkpoint = tmp_path / "two.pt"
    torch.save(model.state_dict(), checkpoint)
    out = tmp_path / "out"
    assert main(["build", "--user-model", "tests.test_pipeline:make_two_headed_cnn",
                 "--checkpoint", str(checkpoint), "--calib-dir", str(calib), "--key", str(keys),
                 "--out", str(out), "--calib-samples", "96"]) == 0
    bundle = open_bundle(out / "make_two_headed_cnn-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    assert [output["name"] for output in bundle.manifest["outputs"]] == ["logits", "probabilities"]
    # Each output is judged: the probabilities (a softmax) by their class, the logits beside
    # them as regression, by their cosine.
    report = json.loads((out / "report.json").read_text())
    assert [(output["name"], output["judged_by_budget"]) for output in report["accuracy"]["outputs"]] \
        == [("logits", True), ("probabilities", True)]
    assert all(output["sqnr_db"] > 10.0 for output in report["accuracy"]["outputs"])
    assert [(judge["output"], judge["judge"], judge["held"])
            for judge in report["accuracy"]["judges"]] == [("logits", "cosine", True),
                                                          ("probabilities", "classes", True)]
    table = capsys.readouterr().out.split("accuracy (")[1]
    assert "logits" in table and "probabilities" in table and ">= 0.99" in table
    # Both run in the INT8 model.
    from models.ort import create_session

    extracted = bundle.extract(tmp_path / "installed")
    images = np.load(sorted(calib.glob("*.npy"))[0])[None]
    logits, probabilities = create_session(extracted / "model.onnx").run(None, {"input": images})
    assert logits.shape == probabilities.shape == (1, 10)
    # The INT8 model rounds each probability to its output's quantization step (about 1/127 for
    # [0, 1]), so the sum is 1 only to within a few steps (0.992 on an AVX2 host).
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=0.04)
    assert int(logits.argmax()) == int(probabilities.argmax())


def test_user_checkpoint_that_does_not_fit_is_refused(tmp_path, keys, digits_onnx, capsys):
    from models.zoo.small_cnn import SmallCNN

    _, calib = digits_onnx
    checkpoint = tmp_path / "wide.pt"
    torch.save(SmallCNN(width=32).state_dict(), checkpoint)
    out = tmp_path / "out"
    err = _fails(["build", "--user-model", "tests.test_pipeline:make_small_cnn", "--checkpoint",
                  str(checkpoint), "--calib-dir", str(calib), "--key", str(keys), "--out", str(out)], capsys)
    assert "checkpoint does not match the model" in err
    assert _outputs(out) == set()


def test_build_from_onnx_calibrates_on_images_and_records_their_preprocessing(
        tmp_path, keys, digits_onnx):
    image_module = pytest.importorskip("PIL.Image")
    from sklearn.datasets import load_digits

    model_path, _ = digits_onnx
    calib = tmp_path / "frames"
    calib.mkdir()
    raw = load_digits().images[:96]  # real 8x8 digits, 0..16
    for index, digit in enumerate(raw):
        gray = (digit * (255.0 / 16.0)).astype(np.uint8)
        image_module.fromarray(np.stack([gray] * 3, axis=-1)).save(calib / f"d{index:03d}.png")
    spec = {"resize": [16, 16], "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
            "channel_order": "RGB"}
    (calib / "preprocessing.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    assert main(["build", "--onnx", str(model_path), "--calib-dir", str(calib), "--key", str(keys),
                 "--out", str(out), "--calib-samples", "64", "--json"]) == 0
    bundle = next(out.glob("*.bundle"))
    manifest = inspect_bundle(bundle)["manifest"]
    assert manifest["preprocessing"]["resize"] == [16, 16]
    assert manifest["preprocessing"]["mean"] == [0.5, 0.5, 0.5]
    # The first 64 images calibrate, the other 32 are held out to judge INT8.
    assert manifest["calibration"]["samples"] == 64
    assert manifest["accuracy"]["samples"]["judged"] == 32


# -- bad input found by probing the command line -------------------------------------------


def _rewritten(model_path: Path, tmp_path: Path, name: str, change) -> Path:
    model = onnx.load(str(model_path))
    change(model)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_models_the_build_cannot_quantize_are_refused_before_any_work(tmp_path, keys, digits_onnx,
                                                                      capsys):
    from onnx import TensorProto, helper

    model_path, calib = digits_onnx

    def int64_input(model):
        model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64

    def contrib_op(model):  # as ONNX Runtime's optimizer saves a fused model
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        model.graph.node.append(helper.make_node("Gelu", [model.graph.output[0].name], ["gelu"],
                                                 name="gelu0", domain="com.microsoft"))
        model.graph.output[0].name = "gelu"

    def quantized(model):  # a Q/DQ pair on the input, as a quantized export has them
        name = model.graph.input[0].name
        for node in model.graph.node:
            node.input[:] = ["dq" if value == name else value for value in node.input]
        model.graph.initializer.extend([helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
                                        helper.make_tensor("z", TensorProto.INT8, [], [0])])
        model.graph.node.insert(0, helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]))
        model.graph.node.insert(0, helper.make_node("QuantizeLinear", [name, "s", "z"], ["q"]))

    # An old opset and a constant batch are no longer refused (test_graph_fixes.py builds them).
    cases = {"int64": (int64_input, "floating-point inputs only"),
             "contrib": (contrib_op, "standard ONNX operators only"),
             "quantized": (quantized, "quantized already")}
    for name, (change, message) in cases.items():
        bad = _rewritten(model_path, tmp_path, f"{name}.onnx", change)
        out = tmp_path / f"out-{name}"
        err = _fails(["build", "--onnx", str(bad), "--calib-dir", str(calib), "--key", str(keys),
                      "--out", str(out)], capsys)
        assert message in err, err
        assert not out.exists()  # the build created it, and removed it again
    err = _fails(["build", "--onnx", str(tmp_path), "--calib-dir", str(calib), "--key", str(keys),
                  "--out", str(tmp_path / "out-dir")], capsys)
    assert "is a directory" in err


def test_output_directory_problems_are_one_line_errors(tmp_path, keys, digits_onnx, capsys):
    model_path, calib = digits_onnx
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    common = ["build", "--onnx", str(model_path), "--calib-dir", str(calib), "--key", str(keys)]
    assert "--out is not a directory" in _fails([*common, "--out", str(a_file)], capsys)
    assert "cannot create the output directory" in _fails([*common, "--out", str(a_file / "sub")],
                                                          capsys)
    # A public key without its private half: refused at once, no new key written beside it.
    out = tmp_path / "pub-only"
    out.mkdir()
    write_keypair(out / "other.key")
    (out / "other.key").rename(out / "elsewhere.key")
    (out / "other.key.pub").rename(out / "signing.key.pub")
    err = _fails(["build", "--onnx", str(model_path), "--calib-dir", str(calib), "--out", str(out)],
                 capsys)
    assert "public key but no private key" in err
    assert _outputs(out) == {"signing.key.pub", "elsewhere.key"}
    assert "--prune-target-macs" in _fails(["build", "--model", MODEL, "--prune-target-macs", "0",
                                            "--out", str(tmp_path / "o")], capsys)


def test_a_killed_builds_staging_directory_is_removed_by_the_next_build(tmp_path, keys):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    out = tmp_path / "out"
    stale = out / f".build-{dead.stdout.strip()}-abc"
    live = out / ".build-1-xyz"  # pid 1 is alive: another build's, left alone
    stale.mkdir(parents=True)
    live.mkdir()
    from models.pipeline.outdir import _prepare_out_dir

    assert _prepare_out_dir(out) is False
    assert not stale.exists() and live.exists()


def test_bad_calibration_samples_name_the_file(tmp_path, keys, digits_onnx, capsys):
    model_path, calib = digits_onnx
    sample = np.load(sorted(calib.glob("*.npy"))[0])
    for name, array, message in (("nan", np.full_like(sample, np.nan), "NaN or infinite"),
                                 ("empty", np.zeros((3, 0, 0), np.float32), "wrong shape|empty")):
        directory = tmp_path / name
        directory.mkdir()
        np.save(directory / "a.npy", sample)
        np.save(directory / "bad.npy", array)
        err = _fails(["build", "--onnx", str(model_path), "--calib-dir", str(directory),
                      "--key", str(keys), "--out", str(tmp_path / f"out-{name}")], capsys)
        assert "bad.npy" in err and any(part in err for part in message.split("|")), err
    spec = tmp_path / "spec.json"
    spec.write_text('{"resize": [16, 16], "mean": [0, 0, 0], "std": [1, 1, 1]}')
    err = _fails(["build", "--onnx", str(model_path), "--calib-dir", str(calib),
                  "--calib-preprocess", str(spec), "--key", str(keys),
                  "--out", str(tmp_path / "out-spec")], capsys)
    assert "used as they are" in err


def test_sigterm_during_a_build_removes_its_staging_directory(tmp_path, keys, digits_onnx):
    import os
    import signal
    import subprocess
    import sys
    import time

    model_path, calib = digits_onnx
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "-q", "build", "--onnx", str(model_path), "--calib-dir",
         str(calib), "--key", str(keys), "--out", str(out), *FAST],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    deadline = time.monotonic() + 120
    while not list(out.glob(".build-*")) and process.poll() is None:
        assert time.monotonic() < deadline, "the build never started staging"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err
    assert not out.exists()  # staging removed, and the directory the build made with it


# --- ONNX models from elsewhere: layouts and inputs ---------------------------------------------


def _export(model, inputs: dict[str, tuple[int, ...]], dynamic: dict[str, dict[int, str]],
            path: Path, output_axes: dict[int, str] | None = None) -> Path:
    """Export ``model`` the way other tools do (plain torch.onnx.export, no clean-up)."""
    import warnings

    model.eval()
    examples = tuple(torch.randn(shape) for shape in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
        torch.onnx.export(model, examples, str(path), dynamo=False, opset_version=17,
                          input_names=list(inputs), output_names=["scores"],
                          dynamic_axes={**dynamic, "scores": output_axes or {0: "batch"}})
    return path


class _ChannelsLast(torch.nn.Module):
    """An NHWC model as tf2onnx exports one: it transposes to channels-first first."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        features = torch.relu(self.conv(x.permute(0, 3, 1, 2)))
        return self.head(features.mean(dim=(2, 3)))


def _samples(directory: Path, shape: tuple[int, ...], count: int = 48) -> Path:
    rng = np.random.default_rng(0)
    return write_samples(directory, rng.standard_normal((count, *shape)).astype(np.float32))


def _build_onnx(model: Path, calib: Path, keys: Path, out: Path, *extra: str) -> dict:
    """Build ``model`` (48 calibration samples, a 5-point budget: random weights) and return the
    bundle's manifest."""
    assert main(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                 "--out", str(out), "--calib-samples", "48", "--accuracy-budget", "5",
                 *extra]) == 0
    return inspect_bundle(out / f"{model.stem}-1.bundle")["manifest"]


def test_an_nhwc_model_is_described_as_nhwc_with_ranges_on_its_height_and_width(tmp_path, keys):
    from agent.backends.base import ModelArtifacts
    from agent.backends.tensorrt import engine_build_config
    from models.engine import profile_shapes

    torch.manual_seed(0)
    model = _export(_ChannelsLast(), {"image": (2, 32, 32, 3)},
                    {"image": {0: "batch", 1: "height", 2: "width"}}, tmp_path / "nhwc.onnx")
    out = tmp_path / "out"
    manifest = _build_onnx(model, _samples(tmp_path / "c", (32, 32, 3)), keys, out,
                           "--frame-size", "224")
    assert manifest["inputs"][0]["layout"] == "NHWC"
    profile = manifest["engine_profile"]
    assert profile["height"] == profile["width"] == [32, 224, 448]
    report = json.loads((out / "report.json").read_text())
    assert report["speed"]["input_shape"] == [8, 224, 224, 3]  # timed at the deployment size
    # What a board does with it: the ranges land on axes 1 and 2 of the NHWC input.
    artifacts = ModelArtifacts(name="nhwc", version=1, directory=tmp_path, manifest=manifest,
                               engine_cache_dir=tmp_path / "engines")
    ranges, _ = profile_shapes({"image": [-1, -1, -1, 3]}, engine_build_config(artifacts, {}))
    assert ranges["image"].max == (32, 448, 448, 3)


def test_a_model_with_only_a_dynamic_height_gets_a_height_range(tmp_path, keys):
    model = _export(_small_cnn(), {"input": (2, 3, 32, 32)},
                    {"input": {0: "batch", 2: "height"}}, tmp_path / "tall.onnx")
    out = tmp_path / "out"
    # 24 held-out samples of a random-weight CNN: one changed class costs 4.2 points.
    manifest = _build_onnx(model, _samples(tmp_path / "c", (3, 32, 32)), keys, out,
                           "--accuracy-budget", "10")
    assert manifest["inputs"][0]["layout"] == "NCHW"
    # Without --frame-size, frames are deployed at the calibration samples' size.
    assert manifest["engine_profile"]["height"] == [32, 32, 64]
    assert "width" not in manifest["engine_profile"]
    assert json.loads((out / "report.json").read_text())["speed"]["input_shape"] == [8, 3, 32, 32]


def _small_cnn():
    from models.zoo.small_cnn import SmallCNN

    torch.manual_seed(0)
    return SmallCNN(num_classes=10)


class _TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.mix = torch.nn.Linear(8 + 4, 5)

    def forward(self, image, extra):
        pooled = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return self.mix(torch.cat([pooled, extra], dim=1))


def test_a_model_with_two_inputs_builds_from_npz_samples(tmp_path, keys):
    torch.manual_seed(0)
    model = _export(_TwoInputs(), {"image": (2, 3, 32, 32), "extra": (2, 4)},
                    {"image": {0: "batch"}, "extra": {0: "batch"}}, tmp_path / "two.onnx")
    calib = tmp_path / "c"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for index in range(48):
        np.savez(calib / f"{index:03d}.npz", image=rng.standard_normal((3, 32, 32)).astype(np.float32),
                 extra=rng.standard_normal(4).astype(np.float32))
    out = tmp_path / "out"
    manifest = _build_onnx(model, calib, keys, out)
    assert [(entry["name"], entry.get("layout")) for entry in manifest["inputs"]] == [
        ("image", "NCHW"), ("extra", None)]
    assert json.loads((out / "report.json").read_text())["speed"]["int8_img_s"] > 0


def test_a_4d_input_without_a_fixed_channel_axis_is_refused(tmp_path, keys, capsys):
    model = _export(_small_cnn(), {"input": (2, 3, 32, 32)},
                    {"input": {0: "batch", 1: "channels", 2: "height", 3: "width"}},
                    tmp_path / "nochannels.onnx")
    err = _fails(["build", "--onnx", str(model), "--calib-dir",
                  str(_samples(tmp_path / "c", (3, 32, 32))), "--key", str(keys),
                  "--out", str(tmp_path / "out")], capsys)
    assert "4-D input has no fixed channel axis" in err
    assert _outputs(tmp_path / "out") == set()


def test_missing_external_data_is_named_as_such(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from agent.errors import ModelError
    from models.onnx_model import load_onnx

    weight = numpy_helper.from_array(np.ones((8, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    (tmp_path / "m.data").unlink()
    with pytest.raises(ModelError, match="external data cannot be read"):
        load_onnx(tmp_path / "m.onnx")


# --- deployment frame sizes -------------------------------------------------------------------


class _Hourglass(torch.nn.Module):
    """Down twice, up twice, and a skip connection: takes only sizes divisible by 4."""

    def __init__(self, in_channels: int = 3) -> None:
        super().__init__()
        self.down = torch.nn.Sequential(torch.nn.Conv2d(in_channels, 8, 3, 2, 1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, 2, 1), torch.nn.ReLU())
        self.up = torch.nn.Upsample(scale_factor=4.0)
        self.head = torch.nn.Conv2d(8 + in_channels, 4, 1)

    def forward(self, x):
        return self.head(torch.cat([self.up(self.down(x)), x], dim=1))


_DENSE_AXES = {0: "batch", 2: "height", 3: "width"}


def test_a_frame_size_the_model_cannot_take_is_refused_before_calibration(tmp_path, keys, capsys):
    torch.manual_seed(0)
    model = _export(_Hourglass(), {"input": (2, 3, 32, 32)}, {"input": _DENSE_AXES},
                    tmp_path / "hourglass.onnx", output_axes=_DENSE_AXES)
    calib = _samples(tmp_path / "c", (3, 32, 32))
    args = ["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
            "--out", str(tmp_path / "out"), "--calib-samples", "48"]
    err = _fails([*args, "--frame-size", "30x32"], capsys)
    assert ("does not run at the deployment frame (input [1, 3, 30, 32]): its height must be a "
            "multiple of 4, not 30; give --frame-size 32x32, which runs") in err
    assert "Traceback" not in err
    assert _outputs(tmp_path / "out") == set()
    manifest = _build_onnx(model, calib, keys, tmp_path / "out", "--frame-size", "64x96",
                           "--accuracy-budget", "100")
    assert manifest["engine_profile"]["height"] == [32, 64, 128]
    assert manifest["engine_profile"]["width"] == [32, 96, 192]


class _ImageAndDepth(torch.nn.Module):
    """RGB and an aligned depth map, concatenated: both take any size, but the same one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Hourglass(in_channels=4)

    def forward(self, image, depth):
        return self.body(torch.cat([image, depth], dim=1))


def test_aligned_inputs_are_sized_together_at_the_frame_size(tmp_path, keys):
    torch.manual_seed(0)
    model = _export(_ImageAndDepth(), {"image": (2, 3, 32, 32), "depth": (2, 1, 32, 32)},
                    {"image": _DENSE_AXES, "depth": _DENSE_AXES}, tmp_path / "rgbd.onnx",
                    output_axes=_DENSE_AXES)
    calib = tmp_path / "c"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for index in range(48):
        np.savez(calib / f"{index:03d}.npz",
                 image=rng.standard_normal((3, 32, 32)).astype(np.float32),
                 depth=rng.uniform(0, 1, (1, 32, 32)).astype(np.float32))
    out = tmp_path / "out"
    _build_onnx(model, calib, keys, out, "--frame-size", "64", "--accuracy-budget", "100")
    assert json.loads((out / "report.json").read_text())["speed"]["input_shape"] == [8, 3, 64, 64]


def test_frame_size_is_refused_for_a_model_of_fixed_size(tmp_path, keys, digits_onnx, capsys):
    model = _export(_small_cnn(), {"input": (2, 3, 32, 32)}, {"input": {0: "batch"}},
                    tmp_path / "fixed.onnx")
    err = _fails(["build", "--onnx", str(model), "--calib-dir",
                  str(_samples(tmp_path / "c", (3, 32, 32))), "--key", str(keys),
                  "--out", str(tmp_path / "out"), "--frame-size", "64"], capsys)
    assert "--frame-size is for models whose input takes any height and width" in err


def test_the_host_engine_build_puts_an_nhwc_models_ranges_on_its_height_and_width(
        tmp_path, keys, monkeypatch):
    import sys

    import models.engine.builder as builder
    from models.fingerprint import GpuModel
    from tests.fakes.fake_tensorrt import decode_plan, make_fake_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt("10.3.0.30"))
    monkeypatch.setattr(builder, "cuda_gpu_model", lambda: GpuModel("8.7", 16))
    torch.manual_seed(0)
    model = _export(_ChannelsLast(), {"image": (2, 32, 32, 3)},
                    {"image": {0: "batch", 1: "height", 2: "width"}}, tmp_path / "nhwc.onnx")
    out = tmp_path / "out"
    manifest = _build_onnx(model, _samples(tmp_path / "c", (32, 32, 3)), keys, out, "--engine")
    bundle = open_bundle(out / "nhwc-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    plan = decode_plan(bundle.read_member(next(iter(manifest["engines"].values()))))
    assert plan["profiles"] == [
        {"image": {"min": [1, 32, 32, 3], "opt": [8, 32, 32, 3], "max": [32, 64, 64, 3]}}]


# --- judging agreement without labels ---------------------------------------------------------


class _Segmenter(torch.nn.Module):
    def __init__(self, classes: int, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(16, classes, 1))

    def forward(self, x):
        scores = self.body(x)
        return scores.permute(0, 2, 3, 1) if self.channels_last else scores


def test_a_channels_last_segmentation_output_is_judged_like_its_channels_first_twin(
        tmp_path, keys):
    torch.manual_seed(0)
    first = _Segmenter(5, channels_last=False)
    last = _Segmenter(5, channels_last=True)
    last.load_state_dict(first.state_dict())
    calib = _samples(tmp_path / "c", (3, 16, 16))
    reports = {}
    for name, model, axes in (("nchw", first, _DENSE_AXES),
                              ("nhwc", last, {0: "batch", 1: "height", 2: "width"})):
        path = _export(model, {"input": (2, 3, 16, 16)}, {"input": _DENSE_AXES},
                       tmp_path / f"{name}.onnx", output_axes=axes)
        _build_onnx(path, calib, keys, tmp_path / name, "--accuracy-budget", "100")
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())["accuracy"]
    assert "axis 3" in reports["nhwc"]["metric_description"]
    assert "axis 1" in reports["nchw"]["metric_description"]
    # The same weights and samples: the same share of positions keeps its class in INT8.
    assert reports["nhwc"]["int8_all_layers"] == pytest.approx(reports["nchw"]["int8_all_layers"],
                                                               abs=0.5)
    assert reports["nchw"]["int8_all_layers"] < 100.0  # random weights: some positions move


def test_a_binary_mask_is_judged_by_its_decision(tmp_path, keys):
    torch.manual_seed(0)
    path = _export(_Segmenter(1, channels_last=False), {"input": (2, 3, 16, 16)},
                   {"input": _DENSE_AXES}, tmp_path / "mask.onnx", output_axes=_DENSE_AXES)
    _build_onnx(path, _samples(tmp_path / "c", (3, 16, 16)), keys, tmp_path / "out",
                "--accuracy-budget", "100")
    accuracy = json.loads((tmp_path / "out" / "report.json").read_text())["accuracy"]
    assert accuracy["metric"] == "agreement"
    assert accuracy["metric_description"].startswith("F1 of the positions where output > 0")
    assert accuracy["int8_all_layers"] < 100.0  # argmax over one channel said 100 whatever changed


def test_unnamed_nodes_are_named_so_the_model_builds(tmp_path, keys, digits_onnx):
    model_path, calib = digits_onnx
    model = onnx.load(str(model_path))
    for node in model.graph.node:
        node.name = ""
    unnamed = tmp_path / "unnamed.onnx"
    onnx.save(model, str(unnamed))
    manifest = _build_onnx(unnamed, calib, keys, tmp_path / "out")
    assert manifest["precision"]["int8_layers"]


def test_calibration_images_follow_an_nhwc_models_layout(tmp_path, keys):
    image_module = pytest.importorskip("PIL.Image")
    torch.manual_seed(0)
    model = _export(_ChannelsLast(), {"image": (2, 16, 16, 3)},
                    {"image": {0: "batch", 1: "height", 2: "width"}}, tmp_path / "nhwc.onnx")
    calib = tmp_path / "frames"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for index in range(48):
        pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
        image_module.fromarray(pixels).save(calib / f"f{index:03d}.png")
    (calib / "preprocessing.json").write_text(json.dumps(
        {"resize": [16, 16], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}))
    manifest = _build_onnx(model, calib, keys, tmp_path / "out")
    assert manifest["preprocessing"]["layout"] == "NHWC"
    assert manifest["engine_profile"]["height"] == [16, 16, 32]


def make_branchy():
    from tests.torch_nets import Branchy

    torch.manual_seed(0)
    return Branchy()


def test_a_user_model_that_branches_on_its_input_is_refused_at_export(tmp_path, keys, capsys):
    # Tracing keeps the branch the first sample took; checking the export on several real
    # samples shows the others disagree, before a bundle could serve the wrong branch.
    rng = np.random.default_rng(0)
    samples = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    samples[::2] += 2.0
    samples[1::2] -= 2.0
    calib = write_samples(tmp_path / "c", samples)
    err = _fails(["build", "--user-model", "tests.test_pipeline:make_branchy", "--calib-dir",
                  str(calib), "--key", str(keys), "--out", str(tmp_path / "out")], capsys)
    assert "ONNX output differs from PyTorch" in err and "a branch or loop" in err
    assert _outputs(tmp_path / "out") == set()


# --- every output judged, the user's judges, the search's outcome --------------------------------


def _tiny_onnx(tmp_path: Path, layers: int) -> tuple[Path, Path]:
    """A chain of ``layers`` Gemm layers (tests.test_judges) and 48 calibration samples."""
    from tests.test_judges import _chain

    path = tmp_path / "chain.onnx"
    onnx.save(_chain(layers), str(path))
    rng = np.random.default_rng(0)
    return path, write_samples(tmp_path / "c", rng.standard_normal((48, 16)).astype(np.float32))


def test_an_output_metric_for_no_output_is_refused_with_the_outputs(tmp_path, keys, capsys):
    model, calib = _tiny_onnx(tmp_path, 2)
    err = _fails(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                  "--out", str(tmp_path / "out"), "--output-metric", "output=cosine"], capsys)
    assert "--output-metric names no output of the model" in err and "outputs=out" in err
    err = _fails(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                  "--out", str(tmp_path / "out"), "--output-metric", "out=l2"], capsys)
    assert "choose one of agreement, top1, decision, exact, cosine, sqnr, ignore" in err
    assert _outputs(tmp_path / "out") == set()


def test_a_build_that_keeps_every_layer_out_of_int8_is_refused_unless_allowed(tmp_path, keys,
                                                                              capsys):
    # One layer and an SQNR of 45 dB: INT8 gives about 22, FP16 about 70.
    model, calib = _tiny_onnx(tmp_path, 1)
    args = ["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
            "--calib-samples", "24", "--output-metric", "out=sqnr:45"]
    err = _fails([*args, "--out", str(tmp_path / "refused")], capsys)
    assert "no layer runs in INT8, so this is not an INT8 build" in err
    assert "--allow-no-int8" in err
    assert _outputs(tmp_path / "refused") == set()
    assert main([*args, "--out", str(tmp_path / "out"), "--allow-no-int8"]) == 0
    summary = capsys.readouterr().out
    assert "FP16 throughout" in summary and "INT8, mixed" not in summary
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["quantization"]["fp16_throughout"]
    assert report["quantization"]["int8_layer_count"] == 0
    assert any("FP16 throughout" in warning for warning in report["warnings"])
    assert any(line.startswith("warning  ") and "FP16 throughout" in line
               for line in summary.splitlines())
    [judge] = report["accuracy"]["judges"]
    assert (judge["output"], judge["judge"], judge["tolerance"]) == ("out", "sqnr", ">= 45.0 dB")
    assert judge["int8_all_layers"] < 45.0 <= judge["int8"] and judge["passed"]
    # The split: 24 calibrate, the other 24 judge.
    assert report["accuracy"]["samples"]["calibration"] == 24
    assert report["accuracy"]["samples"]["judged"] == 24


_TASK_METRIC = '''
import numpy as np

def direction(fp32, candidate, labels):
    assert labels is None
    a, b = fp32["out"], candidate["out"]
    return 100.0 * float(np.mean(np.sign(a) == np.sign(b)))

def broken(fp32, candidate, labels):
    raise KeyError("boxes")
'''


def test_a_users_evaluator_judges_the_build(tmp_path, keys, capsys, monkeypatch):
    (tmp_path / "task_metric.py").write_text(_TASK_METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, calib = _tiny_onnx(tmp_path, 3)
    args = ["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
            "--calib-samples", "24", "--accuracy-budget", "10"]
    assert main([*args, "--out", str(tmp_path / "out"), "--evaluator",
                 "task_metric:direction"]) == 0
    summary = capsys.readouterr().out
    accuracy = json.loads((tmp_path / "out" / "report.json").read_text())["accuracy"]
    assert accuracy["metric"] == "evaluator" and accuracy["fp32"] == 100.0
    first, automatic = accuracy["judges"]
    assert (first["judge"], first["held"], first["passed"]) == ("evaluator", True, True)
    assert first["description"] == "the evaluator task_metric:direction (higher is better)"
    assert automatic["output"] == "out" and not automatic["held"]
    assert "(all)" in summary and "evaluator" in summary  # its row in the judges' table
    err = _fails([*args, "--out", str(tmp_path / "broken"), "--evaluator", "task_metric:broken"],
                 capsys)
    assert "the evaluator 'task_metric:broken' failed: KeyError: 'boxes'" in err
    err = _fails([*args, "--out", str(tmp_path / "missing"), "--evaluator", "task_metric:gone"],
                 capsys)
    assert "cannot load the evaluator: module 'task_metric' has no attribute 'gone'" in err


def test_too_few_samples_to_calibrate_and_judge_are_refused(tmp_path, keys, capsys):
    model, _ = _tiny_onnx(tmp_path, 1)
    calib = write_samples(tmp_path / "few", np.ones((5, 16), np.float32))
    err = _fails(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                  "--out", str(tmp_path / "out")], capsys)
    assert "too few samples to calibrate INT8 and judge it on held-out ones" in err
    assert "found=5" in err


@pytest.mark.parametrize("files, asked, expected", [
    (600, 512, (512, 88)),   # the rest after --calib-samples
    (400, 48, (48, 256)),    # at most 256 judge
    (100, 48, (48, 52)),
    (96, 96, (64, 32)),      # fewer than asked + 32: 32 are held out
    (48, 512, (24, 24)),     # fewer than 64: half
])
def test_the_held_out_split_follows_its_rule(tmp_path, files, asked, expected):
    from models.onnx_model import TensorSpec
    from models.pipeline import BuildOptions
    from models.pipeline.sources import _split_samples

    calib = write_samples(tmp_path / "c", np.arange(files * 2, dtype=np.float32).reshape(files, 2))
    options = BuildOptions(out_dir=tmp_path / "out", onnx=tmp_path / "m.onnx", calib_dir=calib,
                           calib_samples=asked)
    calibration, held_out, samples = _split_samples(
        calib, [TensorSpec("x", "float32", (-1, 2), ("batch", ""))], options)
    assert (len(calibration), len(held_out)) == expected
    assert (samples["calibration"], samples["judged"]) == expected
    # The held-out samples follow the calibration ones: no sample does both.
    assert held_out.arrays["x"][0, 0] == calibration.arrays["x"][-1, 0] + 2
    assert bool(samples["warnings"]) == (files - asked < 32)


def test_a_build_keeping_most_layers_out_of_int8_says_so_with_its_speed():
    from models.pipeline.report import _warnings
    from models.quantize import QuantizeResult

    def result(kept_out: int, candidates: int) -> QuantizeResult:
        names = [f"conv{index}" for index in range(candidates)]
        return QuantizeResult(b"", "agreement", 100.0, 90.0, 99.5, names[kept_out:],
                              names[:kept_out], [], [], {}, {}, 100.0,
                              candidate_count=candidates, warnings=["from the search"])

    meta = {"samples": {"warnings": ["from the split"]}}
    [split, search, most] = _warnings(result(3, 4), meta, {"int8_speedup": 1.05})
    assert (split, search) == ("from the split", "from the search")
    assert most.startswith("3 of 4 layers (75%) are kept out of INT8")
    assert "runs at 1.05x the FP32 model's speed on this host" in most
    assert _warnings(result(2, 4), meta, {"int8_speedup": 1.8}) == ["from the split",
                                                                   "from the search"]


def test_a_tolerance_no_layer_set_meets_ends_the_build_at_once(tmp_path, keys, capsys):
    import time

    model, calib = _tiny_onnx(tmp_path, 4)
    started = time.perf_counter()
    status = main(["build", "--onnx", str(model), "--calib-dir", str(calib), "--key", str(keys),
                   "--out", str(tmp_path / "out"), "--calib-samples", "24",
                   "--output-metric", "out=sqnr:200"])
    assert status == 1 and time.perf_counter() - started < 60.0
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("edge-agent: error: the accuracy budget cannot be met even with every "
                           "layer kept out of INT8")
    assert "out: sqnr" in last and "needs >= 200.0 dB" in last and "most_sensitive=gemm" in last
    # The per-layer table went to the log before the error.
    assert "per-layer sensitivity (that layer alone in INT8), most sensitive first" in err
    assert _outputs(tmp_path / "out") == set()
