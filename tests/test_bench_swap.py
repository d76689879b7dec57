"""``edge-agent bench swap`` end to end with tiny numbers: a daemon process of its own, swaps
under load, the two misbehaving versions and a short soak; and the benchmark's hand-written ONNX
classifier against the onnx package's reading of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import main
from agent.tooling.swapbench.onnx_writer import classifier_bytes

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("httptools")


def test_the_hand_written_classifier_is_valid_onnx_and_its_faults_do_what_they_say() -> None:
    onnx = pytest.importorskip("onnx")
    frames = np.abs(np.random.default_rng(0).normal(size=(6, 3, 16, 16))).astype(np.float32)
    logits = {}
    for fault in (None, "disagree", "nan_on_negative"):
        model = classifier_bytes(fault=fault)
        onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        logits[fault] = (session.run(None, {"input": frames})[0],
                         session.run(None, {"input": -frames})[0])
    healthy, disagree, nan = logits[None], logits["disagree"], logits["nan_on_negative"]
    assert healthy[0].shape == (6, 10) and np.isfinite(healthy[0]).all()
    assert np.isfinite(healthy[1]).all()
    np.testing.assert_array_equal(disagree[0], -healthy[0])
    np.testing.assert_array_equal(nan[0], healthy[0])  # passes a canary fed positive frames
    assert np.isnan(nan[1]).all()


def test_bench_swap_runs_every_phase_and_writes_its_figures(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    out = tmp_path / "swap.json"
    status = main(["bench", "swap", "--json", str(out), "--swaps", "2", "--soak", "8",
                   "--soak-warmup", "2", "--capacity-time", "0.5", "--steady-time", "1",
                   "--watch-window", "0.5", "--gap", "0.1"])
    summary = json.loads(out.read_text())
    printed = capsys.readouterr().out
    for key in ("swaps", "failed_requests", "p99_swap_over_steady", "rollback_s", "soak_swaps",
                "soak_rss_growth_mib"):
        assert key in summary, key
    assert summary["swaps"] == 2 and summary["soak_swaps"] == 8, summary["swap_failures"]
    assert summary["failed_requests"] == 0, summary["failures_by_kind"]
    assert summary["phases"]["steady"]["requests"] > 0
    assert summary["phases"]["during_swaps"]["requests"] > 0
    # The disagreeing version never answered; the NaN-after-commit one did, and was rolled
    # back by the watch window to the version before it.
    canary = summary["canary_reject"]
    assert (canary["state"], canary["reason"]) == ("failed", "disagreement")
    assert canary["answers_by_refused_version"] == 0
    watch = summary["watch_rollback"]
    assert watch["committed"] and watch["reason"] == "non_finite"
    assert watch["serving_after"] == watch["previous_version"] == 3
    assert watch["nan_answers"] > 0 and 0 < summary["rollback_s"] < 30
    # Nothing a swap makes is left behind: threads, open files, downloaded bundles. (A thread
    # leaked per swap would add 6 here; the daemon's executor may still start one meanwhile.)
    soak = summary["soak"]
    assert summary["soak_thread_growth"] <= 1, soak
    assert summary["soak_fd_growth"] <= 0, soak
    assert soak["state_dir_files"] <= soak["state_dir_files_before"], soak
    assert "p99/steady" in printed and "rollback" in printed
    assert status in (0, 1)  # 1: a target missed on a loaded machine; the figures are the test
