from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from torch import nn  # noqa: E402

from agent.errors import ModelError  # noqa: E402
from models.export import compare_with_torch, export_onnx  # noqa: E402
from models.ort import create_session  # noqa: E402
from models.zoo.resnet import ResNet18  # noqa: E402
from models.zoo.small_cnn import SmallCNN  # noqa: E402
from tests.torch_nets import Branchy  # noqa: E402


class FixedSizeNet(nn.Module):
    """Flattens into a linear layer, so it only runs at one input size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))


def _randomise_bn(model: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics, so folding them is really tested."""
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator))
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
            module.weight.data.copy_(torch.randn(module.num_features, generator=generator))
            module.bias.data.copy_(torch.randn(module.num_features, generator=generator))
    return model.eval()


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_export_folds_batchnorm_and_keeps_batch_and_spatial_axes_dynamic():
    model = _randomise_bn(SmallCNN())
    result = export_onnx(model, torch.randn(2, 3, 16, 16))
    assert result.node_counts_before["BatchNormalization"] == 4
    assert "BatchNormalization" not in result.node_counts_after
    assert "Identity" not in result.node_counts_after
    assert result.node_counts_after["Conv"] == 4
    graph = onnx.load_from_string(result.model_bytes)
    assert graph.opset_import[0].version >= 17
    assert _dims(graph.graph.input[0]) == ["batch", 3, "height", "width"]
    assert result.dynamic_spatial
    # The same graph answers at other batch sizes and resolutions, like PyTorch does.
    session = create_session(result.model_bytes)
    for shape in [(1, 3, 16, 16), (5, 3, 40, 24), (2, 3, 224, 224)]:
        x = torch.randn(shape)
        expected = model(x).detach().numpy()
        np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], expected, atol=1e-4, rtol=1e-4)


def test_resnet18_export_matches_torch_at_224():
    model = _randomise_bn(ResNet18(num_classes=10))
    result = export_onnx(model, torch.randn(1, 3, 32, 32))
    assert result.node_counts_after["Conv"] == 20
    assert result.node_counts_before["BatchNormalization"] == 20
    assert any(check["input_shape"] == [2, 3, 224, 224] for check in result.checks)
    assert result.max_abs_error < 1e-3


def test_fixed_size_model_exports_static_spatial_axes():
    model = _randomise_bn(FixedSizeNet())
    result = export_onnx(model, torch.randn(1, 3, 16, 16))
    assert not result.dynamic_spatial
    graph = onnx.load_from_string(result.model_bytes)
    assert _dims(graph.graph.input[0]) == ["batch", 3, 16, 16]


def test_opset_below_17_is_rejected():
    with pytest.raises(ModelError, match="opset"):
        export_onnx(SmallCNN().eval(), torch.randn(1, 3, 16, 16), opset=13)


def test_comparison_catches_a_graph_that_disagrees_with_torch():
    model = _randomise_bn(SmallCNN())
    other = _randomise_bn(SmallCNN())
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.5)
    wrong_bytes = export_onnx(other, torch.randn(1, 3, 16, 16)).model_bytes
    with pytest.raises(ModelError, match="beyond tolerance"):
        compare_with_torch(model, wrong_bytes, "input", [np.random.rand(2, 3, 16, 16).astype(np.float32)],
                           1e-3, 1e-3)


class _TwoOutputs(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.kind = kind

    def forward(self, x):
        features = self.conv(x).amax(dim=(2, 3))  # same shape at any input size
        logits = features.softmax(dim=1)
        if self.kind == "dict":
            return {"logits": logits, "features": features}
        if self.kind == "nested":
            return logits, (features, features)
        if self.kind == "with a number":
            return logits, 3
        return logits, features


@pytest.mark.parametrize("kind, names", [("tuple", ["output_0", "output_1"]),
                                         ("dict", ["logits", "features"])])
def test_a_model_with_several_outputs_exports_them_all(kind, names):
    model = _TwoOutputs(kind)
    example = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    result = export_onnx(model, example)
    assert list(result.output_names) == names
    assert result.dynamic_spatial
    session = create_session(result.model_bytes)
    batch = torch.randn(3, 3, 24, 20, generator=torch.Generator().manual_seed(1))
    logits, features = session.run(None, {"input": batch.numpy()})
    with torch.no_grad():
        expected = model(batch)
    expected_logits, expected_features = (expected["logits"], expected["features"]) \
        if kind == "dict" else expected
    np.testing.assert_allclose(logits, expected_logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(features, expected_features.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["nested", "with a number"])
def test_outputs_that_are_not_tensors_are_refused_in_one_line(kind):
    with pytest.raises(ModelError) as caught:
        export_onnx(_TwoOutputs(kind), torch.zeros(2, 3, 16, 16))
    message = str(caught.value)
    assert "must return a tensor, or a tuple, list or dict of tensors" in message
    assert "\n" not in message


class _Segmenter(nn.Module):
    """Encoder-decoder with a dense output that follows the input size (N x 4 x H x W)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, 4, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x):
        return self.up(self.head(self.down(x)))


def test_a_dense_output_that_follows_the_input_size_stays_dynamic():
    model = _Segmenter().eval()
    result = export_onnx(model, torch.zeros(2, 3, 32, 32))
    assert result.dynamic_spatial
    output = onnx.load_from_string(result.model_bytes).graph.output[0]
    dims = [dim.dim_value or dim.dim_param for dim in output.type.tensor_type.shape.dim]
    assert dims[1] == 4 and all(isinstance(dim, str) for dim in (dims[0], dims[2], dims[3]))
    batch = torch.randn(3, 3, 48, 40, generator=torch.Generator().manual_seed(2))
    (segmentation,) = create_session(result.model_bytes).run(None, {"input": batch.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(segmentation, model(batch).numpy(), rtol=1e-4, atol=1e-5)
    assert segmentation.shape == (3, 4, 48, 40)


def test_an_error_reason_is_one_line_even_without_a_message():
    from agent.errors import first_line

    assert first_line(RuntimeError("\n  shape mismatch  \nsecond line")) == "shape mismatch"
    assert first_line(IndexError()) == "IndexError"  # was an IndexError of its own
    assert first_line(ValueError("x" * 500), limit=20) == "x" * 17 + "..."


class _Sixteens(nn.Module):
    """Four stride-2 stages down and back up, with a skip: takes multiples of 16 only."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(*[nn.Conv2d(3, 3, 3, 2, 1) for _ in range(4)])
        self.up = nn.Upsample(scale_factor=16.0)

    def forward(self, x):
        return self.up(self.down(x)) + x


def test_a_model_taking_multiples_of_16_is_found_to_take_any_such_size():
    # Probing at twice the height and three times the width keeps the divisibility the example
    # had (a width of 2W + 8 did not, and such a model was exported with a fixed size).
    result = export_onnx(_Sixteens().eval(), torch.randn(1, 3, 32, 32), check_size=None)
    assert result.dynamic_spatial
    assert any(check["input_shape"] == [2, 3, 64, 96] for check in result.checks)


class _WithAnchors(nn.Module):
    def __init__(self, scalar: bool = False) -> None:
        super().__init__()
        self.scalar = scalar
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("anchors", torch.arange(20.0).reshape(5, 4))

    def forward(self, x):
        scores = self.conv(x).mean(dim=(2, 3))
        return scores.sum() if self.scalar else (scores, self.anchors * 1.0)


@pytest.mark.parametrize("scalar", [False, True])
def test_outputs_without_a_batch_axis_are_refused(scalar):
    with pytest.raises(ModelError) as caught:
        export_onnx(_WithAnchors(scalar).eval(), torch.randn(1, 3, 16, 16))
    message = str(caught.value)
    assert "needs the batch as its first, dynamic axis" in message and "\n" not in message
    assert caught.value.fields["output"] == ("logits" if scalar else "output_1")


def test_an_onnx_model_with_an_output_without_a_batch_axis_is_refused(tmp_path):
    """An ONNX model's outputs are checked by running it (models.batch_axis), not by their
    declared shapes."""
    from onnx import TensorProto, helper

    from models.batch_axis import BatchTrial, check_batch

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Shape", ["x"], ["shape"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 8, 8]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    samples = {"x": np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)}
    with pytest.raises(ModelError, match="output 'shape' does not follow the input batch"):
        check_batch(model.SerializeToString(), samples, BatchTrial(None))


class _OneAtATime(nn.Module):
    """Takes one frame at a time: refuses a batch (checked in Python, so tracing never sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if x.shape[0] != 1:
            raise ValueError("one frame at a time")
        return self.conv(x).mean(dim=(2, 3))


def test_a_model_that_cannot_take_a_batch_is_named_in_one_line():
    batch = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    with pytest.raises(ModelError) as caught:
        export_onnx(_OneAtATime().eval(), torch.randn(1, 3, 8, 8), check_inputs=[batch])
    message = str(caught.value)
    assert "the model fails on an input of shape [4, 3, 8, 8]" in message
    assert "must take any batch size" in message and "ValueError: one frame at a time" in message
    assert "\n" not in message


def test_a_branch_on_the_data_is_caught_on_real_samples():
    rng = np.random.default_rng(0)
    samples = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    samples[:2] += 2.0
    samples[2:] -= 2.0
    with pytest.raises(ModelError, match="a branch or loop on tensor values"):
        export_onnx(Branchy().eval(), torch.from_numpy(samples[:1]),
                    check_inputs=[samples[index:index + 1] for index in range(1, 4)])
