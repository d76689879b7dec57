"""Where an ONNX file's weights lie (models/onnx_wire.py), and the QuantizeLinear scan that skips
them (models/ort.py ``_may_quantize``), on small real models built with the onnx helper API."""

from __future__ import annotations

import builtins
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper

from models import ort as models_ort
from models.onnx_wire import Malformed, initializer_spans


def float_model(weight: np.ndarray, *, extra_nodes: list | None = None,
                functions: list | None = None) -> Any:
    """input [n, 4] -> MatMul with ``weight`` [4, k] -> output (and ``extra_nodes`` after)."""
    nodes = [helper.make_node("MatMul", ["input", "w"], ["out"], name="matmul"),
             *(extra_nodes or [])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("local", 1)],
                              functions=functions or [])
    model.ir_version = 8
    return model


def weight_naming_the_op(columns: int = 64) -> np.ndarray:
    """A float weight whose raw bytes spell QuantizeLinear (a float model's weights may hold any
    bytes)."""
    text = b"QuantizeLinear".ljust(16, b"\0")
    raw = bytearray(np.random.default_rng(0).normal(size=(4, columns)).astype(np.float32).tobytes())
    raw[100:116] = text
    return np.frombuffer(bytes(raw), dtype=np.float32).reshape(4, columns)


def test_the_initializers_spans_hold_exactly_the_weights() -> None:
    weight = np.arange(4 * 300, dtype=np.float32).reshape(4, 300)
    data = float_model(weight).SerializeToString()
    spans = initializer_spans(io.BytesIO(data))
    assert spans is not None and len(spans) == 1
    start, end = spans[0]
    tensor = onnx.TensorProto()
    tensor.ParseFromString(data[start:end])
    np.testing.assert_array_equal(numpy_helper.to_array(tensor), weight)
    assert end - start > 0.9 * len(data)  # the rest of the file is small


def test_bytes_that_are_not_a_message_are_refused() -> None:
    with pytest.raises(Malformed):
        initializer_spans(io.BytesIO(b"\x3a\x7f" + b"x" * 10))  # a length beyond the end
    with pytest.raises(Malformed):
        initializer_spans(io.BytesIO(b"\x0b"))  # wire type 3 (a group)


def test_op_text_inside_a_weight_is_not_the_op(tmp_path: Path) -> None:
    """A float model whose weight bytes happen to spell QuantizeLinear is not parsed for the INT8
    rewrites (it was: the whole file was scanned, weights included)."""
    data = float_model(weight_naming_the_op()).SerializeToString()
    assert b"QuantizeLinear" in data
    (tmp_path / "m.onnx").write_bytes(data)
    assert not models_ort._may_quantize(data)
    assert not models_ort._may_quantize(tmp_path / "m.onnx")


def test_the_op_is_found_in_the_graph_a_subgraph_and_a_function(tmp_path: Path) -> None:
    weight = weight_naming_the_op()
    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    quantize = helper.make_node("QuantizeLinear", ["out", "s"], ["q"], name="q")
    in_graph = float_model(weight, extra_nodes=[
        helper.make_node("Constant", [], ["s"], value=scale), quantize])
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["s"], value=scale),
         helper.make_node("QuantizeLinear", ["out", "s"], ["q"])], "branch", [],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, None)])
    in_subgraph = float_model(weight, extra_nodes=[
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL,
                                                                         [], [True])),
        helper.make_node("If", ["c"], ["q"], then_branch=branch, else_branch=branch)])
    function = helper.make_function(
        "local", "Quant", ["x"], ["y"],
        [helper.make_node("Constant", [], ["s"], value=scale),
         helper.make_node("QuantizeLinear", ["x", "s"], ["y"])],
        [helper.make_opsetid("", 17)])
    in_function = float_model(weight, extra_nodes=[
        helper.make_node("Quant", ["out"], ["q"], domain="local")], functions=[function])
    for index, model in enumerate((in_graph, in_subgraph, in_function)):
        data = model.SerializeToString()
        (tmp_path / f"{index}.onnx").write_bytes(data)
        assert models_ort._may_quantize(data), index
        assert models_ort._may_quantize(tmp_path / f"{index}.onnx"), index


def test_a_large_float_model_is_read_around_its_weights(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan of a float model reads its few non-weight bytes, not its 16 MiB of weights (the
    daemon's CPU under the GIL while a candidate loads: 0.9 ms for a 40 MB model, was 18-19.5)."""
    weight = np.random.default_rng(1).normal(size=(4, 1 << 20)).astype(np.float32)
    path = tmp_path / "big.onnx"
    path.write_bytes(float_model(weight).SerializeToString())
    read = [0]

    class Counting(io.FileIO):
        def readinto(self, buffer: Any) -> int | None:
            count = super().readinto(buffer)
            read[0] += count or 0
            return count

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "rb" and Path(file) == path:
            return io.BufferedReader(Counting(file, "r"))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(models_ort, "open", counting_open, raising=False)
    assert not models_ort._may_quantize(path)
    assert 0 < read[0] < 256 << 10 < path.stat().st_size / 50


def test_a_graph_of_many_small_nodes_is_scanned_whole(tmp_path: Path) -> None:
    """Reading around the weights costs Python work per field: past one field per 16 KiB the
    walk gives up and the file is scanned whole, which still finds a QuantizeLinear node after
    a thousand others (the walk alone took 176 ms for 20,000 fields, the scan 1.1 ms)."""
    nodes = [helper.make_node("Relu", ["input" if index == 0 else f"r{index - 1}"], [f"r{index}"])
             for index in range(1000)]
    nodes += [helper.make_node("Constant", [], ["s"],
                               value=helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])),
              helper.make_node("QuantizeLinear", ["r999", "s"], ["q"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, ["n", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    data = model.SerializeToString()
    assert initializer_spans(io.BytesIO(data), max_fields=256) is None
    assert initializer_spans(io.BytesIO(data)) == []
    (tmp_path / "m.onnx").write_bytes(data)
    assert models_ort._may_quantize(data) and models_ort._may_quantize(tmp_path / "m.onnx")
