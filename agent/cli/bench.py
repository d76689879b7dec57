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
    from agent.tooling.bench_serve import ServeBenchOptions, format_summary, parse_levels, run_bench

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
