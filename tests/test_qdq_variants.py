"""Mixed-precision variants derived from the fully quantized model (models/quantize/variants.py)
against what ONNX Runtime's quantize_static makes with the same nodes excluded."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
# Quantization is a host job: the device pass (Python 3.10, no torch) has an older ONNX Runtime
# whose quantization tools lack what the build uses.
pytest.importorskip("torch", reason="INT8 quantization runs on the host (the host extra)")
pytest.importorskip("onnxruntime")
import onnxruntime as ort  # noqa: E402

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from agent.errors import InternalError  # noqa: E402
from models.calibration import from_array  # noqa: E402
from models.quantize import (  # noqa: E402
    QdqQuantizer,
    QuantizeConfig,
    check_qdq_format,
    cosine_similarity,
    quantized_layers,
)
from models.quantize.evaluate import all_model_outputs  # noqa: E402
from models.quantize.qdq import check_qdq_graph  # noqa: E402


def _branchy_model() -> bytes:
    """Two convolutions on one ReLU's output joined by an Add, a residual Add back to that
    output (which so feeds three layers), max-pooling, and two heads: a 1x1 convolution whose
    output is a model output, and pooling into a Gemm (transposed weights) and a MatMul; the
    Gemm's output also feeds a Sub (an op quantize_static does not quantize) into a MatMul."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.normal(scale=0.4, size=shape).astype(np.float32), name)

    initializers = [weight("w1", 4, 3, 3, 3), weight("b1", 4), weight("w2", 4, 4, 3, 3),
                    weight("b2", 4), weight("w3", 4, 4, 1, 1), weight("w4", 2, 4, 1, 1),
                    weight("b4", 2), weight("wg", 6, 4), weight("bg", 6), weight("wm", 6, 5),
                    weight("centre", 6), weight("wo", 6, 3)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1_out"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1_out"], ["t"], name="r1"),
        helper.make_node("Conv", ["t", "w2", "b2"], ["a"], name="c2", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["t", "w3"], ["b"], name="c3"),
        helper.make_node("Add", ["a", "b"], ["s"], name="add1"),
        helper.make_node("Add", ["s", "t"], ["u"], name="add2"),
        helper.make_node("MaxPool", ["u"], ["w"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["w", "w4", "b4"], ["heatmap"], name="c4"),
        helper.make_node("GlobalAveragePool", ["w"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["h"], name="gemm", transB=1),
        helper.make_node("MatMul", ["h", "wm"], ["logits"], name="mm"),
        helper.make_node("Sub", ["h", "centre"], ["centred"], name="sub"),
        helper.make_node("MatMul", ["centred", "wo"], ["offsets"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("heatmap", TensorProto.FLOAT, ["n", 2, 4, 4]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 5]),
         helper.make_tensor_value_info("offsets", TensorProto.FLOAT, ["n", 3])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


SAMPLES = np.random.default_rng(1).normal(size=(48, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def quantizer(tmp_path_factory):
    return QdqQuantizer(_branchy_model(), from_array(SAMPLES, "x", 48),
                        QuantizeConfig(method="entropy", entropy_min_values=0, progress=False),
                        tmp_path_factory.mktemp("variants"))


def _dequantized_inputs(model_bytes: bytes) -> dict[str, list[tuple[int, float | None]]]:
    """For each node that is not Q/DQ: its inputs that a DequantizeLinear produces, each with
    its scale (per-tensor scales; None for per-channel ones)."""
    model = onnx.load_from_string(model_bytes)
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    found = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        inputs = []
        for index, name in enumerate(node.input):
            producer = producers.get(name)
            if producer is not None and producer.op_type == "DequantizeLinear":
                scale = initializers[producer.input[1]]
                inputs.append((index, float(scale) if scale.shape == () else None))
        found[node.name] = inputs
    return found


EXCLUSIONS = [["c1"], ["c2"], ["c2", "c3"], ["add1"], ["add2"], ["c4"], ["gemm"], ["mm"],
              ["c1", "add2", "gemm"], ["add1", "add2", "c4", "gemm"]]


@pytest.mark.parametrize("excluded", EXCLUSIONS, ids="+".join)
def test_a_derived_variant_quantizes_what_quantize_static_does(quantizer, excluded):
    expanded = quantizer.expand_exclusions(excluded)
    derived = quantizer.quantize(exclude=excluded)
    reference = quantizer.quantize_with_ort(exclude=expanded)
    check_qdq_format(derived)
    assert quantized_layers(derived, kept_out=expanded) == quantized_layers(reference,
                                                                            kept_out=expanded)
    ours, theirs = _dequantized_inputs(derived), _dequantized_inputs(reference)
    assert ours.keys() == theirs.keys()
    for node in ours:
        if node in expanded:
            assert ours[node] == []  # an excluded node reads float tensors only
        elif node != "sub":  # never quantized: see the test below
            # The same inputs dequantized, with the same scales, for every node left quantized.
            assert ours[node] == theirs[node], node
    inputs = {"x": SAMPLES}
    derived_outputs = all_model_outputs(derived, inputs, threads=1)
    reference_outputs = all_model_outputs(reference, inputs, threads=1)
    # quantize_static may leave an excluded node reading INT8 values (see below); where it does
    # not, the two models compute the same.
    same_graph = all(theirs[node] == [] for node in (*expanded, "sub")) or ours == theirs
    for name, expected in reference_outputs.items():
        if same_graph:
            np.testing.assert_array_equal(derived_outputs[name], expected)
        else:
            assert cosine_similarity(expected, derived_outputs[name]) > 0.99, name


def test_an_excluded_nodes_inputs_are_float_where_quantize_static_leaves_them_int8(quantizer):
    """quantize_static shares one Q/DQ pair among all consumers of a tensor when only one of
    them is quantized: with the residual Add excluded, the Add still reads both of its inputs
    dequantized. The derived variant reads them in float; both keep the Add out of the INT8
    layers once it is named as kept out."""
    reference = quantizer.quantize_with_ort(exclude=["add1"])
    derived = quantizer.quantize(exclude=["add1"])
    assert "add1" in quantized_layers(reference)
    assert "add1" not in quantized_layers(derived)
    assert quantized_layers(reference, kept_out=["add1"]) == quantized_layers(derived)


def test_a_node_never_quantized_reads_float_from_an_excluded_producer(quantizer):
    # The Gemm quantizes its output for the MatMul, and quantize_static lets the Sub, which it
    # does not quantize, read that dequantized output too; it still does with the Gemm excluded
    # (the MatMul still quantizes its input). The Sub reads the Gemm's float output then.
    assert _dequantized_inputs(quantizer.quantize())["sub"] == [
        (0, pytest.approx(_dequantized_inputs(quantizer.quantize())["mm"][0][1]))]
    assert _dequantized_inputs(quantizer.quantize_with_ort(exclude=["gemm"]))["sub"] != []
    assert _dequantized_inputs(quantizer.quantize(exclude=["gemm"]))["sub"] == []
    # With the MatMul excluded instead, the Gemm (still INT8) quantizes its output as before.
    assert _dequantized_inputs(quantizer.quantize(exclude=["mm"]))["sub"] != []


def test_nothing_excluded_is_the_fully_quantized_model(quantizer):
    full = quantizer.quantize()
    assert full == quantizer.quantize_with_ort()
    assert set(quantized_layers(full)) == {name for name, _ in quantizer.candidates}


def test_excluding_every_layer_leaves_no_quantization_at_all(quantizer):
    model_bytes = quantizer.quantize(exclude=[name for name, _ in quantizer.candidates])
    check_qdq_format(model_bytes)
    model = onnx.load_from_string(model_bytes)
    assert not [node for node in model.graph.node
                if node.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert quantized_layers(model_bytes) == []
    # Only the float weights remain, no scale or zero point.
    assert {init.name for init in model.graph.initializer} == {
        init.name for init in onnx.load_from_string(_branchy_model()).graph.initializer}
    inputs = {"x": SAMPLES}
    for name, expected in all_model_outputs(_branchy_model(), inputs, threads=1).items():
        np.testing.assert_allclose(all_model_outputs(model_bytes, inputs, threads=1)[name],
                                   expected, rtol=1e-5, atol=1e-5)


def test_a_model_output_quantized_for_an_excluded_layer_is_float_again(quantizer):
    def producer_of(model_bytes, name):
        model = onnx.load_from_string(model_bytes)
        return next(node for node in model.graph.node if name in node.output)

    assert producer_of(quantizer.quantize(), "heatmap").op_type == "DequantizeLinear"
    derived = quantizer.quantize(exclude=["c4"])
    assert producer_of(derived, "heatmap").name == "c4"
    assert [output.name for output in onnx.load_from_string(derived).graph.output] == [
        "heatmap", "logits", "offsets"]


def test_a_relu_after_an_excluded_layer_is_left_in_float_as_quantize_static_leaves_it(quantizer):
    # quantize_static quantizes a ReLU only when its input is quantized already: with c1 in
    # float nothing quantizes c1's output, so r1 reads it in float and t is quantized for its
    # consumers, once, after the ReLU.
    for model_bytes in (quantizer.quantize(exclude=["c1"]),
                        quantizer.quantize_with_ort(exclude=quantizer.expand_exclusions(["c1"]))):
        assert _dequantized_inputs(model_bytes)["r1"] == []
        assert [index for index, _ in _dequantized_inputs(model_bytes)["c2"]] == [0, 1]


def test_a_pooling_left_in_float_no_longer_passes_its_input_scale_on(quantizer):
    # In the full model the max-pooling's output takes the scale of its input (the residual
    # Add's output); with the Add excluded, quantize_static leaves the pooling in float and
    # quantizes its output for the 1x1 convolution with that tensor's own scale.
    full = _dequantized_inputs(quantizer.quantize())["c4"][0]
    derived = _dequantized_inputs(quantizer.quantize(exclude=["add2"]))["c4"][0]
    reference = _dequantized_inputs(quantizer.quantize_with_ort(exclude=["add2"]))["c4"][0]
    assert derived == reference != full


def test_a_weight_quantized_per_channel_on_the_wrong_axis_is_caught(quantizer):
    model = onnx.load_from_string(quantizer.quantize())
    check_qdq_graph(model)
    weight_dq = next(node for node in model.graph.node
                     if node.op_type == "DequantizeLinear" and node.output[0].startswith("wm"))
    axis = next(attribute for attribute in weight_dq.attribute if attribute.name == "axis")
    assert axis.i in (1, -1)  # MatMul weight [6, 5]: per output column
    axis.i = 0
    with pytest.raises(InternalError, match="MatMul weight wm quantized per channel on axis 0"):
        check_qdq_graph(model)


def test_unnamed_and_duplicate_named_nodes_get_names_of_their_own(tmp_path):
    """Exporters leave nodes unnamed (an orientation classifier from PyPI has 56): every layer
    still gets a unique name, so the plan can keep any one out of INT8."""
    model = onnx.load_from_string(_branchy_model())
    model.graph.node[0].name = ""  # c1
    model.graph.node[2].name = ""  # c2
    model.graph.node[3].name = "c4"  # c3 takes the name of a later layer
    quantizer = QdqQuantizer(model.SerializeToString(), from_array(SAMPLES, "x", 48),
                             QuantizeConfig(method="minmax", progress=False), tmp_path)
    names = [node.name for node in quantizer.float_model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    layers = [name for name, _ in quantizer.candidates]
    assert len(layers) == 9 and "c4" in layers and "" not in layers
    inputs = _dequantized_inputs(quantizer.quantize(exclude=[layers[0]]))
    assert inputs[layers[0]] == []
    assert all(inputs[name] for name in layers[1:3])


def _detector_head_model() -> bytes:
    """A YOLOv8-like tail: a convolution's boxes scaled to pixels (x 300) concatenated with a
    sigmoid's class scores, which are almost all near 0 and now and then near 1."""
    rng = np.random.default_rng(2)
    initializers = [
        numpy_helper.from_array(rng.normal(scale=0.3, size=(4, 3, 1, 1)).astype(np.float32), "wb"),
        numpy_helper.from_array(np.abs(rng.normal(scale=0.3, size=(2, 3, 1, 1))).astype(np.float32) + 0.2,
                                "ws"),
        numpy_helper.from_array(np.array([-6.0, -6.0], np.float32).reshape(1, 2, 1, 1), "bias"),
        numpy_helper.from_array(np.array(300.0, np.float32), "pixels"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "wb"], ["b"], name="box_conv"),
        helper.make_node("Mul", ["b", "pixels"], ["boxes"], name="to_pixels"),
        helper.make_node("Conv", ["x", "ws"], ["s0"], name="score_conv"),
        helper.make_node("Add", ["s0", "bias"], ["s1"], name="score_bias"),
        helper.make_node("Sigmoid", ["s1"], ["scores"], name="sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["out"], name="head", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 6, 8, 8])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_detectors_scores_survive_int8_beside_boxes_in_pixels(tmp_path):
    """Concatenated with boxes in pixels, the scores would share the boxes' scale (about 5 a
    step) and round to 0: the Concat stays float."""
    from models.quantize.qdq import mismatched_concats  # noqa: PLC0415

    rng = np.random.default_rng(3)
    samples = rng.normal(size=(64, 3, 8, 8)).astype(np.float32)
    samples[::8, :, 2, 2] += 12.0  # one position in every eighth sample scores high
    model = _detector_head_model()
    quantizer = QdqQuantizer(model, from_array(samples[:48], "x", 48),
                             QuantizeConfig(method="entropy", progress=False), tmp_path)
    quantized = quantizer.quantize()
    assert mismatched_concats(quantizer.float_model, quantizer._activation_scales()) == ["head"]
    assert _dequantized_inputs(quantized)["head"] == []
    assert _dequantized_inputs(quantized)["box_conv"]  # the rest is still INT8

    def run(model_bytes):
        session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
        return session.run(None, {"x": samples[48:]})[0]

    want, got = run(model), run(quantized)
    high = want[:, 4:] > 0.5
    assert high.any()
    assert np.abs(got[:, 4:][high] - want[:, 4:][high]).max() < 0.05
