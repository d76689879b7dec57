"""``edge-agent build``: trained model -> pruned -> ONNX -> INT8 with mixed precision -> signed bundle.

Everything is produced in a staging directory inside the output directory and moved into place
only when the whole build has succeeded, so a failed or interrupted build leaves no half-written
bundle or report behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent import __version__
from agent.errors import ConfigError, KeyFileError, ModelError, PruningError, first_line
from agent.fsutil import atomic_write_text, fsync_dir, staging_dir
from models.bundle import pack_bundle
from models.manifest import MAX_NAME_LENGTH, MAX_VERSION
from models.calibration import DEFAULT_SAMPLES, CalibrationSet, from_array, from_directory
from models.ort import int8_kernels
from models.quantize import Evaluator, QuantizeConfig, QuantizeResult, model_outputs, quantize_model
from pruning.config import Importance, PruneConfig, Scope

log = logging.getLogger(__name__)

MIN_AGENT_VERSION = "0.1.0"
_BUNDLE_NAME = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]*)-(?P<version>\d+)\.bundle$")


# No layer loses more than this fraction of its channels, so neither can the whole model.
MAX_PRUNE_RATIO: float = PruneConfig.max_layer_ratio
CHECK_SAMPLES = 8  # real samples a user model's export is checked on
MAX_BATCH = 4096  # an engine profile's largest batch; far beyond any Jetson's memory already
EXAMPLE_FRAME = (224, 224)  # the example models' deployment frame (see BuildOptions.frame_size)
MIN_FRAME, MAX_FRAME = 8, 8192


@dataclass(frozen=True)
class BuildOptions:
    """What to build. Exactly one of ``model`` (an example from the zoo), ``user_model``
    (``module:callable``, with ``checkpoint`` and ``calib_dir``) or ``onnx`` (with ``calib_dir``)."""

    out_dir: Path
    model: str | None = None
    user_model: str | None = None
    checkpoint: Path | None = None
    onnx: Path | None = None
    calib_dir: Path | None = None
    calib_preprocess: Path | None = None  # spec for image files in calib_dir
    prune_ratio: float | None = None
    prune_target_macs: int | None = None
    prune_importance: Importance = "l2"
    prune_scope: Scope = "uniform"
    round_to: int = 32
    prune_steps: int = 1
    # Epochs of fine-tuning after each pruning step. Pruning the example ResNet-18 at 0.75 and
    # fine-tuning with five seeds: 4 epochs gave 97.8-98.9 top-1 on the held-out split (from 98.9
    # unpruned; one seed missed the 1-point budget), 12 gave 98.9-99.4, at about 4 s more.
    finetune_epochs: int = 12
    calib_samples: int = DEFAULT_SAMPLES
    calib_method: str = "entropy"
    accuracy_budget: float = 1.0
    key: Path | None = None
    name: str | None = None
    version: int | None = None
    max_batch: int = 32
    opt_batch: int = 8
    # The deployment frame (height, width) for models that take any image size: the engine
    # profile's optimum and the host speed check's input. None: 224 x 224 for the example models
    # (trained at 32 x 32, measured at a camera-like size), the calibration samples' size otherwise.
    frame_size: tuple[int, int] | None = None
    # The first output's layout, to find its classes when judging agreement (4-D outputs only;
    # default: told by the graph, see models.onnx_model.output_layout).
    output_layout: str | None = None
    threads: int = 2
    build_engine: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        sources = [self.model is not None, self.user_model is not None, self.onnx is not None]
        if sum(sources) != 1:
            raise ConfigError("give exactly one of --model, --user-model or --onnx")
        if (self.onnx is not None or self.user_model is not None) and self.calib_dir is None:
            raise ConfigError("--onnx and --user-model need --calib-dir with calibration samples")
        if self.prune_ratio is not None and not 0.0 <= self.prune_ratio <= MAX_PRUNE_RATIO:
            raise ConfigError(f"prune ratio must be in [0, {MAX_PRUNE_RATIO}] (no layer may lose "
                              f"more than {MAX_PRUNE_RATIO:.0%} of its channels)", key="--prune",
                              found=self.prune_ratio)
        if self.prune_ratio is not None and self.prune_target_macs is not None:
            raise ConfigError("give --prune or --prune-target-macs, not both")
        if self.onnx is not None and (self.prune_ratio or self.prune_target_macs):
            raise ConfigError("an ONNX model cannot be pruned; prune the PyTorch model instead")
        if self.model is not None and self.calib_dir is not None:
            raise ConfigError("--calib-dir is for --user-model and --onnx; the example models "
                              "calibrate on their own training split", key="--calib-dir",
                              path=self.calib_dir)
        if self.calib_preprocess is not None and self.calib_dir is None:
            raise ConfigError("--calib-preprocess needs --calib-dir", key="--calib-preprocess")
        if self.checkpoint is not None and self.user_model is None:
            raise ConfigError("--checkpoint is for --user-model (the example models use their "
                              "own trained checkpoint; an ONNX model carries its weights)",
                              key="--checkpoint", path=self.checkpoint)
        if not 0.0 <= self.accuracy_budget <= 100.0:  # also refuses NaN
            raise ConfigError("--accuracy-budget must be in [0, 100] points",
                              key="--accuracy-budget", found=self.accuracy_budget)
        if self.max_batch > MAX_BATCH:
            raise ConfigError(f"--max-batch must be at most {MAX_BATCH}", key="--max-batch",
                              found=self.max_batch)
        if not 1 <= self.opt_batch <= self.max_batch:
            raise ConfigError("need 1 <= opt batch <= max batch", opt_batch=self.opt_batch,
                              max_batch=self.max_batch)
        if self.version is not None and not 1 <= self.version <= MAX_VERSION:
            raise ConfigError(f"version must be from 1 to {MAX_VERSION}", key="--version",
                              found=self.version)
        if self.name is not None and (not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", self.name)
                                      or len(self.name) > MAX_NAME_LENGTH):
            raise ConfigError(f"name must be lower-case letters, digits, '.', '_' or '-', at "
                              f"most {MAX_NAME_LENGTH} characters", found=self.name)
        if self.calib_samples < 1:
            raise ConfigError("calibration sample count must be >= 1", found=self.calib_samples)
        for key, value, minimum in (("--threads", self.threads, 1),
                                    ("--finetune-epochs", self.finetune_epochs, 0),
                                    ("--prune-steps", self.prune_steps, 1),
                                    ("--round-to", self.round_to, 1)):
            if value < minimum:
                raise ConfigError(f"{key} must be at least {minimum}", key=key, found=value)
        if self.frame_size is not None and (
                len(self.frame_size) != 2
                or not all(MIN_FRAME <= side <= MAX_FRAME for side in self.frame_size)):
            raise ConfigError(f"--frame-size must be a height and width from {MIN_FRAME} to "
                              f"{MAX_FRAME}", key="--frame-size", found=self.frame_size)
        if self.output_layout not in (None, "NCHW", "NHWC"):
            raise ConfigError("--output-layout must be NCHW or NHWC", key="--output-layout",
                              found=self.output_layout)
        if self.output_layout is not None and self.model is not None:
            raise ConfigError("--output-layout is for --onnx and --user-model (the example "
                              "models are judged against their labels)", key="--output-layout")
        if self.prune_target_macs is not None and self.prune_target_macs < 1:
            raise ConfigError("--prune-target-macs must be positive", key="--prune-target-macs",
                              found=self.prune_target_macs)


@dataclass
class BuildResult:
    bundle_path: Path
    report_path: Path
    report: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)


def next_version(out_dir: Path, name: str) -> int:
    """One more than the highest version of ``name`` already in ``out_dir``."""
    versions = [
        int(match["version"])
        for path in (out_dir.iterdir() if out_dir.is_dir() else [])
        if (match := _BUNDLE_NAME.match(path.name)) and match["name"] == name
    ]
    return max(versions, default=0) + 1


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return slug[:MAX_NAME_LENGTH].rstrip("-._") or "model"


def _signing_key(options: BuildOptions) -> tuple[Any, str, Path | None]:
    """The private key to sign with, its key id, and where a newly generated pair is to be
    written once the build has succeeded (None when the key came from a file): without --key,
    the output directory's ``signing.key`` is used, or a new pair is made for it, so that a build
    that fails leaves no key behind either."""
    from models import signing

    if options.key is not None:
        key = signing.load_private_key(options.key)
        return key, signing.compute_key_id(key.public_key()), None
    default = options.out_dir / "signing.key"
    if default.exists():
        key = signing.load_private_key(default)
        public = signing.public_key_path(default)
        if not public.exists():  # devices need it; it follows from the private key
            with contextlib.suppress(KeyFileError):  # another build wrote it meanwhile
                signing.write_public_key(public, key.public_key())
                log.info("wrote the missing public key %s", public)
        return key, signing.compute_key_id(key.public_key()), None
    if signing.public_key_path(default).exists():
        raise ConfigError("the output directory has a public key but no private key to sign "
                          "with; give --key, or remove the public key to make a new pair",
                          path=signing.public_key_path(default))
    key = signing.generate_private_key()
    log.warning("no --key given: signing with a new key, written to %s when the build succeeds; "
                "devices must trust %s", default, signing.public_key_path(default))
    return key, signing.compute_key_id(key.public_key()), default


def _write_new_key(key: Any, path: Path) -> None:
    from models import signing

    signing.write_private_key(path, key)
    signing.write_public_key(signing.public_key_path(path), key.public_key())
    log.info("wrote the new signing key pair %s and %s", path, signing.public_key_path(path))


def _remove_new_key(path: Path) -> None:
    from models import signing

    for written in (path, signing.public_key_path(path)):
        with contextlib.suppress(FileNotFoundError):
            written.unlink()


def _speed(model_bytes: bytes, inputs: dict[str, tuple[tuple[int, ...], str]],
           threads: int) -> float:
    """Images per second of an ONNX model on this host (median latency over about a second),
    fed random inputs of the given shapes and dtypes."""
    from models.ort import create_session
    from models.timing import time_call

    session = create_session(model_bytes, threads=threads)
    rng = np.random.default_rng(0)
    feed = {name: rng.standard_normal(shape).astype(dtype) for name, (shape, dtype) in inputs.items()}
    latencies = time_call(lambda: session.run(None, feed), 1.0, 5)
    return next(iter(inputs.values()))[0][0] / statistics.median(latencies)


class _Stages:
    """Times and logs the stages of a build. A stage may run stages of its own: ``within`` maps
    it to them, so that a summary does not add nested times to the ones around them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.within: dict[str, list[str]] = {}
        self._running: list[str] = []

    def run(self, name: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        log.info("== %s", name)
        if self._running:
            self.within.setdefault(self._running[-1], []).append(name)
        self._running.append(name)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            self._running.pop()
            self.seconds[name] = round(time.perf_counter() - started, 2)


def prune_and_finetune(model: Any, options: BuildOptions, train_split: Any, held_out: Any,
           example: Any) -> tuple[Any, dict[str, Any]]:
    from pruning import PruneConfig, prune_model

    from models.train import TrainConfig, predict, top1_accuracy, train

    config = PruneConfig(
        ratio=options.prune_ratio,
        target_macs=options.prune_target_macs,
        importance=options.prune_importance,
        scope=options.prune_scope,
        round_to=options.round_to,
        iterative_steps=options.prune_steps,
    )
    finetune_config = TrainConfig(epochs=options.finetune_epochs, learning_rate=0.01)
    params_before = _parameter_count(model)

    def finetune(pruned: Any, step: int) -> None:
        if _parameter_count(pruned) == params_before:
            # Fine-tuning a model that lost nothing would only move it off its checkpoint.
            log.info("pruning step %d removed nothing: not fine-tuning", step + 1)
            return
        log.info("fine-tuning after pruning step %d (%d epochs)", step + 1, finetune_config.epochs)
        train(pruned, train_split, finetune_config, progress=options.progress)

    def loss_batches():
        import torch

        for start in range(0, min(len(train_split), 512), 64):
            yield (torch.from_numpy(train_split.images[start:start + 64]),
                   torch.from_numpy(train_split.labels[start:start + 64]))

    result = prune_model(model, example, config, finetune=finetune, loss_batches=loss_batches,
                         progress=options.progress)
    already_small = (options.prune_target_macs is not None
                     and result.report.macs_before <= options.prune_target_macs)
    if _parameter_count(result.model) == params_before and not already_small:
        log.warning("pruning removed no channels (every layer is already at or below what "
                    "--round-to %d and the ratio or MAC target allow): the model is unchanged",
                    options.round_to)
    accuracy = top1_accuracy(predict(result.model, held_out.images), held_out.labels)
    report = result.report.to_dict()
    report["top1"] = accuracy
    log.info("pruned:\n%s", result.report.format_table())
    return result.model, report


def _parameter_count(model: Any) -> int:
    return sum(int(parameter.numel()) for parameter in model.parameters())


def _prepare_out_dir(out_dir: Path) -> bool:
    """Make sure ``--out`` is a directory this process can write (creating it when missing;
    returns whether it did, so that a failed build can remove it again) and remove the staging
    directories of builds that were killed."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--out is not a directory", key="--out", path=out_dir)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("cannot create the output directory", key="--out", path=out_dir,
                          reason=exc.strerror or str(exc)) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError("the output directory is not writable", key="--out", path=out_dir)
    for stale in out_dir.glob(".build-*"):
        match = re.fullmatch(r"\.build-(\d+)-.*", stale.name)
        if match and stale.is_dir() and not _process_alive(int(match[1])):
            log.info("removing %s, left by a build that was killed", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return created


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _planned_name(options: BuildOptions) -> str:
    """The bundle's name, known before any work (the same rules as the loaders use)."""
    if options.name:
        return options.name
    if options.model is not None:
        from models import zoo

        return zoo.get(options.model).name
    if options.user_model is not None:
        return _slug(options.user_model.split(":")[-1])
    assert options.onnx is not None  # BuildOptions allows exactly one source
    return _slug(options.onnx.stem)


def _check_before_work(options: BuildOptions) -> None:
    """Refuse what would only fail after minutes of pruning and calibration."""
    if options.version is not None:
        bundle_path = options.out_dir / f"{_planned_name(options)}-{options.version}.bundle"
        if bundle_path.exists():
            raise ConfigError("bundle already exists; pick another --version", path=bundle_path)
    if options.build_engine:
        from models.engine import require_tensorrt

        require_tensorrt()


def build(options: BuildOptions) -> BuildResult:
    """Run the whole pipeline; see the module docstring."""
    _check_before_work(options)
    created = _prepare_out_dir(options.out_dir)
    try:
        return _build(options)
    except BaseException:
        if created and not any(options.out_dir.iterdir()):
            options.out_dir.rmdir()
        raise


def _build(options: BuildOptions) -> BuildResult:
    stages = _Stages()
    started = time.perf_counter()
    report: dict[str, Any] = {"agent_version": __version__}
    key, key_id, new_key_path = _signing_key(options)

    with staging_dir(options.out_dir, prefix=f".build-{os.getpid()}-") as work:
        if options.onnx is not None:
            float_bytes, evaluator, calibration, meta = stages.run(
                "load ONNX", _from_onnx, options, report)
        else:
            float_bytes, evaluator, calibration, meta = stages.run(
                "prepare PyTorch model", _from_torch, options, report, stages)
        _check_frame_option(meta, options)
        stages.run("check frame sizes", check_frame_sizes, float_bytes, meta, options)
        name = _planned_name(options)
        version = options.version or next_version(options.out_dir, name)
        bundle_path = options.out_dir / f"{name}-{version}.bundle"
        if bundle_path.exists():
            raise ConfigError("bundle already exists; pick another --version", path=bundle_path)

        quantized: QuantizeResult = stages.run(
            "INT8 calibration and mixed precision",
            quantize_model,
            float_bytes,
            calibration,
            evaluator,
            QuantizeConfig(method=options.calib_method, accuracy_budget=options.accuracy_budget,
                           reference_metric=_budget_reference(meta), progress=options.progress),
            work / "quantize",
        )
        report["quantization"] = _quantization_report(quantized, options)
        report["accuracy"] = _accuracy_report(quantized, meta, options)
        # What a CPU daemon will answer: its ONNX Runtime backend folds ReLUs (models.ort_relu).
        report["accuracy"]["int8_onnxruntime_served"] = round(
            evaluator.score(evaluator.outputs(quantized.model_bytes, fold_relu=True)), 3)

        speed = stages.run("host speed check", _speed_report, float_bytes, quantized.model_bytes,
                           meta, options)
        report["speed"] = speed

        files = {"model.onnx": work / "model.onnx"}
        files["model.onnx"].write_bytes(quantized.model_bytes)
        engines: dict[str, str] = {}
        if options.build_engine:
            engines = stages.run("TensorRT engine", _build_engine, files, work, quantized,
                                 _engine_profile(meta, options),
                                 meta["layouts"].get(meta["input_name"]) or "NCHW")

        manifest = _manifest(name, version, quantized, engines, report["accuracy"], meta, options)
        if new_key_path is not None:
            try:  # created exclusively: of two builds into one directory, one makes the pair
                _write_new_key(key, new_key_path)
            except KeyFileError:
                # Another build into this directory made it meanwhile: sign with that one, as
                # this build would have had it started later.
                key, key_id, new_key_path = _signing_key(options)
        try:
            report.update(
                {
                    "name": name,
                    "version": version,
                    "source": meta["source"],
                    "signing_key_id": key_id,
                    "timings_s": stages.seconds,
                    "timings_within": stages.within,
                }
            )
            report["timings_s"]["total"] = round(time.perf_counter() - started, 2)
            report_text = json.dumps(report, indent=2, sort_keys=True,
                                     default=_json_default) + "\n"
            (work / "report.json").write_text(report_text)
            files["report.json"] = work / "report.json"
            final_manifest = pack_bundle(bundle_path, manifest, files, key, overwrite=False)
        except BaseException:
            if new_key_path is not None:  # a failed build leaves no key behind
                _remove_new_key(new_key_path)
            raise
        report_path = options.out_dir / "report.json"
        atomic_write_text(report_path, report_text)
        fsync_dir(options.out_dir)
    return BuildResult(bundle_path, report_path, report, final_manifest)


def _manifest(name: str, version: int, quantized: QuantizeResult, engines: dict[str, str],
              accuracy: dict[str, Any], meta: dict[str, Any], options: BuildOptions) -> dict[str, Any]:
    """The bundle manifest (design 5.1) without the fields pack_bundle fills in."""
    import onnx

    from models.onnx_model import io_specs

    inputs, outputs = io_specs(onnx.load_from_string(quantized.model_bytes))
    return {
        "name": name,
        "version": version,
        "inputs": [spec.to_manifest(meta["layouts"].get(spec.name)) for spec in inputs],
        "outputs": [spec.to_manifest() for spec in outputs],
        "preprocessing": meta.get("preprocessing"),
        "precision": quantized.precision_plan(),
        "max_batch": options.max_batch,
        "opt_batch": options.opt_batch,
        "engine_profile": _engine_profile(meta, options),
        "calibration": quantized.calibration,
        "accuracy": accuracy,
        "engines": engines,
        "min_agent_version": MIN_AGENT_VERSION,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _from_torch(options: BuildOptions, report: dict[str, Any], stages: _Stages):
    import torch

    from models import zoo
    from models.checkpoints import load_example
    from pruning import count_macs_and_params
    from models.data import digits_preprocessing, load_digits_splits
    from models.export import export_onnx
    from models.train import predict, top1_accuracy

    torch.set_num_threads(options.threads)
    if options.model is None:
        # A user's PyTorch model: calibration samples from a directory, agreement as the metric.
        return _from_user_torch(options, report, stages)
    spec = zoo.get(options.model)
    train_split, held_out = load_digits_splits(spec.train_size)
    model = stages.run("load trained model", load_example, spec.name, threads=options.threads)
    example = torch.from_numpy(train_split.images[:2])
    fp32_top1 = top1_accuracy(predict(model, held_out.images), held_out.labels)
    height, width = options.frame_size or EXAMPLE_FRAME
    size = f"{height}" if height == width else f"{height}x{width}"
    speed_example = torch.zeros(1, 3, height, width)
    macs, params = count_macs_and_params(model, speed_example)
    report["model"] = {"fp32_top1": fp32_top1, "params": params, f"macs_{size}": macs}
    pruned_top1 = None
    if options.prune_ratio or options.prune_target_macs:
        # MACs (and a MAC target) are counted at the deployment size, not the training size.
        model, prune_report = stages.run("prune channels", prune_and_finetune, model, options, train_split,
                                         held_out, speed_example)
        report["pruning"] = prune_report
        pruned_top1 = prune_report["top1"]
        macs_after, params_after = count_macs_and_params(model, speed_example)
        report["model"].update({"pruned_params": params_after,
                                f"pruned_macs_{size}": macs_after})
    exported = stages.run("export ONNX", export_onnx, model, example,
                          check_inputs=[held_out.images[:64]])
    report["export"] = _export_report(exported)
    calibration = from_array(train_split.images, exported.input_name, options.calib_samples,
                             source=f"digits train split ({len(train_split)} images)")
    evaluator = Evaluator({exported.input_name: held_out.images}, held_out.labels,
                          threads=options.threads)
    meta = {
        "source": {"kind": "zoo", "model": spec.name},
        "dataset": f"digits held-out split ({len(held_out)} images, {spec.train_size}x{spec.train_size})",
        "fp32_torch_metric": fp32_top1,
        "pruned_torch_metric": pruned_top1,
        "preprocessing": digits_preprocessing(spec.train_size).to_dict(),
        **_input_meta(exported.model_bytes, calibration),
    }
    return exported.model_bytes, evaluator, calibration, meta


def _from_user_torch(options: BuildOptions, report: dict[str, Any], stages: _Stages):
    import onnx
    import torch

    from models.export import export_onnx
    from models.loader import load_user_model
    from models.onnx_model import TensorSpec, io_specs

    if options.prune_ratio or options.prune_target_macs:
        raise PruningError(
            "pruning a user model needs labelled fine-tuning data: prune it with the pruning "
            "API (pruning.prune_model, then pruning.save_pruned) and build the saved model with "
            "--user-model MODULE:CALLABLE --checkpoint PRUNED.pt"
        )
    calib_dir = options.calib_dir
    assert calib_dir is not None  # BuildOptions requires it with --user-model
    model = stages.run("load user model", load_user_model, options.user_model, options.checkpoint)
    probe = from_directory(calib_dir,
                           [TensorSpec("input", "float32", (-1, -1, -1, -1), ("batch",) * 4)],
                           samples=CHECK_SAMPLES, preprocessing=options.calib_preprocess,
                           probe=True)
    samples = probe.arrays["input"]
    example = torch.from_numpy(samples[:1])
    # ONNX is checked against PyTorch on real samples, one by one and as a batch: tracing keeps
    # the branch the example took, so a branch on the data shows up as a mismatch here, and a
    # model that cannot take a batch fails here, not in calibration.
    exported = stages.run("export ONNX", export_onnx, model, example, check_size=None,
                          check_inputs=[*(samples[index:index + 1]
                                          for index in range(1, len(samples))), samples])
    report["export"] = _export_report(exported)
    exported_model = onnx.load_from_string(exported.model_bytes)
    inputs, _ = io_specs(exported_model)
    calibration = from_directory(calib_dir, inputs, options.calib_samples,
                                 preprocessing=options.calib_preprocess)
    evaluator = _agreement_evaluator(exported_model, exported.model_bytes, calibration, options)
    meta = {
        "source": {"kind": "pytorch", "model": options.user_model,
                   "checkpoint": str(options.checkpoint) if options.checkpoint else None},
        "dataset": f"calibration samples ({len(calibration)}), agreement with FP32",
        "preprocessing": calibration.preprocessing,
        **_input_meta(exported_model, calibration),
    }
    return exported.model_bytes, evaluator, calibration, meta


def _agreement_evaluator(model: Any, float_bytes: bytes, calibration: CalibrationSet,
                         options: BuildOptions) -> Evaluator:
    """Without labels, INT8 is judged by agreement with the FP32 model (``model``, parsed, and
    ``float_bytes``) on the calibration set; for a 4-D first output, the classes are on the axis
    its layout (``--output-layout``, else :func:`models.onnx_model.output_layout`) says."""
    from models.onnx_model import image_layout, io_specs, output_layout

    inputs, outputs = io_specs(model)
    layout = options.output_layout
    if layout is not None and len(outputs[0].shape) != 4:
        raise ConfigError("--output-layout applies to a 4-D first output (N x C x H x W or "
                          "N x H x W x C)", key="--output-layout", output=outputs[0].name,
                          found=list(outputs[0].shape))
    if layout is None:
        layout = output_layout(model, outputs[0], image_layout(model, inputs[0]))
    reference = model_outputs(float_bytes, calibration.arrays, threads=options.threads)
    evaluator = Evaluator(calibration.arrays, threads=options.threads, reference=reference,
                          class_axis=3 if layout == "NHWC" else 1)
    log.info("INT8 is judged by %s%s", evaluator.metric_description,
             f" ({outputs[0].name!r} read as {layout})" if layout else "")
    return evaluator


def _from_onnx(options: BuildOptions, report: dict[str, Any]):
    from models.export import clean_onnx, node_counts
    from models.onnx_model import check_float_model, io_specs, load_onnx

    onnx_path, calib_dir = options.onnx, options.calib_dir
    assert onnx_path is not None and calib_dir is not None  # BuildOptions requires both
    raw = load_onnx(onnx_path)
    check_float_model(raw, onnx_path)
    inputs, _ = io_specs(raw)
    calibration = from_directory(calib_dir, inputs, options.calib_samples,
                                 preprocessing=options.calib_preprocess)
    cleaned = clean_onnx(raw)
    report["export"] = {
        "node_counts_before": node_counts(raw),
        "node_counts_after": node_counts(cleaned),
    }
    float_bytes = cleaned.SerializeToString()
    evaluator = _agreement_evaluator(cleaned, float_bytes, calibration, options)
    meta = {
        "source": {"kind": "onnx", "path": str(options.onnx)},
        "dataset": f"calibration samples ({len(calibration)}), agreement with FP32",
        "preprocessing": calibration.preprocessing,
        **_input_meta(raw, calibration),
    }
    return float_bytes, evaluator, calibration, meta


def _input_meta(model: Any, calibration: CalibrationSet) -> dict[str, Any]:
    """What later stages need to know about the model's inputs: names, dtypes and one sample's
    shape each (from the calibration set), each 4-D input's layout, and which of the first
    input's height and width are dynamic (they get engine profile ranges)."""
    import onnx

    from models.onnx_model import image_layout, io_specs, spatial_axes

    proto = onnx.load_from_string(model) if isinstance(model, bytes) else model
    inputs, _ = io_specs(proto)
    layouts = {spec.name: image_layout(proto, spec) for spec in inputs}
    first = inputs[0]
    axes = spatial_axes(layouts[first.name]) or ()
    return {
        "input_name": first.name,
        "inputs": [(spec.name, spec.dtype, tuple(calibration.arrays[spec.name].shape[1:]))
                   for spec in inputs],
        "layouts": layouts,
        "dynamic_hw": [axis_name for axis_name, axis in zip(("height", "width"), axes)
                       if first.shape[axis] < 0],
    }


def _export_report(exported: Any) -> dict[str, Any]:
    return {
        "opset": 17,
        "input_shape": list(exported.input_shape),
        "dynamic_spatial": exported.dynamic_spatial,
        "node_counts_before": exported.node_counts_before,
        "node_counts_after": exported.node_counts_after,
        "max_abs_error_vs_torch": exported.max_abs_error,
        "checks": exported.checks,
        "seconds": round(exported.seconds, 2),
    }


def _quantization_report(result: QuantizeResult, options: BuildOptions) -> dict[str, Any]:
    return {
        "format": "QDQ, symmetric INT8, per-channel weights, float bias",
        "calibration": result.calibration,
        "accuracy_budget": options.accuracy_budget,
        "fp16_layers": result.fp16_layers,
        "int8_layer_count": len(result.int8_layers),
        "sensitivity": [layer.to_dict() for layer in result.sensitivity],
        "search": result.search_trace,
        "node_counts": result.node_counts,
        "seconds": {name: round(value, 2) for name, value in result.seconds.items()},
    }


def _budget_reference(meta: dict[str, Any]) -> float | None:
    """After pruning, the accuracy budget is counted from the unpruned model: it covers what
    pruning and INT8 cost together, which is what the operator asked to bound."""
    if meta.get("pruned_torch_metric") is None:
        return None
    return float(meta["fp32_torch_metric"])


def _accuracy_report(result: QuantizeResult, meta: dict[str, Any],
                     options: BuildOptions) -> dict[str, Any]:
    accuracy: dict[str, Any] = {
        "metric": result.metric_name,
        "metric_description": result.metric_description,
        "dataset": meta["dataset"],
        "fp32": round(result.float_metric, 3),
        "int8_all_layers": round(result.full_int8_metric, 3),
        "int8": round(result.int8_metric, 3),
        # The drop the budget holds: from the unpruned model when pruning ran, else from FP32.
        "drop": round(result.budget_drop, 3),
        "int8_drop": round(result.drop, 3),
        "budget": options.accuracy_budget,
        "budget_from": "FP32 (ONNX)",
        "fp16_layers": len(result.fp16_layers),
        # Every output of the final model against FP32, on the sensitivity samples.
        "outputs": [output.to_dict() for output in result.outputs],
    }
    if meta.get("fp32_torch_metric") is not None:
        accuracy["fp32_unpruned"] = round(meta["fp32_torch_metric"], 3)
    if meta.get("pruned_torch_metric") is not None:
        accuracy["pruned_fp32"] = round(meta["pruned_torch_metric"], 3)
        accuracy["drop_vs_unpruned"] = accuracy["drop"]  # the budgeted drop counts from it
        accuracy["budget_from"] = "unpruned FP32 (PyTorch)"
    return accuracy


def frame_size(meta: dict[str, Any], options: BuildOptions) -> tuple[int, int] | None:
    """The deployment frame (height, width) of a model whose first input takes any size, else
    None (see :attr:`BuildOptions.frame_size`): the given one, 224 x 224 for the example models,
    or the calibration samples' size."""
    calibrated = _calibrated_frame(meta)
    if not meta["dynamic_hw"] or calibrated is None:
        return None
    if options.frame_size is not None:
        return (int(options.frame_size[0]), int(options.frame_size[1]))
    if options.model is not None:
        return EXAMPLE_FRAME
    return calibrated


def _sample_shape(meta: dict[str, Any], name: str) -> tuple[int, ...]:
    return next(tuple(shape) for input_name, _, shape in meta["inputs"] if input_name == name)


def _calibrated_frame(meta: dict[str, Any]) -> tuple[int, int] | None:
    """The first input's height and width in the calibration samples; None when it is no image."""
    from models.onnx_model import spatial_axes

    axes = spatial_axes(meta["layouts"].get(meta["input_name"]))
    if axes is None:
        return None
    sample = _sample_shape(meta, meta["input_name"])  # no batch axis: one less than the input's
    return int(sample[axes[0] - 1]), int(sample[axes[1] - 1])


def _check_frame_option(meta: dict[str, Any], options: BuildOptions) -> None:
    """Refuse --frame-size for a model whose first input has a fixed height and width."""
    if options.frame_size is not None and not meta["dynamic_hw"]:
        raise ConfigError("--frame-size is for models whose input takes any height and width; "
                          "this one's is fixed", key="--frame-size", input=meta["input_name"],
                          shape=list(_sample_shape(meta, meta["input_name"])))


def _frame_inputs(meta: dict[str, Any], batch: int, frame: tuple[int | None, int | None] | None
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every input's shape and dtype for ``batch`` samples at ``frame``: the calibration samples'
    shape, with the dynamic height and width of the first input, and of every other image input
    calibrated at the same size as it (an aligned depth map, a mask), set to ``frame`` (whose
    entry for a fixed axis is not used)."""
    from models.onnx_model import spatial_axes

    first_hw = _calibrated_frame(meta)
    feeds = {}
    for name, dtype, sample_shape in meta["inputs"]:
        shape = [batch, *sample_shape]
        axes = spatial_axes(meta["layouts"].get(name))
        if frame is not None and axes is not None and first_hw is not None and tuple(
                sample_shape[axis - 1] for axis in axes) == first_hw:
            for axis_name, axis, side in zip(("height", "width"), axes, frame):
                if axis_name in meta["dynamic_hw"] and side is not None:
                    shape[axis] = side
        feeds[name] = (tuple(shape), dtype)
    return feeds


def check_frame_sizes(float_bytes: bytes, meta: dict[str, Any], options: BuildOptions) -> None:
    """Run the FP32 model once at the engine profile's frame sizes beyond the calibration size
    (the optimum and the largest), so that a model that cannot take them (a network that needs
    multiples of 64, or inputs that must match) is refused now, not after calibration or in the
    board's engine build.

    Raises:
        ModelError: the model fails at one of the sizes (names it and ONNX Runtime's reason).
    """
    from models.ort import create_session

    profile = _engine_profile(meta, options)
    if "height" not in profile and "width" not in profile:
        return
    session = create_session(float_bytes, threads=options.threads, fold_relu=False)
    rng = np.random.default_rng(0)
    for role, index in (("optimum", 1), ("largest", 2)):
        frame = (profile.get("height", [None] * 3)[index], profile.get("width", [None] * 3)[index])
        feeds = _frame_inputs(meta, 1, frame)
        try:
            feed = {name: rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
                    for name, (shape, dtype) in feeds.items()}
            session.run(None, feed)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            shapes = ", ".join(f"{name} {list(shape)}" for name, (shape, _) in feeds.items())
            reason = first_line(exc)
            if isinstance(exc, MemoryError) or "bad_alloc" in reason or "allocate" in reason:
                raise ModelError(f"this host has not enough memory to run the model at the "
                                 f"engine profile's {role} frame size ({shapes}); give a smaller "
                                 "--frame-size (the largest is twice it)",
                                 reason=reason) from None
            raise ModelError(f"the model does not run at the engine profile's {role} frame size "
                             f"({shapes}); give --frame-size with a size it accepts",
                             reason=reason) from None


def _speed_report(float_bytes: bytes, int8_bytes: bytes, meta: dict[str, Any],
                  options: BuildOptions) -> dict[str, Any]:
    frame = frame_size(meta, options)
    feeds = _frame_inputs(meta, options.opt_batch, frame)
    fp32 = _speed(float_bytes, feeds, options.threads)
    int8 = _speed(int8_bytes, feeds, options.threads)
    return {
        "where": f"this host's CPU, ONNX Runtime, {options.threads} threads",
        "input_shape": list(feeds[meta["input_name"]][0]),
        "fp32_img_s": round(fp32, 2),
        "int8_img_s": round(int8, 2),
        "int8_speedup": round(int8 / fp32, 2),
        # Without VNNI an x86 CPU runs INT8 through ONNX Runtime's slower exact kernels
        # (models/ort.py), so the host's INT8 gain says little about a Jetson's.
        "int8_kernels": int8_kernels(),
        "note": "TensorRT speed is measured on the device; see `edge-agent bench`",
    }


def _engine_profile(meta: dict[str, Any], options: BuildOptions) -> dict[str, list[int]]:
    """The shape ranges a TensorRT engine for this bundle is built for: batch from 1 to
    ``max_batch`` tuned at ``opt_batch`` and, for models that take any image size, each dynamic
    one of height and width from the smaller of the calibration and deployment sizes to the larger
    of twice the deployment size and the calibration size, tuned at the deployment size
    (:func:`frame_size`)."""
    profile = {"batch": [1, options.opt_batch, options.max_batch]}
    frame, calibrated_frame = frame_size(meta, options), _calibrated_frame(meta)
    if frame is None or calibrated_frame is None:
        return profile
    for axis_name, deployed, calibrated in zip(("height", "width"), frame, calibrated_frame):
        if axis_name in meta["dynamic_hw"]:
            profile[axis_name] = [min(calibrated, deployed), deployed,
                                  max(2 * deployed, calibrated)]
    return profile


def _build_engine(files: dict[str, Path], work: Path, quantized: QuantizeResult,
                  profile: dict[str, list[int]], layout: str) -> dict[str, str]:
    from models.engine import EngineBuildConfig, build_engine

    unset: list[int | None] = [None, None, None]
    height: list[int | None] = list(profile.get("height") or unset)
    width: list[int | None] = list(profile.get("width") or unset)
    config = EngineBuildConfig(
        layout=layout,
        min_batch=profile["batch"][0],
        opt_batch=profile["batch"][1],
        max_batch=profile["batch"][2],
        min_height=height[0], opt_height=height[1], max_height=height[2],
        min_width=width[0], opt_width=width[1], max_width=width[2],
        fp16_layers=tuple(quantized.fp16_layers),
    )
    result = build_engine(files["model.onnx"], config)
    member = f"engines/{result.fingerprint.key()}.plan"
    path = work / member
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(result.plan)
    files[member] = path
    if result.timing_cache:
        (work / "timing.cache").write_bytes(result.timing_cache)
        files["timing.cache"] = work / "timing.cache"
    return {result.fingerprint.key(): member}


def format_summary(result: BuildResult) -> str:
    """A readable summary of a build for the terminal."""
    report = result.report
    accuracy = report["accuracy"]
    lines = [
        f"bundle   {result.bundle_path}",
        f"report   {result.report_path}",
        f"model    {report['name']} v{report['version']}  (signed by key {report['signing_key_id']})",
        f"accuracy ({accuracy['metric']}, {accuracy['dataset']})",
    ]
    if "fp32_unpruned" in accuracy:
        lines.append(f"  FP32 (PyTorch)     {accuracy['fp32_unpruned']:.2f}")
    if "pruned_fp32" in accuracy:
        lines.append(f"  pruned FP32        {accuracy['pruned_fp32']:.2f}")
    lines += [
        f"  FP32 (ONNX)        {accuracy['fp32']:.2f}",
        f"  INT8, all layers   {accuracy['int8_all_layers']:.2f}",
        f"  INT8, mixed        {accuracy['int8']:.2f}  (drop {accuracy['drop']:.2f} from "
        f"{accuracy['budget_from']}, budget {accuracy['budget']:.2f}, "
        f"{accuracy['fp16_layers']} layer(s) in FP16)",
    ]
    if "int8_onnxruntime_served" in accuracy:
        lines.append(f"  INT8, served (CPU) {accuracy['int8_onnxruntime_served']:.2f}  (ONNX Runtime "
                     "folds ReLUs into a finer UINT8 step; TensorRT runs the line above)")
    if len(accuracy.get("outputs", [])) > 1:
        lines.append("  outputs, INT8 against FP32: " + ", ".join(
            f"{output['name']} "
            + ("n/a" if output["sqnr_db"] is None else f"{output['sqnr_db']:.1f} dB")
            + ("" if output["judged_by_budget"] else " (not budgeted)")
            for output in accuracy["outputs"]))
    fp16 = report["quantization"]["fp16_layers"]
    if fp16:
        lines.append("  FP16 layers: " + ", ".join(fp16))
    model = report.get("model")
    if model:
        size = next((key.split("_")[-1] for key in model if key.startswith("macs_")), "")
        line = f"size     {model['params'] / 1e6:.2f} M params, {model[f'macs_{size}'] / 1e9:.2f} GMACs at {size}"
        if "pruned_params" in model:
            line += (f" -> pruned {model['pruned_params'] / 1e6:.2f} M params, "
                     f"{model[f'pruned_macs_{size}'] / 1e9:.2f} GMACs")
        lines.append(line)
    export = report.get("export", {})
    if export:
        before = sum(export["node_counts_before"].values())
        after = sum(export["node_counts_after"].values())
        lines.append(f"graph    {before} nodes exported -> {after} after BN folding and clean-up")
    speed = report["speed"]
    kernels = speed.get("int8_kernels", "default")
    kernels_note = "" if kernels == "default" else f"; INT8 kernels: {kernels}"
    lines.append(
        f"speed    {speed['where']}, input {'x'.join(map(str, speed['input_shape']))}: "
        f"FP32 {speed['fp32_img_s']:.1f} img/s, INT8 {speed['int8_img_s']:.1f} img/s "
        f"({speed['int8_speedup']:.2f}x{kernels_note})"
    )
    timings = report["timings_s"]
    within = report.get("timings_within", {})
    nested = {name for names in within.values() for name in names}

    def timing(name: str) -> str:
        parts = ", ".join(timing(inner) for inner in within.get(name, []))
        return f"{name} {timings[name]:.1f}s" + (f" ({parts})" if parts else "")

    lines.append("time     " + ", ".join(timing(name) for name in timings if name not in nested))
    return "\n".join(lines)
