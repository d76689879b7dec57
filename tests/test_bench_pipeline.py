"""The pipeline benchmark end to end, at a small size (slow: it trains and prunes ResNet-18)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from agent.cli import main  # noqa: E402

REQUIRED_KEYS = (
    "baseline_img_s", "int8_img_s", "pruned_int8_img_s", "speedup_int8", "speedup_pruned_int8",
    "fp32_top1", "pruned_int8_top1", "top1_drop", "roofline_fraction",
)


@pytest.mark.slow
def test_bench_pipeline_writes_every_required_key(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "pipeline", "--json", str(out), "--size", "64", "--min-time", "0.3",
                 "--rounds", "1", "--finetune-epochs", "1"]) == 0
    summary = json.loads(out.read_text())
    for key in REQUIRED_KEYS:
        assert isinstance(summary[key], float), key
    assert summary["speedup_int8"] == pytest.approx(summary["int8_img_s"] / summary["baseline_img_s"])
    assert summary["top1_drop"] == pytest.approx(summary["fp32_top1"] - summary["pruned_int8_top1"])
    assert summary["pruned_macs_per_image"] < summary["macs_per_image"]
    assert set(summary["per_batch"]) == {"1", "8"}
    assert summary["baseline_gmacs_s"] == pytest.approx(
        summary["baseline_img_s"] * summary["macs_per_image"] / 1e9)
    assert summary["speedup_int8_ceiling"] == pytest.approx(
        summary["int8_matmul_gmacs_s"] / summary["baseline_gmacs_s"])
    assert summary["int8_kernels"].startswith(("exact U8U8", "default"))
    printed = capsys.readouterr().out
    assert "speedup_pruned_int8" in printed and "INT8 can be at most" in printed


@pytest.mark.parametrize("args, message", [
    (["--prune", "1.5"], "prune ratio must be in [0, 0.9]"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--size", "16"], "--size must be at least 32"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--min-time", "0"], "--min-time must be positive"),
])
def test_bad_settings_are_refused_before_any_work(args, message, capsys, monkeypatch):
    import models.checkpoints

    def no_training(*_args, **_kwargs):
        raise AssertionError("the checkpoint was loaded before the settings were checked")

    monkeypatch.setattr(models.checkpoints, "load_example", no_training)
    assert main(["bench", "pipeline", *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edge-agent: error:") and message in err[-1]


def test_int8_reference_multiplies_integers_in_a_chain() -> None:
    """The roofline's reference: ``depth`` chained INT8 matrix multiplies in ONNX Runtime, with
    the result of the chain equal to the float chain up to the quantization."""
    pytest.importorskip("onnxruntime")
    from models.bench_pipeline import int8_matmul

    call, macs = int8_matmul(64, threads=1, depth=3)
    assert macs == 3 * 64**3
    (out,) = call()
    assert out.shape == (1, 64, 32, 2)
    # Every value is a multiple of the output scale (0.05) within the INT8 range: the last
    # multiply's result was quantized, not passed through in float.
    steps = out / 0.05
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert -128 <= steps.min() and steps.max() <= 127


def touch_fresh_block(libc, size: int) -> int:  # type: ignore[no-untyped-def]
    """Minor page faults of allocating, filling and freeing ``size`` bytes with malloc()."""
    import ctypes
    import resource

    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_large_allocations_stay_on_the_heap() -> None:
    """After keep_large_allocations(), a freed 40 MB block is reused from the heap, where glibc's
    default maps it afresh (and faults on every page again) each time."""
    import ctypes
    import ctypes.util

    from models.timing import keep_large_allocations

    if not keep_large_allocations():
        pytest.skip("not glibc")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    touch_fresh_block(libc, 40 << 20)
    # 40 MB of fresh 4 KiB pages would be about 10,000 faults; the reused heap block needs none.
    assert touch_fresh_block(libc, 40 << 20) < 1000


@pytest.mark.parametrize(("field", "value", "key"), [
    ("min_time_s", float("inf"), "--min-time"), ("min_time_s", float("nan"), "--min-time"),
    ("size", 100_000, "--size")])
def test_settings_that_would_never_finish_are_refused(field: str, value: float, key: str) -> None:
    from agent.errors import ConfigError
    from models.bench_pipeline import PipelineBenchConfig

    with pytest.raises(ConfigError) as caught:
        PipelineBenchConfig(**{field: value})
    assert caught.value.fields["key"] == key
