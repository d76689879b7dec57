"""``edge-agent bench ...``: benchmarks that compare against a baseline in the same run."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from agent.deps import require
from agent.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (ratios against a same-run baseline)")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    pipeline = kinds.add_parser(
        "pipeline",
        help="PyTorch FP32 vs pruned vs INT8 (ONNX Runtime), ResNet-18 at 224x224",
    )
    pipeline.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    pipeline.add_argument("--prune", type=float, default=0.75, metavar="RATIO")
    pipeline.add_argument("--finetune-epochs", type=int, default=12)
    pipeline.add_argument("--threads", type=int, default=2)
    pipeline.add_argument("--size", type=int, default=224)
    pipeline.add_argument("--min-time", type=float, default=3.0, metavar="SECONDS",
                          help="time each variant for at least this long (over all rounds)")
    pipeline.add_argument("--rounds", type=int, default=3,
                          help="interleaved timing rounds (spreads machine noise over variants)")
    pipeline.set_defaults(handler=run_pipeline)
    register_serve(kinds)
    register_swap(kinds)
    register_fleet(kinds)
    register_power(kinds)


def check_json_path(path: Path | None) -> None:
    """Refuse a --json path that cannot be written before minutes of measuring, not after."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError("--json is a directory", key="--json", path=path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--json's directory does not exist", key="--json", path=path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--json's directory is not writable", key="--json", path=path)


def write_summary(summary: dict[str, object], path: Path) -> None:
    from agent.fsutil import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise ConfigError("cannot write the results", key="--json", path=path,
                          reason=exc.strerror or str(exc)) from None


def run_pipeline(args: argparse.Namespace) -> int:
    require("torch", extra="host", purpose="edge-agent bench pipeline")
    from models.bench_pipeline import PipelineBenchConfig, format_table, run

    config = PipelineBenchConfig(
        prune_ratio=args.prune,
        finetune_epochs=args.finetune_epochs,
        threads=args.threads,
        size=args.size,
        min_time_s=args.min_time,
        rounds=args.rounds,
    )
    check_json_path(args.json)
    summary = run(config)
    print(format_table(summary))
    if args.json:
        write_summary(summary, args.json)
        print(f"wrote {args.json}")
    else:
        print(json.dumps({key: value for key, value in summary.items()
                          if not isinstance(value, (dict, list))}, indent=2))
    return 0


def register_serve(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser(
        "serve",
        help="the serving path vs its raw backend: concurrency sweep, Poisson load, RSS",
    )
    serve.add_argument("--bundle", type=Path, required=True)
    serve.add_argument("--pubkey", type=Path, action="append", required=True, metavar="PUB")
    serve.add_argument("--config", type=Path, metavar="FILE",
                       help="daemon configuration (batching, backend, threads)")
    serve.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    serve.add_argument("--input-size", type=int, metavar="PIXELS",
                       help="height and width of the frames sent (default 224, or the engine "
                            "profile's optimum when 224 is outside it; a fixed-size model's own "
                            "size)")
    serve.add_argument("--concurrency", default="1,4,16,64", metavar="LIST")
    serve.add_argument("--duration", type=float, default=10.0, metavar="SECONDS",
                       help="measured window per level")
    serve.add_argument("--warmup", type=float, default=2.0, metavar="SECONDS")
    serve.add_argument("--rounds", type=int, default=3,
                       help="interleaved raw-backend / top-concurrency pairs for the efficiency")
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from agent.tooling.bench_serve import (
        ServeBenchOptions,
        format_summary,
        parse_levels,
        run_bench,
    )

    options = ServeBenchOptions(
        bundle=args.bundle, public_keys=tuple(args.pubkey), config=args.config,
        input_size=args.input_size, concurrency=parse_levels(args.concurrency),
        duration_s=args.duration, warmup_s=args.warmup, rounds=args.rounds,
    )
    check_json_path(args.json)
    summary = run_bench(options)
    print(format_summary(summary))
    if args.json:
        write_summary(summary, args.json)
        print(f"wrote {args.json}")
    return 0


def register_swap(kinds: argparse._SubParsersAction) -> None:
    from agent.tooling.swapbench.bench import SwapBenchOptions

    defaults = SwapBenchOptions()
    swap = kinds.add_parser(
        "swap",
        help="hot swaps under half-capacity load, a bad version rolled back, a soak of swaps",
        description="Makes its own key, tiny bundles and daemon (ONNX Runtime): needs the "
                    "device extra.")
    swap.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    swap.add_argument("--swaps", type=int, default=defaults.swaps,
                      help="measured consecutive swaps")
    swap.add_argument("--soak", type=int, default=defaults.soak_swaps, metavar="SWAPS",
                      help="swaps of the soak (memory and open files before and after)")
    swap.add_argument("--soak-warmup", type=int, default=defaults.soak_warmup_swaps,
                      metavar="SWAPS", help="soak swaps before the first memory reading")
    swap.add_argument("--capacity-time", type=float, default=defaults.capacity_s,
                      metavar="SECONDS")
    swap.add_argument("--steady-time", type=float, default=defaults.steady_s, metavar="SECONDS",
                      help="the baseline window without swaps")
    swap.add_argument("--load-fraction", type=float, default=defaults.load_fraction,
                      metavar="SHARE", help="the load as a share of the measured capacity")
    swap.add_argument("--workers", type=int, default=defaults.workers,
                      help="paced clients (requests in flight at most)")
    swap.add_argument("--gap", type=float, default=defaults.gap_s, metavar="SECONDS",
                      help="load between a swap's watch window and the next swap")
    swap.add_argument("--watch-window", type=float, default=defaults.watch_window_s,
                      metavar="SECONDS", help="the daemon's watch window after a commit")
    swap.add_argument("--canary-min-samples", type=int, default=defaults.canary_min_samples)
    swap.add_argument("--config", type=Path, metavar="FILE",
                      help="daemon configuration (default: the embedded defaults)")
    swap.add_argument("--backend", default=defaults.backend)
    swap.set_defaults(handler=run_swap)


def run_swap(args: argparse.Namespace) -> int:
    require("onnxruntime", extra="device", purpose="edge-agent bench swap")
    require("httptools", extra="device", purpose="edge-agent bench swap")
    from agent.tooling.swapbench.bench import (
        SwapBenchOptions,
        format_summary,
        run_bench,
    )

    options = SwapBenchOptions(
        swaps=args.swaps, soak_swaps=args.soak, soak_warmup_swaps=args.soak_warmup,
        capacity_s=args.capacity_time, steady_s=args.steady_time,
        load_fraction=args.load_fraction, workers=args.workers, gap_s=args.gap,
        watch_window_s=args.watch_window, canary_min_samples=args.canary_min_samples,
        config=args.config, backend=args.backend)
    check_json_path(args.json)
    summary = run_bench(options)
    print(format_summary(summary))
    if args.json:
        write_summary(summary, args.json)
        print(f"wrote {args.json}")
    return 1 if not all(value is not False for value in summary["targets"].values()) else 0


def register_fleet(kinds: argparse._SubParsersAction) -> None:
    from agent.tooling.fleetbench.bench import FleetBenchOptions

    defaults = FleetBenchOptions()
    fleet = kinds.add_parser(
        "fleet",
        help="N agents on one TLS broker: a deploy to all, a deploy through a broker crash, a "
             "misbehaving version stopped by a staged rollout",
        description="Makes its own fleet workspace, broker (Mosquitto, the production "
                    "configuration), devices, bundles and file server. Each agent is the real "
                    "MQTT link, control plane and updater, downloading, verifying, installing "
                    "and loading each version (ONNX Runtime) with a warm-up; it serves no "
                    "traffic, so the canary and the watch window are skipped. Needs the device "
                    "extra and mosquitto.")
    fleet.add_argument("--agents", type=int, default=defaults.agents)
    fleet.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    fleet.add_argument("--processes", type=int, default=defaults.processes,
                       help="processes the agents run in (0: one per 100 agents; at most 200 "
                            "in one)")
    fleet.add_argument("--canary", type=int, default=defaults.canary, metavar="DEVICES",
                       help="the misbehaving version's first stage")
    fleet.add_argument("--phase-timeout", type=float, default=defaults.phase_timeout_s,
                       metavar="SECONDS", help="after this, a phase's stragglers count as lost")
    fleet.add_argument("--broker-down", type=float, default=defaults.broker_down_s,
                       metavar="SECONDS", help="how long the killed broker stays down")
    fleet.add_argument("--work-dir", type=Path, metavar="DIR",
                       help="keep everything here (an empty or new directory; default: a "
                            "temporary one, removed)")
    fleet.set_defaults(handler=run_fleet)


def run_fleet(args: argparse.Namespace) -> int:
    require("onnxruntime", extra="device", purpose="edge-agent bench fleet")
    require("paho.mqtt", extra="device", purpose="edge-agent bench fleet")
    from agent.tooling.fleetbench.bench import (
        FleetBenchOptions,
        format_summary,
        run_bench,
    )

    options = FleetBenchOptions(agents=args.agents, processes=args.processes, canary=args.canary,
                                phase_timeout_s=args.phase_timeout,
                                broker_down_s=args.broker_down, work_dir=args.work_dir)
    check_json_path(args.json)
    summary = run_bench(options)
    print(format_summary(summary))
    if args.json:
        write_summary(summary, args.json)
        print(f"wrote {args.json}")
    return 1 if not all(value is not False for value in summary["targets"].values()) else 0


def register_power(kinds: argparse._SubParsersAction) -> None:
    power = kinds.add_parser(
        "power",
        help="SIMULATION: energy and latency of max clocks, the stock governors and ours over "
             "four traces, and the simulator's calibration against published measurements",
        description="Runs on a simulated board (power/sim/): the production board layer and "
                    "governor drive a fake sysfs tree whose physics is calibrated to the "
                    "published anchors. Exit status 1 when a target is missed.")
    power.add_argument("--board", default="orin-nano", help="board profile (default orin-nano)")
    power.add_argument("--jetpack", type=int, default=6)
    power.add_argument("--mode", type=int, metavar="ID",
                       help="nvpmodel mode (default: the profile's uncapped mode, MAXN_SUPER)")
    power.add_argument("--seed", type=int, default=1)
    power.add_argument("--target-ms", type=float, default=50.0, metavar="MS",
                       help="the P99 latency target")
    power.add_argument("--quick", action="store_true", help="short traces (tests)")
    power.add_argument("--max-rail-gating", action="store_true",
                       help="let the max baseline's GPU rail gate when idle (default: kept on, "
                            "as the pinned-idle anchor is read); shows how much the figures "
                            "against max depend on that")
    power.add_argument("--ceiling", default="", metavar="TRACES",
                       help="also search static operating points for the cheapest that meets "
                            "the target on these traces (comma list, e.g. periodic,saturated; "
                            "slow): how much each energy target allows under the simulation")
    power.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    power.add_argument("--plot", type=Path, metavar="PNG",
                       help="the plot (default: next to --json, else none)")
    power.set_defaults(handler=run_power)


def run_power(args: argparse.Namespace) -> int:
    from agent.tooling.powerbench.plot import write_plot
    from agent.tooling.powerbench.report import check_targets, format_summary
    from agent.tooling.powerbench.runner import (
        PowerBenchOptions,
        parse_traces,
        run_bench,
    )

    check_json_path(args.json)
    plot = args.plot if args.plot is not None else (
        args.json.with_suffix(".png") if args.json is not None else None)
    check_json_path(plot)
    options = PowerBenchOptions(board=args.board, jetpack=args.jetpack, mode_id=args.mode,
                                seed=args.seed, quick=args.quick,
                                latency_target_s=args.target_ms / 1000,
                                max_keeps_rail_on=not args.max_rail_gating,
                                ceiling_traces=parse_traces(args.ceiling))
    summary, outcomes = run_bench(options)
    check_targets(summary)
    if plot is not None:
        skipped = write_plot(outcomes.get("bursty", []), plot, target_ms=args.target_ms)
        summary["plot"] = None if skipped else str(plot)
        summary["plot_skipped"] = skipped
    print(format_summary(summary))
    if plot is not None:
        print(f"plot skipped: {summary['plot_skipped']}" if summary["plot_skipped"]
              else f"wrote {plot}")
    if args.json:
        write_summary(summary, args.json)
        print(f"wrote {args.json}")
    return 0 if summary["targets_met"] else 1
