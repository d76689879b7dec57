"""``edge-agent bench fleet`` end to end with a handful of agents: the production broker
configuration with a password per device over TLS, the file server as its own process, the
operator's rollout driver, the broker killed mid-rollout, and a bad bundle stopped at its canary
stage. Times are the benchmark's figures, not asserted here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent.cli import main

pytest.importorskip("onnxruntime")
pytest.importorskip("paho.mqtt")
if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
    pytest.skip("mosquitto is not installed", allow_module_level=True)


def test_bench_fleet_runs_every_phase_and_writes_its_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.json"
    code = main(["bench", "fleet", "--agents", "5", "--json", str(out), "--timeout", "120",
                 "--agents-per-process", "2", "--work-dir", str(tmp_path / "work")])
    summary = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert code == 0, printed
    for key in ("agents", "converge_s", "converge_s_with_broker_restart", "lost",
                "bad_bundle_reached", "bad_bundle_reverted_s"):
        assert key in summary and key in printed
    assert summary["agents"] == 5 and summary["lost"] == 0
    assert len(list((tmp_path / "work" / "workers").glob("*.json"))) == 3  # 2 + 2 + 1
    phases = summary["phases"]
    for name in ("converge", "converge_with_broker_restart"):
        assert phases[name]["converged"] == 5 and phases[name]["rollout_state"] == "completed"
    assert phases["converge_with_broker_restart"]["broker"]["converged_before_kill"] < 5
    bad = phases["bad_bundle"]
    assert bad["reached"] == bad["given"] == 3 and bad["serving_bad"] == 0
    assert bad["rollout_state"] in ("aborted", "rolled_back")
    assert bad["abort"]["cause"] == "failure_share"
    # Each agent kept a real store: the healthy version before the bad one is current.
    for agent in (tmp_path / "work" / "agents").iterdir():
        assert json.loads((agent / "current").read_text())["current"]["version"] == 3


def test_bench_fleet_refuses_too_few_agents(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fleet", "--agents", "2"]) != 0
    assert "--agents" in capsys.readouterr().err
