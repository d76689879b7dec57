"""Clusters a mode took offline, as a real kernel shows them: an inactive cpufreq policy answers
EBUSY to reads as well as writes (``show()`` in drivers/cpufreq/cpufreq.c), so its table cannot be
read when the board is opened in AGX Orin's default MODE_30W (cpu8-11 offline)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import power.io
from power.board import Board
from power.io import allowed_writes
from power.sim.commands import FakeCommands
from power.sim.kernel import FakeKernel
from power.sim.tree import FakeTree
from power.types import OperatingPoint
from tests.power_boards import fake_board

READ_BY_THE_BOARD = ("scaling_available_frequencies", "cpuinfo_min_freq", "cpuinfo_max_freq",
                     "scaling_min_freq", "scaling_max_freq", "scaling_cur_freq")


class BusyReads:
    """``os`` for ``power.io``, answering EBUSY to opens of an inactive policy's attributes as the
    kernel does; everything else goes to the real ``os``."""

    def __init__(self, root: Path, policies: list[str]) -> None:
        self.busy = {f"{root}/{policy}/{name}" for policy in policies
                     for name in READ_BY_THE_BOARD}

    def open(self, path: str, flags: int, *args: int) -> int:
        if path in self.busy:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        return os.open(path, flags, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)


def make_unreadable(monkeypatch: pytest.MonkeyPatch, tree: FakeTree, *policies: str) -> None:
    monkeypatch.setattr(power.io, "os", BusyReads(tree.root, list(policies)))


def test_an_inactive_cluster_does_not_cost_the_board_its_cpu_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6, mode_id=2)  # MODE_30W: cpu8-11 offline
    make_unreadable(monkeypatch, tree, tree.policies[2])
    kernel = FakeKernel(tree.root, 6)
    board = Board.open(tree.root, writer=kernel, runner=FakeCommands(tree.root, kernel))
    assert board.capabilities()["cpu"] is None
    assert board.clock_table().cpu_khz == board.profile.cpu_khz  # type: ignore[union-attr]
    result = board.apply(OperatingPoint(cpu_min_khz=729600, cpu_max_khz=1344000))
    assert result.ok and not result.unsupported, result
    for policy in tree.policies[:2]:
        assert tree.get(f"{policy}/scaling_max_freq") == "1344000"
    snapshot = board.snapshot()
    assert not any(path.startswith(tree.policies[2]) for path in snapshot["files"])
    assert board.restore(snapshot).ok
    # A privileged helper's rules cover the inactive cluster too (nvpmodel may bring it back).
    rules = allowed_writes(tree.root)
    assert rules[f"{tree.policies[2]}/scaling_max_freq"].check("1344000") is None


def test_a_board_whose_every_cluster_table_is_unreadable_has_no_cpu_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    make_unreadable(monkeypatch, tree, *tree.policies)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    assert board.capabilities()["cpu"] is not None
