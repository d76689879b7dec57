"""The batch axis of a user's ONNX model, found by running the model, not read off its declared
shapes.

The daemon stacks requests along the first input axis and answers each request from its own
rows of every output, so the build must know whether the graph takes any batch at all and, for
each output, which axis follows the input batch:

- :func:`make_batch_dynamic`: a model whose inputs declare a constant batch (``[1, 3, 416, 416]``)
  gets a symbolic ``batch`` axis instead, kept only when the model then runs at batch 1, 2 and 3
  with every output following the batch. A Reshape to a constant ``[1, 6, -1]`` bakes batch 1 in
  (at batch 2 it glues the rows into one); such a graph keeps its declared batch.
- :func:`check_batch`: every output's batch axis, found by comparing batched runs with
  one-sample runs on real samples (usually axis 0; a ``[T, B, C]`` recognizer output has it on
  axis 1). A model that declares a dynamic batch but does not follow it is built for batch 1.
  For a fixed batch N > 1, a batch is compared with the same rows in reverse order.

A model whose graph bakes in its batch is built for exactly that batch (:attr:`BatchAxes.fixed`):
calibration and evaluation run in chunks of that many rows, and the daemon pads smaller batches
to it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import InternalError, ModelError, first_line

log = logging.getLogger(__name__)

BATCH_DIM = "batch"  # the symbolic name a constant batch axis is given
CHECK_BATCHES = (2, 3)  # batch sizes compared with one-sample runs
# Batched and one-sample results may differ by the kernels' rounding (another GEMM blocking):
# they count as equal within this fraction of the output's largest magnitude. Rows glued
# together or mixed across the batch miss it by orders of magnitude.
FOLLOW_RTOL = 1e-3


@dataclass(frozen=True)
class BatchTrial:
    """What :func:`make_batch_dynamic` did: the constant batch the inputs declared (None: they
    declare a dynamic one), whether it was made dynamic, and if not, why."""

    declared: int | None
    made_dynamic: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class BatchAxes:
    """The batch a model takes and where each output carries it.

    ``fixed``: the one batch size the graph runs at (None: any); ``output_axes``: output name to
    the axis that follows the input batch; ``checked_batches``: the batch sizes that were run.
    """

    fixed: int | None
    output_axes: dict[str, int]
    checked_batches: tuple[int, ...]
    declared: int | None = None
    made_dynamic: bool = False
    reason: str | None = None  # why the batch is fixed

    def to_report(self) -> dict[str, Any]:
        return {
            "declared": self.declared,
            "fixed": self.fixed,
            "made_dynamic": self.made_dynamic,
            "output_axes": dict(self.output_axes),
            "checked_batches": list(self.checked_batches),
            "fixed_because": self.reason,
        }


def declared_batch(model: Any) -> int | None:
    """The constant batch the model's inputs declare on their first axis, None when it is
    dynamic on every input.

    Raises:
        ModelError: two inputs declare different constant batches.
    """
    initializers = {init.name for init in model.graph.initializer}
    sizes = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in initializers or not dims:
            continue
        if dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            sizes[value.name] = int(dims[0].dim_value)
    if len(set(sizes.values())) > 1:
        raise ModelError("the model's inputs declare different batch sizes on their first axis; "
                         "give every input the same batch axis", found=sizes)
    return next(iter(sizes.values()), None)


def with_dynamic_batch(model: Any) -> Any:
    """A copy of ``model`` whose inputs' first axis is the symbolic ``batch``. The outputs'
    declared shapes and the graph's shape annotations (value_info) are dropped: they were
    inferred for the constant batch, and ONNX Runtime infers them again."""
    onnx = require("onnx", extra="host", purpose="rewriting ONNX models")
    dynamic = onnx.ModelProto()
    dynamic.CopyFrom(model)
    initializers = {init.name for init in dynamic.graph.initializer}
    for value in dynamic.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name not in initializers and dims:
            dims[0].dim_param = BATCH_DIM  # a oneof with dim_value: setting one clears the other
    for value in dynamic.graph.output:
        value.type.tensor_type.ClearField("shape")
    del dynamic.graph.value_info[:]
    return dynamic


def make_batch_dynamic(model: Any, samples: dict[str, np.ndarray], *, threads: int = 2
                       ) -> tuple[Any, BatchTrial]:
    """``model`` with a symbolic batch axis where its inputs declare a constant one and the graph
    takes any batch (it runs at batch 1, 2 and 3 on ``samples`` and every output follows the
    batch); otherwise ``model`` unchanged. See the module docstring."""
    declared = declared_batch(model)
    if declared is None:
        return model, BatchTrial(None)
    candidate = with_dynamic_batch(model)
    probe = _probe(candidate.SerializeToString(), samples, threads)
    if probe.problem is not None:
        log.warning("the model's batch stays fixed at %d: with a dynamic batch, %s", declared,
                    probe.problem)
        return model, BatchTrial(declared, False, probe.problem)
    _declare_outputs(candidate, model, probe.axes, probe.shapes)
    log.info("the model's constant batch %d was made dynamic: it runs at batch 1, %s with every "
             "output following the batch", declared, " and ".join(map(str, CHECK_BATCHES)))
    return candidate, BatchTrial(declared, True)


def check_batch(model_bytes: bytes, samples: dict[str, np.ndarray], trial: BatchTrial, *,
                threads: int = 2) -> BatchAxes:
    """Find each output's batch axis by running the model (``model_bytes``, as the build will
    quantize it) on real ``samples``; ``trial`` says what :func:`make_batch_dynamic` did.

    Raises:
        ModelError: the model does not run on the samples, or an output does not follow the
            input batch on any axis (a constant table, a batch reduced away).
    """
    fixed = None if trial.made_dynamic else trial.declared
    reason = trial.reason
    if fixed is None:
        probe = _probe(model_bytes, samples, threads)
        if probe.problem is None:
            return BatchAxes(None, probe.axes, (1, *CHECK_BATCHES), trial.declared,
                             trial.made_dynamic)
        if not probe.ran_one:
            raise ModelError(f"the model does not run on the calibration samples: {probe.problem}")
        if trial.made_dynamic:
            raise InternalError(f"the graph clean-up broke the dynamic batch: {probe.problem}")
        log.warning("the model declares a dynamic batch, but %s: it is built for batch 1",
                    probe.problem)
        fixed, reason = 1, probe.problem
    axes = _fixed_batch_axes(model_bytes, samples, fixed, threads, reason)
    return BatchAxes(fixed, axes, (fixed,), trial.declared, False, reason)


@dataclass(frozen=True)
class _Probe:
    axes: dict[str, int]  # output -> batch axis, when every output follows the batch
    shapes: dict[str, tuple[int, ...]]  # each output's shape at batch 1
    problem: str | None  # why the model does not take batches, in a few words
    ran_one: bool  # it ran at batch 1


def _probe(model_bytes: bytes, samples: dict[str, np.ndarray], threads: int) -> _Probe:
    """Run the model on one sample at a time and on batches of :data:`CHECK_BATCHES` samples,
    and find each output's batch axis (see :func:`follows_on`)."""
    try:
        session = _session(model_bytes, threads)
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
        return _Probe({}, {}, f"ONNX Runtime cannot load it ({first_line(exc)})", False)
    names = [output.name for output in session.get_outputs()]
    try:
        singles = [_run(session, names, _rows(samples, [index]))
                   for index in range(max(CHECK_BATCHES))]
    except Exception as exc:  # noqa: BLE001
        return _Probe({}, {}, f"it fails at batch 1 ({first_line(exc)})", False)
    shapes = {name: tuple(value.shape) for name, value in zip(names, singles[0])}
    axes: dict[str, int] = {}
    for batch in CHECK_BATCHES:
        try:
            batched = _run(session, names, _rows(samples, range(batch)))
        except Exception as exc:  # noqa: BLE001
            return _Probe({}, shapes, f"it fails at batch {batch} ({first_line(exc)})", True)
        for index, name in enumerate(names):
            axis = follows_on([single[index] for single in singles[:batch]], batched[index])
            if axis is None:
                return _Probe({}, shapes, (
                    f"output {name!r} at batch {batch} ({list(batched[index].shape)}) is not "
                    f"the one-sample results ({list(shapes[name])}) stacked on one axis"), True)
            if axes.setdefault(name, axis) != axis:
                return _Probe({}, shapes, f"output {name!r} follows the batch on axis "
                                          f"{axes[name]} at batch 2 but on axis {axis} at "
                                          f"batch {batch}", True)
    return _Probe(axes, shapes, None, True)


def follows_on(parts: Sequence[np.ndarray], batched: np.ndarray) -> int | None:
    """The axis along which ``batched`` (one output for a batch of samples) is the one-sample
    results ``parts`` stacked, within :data:`FOLLOW_RTOL`; the lowest such axis, None if none."""
    for axis in range(batched.ndim):
        try:
            joined = np.concatenate(parts, axis=axis)
        except ValueError:  # ranks or other axes differ
            return None
        if joined.shape == batched.shape and _close(joined, batched):
            return axis
    return None


def _close(want: np.ndarray, got: np.ndarray) -> bool:
    if want.dtype.kind != "f":
        return bool(np.array_equal(want, got))
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return False
    scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
    error = np.abs(want[finite].astype(np.float64) - got[finite])
    return bool(error.size == 0 or error.max() <= FOLLOW_RTOL * scale + 1e-7)


def _fixed_batch_axes(model_bytes: bytes, samples: dict[str, np.ndarray], fixed: int,
                      threads: int, reason: str | None) -> dict[str, int]:
    """Each output's batch axis for a graph that runs at batch ``fixed`` only: for batch 1, an
    axis of size 1 (the first; any gives the whole output to the one request); for more, the
    axis of that size that reverses when the batch's rows are given in reverse order."""
    try:
        session = _session(model_bytes, threads)
        names = [output.name for output in session.get_outputs()]
        rows = list(range(fixed))
        forward = _run(session, names, _rows(samples, rows))
        backward = _run(session, names, _rows(samples, rows[::-1])) if fixed > 1 else forward
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"the model does not run on the calibration samples at its batch "
                         f"{fixed}", reason=first_line(exc)) from None
    axes = {}
    for name, value, reversed_value in zip(names, forward, backward):
        candidates = [axis for axis, size in enumerate(value.shape) if size == fixed]
        if fixed > 1:
            candidates = [axis for axis in candidates
                          if _close(np.flip(value, axis=axis), reversed_value)]
        if not candidates:
            raise ModelError(f"output {name!r} does not follow the input batch (the daemon "
                             "answers each request from its own rows of every output): return "
                             "per-sample tensors only", found=list(value.shape), batch=fixed,
                             reason=reason)
        axes[name] = candidates[0]
    return axes


def _declare_outputs(candidate: Any, original: Any, axes: dict[str, int],
                     shapes: dict[str, tuple[int, ...]]) -> None:
    """Give ``candidate``'s outputs (shapes dropped by :func:`with_dynamic_batch`) the shape
    they were seen to have: ``batch`` on their batch axis, and elsewhere the size the original
    model declared where it matches the run (its declared rank may be wrong: ddddocr's
    recognizer declares ``[1, seqlen]`` and returns ``[T, 1, classes]``), else unknown."""
    declared = {value.name: value.type.tensor_type.shape.dim for value in original.graph.output}
    for value in candidate.graph.output:
        observed, axis = shapes[value.name], axes[value.name]
        original_dims = declared.get(value.name) or []
        matches = len(original_dims) == len(observed)
        shape = value.type.tensor_type.shape
        for index, size in enumerate(observed):
            dim = shape.dim.add()
            if index == axis:
                dim.dim_param = BATCH_DIM
            elif matches and original_dims[index].HasField("dim_param"):
                dim.dim_param = original_dims[index].dim_param
            elif matches and original_dims[index].dim_value == size:
                dim.dim_value = size


def _session(model_bytes: bytes, threads: int) -> Any:
    """A plain CPU session for a float model, silent: a graph that fails at a batch size is an
    expected answer here, and ONNX Runtime would print its own error line for it."""
    ort = require("onnxruntime", extra="host", purpose="checking the model's batch axis")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _run(session: Any, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = require("onnxruntime", extra="host", purpose="checking the model's batch axis")
    options = ort.RunOptions()
    options.log_severity_level = 4
    return [np.asarray(value) for value in session.run(names, feed, options)]


def _rows(samples: dict[str, np.ndarray], indices: Sequence[int]) -> dict[str, np.ndarray]:
    """The samples at ``indices`` as one batch, reusing samples when there are fewer."""
    count = len(next(iter(samples.values())))
    chosen = np.asarray(list(indices)) % count
    return {name: np.ascontiguousarray(array[chosen]) for name, array in samples.items()}


def run_in_chunks(model_bytes: bytes, samples: dict[str, np.ndarray], chunk: int, *,
                  threads: int = 2) -> list[list[np.ndarray]]:
    """Every output for ``samples`` run ``chunk`` rows at a time (the last chunk shorter), one
    list of outputs (graph order) per chunk: for comparing two models output by output without
    knowing their batch axes."""
    session = _session(model_bytes, threads)
    names = [output.name for output in session.get_outputs()]
    count = len(next(iter(samples.values())))
    return [_run(session, names, {name: array[start:start + chunk]
                                  for name, array in samples.items()})
            for start in range(0, count, chunk)]
