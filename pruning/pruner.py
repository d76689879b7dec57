"""What prune_model and sensitivity_scan share: importance criteria, ignored layers, widths.

torch-pruning (1.6) rounds a pruned layer's width *down* to a multiple of ``round_to``. When fewer
than ``round_to`` channels would remain, that rounds to zero, and the library then silently skips
the layer (its group check refuses to remove every channel). With ``round_to=32`` and a ratio of 0.6
a 64-wide layer is therefore not pruned at all, while a 128-wide one loses 75 %.
:class:`AlignedPruner` replaces that rounding with :func:`aligned_width`: the multiple of
``round_to`` nearest to the requested width, never below ``round_to`` or the ``max_layer_ratio``
floor.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch_pruning as tp
from torch import Tensor, nn

from agent.errors import ConfigError, PruningError, first_line

log = logging.getLogger(__name__)

LossBatches = Callable[[], Iterable[tuple[Tensor, Tensor]]]
LossFunction = Callable[[Tensor, Tensor], Tensor]

# The layer types whose output channels start a pruning group. Normalisation layers follow the
# convolution they belong to; they are never pruned on their own.
ROOT_MODULE_TYPES = (nn.modules.conv._ConvNd, nn.Linear)


def make_importance(name: str) -> tp.importance.Importance:
    """The torch-pruning importance criterion for ``name`` (``l1``, ``l2`` or ``taylor``)."""
    if name == "l1":
        return tp.importance.MagnitudeImportance(p=1)
    if name == "l2":
        return tp.importance.MagnitudeImportance(p=2)
    if name == "taylor":
        return tp.importance.TaylorImportance()
    raise ConfigError("importance must be one of l1, l2, taylor", key="importance", found=name)


def aligned_width(current: int, requested: int, *, round_to: int, min_keep: int = 1) -> int:
    """The number of channels a layer of ``current`` channels keeps when ``requested`` are asked.

    The result is ``current`` itself (no pruning) or a multiple of ``round_to`` of at least
    ``max(round_to, min_keep)``, whichever is nearest to ``requested``; a tie keeps more channels.
    A layer no wider than ``round_to`` is never pruned.
    """
    if current <= round_to:
        return current
    candidates = [width for width in range(round_to, current, round_to) if width >= min_keep]
    candidates.append(current)
    return min(candidates, key=lambda width: (abs(width - requested), -width))


class AlignedPruner(tp.pruner.BasePruner):
    """torch-pruning's BasePruner with widths chosen by :func:`aligned_width`.

    Args:
        model: The model to prune in place.
        example_input: An input batch used to trace the model.
        importance: A torch-pruning importance criterion.
        max_layer_ratio: Largest fraction of a layer's channels that one step may remove.
        **options: Passed to ``BasePruner`` (``pruning_ratio``, ``global_pruning``,
            ``iterative_steps``, ``ignored_layers``, ``round_to``, ``pruning_ratio_dict``).
    """

    def __init__(
        self,
        model: nn.Module,
        example_input: Tensor,
        importance: tp.importance.Importance,
        *,
        max_layer_ratio: float,
        **options: Any,
    ) -> None:
        self._max_layer_ratio = max_layer_ratio
        was_training = model.training
        # Tracing the graph runs a forward pass and torch-pruning switches the model to eval mode
        # for it without switching back; restore the caller's mode.
        try:
            with traceable(model):
                super().__init__(
                    model,
                    example_input,
                    importance,
                    max_pruning_ratio=max_layer_ratio,
                    **options,
                )
        finally:
            model.train(was_training)

    def step(self, interactive: bool = False) -> Any:
        """One pruning step; torch-pruning's failures on graphs it cannot follow become a
        PruningError that says what to do."""
        if isinstance(self.importance, tp.importance.TaylorImportance):
            self._zero_unreached_gradients()
        # Pruning replaces a layer's parameters with new (trainable) ones: frozen stays frozen.
        frozen = {name for name, parameter in self.model.named_parameters()
                  if not parameter.requires_grad}
        try:
            return super().step(interactive)
        except (IndexError, RuntimeError, ValueError, KeyError) as exc:
            raise PruningError(
                "torch-pruning could not prune this model: some layers couple channels in a way "
                "it cannot follow (hand-written attention that reshapes heads, a parameter used "
                "outside a layer); keep those layers out with ignored_layer_names",
                reason=f"{type(exc).__name__}: {first_line(exc)}",
            ) from exc
        finally:
            for name, parameter in self.model.named_parameters():
                if name in frozen:
                    parameter.requires_grad_(False)

    def _zero_unreached_gradients(self) -> None:
        """Taylor importance is weight x loss gradient; a layer the loss does not reach (a head
        the loss leaves out) has no gradient, which torch-pruning cannot read. Its true gradient
        is zero: its channels count for nothing in that loss, which the warning says."""
        names = {module: name for name, module in self.model.named_modules()}
        unreached = []
        for module in self.DG.module2node:  # the layers the traced forward pass went through
            if not isinstance(module, ROOT_MODULE_TYPES) or module.weight.grad is not None:
                continue
            unreached.append(names.get(module, type(module).__name__))
            for parameter in module.parameters(recurse=False):
                parameter.grad = torch.zeros_like(parameter)
        if unreached and not getattr(self, "_warned_unreached", False):
            self._warned_unreached = True
            log.warning("taylor importance: the loss does not reach %s, so channels are ranked "
                        "by what the loss uses only (give a loss over every output, or use l1 or "
                        "l2 importance)", ", ".join(sorted(unreached)))

    def _is_atten_group(self, group: Any) -> Any:
        # torch-pruning calls this (and nothing else we can hook) with each group just before it
        # rounds that group's pruning count: remember the group so _round_to knows which layer it
        # rounds and in how many channel groups (grouped convolutions) the count applies.
        self._rounding_group = group
        return super()._is_atten_group(group)

    def _round_to(self, n_pruned: int, current_channels: int, round_to: int) -> int:
        # Overrides torch-pruning's private rounding hook (torch-pruning 1.6.1; the host extra pins
        # <1.7). BasePruner calls it, whenever round_to is set, with the number of channels the
        # criterion chose to remove from one layer group. tests/test_pruning.py fails if a new
        # release stops calling it (64-wide ResNet-18 layers would stay unpruned at ratio 0.6).
        #
        # With channel groups (a grouped convolution, a GroupNorm), ``n_pruned`` counts channels
        # of one group and the library removes that many from each of the group count's groups
        # (the largest count among the coupled layers); every member's count must divide the
        # width that is kept.
        group = getattr(self, "_rounding_group", None)
        counts = self._channel_group_counts(group) if group is not None else []
        channel_groups = max(counts, default=1)
        if current_channels % channel_groups:
            channel_groups, counts = 1, []
        module = group[0].dep.target.module if group is not None else None
        # The max_layer_ratio floor counts from the layer's width before any step, as
        # torch-pruning's own check does: per step, several steps would remove more.
        original = self.layer_init_out_ch.get(module) or current_channels
        min_keep = max(1, math.ceil(original * (1.0 - self._max_layer_ratio)))
        keep = aligned_width(
            current_channels,
            current_channels - n_pruned * channel_groups,
            round_to=math.lcm(max(1, round_to), *counts),
            min_keep=min_keep,
        )
        return (current_channels - keep) // channel_groups

    def _channel_group_counts(self, group: Any) -> list[int]:
        """The channel-group counts of a pruning group's members (what torch-pruning's
        _get_channel_groups takes the largest of)."""
        counts = []
        for dep, _ in group:
            groups = (self.out_channel_groups if self.DG.is_out_channel_pruning_fn(dep.handler)
                      else self.in_channel_groups)
            if dep.target.module in groups:
                counts.append(int(groups[dep.target.module]))
        return counts


@contextlib.contextmanager
def traceable(model: nn.Module) -> Iterator[None]:
    """Let torch-pruning see frozen layers: it traces the model through autograd, and a layer
    whose parameters do not require gradients (and whose input does not) leaves no trace, so it
    would be neither pruned nor adjusted to its pruned neighbours."""
    frozen = [parameter for parameter in model.parameters() if not parameter.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)


def output_channel_counts(model: nn.Module, example_input: Tensor) -> set[int]:
    """The size of axis 1 of every tensor the model returns (classes, or channels of a map)."""
    return {shape[1] for shape in output_shapes(model, example_input) if len(shape) >= 2}


def output_shapes(model: nn.Module, example_input: Tensor) -> list[tuple[int, ...]]:
    """Shapes of the tensors the model returns for ``example_input`` (in eval mode)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(example_input)
    finally:
        model.train(was_training)
    return [tuple(tensor.shape) for tensor in _flatten_tensors(outputs)]


def _flatten_tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _flatten_tensors(item)]
    return []


def layers_to_ignore(
    model: nn.Module,
    example_input: Tensor,
    ignored_layer_names: Sequence[str],
    graph: tp.DependencyGraph | None = None,
) -> list[nn.Module]:
    """The modules whose output channels must be kept.

    Those are the classifier (every ``nn.Linear`` whose ``out_features`` equals the size of one
    of the model's outputs; a hidden layer of the same width is kept too, which only costs a
    little pruning), the convolutions that produce an output's channels
    (:func:`output_convolutions`) and the modules named in ``ignored_layer_names``.

    Raises:
        ConfigError: A name in ``ignored_layer_names`` is not a module of ``model``.
    """
    if isinstance(ignored_layer_names, str):
        raise ConfigError("ignored_layer_names must be a sequence of module names, not one string",
                          key="ignored_layer_names", found=ignored_layer_names)
    modules = dict(model.named_modules())
    unknown = [name for name in ignored_layer_names if name not in modules]
    if unknown:
        raise ConfigError(
            "ignored_layer_names lists modules the model does not have",
            key="ignored_layer_names",
            found=", ".join(unknown),
        )
    output_counts = output_channel_counts(model, example_input)
    ignored: list[nn.Module] = [
        module
        for module in model.modules()
        if isinstance(module, nn.Linear) and module.out_features in output_counts
    ]
    ignored += output_convolutions(model, example_input, graph)
    # A named container keeps every layer inside it (as torch-pruning's pruner expands it; its
    # dependency graph, which the sensitivity scan walks, does not).
    ignored += [module for name in ignored_layer_names for module in modules[name].modules()]
    return ignored


def dependency_graph(model: nn.Module, example_input: Tensor) -> tp.DependencyGraph:
    """torch-pruning's dependency graph of ``model`` (frozen layers included), leaving the model
    in the mode it was in (tracing switches it to eval mode)."""
    was_training = model.training
    try:
        with traceable(model):
            return tp.DependencyGraph().build_dependency(model, example_inputs=example_input)
    finally:
        model.train(was_training)


def output_convolutions(model: nn.Module, example_input: Tensor,
                        graph: tp.DependencyGraph | None = None) -> list[nn.Module]:
    """Convolutions whose output channels reach one of the model's outputs with no layer taking
    them in between: a 1x1 convolution classifier before global pooling, the last layer of a
    segmentation net (also behind a softmax or a permute to channels-last).

    Told apart from hidden layers in torch-pruning's dependency graph: removing a hidden layer's
    channel also removes an input channel of the convolution or Linear layer that consumes it;
    removing an output layer's channel reaches no such layer, only the output. ``graph``: the
    model's :func:`dependency_graph`, when the caller has one already.
    """
    sizes = {size for shape in output_shapes(model, example_input) for size in shape[1:]}
    candidates = [module for module in model.modules()
                  if isinstance(module, nn.modules.conv._ConvNd) and module.out_channels in sizes]
    if not candidates:
        return []
    if graph is None:
        graph = dependency_graph(model, example_input)
    found: list[nn.Module] = []
    for module in candidates:
        if module not in graph.module2node:
            continue  # not on the traced path
        pruner = graph.get_pruner_of_module(module)
        group = graph.get_pruning_group(module, pruner.prune_out_channels, idxs=[0])
        if not any(graph.is_in_channel_pruning_fn(dep.handler)
                   and isinstance(dep.target.module, ROOT_MODULE_TYPES) for dep, _ in group):
            found.append(module)
    return found


def copy_with_gradients(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters also carry copies of the original's ``.grad``.

    ``copy.deepcopy`` drops gradients (torch 2.13), and Taylor importance needs them on every copy
    that is pruned; copying them is cheaper than a new backward pass per copy.
    """
    duplicate = copy.deepcopy(model)
    for original, copied in zip(model.parameters(), duplicate.parameters()):
        if original.grad is not None:
            copied.grad = original.grad.detach().clone()
    return duplicate


def accumulate_gradients(
    model: nn.Module, loss_batches: LossBatches, loss_function: LossFunction
) -> int:
    """Fill ``.grad`` of every parameter with the loss gradient summed over ``loss_batches()``.

    Taylor importance ranks a channel by weight x gradient, so it needs these gradients before
    every pruning step.

    Returns:
        The number of batches used.

    Raises:
        PruningError: ``loss_batches()`` yields nothing.
    """
    was_training = model.training
    # Eval mode: measuring gradients must not move BatchNorm's running statistics.
    model.eval()
    model.zero_grad(set_to_none=True)
    batches = 0
    try:
        # Frozen layers are ranked too: they need a gradient for that, not training.
        with torch.enable_grad(), traceable(model):
            for images, labels in loss_batches():
                loss_function(model(images), labels).backward()
                batches += 1
    finally:
        model.train(was_training)
    if batches == 0:
        raise PruningError("taylor importance needs at least one batch; loss_batches gave none")
    return batches
