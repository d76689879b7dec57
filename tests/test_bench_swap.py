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
    # The load alone in the gap before each swap, a baseline in the swaps' own minutes.
    assert summary["phases"]["quiet_gaps"]["requests"] > 0
    assert summary["p99_swap_over_quiet"] == pytest.approx(
        summary["phases"]["during_swaps"]["p99_ms"] / summary["phases"]["quiet_gaps"]["p99_ms"])
    assert "over the quiet gaps" in printed
    tail = summary["tail_by_swap"]
    assert tail["requests"] == sum(entry["requests"] for entry in tail["swaps"]) > 0
    assert {entry["swap"] for entry in tail["swaps"]} <= {1, 2}
    assert "slowest 1 % during swaps" in printed
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
    # Where in a swap the requests waited: each state the updater went through, from its
    # journal, with the requests that overlapped it.
    states = summary["swap_states"]
    for state in ("downloading", "verifying", "staged", "building-engine", "warming", "canary",
                  "committed"):
        assert state in states, sorted(states)
        assert states[state]["seconds"] > 0
    assert states["canary"]["requests"] > 0 and "swap state" in printed
    assert status in (0, 1)  # 1: a target missed on a loaded machine; the figures are the test


def test_the_states_of_a_swap_come_from_the_journals_history_on_the_benchs_clock() -> None:
    from agent.tooling.swapbench import bench
    from agent.tooling.swapbench.load import Record

    def at(perf_s: float) -> str:
        import datetime

        moment = datetime.datetime.fromtimestamp(perf_s + bench._WALL_MINUS_PERF,
                                                 tz=datetime.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"

    def event(frm: str, to: str, perf_s: float) -> dict[str, object]:
        return {"at": at(perf_s), "from": frm, "to": to}

    history = [event("idle", "downloading", 5.0),  # an earlier swap's: outside this one
               event("idle", "downloading", 100.0), event("downloading", "verifying", 100.2),
               event("verifying", "verifying", 100.25),  # a note, not a transition
               event("verifying", "canary", 100.4), event("canary", "committed", 101.0),
               event("committed", "idle", 103.0)]  # the watch window, after the answer
    spans = bench._swap_states(history, 100.0, 101.1)
    assert [name for name, _, _ in spans] == ["downloading", "verifying", "canary", "committed"]
    for (_, start, end), (want_start, want_end) in zip(
            spans, [(100.0, 100.2), (100.2, 100.4), (100.4, 101.0), (101.0, 101.1)]):
        assert start == pytest.approx(want_start, abs=0.002)
        assert end == pytest.approx(want_end, abs=0.002)
    records = [Record(100.05, 100.06, 2, "ok", False), Record(100.19, 100.21, 2, "ok", False),
               Record(100.5, 100.51, 2, "ok", False)]
    found = bench._by_state(records, spans, steady_p99_ms=5.0)
    assert found["downloading"]["requests"] == 2 and found["verifying"]["requests"] == 1
    assert found["canary"]["requests"] == 1 and found["committed"]["requests"] == 0
    assert found["verifying"]["p99_ms"] == pytest.approx(20.0, rel=1e-6)
    assert found["verifying"]["p99_over_steady"] == pytest.approx(4.0, rel=1e-6)


def test_the_tail_by_swap_names_the_swaps_holding_the_slowest_requests_and_their_gaps() -> None:
    from agent.tooling.swapbench.bench import _tail_by_swap, _tail_line
    from agent.tooling.swapbench.load import Record

    def requests(start: float, end: float, latency: float, count: int) -> list[Record]:
        step = (end - start - latency) / count
        return [Record(start + i * step, start + i * step + latency, 1, "ok", False)
                for i in range(count)]

    swaps = [(10.0, 10.1), (20.0, 20.1), (30.0, 30.1)]
    gaps = [(9.4, 9.9), (19.4, 19.9), (29.4, 29.9)]
    # Swaps 1 and 3 are as fast as their gaps; swap 2's requests are slow, and so was its gap.
    during = (requests(10.0, 10.1, 0.001, 100) + requests(20.0, 20.1, 0.005, 100)
              + requests(30.0, 30.1, 0.001, 100))
    quiet = (requests(9.4, 9.9, 0.001, 200) + requests(19.4, 19.9, 0.004, 200)
             + requests(29.4, 29.9, 0.001, 200))
    tail = _tail_by_swap(during, quiet, swaps, gaps, quiet_p99_ms=2.0)
    assert [entry["swap"] for entry in tail["swaps"]] == [2]
    assert tail["requests"] == tail["swaps"][0]["requests"] >= 3
    assert tail["swaps"][0]["gap_p99_ms"] == pytest.approx(4.0)
    assert tail["swaps"][0]["gap_p99_over_quiet"] == pytest.approx(2.0)
    assert "swap 2:" in _tail_line(tail) and "2.00x" in _tail_line(tail)
    assert _tail_by_swap([], quiet, swaps, gaps, 2.0) == {"requests": 0, "swaps": []}


def test_sent_after_apply_bins_the_requests_by_when_they_were_sent() -> None:
    """A request sent in a swap's first 50 ms is slow, the rest are not: the first bin's P50 is
    twice the gaps', the later ones as the gaps', and a request sent just before the apply
    counts in none (not a target; swap_states would count it wherever it overlapped)."""
    from agent.tooling.swapbench.bench import _sent_after_apply, _sent_line
    from agent.tooling.swapbench.load import Record

    swaps = [(10.0, 10.3), (20.0, 20.3)]
    records = []
    for start, _ in swaps:
        for offset_ms in range(0, 200, 5):  # sent 2.5 ms into each 5 ms, clear of the edges
            sent = start + (offset_ms + 2.5) / 1000
            latency = 0.004 if offset_ms < 50 else 0.002
            records.append(Record(sent, sent + latency, 1, "ok", False))
        records.append(Record(start - 0.001, start + 0.030, 1, "ok", False))  # before it
    bins = _sent_after_apply(records, swaps, quiet_p50_ms=2.0)
    assert [(entry["from_ms"], entry["to_ms"]) for entry in bins] == [
        (0, 50), (50, 100), (100, 150), (150, 200)]
    assert [entry["requests"] for entry in bins] == [20, 20, 20, 20]
    assert bins[0]["p50_over_quiet"] == pytest.approx(2.0)
    assert [entry["p50_over_quiet"] for entry in bins[1:]] == pytest.approx([1.0, 1.0, 1.0])
    assert "0-50 ms 2.00x" in _sent_line(bins)
