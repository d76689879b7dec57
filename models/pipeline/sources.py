"""The three model sources a build starts from, each giving the FP32 ONNX model, the evaluator
that judges INT8 against it, the calibration set and what later stages need to know (``meta``):
an example model from the zoo (trained, optionally pruned and fine-tuned, exported), a user's
PyTorch model (exported and checked on real samples), or a user's ONNX model. The zoo's models
are judged against the labels of their held-out split; the others against the FP32 model on
samples of the calibration directory held out from calibration (:func:`_split_samples`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agent.errors import CalibrationError, ConfigError, PruningError
from models.calibration import CalibrationSet, from_array, from_directory
from models.pipeline.batching import note_batch
from models.pipeline.options import CHECK_SAMPLES, EXAMPLE_FRAME, BuildOptions
from models.pipeline.report import _export_report
from models.pipeline.stages import _Stages
from models.quantize import Evaluator, all_model_outputs

log = logging.getLogger(__name__)


def _from_torch(options: BuildOptions, report: dict[str, Any], stages: _Stages):
    import onnx
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
    evaluator = _evaluator(onnx.load_from_string(exported.model_bytes), exported.model_bytes,
                           {exported.input_name: held_out.images}, options, held_out.labels)
    meta = {
        "source": {"kind": "zoo", "model": spec.name},
        "dataset": f"digits held-out split ({len(held_out)} images, {spec.train_size}x{spec.train_size})",
        "samples": {"calibration": len(calibration), "judged": len(held_out),
                    "rule": "the digits train split calibrates; its held-out split, with "
                            "labels, judges"},
        "fp32_torch_metric": fp32_top1,
        "pruned_torch_metric": pruned_top1,
        "preprocessing": digits_preprocessing(spec.train_size).to_dict(),
        **_input_meta(exported.model_bytes, calibration),
        # Exported with a dynamic batch, on axis 0 of every output (models.export checks it).
        "fixed_batch": None,
        "output_batch_axes": {},
    }
    return exported.model_bytes, evaluator, calibration, meta


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
    calibration, held_out, split = _split_samples(calib_dir, inputs, options)
    evaluator = _evaluator(exported_model, exported.model_bytes, held_out.arrays, options)
    meta = {
        "source": {"kind": "pytorch", "model": options.user_model,
                   "checkpoint": str(options.checkpoint) if options.checkpoint else None},
        "dataset": _held_out_dataset(split),
        "samples": split,
        "preprocessing": calibration.preprocessing,
        **_input_meta(exported_model, calibration),
        # Exported with a dynamic batch, on axis 0 of every output (models.export checks it).
        "fixed_batch": None,
        "output_batch_axes": {},
    }
    return exported.model_bytes, evaluator, calibration, meta


# Without labels INT8 is judged on samples of the calibration directory held out from
# calibration: the first --calib-samples files (name order) calibrate, the next ones, up to
# HELD_OUT_MAX, judge. Where fewer than HELD_OUT_MIN are left after --calib-samples, HELD_OUT_MIN
# (or half the directory, when it has fewer than twice that) are held out and fewer calibrate;
# under MIN_SPLIT_SAMPLES there are not enough to do both.
HELD_OUT_MAX = 256
HELD_OUT_MIN = 32
MIN_SPLIT_SAMPLES = 8


def _split_samples(calib_dir: Path, inputs: Any, options: BuildOptions
                   ) -> tuple[CalibrationSet, CalibrationSet, dict[str, Any]]:
    """The calibration directory's samples split into those that calibrate and those held out
    to judge INT8 (the rule above), and the counts and rule for the report."""
    from models.calibration import (RECOMMENDED_MAX_SAMPLES, RECOMMENDED_MIN_SAMPLES,
                                    warn_about_copies)

    everything = from_directory(calib_dir, inputs, options.calib_samples + HELD_OUT_MAX,
                                preprocessing=options.calib_preprocess, probe=True)
    total = len(everything)
    if total < MIN_SPLIT_SAMPLES:
        raise CalibrationError(
            f"too few samples to calibrate INT8 and judge it on held-out ones: give at least "
            f"{MIN_SPLIT_SAMPLES} (better {HELD_OUT_MIN} more than --calib-samples)",
            path=calib_dir, found=total)
    rule = (f"the first --calib-samples files (name order) calibrate, the next ones (up to "
            f"{HELD_OUT_MAX}) are held out to judge")
    spare = total - options.calib_samples
    note = None
    if spare >= HELD_OUT_MIN:
        calibrate, judged = options.calib_samples, min(spare, HELD_OUT_MAX)
    else:
        judged = min(HELD_OUT_MIN, total // 2)
        calibrate = min(options.calib_samples, total - judged)
        note = (f"the calibration directory has {total} samples, fewer than --calib-samples "
                f"{options.calib_samples} plus {HELD_OUT_MIN} held out to judge INT8: "
                f"{calibrate} calibrate and the last {judged} judge (add samples for a steadier "
                "judgement)")
        rule += (f"; with fewer than --calib-samples + {HELD_OUT_MIN} files, {HELD_OUT_MIN} "
                 "(at most half of them) are held out")
        log.warning("%s", note)
    arrays = everything.arrays
    calibration = CalibrationSet({name: array[:calibrate] for name, array in arrays.items()},
                                 everything.source, everything.preprocessing)
    held_out = CalibrationSet(
        {name: array[calibrate:calibrate + judged] for name, array in arrays.items()},
        everything.source, everything.preprocessing)
    if calibrate < RECOMMENDED_MIN_SAMPLES:
        log.warning("calibrating on %d samples; %d-%d are recommended", calibrate,
                    RECOMMENDED_MIN_SAMPLES, RECOMMENDED_MAX_SAMPLES)
    warn_about_copies(calibration.arrays, str(calib_dir))
    log.info("%d samples calibrate, %d held-out samples judge INT8", calibrate, judged)
    samples = {"calibration": calibrate, "judged": judged, "held_out": True, "rule": rule,
               "warnings": [note] if note else []}
    return calibration, held_out, samples


def _held_out_dataset(samples: dict[str, Any]) -> str:
    return (f"{samples['judged']} held-out samples (after the {samples['calibration']} that "
            "calibrate), against FP32")


def _evaluator(model: Any, float_bytes: bytes, inputs: dict[str, Any], options: BuildOptions,
               labels: Any = None, *, fixed_batch: int | None = None,
               batch_axes: dict[str, int] | None = None) -> Evaluator:
    """The evaluator that judges INT8 against the FP32 model (``model``, parsed, and
    ``float_bytes``) on ``inputs``: every output by the judge that suits it (a 4-D output's
    classes on the axis its layout, ``--output-layout`` or told by the graph, says), or as
    ``--output-metric`` and ``--evaluator`` say; the first output's top-1 against ``labels``
    where given. ``fixed_batch`` and ``batch_axes``: how the model takes and returns batches
    (models.batch_axis; outputs are judged batch first)."""
    from models.onnx_model import io_specs
    from models.quantize import CustomJudge, choose_judges, output_facts

    _, outputs = io_specs(model)
    if options.output_layout is not None and not any(len(spec.shape) == 4 for spec in outputs):
        raise ConfigError("--output-layout applies to 4-D outputs (N x C x H x W or "
                          "N x H x W x C); this model has none", key="--output-layout",
                          outputs=", ".join(f"{spec.name} {list(spec.shape)}" for spec in outputs))
    custom = CustomJudge.load(options.evaluator) if options.evaluator else None
    reference = all_model_outputs(float_bytes, inputs, threads=options.threads,
                                  fixed_batch=fixed_batch, batch_axes=batch_axes)
    judges = choose_judges(reference, labels=labels is not None,
                           facts=output_facts(model, options.output_layout),
                           overrides=options.output_metrics, custom=custom)
    for judge in judges:
        log.info("INT8 is judged on %s by %s (%s), %s", judge.name if judge is not custom else
                 "every output", judge.describe(), judge.to_dict()["why"],
                 judge.limit_text(options.accuracy_budget))
    return Evaluator(inputs, labels, reference, threads=options.threads, judges=judges,
                     fixed_batch=fixed_batch, batch_axes=batch_axes)


def _from_onnx(options: BuildOptions, report: dict[str, Any]):
    """A user's ONNX model: checked, converted to a newer opset when it is below 13 (and checked
    against the original), its batch axis made dynamic where the graph allows it, cleaned, and
    every output's batch axis found by running it (models.onnx_upgrade, models.batch_axis)."""
    from models.batch_axis import check_batch, make_batch_dynamic
    from models.export import clean_onnx, node_counts
    from models.onnx_model import check_float_model, io_specs, load_onnx
    from models.onnx_upgrade import upgrade_opset

    onnx_path, calib_dir = options.onnx, options.calib_dir
    assert onnx_path is not None and calib_dir is not None  # BuildOptions requires both
    raw = load_onnx(onnx_path)
    check_float_model(raw, onnx_path)
    inputs, _ = io_specs(raw)
    calibration, held_out, split = _split_samples(calib_dir, inputs, options)
    samples = calibration.arrays
    upgraded, conversion = upgrade_opset(raw, samples, threads=options.threads)
    if conversion is not None:
        report["conversion"] = conversion
    model, trial = make_batch_dynamic(upgraded, samples, threads=options.threads)
    cleaned = clean_onnx(model)
    float_bytes = cleaned.SerializeToString()
    batch = check_batch(float_bytes, samples, trial, threads=options.threads)
    note_batch(batch, options, report)
    report["export"] = {
        "node_counts_before": node_counts(raw),
        "node_counts_after": node_counts(cleaned),
    }
    evaluator = _evaluator(cleaned, float_bytes, held_out.arrays, options,
                           fixed_batch=batch.fixed, batch_axes=batch.output_axes)
    meta = {
        "source": {"kind": "onnx", "path": str(options.onnx)},
        "dataset": _held_out_dataset(split),
        "samples": split,
        "preprocessing": calibration.preprocessing,
        **_input_meta(raw, calibration),
        "fixed_batch": batch.fixed,
        "output_batch_axes": dict(batch.output_axes),
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
