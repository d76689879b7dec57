"""SIMULATION: the baselines the power benchmark compares the governor with.

* :class:`MaxClocks` (``max``): ``jetson_clocks`` on the tree -- every CPU policy's and the GPU's
  minimum and maximum at the mode's top, EMC locked at its top rate -- and the GPU rail kept on
  (pinned clocks; the reference's MAXN idle figure is taken as such a board).
* :class:`StockGovernors` (``stock``): nothing: the board's own governors decide (podgov for the
  GPU, schedutil for the CPUs, EMC unlocked, rail gating on), as :mod:`power.sim.podgov` and
  :mod:`power.sim.cpugov` model them from their source.

* :class:`PinnedPoint`: one operating point for a whole trace (the static reference of
  ``bench power --ceiling``).

All follow :class:`power.sim.serving.Strategy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.errors import PowerError
from power.io import FileWriter, Writer
from power.jetson_clocks import JetsonClocks
from power.sim.board import SimBoard
from power.sim.commands import FakeCommands
from power.types import Completion, LoadSample, OperatingPoint


class _Static:
    """A baseline that only sets the board up at the start: it neither steps, sleeps, wakes nor
    puts anything back (the next run writes a fresh tree)."""

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        pass

    def sleeping(self) -> bool:
        return False

    def wake(self, now_s: float) -> None:
        pass

    def stop(self, now_s: float) -> None:
        pass


class MaxClocks(_Static):
    """``jetson_clocks`` run on the tree (the board layer's
    :class:`~power.jetson_clocks.JetsonClocks` through the strict fake command of
    ``power/sim/commands.py``), then the GPU rail kept on.

    Keeping the rail on is our assumption, not a documented effect of ``jetson_clocks``: it is
    what makes the simulated pinned idle the reference's 9.1 W MAXN idle figure (taken as
    pinned); with the rail allowed to gate, the pinned board would idle near 6.3 W instead.
    """

    name = "max"

    def __init__(self, board: SimBoard, writer: Writer | None = None, *,
                 keep_rail_on: bool = True) -> None:
        self._board = board
        self._writer: Writer = writer if writer is not None else FileWriter(board.root)
        self._keep_rail_on = keep_rail_on

    def start(self, now_s: float) -> None:
        JetsonClocks(FakeCommands(self._board.root, self._writer)).pin()
        railgate = self._board.gpu_paths.railgate_file
        if railgate is not None and self._keep_rail_on:
            self._writer.write(railgate, "on" if railgate.endswith("power/control") else "0")


class PinnedPoint(_Static):
    """One operating point pinned for a whole trace through the board layer
    (:meth:`power.board.Board.apply`): the static reference the benchmark's ``--ceiling`` searches
    for the cheapest point that meets the target."""

    name = "pinned"

    def __init__(self, board: SimBoard, writer: Writer, point: OperatingPoint) -> None:
        self._board = board
        self._writer = writer
        self.point = point

    def start(self, now_s: float) -> None:
        from power.board import Board

        root = self._board.root
        result = Board.open(root, writer=self._writer,
                            runner=FakeCommands(root, self._writer)).apply(self.point)
        if not result.ok:
            raise PowerError("a pinned point did not read back as written",
                             mismatches=", ".join(m.path for m in result.mismatches))


class StockGovernors(_Static):
    """The board as it boots: its own governors decide (modelled in the simulator)."""

    name = "stock"

    def start(self, now_s: float) -> None:
        pass


__all__ = ["MaxClocks", "PinnedPoint", "StockGovernors"]
