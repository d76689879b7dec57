"""The three ways the power benchmark runs a simulated board's clocks (SIMULATION).

* ``max`` and ``stock``: :mod:`power.sim.baselines` (``jetson_clocks``' effect on the tree; the
  board's own governors as the simulator models them).
* ``ours``: the production controller (``power/controller.py``) over the production board layer
  (``power/board.py``), exactly as the daemon builds them, stepped with the serving path's load.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from agent.errors import PowerError
from power.io import Writer
from power.sim.baselines import MaxClocks, StockGovernors
from power.sim.board import SimBoard
from power.types import Completion, LoadSample, PowerPolicy


def ours_available() -> str | None:
    """``None`` when the production controller and board layer can be imported, else why not."""
    for module in ("power.controller", "power.board"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is not importable ({exc})"
    return None


class OurGovernor:
    """The production controller over the production :class:`~power.board.Board`, opened on the
    simulator's tree (writes through the fake kernel's rules, commands through the strict fake
    runners), on the simulation's clock."""

    name = "ours"

    def __init__(self, board: SimBoard, policy: PowerPolicy, writer: Writer) -> None:
        reason = ours_available()
        if reason is not None:
            raise PowerError("the governor under test is not available", reason=reason)
        from power.board import Board
        from power.controller import Controller, MemoryStore
        from power.sim.commands import FakeCommands

        self._board = Board.open(board.root, writer=writer,
                                 runner=FakeCommands(board.root, writer))
        self.controller = Controller(self._board, policy, clock=lambda: board.now_s,
                                     saved=MemoryStore())

    def start(self, now_s: float) -> None:
        self.controller.start()

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        self.controller.step(load, completions)

    def sleeping(self) -> bool:
        return bool(self.controller.needs_wake())

    def wake(self, now_s: float) -> None:
        self.controller.wake()

    def stop(self, now_s: float) -> None:
        self.controller.stop()


__all__ = ["MaxClocks", "OurGovernor", "StockGovernors", "ours_available"]
