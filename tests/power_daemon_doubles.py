"""Doubles for the daemon's power tests, at the seams the daemon does not own: a board over a fake
board tree (``power/sim/tree.py``) that reads and writes the real files through the one writer
(``power/io.py``), and a controller that keeps the power states of ``power/types.py`` strictly.

They stand in for ``power/board.py`` and ``power/controller.py`` (other helpers' modules): the
daemon, the service, the batcher and the files are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from agent.errors import InternalError, PowerError
from power.io import FileWriter, read_int
from power.sim.tree import FakeTree
from power.types import (
    TRANSITIONS,
    ApplyResult,
    ClockTable,
    Completion,
    LoadSample,
    Mismatch,
    OperatingPoint,
    PowerPolicy,
    PowerState,
    Telemetry,
    ThermalZone,
)


class TreeBoard:
    """GPU min/max and every CPU policy's max over a fake tree's files (a BoardControl)."""

    def __init__(self, tree: FakeTree) -> None:
        self.tree = tree
        self.root = tree.root
        self.writer = FileWriter(tree.root)
        self.gpu = tree.gpu_freq_dir
        self.policies = tree.policies
        self.threads: set[int] = set()  # where its files were touched: never the event loop's

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def clock_table(self) -> ClockTable:
        return ClockTable(gpu_hz=self.tree.board.gpu_hz, cpu_khz=self.tree.board.cpu_khz)

    def read_point(self) -> OperatingPoint:
        self._touch()
        return OperatingPoint(
            gpu_min_hz=read_int(self.root, f"{self.gpu}/min_freq"),
            gpu_max_hz=read_int(self.root, f"{self.gpu}/max_freq"),
            cpu_max_khz=read_int(self.root, f"{self.policies[0]}/scaling_max_freq"))

    def apply(self, point: OperatingPoint) -> ApplyResult:
        self._touch()
        table = self.clock_table()
        writes: list[tuple[str, int]] = []
        for value, allowed, name in ((point.gpu_min_hz, table.gpu_hz, "min_freq"),
                                     (point.gpu_max_hz, table.gpu_hz, "max_freq")):
            if value is not None:
                if value not in allowed:
                    raise PowerError("not in the GPU's table", value=value)
                writes.append((f"{self.gpu}/{name}", value))
        if point.cpu_max_khz is not None:
            if point.cpu_max_khz not in table.cpu_khz:
                raise PowerError("not in the CPU's table", value=point.cpu_max_khz)
            writes += [(f"{policy}/scaling_max_freq", point.cpu_max_khz)
                       for policy in self.policies]
        # The order every kernel accepts: floor the minimum, set the maximum, then the minimum.
        current_min = read_int(self.root, f"{self.gpu}/min_freq")
        floor = min(table.gpu_hz)
        if point.gpu_min_hz is not None and current_min != floor:
            self.writer.write(f"{self.gpu}/min_freq", str(floor))
        writes.sort(key=lambda item: not item[0].endswith("max_freq"))
        mismatches = []
        for path, value in writes:
            self.writer.write(path, str(value))
            found = read_int(self.root, path)
            if found != value:
                mismatches.append(Mismatch(path=path, wanted=value, found=found))
        return ApplyResult(applied=self.read_point(), mismatches=tuple(mismatches),
                           writes=len(writes))

    def telemetry(self) -> Telemetry:
        self._touch()
        zones = tuple(ThermalZone(name=name.split("-")[0].lower(),
                                  temp_c=read_int(self.root, f"{path}/temp") / 1000.0)
                      for name, path in self.tree.zones.items()
                      if name not in self.tree.unreadable_zones)
        return Telemetry(time_s=time.monotonic(),
                         gpu_freq_hz=read_int(self.root, f"{self.gpu}/cur_freq"),
                         cpu_freq_khz=tuple(read_int(self.root, f"{p}/scaling_cur_freq")
                                            for p in self.policies),
                         thermal=zones, rails_mw={"VDD_IN": 5000, "VDD_CPU_GPU_CV": 1500},
                         total_power_mw=5000)

    def snapshot(self) -> dict[str, Any]:
        return self.read_point().to_json()

    def restore(self, snapshot: dict[str, Any]) -> ApplyResult:
        return self.apply(OperatingPoint(**snapshot))

    def capabilities(self) -> dict[str, str | None]:
        return {"gpu": None, "cpu": None, "emc": "not in this double", "railgate": "not in this "
                "double", "nvpmodel": "not in this double", "thermal": None, "rails": None,
                "fan": "not in this double"}


class StrictController:
    """The power states of design section 6 over a board: idle after ``idle_after_s`` without
    an arrival, a queued or a computing request, sleeping (the lowest clocks) after
    ``sleep_after_s`` more, waking (the highest) on :meth:`wake`, active on the next step.
    Every call must come from the thread that started it; every transition must be in
    ``TRANSITIONS``."""

    def __init__(self, board: TreeBoard, policy: PowerPolicy, saved: Any, *,
                 wake_delay_s: float = 0.0) -> None:
        self.saved = saved  # a power.saved.SavedSnapshot: what a crash must not lose
        self.snapshot: dict[str, Any] | None = None
        self.board = board
        self.policy = policy
        self.wake_delay_s = wake_delay_s
        self.state = PowerState.ACTIVE
        self.thread: int | None = None
        self.events: list[tuple[str, float]] = []
        self.steps = 0
        self.completions: list[Completion] = []
        self.woken = threading.Event()
        self.stopped = False
        self._last_arrivals = 0
        self._last_arrival_s = time.monotonic()
        self._idle_since = 0.0
        self.point = OperatingPoint()

    def _check_thread(self) -> None:
        if self.thread != threading.get_ident():
            raise InternalError("the controller was called from another thread")

    def _go(self, state: PowerState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise InternalError(f"{self.state.value} -> {state.value} is not a transition")
        self.state = state
        self.events.append((state.value, time.monotonic()))

    def _apply(self, gpu_hz: int) -> None:
        result = self.board.apply(OperatingPoint(gpu_min_hz=gpu_hz, gpu_max_hz=gpu_hz))
        self.point = result.applied

    def start(self) -> None:
        self.thread = threading.get_ident()
        self.events.append(("start", time.monotonic()))
        left_over = self.saved.load()
        if left_over is not None:  # the last run died: its original limits first
            self.board.restore(left_over)
            self.events.append(("restored left-over", time.monotonic()))
            self.snapshot = left_over
        else:
            self.snapshot = self.board.snapshot()
            self.saved.save(self.snapshot)
        self._apply(self.board.clock_table().gpu_hz[-1])

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> None:
        self._check_thread()
        if self.stopped:
            raise InternalError("stepped after stop")
        self.steps += 1
        self.completions.extend(completions)
        now = load.time_s
        # Activity: a new arrival, a request queued, or one computing (a board computing is
        # not idle, however long its batch takes on a loaded machine).
        if (load.arrivals_total != self._last_arrivals or load.queue_depth
                or load.busy_instances):
            self._last_arrivals = load.arrivals_total
            self._last_arrival_s = now
            if self.state is PowerState.IDLE:
                self._go(PowerState.ACTIVE)
        if self.state is PowerState.WAKING:
            self._go(PowerState.ACTIVE)
        quiet_s = now - self._last_arrival_s
        if self.state is PowerState.ACTIVE and quiet_s >= self.policy.idle_after_s:
            self._go(PowerState.IDLE)
            self._idle_since = now
        elif (self.state is PowerState.IDLE
              and now - self._idle_since >= self.policy.sleep_after_s - self.policy.idle_after_s):
            self._go(PowerState.SLEEPING)
            self._apply(self.board.clock_table().gpu_hz[0])

    def needs_wake(self) -> bool:
        return self.state in (PowerState.IDLE, PowerState.SLEEPING)

    def wake(self, reason: str = "request") -> None:
        self._check_thread()
        if self.state is PowerState.SLEEPING:
            self._go(PowerState.WAKING)
            time.sleep(self.wake_delay_s)  # the clock change's delay
            self._apply(self.board.clock_table().gpu_hz[-1])
        elif self.state is PowerState.IDLE:
            self._go(PowerState.ACTIVE)
        self._last_arrival_s = time.monotonic()
        self.events.append(("woken", time.monotonic()))
        self.woken.set()

    def set_policy(self, policy: PowerPolicy) -> None:
        self._check_thread()
        self.policy = policy
        self.events.append((f"policy {policy.profile}", time.monotonic()))

    def status(self) -> dict[str, Any]:
        return {"state": self.state.value, "point": self.point.to_json(), "steps": self.steps}

    def stop(self) -> ApplyResult | None:
        self._check_thread()
        self.stopped = True
        assert self.snapshot is not None
        result = self.board.restore(self.snapshot)
        self.saved.clear()
        self.events.append(("stop", time.monotonic()))
        return result
