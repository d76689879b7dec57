"""Smart sleep with a fake clock: the idle forecast and break-even rule, sleeping and waking
through the controller (low-power mode, engine release, wake latency, a wake command); the GPU's
rail-gate delay shortened between frames of a periodic load and given back (SIMULATION)."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agent.tooling.powerbench.strategies import OurGovernor
from power.controller import Controller
from power.io import read_int
from power.sim.board import SimBoard
from power.sim.kernel import FakeKernel
from power.sim.physics import LatencyNoise, physics_for
from power.sim.serving import ServingConfig, run_serving
from power.sim.traces import Trace, periodic
from power.sleep import (
    RAILGATE_SHORT_MS,
    IdleForecast,
    RailgatePlanner,
    SleepDepth,
    SleepPlanner,
    default_depth,
)
from power.types import Completion, LoadSample, PowerPolicy, PowerState
from tests.power_boards import fake_board
from tests.power_doubles import FakeClock, StrictBoard, serve


def quiet(controller: Controller, clock: FakeClock, seconds: float, arrivals: int) -> None:
    """Step the controller through ``seconds`` with no request."""
    for _ in range(round(seconds / 0.05)):
        clock.advance(0.05)
        controller.step(LoadSample(time_s=clock.now_s, queue_depth=0, busy_instances=0,
                                   instances=1, arrivals_total=arrivals, completed_total=arrivals))


def test_the_forecast_is_the_median_of_past_gaps_longer_than_the_idle_so_far() -> None:
    forecast = IdleForecast()
    assert forecast.expected_remaining_s(3.0) == float("inf")  # no history: assume it lasts
    for gap in (2.0, 4.0, 20.0, 30.0, 1.0):
        forecast.record(gap)
    assert forecast.expected_remaining_s(3.0) == pytest.approx(20.0 - 3.0)
    assert forecast.expected_remaining_s(25.0) == pytest.approx(5.0)
    # Longer than every gap seen: as long again.
    assert forecast.expected_remaining_s(40.0) == pytest.approx(40.0)


def test_sleep_needs_the_idle_time_and_a_forecast_past_break_even() -> None:
    depth = SleepDepth(name="sleeping", saved_mw=500.0, transition_mj=5000.0, wake_s=0.02)
    assert depth.break_even_s == pytest.approx(10.0)
    planner = SleepPlanner(sleep_after_s=5.0, depth=depth)
    assert not planner.should_sleep(4.9)
    assert planner.should_sleep(5.0)  # nothing known: sleep
    for _ in range(10):
        planner.forecast.record(8.0)  # gaps end 3 s after the sleep would start
    assert not planner.should_sleep(5.0)
    for _ in range(30):
        planner.forecast.record(60.0)
    assert planner.should_sleep(5.0)
    assert SleepDepth(name="x", saved_mw=0.0, transition_mj=1.0, wake_s=0.0).break_even_s \
        == float("inf")


def test_releasing_the_engine_raises_the_break_even() -> None:
    kept = default_depth(idle_mw=5500.0, sleep_mw=4500.0, engine_reload_s=2.0,
                         release_engine=False)
    released = default_depth(idle_mw=5500.0, sleep_mw=4500.0, engine_reload_s=2.0,
                             release_engine=True)
    assert released.break_even_s > 10 * kept.break_even_s
    assert released.wake_s > kept.wake_s


def test_idle_then_sleep_then_wake_restores_mode_engine_and_clocks() -> None:
    clock = FakeClock()
    board = StrictBoard(clock=clock)
    engine: list[bool] = []
    policy = PowerPolicy(idle_after_s=1.0, sleep_after_s=3.0, sleep_nvpmodel_mode=3,
                         release_engine_in_sleep=True)
    controller = Controller(board, policy, clock=clock, on_engine=engine.append,
                            engine_reload_s=0.1)
    controller.start()
    start = clock.now_s
    serve(controller, board, clock, [start + 0.1 + 0.05 * i for i in range(20)],
          until_s=start + 1.5)
    quiet(controller, clock, 1.0, arrivals=20)
    assert controller.state is PowerState.IDLE
    assert board.point.nvpmodel_mode == 1  # idle keeps the mode
    quiet(controller, clock, 2.5, arrivals=20)
    assert controller.state is PowerState.SLEEPING
    assert board.point.nvpmodel_mode == 3
    assert (board.point.gpu_max_hz, board.point.emc_hz) == (306000000, 204000000)
    assert board.point.gpu_railgate is True
    assert engine == [False]
    controller.wake(reason="mqtt")  # a wake command: no request needed
    assert controller.state is PowerState.ACTIVE
    assert board.point.nvpmodel_mode == 1
    assert engine == [False, True]
    assert board.point.gpu_max_hz == 1020000000  # after sleep: the top point
    controller.stop()
    assert board.point == board.original


def test_short_idle_gaps_keep_it_from_sleeping_when_the_engine_would_be_released() -> None:
    clock = FakeClock()
    board = StrictBoard(clock=clock)
    policy = PowerPolicy(idle_after_s=0.5, sleep_after_s=2.0, release_engine_in_sleep=True)
    released: list[bool] = []
    controller = Controller(board, policy, clock=clock, on_engine=released.append,
                            engine_reload_s=2.0)
    controller.start()
    states = set()
    arrivals = 0
    for _ in range(12):  # busy, then ~4 s of nothing, again and again
        start = clock.now_s
        result = serve(controller, board, clock, [start + 0.05 * i for i in range(1, 6)],
                       until_s=start + 0.5)
        arrivals += len(result.latencies_s)
        for _ in range(80):
            clock.advance(0.05)
            decision = controller.step(LoadSample(
                time_s=clock.now_s, queue_depth=0, busy_instances=0, instances=1,
                arrivals_total=arrivals, completed_total=arrivals))
            states.add(decision.state)
        controller.wake()
    # The first gap (nothing known) may sleep; once the gaps are known to be short, no more.
    assert released.count(False) <= 1
    assert PowerState.IDLE in states


def test_the_wake_latency_of_the_first_request_is_measured_and_exported() -> None:
    clock = FakeClock()
    board = StrictBoard(clock=clock)
    controller = Controller(board, PowerPolicy(idle_after_s=0.5, sleep_after_s=1.0), clock=clock)
    controller.start()
    start = clock.now_s
    serve(controller, board, clock, [start + 0.1 + 0.05 * i for i in range(30)],
          until_s=start + 2.0)
    quiet(controller, clock, 3.0, arrivals=30)
    assert controller.state is PowerState.SLEEPING
    start = clock.now_s
    result = serve(controller, board, clock, [start + 0.01], until_s=start + 0.2)
    assert result.points[0][1].gpu_max_hz == 1020000000  # the first request: the top point
    # Once it is answered, the point sized for the last busy period (20 req/s) takes over.
    after = [d for d in result.decisions if d.reason == "after the wake"]
    assert after and (after[0].point.gpu_max_hz or 0) < 1020000000
    status = controller.status()
    assert status["state"] == "active"
    assert status["wake_ms"] is not None and 0.0 <= status["wake_ms"] < 50.0
    assert status["wake_call_ms"] is not None


def test_the_railgate_planner_wants_long_gaps_with_hysteresis() -> None:
    planner = RailgatePlanner()
    need = planner.need_s
    assert need == pytest.approx(0.010 + 0.004 + 0.004 * 2000.0 / 780.0)

    def batches(gap_s: float, count: int, start_s: float) -> list[Completion]:
        out, now = [], start_s
        for _ in range(count):
            now += gap_s + 0.030
            out.append(Completion(time_s=now, total_s=0.031, compute_s=0.030))
        return out

    planner.observe(batches(0.170, 7, 0.0))
    assert planner.gap_quantile_s() is None  # 6 gaps: too few to judge
    assert not planner.wants_short(short_now=False) and planner.wants_short(short_now=True)
    planner.observe(batches(0.170, 10, 2.0))
    assert planner.wants_short(short_now=False)
    # Gaps between the need and twice it: kept short, not entered.
    planner.observe(batches(1.5 * need, 16, 5.0))
    assert planner.wants_short(short_now=True) and not planner.wants_short(short_now=False)
    # Back to back (continuous load): not even kept.
    planner.observe(batches(0.0, 16, 9.0))
    assert planner.gap_quantile_s() == 0.0 and not planner.wants_short(short_now=True)


class RefusingKernel(FakeKernel):
    """The simulator's kernel, where the rail-gate delay file refuses every write: ``EACCES``
    (root-only, the agent a user) or ``EINVAL`` (a kernel that takes no delay this short); the
    attempts are counted."""

    def __init__(self, root: Path, jetpack: int, *, error: int) -> None:
        super().__init__(root, jetpack)
        self.error = error
        self.delay_attempts: list[str] = []

    def write(self, relpath: str, value: str) -> None:
        if relpath.endswith("/railgate_delay"):
            self.delay_attempts.append(value)
            raise OSError(self.error, os.strerror(self.error), str(self.root / relpath))
        super().write(relpath, value)


def _delay_over_a_trace(tmp_path: Path, trace: Trace,
                        kernel_for: Callable[[Path], FakeKernel] | None = None
                        ) -> tuple[list[tuple[float, int]], str]:
    """Serve ``trace`` on the simulated Orin Nano under the production controller; the rail-gate
    delay file (ms) at every step, and the file after the stop. At every step the controller
    takes the delay as short exactly when the file holds the short one. ``kernel_for``: the
    kernel over the tree's root (default: the simulator's own)."""
    tree = fake_board(tmp_path, "orin-nano", 6, mode_id=2)
    kernel = FakeKernel(tree.root, 6) if kernel_for is None else kernel_for(tree.root)
    board = SimBoard(root=tree.root, physics=physics_for("orin-nano-super"), kernel=kernel)
    ours = OurGovernor(board, PowerPolicy(latency_target_s=0.050), kernel)
    delay = f"{tree.gpu_device_dir}/railgate_delay"
    seen: list[tuple[float, int]] = []
    step = ours.step

    def recording(load: LoadSample, completions: Sequence[Completion]) -> None:
        step(load, completions)
        ms = read_int(tree.root, delay)
        seen.append((load.time_s, ms))
        assert ours.controller.railgate_short == (ms == RAILGATE_SHORT_MS), load.time_s

    ours.step = recording  # type: ignore[method-assign]
    run_serving(board, trace, ours, config=ServingConfig(), noise=LatencyNoise(board.physics, 3))
    return seen, tree.get(delay)


def test_the_controller_gates_the_gpu_between_frames_and_gives_it_back_under_continuous_load(
        tmp_path: Path) -> None:
    frames = periodic(duration_s=10.0, seed=2).arrivals_s
    rng = random.Random(5)
    flood, now = [], 10.0
    while now < 16.0:  # ~80 req/s: batches close behind each other
        now += rng.expovariate(80.0)
        flood.append(now)
    trace = Trace(name="mixed", description="5 Hz, then near capacity",
                  arrivals_s=(*frames, *flood), duration_s=16.0)
    seen, after = _delay_over_a_trace(tmp_path, trace)
    short = [time_s for time_s, ms in seen if ms == RAILGATE_SHORT_MS]
    assert short and short[0] < 5.0  # shortened within a few seconds of frames
    assert all(ms == RAILGATE_SHORT_MS for time_s, ms in seen if 6.0 <= time_s < 10.0)
    assert all(ms == 500 for time_s, ms in seen if time_s >= 13.0)  # given back under the flood
    assert after == "500"  # and the board's own after the stop


def test_a_target_without_room_for_the_unrailgate_keeps_the_delay(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6, mode_id=2)
    kernel = FakeKernel(tree.root, 6)
    board = SimBoard(root=tree.root, physics=physics_for("orin-nano-super"), kernel=kernel)
    # A 10 ms target: the job takes 8 ms at the top clocks, no room for a 4 ms unrailgate.
    ours = OurGovernor(board, PowerPolicy(latency_target_s=0.010), kernel)
    run_serving(board, periodic(duration_s=8.0, seed=2), ours, config=ServingConfig(),
                noise=LatencyNoise(board.physics, 3))
    assert all(path != f"{tree.gpu_device_dir}/railgate_delay" for path, _ in kernel.log)



@pytest.mark.parametrize("error", [errno.EACCES, errno.EINVAL])
def test_a_delay_the_board_refuses_is_never_taken_as_short(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, error: int) -> None:
    """A read-only delay file (the control degrades: asked once) or one that refuses the value
    (asked again after each hold): 5 Hz frames want the short delay, the board keeps its own,
    and the controller believes the board, not what it asked for."""
    kernels: list[RefusingKernel] = []

    def refusing(root: Path) -> FakeKernel:
        kernels.append(RefusingKernel(root, 6, error=error))
        return kernels[-1]

    with caplog.at_level("WARNING", logger="power.controller"):
        seen, after = _delay_over_a_trace(tmp_path, periodic(duration_s=12.0, seed=2),
                                          kernel_for=refusing)
    attempts = kernels[0].delay_attempts
    assert attempts and set(attempts) == {str(RAILGATE_SHORT_MS)}
    if error == errno.EACCES:
        assert len(attempts) == 1  # degraded: not asked again
    else:
        assert len(attempts) >= 3  # 12 s of frames, a try every 2 s once the gaps are known
    assert seen and all(ms == 500 for _, ms in seen) and after == "500"
    warned = [r.getMessage() for r in caplog.records if "rail-gate delay" in r.getMessage()]
    assert len(warned) == 1 and "not in force (it reads 500 ms)" in warned[0]
