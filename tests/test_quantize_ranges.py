"""Calibrated ranges (models/quantize/ranges.py) against ONNX Runtime's own calibrators."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from models.calibration import CalibrationSet  # noqa: E402
from models.quantize import ranges  # noqa: E402
from models.quantize.qdq import quantized_op_types  # noqa: E402


def _model(batch: int | str = "n") -> onnx.ModelProto:
    """Conv -> ReLU -> Conv -> Add (residual) -> global pool -> MatMul, shape-inferred."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(scale=0.5, size=shape).astype(np.float32), name)
               for name, shape in (("w1", (6, 3, 3, 3)), ("w2", (6, 6, 3, 3)), ("wm", (6, 4)))]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "c1"], ["s"], name="add"),
        helper.make_node("GlobalAveragePool", ["s"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "wm"], ["y"], name="matmul"),
    ]
    graph = helper.make_graph(nodes, "ranges",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 10, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _samples(count: int = 40) -> CalibrationSet:
    rng = np.random.default_rng(1)
    images = rng.normal(size=(count, 3, 10, 10)).astype(np.float32)
    images[3, 0, 0, 0] = 25.0  # one outlier, for the entropy and percentile cuts to discard
    return CalibrationSet({"x": images}, "test")


def _ort_calibrator(model, calibration, method, tmp_path, bins=2048):
    """ONNX Runtime's calibrator of ``method``, run over every sample at once (one collect
    call: one histogram of all samples)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    options = {"symmetric": True, "num_bins": bins, "num_quantized_bins": 128, "percentile": 99.9}

    class Reader:
        def __init__(self):
            self.batches = [calibration.arrays]

        def get_next(self):
            return self.batches.pop() if self.batches else None

    with contextlib.redirect_stdout(io.StringIO()):
        calibrator = create_calibrator(
            path, list(quantized_op_types()), augmented_model_path=str(tmp_path / "augmented.onnx"),
            calibrate_method={"entropy": CalibrationMethod.Entropy, "minmax": CalibrationMethod.MinMax,
                              "percentile": CalibrationMethod.Percentile}[method],
            extra_options=options)
        calibrator.collect_data(Reader())
        computed = calibrator.compute_data()
    found = {name: tuple(np.asarray(value).item() for value in computed[name].range_value)
             for name in computed}
    return calibrator, found


def _floats(found):
    return {name: tuple(np.asarray(value).item() for value in pair) for name, pair in found.items()}


@pytest.mark.parametrize("method", ["percentile", "minmax"])
def test_ranges_are_the_ones_onnx_runtime_calibrates(method, tmp_path):
    model = _model()
    tensors = ranges.calibration_tensors(model, quantized_op_types())
    assert set(tensors) == {"x", "c1", "r1", "c2", "s", "g", "f", "y"}
    _, expected = _ort_calibrator(model, _samples(), method, tmp_path)
    found = ranges.collect_ranges(model, tensors, _samples(), method=method, percentile=99.9,
                                  batch_size=8)
    assert _floats(found) == expected


def test_entropy_ranges_are_onnx_runtimes_up_to_its_rounding(tmp_path, monkeypatch):
    """The histograms are ONNX Runtime's, bin for bin, though counted batch by batch. The cut
    is its cut, or one its float32 arithmetic cannot tell from it: a divergence no larger, and
    within 1e-4 of it."""
    monkeypatch.setattr(ranges, "HISTOGRAM_BINS", 512)  # ONNX Runtime's search is slow at 2048
    model = _model()
    tensors = ranges.calibration_tensors(model, quantized_op_types())
    calibrator, expected = _ort_calibrator(model, _samples(), "entropy", tmp_path, bins=512)
    samples = _samples()
    with ranges._Samples(model, samples, 8, passes=2, progress=False) as batches:
        session = ranges._session(ranges._with_outputs(model, tensors))
        extremes = ranges._extremes(model, tensors, batches, session, absolute=False)
        histograms = ranges._histograms(session, tensors, batches, extremes, absolute=False)
    found = _floats(ranges.collect_ranges(model, tensors, samples, method="entropy", batch_size=8,
                                        entropy_min_values=0))
    for name in tensors:
        theirs = calibrator.collector.histogram_dict[name]
        np.testing.assert_array_equal(histograms[name][0], theirs[0])
        np.testing.assert_array_equal(histograms[name][1], theirs[1])
        if found[name] != expected[name]:
            divergence = _divergence_of_cuts(*histograms[name], *extremes[name][:2])
            assert divergence[found[name]] <= divergence[expected[name]] * (1 + 1e-4), name


def _divergence_of_cuts(counts, edges, lowest, highest):
    """Each cut's range (as entropy_range clips it) -> its exact divergence."""
    middle = counts.size // 2
    divergence = {}
    for step in range(64, middle + 1):
        start, end = middle - step, min(middle + step + 1, counts.size)
        pair = (max(edges[start], lowest).item(), min(edges[end], highest).item())
        value = _divergence_by_bins(counts, start, end, 128)
        divergence[pair] = min(value, divergence.get(pair, np.inf))
    return divergence


def test_a_tensor_with_nan_is_calibrated_on_its_other_values_as_onnx_runtime_does(tmp_path,
                                                                                monkeypatch):
    # log(x) is NaN wherever x < 0; ONNX Runtime's ReduceMin lets such a NaN through or not
    # depending on where it falls.
    monkeypatch.setattr(ranges, "HISTOGRAM_BINS", 512)
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["log"], name="log"),
         helper.make_node("Mul", ["log", "two"], ["y"], name="double")],
        "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    samples = CalibrationSet({"x": np.random.default_rng(4).normal(size=(30, 8)).astype(np.float32)},
                             "test")
    tensors = ranges.calibration_tensors(model, quantized_op_types())
    assert tensors == ["log", "y"]
    calibrator, _ = _ort_calibrator(model, samples, "entropy", tmp_path, bins=512)
    with ranges._Samples(model, samples, 8, passes=2, progress=False) as batches:
        session = ranges._session(ranges._with_outputs(model, tensors))
        extremes = ranges._extremes(model, tensors, batches, session, absolute=False)
        histograms = ranges._histograms(session, tensors, batches, extremes, absolute=False)
    for name in tensors:
        counts, edges, lowest, highest, _ = calibrator.collector.histogram_dict[name]
        assert (extremes[name][0], extremes[name][1]) == (lowest, highest)
        np.testing.assert_array_equal(histograms[name][0], counts)
        np.testing.assert_array_equal(histograms[name][1], edges)


def _histogram(kind: str, rng: np.random.Generator, bins: int = 400):
    data = {"normal": lambda: rng.standard_normal(50_000),
            "relu": lambda: np.maximum(rng.standard_normal(50_000), 0) * 3,
            "outliers": lambda: np.concatenate([rng.laplace(size=50_000), [60.0, -45.0]]),
            "levels": lambda: rng.integers(-3, 4, 50_000)}[kind]().astype(np.float32)
    threshold = np.array(np.abs(data).max(), dtype=np.float32)
    counts, edges = np.histogram(data, bins, range=(-threshold, threshold))
    return counts, edges, data.min(), data.max()


@pytest.mark.parametrize("kind", ["normal", "relu", "levels"])
def test_the_entropy_cut_is_the_one_onnx_runtime_picks(kind):
    from onnxruntime.quantization.calibrate import HistogramCollector

    counts, edges, lowest, highest = _histogram(kind, np.random.default_rng(2))
    collector = HistogramCollector("entropy", True, counts.size, 128, 99.999, "same")
    expected = collector.get_entropy_threshold((counts, edges, lowest, highest), 128)
    assert ranges.entropy_range(counts, edges, lowest, highest) == expected


def _divergence_by_bins(counts: np.ndarray, start: int, end: int, quantized: int) -> float:
    """KL(p || q) of one cut, built bin by bin the way ONNX Runtime does (in float64)."""
    p = counts[start:end].astype(np.float64)
    p[0] += counts[:start].sum()
    p[-1] += counts[end:].sum()
    merged = (end - start) // quantized
    q = np.zeros_like(p)
    for group in range(quantized):
        low, high = group * merged, (group + 1) * merged
        total = counts[start + low:start + high].sum()
        if group == quantized - 1:
            total += counts[start + quantized * merged:end].sum()
        filled = np.count_nonzero(p[low:high])
        if filled:
            q[low:high] = total // filled

    def smoothed(values):
        empty = values == 0
        if empty.all():
            return None
        return values + 1e-4 * empty - 1e-4 * empty.sum() / (~empty).sum() * ~empty

    p, q = smoothed(p), smoothed(q)
    if p is None or q is None:
        return np.inf
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def test_the_divergence_of_every_cut_is_the_exact_one():
    # Sparse histograms: many empty bins, so the smoothing weights are at their largest.
    rng = np.random.default_rng(3)
    for _ in range(3):
        counts = rng.poisson(rng.uniform(0, 4, 300)) * (rng.random(300) < 0.4)
        counts[rng.integers(0, 300, 3)] += 10_000
        middle = counts.size // 2
        steps = np.arange(64, middle + 1)
        starts, ends = middle - steps, np.minimum(middle + steps + 1, counts.size)
        found = ranges._divergences(counts, starts, ends, 128)
        expected = [_divergence_by_bins(counts, s, e, 128) for s, e in zip(starts, ends)]
        np.testing.assert_allclose(found, expected, rtol=1e-9, atol=1e-12)


def test_a_sigmoids_probabilities_keep_their_largest_values():
    """A probability map near 0 almost everywhere (a text detector's): the entropy threshold
    cuts its rare large values, the decisions, unless calibrated by the values seen."""
    method = "entropy"
    nodes = [helper.make_node("Conv", ["x", "w"], ["logits"], name="conv"),
             helper.make_node("Sigmoid", ["logits"], ["p"], name="sigmoid"),
             helper.make_node("Mul", ["p", "p"], ["y"], name="square")]
    graph = helper.make_graph(
        nodes, "probabilities",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, 16, 16])],
        [numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    images = np.full((32, 1, 16, 16), -8.0, np.float32)
    images[:, :, 3, 3] = 8.0  # one position in 256 is text
    calibration = CalibrationSet({"x": images}, "test")
    assert ranges.bounded_outputs(model) == ["p"]
    tensors = ranges.calibration_tensors(model, quantized_op_types())
    cut = ranges.collect_ranges(model, tensors, calibration, method=method, entropy_min_values=0)
    seen = ranges.collect_ranges(model, tensors, calibration, method=method, observed=["p"],
                                 entropy_min_values=0)
    assert float(cut["p"][1]) < 0.5  # what the cut would have kept: no decision survives
    assert float(seen["p"][1]) == pytest.approx(1.0, abs=1e-3)
    assert float(seen["logits"][1]) == pytest.approx(float(cut["logits"][1]))  # others as before


def test_a_tensor_of_few_values_is_calibrated_by_the_values_seen():
    """A squeeze-excitation vector (N x C x 1 x 1): too few values for an entropy histogram of
    2,048 bins, whose threshold then cuts the channels that matter."""
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"], name="squeeze"),
             helper.make_node("Conv", ["g", "w"], ["e"], name="excite"),
             helper.make_node("Relu", ["e"], ["y"], name="relu")]
    graph = helper.make_graph(
        nodes, "excitation",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 1, 1])],
        [numpy_helper.from_array(np.eye(8, dtype=np.float32).reshape(8, 8, 1, 1), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    rng = np.random.default_rng(4)
    images = np.abs(rng.normal(scale=0.2, size=(64, 8, 4, 4))).astype(np.float32)
    images[:3, 5] += 12.0  # one channel is strong now and then: 3 values of 512
    calibration = CalibrationSet({"x": images}, "test")
    tensors = ranges.calibration_tensors(model, quantized_op_types())
    found = ranges.collect_ranges(model, tensors, calibration, method="entropy")
    cut = ranges.collect_ranges(model, tensors, calibration, method="entropy", entropy_min_values=0)
    strongest = float(images[:3, 5].mean(axis=(1, 2)).max())
    assert float(found["e"][1]) == pytest.approx(strongest, rel=1e-4)
    assert float(cut["e"][1]) < 0.5 * strongest
