"""What to prune and how: :class:`PruneConfig`, validated when it is built.

This module imports nothing heavy, so a CLI can build and validate a configuration before torch is
loaded.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from typing import Any, Literal

from agent.errors import ConfigError

Importance = Literal["l1", "l2", "taylor"]
Scope = Literal["uniform", "global"]

IMPORTANCES: tuple[str, ...] = ("l1", "l2", "taylor")
SCOPES: tuple[str, ...] = ("uniform", "global")

# TensorRT's INT8 kernels prefer channel counts in multiples of 32 and FP16 ones multiples of 8
# (docs/reference/tensorrt.md, section 5); 32 satisfies both.
DEFAULT_ROUND_TO = 32


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_fraction(key: str, value: object, *, allow_zero: bool = True) -> float:
    """Return ``value`` as a float in [0, 1) (or (0, 1) without ``allow_zero``).

    Raises:
        ConfigError: naming ``key`` and the value found.
    """
    low = "[0" if allow_zero else "(0"
    if not _is_real(value):
        raise ConfigError(f"{key} must be a number in {low}, 1)", key=key, found=repr(value))
    number = float(value)  # type: ignore[arg-type]
    if not (0.0 <= number < 1.0) or (number == 0.0 and not allow_zero):
        raise ConfigError(f"{key} must be in {low}, 1)", key=key, found=value)
    return number


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ConfigError naming ``key``."""
    if value not in choices:
        raise ConfigError(
            f"{key} must be one of {', '.join(choices)}", key=key, found=repr(value)
        )
    return str(value)


def check_positive_int(key: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1, else raise a ConfigError naming ``key``."""
    if not _is_int(value) or int(value) < 1:  # type: ignore[call-overload]
        raise ConfigError(f"{key} must be an integer >= 1", key=key, found=repr(value))
    return int(value)  # type: ignore[call-overload]


@dataclass(frozen=True, kw_only=True)
class PruneConfig:
    """Settings of one channel-pruning run.

    Exactly one of ``ratio`` and ``target_macs`` is given.

    Attributes:
        ratio: Fraction of the output channels of every prunable layer group to remove, in [0, 1).
            With ``scope="global"`` it is the fraction of all prunable channels instead.
        target_macs: Prune until the model's MACs at the example input are at most this; the
            ratio is then searched.
        importance: How channels are ranked: ``l1`` or ``l2`` norm of their weights, or ``taylor``
            (first-order Taylor expansion of the loss, which needs loss batches).
        scope: ``uniform`` removes the same fraction from every layer group; ``global`` ranks all
            channels of the network together, so that layers with many weak channels lose more.
        round_to: Every pruned layer keeps a multiple of this many output channels (32 for INT8,
            8 is enough for FP16). A layer no wider than ``round_to`` is left as it is.
        iterative_steps: The ratio is reached in this many equal steps, with fine-tuning between.
        max_layer_ratio: No layer loses more than this fraction of its channels, in (0, 1).
        ignored_layer_names: Modules (names as in ``model.named_modules()``) whose output channels
            are kept. The classifier (a Linear, or a convolution whose channels reach an output
            with no layer taking them in between) is always kept and needs no entry here.

    Raises:
        ConfigError: A value is out of range; the error names the field and the value found.
    """

    ratio: float | None = None
    target_macs: int | None = None
    importance: Importance = "l2"
    scope: Scope = "uniform"
    round_to: int = DEFAULT_ROUND_TO
    iterative_steps: int = 1
    max_layer_ratio: float = 0.9
    ignored_layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.target_macs is None):
            raise ConfigError(
                "give exactly one of ratio and target_macs",
                key="ratio/target_macs",
                found=f"ratio={self.ratio!r}, target_macs={self.target_macs!r}",
            )
        if self.ratio is not None:
            check_fraction("ratio", self.ratio)
        if self.target_macs is not None:
            check_positive_int("target_macs", self.target_macs)
        check_choice("importance", self.importance, IMPORTANCES)
        check_choice("scope", self.scope, SCOPES)
        check_positive_int("round_to", self.round_to)
        check_positive_int("iterative_steps", self.iterative_steps)
        check_fraction("max_layer_ratio", self.max_layer_ratio, allow_zero=False)
        if self.ratio is not None and self.ratio > self.max_layer_ratio:
            # No layer may lose more than max_layer_ratio, so neither can the network as a whole.
            raise ConfigError(
                f"ratio must not exceed max_layer_ratio ({self.max_layer_ratio})",
                key="ratio",
                found=self.ratio,
            )
        names = self.ignored_layer_names
        if isinstance(names, str) or not all(isinstance(name, str) for name in names):
            raise ConfigError(
                "ignored_layer_names must be a sequence of module names",
                key="ignored_layer_names",
                found=repr(names),
            )
        # A list given by a caller is stored as a tuple so the frozen config stays hashable.
        object.__setattr__(self, "ignored_layer_names", tuple(names))

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON-ready values."""
        settings = asdict(self)
        settings["ignored_layer_names"] = list(self.ignored_layer_names)
        return settings
