"""The three model sources a build starts from, each giving the FP32 ONNX model, the evaluator
that judges INT8 against it, the calibration set and what later stages need to know (``meta``):
an example model from the zoo (trained, optionally pruned and fine-tuned, exported), a user's
PyTorch model (exported and checked on real samples), or a user's ONNX model."""

from __future__ import annotations

import logging
from typing import Any

from agent.errors import ConfigError, PruningError
from models.calibration import CalibrationSet, from_array, from_directory
from models.pipeline.batching import note_batch
from models.pipeline.options import CHECK_SAMPLES, EXAMPLE_FRAME, BuildOptions
from models.pipeline.report import _export_report
from models.pipeline.stages import _Stages
from models.quantize import Evaluator, model_outputs

log = logging.getLogger(__name__)


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
    calibration = from_directory(calib_dir, inputs, options.calib_samples,
                                 preprocessing=options.calib_preprocess)
    evaluator = _agreement_evaluator(exported_model, exported.model_bytes, calibration, options)
    meta = {
        "source": {"kind": "pytorch", "model": options.user_model,
                   "checkpoint": str(options.checkpoint) if options.checkpoint else None},
        "dataset": f"calibration samples ({len(calibration)}), agreement with FP32",
        "preprocessing": calibration.preprocessing,
        **_input_meta(exported_model, calibration),
        # Exported with a dynamic batch, on axis 0 of every output (models.export checks it).
        "fixed_batch": None,
        "output_batch_axes": {},
    }
    return exported.model_bytes, evaluator, calibration, meta


def _agreement_evaluator(model: Any, float_bytes: bytes, calibration: CalibrationSet,
                         options: BuildOptions, *, fixed_batch: int | None = None,
                         batch_axes: dict[str, int] | None = None) -> Evaluator:
    """Without labels, INT8 is judged by agreement with the FP32 model (``model``, parsed, and
    ``float_bytes``) on the calibration set; for a 4-D first output, the classes are on the axis
    its layout (``--output-layout``, else :func:`models.onnx_model.output_layout`) says.
    ``fixed_batch`` and ``batch_axes``: how the model takes and returns batches
    (models.batch_axis; outputs are judged batch first)."""
    from models.onnx_model import image_layout, io_specs, output_layout

    inputs, outputs = io_specs(model)
    layout = options.output_layout
    if layout is not None and len(outputs[0].shape) != 4:
        raise ConfigError("--output-layout applies to a 4-D first output (N x C x H x W or "
                          "N x H x W x C)", key="--output-layout", output=outputs[0].name,
                          found=list(outputs[0].shape))
    if layout is None:
        layout = output_layout(model, outputs[0], image_layout(model, inputs[0]))
    reference = model_outputs(float_bytes, calibration.arrays, threads=options.threads,
                              fixed_batch=fixed_batch, batch_axes=batch_axes)
    evaluator = Evaluator(calibration.arrays, threads=options.threads, reference=reference,
                          class_axis=3 if layout == "NHWC" else 1, fixed_batch=fixed_batch,
                          batch_axes=batch_axes)
    log.info("INT8 is judged by %s%s", evaluator.metric_description,
             f" ({outputs[0].name!r} read as {layout})" if layout else "")
    return evaluator


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
    calibration = from_directory(calib_dir, inputs, options.calib_samples,
                                 preprocessing=options.calib_preprocess)
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
    evaluator = _agreement_evaluator(cleaned, float_bytes, calibration, options,
                                     fixed_batch=batch.fixed, batch_axes=batch.output_axes)
    meta = {
        "source": {"kind": "onnx", "path": str(options.onnx)},
        "dataset": f"calibration samples ({len(calibration)}), agreement with FP32",
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
