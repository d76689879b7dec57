"""The opset upgrade of a user's ONNX model: a model below opset 13, which per-channel INT8
needs (QuantizeLinear's ``axis``), is converted with ONNX's version converter, and the converted
model is checked against the original on real samples before the build uses it.

Most published models were exported years ago (opset 9 to 12), and their users have no PyTorch
or Paddle source to export them again from. The converter rewrites the operators whose form
changed (Split, Squeeze and Unsqueeze take their axes as inputs from opset 13, Upsample became
Resize, ...), so the graph computes what it did; running both models on the calibration samples
proves it for this model. Only a model the converter cannot handle is refused, naming the node.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import ModelError, first_line
from models.batch_axis import declared_batch, run_in_chunks

log = logging.getLogger(__name__)

MIN_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (an axis attribute) needs 13
# What models/export.py writes for PyTorch models, and what TensorRT 8.5 (JetPack 5) parses.
TARGET_OPSET = 17
CHECK_SAMPLES = 8  # calibration samples both models are run on
# Outputs of a correct conversion equal the original's up to a kernel's rounding (the published
# models tried: at most 6e-7 of a softmax output); a wrongly converted operator is off by far
# more than this fraction of the output's largest magnitude.
CONVERSION_RTOL = 1e-4
_DEFAULT_DOMAINS = ("", "ai.onnx")


def default_opset(model: Any) -> int | None:
    """The model's opset of the standard ONNX domain (None when it imports none)."""
    versions = [entry.version for entry in model.opset_import if entry.domain in _DEFAULT_DOMAINS]
    return max(versions) if versions else None


def upgrade_opset(model: Any, samples: dict[str, np.ndarray], *, threads: int = 2
                  ) -> tuple[Any, dict[str, Any] | None]:
    """``model`` converted to :data:`TARGET_OPSET` when its opset is below :data:`MIN_OPSET`,
    with what was done for the report (None when nothing was); the converted model's every
    output is compared with the original's on up to :data:`CHECK_SAMPLES` of ``samples``.

    Raises:
        ModelError: the converter cannot convert a node (named), or the converted model's
            outputs differ from the original's.
    """
    opset = default_opset(model)
    if opset is None or opset >= MIN_OPSET:
        return model, None
    started = time.perf_counter()
    converted = convert(model, opset)
    outputs, count = compare_outputs(model, converted, samples, threads=threads)
    report = {
        "from_opset": opset,
        "to_opset": TARGET_OPSET,
        "converter": "onnx.version_converter",
        "checked_samples": count,
        "tolerance_relative": CONVERSION_RTOL,
        "outputs": outputs,
        "seconds": round(time.perf_counter() - started, 2),
    }
    for name, figures in outputs.items():
        if not figures["max_rel_error"] <= CONVERSION_RTOL:  # NaN fails too
            raise ModelError(
                f"the model converted from opset {opset} to {TARGET_OPSET} computes another "
                f"output {name!r} than the original (ONNX's version converter got an operator "
                f"wrong); export the model again with opset {MIN_OPSET} or newer",
                max_abs_error=f"{figures['max_abs_error']:.3g}",
                max_rel_error=f"{figures['max_rel_error']:.3g}", tolerance=CONVERSION_RTOL)
    worst = max((figures["max_rel_error"] for figures in outputs.values()), default=0.0)
    log.info("converted the model from opset %d to %d; its outputs match the original's on %d "
             "calibration samples (largest error %.1e of an output's range)", opset,
             TARGET_OPSET, count, worst)
    return converted, report


def convert(model: Any, opset: int) -> Any:
    """``model`` converted from ``opset`` to :data:`TARGET_OPSET` and checked.

    Raises:
        ModelError: the converter fails, naming the node it fails on where that can be found.
    """
    onnx = require("onnx", extra="host", purpose="converting ONNX opsets")
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model, TARGET_OPSET)
        onnx.checker.check_model(converted)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError, ConvertError, ...
        node = failing_node(model)
        where = f" at node {node.name!r} ({node.op_type})" if node is not None else ""
        raise ModelError(
            f"ONNX's version converter cannot convert the model from opset {opset} to "
            f"{TARGET_OPSET}{where}; export the model again with opset {MIN_OPSET} or newer"
            + (f", or replace its {node.op_type} operators" if node is not None else ""),
            node=node.name if node is not None else None,
            op_type=node.op_type if node is not None else None,
            reason=first_line(exc)) from None
    return converted


def failing_node(model: Any) -> Any | None:
    """The first standard-domain node of ``model`` that the converter cannot take to
    :data:`TARGET_OPSET`: an operator ONNX no longer defines there (ImageScaler, Crop), or one
    whose conversion fails on its own (converted as a one-node model), or leaves an operator
    deprecated at the target. None when no node alone fails."""
    require("onnx", extra="host", purpose="converting ONNX opsets")
    from onnx import defs, version_converter

    nodes = [node for node in model.graph.node if node.domain in _DEFAULT_DOMAINS]
    for node in nodes:
        try:
            defs.get_schema(node.op_type, TARGET_OPSET, "")
        except defs.SchemaError:
            return node
    tried = set()
    for node in nodes:
        signature = (node.op_type, tuple(attribute.SerializeToString() for attribute in node.attribute))
        if signature in tried or any(attribute.g.node or attribute.graphs
                                     for attribute in node.attribute):
            continue  # nodes with subgraphs (If, Loop) need their outer scope
        tried.add(signature)
        try:
            alone = version_converter.convert_version(_one_node_model(model, node), TARGET_OPSET)
        except Exception:  # noqa: BLE001
            return node
        if any(defs.get_schema(converted.op_type, TARGET_OPSET, "").deprecated
               for converted in alone.graph.node if converted.domain in _DEFAULT_DOMAINS):
            return node  # left as an operator the target opset no longer has
    return None


def _one_node_model(model: Any, node: Any) -> Any:
    """``node`` alone in a model of ``model``'s opsets: its constant inputs as initializers,
    the others as graph inputs of the types the model gives them (float where it does not)."""
    from onnx import TensorProto, helper

    initializers = {init.name: init for init in model.graph.initializer}
    constants = {output: candidate for candidate in model.graph.node
                 if candidate.op_type == "Constant" for output in candidate.output}
    types = {value.name: value.type.tensor_type.elem_type
             for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    inputs, inits, extra_nodes = [], [], []
    for name in dict.fromkeys(name for name in node.input if name):
        if name in initializers:
            inits.append(initializers[name])
        elif name in constants:
            extra_nodes.append(constants[name])
        else:
            inputs.append(helper.make_tensor_value_info(name, types.get(name) or TensorProto.FLOAT,
                                                        None))
    outputs = [helper.make_tensor_value_info(name, types.get(name) or TensorProto.FLOAT, None)
               for name in node.output if name]
    graph = helper.make_graph([*extra_nodes, node], "one_node", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=list(model.opset_import),
                             ir_version=model.ir_version)


def compare_outputs(original: Any, converted: Any, samples: dict[str, np.ndarray], *,
                    threads: int = 2) -> tuple[dict[str, dict[str, float]], int]:
    """Every output of ``converted`` against ``original`` on up to :data:`CHECK_SAMPLES`
    samples, run one at a time (or in chunks of the batch the model declares): the largest
    absolute error, and that error as a fraction of the output's largest magnitude. Also returns
    how many samples were run.

    Raises:
        ModelError: either model does not run on the samples.
    """
    chunk = declared_batch(original) or 1
    count = len(next(iter(samples.values())))
    # Whole chunks only: a graph of constant batch N runs N rows at a time, no fewer.
    used = max(chunk, min(CHECK_SAMPLES, count) // chunk * chunk)
    rows = np.arange(used) % count
    subset = {name: np.ascontiguousarray(array[rows]) for name, array in samples.items()}
    results = []
    for role, model in (("original", original), ("converted", converted)):
        try:
            results.append(run_in_chunks(model.SerializeToString(), subset, chunk,
                                         threads=threads))
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            raise ModelError(f"ONNX Runtime cannot run the {role} model on the calibration "
                             "samples", reason=first_line(exc)) from None
    names = [value.name for value in original.graph.output]
    figures: dict[str, dict[str, float]] = {}
    for index, name in enumerate(names):
        want = [chunk_outputs[index] for chunk_outputs in results[0]]
        got = [chunk_outputs[index] for chunk_outputs in results[1]]
        figures[name] = _errors(want, got)
    return figures, used


def _errors(want: list[np.ndarray], got: list[np.ndarray]) -> dict[str, float]:
    if any(a.shape != b.shape for a, b in zip(want, got)):
        return {"max_abs_error": float("inf"), "max_rel_error": float("inf")}
    reference = np.concatenate([a.astype(np.float64).ravel() for a in want])
    test = np.concatenate([b.astype(np.float64).ravel() for b in got])
    if not np.array_equal(np.isfinite(reference), np.isfinite(test)):
        return {"max_abs_error": float("nan"), "max_rel_error": float("nan")}
    finite = np.isfinite(reference)
    error = float(np.abs(reference[finite] - test[finite]).max()) if finite.any() else 0.0
    scale = float(np.abs(reference[finite]).max()) if finite.any() else 0.0
    return {"max_abs_error": error, "max_rel_error": error / scale if scale else error}
