"""Builds of ONNX models as they are published: an old opset is converted, a constant batch made
dynamic where the graph allows it, and a graph that bakes its batch in is built and served for
that batch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
# `edge-agent build` needs the host extra (torch), which the device-side pass on Python 3.10 lacks.
pytest.importorskip("torch", reason="edge-agent build needs the host extra")

from agent.backends.base import BackendOptions, ModelArtifacts  # noqa: E402
from agent.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from agent.cli import main  # noqa: E402
from models.bundle import open_bundle  # noqa: E402
from models.signing import load_public_key, write_keypair  # noqa: E402
from tests.batch_models import classifier, glued_map, samples, save  # noqa: E402
from tests.helpers import write_samples  # noqa: E402


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "signing.key"
    write_keypair(path)
    return path


def _build(model, tmp_path: Path, keys: Path, *extra: str) -> tuple[dict, dict, Path]:
    """Build ``model`` from 24 calibration samples (min-max ranges: the quickest); the manifest,
    the report and the bundle."""
    path = save(model, tmp_path / "model" / "tiny.onnx")
    calib = write_samples(tmp_path / "calib", samples(24)["images"])
    out = tmp_path / "out"
    assert main(["build", "--onnx", str(path), "--calib-dir", str(calib), "--key", str(keys),
                 "--out", str(out), "--calib-samples", "24", "--accuracy-budget", "5",
                 "--threads", "1", "--calib-method", "minmax", *extra]) == 0
    bundle = open_bundle(out / "tiny-1.bundle", [load_public_key(Path(f"{keys}.pub"))])
    return bundle.manifest, json.loads((out / "report.json").read_text()), out / "tiny-1.bundle"


def test_an_opset_11_model_with_a_constant_batch_is_converted_made_dynamic_and_built(tmp_path, keys):
    manifest, report, _ = _build(classifier(opset=11, batch=1), tmp_path, keys)
    conversion = report["conversion"]
    assert (conversion["from_opset"], conversion["to_opset"]) == (11, 17)
    assert conversion["outputs"]["logits"]["max_rel_error"] <= conversion["tolerance_relative"]
    assert report["batch"] == {"declared": 1, "fixed": None, "made_dynamic": True,
                               "output_axes": {"logits": 0}, "checked_batches": [1, 2, 3],
                               "fixed_because": None}
    assert manifest["inputs"][0]["shape"] == [-1, 3, 8, 8]
    assert (manifest["max_batch"], manifest["opt_batch"]) == (32, 8)
    assert "fixed_batch" not in manifest and manifest["engine_profile"]["batch"] == [1, 8, 32]
    assert manifest["precision"]["int8_layers"]  # per-channel INT8 on the converted opset


@pytest.mark.parametrize("fixed", [1, 2])
def test_a_graph_that_bakes_its_batch_in_is_built_and_served_for_that_batch(tmp_path, keys, fixed,
                                                                            caplog):
    with caplog.at_level(logging.WARNING):
        manifest, report, bundle_path = _build(glued_map(fixed), tmp_path, keys,
                                               "--max-batch", "16")
    assert report["batch"]["fixed"] == fixed and report["batch"]["made_dynamic"] is False
    assert "not the one-sample results" in report["batch"]["fixed_because"]
    assert (manifest["fixed_batch"], manifest["max_batch"], manifest["opt_batch"]) == (fixed,) * 3
    assert manifest["engine_profile"]["batch"] == [fixed] * 3
    warning = next(text for text in report["warnings"] if "runs at batch" in text)
    assert f"built for batch {fixed}" in warning and "--max-batch 16" in warning
    assert any(f"runs at batch {fixed} only" in record.message for record in caplog.records)
    assert report["speed"]["input_shape"][0] == fixed
    # 24 samples in the directory: 12 calibrate, 12 are held out to judge INT8.
    assert report["quantization"]["calibration"]["samples"] == 12

    # The daemon's ONNX Runtime backend serves it: a request of one row, padded to the batch.
    installed = open_bundle(bundle_path, [load_public_key(Path(f"{keys}.pub"))]).extract(
        tmp_path / "installed")
    artifacts = ModelArtifacts("tiny", 1, installed, manifest, tmp_path / "engines")
    images = samples(2, seed=9)["images"]
    from models.ort import create_session

    session = create_session(installed / "model.onnx")  # as the backend makes it (ReLUs folded)
    padded = np.concatenate([images[:1], np.zeros((fixed - 1, *images.shape[1:]), np.float32)])
    expected = session.run(None, {"images": padded})[0][:1]
    with OnnxRuntimeBackend(artifacts, BackendOptions(max_batch_size=16, threads=1)) as backend:
        assert backend.max_batch_size == fixed
        served = backend.infer({"images": images[:1]})["map"]
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
