"""Per-layer sensitivity: how much the metric drops when one layer group alone is pruned.

Layers whose channels are coupled (a residual stage: every convolution that writes into the same
sum) form one group and are pruned together. Each group is pruned on its own copy of the model at
each ratio, without fine-tuning, and evaluated. The result shows where pruning is cheap and where
it hurts, to choose ``ignored_layer_names`` or a per-network ratio.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from agent.errors import ConfigError, PruningError
from pruning.config import (
    DEFAULT_ROUND_TO,
    IMPORTANCES,
    check_choice,
    check_fraction,
    check_positive_int,
)
from pruning.pruner import (
    ROOT_MODULE_TYPES,
    AlignedPruner,
    LossBatches,
    LossFunction,
    accumulate_gradients,
    aligned_width,
    copy_with_gradients,
    dependency_graph,
    layers_to_ignore,
    make_importance,
)

log = logging.getLogger(__name__)

Evaluate = Callable[[nn.Module], float]


@dataclass(frozen=True)
class LayerSensitivity:
    """The metric after pruning one layer group at one ratio.

    Attributes:
        layer: The group's root convolution (or linear layer), as in ``named_modules()``.
        coupled_layers: Every layer whose output width changes with it (the root included), in
            model order.
        ratio: Fraction of the channels asked to be removed.
        width_before, width_after: The root's output channels; ``width_after`` is aligned to
            ``round_to``, so it can differ from ``ratio`` x ``width_before``.
        metric: ``evaluate`` of the pruned copy.
        drop: Baseline metric minus ``metric`` (positive: pruning hurt).
    """

    layer: str
    coupled_layers: tuple[str, ...]
    ratio: float
    width_before: int
    width_after: int
    metric: float
    drop: float


def sensitivity_scan(
    model: nn.Module,
    example_input: Tensor,
    evaluate: Evaluate,
    *,
    ratios: Sequence[float] = (0.25, 0.5, 0.75),
    importance: str = "l2",
    round_to: int = DEFAULT_ROUND_TO,
    ignored_layer_names: Sequence[str] = (),
    loss_batches: LossBatches | None = None,
    loss_function: LossFunction | None = None,
    progress: bool = True,
) -> list[LayerSensitivity]:
    """Prune each prunable layer group alone at each ratio and measure the metric's drop.

    A group is prunable when its root is wider than ``round_to`` (a narrower one stays as it is).
    The classifier and ``ignored_layer_names`` are left out, as in :func:`prune_model`.

    Args:
        model: The trained model; it is not modified.
        example_input: An input batch used to trace the model.
        evaluate: Returns the metric of a model (higher is better, e.g. top-1 in percent).
        ratios: Fractions of channels to remove, each in (0, 1).
        importance: ``l1``, ``l2`` or ``taylor`` (which needs ``loss_batches``).
        round_to: Alignment of the pruned widths.
        ignored_layer_names: Modules whose output channels are kept.
        loss_batches, loss_function: For Taylor importance, as in :func:`prune_model`.
        progress: Log each measurement at INFO (else at DEBUG).

    Returns:
        One entry per prunable group and ratio, the largest drop first.

    Raises:
        ConfigError: A ratio, the importance or round_to is invalid.
        PruningError: Taylor importance without ``loss_batches``.
    """
    ratios, round_to = _checked_arguments(ratios, importance, round_to, loss_batches)
    level = logging.INFO if progress else logging.DEBUG
    base = copy.deepcopy(model)
    if importance == "taylor" and loss_batches is not None:
        # One gradient pass serves every trial: each trial copy takes the gradients along.
        accumulate_gradients(base, loss_batches, loss_function or nn.functional.cross_entropy)
    baseline = float(evaluate(copy.deepcopy(base)))
    log.log(level, "sensitivity baseline metric %.4f", baseline)

    results = []
    groups = _prunable_groups(base, example_input, ignored_layer_names, round_to)
    for root_name, coupled, width in groups:
        for ratio in ratios:
            trial, width_after = _prune_group_alone(
                base,
                example_input,
                root_name,
                ratio,
                importance=importance,
                max_layer_ratio=max(ratios),
                ignored_layer_names=ignored_layer_names,
                round_to=round_to,
            )
            metric = float(evaluate(trial))
            entry = LayerSensitivity(
                layer=root_name,
                coupled_layers=coupled,
                ratio=ratio,
                width_before=width,
                width_after=width_after,
                metric=metric,
                drop=baseline - metric,
            )
            log.log(
                level,
                "sensitivity %s ratio %.2f: width %d -> %d, metric %.4f (drop %.4f)",
                root_name,
                ratio,
                width,
                width_after,
                metric,
                entry.drop,
            )
            results.append(entry)
    results.sort(key=lambda entry: (-entry.drop, entry.layer, entry.ratio))
    return results


def _checked_arguments(
    ratios: Sequence[float],
    importance: str,
    round_to: int,
    loss_batches: LossBatches | None,
) -> tuple[list[float], int]:
    """The ratios and round_to as checked; raises before any copy or evaluation is made."""
    ratios = [check_fraction("ratios", ratio, allow_zero=False) for ratio in ratios]
    if not ratios:
        raise ConfigError("ratios must list at least one ratio", key="ratios", found="()")
    check_choice("importance", importance, IMPORTANCES)
    round_to = check_positive_int("round_to", round_to)
    if importance == "taylor" and loss_batches is None:
        raise PruningError(
            "taylor importance needs loss_batches to compute gradients",
            key="importance",
            found=importance,
        )
    return ratios, round_to


def _prune_group_alone(
    base: nn.Module,
    example_input: Tensor,
    root_name: str,
    ratio: float,
    *,
    importance: str,
    max_layer_ratio: float,
    ignored_layer_names: Sequence[str],
    round_to: int,
) -> tuple[nn.Module, int]:
    """A copy of ``base`` with only the group rooted at ``root_name`` pruned by ``ratio``, and
    the root's output width after it."""
    trial = copy_with_gradients(base)
    modules = dict(trial.named_modules())
    pruner = AlignedPruner(
        trial,
        example_input,
        make_importance(importance),
        # Each trial prunes one group by exactly the ratio asked; no extra floor.
        max_layer_ratio=max_layer_ratio,
        pruning_ratio=0.0,
        pruning_ratio_dict={modules[root_name]: ratio},
        ignored_layers=layers_to_ignore(trial, example_input, ignored_layer_names),
        round_to=round_to,
    )
    pruner.step()
    return trial, _out_width(modules[root_name])


def _out_width(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return int(module.out_features)
    return int(module.out_channels)  # type: ignore[arg-type]


def _prunable_groups(
    model: nn.Module,
    example_input: Tensor,
    ignored_layer_names: Sequence[str],
    round_to: int,
) -> list[tuple[str, tuple[str, ...], int]]:
    """``(root name, coupled layer names, root width)`` of every group that round_to lets shrink."""
    names = {module: name for name, module in model.named_modules()}
    model_order = {name: index for index, name in enumerate(names.values())}
    graph = dependency_graph(model, example_input)
    ignored = layers_to_ignore(model, example_input, ignored_layer_names, graph)
    groups = []
    for group in graph.get_all_groups(
        ignored_layers=ignored, root_module_types=list(ROOT_MODULE_TYPES)
    ):
        root = group[0].dep.target.module
        width = _out_width(root)
        # A group that cannot lose a channel at this alignment (no wider than round_to) is not
        # measured: every trial would equal the baseline.
        if aligned_width(width, 1, round_to=round_to) == width:
            continue
        coupled = sorted(
            {
                names[dep.target.module]
                for dep, _ in group
                if graph.is_out_channel_pruning_fn(dep.handler)
                and isinstance(dep.target.module, ROOT_MODULE_TYPES)
            },
            key=model_order.__getitem__,
        )
        groups.append((names[root], tuple(coupled), width))
    return groups
