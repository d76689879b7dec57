"""Channel pruning: widths, alignment, MACs, scopes, target search, steps, Taylor, persistence.

SmallCNN at 16x16 (trained for three epochs on the digits set where a metric is needed) and a
randomly initialised ResNet-18 at 32x32 for structural checks only.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_pruning")

from torch import nn  # noqa: E402

from agent.errors import ConfigError, ModelError, PruningError  # noqa: E402
from models.data import load_digits_splits  # noqa: E402
from models.train import TrainConfig, predict, top1_accuracy, train  # noqa: E402
from models.zoo.resnet import ResNet18  # noqa: E402
from models.zoo.small_cnn import SmallCNN  # noqa: E402
from pruning import (  # noqa: E402
    PruneConfig,
    conv_widths,
    count_macs_and_params,
    load_pruned,
    prune_model,
    save_pruned,
    sensitivity_scan,
)
from pruning.pruner import aligned_width  # noqa: E402

SMALL_SIZE = 16


class OutsideZooNet(nn.Module):
    """A model whose class lives outside the trusted packages (here, in this test module)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean(dim=(2, 3)))


class ConvHeadNet(nn.Module):
    """Ends in a convolution (a dense-prediction head): no Linear marks the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def small_input(batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, SMALL_SIZE, SMALL_SIZE, generator=torch.Generator().manual_seed(1))


def random_small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN().eval()


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(SMALL_SIZE)


@pytest.fixture(scope="module")
def trained_small_cnn(digits):
    train_split, _ = digits
    torch.manual_seed(0)
    model = train(SmallCNN(), train_split, TrainConfig(epochs=3), progress=False)
    model.zero_grad(set_to_none=True)  # so a test can tell whether pruning wrote gradients here
    return model


def held_out_top1(digits):
    _, held_out = digits

    def evaluate(model: nn.Module) -> float:
        return top1_accuracy(predict(model, held_out.images), held_out.labels)

    return evaluate


def loss_batches_from(digits, batches: int = 2, batch_size: int = 64):
    train_split, _ = digits
    images = torch.from_numpy(train_split.images)
    labels = torch.from_numpy(train_split.labels)

    def loss_batches():
        for index in range(batches):
            window = slice(index * batch_size, (index + 1) * batch_size)
            yield images[window], labels[window]

    return loss_batches


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"ratio": 1.5}, "ratio"),
        ({"ratio": -0.1}, "ratio"),
        ({"ratio": "half"}, "ratio"),
        ({}, "ratio/target_macs"),
        ({"ratio": 0.5, "target_macs": 1000}, "ratio/target_macs"),
        ({"target_macs": 0}, "target_macs"),
        ({"ratio": 0.5, "importance": "l3"}, "importance"),
        ({"ratio": 0.5, "scope": "local"}, "scope"),
        ({"ratio": 0.5, "round_to": 0}, "round_to"),
        ({"ratio": 0.5, "iterative_steps": 0}, "iterative_steps"),
        ({"ratio": 0.5, "max_layer_ratio": 1.0}, "max_layer_ratio"),
        ({"ratio": 0.95}, "ratio"),  # above the default max_layer_ratio of 0.9
        ({"ratio": 0.5, "ignored_layer_names": "fc"}, "ignored_layer_names"),
    ],
)
def test_invalid_config_names_the_field(settings, key):
    with pytest.raises(ConfigError) as caught:
        PruneConfig(**settings)
    assert caught.value.fields["key"] == key
    assert key.split("/")[0] in str(caught.value)


def test_ratio_error_shows_the_value_found():
    with pytest.raises(ConfigError, match=r"ratio must be in \[0, 1\).*found=1.5"):
        PruneConfig(ratio=1.5)


def test_config_keeps_ignored_names_as_a_tuple():
    config = PruneConfig(ratio=0.5, ignored_layer_names=["stem.0"])
    assert config.ignored_layer_names == ("stem.0",)
    assert json.loads(json.dumps(config.to_dict()))["ignored_layer_names"] == ["stem.0"]


@pytest.mark.parametrize(
    ("current", "requested", "round_to", "min_keep", "expected"),
    [
        (64, 25, 32, 1, 32),  # torch-pruning alone would round 25 down to 0 and skip the layer
        (64, 48, 32, 1, 64),  # a tie keeps more channels
        (128, 51, 32, 1, 64),
        (512, 204, 32, 1, 192),
        (32, 10, 32, 1, 32),  # no wider than round_to: never pruned
        (40, 36, 32, 1, 40),  # tie between 32 and the unpruned 40
        (64, 5, 8, 1, 8),
        (64, 5, 8, 20, 24),  # max_layer_ratio floor
        (64, 30, 1, 1, 30),  # round_to=1 means no alignment
    ],
)
def test_aligned_width(current, requested, round_to, min_keep, expected):
    assert aligned_width(current, requested, round_to=round_to, min_keep=min_keep) == expected


# --- structure ------------------------------------------------------------------------------


def test_ratio_pruning_reduces_macs_and_params_quadratically():
    model = random_small_cnn()
    result = prune_model(model, small_input(), PruneConfig(ratio=0.5, round_to=8), progress=False)
    report = result.report
    # Inner convolutions lose half their inputs and half their outputs: about a quarter is left.
    assert 0.2 < report.macs_ratio < 0.35
    assert 0.2 < report.params_ratio < 0.35
    assert report.macs_after < report.macs_before
    assert {name: widths[1] for name, widths in conv_widths(result.model).items()} == {
        "stem.0": 16,
        "down.0": 32,
        "block_a.0": 32,
        "block_b.0": 32,
    }
    assert result.model.fc.out_features == 10
    assert result.model(small_input(batch=3)).shape == (3, 10)


def test_original_model_is_left_unchanged():
    model = random_small_cnn().train()
    state_before = {name: value.clone() for name, value in model.state_dict().items()}
    result = prune_model(model, small_input(), PruneConfig(ratio=0.5, round_to=8), progress=False)
    assert result.model is not model
    assert model.training  # torch-pruning's tracing switches to eval; the caller's mode survives
    state_after = model.state_dict()
    assert all(torch.equal(state_before[name], state_after[name]) for name in state_before)
    assert conv_widths(model)["block_a.0"] == (64, 64)
    assert not result.model.training


def test_layers_no_wider_than_round_to_are_not_pruned():
    result = prune_model(
        random_small_cnn(), small_input(), PruneConfig(ratio=0.5, round_to=32), progress=False
    )
    widths = conv_widths(result.model)
    assert widths["stem.0"] == (3, 32)  # 32 wide: cannot drop to a smaller multiple of 32
    assert widths["block_a.0"] == (32, 32)


@pytest.mark.parametrize("round_to", [32, 8])
def test_resnet18_widths_are_multiples_of_round_to(round_to):
    torch.manual_seed(0)
    model = ResNet18(num_classes=10).eval()
    example = torch.randn(1, 3, 32, 32)
    result = prune_model(model, example, PruneConfig(ratio=0.6, round_to=round_to), progress=False)
    report = result.report
    for layer in report.layers:
        if layer.out_before > round_to:
            assert layer.out_after % round_to == 0, layer
            # Every layer is pruned, including 64-wide ones that plain torch-pruning skips.
            assert layer.out_after < layer.out_before, layer
    assert report.misaligned_layers() == []
    assert conv_widths(result.model)["conv1"][0] == 3
    assert result.model.fc.out_features == 10
    assert result.model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert report.macs_ratio < 0.35
    assert report.params_ratio < 0.35


def test_pruned_model_exports_to_onnx_with_the_same_outputs():
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    result = prune_model(
        random_small_cnn(), small_input(), PruneConfig(ratio=0.5, round_to=8), progress=False
    )
    model = result.model
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (small_input(),),
            buffer,
            dynamo=False,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        )
    graph = onnx.load_from_string(buffer.getvalue()).graph
    conv_weight_shapes = sorted(
        tuple(initializer.dims)[:2]
        for initializer in graph.initializer
        if len(initializer.dims) == 4
    )
    assert conv_weight_shapes == sorted((out, inp) for inp, out in conv_widths(model).values())
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    batch = small_input(batch=4)
    expected = model(batch).detach().numpy()
    (actual,) = session.run(None, {"input": batch.numpy()})
    assert actual.shape == (4, 10)
    assert abs(actual - expected).max() < 1e-4


def weaken_channels(model: nn.Module, channels: slice) -> None:
    """Scale the channels of SmallCNN's residual group (down + block_b) to almost nothing."""
    with torch.no_grad():
        for conv, norm in ((model.down[0], model.down[1]), (model.block_b[0], model.block_b[1])):
            conv.weight[channels] *= 0.01
            norm.weight[channels] *= 0.01
        model.block_a[0].weight[:, channels] *= 0.01
        model.fc.weight[:, channels] *= 0.01


def test_global_scope_prunes_the_layer_with_weak_channels_harder():
    model = random_small_cnn()
    weaken_channels(model, slice(16, None))  # 48 of the group's 64 channels are almost zero
    uniform = prune_model(model, small_input(), PruneConfig(ratio=0.5, round_to=8), progress=False)
    global_ = prune_model(
        model, small_input(), PruneConfig(ratio=0.5, round_to=8, scope="global"), progress=False
    )
    uniform_out = {name: out for name, (_, out) in conv_widths(uniform.model).items()}
    global_out = {name: out for name, (_, out) in conv_widths(global_.model).items()}
    assert uniform_out == {"stem.0": 16, "down.0": 32, "block_a.0": 32, "block_b.0": 32}
    # Global ranking removes the 48 weak channels and spares the others.
    assert global_out["down.0"] == global_out["block_b.0"] == 16
    spared = ("stem.0", "block_a.0")
    assert sum(global_out[name] for name in spared) > sum(uniform_out[name] for name in spared)
    # Both remove about half of all prunable channels.
    assert abs(sum(global_out.values()) - sum(uniform_out.values())) <= 16


def test_ignored_layer_keeps_its_width():
    config = PruneConfig(ratio=0.5, round_to=8, ignored_layer_names=("block_a.0",))
    result = prune_model(random_small_cnn(), small_input(), config, progress=False)
    assert conv_widths(result.model)["block_a.0"][1] == 64
    assert conv_widths(result.model)["stem.0"][1] == 16


def test_unknown_ignored_layer_is_an_error():
    config = PruneConfig(ratio=0.5, ignored_layer_names=("no_such_layer",))
    with pytest.raises(ConfigError, match="ignored_layer_names") as caught:
        prune_model(random_small_cnn(), small_input(), config, progress=False)
    assert caught.value.fields["found"] == "no_such_layer"


class DeepConvHeadNet(nn.Module):
    """Three 64-wide convolutions; the last one's channels are the output's (a dense head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class PooledConvClassifier(nn.Module):
    """A 1x1 convolution classifier before global pooling (no Linear at all)."""

    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1), nn.ReLU())
        self.classifier = nn.Conv2d(128, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x)).mean(dim=(2, 3))


class SegmentationHead(nn.Module):
    """21 classes per pixel, then ``after`` (a softmax, a permute)."""

    def __init__(self, after: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.after = after
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(64, 21, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.head(self.body(x)))


def test_convolutions_that_produce_the_output_are_kept_without_being_named():
    torch.manual_seed(0)
    example = torch.randn(1, 3, 8, 8)
    result = prune_model(ConvHeadNet().eval(), example, PruneConfig(ratio=0.5, round_to=8),
                         progress=False)
    assert conv_widths(result.model) == {"body.0": (3, 32), "body.2": (32, 64)}
    # Hidden convolutions as wide as the output are still pruned; only the last one is kept.
    result = prune_model(DeepConvHeadNet().eval(), example, PruneConfig(ratio=0.5, round_to=8),
                         progress=False)
    assert conv_widths(result.model) == {"body.0": (3, 32), "body.2": (32, 32), "body.4": (32, 64)}
    result = prune_model(PooledConvClassifier().eval(), example,
                         PruneConfig(ratio=0.5, round_to=8), progress=False)
    assert conv_widths(result.model) == {"features.0": (3, 64), "classifier": (64, 100)}
    # Behind a softmax over the classes, or a permute to channels-last, too.
    for head in (lambda y: y.softmax(dim=1), lambda y: y.permute(0, 2, 3, 1)):
        result = prune_model(SegmentationHead(head).eval(), example, PruneConfig(ratio=0.5, round_to=8),
                             progress=False)
        assert conv_widths(result.model) == {"body.0": (3, 32), "head": (32, 21)}


def test_grouped_convolutions_keep_aligned_widths_in_equal_groups():
    class Grouped(nn.Module):
        def __init__(self, width: int, groups: int) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, width, 3, padding=1)
            self.b = nn.Conv2d(width, width, 3, padding=1, groups=groups)
            self.c = nn.Conv2d(width, 64, 1)
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
            return self.fc(x.mean((2, 3)))

    example = torch.randn(2, 3, 16, 16)
    for width, groups in ((128, 4), (120, 4), (128, 1)):
        torch.manual_seed(0)
        result = prune_model(Grouped(width, groups), example, PruneConfig(ratio=0.5, round_to=32),
                             progress=False)
        kept = result.model.b.out_channels
        # Half of 128 is 64; 120 rounds to the nearest multiple of 32 that 4 groups share.
        assert kept == 64 and kept % groups == 0, (width, groups, kept)
        assert result.model.b.groups == groups
        assert result.report.misaligned_layers() == []


def test_widths_suit_every_channel_grouping_of_a_coupled_group():
    class GroupNormAndGroupedConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 96, 3, padding=1)
            self.norm = nn.GroupNorm(3, 96)
            self.b = nn.Conv2d(96, 96, 3, padding=1, groups=4)
            self.fc = nn.Linear(96, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.norm(self.a(x)))
            return self.fc(torch.relu(self.b(x)).mean((2, 3)))

    for round_to in (8, 16):
        torch.manual_seed(0)
        result = prune_model(GroupNormAndGroupedConv().eval(), torch.randn(2, 3, 16, 16),
                             PruneConfig(ratio=0.6, round_to=round_to), progress=False)
        width = result.model.a.out_channels
        # A multiple of round_to, of the norm's 3 groups and of the convolution's 4.
        assert width < 96 and width % math.lcm(round_to, 3, 4) == 0, (round_to, width)
        assert result.model.norm.num_channels == width


def test_the_layer_ratio_cap_counts_from_the_original_width_over_steps():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 96, 3, padding=1)
            self.fc = nn.Linear(96, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.a(x)).mean((2, 3)))

    example = torch.randn(2, 3, 16, 16)
    widths = set()
    for steps in (1, 2, 3):
        torch.manual_seed(0)
        config = PruneConfig(ratio=0.6, round_to=32, max_layer_ratio=0.6, iterative_steps=steps)
        widths.add(prune_model(Net(), example, config, progress=False).model.a.out_channels)
    assert widths == {64}  # at most 60 % of 96 may go: 32 would remove 67 %


# --- target MACs, steps, Taylor -------------------------------------------------------------


def test_target_macs_lands_at_or_below_the_target():
    model = random_small_cnn()
    example = small_input()
    target = int(count_macs_and_params(model, example)[0] * 0.4)
    config = PruneConfig(target_macs=target, round_to=8)
    result = prune_model(model, example, config, progress=False)
    assert result.report.macs_after <= target
    assert result.report.macs_after > target * 0.6  # the search does not overshoot wildly
    assert 0.0 < result.ratio < 0.9
    assert result.report.settings["ratio_applied"] == result.ratio
    assert result.report.settings["target_met"] is True


def test_target_macs_already_met_prunes_nothing(caplog):
    model = random_small_cnn()
    with caplog.at_level("WARNING", logger="pruning"):
        result = prune_model(model, small_input(), PruneConfig(target_macs=10**12),
                             progress=False)
    assert result.ratio == 0.0
    assert result.report.settings["target_met"] is True
    assert "already at most the target" in caplog.text  # said, not left to a debug line
    assert result.report.macs_after == result.report.macs_before


def test_unreachable_target_macs_is_an_error():
    with pytest.raises(PruningError, match="target_macs cannot be reached") as caught:
        prune_model(
            random_small_cnn(), small_input(), PruneConfig(target_macs=1000), progress=False
        )
    assert caught.value.fields["lowest_reachable_macs"] > 1000


def test_iterative_steps_call_finetune_after_each_step():
    calls = []

    def finetune(model: nn.Module, step_index: int) -> None:
        calls.append((step_index, conv_widths(model)["block_a.0"][1], model))

    config = PruneConfig(ratio=0.75, round_to=8, iterative_steps=3)
    result = prune_model(
        random_small_cnn(), small_input(), config, finetune=finetune, progress=False
    )
    assert [step for step, _, _ in calls] == [0, 1, 2]
    assert [width for _, width, _ in calls] == [48, 32, 16]
    assert all(model is result.model for _, _, model in calls)
    macs = [step.macs for step in result.report.steps]
    assert len(macs) == 3 and macs[0] > macs[1] > macs[2] == result.report.macs_after


def test_taylor_importance_needs_loss_batches():
    with pytest.raises(PruningError, match="loss_batches"):
        prune_model(
            random_small_cnn(),
            small_input(),
            PruneConfig(ratio=0.5, importance="taylor"),
            progress=False,
        )


def test_taylor_importance_uses_the_loss_batches(trained_small_cnn, digits):
    batches = loss_batches_from(digits)
    calls = []

    def counted_batches():
        calls.append(1)
        return batches()

    config = PruneConfig(ratio=0.5, round_to=8, importance="taylor", iterative_steps=2)
    result = prune_model(
        trained_small_cnn, small_input(), config, loss_batches=counted_batches, progress=False
    )
    assert len(calls) == 2  # a fresh gradient before every step
    assert result.report.misaligned_layers() == []
    assert conv_widths(result.model)["block_a.0"][1] == 32
    assert all(parameter.grad is None for parameter in result.model.parameters())
    assert all(parameter.grad is None for parameter in trained_small_cnn.parameters())


def test_taylor_importance_with_target_macs(trained_small_cnn, digits):
    example = small_input()
    target = count_macs_and_params(trained_small_cnn, example)[0] // 2
    config = PruneConfig(target_macs=target, round_to=8, importance="taylor")
    result = prune_model(
        trained_small_cnn, example, config, loss_batches=loss_batches_from(digits), progress=False
    )
    assert result.report.macs_after <= target


# --- report ---------------------------------------------------------------------------------


def test_report_serialises_and_formats():
    result = prune_model(
        random_small_cnn(), small_input(), PruneConfig(ratio=0.5, round_to=8), progress=False
    )
    data = json.loads(json.dumps(result.report.to_dict()))
    assert data["input_shape"] == [1, 3, SMALL_SIZE, SMALL_SIZE]
    assert data["macs_after"] < data["macs_before"]
    expected_reduction = data["macs_before"] / data["macs_after"]
    assert data["macs_reduction"] == pytest.approx(expected_reduction, rel=1e-3)
    assert [layer["name"] for layer in data["layers"]] == list(conv_widths(result.model))
    assert data["layers"][0] == {
        "name": "stem.0",
        "in_before": 3,
        "out_before": 32,
        "in_after": 3,
        "out_after": 16,
        "out_multiple_of_round_to": True,
    }
    assert data["settings"]["round_to"] == 8
    table = result.report.format_table()
    assert "block_a.0" in table and "out % 8 == 0" in table and "fewer" in table


# --- persistence ----------------------------------------------------------------------------


def test_save_and_load_give_identical_outputs(tmp_path):
    torch.manual_seed(0)
    model = ResNet18(num_classes=10).eval()
    result = prune_model(model, torch.randn(1, 3, 32, 32), PruneConfig(ratio=0.5), progress=False)
    path = tmp_path / "pruned.pt"
    save_pruned(result.model, path)
    loaded = load_pruned(path)
    assert type(loaded) is ResNet18
    assert not loaded.training
    assert conv_widths(loaded) == conv_widths(result.model)
    batch = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(batch), result.model(batch))
    assert [entry.name for entry in tmp_path.iterdir()] == ["pruned.pt"]  # no temporary left


def test_load_refuses_classes_from_untrusted_packages(tmp_path):
    path = tmp_path / "outside.pt"
    model = OutsideZooNet().eval()
    save_pruned(model, path)
    with pytest.raises(ModelError, match="not a trusted nn.Module") as caught:
        load_pruned(path)
    assert caught.value.fields["found"].endswith("OutsideZooNet")
    loaded = load_pruned(path, trusted_modules=(OutsideZooNet.__module__,))
    batch = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(batch), model(batch))


def test_load_reports_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        load_pruned(tmp_path / "absent.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ModelError, match="cannot read"):
        load_pruned(garbage)
    good = tmp_path / "good.pt"
    save_pruned(random_small_cnn(), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelError, match="cannot read"):
        load_pruned(truncated)
    plain_state_dict = tmp_path / "state_dict.pt"
    torch.save(random_small_cnn().state_dict(), plain_state_dict)
    with pytest.raises(ModelError, match="not a pruned model"):
        load_pruned(plain_state_dict)


def test_save_of_an_unpicklable_model_is_an_error(tmp_path):
    class LocalNet(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    path = tmp_path / "local.pt"
    with pytest.raises(ModelError, match="cannot save"):
        save_pruned(LocalNet(), path)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


# --- sensitivity ----------------------------------------------------------------------------


def test_sensitivity_scan_covers_every_prunable_group(trained_small_cnn, digits):
    ratios = (0.25, 0.75)
    entries = sensitivity_scan(
        trained_small_cnn,
        small_input(),
        held_out_top1(digits),
        ratios=ratios,
        round_to=8,
        progress=False,
    )
    layers = {entry.layer for entry in entries}
    assert len(layers) == 3  # stem, block_a, and the residual group (down + block_b)
    assert len(entries) == len(layers) * len(ratios)
    assert {(entry.layer, entry.ratio) for entry in entries} == {
        (layer, ratio) for layer in layers for ratio in ratios
    }
    drops = [entry.drop for entry in entries]
    assert drops == sorted(drops, reverse=True)
    coupled = {entry.layer: set(entry.coupled_layers) for entry in entries}
    assert {"down.0", "block_b.0"} in coupled.values()
    assert set().union(*coupled.values()) == {"stem.0", "down.0", "block_a.0", "block_b.0"}
    for entry in entries:
        assert entry.width_after % 8 == 0 and entry.width_after < entry.width_before
    # Removing three quarters of the residual group's channels without fine-tuning must hurt.
    assert max(drops) > 1.0
    assert conv_widths(trained_small_cnn)["down.0"] == (32, 64)  # the scan works on copies


def test_sensitivity_scan_skips_layers_no_wider_than_round_to(trained_small_cnn, digits):
    entries = sensitivity_scan(
        trained_small_cnn,
        small_input(),
        held_out_top1(digits),
        ratios=(0.5,),
        round_to=32,
        progress=False,
    )
    assert "stem.0" not in {layer for entry in entries for layer in entry.coupled_layers}
    assert len(entries) == 2


def test_sensitivity_scan_with_taylor_importance(trained_small_cnn, digits):
    entries = sensitivity_scan(
        trained_small_cnn,
        small_input(),
        held_out_top1(digits),
        ratios=(0.5,),
        importance="taylor",
        round_to=8,
        loss_batches=loss_batches_from(digits),
        progress=False,
    )
    assert len(entries) == 3
    assert all(entry.width_after == entry.width_before // 2 for entry in entries)


def test_sensitivity_scan_validates_its_arguments(trained_small_cnn, digits):
    with pytest.raises(ConfigError, match="ratios"):
        sensitivity_scan(trained_small_cnn, small_input(), held_out_top1(digits), ratios=(1.0,))
    with pytest.raises(PruningError, match="loss_batches"):
        sensitivity_scan(
            trained_small_cnn, small_input(), held_out_top1(digits), importance="taylor"
        )


# --- user models that go beyond the example's shape --------------------------------------------


class TwoHeads(nn.Module):
    """A shared body with a class head and a box head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU())
        self.cls = nn.Linear(64, 4)
        self.box = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x).mean(dim=(2, 3))
        return self.cls(features), self.box(features)


def test_taylor_importance_ranks_by_the_loss_it_is_given_and_names_what_it_leaves_out(caplog):
    batches = lambda: [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))]  # noqa: E731
    only_classes = lambda outputs, labels: nn.functional.cross_entropy(outputs[0], labels)  # noqa: E731
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="pruning.pruner"):
        result = prune_model(TwoHeads().eval(), torch.randn(1, 3, 8, 8),
                             PruneConfig(ratio=0.5, round_to=8, importance="taylor"),
                             loss_batches=batches, loss_function=only_classes, progress=False)
    assert result.model.body[0].out_channels == 32
    assert (result.model.cls.out_features, result.model.box.out_features) == (4, 8)
    [record] = [record for record in caplog.records if "does not reach" in record.getMessage()]
    assert "does not reach box" in record.getMessage()


def test_taylor_importance_ranks_frozen_layers_and_leaves_them_frozen():
    model = random_small_cnn()
    for parameter in model.stem.parameters():
        parameter.requires_grad_(False)
    batches = lambda: [(small_input(4), torch.randint(0, 10, (4,)))]  # noqa: E731
    result = prune_model(model, small_input(), PruneConfig(ratio=0.5, round_to=8, importance="taylor"),
                         loss_batches=batches, progress=False)
    assert conv_widths(result.model)["stem.0"][1] < conv_widths(model)["stem.0"][1]
    frozen = {name for name, parameter in result.model.named_parameters() if not parameter.requires_grad}
    assert frozen == {name for name, _ in result.model.named_parameters() if name.startswith("stem.")}


def test_a_pruned_model_that_no_longer_runs_is_a_pruning_error():
    class FixedView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 64, 3, padding=1)
            self.fc = nn.Linear(64 * 4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = nn.functional.adaptive_avg_pool2d(self.conv(x), 2)
            return self.fc(pooled.view(x.shape[0], 64 * 4))  # the width is written in

    with pytest.raises(PruningError, match="no longer runs") as caught:
        prune_model(FixedView().eval(), torch.randn(1, 3, 8, 8), PruneConfig(ratio=0.5, round_to=8),
                    progress=False)
    assert caught.value.fields["reason"]


def test_an_example_the_model_cannot_take_is_a_config_error():
    with pytest.raises(ConfigError, match="one tensor"):
        prune_model(random_small_cnn(), (small_input(),), PruneConfig(ratio=0.5), progress=False)
    with pytest.raises(ConfigError, match="does not run on example_input") as caught:
        prune_model(random_small_cnn(), torch.randn(1, 5, 8, 8), PruneConfig(ratio=0.5),
                    progress=False)
    assert caught.value.fields["shape"] == [1, 5, 8, 8]


def test_sensitivity_scan_keeps_every_layer_of_an_ignored_container(trained_small_cnn, digits):
    entries = sensitivity_scan(trained_small_cnn, small_input(), held_out_top1(digits), ratios=(0.5,),
                               round_to=8, ignored_layer_names=("block_a",), progress=False)
    assert "block_a.0" not in {layer for entry in entries for layer in entry.coupled_layers}
    with pytest.raises(ConfigError, match="not one string"):
        sensitivity_scan(trained_small_cnn, small_input(), held_out_top1(digits), ratios=(0.5,),
                         ignored_layer_names="block_a", progress=False)


class ActivationAttribute(nn.Module):
    """Keeps its activation as a function attribute, as nn.TransformerEncoderLayer does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.functional.relu  # written in Python
        self.smooth = nn.functional.gelu  # written in C (torch._C._nn)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.smooth(self.act(self.conv(x))).mean(dim=(2, 3)))


def test_a_model_holding_a_torch_function_saves_and_loads(tmp_path):
    model = ActivationAttribute().eval()
    path = tmp_path / "act.pt"
    save_pruned(model, path)
    loaded = load_pruned(path, trusted_modules=(ActivationAttribute.__module__,))
    batch = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(batch), model(batch))


class HeadsAttention(nn.Module):
    """Attention whose heads are cut out of one qkv projection by reshapes."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        return self.project(((q @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class TinyTransformer(nn.Module):
    """Patch embedding, a learned position table and one pre-norm transformer block: the
    channel coupling torch-pruning 1.6 cannot follow without head counts."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 8, 8)
        self.position = nn.Parameter(torch.zeros(1, 16, width))
        self.norm1 = nn.LayerNorm(width)
        self.attention = HeadsAttention(width, 4)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.position
        x = x + self.attention(self.norm1(x))
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x).mean(1))


def test_a_model_torch_pruning_cannot_follow_is_a_pruning_error():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch-pruning's note about the position table
        with pytest.raises(PruningError, match="torch-pruning could not prune this model") as caught:
            prune_model(TinyTransformer().eval(), torch.randn(2, 3, 32, 32), PruneConfig(ratio=0.5),
                        progress=False)
    assert caught.value.fields["reason"].startswith("IndexError")
