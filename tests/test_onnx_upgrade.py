"""The opset upgrade of old ONNX models (models/onnx_upgrade.py) and what check_float_model still
refuses: quantized models and operators outside the standard domain."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from agent.errors import ModelError  # noqa: E402
from models.onnx_model import check_float_model  # noqa: E402
from models.onnx_upgrade import CONVERSION_RTOL, TARGET_OPSET, default_opset, upgrade_opset  # noqa: E402
from tests.batch_models import classifier, per_activation_batchnorm, samples  # noqa: E402


def _run(model, images: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": images})[0]


def test_an_opset_11_model_is_converted_and_checked_against_the_original():
    old = classifier(opset=11)
    converted, report = upgrade_opset(old, samples(12))
    assert default_opset(converted) == TARGET_OPSET
    # Squeeze takes its axes as an input from opset 13: the converter rewrote the node.
    squeeze = next(node for node in converted.graph.node if node.op_type == "Squeeze")
    assert len(squeeze.input) == 2 and not squeeze.attribute
    assert report is not None
    assert (report["from_opset"], report["to_opset"], report["checked_samples"]) == (11, 17, 8)
    assert report["outputs"]["logits"]["max_rel_error"] <= CONVERSION_RTOL
    images = samples(3, seed=5)["images"]
    np.testing.assert_allclose(_run(converted, images), _run(old, images), rtol=1e-6, atol=1e-6)


def test_a_model_at_opset_13_or_newer_is_left_as_it_is():
    model = classifier(opset=13)
    same, report = upgrade_opset(model, samples(4))
    assert same is model and report is None


def test_a_node_the_converter_cannot_convert_is_named():
    with pytest.raises(ModelError) as caught:
        upgrade_opset(per_activation_batchnorm(), samples(4))
    error = caught.value
    assert error.fields["node"] == "bn" and error.fields["op_type"] == "BatchNormalization"
    assert "at node 'bn' (BatchNormalization)" in str(error)
    assert "opset 13 or newer" in str(error) and "\n" not in str(error)


def test_a_conversion_that_changes_an_output_is_refused(monkeypatch):
    from onnx import version_converter

    real = version_converter.convert_version

    def wrong_weights(model, target):  # a converter bug: one weight no longer what it was
        converted = real(model, target)
        for index, init in enumerate(converted.graph.initializer):
            if init.name == "fc_w":
                weights = numpy_helper.to_array(init).copy()
                weights[0, 0] += 1.0
                converted.graph.initializer[index].CopyFrom(numpy_helper.from_array(weights, "fc_w"))
        return converted

    monkeypatch.setattr(version_converter, "convert_version", wrong_weights)
    with pytest.raises(ModelError, match="computes another output 'logits' than the original"):
        upgrade_opset(classifier(opset=11), samples(8))


def test_a_constant_batch_model_is_checked_in_chunks_of_its_batch():
    converted, report = upgrade_opset(classifier(opset=11, batch=2, flatten_to=2), samples(5))
    assert report is not None and report["checked_samples"] == 4  # two whole chunks of 2
    assert default_opset(converted) == TARGET_OPSET


def _with_node(node, *, domain: str | None = None):
    model = classifier()
    model.graph.node.append(node)
    model.graph.output[0].name = node.output[0]
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def test_operators_outside_the_standard_domain_are_refused_by_name():
    model = _with_node(helper.make_node("Gelu", ["logits"], ["activated"], name="gelu0",
                                        domain="com.microsoft"), domain="com.microsoft")
    with pytest.raises(ModelError) as caught:
        check_float_model(model)
    assert caught.value.fields["node"] == "gelu0" and caught.value.fields["domain"] == "com.microsoft"
    assert "standard ONNX operators only" in str(caught.value)


def test_a_model_quantized_with_contrib_operators_is_refused_as_quantized():
    model = _with_node(helper.make_node("DynamicQuantizeLSTM", ["logits"], ["state"], name="lstm",
                                        domain="com.microsoft"), domain="com.microsoft")
    with pytest.raises(ModelError, match="quantized already"):
        check_float_model(model)


def test_float_inputs_only_are_still_required():
    model = classifier()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.UINT8
    with pytest.raises(ModelError, match="floating-point inputs only"):
        check_float_model(model)
