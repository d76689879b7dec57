"""The power controller over a strict board double: snapshot and restore (also after a crash),
profiles, the power states, the wake hook, telemetry cadence and the status document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board
from power.controller import Controller, MemoryStore
from power.saved import SavedSnapshot
from power.sim.commands import FakeCommands
from power.sim.kernel import FakeKernel
from power.sim.tree import FakeTree
from power.types import TRANSITIONS, LoadSample, Mismatch, PowerPolicy, PowerState
from tests.power_boards import fake_board
from tests.power_doubles import FakeClock, StrictBoard, serve


def load(clock: FakeClock, *, arrivals: int = 0, queue: int = 0, busy: int = 0) -> LoadSample:
    return LoadSample(time_s=clock.now_s, queue_depth=queue, busy_instances=busy, instances=1,
                      arrivals_total=arrivals, completed_total=0)


def started(policy: PowerPolicy | None = None, **board_options: object
            ) -> tuple[Controller, StrictBoard, FakeClock, MemoryStore]:
    clock = FakeClock()
    board = StrictBoard(clock=clock, **board_options)  # type: ignore[arg-type]
    store = MemoryStore()
    controller = Controller(board, policy or PowerPolicy(), clock=clock, saved=store)
    controller.start()
    return controller, board, clock, store


def test_start_saves_the_original_limits_and_stop_puts_them_back() -> None:
    controller, board, _, store = started()
    original = board.original
    assert store.snapshot == {"point": original.to_json(), "emc_locked": False}
    assert board.point != original  # the governed profile pinned the clocks
    controller.stop()
    assert board.point == original
    assert store.snapshot is None
    assert controller.stop() is None  # a second stop writes nothing
    assert len(board.restores) == 1


def test_a_snapshot_left_by_a_crash_is_restored_at_start_and_kept_as_the_original() -> None:
    clock = FakeClock()
    board = StrictBoard(clock=clock)
    crashed = {"point": board.original.to_json(), "emc_locked": False}
    # The crashed run left its own pinned clocks on the board.
    board.apply(board.original.__class__(gpu_min_hz=1020000000, gpu_max_hz=1020000000))
    store = MemoryStore(crashed)
    controller = Controller(board, PowerPolicy(), clock=clock, saved=store)
    controller.start()
    assert board.restores == [crashed]
    assert store.snapshot == crashed  # still saved: this run may crash too
    controller.stop()
    assert board.point == board.original


def test_profiles_pin_the_top_or_bottom_point_or_hand_back_to_the_board() -> None:
    controller, board, clock, _ = started(PowerPolicy(profile="max"))
    assert (board.point.gpu_min_hz, board.point.gpu_max_hz) == (1020000000, 1020000000)
    assert board.point.emc_hz == 3199000000
    controller.set_policy(PowerPolicy(profile="min"))
    assert (board.point.gpu_max_hz, board.point.cpu_max_khz, board.point.emc_hz) == (
        306000000, 115200, 204000000)
    controller.set_policy(PowerPolicy(profile="stock"))
    assert board.point == board.original
    writes = len(board.writes)
    for _ in range(40):
        clock.advance(0.05)
        controller.step(load(clock, arrivals=1, busy=1))
    assert len(board.writes) == writes  # stock: nothing written while stepping
    assert not controller.needs_wake()


def test_unknown_profile_and_bad_target_are_refused_naming_the_key() -> None:
    clock = FakeClock()
    with pytest.raises(PowerError, match="unknown power profile") as caught:
        Controller(StrictBoard(), PowerPolicy(profile="turbo"), clock=clock)
    assert caught.value.fields["key"] == "power.profile"
    with pytest.raises(PowerError) as caught:
        Controller(StrictBoard(), PowerPolicy(latency_target_s=0.0), clock=clock)
    assert caught.value.fields["key"] == "power.latency_target_s"


def test_step_before_start_is_an_error() -> None:
    clock = FakeClock()
    controller = Controller(StrictBoard(), PowerPolicy(), clock=clock)
    with pytest.raises(PowerError, match="before start"):
        controller.step(load(clock))


def test_idle_parks_the_clocks_and_the_wake_hook_boosts_before_dispatch() -> None:
    policy = PowerPolicy(idle_after_s=0.5, sleep_after_s=100.0)
    controller, board, clock, _ = started(policy)
    arrivals = [clock.now_s + 0.1 + 0.05 * i for i in range(40)]
    result = serve(controller, board, clock, arrivals, until_s=clock.now_s + 3.0)
    active_point = next(point for _, point in reversed(result.points))
    # Idle: the lowest clocks and rail-gating allowed.
    assert controller.state is PowerState.IDLE
    assert (board.point.gpu_max_hz, board.point.cpu_max_khz, board.point.emc_hz) == (
        306000000, 115200, 204000000)
    assert board.point.gpu_railgate is True
    assert controller.needs_wake()
    controller.wake()
    assert controller.state is PowerState.ACTIVE
    # Back to a point sized for the load just seen: the one the governor held, or a table
    # step from it (the model's choice for the peak rate), never the parked one.
    gpu = board.table.gpu_hz
    assert abs(gpu.index(board.point.gpu_max_hz or 0)
               - gpu.index(active_point.gpu_max_hz or 0)) <= 1
    assert (board.point.gpu_max_hz, board.point.emc_hz) != (306000000, 204000000)
    assert not controller.needs_wake()
    assert controller.wake_call_ms and controller.wake_call_ms[-1] < 5.0


def test_an_arrival_without_the_hook_wakes_at_the_next_step() -> None:
    controller, board, clock, _ = started(PowerPolicy(idle_after_s=0.2))
    for _ in range(10):
        clock.advance(0.05)
        controller.step(load(clock))
    assert controller.state is PowerState.IDLE
    clock.advance(0.05)
    decision = controller.step(load(clock, arrivals=1, queue=1))
    assert decision.state is PowerState.ACTIVE
    assert board.point.gpu_max_hz == 1020000000  # nothing learned yet: the top point


def test_telemetry_is_read_at_its_own_cadence_not_every_step() -> None:
    controller, board, clock, _ = started()
    for _ in range(100):  # 5 s of steps
        clock.advance(0.05)
        controller.step(load(clock, arrivals=0, busy=1))
    assert 4 <= board.telemetry_reads <= 6


def test_thermal_margin_caps_the_gpu_and_lifts_the_cap_with_hysteresis() -> None:
    policy = PowerPolicy(thermal_margin_c=5.0)
    controller, board, clock, _ = started(policy, temp_c=92.0)  # 3 C under the 95 C trip
    start = clock.now_s
    heavy = [start + 0.007 * i for i in range(1, 1400)]  # ~140 req/s: needs high clocks
    hot = serve(controller, board, clock, heavy, until_s=start + 10.0)
    cap = controller.status()["thermal_cap"]
    assert cap is not None and cap["gpu_max_hz"] < 1020000000
    # One table step down per telemetry reading (1 s): at the bottom after ~8 readings.
    late = [point.gpu_max_hz or 0 for time_s, point in hot.points if time_s > start + 8.5]
    assert late and max(late) <= cap["gpu_max_hz"]
    board.temp_c = 60.0  # cooled: 35 C of margin, past the hysteresis
    start = clock.now_s
    cool = serve(controller, board, clock, [start + 0.007 * i for i in range(1, 1400)],
                 until_s=start + 10.0)
    assert controller.status()["thermal_cap"] is None
    late = [point.gpu_max_hz or 0 for time_s, point in cool.points if time_s > start + 6.0]
    assert max(late) > cap["gpu_max_hz"]


def test_status_is_json_and_names_state_point_decisions_and_step_cost() -> None:
    controller, board, clock, _ = started()
    serve(controller, board, clock, [clock.now_s + 0.1 * i for i in range(1, 20)],
          until_s=clock.now_s + 2.0)
    status = json.loads(json.dumps(controller.status()))
    assert status["state"] in {state.value for state in PowerState}
    assert status["point"]["gpu_max_hz"] in board.table.gpu_hz
    assert status["decisions"] and status["step_cpu_ms"]["mean"] >= 0
    assert status["steps"] == controller.steps > 0


def test_every_state_change_follows_the_transition_table() -> None:
    controller, board, clock, _ = started(PowerPolicy(idle_after_s=0.3, sleep_after_s=1.0))
    seen = [controller.state]
    arrivals = [clock.now_s + 0.1] + [clock.now_s + 5.0 + 0.05 * i for i in range(10)]
    result = serve(controller, board, clock, arrivals, until_s=clock.now_s + 8.0)
    for decision in result.decisions:
        if decision.state is not seen[-1]:
            seen.append(decision.state)
    for before, after in zip(seen, seen[1:]):
        assert after in TRANSITIONS[before] or (before, after) == (
            PowerState.SLEEPING, PowerState.ACTIVE)  # through WAKING inside one wake()
    assert PowerState.SLEEPING in seen and PowerState.IDLE in seen


# -- over the real board layer on a fake tree ----------------------------------------------

def real_board(tmp_path: Path, jetpack: int = 6) -> tuple[Board, FakeTree]:
    tree = fake_board(tmp_path, "orin-nano", jetpack)
    kernel = FakeKernel(tree.root, jetpack)
    return Board.open(tree.root, writer=kernel, runner=FakeCommands(tree.root, kernel)), tree


def files(tree: FakeTree) -> dict[str, str]:
    names = [f"{tree.gpu_freq_dir}/min_freq", f"{tree.gpu_freq_dir}/max_freq"]
    names += [f"{policy}/scaling_{end}_freq" for policy in tree.policies for end in ("min", "max")]
    if tree.emc_dir is not None:
        names.append(f"{tree.emc_dir}/mrq_rate_locked")
    return {name: tree.get(name) for name in names}


@pytest.mark.parametrize("jetpack", [6, 7])
def test_over_the_real_board_the_pinned_point_reads_back_and_stop_restores_the_files(
        tmp_path: Path, jetpack: int) -> None:
    board, tree = real_board(tmp_path, jetpack)
    before = files(tree)
    clock = FakeClock()
    store = SavedSnapshot(tmp_path / "power-snapshot.json")
    controller = Controller(board, PowerPolicy(idle_after_s=0.3), clock=clock, saved=store)
    controller.start()
    assert store.load() is not None
    table = board.clock_table()
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == str(table.gpu_hz[-1])
    for _ in range(20):  # no request: idle, the lowest clocks
        clock.advance(0.05)
        decision = controller.step(load(clock))
    assert decision.state is PowerState.IDLE
    assert decision.point.gpu_max_hz == table.gpu_hz[0]
    assert board.read_point().gpu_max_hz == table.gpu_hz[0]  # read back from the files
    assert tree.get(f"{tree.gpu_freq_dir}/min_freq") == str(table.gpu_hz[0])
    if tree.emc_dir is not None and board.usable("emc"):
        assert tree.get(f"{tree.emc_dir}/mrq_rate_locked") == "1"
    controller.stop()
    assert files(tree) == before  # EMC unlocked again, every limit as it was
    assert store.load() is None


def test_over_the_real_board_a_crashed_run_is_undone_at_the_next_start(tmp_path: Path) -> None:
    board, tree = real_board(tmp_path)
    before = files(tree)
    store = SavedSnapshot(tmp_path / "power-snapshot.json")
    clock = FakeClock()
    crashed = Controller(board, PowerPolicy(profile="min"), clock=clock, saved=store)
    crashed.start()  # ... and the process dies here: no stop()
    assert files(tree) != before
    kernel = FakeKernel(tree.root, 6)  # a new process: a new board over the same files
    board_again = Board.open(tree.root, writer=kernel, runner=FakeCommands(tree.root, kernel))
    restarted = Controller(board_again, PowerPolicy(profile="stock"), clock=clock, saved=store)
    restarted.start()
    assert files(tree) == before  # the crashed run's limits are gone before anything else
    restarted.stop()
    assert files(tree) == before and store.load() is None


def test_a_left_over_copy_this_board_refuses_is_set_aside_and_the_start_goes_on(
        tmp_path: Path) -> None:
    """A crashed run's copy from another board (a JetPack upgrade turned the Orin Nano's device
    tree into the super one) must not fail every start: it is moved aside, and the limits in
    force are saved as the board's own."""
    from power.board import Board
    from power.controller import Controller
    from power.profiles import profile
    from power.saved import SavedSnapshot
    from power.sim.kernel import FakeKernel
    from power.sim.tree import write_tree
    from power.types import PowerPolicy

    write_tree(tmp_path / "nano", profile("orin-nano-8gb"), 6)
    write_tree(tmp_path / "super", profile("orin-nano-super"), 6)
    saved = SavedSnapshot(tmp_path / "saved.json")
    saved.save(Board.open(tmp_path / "nano", writer=FakeKernel(tmp_path / "nano", 6)).snapshot())
    board = Board.open(tmp_path / "super", writer=FakeKernel(tmp_path / "super", 6))
    original = board.snapshot()
    controller = Controller(board, PowerPolicy(), saved=saved)
    controller.start()
    assert (tmp_path / "saved.json.damaged").exists()
    assert saved.load() == original
    controller.stop()
    assert board.snapshot() == original and saved.load() is None

    # A damaged copy: the same.
    (tmp_path / "saved.json").write_text('{"snapshot": ')
    controller = Controller(board, PowerPolicy(), saved=saved)
    controller.start()
    assert saved.load() == original
    controller.stop()


# -- profile changes while asleep, and a stop that could not put everything back -------------

def asleep(policy: PowerPolicy | None = None, **board_options: object
           ) -> tuple[Controller, StrictBoard, FakeClock, MemoryStore, list[bool]]:
    clock = FakeClock()
    board = StrictBoard(clock=clock, **board_options)  # type: ignore[arg-type]
    store = MemoryStore()
    engine: list[bool] = []
    controller = Controller(board, policy or PowerPolicy(
        idle_after_s=0.2, sleep_after_s=0.5, release_engine_in_sleep=True),
        clock=clock, saved=store, on_engine=engine.append)
    controller.start()
    for _ in range(40):
        clock.advance(0.05)
        controller.step(load(clock))
    assert controller.state is PowerState.SLEEPING and engine == [False]
    return controller, board, clock, store, engine


@pytest.mark.parametrize("profile", ["stock", "max", "min"])
def test_a_profile_set_while_sleeping_wakes_through_the_transition_table(profile: str) -> None:
    controller, board, clock, _, engine = asleep()
    states: list[tuple[PowerState, PowerState]] = []
    set_state = controller._set_state

    def recording(state: PowerState, now_s: float) -> None:
        before = controller.state
        set_state(state, now_s)
        if controller.state is not before:
            states.append((before, controller.state))

    controller._set_state = recording  # type: ignore[method-assign]
    controller.set_policy(PowerPolicy(profile=profile))
    assert controller.state is PowerState.ACTIVE
    assert states == [(PowerState.SLEEPING, PowerState.WAKING),
                      (PowerState.WAKING, PowerState.ACTIVE)]
    assert engine == [False, True]  # the engine released by sleep is back
    if profile == "stock":
        assert board.point == board.original
        assert not controller.needs_wake()
    elif profile == "max":
        assert board.point.gpu_max_hz == board.table.gpu_hz[-1]
    clock.advance(0.05)
    controller.step(load(clock, arrivals=1, busy=1))
    assert controller.state is PowerState.ACTIVE


def test_a_stop_whose_restore_left_limits_different_keeps_the_saved_copy(
        caplog: pytest.LogCaptureFixture) -> None:
    controller, _, _, store = started(restore_mismatches=(
        Mismatch(path="gpu/max_freq", wanted=1020000000, found=306000000),))
    saved = store.snapshot
    result = controller.stop()
    assert result is not None and not result.ok
    assert store.snapshot == saved  # the next start tries again
    assert "kept for the next start" in caplog.text and "gpu/max_freq" in caplog.text


def test_a_stop_whose_restore_skipped_a_control_keeps_the_saved_copy() -> None:
    controller, _, _, store = started(restore_unsupported=("emc: no debugfs",))
    saved = store.snapshot
    controller.stop()
    assert store.snapshot == saved
    controller2, _, _, store2 = started()
    controller2.stop()
    assert store2.snapshot is None  # a complete restore forgets it


def test_a_limit_that_never_sticks_is_warned_about_once_not_every_apply(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root)  # FileWriter: a directory in a file's place fails EISDIR
    min_path = tree.root / tree.gpu_freq_dir / "min_freq"
    min_path.unlink()
    min_path.mkdir()
    clock = FakeClock()
    controller = Controller(board, PowerPolicy(profile="max"), clock=clock)
    with caplog.at_level("INFO"):
        controller.start()
        for profile in ("min", "max") * 5:
            controller.set_policy(PowerPolicy(profile=profile))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # the board layer's and the controller's, once each
    assert all("min_freq" in message for message in warnings)
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == str(board.clock_table().gpu_hz[-1])
    caplog.clear()
    min_path.rmdir()
    min_path.write_text("306000000\n")
    with caplog.at_level("INFO"):
        controller.set_policy(PowerPolicy(profile="min"))
        controller.set_policy(PowerPolicy(profile="max"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("again" in r.getMessage() for r in caplog.records)
    controller.stop()


@pytest.mark.parametrize(("target_s", "grows"), [(0.200, True), (0.0085, False)])
def test_the_wake_sizing_learns_from_each_busy_period_against_the_target(
        target_s: float, grows: bool) -> None:
    """A burst answered well under the target lets the next wake be sized for a larger share of
    it (the estimates are pessimistic); one near or over it, for a smaller share."""
    controller, board, clock, _ = started(PowerPolicy(latency_target_s=target_s,
                                                      idle_after_s=0.5, sleep_after_s=100.0))
    before = controller._size_share
    start = clock.now_s
    arrivals = [start + 0.1 + 0.02 * i for i in range(60)]
    arrivals += [start + 4.0 + 0.02 * i for i in range(60)]
    serve(controller, board, clock, arrivals, until_s=start + 7.0)
    after = controller._size_share
    assert (after > before) if grows else (after < before), (before, after)
    assert 0.70 <= after <= 1.15
