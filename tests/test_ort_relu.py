"""Folding ReLUs into INT8 quantization for ONNX Runtime (models/ort_relu.py), on small real QDQ
graphs built with the onnx helper API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from models.ort import create_session  # noqa: E402
from models.ort_relu import fold_relu_into_quantize  # noqa: E402


def qdq(name: str, source: str, scale: float, nodes: list, inits: list) -> str:
    """Append a symmetric INT8 Q/DQ pair on ``source``; returns the dequantized tensor."""
    inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
              numpy_helper.from_array(np.array(0, np.int8), f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", [source, f"{name}_s", f"{name}_z"], [f"{name}_q"],
                               name=f"{name}_Q"),
              helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"],
                               [f"{name}_dq"], name=f"{name}_DQ")]
    return f"{name}_dq"


def qdq_conv(index: int, source: str, rng: np.random.Generator, nodes: list, inits: list, *,
             bias: bool) -> str:
    """Append ``conv{index}``: 8 output channels, 3x3, its weight behind a per-tensor Q/DQ pair."""
    weight = rng.normal(0, 0.3, (8, 3 if index == 0 else 8, 3, 3)).astype(np.float32)
    inits.append(numpy_helper.from_array(weight, f"w{index}"))
    inputs = [source, qdq(f"w{index}", f"w{index}", float(np.abs(weight).max() / 127), nodes, inits)]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), f"b{index}"))
        inputs.append(f"b{index}")
    nodes.append(helper.make_node("Conv", inputs, [f"conv{index}"], pads=[1] * 4,
                                  name=f"conv{index}"))
    return f"conv{index}"


def qdq_relu(source: str, nodes: list, inits: list) -> str:
    """Append QDQ(0.05) -> Relu ``relu0`` -> QDQ(0.04) on ``source``; returns the dequantized
    output."""
    pre = qdq("pre", source, 0.05, nodes, inits)
    nodes.append(helper.make_node("Relu", [pre], ["relu0"], name="relu0"))
    return qdq("post", "relu0", 0.04, nodes, inits)


def conv_relu_model(*, residual: bool = False) -> onnx.ModelProto:
    """input -> QDQ -> Conv -> QDQ -> Relu -> QDQ -> Conv (-> Add with the Relu branch)."""
    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []
    x = qdq("in", "input", 0.03, nodes, inits)
    for index in (0, 1):
        conv = qdq_conv(index, x, rng, nodes, inits, bias=True)
        if index == 0:
            x = qdq_relu(conv, nodes, inits)
            if residual:
                skip = qdq("skip", "relu0", 0.04, nodes, inits)
    output = "conv1"
    if residual:
        nodes.append(helper.make_node("Add", ["conv1", skip], ["sum"], name="add"))
        output = "sum"
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["n", 8, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def exact_options() -> ort.SessionOptions:
    """Plain session options, but with exact INT8 accumulation on CPUs without VNNI (whose default
    kernels saturate, see models/ort.py), so that results compare across machines."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.x64quantprecision", "1")
    return options


def run(model: onnx.ModelProto, data: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), exact_options(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"input": data})[0]


def test_a_conv_relu_chain_is_folded_and_computes_the_same() -> None:
    model = conv_relu_model()
    data = np.random.default_rng(1).normal(size=(4, 3, 8, 8)).astype(np.float32)
    before = run(model, data)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_relu_into_quantize(folded) == 1
    onnx.checker.check_model(folded)
    nodes = {node.name: node for node in folded.graph.node}
    assert not {"pre_Q", "pre_DQ", "relu0"} & set(nodes)
    assert nodes["post_Q"].input[0] == "conv0"
    inits = {tensor.name: numpy_helper.to_array(tensor) for tensor in folded.graph.initializer}
    zero_point = inits[nodes["post_Q"].input[2]]
    assert zero_point.dtype == np.uint8 and int(zero_point) == 0
    np.testing.assert_allclose(inits[nodes["post_Q"].input[1]], 0.04 * 127 / 255, rtol=1e-6)
    assert nodes["post_DQ"].input[1:3] == nodes["post_Q"].input[1:3]
    # The removed pair's scale and zero point go with it; every other initializer stays.
    read = {name for node in folded.graph.node for name in node.input}
    assert {"pre_s", "pre_z"}.isdisjoint(inits) and set(inits) <= read
    assert {tensor.name for tensor in model.graph.initializer} - {"pre_s", "pre_z", "post_s",
                                                                  "post_z"} <= set(inits)
    after = run(folded, data)
    # The post-ReLU step halves and one rounding goes: the results stay within a few steps of
    # the output quantization of the original graph.
    assert np.abs(after - before).max() < 0.25
    assert np.abs(after - before).mean() < 0.03


def test_a_relu_feeding_two_quantizers_folds_into_one_shared_by_both_consumers() -> None:
    model = conv_relu_model(residual=True)
    data = np.random.default_rng(3).normal(size=(2, 3, 8, 8)).astype(np.float32)
    before = run(model, data)
    assert fold_relu_into_quantize(model) == 1
    onnx.checker.check_model(model)
    nodes = {node.name: node for node in model.graph.node}
    assert "skip_Q" not in nodes and "post_Q" in nodes
    assert nodes["skip_DQ"].input[0] == nodes["post_DQ"].input[0] == "post_q"
    after = run(model, data)
    assert np.abs(after - before).max() < 0.25


def test_a_relu_whose_quantizers_disagree_is_left_alone() -> None:
    model = conv_relu_model(residual=True)
    for tensor in model.graph.initializer:
        if tensor.name == "skip_s":
            tensor.CopyFrom(numpy_helper.from_array(np.array(0.05, np.float32), "skip_s"))
    assert fold_relu_into_quantize(model) == 0


def test_float_models_and_already_folded_ones_do_not_change() -> None:
    model = conv_relu_model()
    assert fold_relu_into_quantize(model) == 1
    assert fold_relu_into_quantize(model) == 0  # no ReLU left
    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["out"])], "f",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3])])
    assert fold_relu_into_quantize(helper.make_model(graph)) == 0


def test_a_float_model_is_not_parsed_for_the_rewrite(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A model without QuantizeLinear is handed to ONNX Runtime as it is, never parsed by onnx
    (a full parse of a large model holds the GIL during an update); an INT8 one still is."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["out"])], "f",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3])])
    float_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    float_model.ir_version = 8
    path = tmp_path / "float.onnx"
    path.write_bytes(float_model.SerializeToString())
    parsed: list[str] = []
    load, load_from_string = onnx.load, onnx.load_from_string
    monkeypatch.setattr(onnx, "load", lambda *a, **k: parsed.append("file") or load(*a, **k))
    monkeypatch.setattr(onnx, "load_from_string",
                        lambda *a, **k: parsed.append("bytes") or load_from_string(*a, **k))
    data = np.array([[-1.0, 0.0, 2.0]], dtype=np.float32)
    for source in (path, str(path), float_model.SerializeToString()):
        out = create_session(source, threads=1).run(None, {"input": data})[0]
        np.testing.assert_array_equal(out, [[0.0, 0.0, 2.0]])
    assert parsed == []
    create_session(conv_relu_model().SerializeToString(), threads=1)
    assert parsed == ["bytes"]
    (tmp_path / "int8.onnx").write_bytes(conv_relu_model().SerializeToString())
    create_session(tmp_path / "int8.onnx", threads=1)
    assert parsed == ["bytes", "file"]


@pytest.mark.parametrize("at", [0, (1 << 20) - 7, (1 << 20) - 14, 1 << 20, 3 << 20])
def test_the_quantize_scan_finds_the_op_across_its_pieces(tmp_path: Path, at: int) -> None:
    from models.ort import _may_quantize

    data = bytearray(b"x" * ((3 << 20) + 100))
    data[at:at + 14] = b"QuantizeLinear"
    (tmp_path / "m.onnx").write_bytes(data)
    assert _may_quantize(bytes(data)) and _may_quantize(tmp_path / "m.onnx")
    data[at:at + 14] = b"DequantizeLine"  # a lower-case q, as in DequantizeLinear, is not the op
    (tmp_path / "m.onnx").write_bytes(data)
    assert not _may_quantize(bytes(data)) and not _may_quantize(str(tmp_path / "m.onnx"))
    assert _may_quantize(tmp_path / "missing.onnx")  # the parse after reports it


def test_create_session_folds_by_default_and_can_be_told_not_to() -> None:
    model = conv_relu_model().SerializeToString()
    data = np.random.default_rng(2).normal(size=(2, 3, 8, 8)).astype(np.float32)
    original = ort.InferenceSession(model, exact_options(), providers=["CPUExecutionProvider"]).run(
        None, {"input": data})[0]
    unfolded = create_session(model, threads=1, fold_relu=False).run(None, {"input": data})[0]
    folded = create_session(model, threads=1).run(None, {"input": data})[0]
    np.testing.assert_array_equal(unfolded, original)
    assert not np.array_equal(folded, original)  # the rewrite really ran
    assert np.abs(folded - original).max() < 0.25


def pool_model(*, pool_scale: float = 0.04) -> onnx.ModelProto:
    """input -> QDQ -> Conv -> QDQ -> Relu -> QDQ(0.04) -> MaxPool, whose output is quantized
    twice (``pool_scale``, as ONNX's quantizer does for two consumers) and feeds a Conv and, as the
    skip branch, an Add with that Conv's output: the stem of a ResNet."""
    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []
    x = qdq("in", "input", 0.03, nodes, inits)
    for index in (0, 1):
        conv = qdq_conv(index, x, rng, nodes, inits, bias=False)
        if index == 0:
            relu = qdq_relu(conv, nodes, inits)
            nodes.append(helper.make_node("MaxPool", [relu], ["pool"], kernel_shape=[3, 3],
                                          strides=[2, 2], pads=[1] * 4, name="pool"))
            x = qdq("pool_a", "pool", pool_scale, nodes, inits)
            skip = qdq("pool_b", "pool", pool_scale, nodes, inits)
    out = qdq("conv1_out", "conv1", 0.05, nodes, inits)
    nodes.append(helper.make_node("Add", [out, skip], ["sum"], name="add"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 16, 16])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["n", 8, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def float_pools_after_optimization(model: onnx.ModelProto, tmp_path: Path) -> int:
    """How many MaxPools ONNX Runtime still runs on dequantized float input."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    producer = {output: node for node in optimized.graph.node for output in node.output}

    def source(tensor: str) -> str:
        # Look through layout changes: on AVX2 CPUs ONNX Runtime runs float pools in its blocked
        # NCHWc layout, behind a ReorderInput.
        node = producer.get(tensor)
        while node is not None and node.op_type in ("ReorderInput", "Transpose"):
            node = producer.get(node.input[0])
        return node.op_type if node is not None else ""

    return sum(1 for node in optimized.graph.node
               if "MaxPool" in node.op_type and source(node.input[0]) == "DequantizeLinear")


def test_a_max_pool_after_a_folded_relu_is_quantized_like_its_input(tmp_path: Path) -> None:
    model = pool_model()
    data = np.random.default_rng(4).normal(size=(3, 3, 16, 16)).astype(np.float32)
    before = run(model, data)
    assert float_pools_after_optimization(model, tmp_path) == 1
    assert fold_relu_into_quantize(model) == 1
    onnx.checker.check_model(model)
    nodes = {node.name: node for node in model.graph.node}
    # One quantizer left after the pool, on the folded UINT8 parameters of its input.
    assert "pool_b_Q" not in nodes
    assert nodes["pool_b_DQ"].input[0] == nodes["pool_a_DQ"].input[0] == "pool_a_q"
    assert nodes["pool_a_Q"].input[1:3] == nodes["post_DQ"].input[1:3]
    for dq in ("pool_a_DQ", "pool_b_DQ"):
        assert nodes[dq].input[1:3] == nodes["post_DQ"].input[1:3]
    # ONNX Runtime now pools the 8-bit values directly, and the results stay within INT8 noise.
    assert float_pools_after_optimization(model, tmp_path) == 0
    after = run(model, data)
    assert np.abs(after - before).max() < 0.3
    assert np.abs(after - before).mean() < 0.05


def test_a_max_pool_quantized_to_another_range_is_left_alone() -> None:
    model = pool_model(pool_scale=0.05)
    assert fold_relu_into_quantize(model) == 1  # the ReLU still folds
    nodes = {node.name: node for node in model.graph.node}
    assert {"pool_a_Q", "pool_b_Q"} <= set(nodes)
    inits = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    assert inits[nodes["pool_a_Q"].input[2]].dtype == np.int8


def saturating_conv_model() -> onnx.ModelProto:
    """One QDQ 1x1 convolution whose INT8 products are as large as they get: inputs near the top
    of the range and every weight at +127. Adjacent pairs of such products overflow the 16-bit
    sums of ONNX Runtime's fast U8S8 kernels on x86-64 CPUs without VNNI."""
    nodes: list = []
    inits: list = []
    x = qdq("in", "input", 0.01, nodes, inits)
    weight = np.full((4, 64, 1, 1), 1.27, np.float32)
    inits.append(numpy_helper.from_array(weight, "w"))
    w = qdq("w", "w", 0.01, nodes, inits)
    nodes.append(helper.make_node("Conv", [x, w], ["conv"], name="conv"))
    out = qdq("out", "conv", 1.0, nodes, inits)
    graph = helper.make_graph(
        nodes + [helper.make_node("Identity", [out], ["y"])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 64, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_create_session_accumulates_int8_products_exactly() -> None:
    # Reference: the graph run op by op (no fusion), so Q/DQ are float ops and the convolution
    # is a float convolution of exactly representable values, as TensorRT computes it.
    model = saturating_conv_model().SerializeToString()
    data = np.random.default_rng(5).uniform(1.0, 1.27, size=(2, 64, 4, 4)).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    expected = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(
        None, {"input": data})[0]
    assert 60 < expected.min() and expected.max() < 127  # in range: the output Q does not clip
    assert "QLinearConv" in _optimized_op_types(model)  # the INT8 kernel is what gets tested
    # Equal up to one output quantization step (float and integer sums may round a tie apart);
    # saturated 16-bit pair sums would be off by tens of steps.
    got = create_session(model, threads=1).run(None, {"input": data})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1.0)


def _optimized_op_types(model: bytes) -> set[str]:
    """The node list ONNX Runtime ran: proves the INT8 kernel (not a float fallback) was tested."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        options = exact_options()
        options.optimized_model_filepath = str(Path(scratch) / "optimized.onnx")
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return {node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node}


@pytest.mark.parametrize("machine,flags,expected", [
    ("x86_64", "fpu sse2 avx avx2 fma", True),  # AVX2 EPYC: pairs saturate in 16 bits
    ("x86_64", "avx2 avx512f avx512bw", True),  # AVX-512 without VNNI: the same
    ("x86_64", "avx2 avx512f avx512_vnni", False),
    ("x86_64", "avx2 avx_vnni", False),
    ("aarch64", "fp asimd asimddp", False),
])
def test_int8_saturation_is_detected_from_the_cpu_flags(tmp_path: Path, machine: str, flags: str,
                                                         expected: bool) -> None:
    from models.ort import int8_may_saturate

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert int8_may_saturate(cpuinfo, machine) is expected
    # Unreadable flags on x86-64: assume the worst; exact kernels are slower, never wrong.
    assert int8_may_saturate(tmp_path / "missing", "x86_64") is True


def test_a_zero_point_shared_by_weights_is_given_one_per_weight() -> None:
    # With exact INT8 kernels ONNX Runtime rewrites each weight's zero point in place and fails on
    # one shared by two weights; sessions therefore give every weight its own copy first.
    from models.ort import _unshare_zero_points

    model = conv_relu_model()
    shared = "in_z"
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            node.input[2] = shared
    onnx.checker.check_model(model)
    data = np.random.default_rng(6).normal(size=(2, 3, 8, 8)).astype(np.float32)

    def emulated(model: onnx.ModelProto) -> np.ndarray:  # op by op: no kernel rewrites at all
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"]).run(None, {"input": data})[0]

    before = emulated(model)
    assert _unshare_zero_points(model) == 1  # w0 keeps the original, w1 gets a copy
    zero_points = {node.name: node.input[2] for node in model.graph.node
                   if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert zero_points["w0_Q"] == zero_points["w0_DQ"] == shared
    assert zero_points["w1_Q"] == zero_points["w1_DQ"] != shared
    assert {zero_points[name] for name in ("in_Q", "in_DQ", "pre_Q", "post_DQ")} == {shared}
    onnx.checker.check_model(model)
    np.testing.assert_array_equal(emulated(model), before)
    np.testing.assert_allclose(run(model, data), before, rtol=0, atol=0.05)  # fused kernels run
    assert _unshare_zero_points(model) == 0  # idempotent


def test_a_failed_run_raises_without_printing_onnx_runtimes_own_error_line(capfd):
    # The tools print an error as one line; ONNX Runtime's coloured log copy must not come first.
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")])
    # IR 7 / opset 13: the device pass's older ONNX Runtime on Python 3.10 loads it too.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    session = create_session(model.SerializeToString(), threads=1)
    with pytest.raises(Exception, match="Reshape"):
        session.run(None, {"x": np.zeros((1, 3), np.float32)})  # 3 values cannot be N x 4
    assert "onnxruntime" not in capfd.readouterr().err
