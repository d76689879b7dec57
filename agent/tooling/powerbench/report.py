"""The power benchmark's targets, its verdicts and its tables (every table says SIMULATION).

:data:`TARGETS` names each headline key of the summary with its bound (issue 18's acceptance
figures on the Orin Nano profile); :func:`check_targets` adds ``summary["targets"]`` (key -> met,
or ``None`` when the figure could not be measured, which counts as missed) and
:func:`format_summary` prints the per-trace comparison, the target table (figure, bound, verdict,
the figure over its bound) and the calibration table of the simulator against the anchors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Target:
    key: str
    bound: float
    at_least: bool  # True: the figure must be >= bound; False: <= bound
    what: str

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.bound if self.at_least else value <= self.bound


TARGETS: tuple[Target, ...] = (
    Target(key="energy_saving_vs_max", bound=0.30, at_least=True,
           what="energy/inference saved vs max clocks, bursty"),
    Target(key="energy_saving_vs_max_periodic", bound=0.45, at_least=True,
           what="... periodic 5 Hz"),
    Target(key="energy_saving_vs_max_saturated", bound=0.10, at_least=True,
           what="... near saturation"),
    Target(key="energy_saving_vs_podgov", bound=0.10, at_least=True,
           what="vs stock, where stock meets P99 (worst trace)"),
    Target(key="slo_attainment", bound=0.99, at_least=True,
           what="share of requests within target (worst trace)"),
    Target(key="max_consecutive_misses", bound=3, at_least=False,
           what="longest run of misses (any trace)"),
    Target(key="wake_ms", bound=15.0, at_least=False,
           what="first request after >= 10 s idle, beyond its compute"),
    Target(key="sleep_power_fraction", bound=0.5, at_least=False,
           what="sleep power / idle power at max clocks"),
    Target(key="clock_changes_per_s", bound=5.0, at_least=False,
           what="operating-point changes per second (worst trace)"),
    Target(key="calibration_max_power_error", bound=0.10, at_least=False,
           what="simulator vs power anchors (largest)"),
    Target(key="calibration_max_latency_error", bound=0.15, at_least=False,
           what="simulator vs latency anchors (largest)"),
)


def check_targets(summary: dict[str, Any]) -> dict[str, bool | None]:
    targets = {target.key: target.met(summary.get(target.key)) for target in TARGETS}
    summary["targets"] = targets
    summary["targets_met"] = all(value is True for value in targets.values())
    return targets


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_traces(summary: dict[str, Any]) -> list[str]:
    target_ms = summary["latency_target_ms"]
    lines = [f"SIMULATION of {summary['board']} (JetPack {summary['jetpack']}, nvpmodel mode "
             f"{summary['nvpmodel_mode']}), seed {summary['seed']}"
             f"{', quick' if summary['quick'] else ''}: P99 target {target_ms:.0f} ms, batches "
             f"of up to {summary['max_batch']}, capacity at max clocks "
             f"{summary['capacity_rps_at_max']:.0f} req/s; near saturation "
             f"{_number(summary.get('saturated_rps'), 0)} req/s (max clocks' P99 at 80 % of the "
             "target)"
             + ("" if summary.get("max_keeps_rail_on", True)
                else "; max clocks' GPU rail allowed to gate"),
             (f"{'trace':<10}{'strategy':<9}{'req':>6}{'mJ/inf':>9}{'avg W':>7}{'p50 ms':>8}"
             f"{'p99 ms':>8}{'in SLO':>8}{'run':>5}{'chg/s':>7}{'wake ms':>9}{'sleep W':>8}"
             f"{'vs max':>8}{'vs stock':>9}")]

    def saving(entry: dict[str, Any], other: dict[str, Any] | None) -> float | None:
        if other is None or not other.get("energy_per_inference_mj") or \
                entry.get("energy_per_inference_mj") is None:
            return None
        return 1 - entry["energy_per_inference_mj"] / other["energy_per_inference_mj"]

    for trace, by_strategy in summary["traces"].items():
        for name, entry in by_strategy.items():
            wake = max(entry["wake_ms"]) if entry["wake_ms"] else None
            sleep = entry["sleep_power_mw"] / 1000 if entry["sleep_power_mw"] else None
            avg_w = entry["avg_power_mw"] / 1000 if entry["avg_power_mw"] else None
            lines.append(
                f"{trace:<10}{name:<9}{entry['requests']:>6}"
                f"{_number(entry['energy_per_inference_mj'], 1):>9}{_number(avg_w, 2):>7}"
                f"{_number(entry['p50_ms'], 1):>8}{_number(entry['p99_ms'], 1):>8}"
                f"{_number(entry['slo_attainment'], 4):>8}{entry['max_consecutive_misses']:>5}"
                f"{_number(entry['clock_changes_per_s'], 2):>7}{_number(wake, 1):>9}"
                f"{_number(sleep, 2):>8}"
                f"{_number(saving(entry, by_strategy.get('max')), 3):>8}"
                f"{_number(saving(entry, by_strategy.get('stock')), 3):>9}")
    return lines


def format_targets(summary: dict[str, Any]) -> list[str]:
    targets = summary.get("targets") or check_targets(summary)
    lines = [f"{'target':<32}{'figure':>9}{'bound':>9}{'ratio':>8}  verdict  (SIMULATION)"]
    for target in TARGETS:
        value = summary.get(target.key)
        verdict = targets.get(target.key)
        ratio = value / target.bound if isinstance(value, (int, float)) and target.bound else None
        mark = "met" if verdict else ("MISSED" if verdict is False else "MISSED (no figure)")
        sign = ">=" if target.at_least else "<="
        lines.append(f"{target.key:<32}{_number(value):>9}{sign + _number(target.bound, 2):>9}"
                     f"{_number(ratio, 2):>8}  {mark}")
    if summary.get("ours_unavailable"):
        lines.append(f"the governor under test did not run: {summary['ours_unavailable']}")
    return lines


def format_calibration(calibration: dict[str, Any]) -> list[str]:
    lines = [(f"calibration of the simulator ({calibration['board']}) against the published "
             "anchors (fit: used to set the parameters; check: not)"),
             f"{'category':<9}{'role':<10}{'reference':>17}{'simulated':>11}{'error':>8}  anchor"]
    for row in calibration["rows"]:
        low, high = row["reference"]
        reference = _number(low, 2) if low == high else f"{_number(low, 2)}-{_number(high, 2)}"
        error = "n/a" if row["error"] is None else f"{100 * row['error']:.1f}%"
        lines.append(f"{row['category']:<9}{row['role']:<10}{reference + ' ' + row['unit']:>17}"
                     f"{_number(row['simulated'], 2):>11}{error:>8}  {row['anchor']}"
                     + (f" [{row['note']}]" if row["note"] else ""))
    return lines


def format_ceiling(summary: dict[str, Any]) -> list[str]:
    ceiling = summary.get("static_ceiling") or {}
    if not ceiling:
        return []
    lines = ["cheapest static point meeting the target (in-sample, a reference, not a governor)"]
    for trace, entry in ceiling.items():
        if entry["point"] is None:
            lines.append(f"  {trace}: no static point of the grid meets the target")
            continue
        point = entry["point"]
        lines.append(f"  {trace}: saves {_number(entry['energy_saving_vs_max'])} vs max at GPU "
                     f"{point['gpu_max_hz'] / 1e6:.0f} MHz, CPU {point['cpu_max_khz'] / 1e3:.0f} "
                     f"MHz, EMC {point['emc_hz'] / 1e6:.0f} MHz (P99 "
                     f"{_number(entry['p99_ms'], 1)} ms)")
    return ["", *lines]


def format_summary(summary: dict[str, Any]) -> str:
    return "\n".join([*format_traces(summary), *format_ceiling(summary), "",
                      *format_targets(summary), "", *format_calibration(summary["calibration"])])


__all__ = ["TARGETS", "Target", "check_targets", "format_summary"]
