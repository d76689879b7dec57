"""The power benchmark's PNG: GPU/EMC frequency, power and latency over time, one column per
strategy, on the bursty trace (labelled SIMULATION). matplotlib is optional (the host extra):
without it the plot is skipped and :func:`write_plot` says why.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agent.tooling.powerbench.runner import RunOutcome

log = logging.getLogger(__name__)


def write_plot(outcomes: list[RunOutcome], path: Path, *, target_ms: float) -> str | None:
    """Write the plot of ``outcomes`` (one trace, each strategy) to ``path``; answer ``None``, or
    the reason it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'jetson-edge-agent[host]')"
    if not outcomes:
        return "nothing to plot"
    figure, axes = plt.subplots(3, len(outcomes), figsize=(5 * len(outcomes), 8), sharex=True,
                                squeeze=False)
    for column, outcome in enumerate(outcomes):
        _column(axes, column, outcome, target_ms)
    figure.suptitle(f"SIMULATION: {outcomes[0].trace.description} trace "
                    "(not measured on a board)")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
    return None


def _column(axes: Any, column: int, outcome: RunOutcome, target_ms: float) -> None:
    times = [point.time_s for point in outcome.timeline]
    frequency, power, latency = axes[0][column], axes[1][column], axes[2][column]
    frequency.step(times, [point.gpu_hz / 1e6 for point in outcome.timeline], where="post",
                   label="GPU MHz")
    frequency.step(times, [point.emc_hz / 1e6 for point in outcome.timeline], where="post",
                   label="EMC MHz")
    frequency.step(times, [point.cpu_khz / 1e3 for point in outcome.timeline], where="post",
                   label="CPU MHz")
    frequency.set_title(outcome.strategy)
    frequency.set_ylabel("clock in force (MHz)")
    frequency.legend(loc="upper right", fontsize="small")
    power.plot(times, [point.power_mw / 1000 for point in outcome.timeline], linewidth=0.8)
    power.set_ylabel("VDD_IN (W)")
    records = outcome.result.records
    latency.plot([record.arrival_s for record in records],
                 [1000 * record.total_s for record in records], ".", markersize=2)
    latency.axhline(target_ms, color="red", linewidth=0.8, label="target")
    latency.set_ylabel("latency (ms)")
    latency.set_xlabel("simulated time (s)")
    latency.legend(loc="upper right", fontsize="small")


__all__ = ["write_plot"]
