"""Judging INT8 by what each output is, the user's judges and evaluator, the held-out split, and
the mixed-precision search over the sensitivity order (tiny ONNX models built with onnx.helper,
quantized for real)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
# Quantization is a host job: the device pass (Python 3.10, no torch) has an older ONNX Runtime
# whose quantization tools lack what the build uses.
pytest.importorskip("torch", reason="INT8 quantization runs on the host (the host extra)")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from agent.errors import ConfigError, QuantizationError  # noqa: E402
from models.calibration import from_array  # noqa: E402
from models.quantize import (  # noqa: E402
    BudgetUnreachableError,
    CustomJudge,
    Evaluator,
    OutputJudge,
    OutputMetric,
    QdqQuantizer,
    QuantizeConfig,
    all_model_outputs,
    choose_judges,
    cosine_score,
    output_facts,
    quantize_model,
    sqnr_db,
)


def _model(nodes, inputs, outputs, weights) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "tiny", inputs, outputs,
                              [numpy_helper.from_array(value, name)
                               for name, value in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _weights(rng, shape, scale=0.5):
    return rng.normal(0, scale, shape).astype(np.float32)


def _detector(seed: int = 0) -> onnx.ModelProto:
    """Box offsets first (a plain Gemm head), class scores second (a softmax head), as face
    detectors list them."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="body"),
             helper.make_node("Relu", ["h"], ["hr"], name="body_relu"),
             helper.make_node("Gemm", ["hr", "wb", "bb"], ["boxes"], name="box_head"),
             helper.make_node("Gemm", ["hr", "ws", "bs"], ["logits"], name="score_head"),
             helper.make_node("Softmax", ["logits"], ["scores"], axis=1, name="softmax")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                  [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["n", 4]),
                   helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 3])],
                  {"w1": _weights(rng, (8, 16)), "b1": _weights(rng, 16, 0.1),
                   "wb": _weights(rng, (16, 4)), "bb": _weights(rng, 4, 0.1),
                   "ws": _weights(rng, (16, 3)), "bs": _weights(rng, 3, 0.1)})


def _sequence(transposed: bool = False) -> onnx.ModelProto:
    """Per-step character scores [N, T, C] (a softmax over C), and their decoded indices
    (int64 [N, T]); ``transposed``: the softmax runs over axis 1 of [N, C, T], then a
    Transpose makes it [N, T, C]."""
    rng = np.random.default_rng(1)
    if transposed:
        nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="to_ct"),
                 helper.make_node("MatMul", ["w", "xt"], ["ct"], name="classifier"),
                 helper.make_node("Softmax", ["ct"], ["probs_ct"], axis=1, name="softmax"),
                 helper.make_node("Transpose", ["probs_ct"], ["probs"], perm=[0, 2, 1],
                                  name="to_tc")]
        weights = {"w": _weights(rng, (12, 6))}
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"], name="classifier"),
                 helper.make_node("Add", ["scores", "b"], ["biased"], name="bias"),
                 helper.make_node("Softmax", ["biased"], ["probs"], axis=2, name="softmax")]
        weights = {"w": _weights(rng, (6, 12)), "b": _weights(rng, 12, 0.1)}
    nodes.append(helper.make_node("ArgMax", ["probs"], ["indices"], axis=2, keepdims=0,
                                  name="decode"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 6])],
                  [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", 5, 12]),
                   helper.make_tensor_value_info("indices", TensorProto.INT64, ["n", 5])],
                  weights)


def _heatmap() -> onnx.ModelProto:
    """A heatmap that is zero almost everywhere: a ReLU after a strongly negative bias."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["heat"], name="relu2")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 16, 16])],
                  [helper.make_tensor_value_info("heat", TensorProto.FLOAT, ["n", 1, 16, 16])],
                  {"w1": _weights(rng, (8, 3, 3, 3)), "b1": _weights(rng, 8, 0.1),
                   "w2": _weights(rng, (1, 8, 3, 3), 0.3), "b2": np.array([-3.0], np.float32)})


def _chain(layers: int, seed: int = 3) -> onnx.ModelProto:
    """``layers`` Gemm layers with ReLUs between them: as many candidate layers."""
    rng = np.random.default_rng(seed)
    nodes, weights, previous = [], {}, "x"
    for index in range(layers):
        weights[f"w{index}"] = _weights(rng, (16, 16), 0.35)
        weights[f"b{index}"] = _weights(rng, 16, 0.05)
        nodes.append(helper.make_node("Gemm", [previous, f"w{index}", f"b{index}"],
                                      [f"g{index}"], name=f"gemm{index}"))
        previous = f"g{index}"
        if index + 1 < layers:
            nodes.append(helper.make_node("Relu", [previous], [f"r{index}"], name=f"relu{index}"))
            previous = f"r{index}"
    nodes.append(helper.make_node("Identity", [previous], ["out"], name="out"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 16])], weights)


def _quantize(model, samples, tmp_path, config=None, *, overrides=(), custom=None, labels=None):
    """Calibrate on the first half of ``samples``, judge on the rest, as the build does."""
    model_bytes = model.SerializeToString()
    name = model.graph.input[0].name
    calibration, held = samples[: len(samples) // 2], samples[len(samples) // 2:]
    reference = all_model_outputs(model_bytes, {name: held}, threads=1)
    judges = choose_judges(reference, facts=output_facts(model), overrides=overrides,
                           custom=custom, labels=labels is not None)
    evaluator = Evaluator({name: held}, labels, reference, threads=1, judges=judges)
    config = config or QuantizeConfig(method="minmax", progress=False)
    return quantize_model(model_bytes, from_array(calibration, name, len(calibration)),
                          evaluator, config, tmp_path)


def _judges(model, samples):
    name = model.graph.input[0].name
    reference = all_model_outputs(model.SerializeToString(), {name: samples}, threads=1)
    return {judge.name: judge for judge in choose_judges(reference, facts=output_facts(model))}


# --- which judge -------------------------------------------------------------------------------


def test_box_offsets_listed_first_are_judged_by_cosine_and_scores_by_agreement(tmp_path):
    model = _detector()
    samples = np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32)
    judges = _judges(model, samples)
    assert (judges["boxes"].kind, judges["scores"].kind, judges["scores"].axis) == (
        "cosine", "classes", 1)
    assert "softmax over axis 1" in judges["scores"].reason
    assert "regression" in judges["boxes"].reason
    result = _quantize(model, samples, tmp_path)
    # Both are judged and held, each with its own tolerance.
    table = {entry["output"]: entry for entry in result.judges}
    assert set(table) == {"boxes", "scores"}
    assert table["boxes"]["held"] and table["scores"]["held"]
    assert table["boxes"]["tolerance"] == ">= 0.99" and table["scores"]["tolerance"] == "drop <= 1.00"
    assert table["boxes"]["fp32"] == pytest.approx(1.0) and table["scores"]["fp32"] == 100.0
    assert all(entry["passed"] for entry in result.judges)
    assert table["boxes"]["int8"] >= 0.99
    assert [output.judged for output in result.outputs] == [True, True]


def test_a_sparse_heatmap_is_judged_by_cosine_and_passes_for_fine_int8(tmp_path):
    model = _heatmap()
    samples = np.random.default_rng(1).standard_normal((64, 3, 16, 16)).astype(np.float32)
    samples[::4] *= 0.1  # faint inputs: nothing in their heatmap
    reference = all_model_outputs(model.SerializeToString(), {"x": samples})["heat"]
    assert (reference == 0).mean() > 0.8  # the premise: zero almost everywhere
    assert (reference.reshape(64, -1) == 0).all(axis=1).any()  # some samples are empty
    judge = _judges(model, samples)["heat"]
    assert judge.kind == "cosine" and "ReLU" in judge.reason
    result = _quantize(model, samples, tmp_path)
    [entry] = result.judges
    assert entry["passed"] and entry["int8_all_layers"] >= 0.99
    assert result.fp16_layers == []


def test_cosine_is_steady_on_empty_samples():
    empty = np.zeros((2, 1, 8, 8), np.float32)
    assert cosine_score(empty, empty) == 1.0  # two all-zero samples agree
    rng = np.random.default_rng(0)
    maps = np.zeros((10, 1, 8, 8), np.float32)
    maps[:5, 0, 3, 3] = rng.uniform(1.0, 2.0, 5)  # half the samples have one peak
    noisy = maps + np.where(maps > 0, 0.01, 0.0).astype(np.float32)
    # The empty half agree, the others keep their peak: nearly 1, where a relative error
    # over mostly-empty samples would not be.
    assert cosine_score(maps, noisy) > 0.999
    faint = maps.copy()
    faint[5:, 0, 0, 0] = 0.002  # INT8 noise in empty samples, 0.1% of a peak
    assert cosine_score(maps, faint) > 0.99
    moved = np.roll(maps, 1, axis=3)  # every peak in the wrong place
    assert cosine_score(maps, moved) < 0.6


@pytest.mark.parametrize("transposed", [False, True])
def test_sequence_scores_are_judged_per_position_on_the_softmax_axis(transposed):
    model = _sequence(transposed)
    facts = output_facts(model)
    assert facts["probs"].activation == "softmax"
    assert facts["probs"].axis % 3 == 2  # through the Transpose, the softmax's axis moved to 2
    samples = np.random.default_rng(2).standard_normal((16, 5, 6)).astype(np.float32)
    judges = _judges(model, samples)
    probs = judges["probs"]
    assert (probs.kind, probs.axis) == ("classes", 2)
    assert "softmax over axis 2" in probs.reason and "every position" in probs.reason
    reference = all_model_outputs(model.SerializeToString(), {"x": samples})
    evaluator = Evaluator({"x": samples}, reference=reference,
                          judges=list(judges.values()))
    assert evaluator.predictions(probs) == 16 * 5  # one per step, not one per sample
    changed = dict(reference)
    changed["probs"] = reference["probs"].copy()
    changed["probs"][0, 1] = changed["probs"][0, 1][::-1]  # step 1 of sample 0 changes class
    assert evaluator.scores(changed)[0] == pytest.approx(100.0 * 79 / 80)


@pytest.mark.parametrize("convert", [False, True])
def test_an_old_softmax_over_the_last_axis_names_the_classes(convert):
    # Before opset 13 a Softmax's axis flattens the tensor from there on; ONNX's version
    # converter rewrites it as Flatten, Softmax, Reshape. Over the last axis both are per step.
    from onnx import version_converter

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"], name="classifier"),
             helper.make_node("Softmax", ["scores"], ["probs"], axis=2, name="softmax")]
    # No shape on the input: the converter cannot tell that axis 2 is the last one.
    graph = helper.make_graph(nodes, "old", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, None)], [helper.make_tensor_value_info(
            "probs", TensorProto.FLOAT, ["n", 5, 12])],
        [numpy_helper.from_array(_weights(rng, (6, 12)), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    if convert:
        model = version_converter.convert_version(model, 17)
        assert [node.op_type for node in model.graph.node][-3:] == ["Flatten", "Softmax", "Reshape"]
    fact = output_facts(model)["probs"]
    assert (fact.activation, fact.axis, fact.flattened) == ("softmax", 2, True)
    samples = np.random.default_rng(2).standard_normal((4, 5, 6)).astype(np.float32)
    judge = _judges(model, samples)["probs"]
    assert (judge.kind, judge.axis) == ("classes", 2)


def test_scores_flattened_with_their_time_axis_are_not_judged_by_one_argmax():
    # A recognizer that ends in Reshape(logits [T, C] -> [1, T * C]): one argmax over the row
    # would compare one character of the whole sequence.
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["logits"], name="classifier"),
             helper.make_node("Reshape", ["logits", "shape"], ["row"], name="flatten")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 6])],
                   [helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, "tc"])],
                   {"w": _weights(rng, (6, 9)), "b": _weights(rng, 9, 0.1),
                    "shape": np.array([1, -1], np.int64)})
    assert output_facts(model)["row"].source_size == 9
    samples = np.random.default_rng(4).standard_normal((7, 6)).astype(np.float32)
    judge = _judges(model, samples)["row"]
    assert judge.kind == "cosine" and "reshaped after its last layer" in judge.reason


def test_integer_outputs_are_judged_by_exact_agreement(tmp_path):
    model = _sequence()
    samples = np.random.default_rng(3).standard_normal((64, 5, 6)).astype(np.float32)
    judge = _judges(model, samples)["indices"]
    assert judge.kind == "exact" and "int64" in judge.reason
    reference = all_model_outputs(model.SerializeToString(), {"x": samples[:4]})["indices"]
    assert judge.score({"indices": reference}, {"indices": reference}, None) == 100.0
    other = reference.copy()
    other[0, 0] += 1
    assert judge.score({"indices": reference}, {"indices": other}, None) == pytest.approx(95.0)
    # Both outputs are judged in a real build: the softmax per step, the indices exactly.
    result = _quantize(model, samples, tmp_path,
                       QuantizeConfig(method="minmax", accuracy_budget=5.0, progress=False))
    assert [(entry["output"], entry["judge"]) for entry in result.judges] == [
        ("probs", "classes"), ("indices", "exact")]
    assert all(entry["held"] for entry in result.judges)


def test_one_channel_probabilities_are_judged_by_their_decisions():
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("Sigmoid", ["c"], ["mask"], name="sigmoid")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                   [helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["n", 1, 8, 8])],
                   {"w": _weights(np.random.default_rng(4), (1, 3, 1, 1)),
                    "b": np.zeros(1, np.float32)})
    samples = np.random.default_rng(5).standard_normal((4, 3, 8, 8)).astype(np.float32)
    judge = _judges(model, samples)["mask"]
    assert (judge.kind, judge.threshold) == ("decision", 0.5)
    assert judge.reason.startswith("sigmoid: probabilities")


# --- the user's judges --------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("boxes=cosine:0.995", OutputMetric("boxes", "cosine", 0.995)),
    ("scores=agreement", OutputMetric("scores", "agreement", None)),
    ("logits:0=top1:2", OutputMetric("logits:0", "top1", 2.0)),  # a TensorFlow output name
    ("a=b=sqnr:25", OutputMetric("a=b", "sqnr", 25.0)),
    ("heat=IGNORE", OutputMetric("heat", "ignore", None)),
])
def test_output_metrics_are_parsed(text, expected):
    assert OutputMetric.parse(text) == expected


@pytest.mark.parametrize("text, message", [
    ("boxes", "NAME=METRIC[:TOLERANCE]"),
    ("=cosine", "NAME=METRIC[:TOLERANCE]"),
    ("boxes=mse", "choose one of agreement, top1, decision, exact, cosine, sqnr, ignore"),
    ("boxes=cosine:high", "must be a number"),
    ("boxes=cosine:1.5", "minimum in [-1, 1]"),
    ("scores=agreement:-1", "in [0, 100] points"),
    ("scores=ignore:1", "takes no tolerance"),
    ("boxes=sqnr:nan", "finite"),
])
def test_bad_output_metrics_are_refused(text, message):
    with pytest.raises(ConfigError, match=None) as error:
        OutputMetric.parse(text)
    assert message in str(error.value) and "--output-metric" in str(error.value)


def test_output_metrics_replace_the_automatic_judges(tmp_path):
    model = _detector()
    samples = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    reference = all_model_outputs(model.SerializeToString(), {"x": samples})
    facts = output_facts(model)
    boxes, scores = choose_judges(reference, facts=facts, overrides=[
        OutputMetric.parse("boxes=sqnr:30"), OutputMetric.parse("scores=cosine:0.999")])
    assert (boxes.kind, boxes.tolerance, boxes.chosen_by) == ("sqnr", 30.0, "--output-metric")
    assert (scores.kind, scores.tolerance) == ("cosine", 0.999)
    boxes, _ = choose_judges(reference, facts=facts,
                             overrides=[OutputMetric.parse("boxes=top1:0.5")])
    assert (boxes.kind, boxes.axis, boxes.tolerance) == ("classes", 1, 0.5)
    _, scores = choose_judges(reference, facts=facts,
                              overrides=[OutputMetric.parse("scores=ignore")])
    assert scores.kind == "classes" and not scores.held
    with pytest.raises(ConfigError) as error:
        choose_judges(reference, facts=facts, overrides=[OutputMetric.parse("box=cosine")])
    assert "names no output" in str(error.value) and "outputs=boxes, scores" in str(error.value)
    # The effect: a tolerance fully INT8 cannot meet keeps layers out of INT8.
    samples = np.random.default_rng(1).standard_normal((128, 8)).astype(np.float32)
    strict = _quantize(model, samples, tmp_path / "strict",
                       QuantizeConfig(method="minmax", progress=False, allow_no_int8=True),
                       overrides=[OutputMetric.parse("boxes=sqnr:55")])
    boxes_entry = strict.judges[0]
    assert boxes_entry["judge"] == "sqnr" and boxes_entry["int8_all_layers"] < 55
    assert strict.fp16_layers and boxes_entry["passed"]


# --- the user's evaluator -----------------------------------------------------------------------

_EVALUATOR_MODULE = '''
import numpy as np

def agreement(fp32, candidate, labels):
    return 100.0 * float((fp32["scores"].argmax(1) == candidate["scores"].argmax(1)).mean())

def broken(fp32, candidate, labels):
    raise ValueError("no boxes to match")

def wordy(fp32, candidate, labels):
    return "high"

def several(fp32, candidate, labels):
    return np.ones(3)

CONSTANT = 3
'''


@pytest.fixture()
def evaluator_module(tmp_path, monkeypatch):
    (tmp_path / "my_metrics.py").write_text(_EVALUATOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_metrics"
    sys.modules.pop("my_metrics", None)


def test_a_users_evaluator_decides_and_the_automatic_judges_are_reported(tmp_path,
                                                                          evaluator_module):
    model = _detector()
    samples = np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32)
    custom = CustomJudge.load(f"{evaluator_module}:agreement")
    result = _quantize(model, samples, tmp_path, custom=custom)
    first, boxes, scores = result.judges
    assert (first["judge"], first["held"], first["fp32"]) == ("evaluator", True, 100.0)
    assert not boxes["held"] and not scores["held"]  # reported only: the evaluator decides
    assert result.metric_name == "evaluator" and result.float_metric == 100.0


@pytest.mark.parametrize("spec, error_type, message", [
    ("my_metrics", ConfigError, "MODULE:CALLABLE"),
    ("no_such_module_here:f", ConfigError, "cannot import module 'no_such_module_here'"),
    ("my_metrics:missing", ConfigError, "has no attribute 'missing'"),
    ("my_metrics:CONSTANT", ConfigError, "is not callable"),
])
def test_an_evaluator_that_cannot_be_loaded_is_named(evaluator_module, spec, error_type, message):
    with pytest.raises(error_type) as error:
        CustomJudge.load(spec)
    assert message in str(error.value) and "--evaluator" in str(error.value)


@pytest.mark.parametrize("name, message", [
    ("broken", "the evaluator 'my_metrics:broken' failed: ValueError: no boxes to match"),
    ("wordy", "returned str 'high'; it must return one number"),
    ("several", "returned an array of shape [3]"),
])
def test_an_evaluator_that_fails_or_returns_no_number_is_named(evaluator_module, name, message):
    judge = CustomJudge.load(f"{evaluator_module}:{name}")
    outputs = {"scores": np.eye(3, dtype=np.float32)}
    with pytest.raises(QuantizationError) as error:
        judge.score(outputs, outputs, None)
    assert message in str(error.value)


# --- the search ---------------------------------------------------------------------------------


def _strict_sqnr(model, samples, margin_db):
    """An SQNR tolerance ``margin_db`` above what the fully quantized model reaches."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        name = model.graph.input[0].name
        half = len(samples) // 2
        quantizer = QdqQuantizer(model.SerializeToString(), from_array(samples[:half], name, half),
                                 QuantizeConfig(method="minmax", progress=False), Path(work))
        held = {name: samples[half:]}
        full = sqnr_db(all_model_outputs(model.SerializeToString(), held)["out"],
                       all_model_outputs(quantizer.quantize(), held)["out"])
    return full + margin_db


def test_the_search_needs_a_logarithmic_number_of_evaluations(tmp_path):
    layers = 17
    model = _chain(layers)
    samples = np.random.default_rng(6).standard_normal((96, 16)).astype(np.float32)
    tolerance = _strict_sqnr(model, samples, 8.0)
    config = QuantizeConfig(method="minmax", progress=False, refine_evaluations=0)
    result = _quantize(model, samples, tmp_path, config,
                       overrides=[OutputMetric("out", "sqnr", tolerance)])
    assert result.candidate_count == layers
    assert result.full_int8_metric < tolerance <= result.int8_metric  # the search had to work
    assert 1 <= len(result.fp16_layers) < layers
    # Fully INT8, every layer kept out, then a bisection: not one evaluation per layer.
    assert len(result.search_trace) <= math.ceil(math.log2(layers)) + 2
    assert result.search["evaluations"] == len(result.search_trace)
    assert len(result.sensitivity) == layers
    # The kept-out layers are the most sensitive ones, and one fewer fails.
    order = [layer.name for layer in result.sensitivity]
    assert result.fp16_layers == order[:len(result.fp16_layers)]
    failing = [step for step in result.search_trace if not step["passed"]]
    assert len(result.fp16_layers) - 1 in {step["kept_out"] for step in failing}
    # With refinement, a bounded number of evaluations more.
    refined = _quantize(model, samples, tmp_path / "refined",
                        QuantizeConfig(method="minmax", progress=False, refine_evaluations=2),
                        overrides=[OutputMetric("out", "sqnr", tolerance)])
    assert len(refined.search_trace) <= math.ceil(math.log2(layers)) + 4
    assert len(refined.fp16_layers) <= len(result.fp16_layers)


def test_many_layers_are_ranked_in_one_pass_and_the_search_still_meets_the_tolerance(
        tmp_path, monkeypatch):
    import models.quantize.search as search_module

    # As if quantizing the layers one at a time would take too long: the one-pass ranking.
    monkeypatch.setattr(search_module, "EXACT_SENSITIVITY_S", 0.0)
    layers = 17
    model = _chain(layers)
    samples = np.random.default_rng(6).standard_normal((96, 16)).astype(np.float32)
    tolerance = _strict_sqnr(model, samples, 8.0)
    result = _quantize(model, samples, tmp_path,
                       QuantizeConfig(method="minmax", progress=False, refine_evaluations=0),
                       overrides=[OutputMetric("out", "sqnr", tolerance)])
    assert {layer.output for layer in result.sensitivity} == {"local"}
    assert sorted(layer.name for layer in result.sensitivity) == sorted(
        name for name in result.int8_layers + result.fp16_layers)
    assert result.full_int8_metric < tolerance <= result.int8_metric
    assert 1 <= len(result.fp16_layers) < layers
    assert len(result.search_trace) <= math.ceil(math.log2(layers)) + 2
    # Noisiest first: the ranking's numbers ascend.
    ranked = [layer.sqnr_db for layer in result.sensitivity]
    assert ranked == sorted(ranked)


def test_a_budget_no_layer_set_meets_stops_at_once_with_the_layer_table(tmp_path):
    model = _chain(6)
    samples = np.random.default_rng(7).standard_normal((64, 16)).astype(np.float32)
    started = time.perf_counter()
    # Even every layer kept out (FP16 on the board, emulated here) is far from 200 dB.
    with pytest.raises(BudgetUnreachableError) as error:
        _quantize(model, samples, tmp_path, overrides=[OutputMetric("out", "sqnr", 200.0)])
    assert time.perf_counter() - started < 60.0
    message = str(error.value)
    assert "cannot be met even with every layer kept out of INT8" in message
    assert "the metric, a tolerance (--output-metric) or the budget is wrong" in message
    assert "out: sqnr" in message and "needs >= 200.0 dB" in message
    assert error.value.fields["evaluations"] == 2
    assert {layer.name for layer in error.value.sensitivity} == {f"gemm{i}" for i in range(6)}
    [judge] = error.value.judges
    assert judge["every_layer_kept_out"] < 200.0


def test_the_search_time_bounds_the_search_and_says_so(tmp_path):
    model = _chain(8)
    samples = np.random.default_rng(8).standard_normal((64, 16)).astype(np.float32)
    tolerance = _strict_sqnr(model, samples, 8.0)
    config = QuantizeConfig(method="minmax", progress=False, search_time_s=0.001,
                            allow_no_int8=True)
    result = _quantize(model, samples, tmp_path, config,
                       overrides=[OutputMetric("out", "sqnr", tolerance)])
    assert result.search["stopped_by_time"]
    # Sensitivity had no time either: one layer measured, the others rank beside it.
    assert len(result.sensitivity) == 8
    assert sum(math.isnan(layer.sqnr_db) for layer in result.sensitivity) == 7
    # The best passing set found before the limit: every layer kept out.
    assert result.fp16_throughout and len(result.fp16_layers) == 8
    assert any("stopped early: the search time limit (0.001 s) ran out" in warning
               and "next it would have tried 4 layers kept out" in warning
               for warning in result.warnings)
    with pytest.raises(QuantizationError, match="longer --search-time"):
        _quantize(model, samples, tmp_path / "refused",
                  QuantizeConfig(method="minmax", progress=False, search_time_s=0.001),
                  overrides=[OutputMetric("out", "sqnr", tolerance)])


def test_a_build_with_no_int8_layer_is_refused_unless_accepted(tmp_path):
    model = _chain(1)
    samples = np.random.default_rng(9).standard_normal((64, 16)).astype(np.float32)
    strict = [OutputMetric("out", "sqnr", _strict_sqnr(model, samples, 10.0))]
    with pytest.raises(QuantizationError) as error:
        _quantize(model, samples, tmp_path / "refused", overrides=strict)
    assert "no layer runs in INT8, so this is not an INT8 build" in str(error.value)
    assert "--allow-no-int8" in str(error.value)
    result = _quantize(model, samples, tmp_path / "accepted",
                       QuantizeConfig(method="minmax", progress=False, allow_no_int8=True),
                       overrides=strict)
    assert result.fp16_throughout and result.fp16_layers == ["gemm0"]
    assert any("FP16 throughout" in warning for warning in result.warnings)


def test_layers_left_unmeasured_rank_as_a_median_measured_one():
    from models.quantize import LayerSensitivity, rank_layers

    def layer(name, sqnr):
        return LayerSensitivity(name, "Conv", sqnr, float("nan"), "out")

    measured = [layer("a", 30.0), layer("b", 10.0), layer("c", 20.0), layer("nan", float("nan"))]
    unmeasured = [layer("late", float("nan")), layer("head", float("nan"))]
    order = [entry.name for entry in rank_layers(measured, unmeasured)]
    # NaN first (an output holding NaN), then by SQNR; the unmeasured beside the median (20 dB).
    assert order == ["nan", "b", "c", "head", "late", "a"]


def test_kept_out_layers_are_judged_in_fp16():
    from models.quantize.fp16 import emulate_fp16, float_tensors

    model = _chain(2)
    model_bytes = model.SerializeToString()
    samples = {"x": np.random.default_rng(10).standard_normal((8, 16)).astype(np.float32) * 3}
    exact = all_model_outputs(model_bytes, samples)["out"]
    half = all_model_outputs(emulate_fp16(model_bytes, ["gemm0", "gemm1"], float_tensors(model)),
                             samples)["out"]
    assert 50.0 < sqnr_db(exact, half) < 90.0  # FP16's 11 bits, not FP32's 24
    assert emulate_fp16(model_bytes, [], set()) == model_bytes


def test_a_users_judge_of_fidelity_needs_no_budget_points():
    judge = OutputJudge("boxes", "cosine", "test")
    assert judge.tolerance == 0.99 and not judge.agreement
    assert judge.limit_text(1.0) == ">= 0.99"
    assert OutputJudge("boxes", "sqnr", "test").limit_text(1.0) == ">= 20.0 dB"


def test_a_mostly_empty_mask_is_judged_by_the_f1_of_what_it_holds():
    # Text in a photo: 0.5% of the positions above 0.5. INT8 losing all of it keeps 99.5% of the
    # positions' decisions, and an F1 of 0.
    mask = np.full((2, 1, 20, 20), 0.01, np.float32)
    mask[0, 0, 3, :4] = 0.9
    empty = np.full_like(mask, 0.01)
    judge = OutputJudge("mask", "decision", "test", threshold=0.5, dense=True)
    assert judge.score({"mask": mask}, {"mask": empty}, None) == 0.0
    assert judge.score({"mask": mask}, {"mask": mask}, None) == 100.0
    assert judge.score({"mask": empty}, {"mask": empty}, None) == 100.0  # nothing in either
    share = OutputJudge("mask", "decision", "test", threshold=0.5)
    assert share.score({"mask": mask}, {"mask": empty}, None) == pytest.approx(99.5)


def test_concatenated_heads_are_judged_each_on_its_own():
    # YOLOv8's [N, 4 + classes, anchors]: boxes in pixels beside scores in [0, 1]. INT8 that
    # rounds every score to zero leaves the cosine of the whole at the boxes'.
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("Conv", ["x", "wb", "bb"], ["boxes"], name="box_conv"),
             helper.make_node("Conv", ["x", "ws", "bs"], ["logits"], name="score_conv"),
             helper.make_node("Sigmoid", ["logits"], ["scores"], name="sigmoid"),
             helper.make_node("Concat", ["boxes", "scores"], ["head"], axis=1, name="concat")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 30])],
                   [helper.make_tensor_value_info("head", TensorProto.FLOAT, ["n", 7, 30])],
                   {"wb": _weights(rng, (4, 8, 1), 20.0), "bb": np.full(4, 160.0, np.float32),
                    "ws": _weights(rng, (3, 8, 1)), "bs": np.full(3, -3.0, np.float32)})
    assert output_facts(model)["head"].parts == (1, (4, 3))
    samples = rng.standard_normal((6, 8, 30)).astype(np.float32)
    judge = _judges(model, samples)["head"]
    assert (judge.kind, judge.axis, judge.parts) == ("cosine", 1, (4, 3))
    assert "each of the parts 4 + 3 on axis 1" in judge.reason
    head = all_model_outputs(model.SerializeToString(), {"x": samples})["head"]
    rounded = head.copy()
    rounded[:, 4:] = 0.0
    assert cosine_score(head, rounded) > 0.999  # the premise: the whole hides it
    assert judge.score({"head": head}, {"head": rounded}, None) < 0.5
    assert judge.score({"head": head}, {"head": head}, None) == pytest.approx(1.0)
