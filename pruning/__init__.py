"""Structural channel pruning with torch-pruning, aligned to Tensor Core widths.

Importing this package loads only the configuration; torch and torch-pruning are imported when
one of the other names is first used, so a CLI can validate a :class:`PruneConfig` cheaply.

    from pruning import PruneConfig, prune_model
    result = prune_model(model, example_input, PruneConfig(ratio=0.5, round_to=32))
    print(result.report.format_table())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pruning.config import PruneConfig

if TYPE_CHECKING:
    from pruning.persist import load_pruned, save_pruned
    from pruning.prune import PruneResult, prune_model
    from pruning.report import PruneReport, conv_widths, count_macs_and_params
    from pruning.sensitivity import LayerSensitivity, sensitivity_scan

_LAZY = {
    "prune_model": "pruning.prune",
    "PruneResult": "pruning.prune",
    "PruneReport": "pruning.report",
    "conv_widths": "pruning.report",
    "count_macs_and_params": "pruning.report",
    "sensitivity_scan": "pruning.sensitivity",
    "LayerSensitivity": "pruning.sensitivity",
    "save_pruned": "pruning.persist",
    "load_pruned": "pruning.persist",
}

__all__ = ["PruneConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pruning' has no attribute '{name}'")
    return getattr(importlib.import_module(module_name), name)
