"""SIMULATION: the baselines the power benchmark compares the governor with.

* :class:`MaxClocks` (``max``): what ``jetson_clocks`` does to the tree -- every CPU policy's and
  the GPU's minimum and maximum at the mode's top, EMC locked at its top rate, the GPU rail kept on
  (pinned clocks; the reference's MAXN idle figure is taken as such a board).
* :class:`StockGovernors` (``stock``): nothing: the board's own governors decide (podgov for the
  GPU, schedutil for the CPUs, EMC unlocked, rail gating on), as :mod:`power.sim.podgov` and
  :mod:`power.sim.cpugov` model them from their source.

Both follow :class:`power.sim.serving.Strategy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from power.io import FileWriter, Writer
from power.sim.board import SimBoard
from power.types import Completion, LoadSample


class MaxClocks:
    """``jetson_clocks``' effect on the tree: the writes it makes, in its order."""

    name = "max"

    def __init__(self, board: SimBoard, writer: Writer | None = None) -> None:
        self._board = board
        self._writer: Writer = writer if writer is not None else FileWriter(board.root)

    def start(self, now_s: float) -> None:
        board = self._board
        gpu = board.gpu_paths
        top_gpu = board._limits(gpu.freq_dir, "min_freq", "max_freq", gpu.table_hz)[1]
        self._writer.write(f"{gpu.freq_dir}/max_freq", str(top_gpu))
        self._writer.write(f"{gpu.freq_dir}/min_freq", str(top_gpu))
        for policy in board.paths.cpu:
            top_cpu = board._limits(policy.path, "scaling_min_freq", "scaling_max_freq",
                                    policy.table_khz)[1]
            self._writer.write(f"{policy.path}/scaling_max_freq", str(top_cpu))
            self._writer.write(f"{policy.path}/scaling_min_freq", str(top_cpu))
        emc = board.paths.emc
        if emc is not None:
            self._writer.write(f"{emc.path}/mrq_rate_locked", "1")
            self._writer.write(f"{emc.path}/rate", str(board._emc_unlocked_hz()))
        if gpu.railgate_file is not None:
            self._writer.write(gpu.railgate_file,
                               "on" if gpu.railgate_file.endswith("power/control") else "0")

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        pass

    def sleeping(self) -> bool:
        return False

    def wake(self, now_s: float) -> None:
        pass

    def stop(self, now_s: float) -> None:
        pass


class StockGovernors:
    """The board as it boots: its own governors decide (modelled in the simulator)."""

    name = "stock"

    def start(self, now_s: float) -> None:
        pass

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        pass

    def sleeping(self) -> bool:
        return False

    def wake(self, now_s: float) -> None:
        pass

    def stop(self, now_s: float) -> None:
        pass


__all__ = ["MaxClocks", "StockGovernors"]
