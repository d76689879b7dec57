"""The three ways the power benchmark runs a simulated board's clocks (SIMULATION).

* ``max`` and ``stock``: :mod:`power.sim.baselines` (``jetson_clocks``' effect on the tree; the
  board's own governors as the simulator models them).
* ``ours``: the production controller (``power/controller.py``) over the production board layer
  (``power/board.py``), exactly as the daemon builds them, stepped with the serving path's load.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.errors import PowerError
from power.sim.baselines import MaxClocks, StockGovernors
from power.sim.board import SimBoard
from power.types import Completion, LoadSample, PowerPolicy, PowerState


def _clock_for(board: SimBoard) -> Any:
    return lambda: board.now_s


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
    simulator's tree, on the simulation's clock."""

    name = "ours"

    def __init__(self, board: SimBoard, policy: PowerPolicy, state_dir: Path) -> None:
        reason = ours_available()
        if reason is not None:
            raise PowerError("the governor under test is not available", reason=reason)
        board_module = importlib.import_module("power.board")
        controller_module = importlib.import_module("power.controller")
        self._sim = board
        self._board = _open_board(board_module, board.root, state_dir)
        self._controller = _make_controller(controller_module, self._board, policy,
                                            clock=_clock_for(board), state_dir=state_dir)

    def start(self, now_s: float) -> None:
        self._controller.start()

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        self._controller.step(load, list(completions))

    def sleeping(self) -> bool:
        state = getattr(self._controller, "state", None)
        return state == PowerState.SLEEPING

    def wake(self, now_s: float) -> None:
        self._controller.wake()

    def stop(self, now_s: float) -> None:
        self._controller.stop()


def _accepts(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _open_board(module: Any, root: Path, state_dir: Path) -> Any:
    board_class = module.Board
    opener = getattr(board_class, "open", board_class)
    kwargs: dict[str, Any] = {}
    if _accepts(opener, "runner"):
        commands = importlib.import_module("power.sim.commands")
        factory = getattr(commands, "fake_runner", None) or getattr(commands, "FakeRunner")
        kwargs["runner"] = factory(root) if callable(factory) else factory
    if _accepts(opener, "writer"):
        try:
            kernel = importlib.import_module("power.sim.kernel")
            kwargs["writer"] = kernel.FakeKernel(root)
        except (ImportError, AttributeError, TypeError):
            pass
    return opener(root, **kwargs)


def _make_controller(module: Any, board: Any, policy: PowerPolicy, *, clock: Any,
                     state_dir: Path) -> Any:
    controller_class = module.Controller
    kwargs: dict[str, Any] = {}
    for name, value in (("policy", policy), ("clock", clock), ("state_dir", state_dir),
                        ("snapshot_path", state_dir / "power-snapshot.json")):
        if _accepts(controller_class, name):
            kwargs[name] = value
    return controller_class(board, **kwargs)


__all__ = ["MaxClocks", "OurGovernor", "StockGovernors", "ours_available"]
