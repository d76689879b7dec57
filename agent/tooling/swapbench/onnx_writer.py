"""A tiny real image classifier written as an ONNX file without the ``onnx`` package.

``edge-agent bench swap`` must run on a board with only the device extra (ONNX Runtime, no
``onnx``), so it encodes the few protobuf messages of its model itself: the ONNX schema
(onnx/onnx.proto) fixes the field numbers used below, and the wire format is protobuf's
(varints, length-delimited fields, little-endian fixed32).

The model: input ``input`` FP32 [batch, 3, height, width] -> Conv 3x3 (8 channels) -> ReLU ->
global average pool -> Flatten -> Gemm -> output ``logits`` FP32 [batch, 10]. Its faults, for the
benchmark's misbehaving versions (:data:`FAULTS`):

- ``disagree``: the classifier's weights negated, so it picks the least likely class: the canary
  sees decisions that differ from the serving version's;
- ``nan_on_negative``: NaN for every input whose mean is negative (``0 * sqrt(mean)``), the same
  answers as the healthy model otherwise: it passes a canary fed positive frames and regresses
  when the frames change after the commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

CLASSES = 10
FEATURES = 8
OPSET = 17  # ReduceMean's axes are still an attribute here (an input from opset 18)
IR_VERSION = 8
FAULTS = ("disagree", "nan_on_negative")

# protobuf wire types
_VARINT = 0
_LENGTH = 2

# onnx.proto enum values used here
_FLOAT = 1  # TensorProto.DataType
_INT64 = 7
_ATTRIBUTE_INTS = 7  # AttributeProto.AttributeType
_ATTRIBUTE_INT = 2


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 fields encode negatives as ten bytes
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _int(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(value)


def _bytes(number: int, value: bytes) -> bytes:
    return _key(number, _LENGTH) + _varint(len(value)) + value


def _text(number: int, value: str) -> bytes:
    return _bytes(number, value.encode())


def _messages(number: int, values: Iterable[bytes]) -> bytes:
    return b"".join(_bytes(number, value) for value in values)


def _tensor(name: str, array: np.ndarray) -> bytes:
    """TensorProto: dims = 1, data_type = 2, name = 8, raw_data = 9 (little-endian)."""
    kinds = {np.dtype(np.float32): _FLOAT, np.dtype(np.int64): _INT64}
    data_type = kinds[array.dtype]
    dims = b"".join(_int(1, int(size)) for size in array.shape)
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return dims + _int(2, data_type) + _text(8, name) + _bytes(9, raw)


def _attribute_ints(name: str, values: Sequence[int]) -> bytes:
    """AttributeProto: name = 1, ints = 8, type = 20."""
    return _text(1, name) + b"".join(_int(8, value) for value in values) + _int(
        20, _ATTRIBUTE_INTS)


def _attribute_int(name: str, value: int) -> bytes:
    """AttributeProto: name = 1, i = 3, type = 20."""
    return _text(1, name) + _int(3, value) + _int(20, _ATTRIBUTE_INT)


def _node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
          attributes: Sequence[bytes] = ()) -> bytes:
    """NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5."""
    return (b"".join(_text(1, value) for value in inputs)
            + b"".join(_text(2, value) for value in outputs)
            + _text(3, name) + _text(4, op_type) + _messages(5, attributes))


def _value_info(name: str, dims: Sequence[int | str]) -> bytes:
    """ValueInfoProto (name = 1, type = 2) of an FP32 tensor: TypeProto.tensor_type = 1 holds
    elem_type = 1 and shape = 2; each TensorShapeProto.dim = 1 is dim_value = 1 or
    dim_param = 2."""
    shape = _messages(1, (_int(1, dim) if isinstance(dim, int) else _text(2, dim)
                          for dim in dims))
    tensor_type = _int(1, _FLOAT) + _bytes(2, shape)
    return _text(1, name) + _bytes(2, _bytes(1, tensor_type))


def classifier_bytes(*, seed: int = 0, fault: str | None = None) -> bytes:
    """The serialized ModelProto of the tiny classifier (module docstring), weights drawn from
    ``seed``, with the ``fault`` of :data:`FAULTS` asked for (None: healthy)."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
    rng = np.random.default_rng(seed)
    conv_w = rng.normal(0, 0.5, (FEATURES, 3, 3, 3)).astype(np.float32)
    conv_b = rng.normal(0, 0.1, FEATURES).astype(np.float32)
    fc_w = rng.normal(0, 0.5, (CLASSES, FEATURES)).astype(np.float32)
    fc_b = rng.normal(0, 0.1, CLASSES).astype(np.float32)
    if fault == "disagree":
        fc_w, fc_b = -fc_w, -fc_b
    initializers = [_tensor("conv_w", conv_w), _tensor("conv_b", conv_b),
                    _tensor("fc_w", fc_w), _tensor("fc_b", fc_b)]
    last = "logits" if fault != "nan_on_negative" else "clean"
    nodes = [
        _node("Conv", ["input", "conv_w", "conv_b"], ["conv"], "conv",
              [_attribute_ints("pads", [1, 1, 1, 1])]),
        _node("Relu", ["conv"], ["relu"], "relu"),
        _node("GlobalAveragePool", ["relu"], ["pool"], "pool"),
        _node("Flatten", ["pool"], ["flat"], "flatten"),
        _node("Gemm", ["flat", "fc_w", "fc_b"], [last], "fc", [_attribute_int("transB", 1)]),
    ]
    if fault == "nan_on_negative":
        initializers += [_tensor("zero", np.array(0.0, np.float32)),
                         _tensor("axis", np.array([1], np.int64))]
        nodes += [
            _node("ReduceMean", ["input"], ["mean"], "mean",
                  [_attribute_ints("axes", [1, 2, 3]), _attribute_int("keepdims", 0)]),
            _node("Sqrt", ["mean"], ["root"], "root"),
            _node("Mul", ["root", "zero"], ["nothing"], "nothing"),
            _node("Unsqueeze", ["nothing", "axis"], ["column"], "column"),
            _node("Add", ["clean", "column"], ["logits"], "fault"),
        ]
    # GraphProto: node = 1, name = 2, initializer = 5, input = 11, output = 12.
    graph = (_messages(1, nodes) + _text(2, "tiny") + _messages(5, initializers)
             + _bytes(11, _value_info("input", ["batch", 3, "height", "width"]))
             + _bytes(12, _value_info("logits", ["batch", CLASSES])))
    # ModelProto: ir_version = 1, producer_name = 2, graph = 7, opset_import = 8 (domain = 1,
    # version = 2).
    opset = _text(1, "") + _int(2, OPSET)
    return (_int(1, IR_VERSION) + _text(2, "edge-agent bench swap") + _bytes(7, graph)
            + _bytes(8, opset))


def write_classifier(path: Path, *, seed: int = 0, fault: str | None = None) -> Path:
    """:func:`classifier_bytes` written to ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(classifier_bytes(seed=seed, fault=fault))
    return path


__all__ = ["CLASSES", "FAULTS", "classifier_bytes", "write_classifier"]
