"""The batch axis, checked by running the model (models/batch_axis.py), and what follows from
it: calibration and evaluation in chunks of a fixed batch, and backends that pad a fixed batch
and cut outputs on their own batch axis (ONNX Runtime, and TensorRT on the strict fake)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from agent.backends.base import BackendOptions, ModelArtifacts  # noqa: E402
from agent.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from agent.batcher import Batcher, BatchPolicy  # noqa: E402
from agent.errors import BundleError, InputError, ModelError  # noqa: E402
from models.batch_axis import BATCH_DIM, check_batch, make_batch_dynamic  # noqa: E402
from models.manifest import validate_manifest  # noqa: E402
from models.quantize import all_model_outputs  # noqa: E402
from tests.batch_models import (  # noqa: E402
    MID,
    SIDE,
    classifier,
    glued_map,
    samples,
    save,
    sequence_scores,
)


def _settle(model, count: int = 6):
    data = samples(count)
    settled, trial = make_batch_dynamic(model, data)
    return settled, trial, check_batch(settled.SerializeToString(), data, trial)


def _run(model_bytes: bytes, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


# --- finding the batch -----------------------------------------------------------------------


def test_a_constant_batch_of_1_is_made_dynamic_where_the_graph_takes_any_batch():
    settled, trial, batch = _settle(classifier(batch=1))
    assert trial.made_dynamic and trial.declared == 1
    assert settled.graph.input[0].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    assert settled.graph.output[0].type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    assert (batch.fixed, batch.output_axes, batch.checked_batches) == (None, {"logits": 0}, (1, 2, 3))
    images = samples(4, seed=3)["images"]
    assert _run(settled.SerializeToString(), images).shape == (4, 3)


@pytest.mark.parametrize("model, reason", [
    (glued_map(1), "not the one-sample results"),  # runs at batch 2, rows glued into one
    (classifier(batch=1, flatten_to=1), "fails at batch 2"),  # the Gemm gets the wrong width
], ids=["glued", "failing"])
def test_a_reshape_that_bakes_in_batch_1_keeps_the_batch_fixed(model, reason):
    settled, trial, batch = _settle(model)
    assert settled is model and not trial.made_dynamic
    assert batch.fixed == 1 and batch.checked_batches == (1,)
    assert reason in (batch.reason or "")
    assert batch.to_report()["fixed"] == 1 and batch.to_report()["made_dynamic"] is False


def test_a_model_that_declares_a_dynamic_batch_it_cannot_take_is_built_for_batch_1():
    _, trial, batch = _settle(classifier(flatten_to=1))  # declared [N, 3, 8, 8]
    assert trial.declared is None
    assert batch.fixed == 1 and "fails at batch 2" in (batch.reason or "")


def test_a_fixed_batch_of_2_is_kept_and_its_output_axis_found_by_reversing_rows():
    _, trial, batch = _settle(glued_map(2))
    assert trial.declared == 2 and not trial.made_dynamic
    assert (batch.fixed, batch.output_axes, batch.checked_batches) == (2, {"map": 0}, (2,))


def test_a_sequence_output_has_its_batch_on_axis_1():
    _, _, batch = _settle(sequence_scores())
    assert batch.output_axes == {"scores": 1} and batch.fixed is None


def test_an_output_that_does_not_follow_the_batch_is_refused_by_name():
    from onnx import TensorProto, helper

    model = classifier()
    model.graph.node.append(helper.make_node("Shape", ["images"], ["shape"], name="shape"))
    model.graph.output.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [4]))
    data = samples(4)
    with pytest.raises(ModelError, match="does not follow the input batch") as caught:
        check_batch(model.SerializeToString(), data, make_batch_dynamic(model, data)[1])
    assert "'shape'" in str(caught.value) and "\n" not in str(caught.value)


# --- calibration and evaluation at a fixed batch ---------------------------------------------


def test_outputs_run_in_padded_chunks_of_the_fixed_batch_and_come_back_batch_first():
    model = glued_map(2).SerializeToString()
    images = samples(5)["images"]
    outputs = all_model_outputs(model, {"images": images}, fixed_batch=2)["map"]
    assert outputs.shape == (5, MID, SIDE * SIDE)
    last = _run(model, images[[4, 4]])[0]  # the padded last chunk, its padding dropped
    np.testing.assert_allclose(outputs[4], last, rtol=1e-6)
    np.testing.assert_allclose(outputs[:2], _run(model, images[:2]), rtol=1e-6)

    sequence = sequence_scores().SerializeToString()
    scores = all_model_outputs(sequence, {"images": images}, batch_size=2,
                               batch_axes={"scores": 1})["scores"]
    assert scores.shape == (5, SIDE, MID)  # [T, B, C] comes back as [B, T, C]
    np.testing.assert_allclose(scores[3], _run(sequence, images[3:4])[:, 0], rtol=1e-5, atol=1e-6)


# --- the manifest ----------------------------------------------------------------------------


def _manifest(**fields: Any) -> dict[str, Any]:
    manifest = {
        "schema_version": 1, "name": "m", "version": 1, "created_at": "2024-05-01T12:00:00Z",
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, 8, 8]}],
        "outputs": [{"name": "scores", "dtype": "float32", "shape": [8, -1, 4]}],
        "preprocessing": None, "precision": {"int8_layers": [], "fp16_layers": [], "fp32_layers": []},
        "max_batch": 2, "opt_batch": 2, "calibration": None, "accuracy": {},
        "artifacts": {"model.onnx": {"sha256": "0" * 64, "size": 1}},
        "engines": {}, "min_agent_version": "0.1.0",
    }
    manifest.update(fields)
    return manifest


def test_the_manifest_batch_fields_are_validated():
    validate_manifest(_manifest(fixed_batch=2, output_batch_axes={"scores": 1}))
    for fields, field in (({"fixed_batch": 4}, "fixed_batch"),  # not the max_batch
                          ({"fixed_batch": 0}, "fixed_batch"),
                          ({"output_batch_axes": {"other": 1}}, "output_batch_axes['other']"),
                          ({"output_batch_axes": {"scores": 3}}, "output_batch_axes['scores']")):
        with pytest.raises(BundleError) as caught:
            validate_manifest(_manifest(**fields))
        assert caught.value.fields["field"] == field


# --- serving ---------------------------------------------------------------------------------


def _artifacts(directory: Path, model: Any, **manifest: Any) -> ModelArtifacts:
    path = save(model, directory / "model.onnx")
    values = {"name": "batchtest", "version": 1, "max_batch": 8, "opt_batch": 2,
              "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, SIDE, SIDE]}]}
    values.update(manifest)
    return ModelArtifacts("batchtest", 1, path.parent, values, directory / "engines")


def _serve(artifacts: ModelArtifacts, requests: list[np.ndarray], max_batch: int
           ) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Submit ``requests`` together to a batcher over one ONNX Runtime backend; the answers and
    the batch sizes that ran."""
    sizes: list[int] = []

    class Counting(OnnxRuntimeBackend):
        def run(self, batch):
            sizes.append(batch.batch_size)
            return super().run(batch)

    backend = Counting(artifacts, BackendOptions(max_batch_size=max_batch, threads=1))
    backend.activate()

    async def main() -> list[Any]:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=backend.max_batch_size,
                                                 max_queue_delay_us=200_000))
        batcher.start()
        results = await asyncio.gather(*(batcher.submit({"images": rows}) for rows in requests))
        await batcher.stop()
        return results

    try:
        return [result.outputs for result in asyncio.run(main())], sizes
    finally:
        backend.deactivate()


def test_a_fixed_batch_2_model_serves_3_rows_padding_the_last_batch(tmp_path):
    model = glued_map(2)
    artifacts = _artifacts(tmp_path, model, max_batch=2, fixed_batch=2)
    images = samples(3, seed=4)["images"]
    answers, sizes = _serve(artifacts, [images[index:index + 1] for index in range(3)], 8)
    assert sizes == [2, 1]  # never more than the fixed batch; the 1 ran padded to 2
    model_bytes = model.SerializeToString()
    expected = np.concatenate([_run(model_bytes, images[:2]),
                               _run(model_bytes, np.concatenate([images[2:], np.zeros_like(images[2:])]))[:1]])
    for index, answer in enumerate(answers):
        assert answer["map"].shape == (1, MID, SIDE * SIDE)
        np.testing.assert_allclose(answer["map"][0], expected[index], rtol=1e-5, atol=1e-6)
    backend = OnnxRuntimeBackend(artifacts, BackendOptions(max_batch_size=8, threads=1))
    with backend:
        assert backend.max_batch_size == 2 and backend.inputs[0].shape == (-1, 3, SIDE, SIDE)
        with pytest.raises(InputError, match="larger than the backend's maximum"):
            backend.infer({"images": images})


def test_a_sequence_output_is_cut_into_requests_on_its_batch_axis(tmp_path):
    model = sequence_scores()
    artifacts = _artifacts(tmp_path, model, output_batch_axes={"scores": 1})
    images = samples(4, seed=2)["images"]
    answers, sizes = _serve(artifacts, [images[:1], images[1:3], images[3:]], 8)
    assert sizes == [4]
    reference = _run(model.SerializeToString(), images)  # [T, 4, C]
    for answer, rows in zip(answers, (slice(0, 1), slice(1, 3), slice(3, 4))):
        np.testing.assert_allclose(answer["scores"], reference[:, rows], rtol=1e-5, atol=1e-6)
    backend = OnnxRuntimeBackend(artifacts, BackendOptions(threads=1))
    with backend:
        assert backend.outputs[0].shape == (SIDE, -1, MID) and backend.outputs[0].batch_axis == 1
        assert backend.outputs[0].sample_shape == (SIDE, MID)


def test_the_tensorrt_backend_pads_to_a_static_fixed_batch(monkeypatch, tmp_path):
    from tests.fakes.onnx_models import qdq_conv_model
    from tests.fakes.trt_board import make_artifacts, make_board, reference

    board = make_board(monkeypatch, tmp_path)
    base = make_artifacts(tmp_path)
    path = qdq_conv_model(base.onnx_path, batch=2, height=16, width=16)  # the batch is static
    data = path.read_bytes()
    artifacts = dataclasses.replace(base, manifest={
        **base.manifest, "max_batch": 2, "opt_batch": 2, "fixed_batch": 2,
        "engine_profile": {"batch": [2, 2, 2]},
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, 16, 16], "layout": "NCHW"}],
        "artifacts": {"model.onnx": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}})
    rng = np.random.default_rng(5)
    with board.backend(artifacts, max_batch_size=8) as backend:
        assert backend.max_batch_size == 2 and backend.inputs[0].shape == (-1, 3, 16, 16)
        for rows in (1, 2, 1):
            images = rng.normal(size=(rows, 3, 16, 16)).astype(np.float32)
            padded = np.concatenate([images, np.zeros((2 - rows, 3, 16, 16), np.float32)])
            outputs = backend.infer({"images": images})
            assert outputs["features"].shape == (rows, 4, 16, 16)
            np.testing.assert_allclose(outputs["features"], reference(artifacts, padded)[:rows],
                                       rtol=1e-5, atol=1e-5)
    assert board.state.executions == 3
