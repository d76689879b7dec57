"""Smart sleep with a fake clock: the idle forecast and break-even rule, sleeping and waking
through the controller (low-power mode, engine release, wake latency, a wake command)."""

from __future__ import annotations

import pytest

from power.controller import Controller
from power.sleep import IdleForecast, SleepDepth, SleepPlanner, default_depth
from power.types import LoadSample, PowerPolicy, PowerState
from tests.power_doubles import FakeClock, StrictBoard, serve


def quiet(controller: Controller, clock: FakeClock, seconds: float, arrivals: int) -> None:
    """Step the controller through ``seconds`` with no request."""
    for _ in range(int(round(seconds / 0.05))):
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
