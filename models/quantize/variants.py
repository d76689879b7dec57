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

The result means what ``quantize_static`` with ``nodes_to_exclude`` gives, with one difference,
on purpose: ``quantize_static`` leaves an excluded node reading a dequantized tensor when the
tensor's other consumer still wants it quantized (it shares one pair among all consumers when
only one of them is quantized), so an excluded residual Add could still read INT8 values. Here
an excluded node always reads float. The quantized layers (:func:`models.quantize.qdq.quantized_layers`
with the excluded ones kept out) are the same.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
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
            AddQDQPairToWeight on).
        float_model: The float model it was made from (its node order decides, as in
            ``quantize_static``, which follower nodes are quantized).
        op_types: The op types ``quantize_static`` was asked to quantize.
        scales: Each calibrated tensor's own activation scale, as ``quantize_static`` computes it
            from the tensor's range.
    """

    def __init__(self, full_model: Any, float_model: Any, op_types: Collection[str],
                 scales: Mapping[str, np.ndarray]) -> None:
        self._onnx = require("onnx", extra="host", purpose="INT8 quantization")
        self.full_model = full_model
        self._op_types = frozenset(op_types)
        self._float_nodes = list(float_model.graph.node)
        self._float_tensors = _float_tensors(float_model)
        self._float_weights = {init.name for init in float_model.graph.initializer
                               if init.data_type in _FLOAT_TYPES}
        self._opset = next((entry.version for entry in float_model.opset_import
                            if entry.domain in ("", "ai.onnx")), 0)
        producers = {output: node for node in full_model.graph.node for output in node.output}
        # DequantizeLinear output -> the float tensor its QuantizeLinear reads.
        self._float_source: dict[str, str] = {}
        for node in full_model.graph.node:
            if node.op_type != DEQUANTIZE:
                continue
            quantize = producers.get(node.input[0])
            if quantize is not None and quantize.op_type == QUANTIZE:
                self._float_source[node.output[0]] = quantize.input[0]
        self._producers = producers
        self._scales = scales
        self._initializers = {init.name: init for init in full_model.graph.initializer}
        # A model output quantized for its producer: the producer writes this float source.
        self._output_of_source = {self._float_source[output.name]: output.name
                                  for output in full_model.graph.output
                                  if output.name in self._float_source}
        self._quantized_in_full = self._quantized_nodes(frozenset())
        self._shell = self._onnx.ModelProto()  # the full model less its graph's contents
        self._shell.CopyFrom(full_model)
        for field in ("node", "initializer", "value_info", "input", "output"):
            self._shell.graph.ClearField(field)

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
            tensors: Iterable[str] = node.output
            if node.op_type not in FOLLOWER_OP_TYPES or node.op_type in ("Gather", "GatherElements"):
                tensors = (*node.input, *node.output)
            marked.update(name for name in tensors if name in self._float_tensors)
        return quantized

    def _follows(self, node: Any, marked: set[str]) -> bool:
        """Whether ``quantize_static`` quantizes this follower node, given the tensors quantized
        before it."""
        if node.op_type == "MaxPool" and self._opset < 12 or node.op_type == "Resize" and self._opset < 11:
            return False
        if node.op_type in ("Gather", "GatherElements") and node.input[0] in self._float_weights:
            return True  # an embedding table is quantized as a weight
        if node.op_type == "Where":
            return len(node.input) == 3 and node.input[1] in marked and node.input[2] in marked
        return bool(node.input) and node.input[0] in marked

    def derive(self, excluded: Collection[str]) -> Any:
        """The QDQ model with the nodes ``excluded`` (and the followers that lose their
        quantized input with them) reading float tensors; the full model itself when that
        leaves everything as it is."""
        excluded = frozenset(excluded)
        quantized = self._quantized_nodes(excluded)
        in_float = excluded | (self._quantized_in_full - quantized)
        if not in_float:
            return self.full_model
        nodes = []
        for node in self.full_model.graph.node:
            if node.op_type not in (QUANTIZE, DEQUANTIZE) and node.name not in quantized:
                node = self._reading_float(node, every=node.name in in_float, in_float=in_float)
            nodes.append(node)
        graph_outputs = {output.name for output in self.full_model.graph.output}
        nodes, renamed = self._without_unused_pairs(nodes, graph_outputs, in_float)
        nodes, own_scales = self._unshared(nodes, in_float)
        return self._model(nodes, renamed, own_scales)

    def _reading_float(self, node: Any, *, every: bool, in_float: frozenset[str]) -> Any:
        """``node`` reading the float source instead of each dequantized input: ``every`` one,
        or those whose producer is in float (a node never quantized, a LayerNormalization, read
        a tensor dequantized only because its quantized producer quantized its output)."""
        def source(name: str) -> str:
            float_source = self._float_source.get(name)
            if float_source is None:
                return name
            producer = self._producers.get(float_source)
            if every or producer is not None and producer.name in in_float:
                return float_source
            return name

        inputs = [source(name) for name in node.input]
        if inputs == list(node.input):
            return node
        rewired = self._onnx.NodeProto()
        rewired.CopyFrom(node)
        rewired.input[:] = inputs
        return rewired

    def _without_unused_pairs(self, nodes: list[Any], graph_outputs: set[str],
                              in_float: frozenset[str]) -> tuple[list[Any], dict[str, str]]:
        """``nodes`` less the Q/DQ pairs that feed nothing now, and the renames (float source ->
        model output) that undo the quantization of a model output made by a float node."""
        read: dict[str, int] = {}
        for node in nodes:
            for name in node.input:
                read[name] = read.get(name, 0) + 1
        renamed: dict[str, str] = {}
        removed: set[int] = set()
        for index, node in enumerate(nodes):
            if node.op_type != DEQUANTIZE or node.output[0] not in self._float_source:
                continue
            output = node.output[0]
            if read.get(output):
                continue
            if output in graph_outputs:
                source = self._float_source[output]
                producer = self._producers.get(source)
                if producer is None or producer.name not in in_float:
                    continue  # a quantized node's INT8 output: quantize_static keeps it too
                renamed[source] = output
            removed.add(index)
            read[node.input[0]] -= 1
        for index, node in enumerate(nodes):
            if node.op_type == QUANTIZE and not read.get(node.output[0]):
                removed.add(index)
        kept = [node for index, node in enumerate(nodes) if index not in removed]
        if renamed:
            kept = [_renamed(node, renamed, self._onnx) for node in kept]
        return kept, renamed

    def _unshared(self, nodes: list[Any], in_float: frozenset[str]) -> tuple[list[Any], list[Any]]:
        """``nodes`` with every Q/DQ pair on the output of a node in float given that tensor's own
        scale where the full model has another (its producer's input's), and the new scale
        initializers."""
        numpy_helper = require("onnx.numpy_helper", extra="host", purpose="INT8 quantization")
        replaced: dict[str, str] = {}  # Q output -> the name of its tensor's own scale
        scales = []
        for node in nodes:
            if node.op_type != QUANTIZE or node.input[0] in self._initializers:
                continue
            producer = self._producers.get(node.input[0])
            own = self._scales.get(self._output_of_source.get(node.input[0], node.input[0]))
            current = self._initializers.get(node.input[1])
            if (producer is not None and producer.name in in_float and own is not None
                    and current is not None and not np.array_equal(numpy_helper.to_array(current), own)):
                replaced[node.output[0]] = f"{node.output[0]}_own_scale"
                scales.append(numpy_helper.from_array(own, replaced[node.output[0]]))
        if not replaced:
            return nodes, []
        result = []
        for node in nodes:
            if node.op_type == QUANTIZE and node.output[0] in replaced:
                node = _with_input(node, 1, replaced[node.output[0]], self._onnx)
            elif node.op_type == DEQUANTIZE and node.input[0] in replaced:
                node = _with_input(node, 1, replaced[node.input[0]], self._onnx)
            result.append(node)
        return result, scales

    def _model(self, nodes: list[Any], renamed: dict[str, str], extra_initializers: list[Any]) -> Any:
        """A model like the full one with ``nodes``, and only the initializers and value infos
        they use."""
        full = self.full_model
        used = {name for node in nodes for name in node.input}
        used.update(graph_input.name for graph_input in full.graph.input)
        produced = {name for node in nodes for name in node.output}
        model = self._onnx.ModelProto()
        model.CopyFrom(self._shell)
        graph = model.graph
        graph.node.extend(nodes)
        graph.input.extend(full.graph.input)
        graph.output.extend(full.graph.output)
        graph.initializer.extend(init for init in full.graph.initializer if init.name in used)
        graph.initializer.extend(extra_initializers)
        known = used | produced | set(renamed.values())
        graph.value_info.extend(info for info in full.graph.value_info
                                if info.name in known and info.name not in renamed)
        return model


def _with_input(node: Any, index: int, name: str, onnx: Any) -> Any:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[index] = name
    return copy


def _renamed(node: Any, renames: dict[str, str], onnx: Any) -> Any:
    if not any(name in renames for name in (*node.input, *node.output)):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[:] = [renames.get(name, name) for name in node.input]
    copy.output[:] = [renames.get(name, name) for name in node.output]
    return copy


def _float_tensors(model: Any) -> set[str]:
    """Names of the float tensors of a (shape-inferred) model: what ``quantize_static`` may
    quantize."""
    infos = (*model.graph.value_info, *model.graph.input, *model.graph.output)
    names = {info.name for info in infos
             if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type in _FLOAT_TYPES}
    names.update(init.name for init in model.graph.initializer if init.data_type in _FLOAT_TYPES)
    return names
