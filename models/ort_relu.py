"""An ONNX Runtime-only rewrite of symmetric INT8 QDQ models: fold each ReLU into the quantization
of its producer.

The bundle's model keeps every activation symmetric (zero point 0), as TensorRT requires, so a
``Conv -> Q -> DQ -> Relu -> Q -> DQ`` chain cannot drop its ReLU: a zero point of 0 keeps negative
values. ONNX Runtime's CPU provider then runs every such ReLU as a float round trip (dequantize,
ReLU, quantize) between two ``QLinearConv`` kernels. ONNX Runtime removes a ReLU by itself when the
single QuantizeLinear after it has the type's lowest zero point (-128 for INT8): quantizing then
clips at zero. So, for the session only, this rewrite

* connects the producer (Conv, Add, ...) straight to the ReLU (the pre-ReLU Q/DQ pair goes), and
* gives the Q after the ReLU, and the DQs that read it, zero point -128 and scale
  ``s * 127 / 255``: the same range ``[0, 127 s]`` as before at a finer step.

A ReLU whose output feeds several Qs (a residual block's output) is left alone: ONNX Runtime only
folds a ReLU into a single Q, and two Qs on an ``Add`` stop it from using ``QLinearAdd``.

ResNet-18 (pruned, INT8, 224x224, 2 threads): 10 of 17 ReLUs folded, about 10% faster; logits
within INT8 noise of the original and the same predictions. TensorRT fuses these ReLUs itself
and never sees this rewrite.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def fold_relu_into_quantize(model: Any) -> int:
    """Rewrite ``model`` (an ``onnx.ModelProto``) in place; returns how many ReLUs were folded."""
    from onnx import numpy_helper

    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in graph.output}

    def only_consumer(tensor: str, op_type: str) -> Any:
        users = consumers.get(tensor, [])
        if len(users) != 1 or users[0].op_type != op_type or tensor in graph_outputs:
            return None
        return users[0]

    def symmetric_int8(node: Any) -> bool:
        if len(node.input) < 3 or node.input[2] not in initializers:
            return False
        zero_point = numpy_helper.to_array(initializers[node.input[2]])
        scale = initializers.get(node.input[1])
        return (zero_point.dtype == np.int8 and zero_point.size == 1 and int(zero_point) == 0
                and scale is not None and numpy_helper.to_array(scale).size == 1)

    removed: set[int] = set()
    folded = 0
    for relu in graph.node:
        if relu.op_type != "Relu":
            continue
        pre_dq = producer.get(relu.input[0])
        if pre_dq is None or pre_dq.op_type != "DequantizeLinear" or not symmetric_int8(pre_dq):
            continue
        pre_q = producer.get(pre_dq.input[0])
        if (pre_q is None or pre_q.op_type != "QuantizeLinear" or not symmetric_int8(pre_q)
                or only_consumer(pre_dq.output[0], "Relu") is None
                or only_consumer(pre_q.output[0], "DequantizeLinear") is None
                or only_consumer(pre_q.input[0], "QuantizeLinear") is None):
            continue
        post_q = only_consumer(relu.output[0], "QuantizeLinear")
        if post_q is None or not symmetric_int8(post_q):
            continue
        post_dqs = consumers.get(post_q.output[0], [])
        if not post_dqs or any(dq.op_type != "DequantizeLinear" or dq.input[1:3] != post_q.input[1:3]
                               for dq in post_dqs):
            continue
        scale = numpy_helper.to_array(initializers[post_q.input[1]]).astype(np.float32)
        new_scale = numpy_helper.from_array(scale * np.float32(127.0 / 255.0),
                                            f"{post_q.output[0]}_relu_folded_scale")
        new_zero = numpy_helper.from_array(np.full(scale.shape, -128, dtype=np.int8),
                                           f"{post_q.output[0]}_relu_folded_zero_point")
        graph.initializer.extend([new_scale, new_zero])
        relu.input[0] = pre_q.input[0]
        for node in (post_q, *post_dqs):
            node.input[1], node.input[2] = new_scale.name, new_zero.name
        removed.update((id(pre_q), id(pre_dq)))
        folded += 1
    if removed:
        kept = [node for node in graph.node if id(node) not in removed]
        del graph.node[:]
        graph.node.extend(kept)
    return folded
