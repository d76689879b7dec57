"""``edge-agent bench power --quick`` end to end (SIMULATION), and its report and plot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.tooling.powerbench.report import TARGETS, check_targets, format_targets
from agent.tooling.powerbench.runner import STRATEGIES, TRACES

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_KEYS = {
    "energy_saving_vs_max", "energy_saving_vs_max_periodic", "energy_saving_vs_max_saturated",
    "energy_saving_vs_podgov", "slo_attainment", "max_consecutive_misses", "wake_ms",
    "sleep_power_fraction", "clock_changes_per_s", "calibration_max_power_error",
    "calibration_max_latency_error",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                                  dict[str, Any], Path, float]:
    out = tmp_path_factory.mktemp("powerbench") / "power.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "agent", "bench", "power", "--quick", "--seed", "1", "--json",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
        check=False)
    wall_s = time.monotonic() - start
    assert out.is_file(), completed.stdout + completed.stderr
    return completed, json.loads(out.read_text()), out, wall_s


def test_quick_bench_writes_every_key_and_is_quick(quick_run: Any) -> None:
    completed, summary, _, wall_s = quick_run
    assert REQUIRED_KEYS <= set(summary)
    assert summary["simulation"] is True and summary["board"] == "orin-nano-super"
    assert set(summary["traces"]) == set(TRACES)
    # 20 s on an idle machine; the shared 2-core box gets slack.
    assert wall_s < 60, wall_s
    assert "SIMULATION" in completed.stdout
    # The exit status says whether every target was met.
    assert completed.returncode == (0 if summary["targets_met"] else 1), completed.stderr


def test_quick_bench_figures_are_sane(quick_run: Any) -> None:
    _, summary, _, _ = quick_run
    for trace, by_strategy in summary["traces"].items():
        expected = set(STRATEGIES) if summary["ours_unavailable"] is None \
            else set(STRATEGIES) - {"ours"}
        assert set(by_strategy) == expected, trace
        for name, entry in by_strategy.items():
            assert entry["requests"] == entry["arrivals"] > 0, (trace, name)
            assert entry["energy_per_inference_mj"] > 0
            assert 0 < entry["p50_ms"] <= entry["p99_ms"] <= entry["max_ms"]
            assert 0 <= entry["slo_attainment"] <= 1
            # Every board draws between the stripped floor and well under the module's limit.
            assert 2000 < entry["avg_power_mw"] < 25000
    traces = summary["traces"]
    # Pinned clocks: fastest at light load, and the most energy per inference there.
    assert traces["periodic"]["max"]["p50_ms"] < traces["periodic"]["stock"]["p50_ms"]
    assert traces["periodic"]["max"]["energy_per_inference_mj"] > \
        traces["periodic"]["stock"]["energy_per_inference_mj"]
    # Max clocks meet the target near saturation by construction of the trace's rate.
    assert traces["saturated"]["max"]["p99_ms"] <= summary["latency_target_ms"]
    assert traces["daily"]["max"]["wake_ms"], "the daily trace has wake probes"
    assert summary["idle_power_at_max_mw"] > 8000  # the pinned idle anchor (9.1 W)
    assert summary["calibration_max_power_error"] <= 0.10
    assert summary["calibration_max_latency_error"] <= 0.15
    if summary["ours_unavailable"] is None:
        assert summary["sleep_power_fraction"] is not None
        assert summary["energy_saving_vs_max"] is not None
        ours = traces["daily"]["ours"]
        # The production controller ran: it moved the clocks and went to sleep in the idle gaps
        # (the batcher's wake hook was called), which neither baseline does.
        assert ours["wakes"] > 0 and ours["clock_changes_per_s"] > 0
        assert traces["daily"]["max"]["wakes"] == traces["daily"]["stock"]["wakes"] == 0


def test_the_targets_table_lists_every_target_with_its_verdict(quick_run: Any) -> None:
    completed, summary, _, _ = quick_run
    for target in TARGETS:
        assert target.key in completed.stdout
        assert summary["targets"][target.key] == target.met(summary[target.key])
    assert "calibration of the simulator" in completed.stdout


def test_the_plot_is_a_png_or_says_why_it_was_skipped(quick_run: Any) -> None:
    completed, summary, out, _ = quick_run
    plot = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:
        assert summary["plot"] is None and "matplotlib" in summary["plot_skipped"]
        assert "plot skipped" in completed.stdout
        return
    assert summary["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    from agent.tooling.powerbench.plot import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    reason = write_plot([], tmp_path / "x.png", target_ms=50.0)
    assert reason is not None and "matplotlib" in reason
    assert not (tmp_path / "x.png").exists()


def test_a_missing_figure_is_a_missed_target() -> None:
    summary = {target.key: None for target in TARGETS}
    summary.update(energy_saving_vs_max=0.5, wake_ms=20.0)
    targets = check_targets(summary)
    assert targets["energy_saving_vs_max"] is True
    assert targets["wake_ms"] is False
    assert targets["slo_attainment"] is None and summary["targets_met"] is False
    table = "\n".join(format_targets(summary))
    assert "MISSED (no figure)" in table and "SIMULATION" in table


def test_the_ceiling_grid_and_its_trace_names() -> None:
    from agent.errors import ConfigError
    from agent.tooling.powerbench.runner import parse_traces, static_points

    assert parse_traces("periodic, saturated") == ("periodic", "saturated")
    assert parse_traces("") == ()
    with pytest.raises(ConfigError, match="unknown trace"):
        parse_traces("periodic,hourly")
    points = static_points("orin-nano-super")
    assert len(points) == len(set(points)) > 10
    assert all(p.gpu_min_hz == p.gpu_max_hz and p.cpu_min_khz == p.cpu_max_khz for p in points)
    assert {p.gpu_max_hz for p in points} >= {306000000, 1020000000}
    assert min(p.cpu_min_khz or 0 for p in points) == 729600  # nvpmodel's floor, not 115 MHz
