"""``edge-agent demo`` end to end (slow: it builds the example bundle with torch first)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.demo import expected_accuracy

ACCURACY = {"metric": "top1", "int8": 98.889, "int8_onnxruntime_served": 98.333}


def test_the_demo_compares_with_the_figure_for_the_backend_that_served() -> None:
    assert expected_accuracy({"accuracy": ACCURACY}, "onnxruntime") == (
        "; the bundle's report: 98.33% as ONNX Runtime serves it, 98.89% for the model TensorRT "
        "runs (QDQ, measured on this host)")
    assert expected_accuracy({"accuracy": ACCURACY}, "tensorrt") == "; the bundle's report: 98.89%"
    # Older bundles lack the served figure; ONNX-only builds report agreement, not top-1.
    assert expected_accuracy({"accuracy": {"metric": "top1", "int8": 97.5}},
                             "onnxruntime") == "; the bundle's report: 97.50%"
    assert expected_accuracy({"accuracy": {**ACCURACY, "metric": "agreement"}}, "tensorrt") == ""
    assert expected_accuracy({}, "tensorrt") == ""


@pytest.mark.slow
def test_demo_builds_serves_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, "-m", "agent", "demo", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "accuracy" in out and "latency" in out
    # The daemon's answers score exactly what the bundle's report says ONNX Runtime serves.
    served = re.search(r"= ([0-9.]+)% .*the bundle's report: ([0-9.]+)% as ONNX Runtime", out)
    assert served and served.group(1) == served.group(2), out
    assert "same predictions: True" in out
    assert 'edge_agent_requests_total{model="resnet18-digits",outcome="success"}' in out
    assert "daemon stopped cleanly" in out
    assert list(tmp_path.glob("resnet18-digits-*.bundle"))
