"""``edge-agent bench pipeline``: what pruning and INT8 buy on this machine, in one run.

ResNet-18 (trained on the digits set) at 224x224, batch 1 and 8, a fixed number of threads:

- PyTorch eager FP32, the baseline;
- pruned FP32 (PyTorch eager);
- unpruned INT8 and pruned INT8, the QDQ models the build pipeline produces (mixed precision
  included), run through ONNX Runtime's CPU provider;
- FP32 through ONNX Runtime, for context.

Top-1 is measured on the held-out digits split at the size the model was trained at (32x32): the
accuracy of the exact models whose speed is reported. The INT8 roofline divides the MACs per
second the INT8 model achieves by those of large INT8 matrix multiplies (a chain of 2048^3 ones
through ONNX Runtime's integer GEMM kernels, :func:`int8_matmul`) measured in the same run, so
both numbers share the machine's state.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import ConfigError
from models.ort import int8_kernels
from models.timing import keep_large_allocations, time_call

log = logging.getLogger(__name__)

MODEL = "resnet18-digits"


@dataclass(frozen=True)
class PipelineBenchConfig:
    prune_ratio: float = 0.75
    finetune_epochs: int = 12
    threads: int = 2
    size: int = 224
    batches: tuple[int, ...] = (1, 8)
    min_time_s: float = 3.0  # per variant and batch, split over the rounds
    min_runs: int = 5
    rounds: int = 3
    matmul_size: int = 2048
    matmul_depth: int = 8
    calib_samples: int = 512
    accuracy_budget: float = 1.0

    def __post_init__(self) -> None:
        """Refuse bad settings before minutes of pruning and calibration are spent."""
        from models.pipeline import MAX_PRUNE_RATIO

        if not 0.0 <= self.prune_ratio <= MAX_PRUNE_RATIO:
            raise ConfigError(f"prune ratio must be in [0, {MAX_PRUNE_RATIO}]", key="--prune",
                              found=self.prune_ratio)
        for key, value, minimum in (("--finetune-epochs", self.finetune_epochs, 0),
                                    ("--threads", self.threads, 1),
                                    ("--size", self.size, 32),
                                    ("--rounds", self.rounds, 1)):
            if value < minimum:
                raise ConfigError(f"{key} must be at least {minimum}", key=key, found=value)
        if not 0 < self.min_time_s <= 3600:  # also refuses NaN and infinity
            raise ConfigError("--min-time must be positive and at most an hour", key="--min-time",
                              found=self.min_time_s)
        if self.size > 1024:
            raise ConfigError("--size must be at most 1024 (a batch of 8 ResNet-18 activations "
                              "at that size already needs several GiB)", key="--size",
                              found=self.size)
        if not self.batches or min(self.batches) < 1:
            raise ConfigError("batch sizes must be positive", found=list(self.batches))


def cpu_steal_fraction(before: list[int] | None = None) -> tuple[list[int], float]:
    """CPU time counters from /proc/stat and, given earlier counters, the fraction of the time in
    between that the hypervisor gave to other guests ("steal"): a sign of a noisy machine."""
    try:
        with open("/proc/stat") as handle:
            counters = [int(value) for value in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return [], 0.0
    if not before or len(counters) < 8:
        return counters, 0.0
    deltas = [now - then for now, then in zip(counters, before)]
    return counters, deltas[7] / max(1, sum(deltas))


def int8_matmul(size: int, threads: int, depth: int = 8) -> tuple[Callable[[], Any], int]:
    """The INT8 GEMM reference, ready to call, and the MACs of one call: ``depth`` chained
    ``size x size x size`` integer matrix multiplies.

    Each multiply is a QDQ 1x1 convolution over ``size`` positions (``size`` input channels times
    ``size`` output channels), which ONNX Runtime runs as one ``QLinearConv``: the same packed
    symmetric-weight GEMM kernels the model's convolutions use. A QDQ ``MatMul`` goes through a
    slower general kernel (about 0.8x on the AVX-512 VNNI development VM), and converting the float
    input and output costs a fifth of one multiply, so the chain keeps the integers between
    multiplies and pays that conversion once for ``depth`` of them. On the development VM the
    result is the vector units' peak (2 x 64 INT8 MACs per cycle per core).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from models.ort import create_session

    rng = np.random.default_rng(0)
    height = 32 if size % 32 == 0 else 1
    spatial = [height, size // height]
    initializers = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
                    numpy_helper.from_array(np.array(0, np.int8), "zero")]
    nodes = [helper.make_node("QuantizeLinear", ["a", "scale", "zero"], ["x0_q"]),
             helper.make_node("DequantizeLinear", ["x0_q", "scale", "zero"], ["x0"])]
    for index in range(depth):
        weight = rng.standard_normal((size, size, 1, 1)).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weight, f"w{index}"),
            numpy_helper.from_array(np.array(np.abs(weight).max() / 127, np.float32),
                                    f"w{index}_s"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", [f"w{index}", f"w{index}_s", "zero"],
                             [f"w{index}_q"]),
            helper.make_node("DequantizeLinear", [f"w{index}_q", f"w{index}_s", "zero"],
                             [f"w{index}_dq"]),
            helper.make_node("Conv", [f"x{index}", f"w{index}_dq"], [f"y{index}"]),
            helper.make_node("QuantizeLinear", [f"y{index}", "scale", "zero"], [f"y{index}_q"]),
            helper.make_node("DequantizeLinear", [f"y{index}_q", "scale", "zero"],
                             [f"x{index + 1}"]),
        ]
    graph = helper.make_graph(
        nodes,
        "int8_gemm_chain",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, size, *spatial])],
        [helper.make_tensor_value_info(f"x{depth}", TensorProto.FLOAT, [1, size, *spatial])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # make_model stamps the installed onnx's newest IR version, which an older ONNX Runtime
    # refuses (onnx 1.23 writes IR 14, ONNX Runtime 1.30 reads up to 13); opset 17 needs IR 8.
    model.ir_version = 8
    onnx.checker.check_model(model)
    session = create_session(model.SerializeToString(), threads=threads)
    a = rng.standard_normal((1, size, *spatial)).astype(np.float32)
    return (lambda: session.run(None, {"a": a})), depth * size**3


def run(config: PipelineBenchConfig) -> dict[str, Any]:
    import torch

    from models.checkpoints import load_example
    from models.data import load_digits_splits
    from pruning import count_macs_and_params
    from models.export import export_onnx
    from models.pipeline import BuildOptions, prune_and_finetune
    from models.quantize import Evaluator, QuantizeConfig, quantize_model
    from models.calibration import from_array
    from models.train import predict, top1_accuracy

    torch.set_num_threads(config.threads)
    if not keep_large_allocations():
        log.warning("not glibc: PyTorch's large blocks are mapped afresh on each pass, which can "
                    "slow the FP32 baseline")
    train_split, held_out = load_digits_splits(32)
    baseline = load_example(MODEL, threads=config.threads)
    example = torch.from_numpy(train_split.images[:2])

    log.info("pruning a copy at ratio %.2f", config.prune_ratio)
    options = BuildOptions(out_dir=Path("."), model=MODEL, prune_ratio=config.prune_ratio,
                           finetune_epochs=config.finetune_epochs, progress=False)
    speed_example = torch.zeros(1, 3, config.size, config.size)
    pruned, prune_report = prune_and_finetune(baseline, options, train_split, held_out, speed_example)

    variants: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="edge-agent-bench-") as scratch:
        for name, model in (("fp32", baseline), ("pruned_fp32", pruned)):
            exported = export_onnx(model, example)
            calibration = from_array(train_split.images, exported.input_name, config.calib_samples)
            evaluator = Evaluator({exported.input_name: held_out.images}, held_out.labels,
                                  threads=config.threads)
            quantized = quantize_model(
                exported.model_bytes,
                calibration,
                evaluator,
                QuantizeConfig(accuracy_budget=config.accuracy_budget,
                               reference_metric=_budget_reference(name, variants, evaluator,
                                                                  exported.model_bytes, config),
                               progress=False),
                Path(tempfile.mkdtemp(dir=scratch)),
            )
            int8_name = "int8" if name == "fp32" else "pruned_int8"
            speed_input = torch.zeros(1, 3, config.size, config.size)
            macs, params = count_macs_and_params(model, speed_input)
            variants[name] = {
                "runtime": "pytorch eager",
                "top1": top1_accuracy(predict(model, held_out.images), held_out.labels),
                "macs_per_image": macs,
                "params": params,
                "module": model,
            }
            variants[f"{name}_onnxruntime"] = {
                "runtime": "onnxruntime",
                "top1": quantized.float_metric,
                "macs_per_image": macs,
                "params": params,
                "onnx": exported.model_bytes,
            }
            variants[int8_name] = {
                "runtime": "onnxruntime",
                "top1": quantized.int8_metric,
                "macs_per_image": macs,
                "params": params,
                "onnx": quantized.model_bytes,
                "fp16_layers": quantized.fp16_layers,
            }

    results, matmul, steal = _measure(variants, config)
    summary = _summarise(results, variants, matmul, config, prune_report)
    summary["cpu_steal_fraction"] = steal
    return summary


def _budget_reference(name: str, variants: dict[str, dict[str, Any]], evaluator: Any,
                      model_bytes: bytes, config: PipelineBenchConfig) -> float | None:
    """The pruned model's budget counts from the unpruned FP32 top-1, so that ``top1_drop``
    (pruning and INT8 together) stays within it, as in ``edge-agent build``. Where pruning alone
    already lost more than the budget, a build stops; the benchmark measures on, holding INT8 to
    the budget from the pruned model, and its ``top1_drop`` shows the miss."""
    if name == "fp32":
        return None
    reference = float(variants["fp32"]["top1"])
    pruned = evaluator(model_bytes)
    if reference - pruned > config.accuracy_budget:
        log.warning("pruning alone lost %.2f points of top-1 (budget %.2f): INT8 is held to the "
                    "budget from the pruned model instead", reference - pruned,
                    config.accuracy_budget)
        return None
    return reference


def _measure(variants: dict[str, dict[str, Any]], config: PipelineBenchConfig):
    """Time every variant at every batch size, and the INT8 matmul reference, in interleaved
    rounds: on a shared (virtual) machine the speed drifts, and interleaving spreads the drift over
    every variant instead of penalising whichever ran at a bad moment. The roofline fraction is
    computed per round (model and matmul measured minutes apart would not be comparable) and the
    median over rounds is reported."""
    import torch

    from models.ort import create_session

    rng = np.random.default_rng(0)
    calls: dict[tuple[int, str], Callable[[], Any]] = {}
    for batch in config.batches:
        frames = rng.standard_normal((batch, 3, config.size, config.size)).astype(np.float32)
        tensor = torch.from_numpy(frames)
        for name, variant in variants.items():
            if "module" in variant:
                calls[(batch, name)] = _torch_call(variant["module"], tensor)
            else:
                session = create_session(variant["onnx"], threads=config.threads)
                calls[(batch, name)] = _session_call(session, frames)
    matmul, matmul_macs = int8_matmul(config.matmul_size, config.threads, config.matmul_depth)
    window_s = config.min_time_s / config.rounds
    latencies: dict[tuple[int, str], list[float]] = {key: [] for key in calls}
    matmul_latencies: list[float] = []
    roofline_rounds: dict[str, list[float]] = {"int8": [], "pruned_int8": []}
    counters, _ = cpu_steal_fraction()
    for round_index in range(config.rounds):
        round_matmul = time_call(matmul, window_s, config.min_runs)
        matmul_latencies += round_matmul
        matmul_rate = matmul_macs / statistics.median(round_matmul)
        for (batch, name), call in calls.items():
            measured = time_call(call, window_s, config.min_runs)
            latencies[(batch, name)] += measured
            if batch == max(config.batches) and name in roofline_rounds:
                rate = variants[name]["macs_per_image"] * batch / statistics.median(measured)
                roofline_rounds[name].append(rate / matmul_rate)
        log.info("round %d/%d done (INT8 matmul %.0f GMAC/s)", round_index + 1, config.rounds,
                 matmul_rate / 1e9)
    _, steal = cpu_steal_fraction(counters)
    results: dict[str, Any] = {}
    for (batch, name), measured in latencies.items():
        median = statistics.median(measured)
        results.setdefault(str(batch), {})[name] = {
            "img_s": batch / median,
            "latency_ms": median * 1e3,
            "best_img_s": batch / min(measured),
            "runs": len(measured),
            "macs_per_s": variants[name]["macs_per_image"] * batch / median,
        }
    matmul_summary = {
        "size": config.matmul_size,
        "depth": config.matmul_depth,
        "macs_per_s": matmul_macs / statistics.median(matmul_latencies),
        "roofline_rounds": roofline_rounds,
    }
    return results, matmul_summary, steal


def _torch_call(module: Any, tensor: Any) -> Callable[[], Any]:
    import torch

    def call() -> Any:
        with torch.no_grad():
            return module(tensor)

    return call


def _session_call(session: Any, frames: np.ndarray) -> Callable[[], Any]:
    return lambda: session.run(None, {"input": frames})


def _summarise(results: dict[str, Any], variants: dict[str, Any], matmul: dict[str, Any],
               config: PipelineBenchConfig, prune_report: dict[str, Any]) -> dict[str, Any]:
    batch8 = results[str(max(config.batches))]
    baseline = batch8["fp32"]["img_s"]
    summary: dict[str, Any] = {
        "config": {
            "model": "ResNet-18 (digits-trained), " f"{config.size}x{config.size}",
            "threads": config.threads,
            "rounds": config.rounds,
            "timing": "median latency over interleaved rounds; img/s = batch / median",
            "batches": list(config.batches),
            "prune_ratio": config.prune_ratio,
            "accuracy_budget": config.accuracy_budget,
            "top1_on": "digits held-out split (360 images) at 32x32",
        },
        "batch": max(config.batches),
        "baseline_img_s": baseline,
        "pruned_fp32_img_s": batch8["pruned_fp32"]["img_s"],
        "fp32_onnxruntime_img_s": batch8["fp32_onnxruntime"]["img_s"],
        "int8_img_s": batch8["int8"]["img_s"],
        "pruned_int8_img_s": batch8["pruned_int8"]["img_s"],
        "speedup_pruned_fp32": batch8["pruned_fp32"]["img_s"] / baseline,
        "speedup_int8": batch8["int8"]["img_s"] / baseline,
        "speedup_pruned_int8": batch8["pruned_int8"]["img_s"] / baseline,
        "fp32_top1": variants["fp32"]["top1"],
        "pruned_fp32_top1": variants["pruned_fp32"]["top1"],
        "int8_top1": variants["int8"]["top1"],
        "pruned_int8_top1": variants["pruned_int8"]["top1"],
        "top1_drop": variants["fp32"]["top1"] - variants["pruned_int8"]["top1"],
        "int8_matmul_gmacs_s": matmul["macs_per_s"] / 1e9,
        "baseline_gmacs_s": baseline * variants["fp32"]["macs_per_image"] / 1e9,
        # The INT8 speedup a model at the matmul's rate would get: what this CPU allows at all.
        "speedup_int8_ceiling": (matmul["macs_per_s"]
                                 / (baseline * variants["fp32"]["macs_per_image"])),
        "int8_kernels": int8_kernels(),
        "int8_gmacs_s": batch8["int8"]["macs_per_s"] / 1e9,
        "pruned_int8_gmacs_s": batch8["pruned_int8"]["macs_per_s"] / 1e9,
        # Median over rounds of (model MACs/s) / (matmul MACs/s), each pair measured together.
        "roofline_fraction": statistics.median(matmul["roofline_rounds"]["int8"]),
        "pruned_roofline_fraction": statistics.median(matmul["roofline_rounds"]["pruned_int8"]),
        "roofline_rounds": matmul["roofline_rounds"],
        "macs_per_image": variants["fp32"]["macs_per_image"],
        "pruned_macs_per_image": variants["pruned_fp32"]["macs_per_image"],
        "fp16_layers": {
            "int8": variants["int8"]["fp16_layers"],
            "pruned_int8": variants["pruned_int8"]["fp16_layers"],
        },
        "pruned_conv_widths": prune_report["layers"],
        "per_batch": results,
    }
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The result as a terminal table."""
    per_batch = summary["per_batch"]
    batches = sorted(per_batch, key=int)
    names = list(per_batch[batches[0]])
    top1 = {
        "fp32": summary["fp32_top1"],
        "pruned_fp32": summary["pruned_fp32_top1"],
        "int8": summary["int8_top1"],
        "pruned_int8": summary["pruned_int8_top1"],
    }
    header = f"{'variant':24s}" + "".join(f"{'img/s b' + b:>12s}{'x base':>8s}" for b in batches)
    lines = [summary["config"]["model"] + f", {summary['config']['threads']} threads", header]
    for name in names:
        cells = ""
        for batch in batches:
            img_s = per_batch[batch][name]["img_s"]
            cells += f"{img_s:12.1f}{img_s / per_batch[batch]['fp32']['img_s']:8.2f}"
        label = name.replace("_onnxruntime", " (onnxruntime)")
        accuracy = f"  top-1 {top1[name]:.2f}" if name in top1 else ""
        lines.append(f"{label:24s}{cells}{accuracy}")
    lines += [
        f"speedup_int8 {summary['speedup_int8']:.2f}  speedup_pruned_int8 "
        f"{summary['speedup_pruned_int8']:.2f}  top1_drop {summary['top1_drop']:.2f}",
        f"INT8 roofline: model {summary['int8_gmacs_s']:.0f} GMAC/s (pruned "
        f"{summary['pruned_int8_gmacs_s']:.0f}) / matmul {summary['int8_matmul_gmacs_s']:.0f} "
        f"GMAC/s = {summary['roofline_fraction']:.2f} (pruned {summary['pruned_roofline_fraction']:.2f})",
        f"PyTorch FP32 baseline {summary['baseline_gmacs_s']:.0f} GMAC/s: INT8 can be at most "
        f"{summary['speedup_int8_ceiling']:.2f}x faster on this CPU; INT8 kernels: "
        f"{summary['int8_kernels']}",
        f"CPU steal during timing: {100 * summary['cpu_steal_fraction']:.1f}% "
        "(time the hypervisor gave to other guests)",
    ]
    return "\n".join(lines)
