"""Loading an operator's own PyTorch model (``--user-model M:F --checkpoint C``): the checkpoint
forms people actually have, and one-line errors naming what does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_pruning")

from torch import nn  # noqa: E402

from agent.errors import ModelError  # noqa: E402
from models.loader import load_user_model  # noqa: E402
from models.zoo.small_cnn import SmallCNN  # noqa: E402

SPEC = "tests.test_loader:make_model"


def make_model() -> nn.Module:
    return SmallCNN(num_classes=10)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_a_state_dict_saved_from_data_parallel_loads(tmp_path: Path) -> None:
    torch.manual_seed(1)
    trained = make_model()
    path = tmp_path / "dp.pt"
    torch.save({f"module.{key}": value for key, value in trained.state_dict().items()}, path)
    assert _same_weights(load_user_model(SPEC, path), trained)


def test_a_mismatched_checkpoint_names_the_keys_and_shapes(tmp_path: Path) -> None:
    state = make_model().state_dict()
    missing = next(iter(state))
    del state[missing]
    path = tmp_path / "missing.pt"
    torch.save(state, path)
    with pytest.raises(ModelError) as caught:
        load_user_model(SPEC, path)
    message = str(caught.value)
    assert "checkpoint does not match the model" in message and missing in message
    assert "\n" not in message

    wide = tmp_path / "wide.pt"
    torch.save(SmallCNN(width=32).state_dict(), wide)
    with pytest.raises(ModelError, match="size mismatch for"):
        load_user_model(SPEC, wide)


def test_a_whole_pickled_model_gets_a_one_line_explanation(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save(make_model(), path)
    with pytest.raises(ModelError) as caught:
        load_user_model(SPEC, path)
    message = str(caught.value)
    assert "holds pickled objects" in message and "model.state_dict()" in message
    assert "\n" not in message and "\x1b" not in message


def test_a_model_saved_by_save_pruned_loads_with_its_pruned_widths(tmp_path: Path) -> None:
    from pruning import PruneConfig, prune_model, save_pruned

    example = torch.zeros(2, 3, 16, 16)
    pruned = prune_model(make_model(), example, PruneConfig(ratio=0.5, round_to=8),
                         progress=False).model
    path = tmp_path / "pruned.pt"
    save_pruned(pruned, path)
    loaded = load_user_model(SPEC, path)
    assert _same_weights(loaded, pruned)
    assert sum(p.numel() for p in loaded.parameters()) < sum(
        p.numel() for p in make_model().parameters())
