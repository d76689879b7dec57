"""``edge-agent bench power``: max clocks vs the stock governors vs ours on a SIMULATED board.

Each trace (periodic 5 Hz, bursty on/off, near saturation, a daily pattern with idle gaps) is
served three times, each time on a fresh fake board tree for the profile (``power/sim/tree.py``)
driven by :class:`~power.sim.board.SimBoard`, with the same arrivals and the same noise seed:
under ``jetson_clocks``' pinned clocks, under the board's stock governors (podgov and schedutil as
modelled from their source) and under the production controller. The figures (energy per
inference, P99 against the target, misses, wake latency, clock changes, sleep power) and the
calibration table of the simulator against the published anchors go into one summary;
:mod:`agent.tooling.powerbench.report` checks it against the targets and prints it.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import ConfigError
from agent.tooling.powerbench.strategies import OurGovernor, ours_available
from power.profiles import profile
from power.sim.baselines import MaxClocks, PinnedPoint, StockGovernors
from power.sim.board import SimBoard, TimelinePoint
from power.sim.kernel import FakeKernel
from power.sim.physics import LatencyNoise, compute_s, physics_for
from power.sim.serving import ServingConfig, ServingResult, Strategy, run_serving
from power.sim.traces import Trace, bursty, daily, periodic, saturated
from power.sim.tree import write_tree
from power.types import OperatingPoint, PowerPolicy

log = logging.getLogger(__name__)

STRATEGIES = ("max", "stock", "ours")
TRACES = ("periodic", "bursty", "saturated", "daily")
SLEEP_WINDOW_S = 2.0  # the last seconds of each >= 10 s idle gap, where sleep power is measured


@dataclass(frozen=True, kw_only=True)
class PowerBenchOptions:
    board: str = "orin-nano"
    jetpack: int = 6
    mode_id: int | None = None  # default: the profile's top mode (MAXN / MAXN_SUPER)
    seed: int = 1
    quick: bool = False
    latency_target_s: float = 0.050
    max_batch: int = 4
    step_period_s: float = 0.050
    # Near saturation: the rate at which max clocks' P99 is this share of the target (found by
    # bisection), i.e. close to the most load at which the target can be met at all.
    saturation_p99_share: float = 0.80
    strategies: tuple[str, ...] = STRATEGIES
    # The max baseline keeps the GPU rail on (the 9.1 W pinned idle anchor); False: it may gate,
    # the sensitivity of every "vs max" figure to that assumption.
    max_keeps_rail_on: bool = True
    # Also search a grid of static operating points for the cheapest that meets the target on
    # these traces: a reference for how much a target allows under the simulated physics.
    ceiling_traces: tuple[str, ...] = ()


@dataclass
class RunOutcome:
    """One trace under one strategy."""

    trace: Trace
    strategy: str
    result: ServingResult
    timeline: list[TimelinePoint] = field(default_factory=list)
    sleep_power_mw: float | None = None


def parse_traces(text: str) -> tuple[str, ...]:
    """``periodic,saturated`` -> the trace names, refusing one the benchmark does not run."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in TRACES]
    if unknown:
        raise ConfigError("unknown trace", key="--ceiling", found=", ".join(unknown),
                          known=", ".join(TRACES))
    return names


def top_mode(board_name: str) -> int:
    board = profile(board_name)
    uncapped = [mode for mode in board.modes if mode.gpu_max_hz is None
                and mode.cpu_max_khz is None]
    return uncapped[0].mode_id if uncapped else board.default_mode


def capacity_rps(options: PowerBenchOptions) -> float:
    board = profile(options.board)
    physics = physics_for(board.name)
    batch_s = compute_s(physics, gpu_hz=board.gpu_hz[-1], cpu_khz=board.cpu_khz[-1],
                        emc_hz=board.emc_hz[-1], batch_size=options.max_batch)
    return options.max_batch / batch_s


def near_saturation_rps(options: PowerBenchOptions) -> float:
    """The Poisson rate at which max clocks' P99 is ``saturation_p99_share`` of the target."""
    low, high = 0.05, 1.0  # shares of the batched capacity at max clocks
    capacity = capacity_rps(options)
    duration_s = 5.0 if options.quick else 15.0
    for _ in range(5 if options.quick else 8):
        share = (low + high) / 2
        trace = saturated(duration_s=duration_s, rate_hz=share * capacity, seed=options.seed)
        figures = trace_figures(run_one(trace, "max", options, record_timeline=False),
                                options.latency_target_s)
        if figures["p99_ms"] is not None and \
                figures["p99_ms"] <= 1000 * options.latency_target_s * options.saturation_p99_share:
            low = share
        else:
            high = share
    return low * capacity


def make_traces(options: PowerBenchOptions) -> list[Trace]:
    scale = 0.2 if options.quick else 1.0
    seed = options.seed
    return [
        periodic(duration_s=60.0 * scale, seed=seed),
        bursty(duration_s=120.0 * scale, seed=seed),
        saturated(duration_s=30.0 * scale, rate_hz=near_saturation_rps(options), seed=seed),
        daily(duration_s=max(40.0, 240.0 * scale), seed=seed),
    ]


def _strategy(name: str, board: SimBoard, options: PowerBenchOptions, writer: FakeKernel,
              point: OperatingPoint | None = None) -> Strategy:
    if point is not None:
        return PinnedPoint(board, writer, point)
    if name == "max":
        return MaxClocks(board, writer, keep_rail_on=options.max_keeps_rail_on)
    if name == "stock":
        return StockGovernors()
    policy = PowerPolicy(latency_target_s=options.latency_target_s,
                         max_changes_per_s=5.0)
    return OurGovernor(board, policy, writer)


def run_one(trace: Trace, strategy_name: str, options: PowerBenchOptions, *,
            record_timeline: bool, point: OperatingPoint | None = None) -> RunOutcome:
    board_profile = profile(options.board)
    mode_id = top_mode(options.board) if options.mode_id is None else options.mode_id
    with tempfile.TemporaryDirectory(prefix="powerbench-") as work:
        root = Path(work) / "board"
        root.mkdir()
        write_tree(root, board_profile, options.jetpack, mode_id=mode_id)
        kernel = FakeKernel(root, options.jetpack)
        board = SimBoard(root=root, physics=physics_for(board_profile.name),
                         record_timeline=True, kernel=kernel)
        strategy = _strategy(strategy_name, board, options, kernel, point)
        noise = LatencyNoise(board.physics, seed=options.seed * 7919 + TRACES.index(trace.name))
        config = ServingConfig(max_batch=options.max_batch, step_period_s=options.step_period_s)
        result = run_serving(board, trace, strategy, config=config, noise=noise)
        timeline = board.timeline or []
    return RunOutcome(trace=trace, strategy=strategy_name, result=result,
                      timeline=timeline if record_timeline else [],
                      sleep_power_mw=_sleep_power_mw(trace, timeline))


def _sleep_power_mw(trace: Trace, timeline: list[TimelinePoint]) -> float | None:
    """The average power over the last seconds of each idle gap before a wake probe."""
    if not trace.wake_probes_s:
        return None
    energy = seconds = 0.0
    previous_s = 0.0
    for point in timeline:
        span = point.time_s - previous_s
        end = point.time_s
        for probe in trace.wake_probes_s:
            start = max(previous_s, probe - SLEEP_WINDOW_S)
            stop = min(end, probe)
            if stop > start and span > 0:
                energy += point.power_mw * (stop - start)
                seconds += stop - start
        previous_s = point.time_s
    return energy / seconds if seconds > 0 else None


def trace_figures(outcome: RunOutcome, target_s: float) -> dict[str, Any]:
    records = sorted(outcome.result.records, key=lambda record: record.arrival_s)
    latencies = sorted(record.total_s for record in records)
    misses = [record.total_s > target_s for record in records]
    run = longest = 0
    for missed in misses:
        run = run + 1 if missed else 0
        longest = max(longest, run)
    probes = set(outcome.trace.wake_probes_s)
    wake_ms = [1000 * (record.total_s - record.ideal_compute_s) for record in records
               if record.arrival_s in probes]
    result = outcome.result
    count = len(records)
    return {
        "requests": count,
        "arrivals": len(outcome.trace.arrivals_s),
        "arrival_rps": len(outcome.trace.arrivals_s) / outcome.trace.duration_s,
        "energy_j": result.energy_mj / 1000,
        "energy_per_inference_mj": result.energy_mj / count if count else None,
        "avg_power_mw": result.energy_mj / result.duration_s if result.duration_s else None,
        "p50_ms": 1000 * _percentile(latencies, 0.50) if latencies else None,
        "p99_ms": 1000 * _percentile(latencies, 0.99) if latencies else None,
        "max_ms": 1000 * latencies[-1] if latencies else None,
        "slo_attainment": 1 - sum(misses) / count if count else None,
        "meets_target": bool(latencies) and _percentile(latencies, 0.99) <= target_s,
        "max_consecutive_misses": longest,
        # Operating-point changes a second (one apply moving GPU, EMC and CPUs counts once);
        # the per-clock count beside it.
        "clock_changes_per_s": result.point_changes / result.duration_s
        if result.duration_s else None,
        "clock_domain_changes_per_s": result.clock_changes / result.duration_s
        if result.duration_s else None,
        "wake_ms": wake_ms,
        "wakes": result.wakes,
        "max_queue_depth": result.max_queue_depth,
        "sleep_power_mw": outcome.sleep_power_mw,
        "duration_s": result.duration_s,
    }


def static_points(board_name: str) -> list[OperatingPoint]:
    """The grid ``--ceiling`` searches: every other GPU entry (and the top), the EMC rates from
    665.6 MHz up, the CPU floor, middle and top; the rail allowed to gate."""
    board = profile(board_name)
    gpus = sorted({*board.gpu_hz[::2], board.gpu_hz[-1]})
    floor_index = board.cpu_khz.index(board.cpu_floor_khz) if board.cpu_floor_khz in \
        board.cpu_khz else 0
    cpus = sorted({board.cpu_khz[floor_index],
                   board.cpu_khz[(floor_index + len(board.cpu_khz) - 1) // 2],
                   board.cpu_khz[-1]})
    emcs = [rate for rate in board.emc_hz if rate >= 665600000] or list(board.emc_hz)
    return [OperatingPoint(gpu_min_hz=gpu, gpu_max_hz=gpu, cpu_min_khz=cpu, cpu_max_khz=cpu,
                           emc_hz=emc, gpu_railgate=True)
            for gpu in gpus for cpu in cpus for emc in emcs]


def static_ceiling(trace: Trace, options: PowerBenchOptions, max_figures: dict[str, Any]
                   ) -> dict[str, Any]:
    """The cheapest static point that meets the target on ``trace`` (in-sample: chosen on the
    very arrivals and noise it is scored on, so an optimistic reference, not a governor)."""
    best: dict[str, Any] | None = None
    for point in static_points(profile(options.board).name):
        figures = trace_figures(run_one(trace, "pinned", options, record_timeline=False,
                                        point=point), options.latency_target_s)
        if not figures["meets_target"]:
            continue
        if best is None or figures["energy_per_inference_mj"] < best["energy_per_inference_mj"]:
            best = {**figures, "point": point.to_json()}
    if best is None:
        return {"point": None, "energy_saving_vs_max": None}
    return {"point": best["point"], "p99_ms": best["p99_ms"],
            "energy_per_inference_mj": best["energy_per_inference_mj"],
            "energy_saving_vs_max": _saving(best, max_figures)}


def _percentile(ordered: list[float], share: float) -> float:
    index = min(len(ordered) - 1, max(0, round(share * len(ordered) + 0.5) - 1))
    return ordered[index]


def _saving(ours: dict[str, Any], other: dict[str, Any]) -> float | None:
    if ours.get("energy_per_inference_mj") is None or not other.get("energy_per_inference_mj"):
        return None
    return 1 - ours["energy_per_inference_mj"] / other["energy_per_inference_mj"]


def summarize(options: PowerBenchOptions, figures: dict[str, dict[str, dict[str, Any]]],
              calibration: dict[str, Any], unavailable: str | None) -> dict[str, Any]:
    """The summary's headline keys from the per-trace figures ``figures[trace][strategy]``."""
    ours = {trace: by["ours"] for trace, by in figures.items() if "ours" in by}
    summary: dict[str, Any] = {
        "simulation": True,
        "board": profile(options.board).name,
        "jetpack": options.jetpack,
        "nvpmodel_mode": top_mode(options.board) if options.mode_id is None else options.mode_id,
        "seed": options.seed,
        "quick": options.quick,
        "latency_target_ms": 1000 * options.latency_target_s,
        "max_batch": options.max_batch,
        "max_keeps_rail_on": options.max_keeps_rail_on,
        "capacity_rps_at_max": capacity_rps(options),
        "saturated_rps": figures.get("saturated", {}).get("max", {}).get("arrival_rps"),
        "traces": figures,
        "calibration": calibration,
        "calibration_max_power_error": calibration["max_power_error"],
        "calibration_max_latency_error": calibration["max_latency_error"],
        "ours_unavailable": unavailable,
    }
    def saving_vs(trace: str, baseline: str) -> float | None:
        by = figures.get(trace, {})
        if "ours" not in by or baseline not in by:
            return None
        return _saving(by["ours"], by[baseline])

    summary["energy_saving_vs_max"] = saving_vs("bursty", "max")
    summary["energy_saving_vs_max_periodic"] = saving_vs("periodic", "max")
    summary["energy_saving_vs_max_saturated"] = saving_vs("saturated", "max")
    summary["energy_saving_vs_max_daily"] = saving_vs("daily", "max")
    podgov_met = [trace for trace, by in figures.items()
                  if "stock" in by and by["stock"]["meets_target"]]
    podgov_savings = [saving_vs(trace, "stock") for trace in podgov_met]
    known = [value for value in podgov_savings if value is not None]
    summary["podgov_meets_target_on"] = podgov_met
    summary["energy_saving_vs_podgov"] = min(known) if known else None  # the worst of them
    summary["energy_saving_vs_podgov_by_trace"] = {
        trace: saving_vs(trace, "stock") for trace in figures if "stock" in figures[trace]}
    missed_by_podgov = [trace for trace, by in figures.items()
                        if "stock" in by and not by["stock"]["meets_target"]]
    summary["energy_over_podgov_where_it_misses"] = {
        trace: -value for trace in missed_by_podgov
        if (value := saving_vs(trace, "stock")) is not None}
    summary["slo_attainment"] = min((entry["slo_attainment"] for entry in ours.values()
                                     if entry["slo_attainment"] is not None), default=None)
    summary["max_consecutive_misses"] = max((entry["max_consecutive_misses"]
                                             for entry in ours.values()), default=None)
    wake = [value for entry in ours.values() for value in entry["wake_ms"]]
    summary["wake_ms"] = max(wake) if wake else None
    summary["clock_changes_per_s"] = max((entry["clock_changes_per_s"] for entry in ours.values()
                                          if entry["clock_changes_per_s"] is not None),
                                         default=None)
    daily_max = figures.get("daily", {}).get("max", {}).get("sleep_power_mw")
    daily_ours = ours.get("daily", {}).get("sleep_power_mw")
    summary["sleep_power_mw"] = daily_ours
    summary["idle_power_at_max_mw"] = daily_max
    summary["sleep_power_fraction"] = daily_ours / daily_max if daily_ours and daily_max else None
    return summary


def run_bench(options: PowerBenchOptions) -> tuple[dict[str, Any], dict[str, list[RunOutcome]]]:
    """Run every trace under every strategy; answer the summary and the outcomes (for the
    plot)."""
    from power.sim.calibration import calibrate

    unavailable = ours_available() if "ours" in options.strategies else None
    strategies = [name for name in options.strategies if name != "ours" or unavailable is None]
    if unavailable is not None:
        log.warning("the governor under test cannot run: %s", unavailable)
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    outcomes: dict[str, list[RunOutcome]] = {}
    for trace in make_traces(options):
        figures[trace.name] = {}
        outcomes[trace.name] = []
        for name in strategies:
            outcome = run_one(trace, name, options, record_timeline=trace.name == "bursty")
            figures[trace.name][name] = trace_figures(outcome, options.latency_target_s)
            outcomes[trace.name].append(outcome)
    calibration = calibrate(profile(options.board).name, seed=options.seed, quick=options.quick)
    summary = summarize(options, figures, calibration, unavailable)
    traces = {trace.name: trace for trace in make_traces(options)} if options.ceiling_traces \
        else {}
    summary["static_ceiling"] = {
        name: static_ceiling(traces[name], options, figures[name]["max"])
        for name in options.ceiling_traces if name in traces and "max" in figures[name]}
    return summary, outcomes


__all__ = ["STRATEGIES", "TRACES", "PowerBenchOptions", "RunOutcome", "make_traces", "run_bench",
           "run_one", "summarize", "trace_figures"]
