"""Structural channel pruning: :func:`prune_model`.

The model is pruned on a deep copy; the caller's model is never changed. Channels are ranked by
the configured importance, removed in ``iterative_steps`` equal steps with an optional fine-tune
after each, and every pruned layer keeps a multiple of ``round_to`` channels. The classifier and
the layers the configuration names keep their output width, so the outputs keep their shape.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from agent.errors import ConfigError, PruningError, first_line
from pruning.config import PruneConfig
from pruning.pruner import (
    AlignedPruner,
    LossBatches,
    LossFunction,
    accumulate_gradients,
    copy_with_gradients,
    layers_to_ignore,
    make_importance,
    output_shapes,
)
from pruning.report import ModelStats, PruneReport, StepStats, count_macs_and_params, measure

log = logging.getLogger(__name__)

Finetune = Callable[[nn.Module, int], None]

# The target-MACs search stops when the ratio is known to within this; finer steps rarely change
# a width once widths are rounded to multiples of round_to.
RATIO_TOLERANCE = 1.0 / 256


@dataclass(frozen=True)
class PruneResult:
    """The pruned model (in eval mode), what was done to it, and the ratio applied.

    ``ratio`` is the configured ratio, or the one the search found for ``target_macs``.
    """

    model: nn.Module
    report: PruneReport
    ratio: float


def prune_model(
    model: nn.Module,
    example_input: Tensor,
    config: PruneConfig,
    *,
    finetune: Finetune | None = None,
    loss_batches: LossBatches | None = None,
    loss_function: LossFunction | None = None,
    progress: bool = True,
) -> PruneResult:
    """Prune a deep copy of ``model`` as ``config`` says.

    Args:
        model: The trained model; it is not modified.
        example_input: An input batch at the size the model is used at; used to trace the model
            and to count MACs.
        config: What to prune.
        finetune: Called as ``finetune(model, step_index)`` after every pruning step (step_index
            0 .. iterative_steps - 1, so also after the last one) to recover accuracy; it trains
            the model it is given in place.
        loss_batches: For ``importance="taylor"``: returns a fresh iterable of (inputs, targets)
            batches; the loss gradient over them is taken before every step.
        loss_function: Loss for the Taylor gradients; cross-entropy when not given.
        progress: Log MACs and parameters after every step at INFO (else at DEBUG).

    Returns:
        The pruned copy, its report and the ratio applied.

    Raises:
        PruningError: Taylor importance without ``loss_batches``, an unreachable
            ``target_macs``, or pruning that would change the shape of an output.
        ConfigError: ``ignored_layer_names`` names a module the model does not have.
    """
    _check_arguments(config, example_input, loss_batches)
    if loss_function is None:
        loss_function = nn.functional.cross_entropy
    # Only Taylor importance reads gradients; None skips the gradient pass for the others.
    gradient_batches = loss_batches if config.importance == "taylor" else None
    level = logging.INFO if progress else logging.DEBUG
    working = copy.deepcopy(model)
    input_shape = tuple(example_input.shape)
    try:
        reference_shapes = output_shapes(working, example_input)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ConfigError("the model does not run on example_input",
                          shape=list(input_shape), reason=first_line(exc)) from exc
    before = measure(working, example_input)

    if config.target_macs is None:
        ratio = float(config.ratio or 0.0)  # PruneConfig guarantees a ratio here
    else:
        ratio = _search_ratio(
            working,
            example_input,
            config,
            target=config.target_macs,
            macs_before=before.macs,
            gradient_batches=gradient_batches,
            loss_function=loss_function,
            level=level,
        )

    steps = _prune_in_steps(
        working,
        example_input,
        config,
        ratio,
        before=before,
        reference_shapes=reference_shapes,
        gradient_batches=gradient_batches,
        loss_function=loss_function,
        finetune=finetune,
        level=level,
    )
    working.eval()
    after = measure(working, example_input)
    report = _prune_report(config, ratio, before, after, input_shape=input_shape, steps=steps)
    return PruneResult(model=working, report=report, ratio=ratio)


def _check_arguments(
    config: PruneConfig, example_input: Tensor, loss_batches: LossBatches | None
) -> None:
    """Refuse what cannot be pruned before the model is copied."""
    if config.importance == "taylor" and loss_batches is None:
        raise PruningError(
            "taylor importance needs loss_batches to compute gradients",
            key="importance",
            found=config.importance,
        )
    if not isinstance(example_input, Tensor):
        raise ConfigError("example_input must be one tensor (a batch for the model's single "
                          "input)", key="example_input", found=type(example_input).__name__)


def _prune_in_steps(
    model: nn.Module,
    example_input: Tensor,
    config: PruneConfig,
    ratio: float,
    *,
    before: ModelStats,
    reference_shapes: list[tuple[int, ...]],
    gradient_batches: LossBatches | None,
    loss_function: LossFunction,
    finetune: Finetune | None,
    level: int,
) -> list[StepStats]:
    """Prune ``model`` in place in ``config.iterative_steps`` steps; the MACs and parameters
    after each step."""
    pruner = _make_pruner(
        model, example_input, config, ratio, iterative_steps=config.iterative_steps
    )
    steps: list[StepStats] = []
    for step_index in range(config.iterative_steps):
        if gradient_batches is not None:
            accumulate_gradients(model, gradient_batches, loss_function)
        pruner.step()
        # Gradients of removed channels are stale now; drop them before anything trains.
        model.zero_grad(set_to_none=True)
        _check_output_shapes(model, example_input, reference_shapes)
        macs, params = count_macs_and_params(model, example_input)
        steps.append(StepStats(step=step_index + 1, macs=macs, params=params))
        log.log(
            level,
            "pruning step %d/%d (ratio %.3f): MACs %d -> %d (%.2fx fewer), params %d -> %d",
            step_index + 1,
            config.iterative_steps,
            ratio,
            before.macs,
            macs,
            before.macs / max(macs, 1),
            before.params,
            params,
        )
        if finetune is not None:
            finetune(model, step_index)
    return steps


def _prune_report(
    config: PruneConfig,
    ratio: float,
    before: ModelStats,
    after: ModelStats,
    *,
    input_shape: tuple[int, ...],
    steps: list[StepStats],
) -> PruneReport:
    """What pruning did, with the ratio applied and, for ``target_macs``, whether it was met."""
    if config.target_macs is not None and after.macs > config.target_macs:
        # Only global ranking with fine-tuning between steps can end above the searched
        # structure: the ranking then depends on weights that changed after the search.
        log.warning(
            "pruned model has %d MACs, above target_macs %d; the search assumed one step",
            after.macs,
            config.target_macs,
        )
    settings = config.to_dict()
    settings["ratio_applied"] = ratio
    if config.target_macs is not None:
        settings["target_met"] = after.macs <= config.target_macs
    return PruneReport.compare(
        before,
        after,
        input_shape=input_shape,
        round_to=config.round_to,
        steps=tuple(steps),
        settings=settings,
    )


def _make_pruner(
    model: nn.Module,
    example_input: Tensor,
    config: PruneConfig,
    ratio: float,
    *,
    iterative_steps: int,
) -> AlignedPruner:
    return AlignedPruner(
        model,
        example_input,
        make_importance(config.importance),
        max_layer_ratio=config.max_layer_ratio,
        pruning_ratio=ratio,
        global_pruning=config.scope == "global",
        iterative_steps=iterative_steps,
        ignored_layers=layers_to_ignore(model, example_input, config.ignored_layer_names),
        round_to=config.round_to,
    )


def _check_output_shapes(
    model: nn.Module, example_input: Tensor, reference: list[tuple[int, ...]]
) -> None:
    try:
        found = output_shapes(model, example_input)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise PruningError(
            "the pruned model no longer runs: some layer depends on a channel count that pruning "
            "changed (a hard-coded view or reshape, or attention heads); keep the layers around it "
            "out of pruning with ignored_layer_names",
            reason=first_line(exc),
        ) from exc
    if found != reference:
        raise PruningError(
            "pruning changed the shape of the model's output; add the layer that produces it to "
            "ignored_layer_names",
            expected=reference,
            found=found,
        )


def _search_ratio(
    model: nn.Module,
    example_input: Tensor,
    config: PruneConfig,
    *,
    target: int,
    macs_before: int,
    gradient_batches: LossBatches | None,
    loss_function: LossFunction,
    level: int,
) -> float:
    """The smallest ratio whose one-step pruning brings the MACs to ``target`` or below.

    Bisection on copies of ``model``: the MACs fall (in steps) as the ratio grows.
    """
    if macs_before <= target:
        log.warning("the model needs %.3f GMACs at this input, already at most the target "
                    "%.3f: nothing to prune", macs_before / 1e9, target / 1e9)
        return 0.0
    if gradient_batches is not None:
        # One gradient pass serves every trial: each trial copy takes the gradients along.
        model = copy.deepcopy(model)
        accumulate_gradients(model, gradient_batches, loss_function)

    def macs_at(ratio: float) -> int:
        trial = copy_with_gradients(model)
        _make_pruner(trial, example_input, config, ratio, iterative_steps=1).step()
        macs, _ = count_macs_and_params(trial, example_input)
        log.debug("target search: ratio %.4f -> %d MACs", ratio, macs)
        return macs

    # No layer may lose more than max_layer_ratio, so a larger ratio could not prune further.
    low, high = 0.0, config.max_layer_ratio
    lowest_reachable = macs_at(high)
    if lowest_reachable > target:
        raise PruningError(
            "target_macs cannot be reached with these round_to and max_layer_ratio settings",
            target_macs=target,
            lowest_reachable_macs=lowest_reachable,
            round_to=config.round_to,
            max_layer_ratio=config.max_layer_ratio,
        )
    while high - low > RATIO_TOLERANCE:
        middle = (low + high) / 2
        if macs_at(middle) <= target:
            high = middle
        else:
            low = middle
    log.log(level, "target %d MACs (from %d): ratio %.4f", target, macs_before, high)
    return high
