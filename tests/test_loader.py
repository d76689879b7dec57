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


def make_failing_model() -> nn.Module:
    raise ValueError("num_classes is required")


def test_a_factory_that_fails_is_one_line_naming_it() -> None:
    with pytest.raises(ModelError) as caught:
        load_user_model("tests.test_loader:make_failing_model", None)
    message = str(caught.value)
    assert "'tests.test_loader:make_failing_model' failed: ValueError: num_classes is required" \
        in message
    assert "functools.partial" in message and "\n" not in message


def _package(root: Path, name: str, files: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / f"{name}.py").write_text(text)


def test_a_module_that_fails_on_import_is_one_line(tmp_path: Path, monkeypatch) -> None:
    _package(tmp_path, "userpkg_broken", {"broken": "raise ValueError('no config file')\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match="importing module 'userpkg_broken.broken' failed: "
                                         "ValueError: no config file"):
        load_user_model("userpkg_broken.broken:make", None)


def test_a_pruned_model_may_use_classes_from_elsewhere_in_the_factorys_package(
        tmp_path: Path, monkeypatch) -> None:
    from pruning import PruneConfig, prune_model, save_pruned

    _package(tmp_path, "userpkg_probe", {
        "nets": "from models.zoo.small_cnn import SmallCNN\n\n\n"
                "class Net(SmallCNN):\n    pass\n",
        "factories": "from userpkg_probe.nets import Net\n\n\n"
                     "def make():\n    return Net(num_classes=10)\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    from userpkg_probe.factories import make

    pruned = prune_model(make(), torch.zeros(2, 3, 16, 16), PruneConfig(ratio=0.5, round_to=8),
                         progress=False).model
    path = tmp_path / "pruned.pt"
    save_pruned(pruned, path)
    assert _same_weights(load_user_model("userpkg_probe.factories:make", path), pruned)
    with pytest.raises(ModelError, match="has no attribute 'does_not_exist'"):
        load_user_model("userpkg_probe.factories:does_not_exist", path)


def test_keys_that_share_a_wrappers_prefix_load(tmp_path: Path) -> None:
    torch.manual_seed(2)
    trained = make_model()
    path = tmp_path / "lightning.pt"
    torch.save({"state_dict": {f"model.{key}": value for key, value in trained.state_dict().items()},
                "epoch": 3}, path)
    assert _same_weights(load_user_model(SPEC, path), trained)


def test_a_mismatch_counts_missing_and_unexpected_keys(tmp_path: Path) -> None:
    state = make_model().state_dict()
    path = tmp_path / "renamed.pt"
    renamed = {f"backbone.{key}": value for key, value in list(state.items())[:-2]}
    renamed.update(dict(list(state.items())[-2:]))  # two keys that do match
    torch.save(renamed, path)
    with pytest.raises(ModelError) as caught:
        load_user_model(SPEC, path)
    message = str(caught.value)
    count = len(state) - 2
    assert f"{count} missing key(s) (" in message and f"{count} unexpected key(s) (backbone." \
        in message
    assert f"... {count - 3} more" in message


@pytest.mark.parametrize("content, message", [
    (b"", "checkpoint file is empty"),
    (b"epoch,loss\n1,0.5\n", "cannot read checkpoint (is it a file torch.save wrote?): "),
])
def test_files_that_are_not_checkpoints_are_named_as_such(tmp_path: Path, content: bytes,
                                                          message: str) -> None:
    path = tmp_path / "not.pt"
    path.write_bytes(content)
    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("?", r"\?")):
        load_user_model(SPEC, path)


def test_no_checkpoint_is_warned_about(caplog) -> None:
    with caplog.at_level("WARNING", logger="models.loader"):
        load_user_model(SPEC, None)
    assert any("no --checkpoint" in record.getMessage() for record in caplog.records)
