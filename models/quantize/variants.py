"""Mixed-precision variants of a fully quantized QDQ model, derived by editing its graph.

``quantize_static`` takes seconds a call on a model of a few hundred layers (about 6 s for a text
recognizer), and the mixed-precision search asks for a model per layer and per step. So the model
with every layer in INT8 is made once, with a dedicated Q/DQ pair for every consumer of a tensor
(which makes each pair belong to one node), and any set of layers is kept out of INT8 by taking
it out of that model:

- an excluded node reads the float tensors again: each of its inputs that a Q/DQ pair feeds
  (activations and weights) is wired back to the pair's float source, the weight initializer or
  the producer's output;
- a node that ``quantize_static`` quantizes only when its input is quantized (a ReLU, a reshape,
  max-pooling: :data:`FOLLOWER_OP_TYPES`) is treated as excluded when, with the excluded nodes
  left out, nothing would quantize that input, as ``quantize_static`` would find;
- Q/DQ nodes left feeding nothing are removed, with their scales and zero points; a pair that
  quantized a model output for an excluded producer is removed and the output renamed back;
- a pair left on the output of a node now in float takes that tensor's own scale: in the full
  model a reshape, a max-pooling or a split passes its input's scale on to its output, which
  ``quantize_static`` does not do for a node it leaves in float.

The result means what ``quantize_static`` with ``nodes_to_exclude`` gives: every node it would
quantize reads the same tensors dequantized, with the same scales, and the quantized layers
(:func:`models.quantize.qdq.quantized_layers` with the excluded ones kept out) are the same. With
one difference, on purpose: ``quantize_static`` shares one Q/DQ pair among all consumers of a
tensor when only one of them is quantized, so an excluded node (a residual Add, a convolution
beside a quantized one, a LayerNormalization it never quantizes) may still read the tensor's
INT8 values. Here such a node reads float, as TensorRT runs a layer left without Q/DQ on its
inputs. On a model with little INT8 headroom that difference shows: on a PP-OCRv4 text recognizer
(8 dB output SQNR fully INT8), with a random fifth of its layers excluded, the two models'
outputs were 7.4 and 9.7 dB from FP32 (top-1 agreement 99.6 and 100%), one layer's change
moving it by up to 1.4 dB either way; on a YOLOv8n detector they were within 0.2 dB.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.deps import require

QUANTIZE, DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"
# Op types quantize_static quantizes only when their (first) input is already quantized by a
# node before them (ONNX Runtime 1.x: QDQRemovableActivation, QDQDirect8BitOp and its
# subclasses, QDQGather): they pass INT8 on, they do not start it.
FOLLOWER_OP_TYPES = frozenset({
    "Relu", "Clip", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "AveragePool",
    "Slice", "TopK", "MaxPool", "Resize", "Gather", "GatherElements", "Where",
})
_FLOAT_TYPES = (1, 10)  # TensorProto.FLOAT, FLOAT16


class QdqVariants:
    """Derives a QDQ model with any set of nodes kept in float from the fully quantized one.

    Args:
        full_model: ``quantize_static``'s model with nothing excluded (DedicatedQDQPair and
            AddQDQPairToWeight on), serialized.
        float_model: The float model it was made from (its node order decides, as in
            ``quantize_static``, which follower nodes are quantized).
        op_types: The op types ``quantize_static`` was asked to quantize.
        scales: Each calibrated tensor's own activation scale, as ``quantize_static`` computes it
            from the tensor's range.
    """

    def __init__(self, full_model: bytes, float_model: Any, op_types: Collection[str],
                 scales: Mapping[str, np.ndarray]) -> None:
        self._onnx = require("onnx", extra="host", purpose="INT8 quantization")
        numpy_helper = require("onnx.numpy_helper", extra="host", purpose="INT8 quantization")
        self.full_bytes = full_model
        model = self._onnx.load_from_string(full_model)
        self._op_types = frozenset(op_types)
        self._float_nodes = [_Node.of(node) for node in float_model.graph.node]
        self._float_tensors = _float_tensors(float_model)
        self._float_weights = {init.name for init in float_model.graph.initializer
                               if init.data_type in _FLOAT_TYPES}
        self._opset = next((entry.version for entry in float_model.opset_import
                            if entry.domain in ("", "ai.onnx")), 0)
        self._pieces = _Pieces(model)
        self._nodes = [_Node.of(node) for node in self._pieces.protos]
        self._producer = {output: node.name for node in self._nodes for output in node.outputs}
        producer_node = {output: node for node in self._nodes for output in node.outputs}
        self._users: dict[str, list[int]] = {}  # tensor -> the nodes reading or writing it
        for index, node in enumerate(self._nodes):
            for name in (*node.inputs, *node.outputs):
                self._users.setdefault(name, []).append(index)
        self._graph_outputs = {output.name for output in model.graph.output}
        initializers = {init.name: init for init in model.graph.initializer}
        # DequantizeLinear output -> the float tensor its QuantizeLinear reads.
        self._float_source: dict[str, str] = {}
        for node in self._nodes:
            quantize = producer_node.get(node.inputs[0]) if node.op_type == DEQUANTIZE else None
            if quantize is not None and quantize.op_type == QUANTIZE:
                self._float_source[node.outputs[0]] = quantize.inputs[0]
        # Each activation pair's dequantizers (Q index -> DQ indices), and the tensor's own scale
        # where the full model's pair has another (its producer passed its input's scale on).
        self._pair_dequantizers: dict[int, list[int]] = {}
        self._own_scales: dict[int, np.ndarray] = {}
        for index, node in enumerate(self._nodes):
            if node.op_type != QUANTIZE or node.inputs[0] in initializers:
                continue
            self._pair_dequantizers[index] = [reader for reader in self._users[node.outputs[0]]
                                              if self._nodes[reader].op_type == DEQUANTIZE]
            # A model output quantized for its producer: the producer writes a renamed source.
            tensor = next((output for output in self._graph_outputs
                           if self._float_source.get(output) == node.inputs[0]), node.inputs[0])
            own, current = scales.get(tensor), initializers.get(node.inputs[1])
            if (own is not None and current is not None
                    and not np.array_equal(numpy_helper.to_array(current), own)):
                self._own_scales[index] = own
        self._quantized_in_full = self._quantized_nodes(frozenset())

    def _quantized_nodes(self, excluded: frozenset[str]) -> set[str]:
        """The nodes ``quantize_static`` would quantize with ``excluded`` left out: each node of
        a quantized op type in graph order, a follower only if a node before it quantized its
        input (what it then quantizes is marked for the nodes after it)."""
        quantized: set[str] = set()
        marked: set[str] = set()
        for node in self._float_nodes:
            if node.name in excluded or node.op_type not in self._op_types:
                continue
            if node.op_type in FOLLOWER_OP_TYPES and not self._follows(node, marked):
                continue
            quantized.add(node.name)
            tensors: Iterable[str] = node.outputs
            if node.op_type not in FOLLOWER_OP_TYPES or node.op_type in ("Gather", "GatherElements"):
                tensors = (*node.inputs, *node.outputs)
            marked.update(name for name in tensors if name in self._float_tensors)
        return quantized

    def _follows(self, node: _Node, marked: set[str]) -> bool:
        """Whether ``quantize_static`` quantizes this follower node, given the tensors quantized
        before it."""
        if node.op_type == "MaxPool" and self._opset < 12 or node.op_type == "Resize" and self._opset < 11:
            return False
        if node.op_type in ("Gather", "GatherElements") and node.inputs[0] in self._float_weights:
            return True  # an embedding table is quantized as a weight
        if node.op_type == "Where":
            return len(node.inputs) == 3 and node.inputs[1] in marked and node.inputs[2] in marked
        return bool(node.inputs) and node.inputs[0] in marked

    def derive(self, excluded: Collection[str]) -> bytes:
        """The QDQ model (serialized) with the nodes ``excluded`` (and the followers that lose
        their quantized input with them) reading float tensors.

        The result keeps the full model's invariants (:func:`models.quantize.qdq.check_qdq_format`):
        it only loses Q/DQ nodes, rewires nodes to the float tensors those fed, and gives some
        activation pairs another per-tensor scale."""
        excluded = frozenset(excluded)
        quantized = self._quantized_nodes(excluded)
        in_float = excluded | (self._quantized_in_full - quantized)
        if not in_float:
            return self.full_bytes
        variant = _Variant(self._nodes)
        for index, node in enumerate(self._nodes):
            if node.op_type not in (QUANTIZE, DEQUANTIZE) and node.name not in quantized:
                every = node.name in in_float
                variant.set_inputs(index, tuple(self._source(name, every, in_float)
                                                for name in node.inputs))
        renamed = self._remove_unused_pairs(variant, in_float)
        scales = self._unshare_scales(variant, in_float)
        return self._pieces.model(variant, renamed, scales, self._onnx)

    def _source(self, name: str, every: bool, in_float: frozenset[str]) -> str:
        """The tensor a node in float reads for ``name``: the float source of a dequantized
        input, for ``every`` one or those whose producer is in float too (a node never
        quantized, a LayerNormalization, read a tensor dequantized only because its quantized
        producer quantized its output)."""
        float_source = self._float_source.get(name)
        if float_source is None:
            return name
        if every or self._producer.get(float_source) in in_float:
            return float_source
        return name

    def _remove_unused_pairs(self, variant: _Variant, in_float: frozenset[str]) -> dict[str, str]:
        """Drop the Q/DQ pairs that feed nothing now; returns the renames (float source -> model
        output) that undo the quantization of a model output made by a node in float."""
        read: dict[str, int] = {}
        for index in range(len(self._nodes)):
            for name in variant.inputs[index]:
                read[name] = read.get(name, 0) + 1
        renamed: dict[str, str] = {}
        for index, node in enumerate(self._nodes):
            if node.op_type != DEQUANTIZE or node.outputs[0] not in self._float_source:
                continue
            output = node.outputs[0]
            if read.get(output):
                continue
            if output in self._graph_outputs:
                source = self._float_source[output]
                if self._producer.get(source) not in in_float:
                    continue  # a quantized node's INT8 output: quantize_static keeps it too
                renamed[source] = output
            variant.removed.add(index)
            read[node.inputs[0]] -= 1
        for index, node in enumerate(self._nodes):
            if node.op_type == QUANTIZE and not read.get(node.outputs[0]):
                variant.removed.add(index)
        for source, output in renamed.items():
            for index in {*self._users.get(source, ()), *variant.changed} - variant.removed:
                variant.rename(index, source, output)
        return renamed

    def _unshare_scales(self, variant: _Variant, in_float: frozenset[str]) -> list[Any]:
        """Give every pair left on the output of a node in float that tensor's own scale where
        the full model gives it its producer's input's; returns the new scale initializers."""
        numpy_helper = require("onnx.numpy_helper", extra="host", purpose="INT8 quantization")
        scales = []
        for index, own in self._own_scales.items():
            node = self._nodes[index]
            if index in variant.removed or self._producer.get(node.inputs[0]) not in in_float:
                continue
            name = f"{node.outputs[0]}_own_scale"
            scales.append(numpy_helper.from_array(own, name))
            for changed in (index, *self._pair_dequantizers[index]):
                inputs = list(variant.inputs[changed])
                inputs[1] = name
                variant.set_inputs(changed, tuple(inputs))
        return scales


@dataclass(frozen=True)
class _Node:
    """What a variant needs of a node, read once (protobuf fields are slow to read)."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def of(cls, proto: Any) -> _Node:
        return cls(proto.name, proto.op_type, tuple(proto.input), tuple(proto.output))


class _Variant:
    """The full model's nodes as one variant changes them: new inputs or outputs by node
    index, and the nodes removed."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.inputs = [node.inputs for node in nodes]
        self.outputs = [node.outputs for node in nodes]
        self.changed: set[int] = set()
        self.removed: set[int] = set()

    def set_inputs(self, index: int, inputs: tuple[str, ...]) -> None:
        if inputs != self.inputs[index]:
            self.inputs[index] = inputs
            self.changed.add(index)

    def rename(self, index: int, old: str, new: str) -> None:
        inputs = tuple(new if name == old else name for name in self.inputs[index])
        outputs = tuple(new if name == old else name for name in self.outputs[index])
        if (inputs, outputs) != (self.inputs[index], self.outputs[index]):
            self.inputs[index], self.outputs[index] = inputs, outputs
            self.changed.add(index)


class _Pieces:
    """The full model's parts, serialized once, from which a variant's bytes are put together:
    its weights (most of its bytes) are never serialized again. Protocol buffers allow a
    message's fields in any order, and a repeated field's items one after another."""

    _GRAPH, _NODE, _INITIALIZER, _VALUE_INFO = 7, 1, 5, 13  # ModelProto/GraphProto field numbers

    def __init__(self, full_model: Any) -> None:
        self.protos = list(full_model.graph.node)
        self._node_bytes = [_field(self._NODE, node.SerializeToString()) for node in self.protos]
        self._initializer_bytes = {init.name: _field(self._INITIALIZER, init.SerializeToString())
                                   for init in full_model.graph.initializer}
        self._value_info_bytes = {info.name: _field(self._VALUE_INFO, info.SerializeToString())
                                  for info in full_model.graph.value_info}
        self._graph_inputs = {graph_input.name for graph_input in full_model.graph.input}
        rest = type(full_model.graph)()
        rest.CopyFrom(full_model.graph)
        for name in ("node", "initializer", "value_info"):
            rest.ClearField(name)
        self._graph_rest = rest.SerializeToString()
        shell = type(full_model)()
        shell.CopyFrom(full_model)
        shell.ClearField("graph")
        self._model_rest = shell.SerializeToString()

    def model(self, variant: _Variant, renamed: dict[str, str], extra_initializers: list[Any],
              onnx: Any) -> bytes:
        """The variant's model: its nodes, ``extra_initializers``, and only the full model's
        initializers and value infos that its nodes use."""
        kept = [index for index in range(len(self.protos)) if index not in variant.removed]
        used = {name for index in kept for name in variant.inputs[index]} | self._graph_inputs
        known = used | {name for index in kept for name in variant.outputs[index]}
        parts = [self._graph_rest]
        for index in kept:
            if index in variant.changed:
                node = onnx.NodeProto()
                node.CopyFrom(self.protos[index])
                node.input[:] = variant.inputs[index]
                node.output[:] = variant.outputs[index]
                parts.append(_field(self._NODE, node.SerializeToString()))
            else:
                parts.append(self._node_bytes[index])
        parts.extend(piece for name, piece in self._initializer_bytes.items() if name in used)
        parts.extend(_field(self._INITIALIZER, init.SerializeToString())
                     for init in extra_initializers)
        parts.extend(piece for name, piece in self._value_info_bytes.items()
                     if name in known and name not in renamed)
        return self._model_rest + _field(self._GRAPH, b"".join(parts))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protocol buffer field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    encoded = bytearray()
    while value > 0x7F:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def _float_tensors(model: Any) -> set[str]:
    """Names of the float tensors of a (shape-inferred) model: what ``quantize_static`` may
    quantize."""
    infos = (*model.graph.value_info, *model.graph.input, *model.graph.output)
    names = {info.name for info in infos
             if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type in _FLOAT_TYPES}
    names.update(init.name for init in model.graph.initializer if init.data_type in _FLOAT_TYPES)
    return names
