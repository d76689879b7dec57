"""``edge-agent build`` and ``edge-agent train`` (host side; they need the ``host`` extra)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from agent.deps import require

log = logging.getLogger(__name__)

DEFAULT_MODEL = "resnet18-digits"


def register(subparsers: argparse._SubParsersAction) -> None:
    build = subparsers.add_parser(
        "build",
        help="turn a model into a signed INT8 bundle with an accuracy and speed report",
        description=(
            "Prune (optional), export to ONNX, calibrate INT8 with mixed precision, and pack a "
            "signed bundle DIR/<name>-<version>.bundle plus DIR/report.json."
        ),
    )
    source = build.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"example model from the zoo (default: {DEFAULT_MODEL})")
    source.add_argument("--user-model", metavar="MODULE:CALLABLE",
                        help="your PyTorch model factory (with --checkpoint and --calib-dir)")
    source.add_argument("--onnx", type=Path, metavar="MODEL", help="an ONNX model (no pruning)")
    build.add_argument("--checkpoint", type=Path, help="state dict for --user-model")
    build.add_argument("--calib-dir", type=Path, metavar="DIR",
                       help="directory of .npy/.npz preprocessed input samples, one per file, or "
                            "of images with a preprocessing spec")
    build.add_argument("--calib-preprocess", type=Path, metavar="FILE",
                       help="preprocessing spec (JSON) for image files in --calib-dir "
                            "(default: DIR/preprocessing.json)")
    build.add_argument("--prune", type=float, metavar="RATIO", dest="prune_ratio",
                       help="fraction of channels to remove, in [0, 0.9]")
    build.add_argument("--prune-target-macs", type=float, metavar="GMACS",
                       help="prune until the model needs at most this many GMACs at the "
                            "deployment frame (--frame-size; 224x224 for the example models)")
    # The pruning settings default to None so that giving one without pruning can be pointed out;
    # None becomes BuildOptions' default.
    build.add_argument("--importance", choices=("l1", "l2", "taylor"), help="default: l2")
    build.add_argument("--prune-scope", choices=("uniform", "global"), help="default: uniform")
    build.add_argument("--round-to", type=int,
                       help="pruned widths are multiples of this (32 suits INT8, 8 suits FP16; "
                            "default: 32)")
    build.add_argument("--prune-steps", type=int, help="iterative pruning steps (default: 1)")
    build.add_argument("--finetune-epochs", type=int,
                       help="epochs of fine-tuning after each pruning step (default: 12)")
    build.add_argument("--calib-samples", type=int, default=512, metavar="N",
                       help="calibration samples to use (500-1000 recommended). Without "
                            "labels INT8 is judged on samples of --calib-dir held out from "
                            "calibration: the first N files (name order) calibrate, the next "
                            "ones (up to 256) judge; with fewer than N + 32 files, 32 (at most "
                            "half of them) are held out and fewer calibrate")
    build.add_argument("--calib-method", choices=("entropy", "percentile", "minmax"),
                       default="entropy", help="how INT8 ranges are chosen")
    build.add_argument("--accuracy-budget", type=float, default=1.0, metavar="POINTS",
                       help="largest drop allowed in each agreement judge (top-1, class or "
                            "decision agreement, your --evaluator's score), in points; after "
                            "pruning it counts from the unpruned model")
    build.add_argument("--key", type=Path, help="Ed25519 private key (PEM) to sign with")
    build.add_argument("--out", type=Path, default=Path("out"), metavar="DIR",
                       help="where the bundle, report and a new key go")
    build.add_argument("--name", help="bundle name (default: from the model)")
    build.add_argument("--version", type=int, dest="bundle_version",
                       help="bundle version (default: one more than the newest in DIR)")
    build.add_argument("--max-batch", type=int, metavar="N",
                       help="largest batch the engine profile allows (default: 32, or the "
                            "--profile-shape max batch)")
    build.add_argument("--opt-batch", type=int, metavar="N",
                       help="batch the engine is tuned for (default: 8, or the --profile-shape "
                            "opt batch)")
    build.add_argument("--frame-size", type=_frame_size, metavar="HxW",
                       help="deployment frame for models that take any image size: the engine "
                            "profile's optimum (its range: the calibration size to twice this, "
                            "as far as the model runs) and the host speed check's input "
                            "(default: 224x224 for the example models, the calibration samples' "
                            "size otherwise)")
    build.add_argument("--profile-shape", action="append", metavar="NAME:MIN,OPT,MAX",
                       help="the engine profile by hand, as trtexec's --minShapes/--optShapes/"
                            "--maxShapes, e.g. x:1x3x48x32,8x3x48x320,32x3x48x640 (once per "
                            "input): replaces the sizes found by running the model; its batch "
                            "sets --max-batch and --opt-batch")
    build.add_argument("--output-layout", choices=("NCHW", "NHWC"),
                       help="layout of the 4-D outputs (segmentation maps), for judging their "
                            "classes per position (default: told by the graph)")
    build.add_argument("--output-metric", action="append", default=[],
                       metavar="NAME=METRIC[:TOL]",
                       help="how to judge output NAME against FP32 instead of the automatic "
                            "choice (repeatable): agreement[:DROP] (the agreement that suits the "
                            "output), top1[:DROP] (the class on its class axis; against the "
                            "labels where given), decision[:DROP] (output > 0.5, or > 0 for "
                            "logits), exact[:DROP] (every value equal), where DROP is the "
                            "largest drop from FP32 in points (default: --accuracy-budget); "
                            "cosine[:MIN] (mean cosine per sample, default 0.99), sqnr[:MIN] "
                            "(dB, default 20); ignore (reported, not held). E.g. "
                            "boxes=cosine:0.995")
    build.add_argument("--evaluator", metavar="MODULE:CALLABLE",
                       help="your task metric: called as f(fp32_outputs, candidate_outputs, "
                            "labels) with dicts of output name to array (labels: None without "
                            "them), returning a number, higher is better (mAP, 100 - CER); its "
                            "drop from f(fp32, fp32, labels) is held to --accuracy-budget, and "
                            "the automatic judges are then reported only")
    build.add_argument("--search-time", type=float, metavar="SECONDS", dest="search_time_s",
                       help="bound on the mixed-precision search (layer sensitivity and "
                            "bisection); when it runs out the smallest passing layer set found "
                            "is taken, and the report says so (default: no bound)")
    build.add_argument("--allow-no-int8", action="store_true",
                       help="accept a build that keeps every layer out of INT8 (an FP16 "
                            "bundle); without it such a build fails")
    build.add_argument("--target", action="append", default=[], metavar="DEVICE_CLASS",
                       dest="targets",
                       help="a device class the bundle is for (again for more), such as "
                            "orin-nano-8gb: a device applies it only when its device_class is "
                            "one of them (default: any device)")
    build.add_argument("--threads", type=int, default=2, metavar="N",
                       help="CPU threads for PyTorch and ONNX Runtime on this host")
    build.add_argument("--engine", action="store_true",
                       help="also build a TensorRT engine for this machine (needs TensorRT)")
    build.add_argument("--json", action="store_true", help="print the report as JSON")
    build.set_defaults(handler=run_build)

    train = subparsers.add_parser(
        "train", help="train an example model on the digits set and cache its checkpoint"
    )
    train.add_argument("--model", default=DEFAULT_MODEL)
    train.add_argument("--force", action="store_true", help="retrain even if cached")
    train.set_defaults(handler=run_train)


def _frame_size(text: str) -> tuple[int, int]:
    """``--frame-size``: ``HxW`` (``480x640``) or one number for a square frame."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        sides = [int(part) for part in parts]
    except ValueError:
        sides = []
    if len(sides) == 1:
        sides *= 2
    if len(sides) != 2:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH (e.g. 480x640) or one size, "
                                         f"got {text!r}")
    return sides[0], sides[1]


def _target_macs(gmacs: float) -> int:
    """--prune-target-macs in GMACs as a MAC count; 0, negative or not finite is refused (0 was
    once taken for "not set")."""
    from agent.errors import ConfigError

    if not math.isfinite(gmacs) or gmacs <= 0:
        raise ConfigError("--prune-target-macs must be a positive number of GMACs",
                          key="--prune-target-macs", found=gmacs)
    return max(1, int(gmacs * 1e9))


_PRUNING_SETTINGS = {"importance": "prune_importance", "prune_scope": "prune_scope",
                     "round_to": "round_to", "prune_steps": "prune_steps",
                     "finetune_epochs": "finetune_epochs"}


def _pruning_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The pruning options that were given, as BuildOptions fields; a warning names those given
    where nothing is pruned (they would change nothing)."""
    given = {field: getattr(args, name) for name, field in _PRUNING_SETTINGS.items()
             if getattr(args, name) is not None}
    if given and not args.prune_ratio and args.prune_target_macs is None:
        flags = ", ".join("--" + name.replace("_", "-") for name in _PRUNING_SETTINGS
                          if getattr(args, name) is not None)
        log.warning("%s only apply when pruning (--prune or --prune-target-macs): ignored", flags)
    return given


def _batch_settings(args: argparse.Namespace, profile_shapes: tuple[Any, ...]) -> dict[str, Any]:
    """--max-batch and --opt-batch as BuildOptions fields: as given, else the --profile-shape
    batch range's max and opt (BuildOptions refuses values that disagree with it), else
    BuildOptions' defaults."""
    settings = {}
    for name, bound in (("max_batch", 2), ("opt_batch", 1)):
        value = getattr(args, name)
        if value is None and profile_shapes:
            value = profile_shapes[0].batch[bound]
        if value is not None:
            settings[name] = value
    return settings


def run_build(args: argparse.Namespace) -> int:
    require("torch", extra="host", purpose="edge-agent build")
    from models.pipeline import BuildOptions, build, format_summary, parse_profile_shape
    from models.quantize import OutputMetric

    model = args.model
    if model is None and args.onnx is None and args.user_model is None:
        model = DEFAULT_MODEL
    profile_shapes = tuple(parse_profile_shape(text) for text in args.profile_shape or ())
    options = BuildOptions(
        out_dir=args.out,
        model=model,
        user_model=args.user_model,
        checkpoint=args.checkpoint,
        onnx=args.onnx,
        calib_dir=args.calib_dir,
        calib_preprocess=args.calib_preprocess,
        prune_ratio=args.prune_ratio,
        prune_target_macs=(None if args.prune_target_macs is None
                           else _target_macs(args.prune_target_macs)),
        **_pruning_settings(args),
        calib_samples=args.calib_samples,
        calib_method=args.calib_method,
        accuracy_budget=args.accuracy_budget,
        key=args.key,
        name=args.name,
        version=args.bundle_version,
        **_batch_settings(args, profile_shapes),
        frame_size=args.frame_size,
        profile_shapes=profile_shapes,
        output_layout=args.output_layout,
        output_metrics=tuple(OutputMetric.parse(text) for text in args.output_metric),
        evaluator=args.evaluator,
        search_time_s=args.search_time_s,
        allow_no_int8=args.allow_no_int8,
        targets=tuple(args.targets),
        threads=args.threads,
        build_engine=args.engine,
        progress=sys.stderr.isatty(),
    )
    result = build(options)
    if args.json:
        print(json.dumps(result.report, indent=2, sort_keys=True))
    else:
        print(format_summary(result))
    return 0


def run_train(args: argparse.Namespace) -> int:
    require("torch", extra="host", purpose="edge-agent train")
    from models.checkpoints import train_example

    path = train_example(args.model, force=args.force)
    print(path)
    return 0
