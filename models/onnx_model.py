"""Reading and describing ONNX models given by the user, with errors that name the problem."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.deps import require
from agent.errors import ModelError

# ONNX TensorProto element types to numpy dtype names (the ones a vision model's I/O uses).
_ELEM_TYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "float16", 11: "float64"}


@dataclass(frozen=True)
class TensorSpec:
    """An input or output: name, numpy dtype name, shape with -1 for dynamic axes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]  # symbolic names ("batch", "height"), "" for static axes

    def to_manifest(self, layout: str | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if layout:
            entry["layout"] = layout
        return entry


def graph_links(graph: Any) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """An ONNX graph's wiring: tensor name -> the node producing it, and tensor name -> the nodes
    reading it (in graph order)."""
    producers = {output: node for node in graph.node for output in node.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producers, consumers


def load_onnx(path: Path) -> Any:
    """Load and check an ONNX file; a missing, truncated or invalid file raises ModelError."""
    onnx = require("onnx", extra="host", purpose="reading ONNX models")
    path = Path(path)
    if path.is_dir():
        raise ModelError("the ONNX model path is a directory, not a file", path=path)
    if not path.is_file():
        raise ModelError("ONNX model not found", path=path)
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and friends
        if "should be stored in" in str(exc):  # onnx names the external data file it lacks
            raise ModelError(f"the model's external data cannot be read (keep the data file "
                             f"beside the .onnx file): {exc}", path=path) from exc
        raise ModelError(f"not a readable ONNX model (corrupt or truncated?): {exc}", path=path) from exc
    if not model.graph.node:
        raise ModelError("ONNX model has no nodes (empty or truncated file?)", path=path)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelError(f"invalid ONNX model: {str(exc).splitlines()[0]}", path=path) from exc
    return model


def _spec(value_info: Any) -> TensorSpec:
    tensor_type = value_info.type.tensor_type
    dims = []
    names = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(int(dim.dim_value))
            names.append("")
        else:
            dims.append(-1)
            names.append(dim.dim_param or "?")
    dtype = _ELEM_TYPES.get(tensor_type.elem_type)
    if dtype is None:
        raise ModelError(
            "unsupported tensor element type", tensor=value_info.name, elem_type=tensor_type.elem_type
        )
    return TensorSpec(value_info.name, dtype, tuple(dims), tuple(names))


# Ops of a model that is quantized already; the pipeline quantizes float models. ONNX Runtime's
# contrib quantized ops (DynamicQuantizeLSTM, QGemm, QLinearAdd, ...) are matched by name.
_QUANTIZED_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                  "QLinearMatMul", "ConvInteger", "MatMulInteger"}
_STANDARD_DOMAINS = ("", "ai.onnx")


def _is_quantized_op(op_type: str) -> bool:
    return (op_type in _QUANTIZED_OPS or "Quantize" in op_type
            or op_type.startswith(("QLinear", "QGemm", "QAttention")))


def check_float_model(model: Any, path: Path | None = None) -> None:
    """Refuse, before any work, an ONNX model the build cannot quantize: one quantized already,
    one with operators outside the standard ONNX domain, or inputs that are not floating point.
    An old opset is converted (models.onnx_upgrade) and the batch axis checked by running the
    model (models.batch_axis), not refused here."""
    where = {"path": path} if path is not None else {}
    quantized = sorted({node.op_type for node in model.graph.node if _is_quantized_op(node.op_type)})
    if quantized:
        raise ModelError("the ONNX model is quantized already; give the float model",
                         found=quantized, **where)
    foreign = next((node for node in model.graph.node if node.domain not in _STANDARD_DOMAINS),
                   None)
    if foreign is not None:
        raise ModelError(
            f"node {foreign.name!r} is a {foreign.domain} {foreign.op_type} operator, not a "
            "standard ONNX one: the INT8 build and TensorRT take standard ONNX operators only "
            "(a model saved by ONNX Runtime's graph optimizer carries its fused com.microsoft "
            "operators); export the model again, without such operators",
            node=foreign.name, op_type=foreign.op_type, domain=foreign.domain, **where)
    inputs, _ = io_specs(model)
    for spec in inputs:
        if not spec.dtype.startswith("float"):
            raise ModelError("the build calibrates floating-point inputs only", input=spec.name,
                             found=spec.dtype, **where)


def check_batch_outputs(model: Any, path: Path | None = None) -> None:
    """Refuse outputs without a dynamic batch axis first (a scalar, a constant table of anchors,
    a batch reduced away): the daemon batches requests and answers each from its own row.
    Outputs whose shape the graph does not state are left to the later checks."""
    where = {"path": path} if path is not None else {}
    for value in model.graph.output:
        tensor_type = value.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if not dims or (dims[0].HasField("dim_value") and dims[0].dim_value > 0):
            shape = [dim.dim_value if dim.HasField("dim_value") else -1 for dim in dims]
            raise ModelError("every model output needs the batch as its first, dynamic axis (the "
                             "daemon batches requests and answers each from its own row); return "
                             "per-sample tensors only", output=value.name, found=shape, **where)


def io_specs(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's real inputs (initializers excluded) and outputs."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_spec(value) for value in model.graph.input if value.name not in initializers]
    outputs = [_spec(value) for value in model.graph.output]
    if not inputs:
        raise ModelError("ONNX model has no inputs")
    return inputs, outputs


# Transposes of a 4-D tensor: to channels-first (as an NHWC graph from tf2onnx starts), and to
# channels-last (as a graph that returns NHWC ends).
TO_CHANNELS_FIRST_PERMS = ((0, 3, 1, 2),)
TO_CHANNELS_LAST_PERMS = ((0, 2, 3, 1),)


def image_layout(model: Any, spec: TensorSpec) -> str | None:
    """``"NCHW"`` or ``"NHWC"`` for a 4-D input, None for other ranks.

    A graph that transposes the input to channels-first straight away (as tf2onnx exports do) is
    NHWC; otherwise the axis holding a fixed channel count decides (NCHW when axis 1 is fixed and
    axis 3 is not, or is much larger, NHWC the other way round; NCHW when it cannot be told).

    Raises:
        ModelError: neither axis 1 nor axis 3 is fixed, so no axis can be the channels.
    """
    if len(spec.shape) != 4:
        return None
    _, consumers = graph_links(model.graph)
    for node in consumers.get(spec.name, []):
        if node.op_type == "Transpose":
            perm = next((tuple(attribute.ints) for attribute in node.attribute
                         if attribute.name == "perm"), ())
            if perm in TO_CHANNELS_FIRST_PERMS:
                return "NHWC"
    second, last = spec.shape[1], spec.shape[3]
    if second < 0 and last < 0:
        raise ModelError("4-D input has no fixed channel axis (axis 1 for NCHW, axis 3 for NHWC); "
                         "export it with a fixed channel count", input=spec.name,
                         found=list(spec.shape))
    if second < 0 or (0 < last <= 4 < second):
        return "NHWC"
    return "NCHW"


# Operations an output may pass through after its layout was set: they keep the tensor's shape.
_SHAPE_KEEPING_OPS = frozenset({"Softmax", "LogSoftmax", "Sigmoid", "Relu", "Clip", "Tanh",
                                "Identity", "Cast", "Add", "Sub", "Mul", "Div", "HardSigmoid"})


def output_layout(model: Any, spec: TensorSpec, input_layout: str | None = None) -> str | None:
    """``"NCHW"`` or ``"NHWC"`` for a 4-D output (where its classes or channels are), None for
    other ranks.

    Told, in this order, by the graph (walking back through shape-keeping operations such as a
    softmax: a Transpose to channels-last or channels-first, or a Softmax over the last axis or
    axis 1), by which of axis 1 and axis 3 has a fixed size while the other is dynamic, and
    otherwise by ``input_layout`` (NCHW when that is unknown too).
    """
    if len(spec.shape) != 4:
        return None
    producer, _ = graph_links(model.graph)
    name = spec.name
    for _ in range(8):
        node = producer.get(name)
        if node is None:
            break
        attributes = {attribute.name: attribute for attribute in node.attribute}
        if node.op_type == "Transpose" and "perm" in attributes:
            perm = tuple(attributes["perm"].ints)
            if perm in TO_CHANNELS_LAST_PERMS:
                return "NHWC"
            if perm in TO_CHANNELS_FIRST_PERMS:
                return "NCHW"
            break
        if node.op_type in ("Softmax", "LogSoftmax") and "axis" in attributes:
            axis = attributes["axis"].i
            if axis in (-1, 3):
                return "NHWC"
            if axis in (1, -3):
                return "NCHW"
        if node.op_type not in _SHAPE_KEEPING_OPS or not node.input:
            break
        name = node.input[0]
    second, last = spec.shape[1], spec.shape[3]
    if second < 0 <= last:
        return "NHWC"
    if last < 0 <= second:
        return "NCHW"
    return input_layout if input_layout in ("NCHW", "NHWC") else "NCHW"


def spatial_axes(layout: str | None) -> tuple[int, int] | None:
    """The (height, width) axes of a 4-D input of ``layout``."""
    return {"NCHW": (2, 3), "NHWC": (1, 2)}.get(layout or "")
