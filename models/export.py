"""PyTorch to ONNX: export with dynamic axes, fold BatchNorm and constants, check against PyTorch.

The export uses torch's TorchScript-based exporter (``dynamo=False``): with torch pinned at 2.13 it
is fast, needs no extra package, and emits plain ``Conv``/``GlobalAveragePool``/``Flatten`` graphs
that TensorRT 8.5's parser reads. It is run with constant folding off so that the raw graph keeps
its ``BatchNormalization`` nodes; onnxslim (a maintained ONNX optimiser) then folds BatchNorm into
the convolutions, folds constants and removes dead and identity nodes, and the node counts before
and after show what it did.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import ModelError, first_line
from agent.fsutil import atomic_write_bytes
from models.onnx_model import check_batch_outputs

log = logging.getLogger(__name__)

MIN_OPSET = 17
DEFAULT_OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class ExportResult:
    """The cleaned ONNX model and what the export did."""

    model_bytes: bytes
    input_name: str
    output_names: tuple[str, ...]
    input_shape: tuple[int | str, ...]  # symbolic names for dynamic axes
    dynamic_spatial: bool
    node_counts_before: dict[str, int]
    node_counts_after: dict[str, int]
    max_abs_error: float
    seconds: float
    checks: list[dict[str, Any]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, self.model_bytes)


def node_counts(model: Any) -> dict[str, int]:
    """Number of nodes of each op type in an ``onnx.ModelProto``, most common first."""
    return dict(Counter(node.op_type for node in model.graph.node).most_common())


def run_example(model: Any, example: Any) -> Any:
    """``model``'s result on one sample of ``example``; a failure is named in one line."""
    import torch

    with torch.no_grad():
        try:
            return model(example[:1])
        except Exception as exc:  # noqa: BLE001 - any model error, named in one line
            raise ModelError(f"the model fails on the example input {tuple(example.shape)}: "
                             f"{type(exc).__name__}: {first_line(exc)}") from exc


def output_names(output: Any, single_name: str = OUTPUT_NAME) -> list[str]:
    """The ONNX output names for a model's result: ``single_name`` for one tensor, ``output_0``,
    ``output_1``, ... for a tuple or list of tensors, the keys for a dict of tensors (in its
    order, as the exporter flattens it). Anything else is refused in one line."""
    import torch

    if isinstance(output, torch.Tensor):
        return [single_name]
    values = flat_outputs(output)
    if isinstance(output, dict):
        names = list(output)
        if not all(isinstance(name, str) and name.isidentifier() for name in names):
            raise ModelError("a model returning a dict needs identifier-like string keys (they "
                             "name the ONNX outputs)", found=[str(name) for name in names])
    else:
        names = [f"output_{index}" for index in range(len(values))]
    if not values or not all(isinstance(value, torch.Tensor) for value in values):
        raise ModelError("the model must return a tensor, or a tuple, list or dict of tensors "
                         "(nested or non-tensor outputs are not supported)",
                         found=type(output).__name__)
    return names


def flat_outputs(output: Any) -> list[Any]:
    """A model's result as a list of its outputs, in the order of :func:`output_names`."""
    if isinstance(output, dict):
        return list(output.values())
    if isinstance(output, (tuple, list)):
        return list(output)
    return [output]


def other_size(example: Any) -> tuple[int, int]:
    """A height and width unlike ``example``'s (twice its height, three times its width) that
    keeps whatever divisibility the model needs (a UNet takes multiples of 16 or 32)."""
    height, width = example.shape[-2:]
    return int(height) * 2, int(width) * 3


def output_size_axes(model: Any, example: Any, output: Any) -> list[dict[int, str]] | None:
    """Run ``model`` at another height and width than ``example`` (whose result is ``output``):
    None when it cannot (a flatten straight into a linear layer: exported with a fixed size),
    else, per output, the axes that followed the input size (a segmentation map's height and
    width), which are exported as dynamic.

    Fully convolutional classifiers with a global pool (like the example ResNet-18) keep every
    output axis; dense heads keep their channels and follow the input in height and width.
    """
    import torch

    probe = torch.zeros((1, example.shape[1], *other_size(example)), dtype=example.dtype)
    with torch.no_grad():
        try:
            other = flat_outputs(model(probe))
        except Exception:  # any failure at another size means "fixed size"
            return None
    axes: list[dict[int, str]] = []
    for index, (ref, alt) in enumerate(zip(flat_outputs(output), other)):
        if ref.dim() != alt.dim():
            return None
        axes.append({axis: f"out{index}_dim{axis}" for axis in range(1, ref.dim())
                     if ref.shape[axis] != alt.shape[axis]})
    return axes


def clean_onnx(model: Any) -> Any:
    """Fold BatchNorm and constants and drop dead nodes with onnxslim; returns a new model."""
    onnxslim = require("onnxslim", extra="host", purpose="ONNX graph clean-up")
    try:
        cleaned = onnxslim.slim(model)
    except Exception as exc:  # onnxslim raises many types on graphs it cannot handle
        raise ModelError(f"onnxslim could not optimise the graph: {exc}") from exc
    named = name_nodes(cleaned)
    if named:
        log.info("named %d unnamed or duplicate-named node(s) (the precision plan and TensorRT's "
                 "layer constraints refer to nodes by name)", named)
    return cleaned


def name_nodes(model: Any) -> int:
    """Give every node without a name, or with a name an earlier node has, a unique one
    (``<op type>_<n>``, as exporters do); returns how many were named. ONNX allows unnamed nodes,
    but the precision plan and TensorRT's per-layer precision need a name for each."""
    taken = {node.name for node in model.graph.node if node.name}
    seen: set[str] = set()
    counter = 0
    named = 0
    for node in model.graph.node:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        while (candidate := f"{node.op_type}_{counter}") in taken:
            counter += 1
        node.name = candidate
        taken.add(candidate)
        seen.add(candidate)
        named += 1
    return named


def export_onnx(
    model: Any,
    example: Any,
    *,
    opset: int = DEFAULT_OPSET,
    input_name: str = INPUT_NAME,
    output_name: str = OUTPUT_NAME,
    check_inputs: list[np.ndarray] | None = None,
    check_size: tuple[int, int] | None = (224, 224),
    atol: float = 1e-3,
    rtol: float = 1e-3,
) -> ExportResult:
    """Export ``model`` (an ``nn.Module``) to a clean ONNX graph and check it against PyTorch.

    Args:
        model: The model; it is put in eval mode.
        example: A float tensor of shape (N, C, H, W) at the size the model is used at.
        opset: ONNX opset, at least 17.
        check_inputs: Real input batches to compare ONNX Runtime and PyTorch on (in addition to
            the example and, for size-agnostic models, a batch of 2 at ``check_size``, or at
            :func:`other_size` when that is None).
        atol, rtol: Tolerance of the comparison (``|onnx - torch| <= atol + rtol * |torch|``).

    Raises:
        ModelError: The export fails, or the ONNX output disagrees with PyTorch.
    """
    onnx = require("onnx", extra="host", purpose="ONNX export")
    if opset < MIN_OPSET:
        raise ModelError(f"opset must be >= {MIN_OPSET}", found=opset)
    started = time.perf_counter()
    model = model.eval()
    output = run_example(model, example)
    names = output_names(output, output_name)
    size_axes = output_size_axes(model, example, output)
    dynamic_spatial = size_axes is not None
    raw = onnx.load_from_string(
        _torchscript_export(model, example, opset, input_name, names, size_axes)
    )
    cleaned = _cleaned_and_checked(onnx, raw)
    model_bytes = cleaned.SerializeToString()

    batches = _check_batches(example, check_inputs, dynamic_spatial, check_size)
    checks, max_error = compare_with_torch(model, model_bytes, input_name, batches, atol, rtol)
    input_shape = tuple(
        dim.dim_param or dim.dim_value for dim in cleaned.graph.input[0].type.tensor_type.shape.dim
    )
    result = ExportResult(
        model_bytes=model_bytes,
        input_name=input_name,
        output_names=tuple(output.name for output in cleaned.graph.output),
        input_shape=input_shape,
        dynamic_spatial=dynamic_spatial,
        node_counts_before=node_counts(raw),
        node_counts_after=node_counts(cleaned),
        max_abs_error=max_error,
        seconds=time.perf_counter() - started,
        checks=checks,
    )
    log.info(
        "exported ONNX opset %d: %d nodes -> %d after clean-up, max |onnx - torch| = %.2e",
        opset,
        sum(result.node_counts_before.values()),
        sum(result.node_counts_after.values()),
        max_error,
    )
    return result


def _torchscript_export(
    model: Any,
    example: Any,
    opset: int,
    input_name: str,
    names: list[str],
    size_axes: list[dict[int, str]] | None,
) -> bytes:
    """The raw ONNX graph (BatchNorm kept, constants not folded); the batch axis is dynamic, and
    height and width too when ``size_axes`` says the model runs at another size."""
    import torch

    axes: dict[int, str] = {0: "batch"}
    if size_axes is not None:
        axes.update({2: "height", 3: "width"})
    output_axes = {name: {0: "batch", **(size_axes[index] if size_axes else {})}
                   for index, name in enumerate(names)}
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter is deprecated in favour of dynamo export; see module docstring.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        try:
            torch.onnx.export(
                model,
                (example,),
                buffer,  # type: ignore[arg-type]  # a file object works; the stub says path only
                dynamo=False,
                opset_version=opset,
                input_names=[input_name],
                output_names=names,
                dynamic_axes={input_name: axes, **output_axes},
                do_constant_folding=False,
            )
        except Exception as exc:
            raise ModelError(f"torch.onnx.export failed: {exc}") from exc
    return buffer.getvalue()


def _cleaned_and_checked(onnx: Any, raw: Any) -> Any:
    """``raw`` cleaned by :func:`clean_onnx`, checked by the ONNX checker and for a batch axis on
    every output; a BatchNorm left unfolded is warned about."""
    cleaned = clean_onnx(raw)
    try:
        onnx.checker.check_model(cleaned)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"exported ONNX is invalid: {exc}") from exc
    remaining_bn = sum(node.op_type == "BatchNormalization" for node in cleaned.graph.node)
    if remaining_bn:
        log.warning("%d BatchNormalization nodes could not be folded (not after a conv)", remaining_bn)
    check_batch_outputs(cleaned)
    return cleaned


def _check_batches(
    example: Any,
    check_inputs: list[np.ndarray] | None,
    dynamic_spatial: bool,
    check_size: tuple[int, int] | None,
) -> list[np.ndarray]:
    """The batches to compare ONNX Runtime and PyTorch on (see :func:`export_onnx`)."""
    import torch

    batches = [example.numpy()] + list(check_inputs or [])
    if dynamic_spatial:
        generator = torch.Generator().manual_seed(0)
        size = check_size or other_size(example)
        batches.append(torch.randn((2, example.shape[1], *size), generator=generator).numpy())
    return batches


def compare_with_torch(
    model: Any,
    model_bytes: bytes,
    input_name: str,
    batches: list[np.ndarray],
    atol: float,
    rtol: float,
) -> tuple[list[dict[str, Any]], float]:
    """Run each batch through ONNX Runtime and PyTorch; raise if any output is out of tolerance."""
    import torch

    from models.ort import create_session

    session = create_session(model_bytes)
    names = [output.name for output in session.get_outputs()]
    checks = []
    worst = 0.0
    for batch in batches:
        shape = list(batch.shape)
        with torch.no_grad():
            try:
                expected_outputs = [tensor.numpy()
                                    for tensor in flat_outputs(model(torch.from_numpy(batch)))]
            except Exception as exc:  # noqa: BLE001 - any model error, named in one line
                raise ModelError(f"the model fails on an input of shape {shape} (the bundle's "
                                 "batch axis is dynamic: the model must take any batch size): "
                                 f"{type(exc).__name__}: {first_line(exc)}") from exc
        try:
            actual_outputs = session.run(None, {input_name: batch})
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            raise ModelError(f"the exported model fails in ONNX Runtime on an input of shape "
                             f"{shape}, where PyTorch runs (a batch or size fixed by tracing, "
                             f"e.g. a view(1, -1)?): {first_line(exc)}") from exc
        if len(actual_outputs) != len(expected_outputs):
            raise ModelError("the ONNX model has a different number of outputs than PyTorch",
                             expected=len(expected_outputs), found=len(actual_outputs))
        max_error = 0.0
        for name, actual, expected in zip(names, actual_outputs, expected_outputs):
            if actual.shape != expected.shape:
                raise ModelError(
                    "ONNX output shape differs from PyTorch",
                    output=name,
                    input_shape=batch.shape,
                    expected=expected.shape,
                    found=actual.shape,
                )
            error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
            output_error = float(error.max()) if error.size else 0.0
            max_error = max(max_error, output_error)
            allowed = atol + rtol * np.abs(expected.astype(np.float64))
            if np.any(error > allowed):
                raise ModelError(
                    "ONNX output differs from PyTorch beyond tolerance (a branch or loop on "
                    "tensor values is traced for the example only; see TracerWarnings above)",
                    output=name,
                    input_shape=batch.shape,
                    max_abs_error=f"{output_error:.3g}",
                    atol=atol,
                    rtol=rtol,
                )
        worst = max(worst, max_error)
        checks.append({"input_shape": list(batch.shape), "max_abs_error": max_error})
    return checks, worst
