"""Activation ranges for INT8 calibration: ONNX Runtime's methods, computed in a fraction of its time.

ONNX Runtime's calibrators (``onnxruntime.quantization.calibrate``) keep every calibrated tensor
of every batch in memory until the last batch (a text recognizer's 64 samples at 48 x 320 need
over 13 GB), calibrate every float tensor of the graph when called on their own, and search the
entropy threshold with Python loops over the histogram's bins (about 0.8 s a tensor at 2,048
bins: over 5 minutes for that recognizer's 359 tensors). Here:

- only the tensors ``quantize_static`` can quantize are calibrated: the inputs and outputs of
  nodes of the op types it is asked to quantize (the selection ONNX Runtime makes inside
  ``quantize_static``);
- the samples are run a batch at a time, twice for the histogram methods: the first pass finds
  each tensor's minimum and maximum (reduced inside ONNX Runtime), the second adds every batch to
  a histogram over that range. That histogram has the bins and edges of ONNX Runtime's one
  histogram of all samples at once, and the same counts, without holding the activations;
- the entropy threshold search (minimum KL divergence, as ONNX Runtime does it) is vectorised
  over the candidate thresholds; percentile and min-max use ONNX Runtime's formulas.

The ranges go to ``quantize_static`` through its calibration cache (:func:`save_ranges`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import CalibrationError
from models.calibration import CalibrationSet

log = logging.getLogger(__name__)

HISTOGRAM_BINS = 2048
# quantize_static would build the entropy calibrator with 128 histogram bins and 128 quantized
# bins, which leaves no threshold to search (it degenerates to min-max). TensorRT's entropy
# calibrator uses 2048 bins folded into 128, and so does this.
QUANTIZED_BINS = 128
# The calibrated tensors of one batch are held in memory together: batches are made small enough
# to keep them under this (a detector at 640 x 640 has over 200 MB of activations a sample).
BATCH_BYTES = 1 << 30
_SMOOTHING = 0.0001  # what ONNX Runtime adds to empty bins before comparing distributions
_FLOAT_TYPES = (1, 10)  # TensorProto.FLOAT, FLOAT16: what ONNX Runtime calibrates


def calibration_tensors(model: Any, op_types: Collection[str]) -> list[str]:
    """The tensors to calibrate: float inputs and outputs of nodes of ``op_types`` that are not
    initializers and whose type shape inference knows (ONNX Runtime's own selection)."""
    value_infos = {info.name: info for info in model.graph.value_info}
    value_infos.update({info.name: info for info in model.graph.output})
    value_infos.update({info.name: info for info in model.graph.input})
    initializers = {init.name for init in model.graph.initializer}
    selected: dict[str, None] = {}
    for node in model.graph.node:
        if node.op_type not in op_types:
            continue
        for name in (*node.input, *node.output):
            info = value_infos.get(name)
            if (info is not None and name not in initializers and info.type.HasField("tensor_type")
                    and info.type.tensor_type.elem_type in _FLOAT_TYPES):
                selected[name] = None
    return list(selected)


# Fewer values than this over all samples leave the entropy threshold to a histogram of mostly
# empty bins: such a tensor (a squeeze-excitation block's N x C x 1 x 1 vectors, a classifier's
# logits) is calibrated by the values seen. PP-OCRv4's recognizer has an excitation of 3,840 values
# (64 samples) reaching 15 whose entropy threshold was 1.9: that one layer in INT8 changed 30% of
# its characters.
ENTROPY_MIN_VALUES = 64 * HISTOGRAM_BINS

# Activations whose outputs are bounded scores or probabilities.
BOUNDED_OP_TYPES = frozenset({"Sigmoid", "HardSigmoid", "Softmax", "Tanh"})


def bounded_outputs(model: Any) -> list[str]:
    """The outputs of :data:`BOUNDED_OP_TYPES` nodes, calibrated by the values seen
    (``collect_ranges(observed=...)``). A text detector's probability map is a sigmoid's
    output, near 0 almost everywhere: its entropy range (PP-OCRv4's, 0.063) clipped every
    probability above it, so no position reached the 0.5 that marks text."""
    return [name for node in model.graph.node if node.op_type in BOUNDED_OP_TYPES
            for name in node.output]


def collect_ranges(
    model: Any,
    tensors: Sequence[str],
    calibration: CalibrationSet,
    *,
    method: str,
    percentile: float = 99.999,
    batch_size: int = 32,
    progress: bool = False,
    fixed_batch: int | None = None,
    observed: Collection[str] = (),
    entropy_min_values: int = ENTROPY_MIN_VALUES,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each tensor's calibrated range (lowest, highest), as ONNX Runtime's symmetric calibrator
    of ``method`` (entropy, percentile, minmax) finds it over all of ``calibration``; the
    tensors in ``observed``, and with entropy those of fewer than ``entropy_min_values``
    values, get the range of the values seen (min-max).

    Args:
        model: The float model (shape inferred), not modified.
        tensors: The tensors to calibrate (:func:`calibration_tensors`).
        batch_size: The largest batch to run; smaller when a batch's tensors would not fit in
            :data:`BATCH_BYTES`, and the model's own where its input fixes one.
        fixed_batch: The one batch size the graph runs at (``meta["fixed_batch"]``, found by
            running it: a graph may declare a dynamic batch and still bake one in), if any.
        observed: Tensors whose largest values are the ones that matter, such as a sigmoid's
            probabilities (:func:`bounded_outputs`): entropy and percentile cut off the rare
            large values of a mostly-zero distribution, and those are the decisions.
    """
    histogram = method != "minmax"
    samples = _Samples(model, calibration, batch_size, passes=2 if histogram else 1,
                       progress=progress, fixed_batch=fixed_batch)
    with samples:
        tensor_session = _session(_with_outputs(model, tensors))
        samples.fit(tensor_session, list(tensors))
        extremes = _extremes(model, tensors, samples, tensor_session,
                             absolute=method == "percentile")
        if not histogram:
            return {name: _symmetric(low, high) for name, (low, high, _) in extremes.items()}
        histograms = _histograms(tensor_session, tensors, samples, extremes,
                                 absolute=method == "percentile")
    observed = set(observed)
    ranges = {}
    for name in tensors:
        if name in observed or (method == "entropy" and
                                histograms[name][0].sum() < entropy_min_values):
            ranges[name] = _symmetric(*extremes[name][:2])
        elif method == "percentile":
            ranges[name] = percentile_range(*histograms[name], *extremes[name][:2], percentile)
        else:
            ranges[name] = entropy_range(*histograms[name], *extremes[name][:2])
    return ranges


def _symmetric(lowest: np.ndarray, highest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    largest = np.nanmax([np.abs(lowest), np.abs(highest)], axis=0)
    return -largest, largest


class _Samples(contextlib.AbstractContextManager["_Samples"]):
    """The calibration samples in batches of :attr:`step`, for one or two passes, with one
    progress bar."""

    def __init__(self, model: Any, calibration: CalibrationSet, batch_size: int, *, passes: int,
                 progress: bool, fixed_batch: int | None = None) -> None:
        self.calibration = calibration
        self.fixed_batch = fixed_batch or _fixed_batch(model)
        self.step = self.fixed_batch or max(1, batch_size)
        self.count = len(calibration)
        if self.fixed_batch is not None and self.count % self.fixed_batch:
            self.count -= self.count % self.fixed_batch
            log.warning("the model takes batches of exactly %d: calibrating on %d of the %d "
                        "samples", self.fixed_batch, self.count, len(calibration))
        if self.count == 0:
            raise CalibrationError("fewer calibration samples than the batch the model takes",
                                   samples=len(calibration), batch=self.fixed_batch)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=passes * self.count, desc="calibrating", unit="sample",
                             leave=False)

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def fit(self, session: Any, tensors: list[str]) -> None:
        """Make :attr:`step` small enough for a batch's ``tensors`` (the outputs of
        ``session``) to fit in :data:`BATCH_BYTES`, from one sample's: ONNX Runtime may also hold
        them all at once while it reduces them in the first pass."""
        if self.fixed_batch is not None:
            return
        first = {name: array[:1] for name, array in self.calibration.arrays.items()}
        per_sample = sum(array.nbytes for array in _run(session, tensors, first))
        self.step = int(max(1, min(self.step, BATCH_BYTES // max(per_sample, 1))))

    def batches(self, *, progress: bool = True) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.count, self.step):
            end = min(start + self.step, self.count)
            if self._bar is not None and progress:
                self._bar.update(end - start)
            yield {name: array[start:end] for name, array in self.calibration.arrays.items()}


def _run(session: Any, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return list(session.run(names, feed))
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises plain errors for input mismatches
        raise CalibrationError(f"calibration data does not fit the model: {exc}") from exc


def _extremes(model: Any, tensors: Sequence[str], samples: _Samples, tensor_session: Any, *,
              absolute: bool) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Each tensor's (lowest, highest, lowest absolute value or None) over all samples, NaN
    ignored as ONNX Runtime's histogram calibrators ignore it.

    Reduced inside the model (ReduceMin/ReduceMax as outputs, as ONNX Runtime's min-max
    calibrator does), so that this pass moves no activations out of ONNX Runtime. Those
    reductions do not skip a NaN (ONNX Runtime's ReduceMin returns the minimum of the values
    on one side of it), so each tensor's sum is taken too: a tensor whose sum is NaN is
    reduced again in numpy, from ``tensor_session`` (which outputs the tensors)."""
    kinds = ("min", "max", "sum", "absmin") if absolute else ("min", "max", "sum")
    reduced, names = _with_reductions(model, tensors, kinds)
    session = _session(reduced)
    found: list[dict[str, np.ndarray]] = [{} for _ in tensors]
    unsure: list[int] = []
    for feed in samples.batches():
        values = iter(_run(session, names, feed))
        for index, extremes in enumerate(found):
            for kind in kinds:
                value = next(values).reshape(())
                if kind != "sum":
                    _merge(extremes, kind, value)
                elif np.isnan(value) and index not in unsure:
                    unsure.append(index)
    if unsure:
        for index in unsure:
            found[index] = {}
        for feed in samples.batches(progress=False):
            arrays = _run(tensor_session, [tensors[index] for index in unsure], feed)
            for index, array in zip(unsure, arrays):
                if np.isnan(array).all():
                    continue  # all NaN, or no values at all
                _merge(found[index], "min", np.nanmin(array))
                _merge(found[index], "max", np.nanmax(array))
                if absolute:
                    _merge(found[index], "absmin", np.nanmin(np.abs(array)))
    result = {}
    for tensor, extremes in zip(tensors, found):
        if "min" not in extremes or extremes["min"] > extremes["max"]:
            zero = np.zeros((), dtype=extremes.get("min", np.float32(0)).dtype)
            extremes = {"min": zero, "max": zero, "absmin": zero}  # ONNX Runtime's (0, 0)
        result[tensor] = (extremes["min"], extremes["max"], extremes.get("absmin"))
    return result



def _merge(extremes: dict[str, np.ndarray], kind: str, value: np.ndarray) -> None:
    """Fold one batch's reduction into ``extremes``, NaN ignored."""
    if kind not in extremes:
        extremes[kind] = value
    elif kind == "max":
        extremes[kind] = np.fmax(extremes[kind], value)
    else:
        extremes[kind] = np.fmin(extremes[kind], value)


def _histograms(session: Any, tensors: Sequence[str], samples: _Samples,
                extremes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]], *,
                absolute: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each tensor's histogram of :data:`HISTOGRAM_BINS` bins (counts, edges) over its whole
    range, as ONNX Runtime makes it from all samples at once: over [-t, t] with t the largest
    magnitude (entropy), or over [smallest, largest] absolute value (symmetric percentile).
    ``session`` outputs the tensors; each batch's are counted in parallel threads (numpy counts
    without holding the GIL)."""
    names = list(tensors)
    bounds: dict[str, Any] = {}
    for name, (low, high, absolute_low) in extremes.items():
        largest = np.maximum(abs(low), abs(high))
        if not np.isfinite(largest):
            raise CalibrationError("a tensor of the model is infinite or NaN on the calibration "
                                   "samples: it has no range to quantize to (check the samples' "
                                   "preprocessing)", tensor=name)
        if absolute:
            bounds[name] = (absolute_low, largest)
        else:
            threshold = np.array(largest, dtype=low.dtype)
            bounds[name] = (-threshold, threshold)

    def count(item: tuple[str, np.ndarray]) -> tuple[str, np.ndarray, np.ndarray]:
        name, array = item
        values = np.abs(array.ravel()) if absolute else array.ravel()
        counts, edges = np.histogram(values, HISTOGRAM_BINS, range=bounds[name])
        return name, counts, edges.astype(values.dtype)

    result: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for feed in samples.batches():
            outputs = _run(session, names, feed)
            for name, counts, edges in pool.map(count, zip(names, outputs)):
                if name in result:
                    result[name][0][...] += counts
                else:
                    result[name] = (counts, edges)
            del outputs
    return result


def _session(model: Any) -> Any:
    """A CPU session without graph optimisations, as ONNX Runtime's calibrators run (a fusion
    would compute some calibrated tensors differently, in another order of operations)."""
    ort = require("onnxruntime", extra="host", purpose="INT8 calibration")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises bare errors for bad graphs
        raise CalibrationError(f"the model cannot be run for calibration: {exc}") from exc


def _fixed_batch(model: Any) -> int | None:
    """The batch size the model's inputs fix (a number written as axis 0), or None."""
    initializers = {init.name for init in model.graph.initializer}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return None


def _with_outputs(model: Any, tensors: Sequence[str]) -> Any:
    """A copy of ``model`` that also outputs ``tensors``."""
    onnx = require("onnx", extra="host", purpose="INT8 calibration")
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    infos = {info.name: info for info in (*model.graph.value_info, *model.graph.input)}
    present = {output.name for output in augmented.graph.output}
    for name in tensors:
        if name not in present:
            augmented.graph.output.append(infos[name])
    return augmented


def _with_reductions(model: Any, tensors: Sequence[str],
                     kinds: Sequence[str]) -> tuple[Any, list[str]]:
    """A copy of ``model`` whose outputs are, tensor by tensor, its reductions of ``kinds``
    (min, max, sum, absmin: the smallest magnitude); and those outputs' names."""
    onnx = require("onnx", extra="host", purpose="INT8 calibration")
    from onnx import helper

    reduced = onnx.ModelProto()
    reduced.CopyFrom(model)
    del reduced.graph.output[:]
    types = {info.name: info.type.tensor_type.elem_type
             for info in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    names = []
    for index, tensor in enumerate(tensors):
        for kind in kinds:
            source, output = tensor, f"calibration_{index}_{kind}"
            if kind == "absmin":
                source = f"calibration_{index}_abs"
                reduced.graph.node.append(helper.make_node("Abs", [tensor], [source], name=source))
            # keepdims (the default) and no axes: one value, even for a tensor with no elements.
            op_type = {"max": "ReduceMax", "sum": "ReduceSum"}.get(kind, "ReduceMin")
            reduced.graph.node.append(helper.make_node(op_type, [source], [output], name=output))
            reduced.graph.output.append(helper.make_tensor_value_info(output, types[tensor], None))
            names.append(output)
    return reduced, names


def percentile_range(counts: np.ndarray, edges: np.ndarray, lowest: np.ndarray,
                     highest: np.ndarray, percentile: float) -> tuple[np.ndarray, np.ndarray]:
    """The symmetric range holding ``percentile`` percent of the absolute values (a histogram of
    them), clipped to the values seen: ONNX Runtime's symmetric percentile calibration."""
    cdf = np.cumsum(counts / counts.sum())
    index = np.searchsorted(cdf, percentile / 100.0)
    low = -np.array(edges[index], dtype=edges.dtype)
    high = np.array(edges[index], dtype=edges.dtype)
    return (lowest if low < lowest else low), (highest if high > highest else high)


def entropy_range(counts: np.ndarray, edges: np.ndarray, lowest: np.ndarray, highest: np.ndarray,
                  quantized_bins: int = QUANTIZED_BINS) -> tuple[np.ndarray, np.ndarray]:
    """The range whose ``quantized_bins``-level quantization loses the least information (KL
    divergence) about a tensor's histogram, clipped to the values seen.

    ONNX Runtime's entropy method, candidate for candidate: the histogram is cut at bins
    symmetric about its middle, the counts outside folded into the end bins (``p``); the cut is
    merged into ``quantized_bins`` groups, each group's total spread back evenly over the
    group's bins that ``p`` fills, in whole counts (``q``; as in ONNX Runtime, the group's empty
    bins get the same share and the bins left over past the last whole group get nothing);
    empty bins of both get a small weight taken evenly from the others, and
    ``KL(p || q)`` picks the cut. See :func:`_divergences` for how it is computed.
    """
    counts = np.asarray(counts, dtype=np.int64)
    bins = counts.size
    middle = bins // 2
    steps = np.arange(quantized_bins // 2, middle + 1)
    starts = middle - steps
    ends = np.minimum(middle + steps + 1, bins)
    best = int(np.argmin(_divergences(counts, starts, ends, quantized_bins)))
    low, high = edges[starts[best]], edges[ends[best]]
    return (lowest if low < lowest else low), (highest if high > highest else high)


def _divergences(counts: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 quantized_bins: int) -> np.ndarray:
    """KL(p || q) of each candidate cut [start, end) of ``counts`` (see :func:`entropy_range`).

    ONNX Runtime builds p and q bin by bin for each of the ~1,000 cuts (two million bins a
    tensor). Here every sum is taken from running sums over the histogram, a few per group of
    q, where q is constant: 128 terms a cut. The one sum that is not linear, of
    ``(c - e) log(c - e)`` over p's filled bins (``e`` the weight each gives to the empty ones,
    at most 0.21), is its Taylor series in ``e`` to the fourth order: exact to 1e-5 of a count.
    """
    eps = _SMOOTHING
    counts = counts.astype(np.float64)
    filled_bin = counts != 0
    safe = np.where(filled_bin, counts, 1.0)

    def running(values: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values)])

    total_count, total_filled = running(counts), running(filled_bin.astype(np.float64))
    total_xlogx = running(np.where(filled_bin, counts * np.log(safe), 0.0))
    total_log = running(np.where(filled_bin, np.log(safe), 0.0))
    total_inverse = [running(np.where(filled_bin, safe ** -power, 0.0)) for power in (1, 2, 3)]
    samples = total_count[-1]

    lengths = ends - starts
    merged = lengths // quantized_bins
    grouped_end = starts + quantized_bins * merged  # the bins past it belong to no group
    leftover = lengths - quantized_bins * merged
    first = counts[starts] + total_count[starts]  # p's end bins, with the outliers folded in
    last = counts[ends - 1] + samples - total_count[ends]
    first_change = (first != 0).astype(np.float64) - filled_bin[starts]
    last_change = (last != 0).astype(np.float64) - filled_bin[ends - 1]
    p_filled = total_filled[ends] - total_filled[starts] + first_change + last_change
    p_empty = lengths - p_filled
    p_weight = eps * p_empty / np.maximum(p_filled, 1)

    group_starts = starts[:, None] + np.arange(quantized_bins)[None, :] * merged[:, None]
    group_ends = group_starts + merged[:, None]
    group_counts = total_count[group_ends] - total_count[group_starts]
    group_filled = total_filled[group_ends] - total_filled[group_starts]
    group_filled[:, 0] += first_change
    ends_in_group = leftover == 0  # else the last bin is among the left-over ones
    group_filled[ends_in_group, -1] += last_change[ends_in_group]
    q_totals = group_counts.copy()
    q_totals[:, -1] += total_count[ends] - total_count[grouped_end]
    share = np.where(group_filled > 0, np.floor(q_totals / np.maximum(group_filled, 1)), 0.0)
    q_empty = (merged[:, None] * (share == 0)).sum(axis=1) + leftover
    q_filled = lengths - q_empty
    q_weight = eps * q_empty / np.maximum(q_filled, 1)
    q_sum = (merged[:, None] * share).sum(axis=1)
    q_smoothed = np.where(share != 0, share - q_weight[:, None], eps)

    # Sum of p (smoothed) times log q (smoothed), group by group, then over the left-over bins.
    p_groups = group_counts.copy()
    p_groups[:, 0] += total_count[starts]
    p_groups[ends_in_group, -1] += (samples - total_count[ends])[ends_in_group]
    p_groups += eps * (merged[:, None] - group_filled) - p_weight[:, None] * group_filled
    leftover_filled = np.where(ends_in_group, 0.0,
                               total_filled[ends] - total_filled[grouped_end] + last_change)
    leftover_p = np.where(ends_in_group, 0.0,
                          total_count[ends] - total_count[grouped_end] + samples - total_count[ends])
    leftover_p += eps * (leftover - leftover_filled) - p_weight * leftover_filled
    cross = (p_groups * np.log(q_smoothed)).sum(axis=1) + leftover_p * np.log(eps)

    # Sum of p log p (smoothed): the inner bins by the series, p's two end bins directly.
    inner_start, inner_end = starts + 1, ends - 1
    weight = p_weight

    def inner(running_sum: np.ndarray) -> np.ndarray:
        return running_sum[inner_end] - running_sum[inner_start]

    own = (inner(total_xlogx) - weight * (inner(total_log) + inner(total_filled))
           + weight ** 2 / 2 * inner(total_inverse[0]) + weight ** 3 / 6 * inner(total_inverse[1])
           + weight ** 4 / 12 * inner(total_inverse[2]))
    for end_bin in (first, last):
        value = np.maximum(end_bin - weight, 1e-300)
        own += np.where(end_bin != 0, value * np.log(value), 0.0)
    own += p_empty * eps * np.log(eps)

    with np.errstate(divide="ignore", invalid="ignore"):
        divergence = (own - cross) / samples - np.log(samples) + np.log(q_sum)
    divergence[(p_filled == 0) | (q_filled == 0) | ~np.isfinite(divergence)] = np.inf
    return divergence


def save_ranges(ranges: dict[str, tuple[np.ndarray, np.ndarray]], method: Any, path: Path) -> None:
    """Write ``ranges`` as ``quantize_static``'s calibration cache for ``method`` (its
    CalibrationMethod): the ranges only, not ONNX Runtime's histograms (17 MB of JSON for a
    text recognizer, parsed again by every ``quantize_static`` call)."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    data = {name: TensorData(lowest=np.asarray(low), highest=np.asarray(high))
            for name, (low, high) in ranges.items()}
    save_tensors_data(TensorsData(method, data), path)
