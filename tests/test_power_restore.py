"""The board's settings come back on a clean stop and, after a run killed with SIGKILL, at the
next start (a real subprocess governs a fake board tree and is killed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board
from power.saved import SavedSnapshot, begin, end
from power.sim.kernel import FakeKernel
from power.types import OperatingPoint
from tests.power_boards import fake_board

REPO = Path(__file__).resolve().parents[1]

GOVERNOR = """
import sys, time
from pathlib import Path
from power.board import Board
from power.saved import SavedSnapshot, begin
from power.sim.kernel import FakeKernel
from power.types import OperatingPoint
root, jetpack = Path(sys.argv[1]), int(sys.argv[3])
board = Board.open(root, writer=FakeKernel(root, jetpack))
begin(board, SavedSnapshot(Path(sys.argv[2])))
table = board.clock_table()
result = board.apply(OperatingPoint(gpu_min_hz=table.gpu_hz[-1], gpu_max_hz=table.gpu_hz[-1],
                                    cpu_min_khz=table.cpu_khz[-1], cpu_max_khz=table.cpu_khz[-1],
                                    emc_hz=table.emc_hz[-1], gpu_railgate=False,
                                    gpu_railgate_delay_ms=10))
assert result.ok, result
print("governing", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("name", "jetpack"), [("orin-nano", 6), ("xavier-nx", 4)])
def test_after_sigkill_the_next_start_restores_the_board(tmp_path: Path, name: str,
                                                         jetpack: int) -> None:
    tree = fake_board(tmp_path, name, jetpack)
    original = Board.open(tree.root, writer=FakeKernel(tree.root, jetpack)).snapshot()
    saved_path = tmp_path / "state" / "power-snapshot.json"
    process = subprocess.Popen(
        [sys.executable, "-c", GOVERNOR, str(tree.root), str(saved_path), str(jetpack)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip() == "governing", process.stderr.read() if process.stderr else ""
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()

    board = Board.open(tree.root, writer=FakeKernel(tree.root, jetpack))
    assert board.snapshot() != original  # the killed run left its clocks pinned, EMC locked
    assert tree.get("sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked") == "1"
    assert json.loads(saved_path.read_text())["snapshot"] == original
    delay = f"{tree.gpu_device_dir}/railgate_delay"
    assert tree.get(delay) == "10" and original["files"][delay] == "500"  # ms

    result = begin(board, SavedSnapshot(saved_path))
    assert result is not None and result.ok
    assert board.snapshot() == original
    assert tree.get("sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked") == "0"
    assert tree.get(delay) == "500"
    assert json.loads(saved_path.read_text())["snapshot"] == original  # saved afresh

    end(board, SavedSnapshot(saved_path))
    assert not saved_path.exists()


def test_a_clean_run_restores_on_stop_and_leaves_nothing(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 7)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 7))
    saved = SavedSnapshot(tmp_path / "snap.json")
    original = board.snapshot()
    assert begin(board, saved) is None  # nothing left by an earlier run
    assert (os.stat(saved.path).st_mode & 0o777) == 0o600
    board.apply(OperatingPoint(gpu_min_hz=1300500000, gpu_max_hz=1300500000, emc_hz=204000000))
    result = end(board, saved)
    assert result is not None and result.ok
    assert board.snapshot() == original and not saved.path.exists()
    assert end(board, saved) is None


def test_a_restore_that_fails_keeps_the_file_for_the_next_start(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    saved = SavedSnapshot(tmp_path / "snap.json")
    begin(board, saved)
    board.apply(OperatingPoint(gpu_max_hz=510000000))
    locked = FakeKernel(tree.root, 6, read_only=frozenset({f"{tree.gpu_freq_dir}/max_freq"}))
    with pytest.raises(PowerError, match="could not restore"):
        begin(Board.open(tree.root, writer=locked), saved)
    assert saved.path.exists()
    assert begin(Board.open(tree.root, writer=FakeKernel(tree.root, 6)), saved) is not None


def test_a_damaged_file_is_a_clear_error(tmp_path: Path) -> None:
    saved = SavedSnapshot(tmp_path / "snap.json")
    saved.path.write_text("{not json")
    with pytest.raises(PowerError, match="not readable") as caught:
        saved.load()
    assert str(saved.path) in str(caught.value)
    # Moved aside, so it fails this start only: the next finds no copy and saves afresh.
    damaged = saved.path.with_name("snap.json.damaged")
    assert damaged.read_text() == "{not json" and str(damaged) in str(caught.value)
    assert saved.load() is None
