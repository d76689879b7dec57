"""What pruning did: parameters, MACs and every convolution's width, before and after.

MACs are multiply-accumulates at the example input, as counted by torch-pruning's
``count_ops_and_params`` (which names them "ops"); they scale with the input's spatial size, so the
report records the input shape they were counted at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch_pruning as tp
from torch import Tensor, nn


def conv_widths(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every convolution's ``(in_channels, out_channels)`` by module name, in model order."""
    return {
        name: (int(module.in_channels), int(module.out_channels))
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.conv._ConvNd)
    }


def count_macs_and_params(model: nn.Module, example_input: Tensor) -> tuple[int, int]:
    """``(MACs, parameters)`` of ``model`` for one forward pass of ``example_input``."""
    macs, params = tp.utils.count_ops_and_params(model, example_input)
    return int(macs), int(params)


@dataclass(frozen=True)
class ModelStats:
    """A model's cost and conv widths at one moment (taken before pruning changes it)."""

    macs: int
    params: int
    conv_widths: dict[str, tuple[int, int]]


def measure(model: nn.Module, example_input: Tensor) -> ModelStats:
    """Count ``model``'s MACs and parameters at ``example_input`` and record its conv widths."""
    macs, params = count_macs_and_params(model, example_input)
    return ModelStats(macs=macs, params=params, conv_widths=conv_widths(model))


@dataclass(frozen=True)
class LayerWidths:
    """One convolution's widths before and after pruning."""

    name: str
    in_before: int
    out_before: int
    in_after: int
    out_after: int
    out_multiple_of_round_to: bool

    @property
    def pruned(self) -> bool:
        return (self.in_after, self.out_after) != (self.in_before, self.out_before)


@dataclass(frozen=True)
class StepStats:
    """Cost after one pruning step (``step`` counts from 1)."""

    step: int
    macs: int
    params: int


@dataclass(frozen=True)
class PruneReport:
    """Parameters, MACs and conv widths before and after pruning.

    Attributes:
        input_shape: The example input the MACs were counted at.
        round_to: The alignment asked for; ``out_multiple_of_round_to`` of each layer is checked
            against it.
        layers: Every convolution, in model order.
        steps: Cost after each iterative step.
        settings: The configuration that produced the model (for the JSON report).
    """

    input_shape: tuple[int, ...]
    round_to: int
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    layers: tuple[LayerWidths, ...]
    steps: tuple[StepStats, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def compare(
        cls,
        before: ModelStats,
        after: ModelStats,
        *,
        input_shape: tuple[int, ...],
        round_to: int,
        steps: tuple[StepStats, ...] = (),
        settings: dict[str, Any] | None = None,
    ) -> PruneReport:
        """Build the report from measurements taken before and after pruning."""
        layers = []
        for name, (in_before, out_before) in before.conv_widths.items():
            # A layer missing after pruning would be a torch-pruning bug; show it as width 0.
            in_after, out_after = after.conv_widths.get(name, (0, 0))
            layers.append(
                LayerWidths(
                    name=name,
                    in_before=in_before,
                    out_before=out_before,
                    in_after=in_after,
                    out_after=out_after,
                    out_multiple_of_round_to=out_after % round_to == 0,
                )
            )
        return cls(
            input_shape=tuple(input_shape),
            round_to=round_to,
            macs_before=before.macs,
            macs_after=after.macs,
            params_before=before.params,
            params_after=after.params,
            layers=tuple(layers),
            steps=tuple(steps),
            settings=dict(settings or {}),
        )

    @property
    def macs_ratio(self) -> float:
        """MACs after / before (0.25 means a quarter is left)."""
        return self.macs_after / self.macs_before if self.macs_before else 1.0

    @property
    def params_ratio(self) -> float:
        """Parameters after / before."""
        return self.params_after / self.params_before if self.params_before else 1.0

    @property
    def macs_reduction(self) -> float:
        """MACs before / after (4.0 means four times fewer)."""
        return self.macs_before / self.macs_after if self.macs_after else float("inf")

    @property
    def params_reduction(self) -> float:
        """Parameters before / after."""
        return self.params_before / self.params_after if self.params_after else float("inf")

    def misaligned_layers(self) -> list[str]:
        """Pruned convolutions whose output width is not a multiple of ``round_to``."""
        return [
            layer.name
            for layer in self.layers
            if layer.out_after != layer.out_before and not layer.out_multiple_of_round_to
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "input_shape": list(self.input_shape),
            "round_to": self.round_to,
            "macs_before": self.macs_before,
            "macs_after": self.macs_after,
            "macs_ratio": round(self.macs_ratio, 6),
            "macs_reduction": round(self.macs_reduction, 4),
            "params_before": self.params_before,
            "params_after": self.params_after,
            "params_ratio": round(self.params_ratio, 6),
            "params_reduction": round(self.params_reduction, 4),
            "layers": [
                {
                    "name": layer.name,
                    "in_before": layer.in_before,
                    "out_before": layer.out_before,
                    "in_after": layer.in_after,
                    "out_after": layer.out_after,
                    "out_multiple_of_round_to": layer.out_multiple_of_round_to,
                }
                for layer in self.layers
            ],
            "steps": [
                {"step": step.step, "macs": step.macs, "params": step.params} for step in self.steps
            ],
            "settings": dict(self.settings),
        }

    def format_table(self) -> str:
        """A table for people: one row per convolution, then the totals."""
        name_width = max([len("layer")] + [len(layer.name) for layer in self.layers])
        aligned_header = f"out % {self.round_to} == 0"
        lines = [
            f"{'layer':<{name_width}}  {'in':>5} -> {'in':>5}  {'out':>5} -> {'out':>5}  "
            f"{aligned_header}"
        ]
        for layer in self.layers:
            lines.append(
                f"{layer.name:<{name_width}}  {layer.in_before:>5} -> {layer.in_after:>5}  "
                f"{layer.out_before:>5} -> {layer.out_after:>5}  "
                f"{'yes' if layer.out_multiple_of_round_to else 'no'}"
            )
        shape = "x".join(str(size) for size in self.input_shape)
        lines.append(
            f"MACs at {shape}: {_human(self.macs_before)} -> {_human(self.macs_after)} "
            f"({self.macs_reduction:.2f}x fewer)"
        )
        lines.append(
            f"parameters: {_human(self.params_before)} -> {_human(self.params_after)} "
            f"({self.params_reduction:.2f}x fewer)"
        )
        return "\n".join(lines)


def _human(count: int) -> str:
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= threshold:
            return f"{count / threshold:.2f} {suffix}"
    return str(count)
