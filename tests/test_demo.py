"""``edge-agent demo`` end to end (slow: it builds the example bundle with torch first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_demo_builds_serves_and_reports(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "agent", "demo", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "accuracy" in out and "latency" in out
    assert "same predictions: True" in out
    assert 'edge_agent_requests_total{model="resnet18-digits",outcome="success"}' in out
    assert "daemon stopped cleanly" in out
    assert list(tmp_path.glob("resnet18-digits-*.bundle"))
