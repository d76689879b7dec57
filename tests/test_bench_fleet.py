"""``edge-agent bench fleet`` end to end with 5 agents: a fleet workspace, the production broker
configuration on a real Mosquitto (killed and restarted in phase 2), the file server, fleet
deploy's engine, and agents that really download, verify, install and load each version. The
figures' values are the machine's; what is checked is that they are there, sane, and that the
agents' own stores and journals agree with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import main
from agent.tooling.fleetbench.bundles import non_finite_classifier_bytes
from agent.tooling.swapbench.onnx_writer import classifier_bytes

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("paho.mqtt")

from agent.tooling.fleetbench.broker import mosquitto_binary  # noqa: E402
from agent.errors import FleetError  # noqa: E402

try:
    mosquitto_binary()
except FleetError:
    pytest.skip("mosquitto is not installed", allow_module_level=True)


def test_the_misbehaving_classifier_gives_nan_on_the_warm_up_batch_and_the_healthy_one_not(
) -> None:
    zeros = np.zeros((4, 3, 16, 16), dtype=np.float32)
    healthy = ort.InferenceSession(classifier_bytes(), providers=["CPUExecutionProvider"])
    bad = ort.InferenceSession(non_finite_classifier_bytes(), providers=["CPUExecutionProvider"])
    assert np.isfinite(healthy.run(None, {"input": zeros})[0]).all()
    out = bad.run(None, {"input": zeros})[0]
    assert out.shape == (4, 10) and np.isnan(out).all()


def test_bench_fleet_converges_survives_a_broker_kill_and_stops_the_bad_version(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.store import ModelStore
    from models.signing import load_public_key

    out, work = tmp_path / "fleet.json", tmp_path / "work"
    status = main(["bench", "fleet", "--agents", "5", "--json", str(out), "--work-dir",
                   str(work), "--phase-timeout", "90"])
    summary = json.loads(out.read_text())
    printed = capsys.readouterr().out
    for key in ("agents", "converge_s", "converge_s_with_broker_restart", "lost",
                "bad_bundle_reached", "bad_bundle_reverted_s", "memory", "targets"):
        assert key in summary, key
    assert summary["agents"] == 5 and summary["lost"] == 0, summary["lost_agents"]
    assert 0 < summary["converge_s"] < 90
    assert 0 < summary["converge_s_with_broker_restart"] < 90
    restart = summary["phases"]["broker_restart"]["broker_restart"]
    assert restart["killed"] and restart["down_s"] >= 2.0
    assert 2 <= restart["converged_at_kill"] < 5
    if restart["rollout_running_at_kill"]:
        # The broker lost what it had not saved; the deploy's driver republished every
        # device's desired document after it came back (and before it ended the rollout).
        phase = summary["phases"]["broker_restart"]
        assert phase["rollout_state"] == "completed", phase
        assert summary["retained_desired_after_restart"]["naming_version"] == 5, (
            summary["retained_desired_after_restart"], phase)
    # The canary of 3 took the NaN version, its warm-up refused it, nobody served it, the
    # rollout aborted before a second stage and brought the 3 back.
    bad = summary["phases"]["misbehaving"]
    assert summary["bad_bundle_reached"] == 3 and len(bad["reached"]) == 3
    assert summary["bad_bundle_served"] == 0
    assert sorted(summary["agents_truth"]["refused_bad_at_warmup"]) == sorted(bad["reached"])
    assert bad["rollout_state"] == "aborted" and bad["abort"]["cause"] == "failure_share"
    assert bad["everyone_on_good_version"] and summary["bad_bundle_reverted_s"] > 0
    # Every agent applied 2 then 3, each once.
    assert summary["agents_truth"]["committed_versions"] == {"2,3": 5}
    assert summary["memory"]["agents_peak_rss_mib"] > 0
    # The agents' own stores say the same: version 3 current, 2 before it, 4 not kept.
    key = load_public_key(work / "bundles" / "release.key.pub")
    for state_dir in sorted((work / "agents").iterdir()):
        with ModelStore(state_dir, trusted_keys=[key]) as store:
            current, previous = store.current(), store.previous()
            assert current is not None and current.version == 3, state_dir
            assert previous is not None and previous.version == 2, state_dir
            assert 4 not in store.versions("tiny"), state_dir
    assert "converge_s_with_broker_restart" in printed and "lightweight" in printed
    assert status in (0, 1)  # 1: a target missed on a loaded machine; the figures are the test


def test_more_agents_than_one_process_can_watch_are_refused_with_the_reason() -> None:
    from agent.errors import ConfigError
    from agent.tooling.fleetbench.bench import FleetBenchOptions

    assert FleetBenchOptions(agents=300).process_count() == 3
    assert FleetBenchOptions(agents=5).process_count() == 1
    with pytest.raises(ConfigError, match="select"):
        FleetBenchOptions(agents=300, processes=1)
