"""What an ONNX graph tells about its outputs, for choosing how each is judged
(:mod:`models.quantize.judges`): the activation that ends an output and its axis (walking back
through ops that keep the shape, and through Transposes, whose permutation moves the axis), the
op that made its values, the heads a Concat joined into it, and a 4-D output's layout.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Ops that keep a tensor's shape and axes: an activation behind them still names the output's
# axes (walking back from an output).
_SHAPE_KEEPING_OPS = frozenset({
    "Identity", "Cast", "LeakyRelu", "Clip", "Tanh", "Neg", "Abs", "Exp", "Log", "Sqrt",
    "Add", "Sub", "Mul", "Div", "Pow", "Dropout"})
# Ops that rearrange a tensor without computing anything: the op that made the values is
# behind them (walking back to where an output comes from).
_REARRANGING_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})
_ACTIVATIONS = {"Softmax": "softmax", "LogSoftmax": "softmax", "Sigmoid": "sigmoid",
                "HardSigmoid": "sigmoid", "Relu": "relu"}
_WALK_LIMIT = 16  # nodes walked back from an output before giving up


@dataclass(frozen=True)
class OutputFacts:
    """What the graph tells about one output (:func:`output_facts`).

    Attributes:
        activation: ``"softmax"``, ``"sigmoid"`` or ``"relu"`` where one ends the output
            (behind ops that keep its shape), else None.
        axis: The softmax's axis as an axis of the output (may be negative: from the end).
        flattened: The softmax runs over every axis from ``axis`` on, flattened (a Softmax
            before opset 13, or the Flatten/Softmax/Reshape that ONNX's version converter makes
            of one): per-axis classes only where ``axis`` is the last axis.
        source: The op that made the output's values, behind ops that only rearrange them
            (``"Concat"``, ``"MatMul"``, ``"Gemm"``, ``"Conv"``, ...).
        source_size: Where a Reshape or Flatten lies between that op and the output: the
            number of values per sample that op made (static axes after the first), None
            when unknown or not reshaped. A last axis of another size merged several axes
            (a sequence of scores flattened into one row): its classes cannot be told.
        parts: Where a Concat made the output (behind shape-keeping ops and Transposes): the
            output's axis it joined along and the size of each input on it (boxes beside
            class scores: values of different units, each judged on its own).
        layout: ``"NCHW"`` or ``"NHWC"`` for a 4-D output, else None.
    """

    activation: str | None = None
    axis: int | None = None
    flattened: bool = False
    source: str | None = None
    source_size: int | None = None
    parts: tuple[int, tuple[int, ...]] | None = None
    layout: str | None = None


def output_facts(model: Any, output_layout: str | None = None) -> dict[str, OutputFacts]:
    """What the graph of ``model`` (an ONNX ModelProto) tells about each output: which
    activation ends it, on which axis, what made it, the heads a Concat joined and, for 4-D
    outputs, the layout (``output_layout`` given, else
    :func:`models.onnx_model.output_layout`)."""
    from models.onnx_model import graph_links, image_layout, io_specs
    from models.onnx_model import output_layout as told_layout

    inputs, outputs = io_specs(model)
    producers, _ = graph_links(model.graph)
    constants = {init.name for init in model.graph.initializer}
    opset = max((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")),
                default=13)
    input_layout = image_layout(model, inputs[0])
    shapes: dict[str, tuple[int, ...]] | None = None
    facts = {}
    for spec in outputs:
        activation, axis, flattened = _activation(spec.name, producers, constants, opset)
        source, reshaped_from = _source(spec.name, producers, constants)
        source_size, parts = None, None
        if reshaped_from is not None or source == "Concat":
            shapes = _static_shapes(model) if shapes is None else shapes
        if reshaped_from is not None and shapes is not None:
            dims = shapes.get(reshaped_from, ())
            if len(dims) >= 2 and min(dims[1:]) > 0:
                source_size = int(np.prod(dims[1:]))
        if source == "Concat" and shapes is not None:
            parts = _concat_parts(spec.name, producers, shapes)
        layout = None
        if len(spec.shape) == 4:
            layout = output_layout or told_layout(model, spec, input_layout)
        facts[spec.name] = OutputFacts(activation, axis, flattened, source, source_size, parts,
                                       layout)
    return facts


def _static_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape (-1 for an axis it does not tell), by ONNX's shape inference, for
    the tensors whose rank it tells."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types; go without shapes
        log.debug("shape inference for the judges failed: %s", exc)
        return {}
    graph = inferred.graph
    shapes = {init.name: tuple(int(dim) for dim in init.dims) for init in graph.initializer}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[value.name] = tuple(dim.dim_value if dim.HasField("dim_value") else -1
                                       for dim in tensor_type.shape.dim)
    return shapes


def _data_input(node: Any, constants: set[str]) -> str | None:
    """The input of ``node`` that carries data (not a weight or a constant)."""
    return next((name for name in node.input if name and name not in constants), None)


def _attribute(node: Any, name: str, default: int) -> int:
    return next((int(attribute.i) for attribute in node.attribute if attribute.name == name),
                default)


def _through_transpose(node: Any, to_output: list[int] | None) -> list[int] | None:
    """``to_output`` (the axis of the tensor reached -> the output's axis; None: the identity,
    rank unknown) one Transpose further back; None where the Transpose has no permutation."""
    perm = [int(axis) for attribute in node.attribute if attribute.name == "perm"
            for axis in attribute.ints]
    if not perm:
        return None
    mapping = to_output if to_output is not None else list(range(len(perm)))
    # output = transpose(input, perm): the input's axis j is the output's perm.index(j).
    return [mapping[perm.index(axis)] for axis in range(len(perm))]


def _activation(name: str, producers: Mapping[str, Any], constants: set[str],
                opset: int) -> tuple[str | None, int | None, bool]:
    """The activation that ends tensor ``name``, a softmax's axis as an axis of ``name``, and
    whether that softmax runs over the axes from there on flattened (see
    :attr:`OutputFacts.flattened`)."""
    to_output: list[int] | None = None
    for _ in range(_WALK_LIMIT):
        node = producers.get(name)
        if node is None:
            return None, None, False
        if node.op_type in ("Softmax", "LogSoftmax"):
            # Before opset 13 the axis flattens the tensor from there on.
            axis = _attribute(node, "axis", -1 if opset >= 13 else 1)
            flattened = opset < 13 and axis != -1
            if to_output is not None:
                if flattened:
                    return None, None, False  # a flattened softmax behind a Transpose
                axis = to_output[axis % len(to_output)]
            return "softmax", axis, flattened
        if node.op_type == "Reshape" and to_output is None:
            converted = _converted_softmax(node, producers)
            if converted is not None:
                return "softmax", converted, True
        if node.op_type in _ACTIVATIONS:
            return _ACTIVATIONS[node.op_type], None, False
        if node.op_type == "Transpose":
            to_output = _through_transpose(node, to_output)
            if to_output is None:
                return None, None, False
        elif node.op_type not in _SHAPE_KEEPING_OPS:
            return None, None, False
        data = _data_input(node, constants)
        if data is None:
            return None, None, False
        name = data
    return None, None, False


def _converted_softmax(reshape: Any, producers: Mapping[str, Any]) -> int | None:
    """The axis of an old Softmax that ONNX's version converter rewrote as
    ``Reshape(Softmax(Flatten(x, axis), axis=-1), Shape(x))``, else None."""
    if len(reshape.input) < 2:
        return None
    shape, softmax = producers.get(reshape.input[1]), producers.get(reshape.input[0])
    if shape is None or shape.op_type != "Shape" or softmax is None or softmax.op_type not in (
            "Softmax", "LogSoftmax") or _attribute(softmax, "axis", -1) not in (-1, 1):
        return None
    flatten = producers.get(softmax.input[0])
    if flatten is None or flatten.op_type != "Flatten" or flatten.input[0] != shape.input[0]:
        return None
    return _attribute(flatten, "axis", 1)


def _source(name: str, producers: Mapping[str, Any], constants: set[str]
            ) -> tuple[str | None, str | None]:
    """The op that made the values of tensor ``name`` (behind rearranging ops and biases), and
    where a Reshape or Flatten lies between, the tensor that op made."""
    reshaped = False
    for _ in range(_WALK_LIMIT):
        node = producers.get(name)
        if node is None:
            return None, None
        if node.op_type not in _REARRANGING_OPS and node.op_type not in ("Add", "Identity",
                                                                         "Cast"):
            return str(node.op_type), name if reshaped else None
        reshaped = reshaped or node.op_type in ("Reshape", "Flatten")
        data = _data_input(node, constants)
        if data is None:
            return None, None
        name = data
    return None, None


def _concat_parts(name: str, producers: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                  ) -> tuple[int, tuple[int, ...]] | None:
    """The output's axis a Concat joined tensor ``name`` along (behind Transposes and casts),
    and each input's size on it; None where it cannot be told or joins along the batch."""
    to_output: list[int] | None = None
    for _ in range(_WALK_LIMIT):
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Concat":
            dims = [shapes.get(part, ()) for part in node.input]
            if not dims or any(not shape for shape in dims):
                return None
            axis = _attribute(node, "axis", 0) % len(dims[0])
            sizes = tuple(shape[axis] if len(shape) > axis else -1 for shape in dims)
            if to_output is not None:
                axis = to_output[axis]
            if axis == 0 or len(sizes) < 2 or min(sizes) <= 0:
                return None
            return axis, sizes
        if node.op_type == "Transpose":
            to_output = _through_transpose(node, to_output)
            if to_output is None:
                return None
        elif node.op_type not in ("Identity", "Cast"):
            return None
        name = node.input[0]
    return None
