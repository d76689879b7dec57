from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import numpy_helper  # noqa: E402

from agent.errors import ConfigError  # noqa: E402
from models.calibration import from_array  # noqa: E402
from models.data import load_digits_splits  # noqa: E402
from models.export import export_onnx  # noqa: E402
from models.quantize import (  # noqa: E402
    Evaluator,
    all_model_outputs,
    check_qdq_format,
    QdqQuantizer,
    QuantizeConfig,
    quantize_model,
    quantized_layers,
    search_mixed_precision,
)
from models.train import TrainConfig, train  # noqa: E402
from models.zoo.small_cnn import SmallCNN  # noqa: E402

SIZE = 16


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(SIZE)


@pytest.fixture(scope="module")
def trained_onnx(digits):
    torch.manual_seed(0)
    model = train(SmallCNN(), digits[0], TrainConfig(epochs=4), progress=False)
    return export_onnx(model, torch.from_numpy(digits[0].images[:2])).model_bytes


def _qdq_facts(model_bytes: bytes):
    model = onnx.load_from_string(model_bytes)
    initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    return model, initializers, producers


def test_int8_model_has_the_format_tensorrt_needs(digits, trained_onnx, tmp_path):
    train_split, held_out = digits
    calibration = from_array(train_split.images, "input", 256)
    quantizer = QdqQuantizer(trained_onnx, calibration, QuantizeConfig(method="minmax", progress=False),
                             tmp_path)
    model, initializers, producers = _qdq_facts(quantizer.quantize())
    q_nodes = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert q_nodes
    for node in q_nodes:
        zero_point = initializers[node.input[2]]
        assert zero_point.dtype == np.int8 and not zero_point.any()
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 4
    for conv in convs:
        weight_dq = producers[conv.input[1]]
        assert weight_dq.op_type == "DequantizeLinear"
        weight_q = producers[weight_dq.input[0]]
        assert weight_q.op_type == "QuantizeLinear"
        weight = initializers[weight_q.input[0]]
        assert weight.dtype == np.float32  # float weights behind Q/DQ (TensorRT 8.5 parser)
        scales = initializers[weight_q.input[1]]
        assert scales.shape == (weight.shape[0],)  # per output channel
        if len(conv.input) > 2:
            assert conv.input[2] in initializers  # float bias, no INT32 DequantizeLinear
            assert initializers[conv.input[2]].dtype == np.float32
        activation_dq = producers[conv.input[0]]
        assert activation_dq.op_type == "DequantizeLinear"
        assert initializers[activation_dq.input[1]].shape == ()  # per-tensor activations


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_calibration_takes_any_sample_count(digits, trained_onnx, tmp_path, method):
    # 100 samples do not split into batches of 32; ONNX Runtime's histogram collectors used to
    # fail on the short last batch (and 1,000, the top of the recommended range, did too).
    train_split, _ = digits
    quantizer = QdqQuantizer(trained_onnx, from_array(train_split.images, "input", 100),
                             QuantizeConfig(method=method, progress=False), tmp_path)
    assert quantized_layers(quantizer.quantize())


def test_calibration_methods_give_different_ranges(digits, trained_onnx, tmp_path):
    calibration = from_array(digits[0].images, "input", 256)
    scales = {}
    for method in ("minmax", "entropy", "percentile"):
        quantizer = QdqQuantizer(trained_onnx, calibration, QuantizeConfig(method=method, progress=False),
                                 tmp_path / method)
        model, initializers, _ = _qdq_facts(quantizer.quantize())
        scales[method] = {
            n.input[0]: float(initializers[n.input[1]]) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and initializers[n.input[1]].shape == ()
        }
    # Min-max keeps every outlier: no tensor gets a smaller range from it, and some a larger one.
    for method in ("entropy", "percentile"):
        assert scales[method].keys() == scales["minmax"].keys()
        assert all(scales["minmax"][t] >= scales[method][t] * 0.999 for t in scales[method])
        assert any(scales["minmax"][t] > scales[method][t] * 1.05 for t in scales[method])
    assert scales["entropy"] != scales["percentile"]


def test_accurate_model_stays_fully_int8_within_budget(digits, trained_onnx, tmp_path):
    train_split, held_out = digits
    evaluator = Evaluator({"input": held_out.images}, held_out.labels)
    result = quantize_model(trained_onnx, from_array(train_split.images, "input", 512), evaluator,
                            QuantizeConfig(progress=False), tmp_path)
    assert result.float_metric > 85.0
    assert result.drop <= 1.0
    assert result.fp16_layers == []
    assert set(result.int8_layers) == {name for name, _ in QdqQuantizer(
        trained_onnx, from_array(train_split.images, "input", 8), QuantizeConfig(progress=False),
        tmp_path / "again").candidates}
    assert result.candidate_count == 6  # 4 convs, the residual add, the classifier
    # Fully INT8 passed: one evaluation, no per-layer sensitivity needed.
    assert len(result.search_trace) == 1 and result.sensitivity == []
    assert result.calibration["samples"] == 512
    [judge] = result.judges
    assert (judge["judge"], judge["passed"], judge["fp32"]) == ("top1", True,
                                                                round(result.float_metric, 4))
    # Calibration, the one quantize_static call, and deriving every variant the search tried.
    assert {"calibration_s", "quantize_static_s", "variants_s"} <= result.seconds.keys()
    [output] = result.outputs
    assert output.name == onnx.load_from_string(trained_onnx).graph.output[0].name
    assert output.judged and output.sqnr_db > 15.0 and output.cosine > 0.98


def _two_output_model(noise: float) -> bytes:
    """``a = x + 1`` and ``b = 2x + noise``: as a stand-in INT8 model, the second output differs
    from its float twin by a known amount."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["a"]),
         helper.make_node("Mul", ["x", "two"], ["doubled"]),
         helper.make_node("Add", ["doubled", "noise"], ["b"])],
        "two_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 4])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.full(4, noise, np.float32), "noise")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_every_output_is_compared_with_fp32_and_unjudged_poor_ones_are_warned_about(caplog):
    from models.quantize import fidelity, warn_about_unjudged_outputs

    x = np.random.default_rng(0).standard_normal((300, 4)).astype(np.float32)
    reference = all_model_outputs(_two_output_model(0.0), {"x": x}, threads=1)
    first, second = fidelity(reference, all_model_outputs(_two_output_model(0.5), {"x": x},
                                                          threads=1), judged={"a"})
    assert (first.name, first.judged, first.sqnr_db) == ("a", True, float("inf"))
    expected = 10 * np.log10(np.sum((2.0 * x.astype(np.float64)) ** 2) / (0.25 * x.size))
    assert (second.name, second.judged) == ("b", False)
    assert second.sqnr_db == pytest.approx(expected, abs=0.01)  # about 12 dB
    with caplog.at_level("WARNING", logger="models.quantize"):
        assert warn_about_unjudged_outputs([first, second]) == []
    assert not caplog.records  # 12 dB is poor, but not below the warning's 10 dB
    _, noisy = fidelity(reference, all_model_outputs(_two_output_model(2.0), {"x": x},
                                                     threads=1), judged={"a"})
    assert noisy.sqnr_db < 10.0
    with caplog.at_level("WARNING", logger="models.quantize"):
        [warning] = warn_about_unjudged_outputs([first, noisy])
    [record] = caplog.records
    assert "output 'b' follows FP32 poorly" in record.getMessage() == warning


def test_mixed_precision_keeps_a_minimal_set_of_layers_out_of_int8(tmp_path):
    # An untrained model on noise has tiny logit margins, so INT8 flips some top-1 classes and a
    # zero budget on agreement forces layers back to float.
    torch.manual_seed(3)
    model = SmallCNN().eval()
    rng = np.random.default_rng(0)
    images = rng.standard_normal((128, 3, SIZE, SIZE)).astype(np.float32)
    float_bytes = export_onnx(model, torch.from_numpy(images[:2])).model_bytes
    reference = all_model_outputs(float_bytes, {"input": images})
    evaluator = Evaluator({"input": images}, reference=reference)
    config = QuantizeConfig(method="minmax", accuracy_budget=0.0, progress=False)
    result = quantize_model(float_bytes, from_array(images, "input", 128), evaluator, config, tmp_path)
    assert result.full_int8_metric < 100.0  # the premise: INT8 alone misses the budget
    assert result.int8_metric == 100.0
    assert 1 <= len(result.fp16_layers) < len(result.sensitivity)
    assert not set(result.fp16_layers) & set(result.int8_layers)
    assert set(result.fp16_layers) | set(result.int8_layers) == {s.name for s in result.sensitivity}
    # The sensitivity table is most sensitive first, and what was kept out is (but for the
    # layers the refinement put back) a prefix of it whose last layer is needed.
    assert [layer.sqnr_db for layer in result.sensitivity] == sorted(
        layer.sqnr_db for layer in result.sensitivity)
    order = [layer.name for layer in result.sensitivity]
    last = max(order.index(name) for name in result.fp16_layers)
    assert set(result.fp16_layers) <= set(order[:last + 1])
    quantizer = QdqQuantizer(float_bytes, from_array(images, "input", 128), config, tmp_path / "check")
    trial = [name for name in result.fp16_layers if name != order[last]]
    assert evaluator(quantizer.quantize(exclude=trial)) < 100.0
    assert set(quantized_layers(result.model_bytes, kept_out=result.fp16_layers)) == set(
        result.int8_layers)


def test_a_kept_out_add_between_int8_branches_is_not_listed_as_int8(digits, trained_onnx,
                                                                     tmp_path):
    """Kept out of INT8 by quantize_static, the residual Add still reads two dequantized tensors
    (its INT8 neighbours' outputs). It runs in FP16, so the precision plan must not also call it
    INT8: a pruned ResNet-18 whose search kept an Add out made a bundle the manifest check
    refused. The quantizer's own variants give a kept-out Add float inputs."""
    train_split, _ = digits
    quantizer = QdqQuantizer(trained_onnx, from_array(train_split.images, "input", 64),
                             QuantizeConfig(method="minmax", progress=False), tmp_path)
    add = next(name for name, op_type in quantizer.candidates if op_type == "Add")
    reference = quantizer.quantize_with_ort(exclude=[add])
    assert add in quantized_layers(reference)  # the premise: every input is dequantized
    int8_layers = quantized_layers(reference, kept_out=[add])
    assert add not in int8_layers
    assert set(int8_layers) == {name for name, _ in quantizer.candidates} - {add}
    assert quantized_layers(quantizer.quantize(exclude=[add])) == int8_layers


def test_an_evaluation_set_too_small_for_the_budget_is_warned_about(digits, trained_onnx,
                                                                     tmp_path, caplog):
    train_split, held_out = digits
    evaluator = Evaluator({"input": held_out.images[:64]}, held_out.labels[:64])
    with caplog.at_level("WARNING", logger="models.quantize"):
        quantize_model(trained_onnx, from_array(train_split.images, "input", 64), evaluator,
                       QuantizeConfig(method="minmax", progress=False), tmp_path)
    assert any("with 64 evaluation samples one changed prediction costs 1.56 points"
               in record.getMessage() for record in caplog.records)


def test_too_few_dense_predictions_are_counted_as_positions(caplog):
    from models.quantize import warn_if_too_few_predictions

    reference = np.zeros((2, 3, 4, 5), np.float32)  # 2 samples, 40 positions
    evaluator = Evaluator({"input": np.zeros((2, 1), np.float32)}, reference={"map": reference})
    with caplog.at_level("WARNING", logger="models.quantize"):
        warn_if_too_few_predictions(evaluator, 1.0)
        warn_if_too_few_predictions(evaluator, 2.5)  # one position is 2.5 points: within
    [record] = caplog.records
    assert "map: with 40 evaluation sample positions one changed prediction costs 2.50 points" \
        in record.getMessage()


def test_dense_outputs_are_judged_position_by_position():
    # Segmentation-like outputs, N x C x H x W: agreement is the share of positions whose class
    # (argmax over C) is unchanged, not one argmax over the flattened map per sample.
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)
    evaluator = Evaluator({"input": np.zeros((2, 3, 2, 2), np.float32)},
                          reference={"map": reference})
    assert evaluator.predictions(evaluator.primary) == 8
    changed = reference.copy()
    position = (0, slice(None), 1, 1)
    changed[position] = -changed[position]  # the largest channel there is no longer the largest
    assert evaluator.score({"map": reference}) == 100.0
    assert evaluator.score({"map": changed}) == pytest.approx(87.5)


def test_channels_last_dense_outputs_take_their_class_from_the_last_axis():
    # N x H x W x C (a segmentation head permuted to channels-last): the class is the argmax over
    # axis 3; argmax over axis 1 would compare rows of the map instead.
    rng = np.random.default_rng(1)
    nchw = rng.standard_normal((4, 5, 6, 7)).astype(np.float32)  # 5 classes, 6 x 7 positions
    nhwc = np.ascontiguousarray(nchw.transpose(0, 2, 3, 1))
    inputs = {"input": np.zeros((4, 1), np.float32)}
    first = Evaluator(inputs, reference={"map": nchw})
    last = Evaluator(inputs, reference={"map": nhwc}, class_axis=3)
    assert first.predictions(first.primary) == last.predictions(last.primary) == 4 * 6 * 7
    noisy = nchw + rng.normal(scale=0.4, size=nchw.shape).astype(np.float32)
    expected = first.score({"map": noisy})
    assert 50.0 < expected < 100.0
    assert last.score({"map": np.ascontiguousarray(noisy.transpose(0, 2, 3, 1))}) == \
        pytest.approx(expected)
    assert "axis 3" in last.metric_description


def test_one_channel_outputs_are_judged_by_their_decision_not_a_trivial_argmax():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 1, 8, 8)).astype(np.float32)  # a binary mask's logits
    inputs = {"input": np.zeros((3, 1), np.float32)}
    evaluator = Evaluator(inputs, reference={"mask": logits})
    judge = evaluator.primary
    assert (judge.kind, judge.threshold) == ("decision", 0.0)
    assert "4-D one channel" in judge.reason and judge.dense
    positive = int((logits > 0).sum())
    assert evaluator.metric_name == "agreement" and evaluator.predictions(judge) == positive
    # Dense decisions are judged by the F1 score of the positions above the threshold.
    flipped = logits.copy()
    row = flipped[0, 0, 0]
    lost = int((row[:4] > 0).sum())
    gained = 4 - lost
    flipped[0, 0, 0, :4] = -row[:4]  # 4 positions change side
    assert evaluator.score({"mask": flipped}) == pytest.approx(
        200.0 * (positive - lost) / (2 * positive - lost + gained))
    # Probabilities in [0, 1] are cut at 0.5; a single logit per sample (N x 1) at 0.
    probabilities = 1.0 / (1.0 + np.exp(-logits))
    assert Evaluator(inputs, reference={"p": probabilities}).primary.threshold == 0.5
    single = rng.standard_normal((3, 1)).astype(np.float32)
    single[0], single[1] = 1.0, -1.0
    assert Evaluator(inputs, reference={"s": single}).score({"s": -single}) == 0.0


def test_one_channel_outputs_without_a_decision_are_judged_by_fidelity():
    # A depth map (every value positive: no decision in it) by its cosine per sample; one value
    # per sample (a score) by SQNR, since the cosine of one number is only its sign.
    depth = np.random.default_rng(3).uniform(1.0, 10.0, (2, 1, 4, 4)).astype(np.float32)
    evaluator = Evaluator({"input": np.zeros((2, 1), np.float32)}, reference={"depth": depth})
    assert evaluator.metric_name == "cosine" and evaluator.predictions(evaluator.primary) == 0
    assert evaluator.score({"depth": depth}) == pytest.approx(1.0)
    assert evaluator.score({"depth": depth * 1.02}) == pytest.approx(1.0)  # scale-free
    assert evaluator.score({"depth": np.full_like(depth, np.nan)}) == 0.0
    assert evaluator.score({"depth": -depth}) == pytest.approx(-1.0, abs=0.01)
    scores = np.random.default_rng(4).uniform(1.0, 2.0, (8, 1)).astype(np.float32)
    sqnr = Evaluator({"input": np.zeros((8, 1), np.float32)}, reference={"score": scores})
    assert sqnr.metric_name == "sqnr"
    assert sqnr.score({"score": scores * 1.01}) == pytest.approx(40.0, abs=0.01)  # 1% error


def test_a_subset_keeps_the_judges_of_the_whole_set():
    reference = np.array([[3.0], [4.0], [-1.0]], np.float32)  # a decision only in the last one
    evaluator = Evaluator({"input": np.zeros((3, 1), np.float32)}, reference={"y": reference})
    subset = evaluator.subset(2)
    assert subset.judges == evaluator.judges and subset.primary.kind == "decision"
    assert subset.samples == 2


@pytest.mark.parametrize("tail, shape, input_layout, expected", [
    ("transpose", [-1, -1, -1, 4], None, "NHWC"),
    ("transpose_first", [-1, 4, 16, 16], "NHWC", "NCHW"),
    ("transpose_softmax", [-1, 16, 16, 4], None, "NHWC"),
    ("softmax_last", [-1, 16, 16, 4], None, "NHWC"),
    ("softmax_first", [-1, 4, 16, 16], "NHWC", "NCHW"),
    ("plain", [-1, -1, -1, 4], None, "NHWC"),
    ("plain", [-1, 4, -1, -1], "NHWC", "NCHW"),
    ("plain", [-1, 16, 16, 4], "NHWC", "NHWC"),
    ("plain", [-1, 4, 16, 16], None, "NCHW"),
    ("plain", [-1, 10], None, None),
])
def test_an_outputs_layout_is_told_by_the_graph_then_its_shape(tail, shape, input_layout,
                                                               expected):
    from onnx import TensorProto, helper

    from models.onnx_model import io_specs, output_layout

    nodes = {"transpose": [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])],
             "transpose_first": [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 3, 1, 2])],
             "transpose_softmax": [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
                                   helper.make_node("Softmax", ["t"], ["y"], axis=3)],
             "softmax_last": [helper.make_node("Softmax", ["x"], ["y"], axis=-1)],
             "softmax_first": [helper.make_node("Softmax", ["x"], ["y"], axis=1)],
             "plain": [helper.make_node("Relu", ["x"], ["y"])]}[tail]
    dims = [None if dim < 0 else dim for dim in shape]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph)
    _, (spec,) = io_specs(model)
    assert output_layout(model, spec, input_layout) == expected


def test_evaluation_sessions_use_the_builds_thread_count(digits, trained_onnx, monkeypatch):
    from models.quantize import evaluate

    asked = []
    real = evaluate.create_session

    def recording(model, **kwargs):
        asked.append(kwargs.get("threads"))
        return real(model, **kwargs)

    monkeypatch.setattr(evaluate, "create_session", recording)
    _, held_out = digits
    Evaluator({"input": held_out.images[:8]}, held_out.labels[:8], threads=1)(trained_onnx)
    assert asked == [1]


def test_search_reports_an_unreachable_budget(digits, trained_onnx, tmp_path):
    from models.quantize import BudgetUnreachableError

    train_split, held_out = digits
    reference = all_model_outputs(trained_onnx, {"input": held_out.images[:64]})
    evaluator = Evaluator({"input": held_out.images[:64]}, held_out.labels[:64], reference)
    config = QuantizeConfig(method="minmax", accuracy_budget=0.0, progress=False)
    quantizer = QdqQuantizer(trained_onnx, from_array(train_split.images, "input", 64), config,
                             tmp_path)
    with pytest.raises(BudgetUnreachableError, match="even with every layer kept out") as error:
        # A float metric no model can reach: the search must give up with an error, not loop.
        search_mixed_precision(quantizer, evaluator, [n for n, _ in quantizer.candidates], config,
                               reference_metric=101.0)
    # Two evaluations (fully INT8, every layer kept out), then the per-layer table.
    assert error.value.fields["evaluations"] == 2
    assert len(error.value.sensitivity) == len(quantizer.candidates)


def test_budget_counts_from_the_reference_metric(digits, trained_onnx, tmp_path):
    # After pruning, the build passes the unpruned model's top-1 as the reference: the search must
    # then hold INT8 to what is left of the budget, not to the whole budget from the pruned model.
    from agent.errors import QuantizationError

    train_split, held_out = digits
    evaluator = Evaluator({"input": held_out.images}, held_out.labels)
    calibration = from_array(train_split.images, "input", 256)
    float_metric = evaluator(trained_onnx)
    reference = float_metric + 0.9
    result = quantize_model(trained_onnx, calibration, evaluator,
                            QuantizeConfig(method="minmax", reference_metric=reference, progress=False),
                            tmp_path / "held")
    assert result.reference_metric == reference
    assert result.budget_drop == pytest.approx(reference - result.int8_metric)
    assert result.budget_drop <= 1.0  # so INT8 itself lost at most 0.1 points
    if result.full_int8_metric < float_metric - 0.1:
        assert result.fp16_layers  # the tighter budget forced layers out of INT8
    with pytest.raises(QuantizationError, match="already further below the reference") as error:
        quantize_model(trained_onnx, calibration, evaluator,
                       QuantizeConfig(reference_metric=float_metric + 1.5, progress=False),
                       tmp_path / "over")
    assert "budget=1.0" in str(error.value)


@pytest.mark.parametrize("field,value", [("method", "kl"), ("accuracy_budget", -1.0), ("percentile", 50.0),
                                                 ("reference_metric", 120.0)])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ConfigError) as error:
        QuantizeConfig(**{field: value})
    assert str(value) in str(error.value)


class _TinyUNet(torch.nn.Module):
    """A skip concatenation after a transposed convolution: ONNX Runtime's symbolic shape
    inference gives up on this graph at dynamic sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 8, 2, 2)
        self.out = torch.nn.Conv2d(11, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.up(torch.relu(self.down(x))), x], 1))


def test_a_graph_symbolic_shape_inference_gives_up_on_still_quantizes(tmp_path, caplog,
                                                                      monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # ONNX Runtime drops its debug files into the current directory
    torch.manual_seed(0)
    exported = export_onnx(_TinyUNet().eval(), torch.randn(2, 3, 16, 16))
    assert exported.dynamic_spatial
    samples = np.random.default_rng(0).random((16, 3, 16, 16), dtype=np.float32)
    with caplog.at_level("WARNING", logger="models.quantize"):
        quantizer = QdqQuantizer(exported.model_bytes, from_array(samples, exported.input_name, 16),
                                 QuantizeConfig(progress=False), tmp_path)
    assert any("symbolic shape inference could not complete" in record.getMessage()
               for record in caplog.records)
    assert len(quantizer.candidates) == 3
    check_qdq_format(quantizer.quantize())
    assert list(elsewhere.iterdir()) == []
    assert not (tmp_path / "sym_shape_infer_temp.onnx").exists()


def test_infinite_sqnr_is_written_as_null():
    import json

    from models.quantize import LayerSensitivity, OutputFidelity

    exact = OutputFidelity("logits", float("inf"), 1.0, judged=True).to_dict()
    layer = LayerSensitivity("conv", "Conv", float("inf"), 1.0, "logits").to_dict()
    assert exact["sqnr_db"] is None and layer["sqnr_db"] is None
    # An output holding infinities (log of a ReLU) compares as NaN on both measures.
    infinite = OutputFidelity("log_density", float("nan"), float("nan"), judged=False).to_dict()
    assert infinite["sqnr_db"] is None and infinite["cosine"] is None
    json.dumps([exact, layer, infinite], allow_nan=False)  # what the manifest's writer requires
