"""The board layer under files a fleet of real boards can show: empty or garbled values, a total
rail that cannot be read, fan trip points, values of the wrong type, damaged snapshots, every
profile's fake tree in every mode. Each test is a case a probe of the board layer found broken."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board, jetpack_of, parse_release
from power.io import WriteRule, check_value, read_int
from power.profiles import PROFILES
from power.saved import SavedSnapshot
from power.sim.kernel import FakeKernel
from power.sim.tree import FakeTree, write_tree
from power.types import OperatingPoint
from tests.power_boards import BOARD_RELEASES, board_ids, fake_board

EMC = "sys/kernel/debug/bpmp/debug/clk/emc"


def open_board(tree: FakeTree) -> tuple[Board, FakeKernel]:
    kernel = FakeKernel(tree.root, tree.layout.jetpack)
    return Board.open(tree.root, writer=kernel), kernel


def test_an_empty_file_is_no_reading_not_a_crash(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, _ = open_board(tree)
    # A sysfs read can come back empty (a driver mid-update; a file truncated in a copied tree).
    (tree.root / f"{tree.gpu_freq_dir}/cur_freq").write_text("")
    hwmon, channel = tree.rails["VDD_SOC"]
    (tree.root / f"{hwmon}/curr{channel}_input").write_text("\n")
    telemetry = board.telemetry()
    assert telemetry.gpu_freq_hz is None
    assert "VDD_SOC" not in telemetry.rails_mw and "VDD_IN" in telemetry.rails_mw
    with pytest.raises(ValueError):
        read_int(tree.root, f"{tree.gpu_freq_dir}/cur_freq")


@pytest.mark.parametrize("content", ["", "\n", "<unsupported>\n", "x"])
def test_a_garbled_limit_file_is_a_mismatch_and_apply_does_not_raise(tmp_path: Path,
                                                                     content: str) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, _ = open_board(tree)
    max_path = f"{tree.gpu_freq_dir}/max_freq"
    (tree.root / max_path).write_text(content)
    result = board.apply(OperatingPoint(gpu_max_hz=612000000, cpu_max_khz=1344000))
    assert [m.path for m in result.mismatches] == [max_path]
    assert result.mismatches[0].wanted == 612000000 and result.mismatches[0].found is None
    assert result.applied.cpu_max_khz == 1344000  # the other controls still applied
    assert board.usable("gpu")  # a value that may read right next time: not degraded


def test_a_garbled_emc_lock_file_is_a_mismatch_not_a_crash(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, _ = open_board(tree)
    (tree.root / f"{EMC}/mrq_rate_locked").write_text("?\n")
    result = board.apply(OperatingPoint(emc_hz=2133000000))
    assert not result.ok
    assert result.mismatches[0].path == f"{EMC}/mrq_rate_locked"


@pytest.mark.parametrize("value", ["²", "١٢", "１２"])
def test_rules_refuse_digits_that_are_not_ascii(value: str) -> None:
    # str.isdigit() is true for these, int() is not always: a helper's rule must say no, not
    # raise.
    assert WriteRule(what="gpu_max_hz", low=0, high=10**9).check(value) is not None
    with pytest.raises(PowerError):
        check_value(value)


@pytest.mark.parametrize(("point", "what"), [
    (OperatingPoint(gpu_max_hz=612000000.0), "gpu_max_hz"),  # type: ignore[arg-type]
    (OperatingPoint(cpu_min_khz=True), "cpu_min_khz"),
    (OperatingPoint(emc_hz=2133000000.0), "emc_hz"),  # type: ignore[arg-type]
    (OperatingPoint(nvpmodel_mode="1"), "nvpmodel_mode"),  # type: ignore[arg-type]
    (OperatingPoint(gpu_railgate=1), "gpu_railgate"),  # type: ignore[arg-type]
])
def test_values_of_the_wrong_type_are_refused_before_any_write(tmp_path: Path,
                                                               point: OperatingPoint,
                                                               what: str) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    with pytest.raises(PowerError, match=what):
        board.apply(point)
    assert kernel.log == []


def test_an_unreadable_vdd_in_is_no_total_not_the_sum_of_its_sub_rails(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, _ = open_board(tree)
    hwmon, channel = tree.rails["VDD_IN"]
    (tree.root / f"{hwmon}/curr{channel}_input").unlink()
    telemetry = board.telemetry()
    assert set(telemetry.rails_mw) == {"VDD_CPU_GPU_CV", "VDD_SOC"}
    assert telemetry.total_power_mw is None


def test_a_sum_of_rails_with_one_unreadable_is_no_total(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    board, _ = open_board(tree)
    assert board.telemetry().total_power_mw is not None
    hwmon, channel = tree.rails["VDD_CPU_CV"]
    (tree.root / f"{hwmon}/in{channel}_input").write_text("")
    assert board.telemetry().total_power_mw is None


def test_fan_trip_points_are_not_thermal_limits(tmp_path: Path) -> None:
    # Active trips switch fan levels (Xavier's thermal-fan-est has them from about 50 °C): they
    # are not a temperature the board throttles at, so they must not set the margin.
    tree = fake_board(tmp_path, "orin-nano", 6,
                      trips_c=(("active", 50.0), ("passive", 99.0), ("critical", 104.5)))
    board, _ = open_board(tree)
    zones = board.telemetry().thermal
    assert all(trip_type != "active" for zone in zones for trip_type, _ in zone.trips_c)
    assert board.telemetry().hottest_margin_c() == pytest.approx(51.0)


def test_a_trip_with_an_unreadable_temperature_does_not_hide_the_next(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    zone = tree.zones["cpu-thermal"]
    (tree.root / f"{zone}/trip_point_0_temp").write_text("")
    board, _ = open_board(tree)
    cpu = next(z for z in board.telemetry().thermal if z.name == "cpu")
    assert cpu.trips_c == (("critical", 104.5),)


@pytest.mark.parametrize("files", [
    {"sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq": 1344000},
    {"sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq": None},
    {"sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq": ["1344000"]},
])
def test_a_snapshot_with_values_that_are_not_text_is_refused(tmp_path: Path,
                                                             files: dict[str, object]) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    snapshot = board.snapshot()
    snapshot["files"].update(files)
    with pytest.raises(PowerError, match="snapshot"):
        board.restore(snapshot)
    assert kernel.log == []


def test_a_snapshot_with_a_mode_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    snapshot = board.snapshot()
    snapshot["nvpmodel_mode"] = True
    with pytest.raises(PowerError, match="snapshot"):
        board.restore(snapshot)
    assert kernel.log == []


@pytest.mark.parametrize(("name", "jetpack", "mode_id"), [
    (name, jetpack, mode.mode_id) for name, jetpack in BOARD_RELEASES
    for mode in PROFILES[name].modes])
def test_every_fake_tree_shows_limits_its_kernel_could_show(tmp_path: Path, name: str,
                                                            jetpack: int, mode_id: int) -> None:
    board = PROFILES[name]
    tree = write_tree(tmp_path / "board", board, jetpack, mode_id=mode_id)
    for policy in tree.policies:
        low = int(tree.get(f"{policy}/scaling_min_freq"))
        high = int(tree.get(f"{policy}/scaling_max_freq"))
        assert low <= high, (policy, low, high)
        if jetpack >= 5:  # 5.10+ resolve both limits to table entries
            assert low in board.cpu_khz and high in board.cpu_khz, (policy, low, high)
    gpu_low = int(tree.get(f"{tree.gpu_freq_dir}/min_freq"))
    gpu_high = int(tree.get(f"{tree.gpu_freq_dir}/max_freq"))
    assert gpu_low <= gpu_high


@pytest.mark.parametrize(("name", "jetpack"), BOARD_RELEASES, ids=board_ids())
def test_restore_after_the_extremes_gives_back_the_same_snapshot(tmp_path: Path, name: str,
                                                                 jetpack: int) -> None:
    for mode in PROFILES[name].modes:
        tree = write_tree(tmp_path / f"m{mode.mode_id}", PROFILES[name], jetpack,
                          mode_id=mode.mode_id)
        board, _ = open_board(tree)
        table = board.clock_table()
        snapshot = board.snapshot()
        point = board.read_point()
        for index in (-1, 0):
            board.apply(OperatingPoint(
                gpu_min_hz=table.gpu_hz[index], gpu_max_hz=table.gpu_hz[index],
                cpu_min_khz=table.cpu_khz[index], cpu_max_khz=table.cpu_khz[index],
                emc_hz=table.emc_hz[index], gpu_railgate=index == 0))
        result = board.restore(snapshot)
        assert result.ok and not result.unsupported, (mode, result)
        assert board.snapshot() == snapshot, mode
        assert board.read_point() == point, mode


@pytest.mark.parametrize("temp_mc", [-40000, -45500])
def test_a_cold_start_of_an_industrial_module_is_a_reading(tmp_path: Path, temp_mc: int) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    tree.set(f"{tree.zones['cpu-thermal']}/temp", temp_mc)
    tree.set(f"{tree.zones['gpu-thermal']}/temp", -256000)
    board, _ = open_board(tree)
    zones = {zone.name: zone.temp_c for zone in board.telemetry().thermal}
    assert zones["cpu"] == temp_mc / 1000 and zones["gpu"] is None


def test_a_minimum_the_kernel_lifts_back_with_the_cap_is_written_again(tmp_path: Path) -> None:
    # 5.10+ keep the minimum asked for and show it clamped under a lower cap; raising the cap
    # lifts it back. Someone else lowered the cap under our minimum: raising it again must not
    # leave our old minimum in force.
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    assert board.apply(OperatingPoint(gpu_min_hz=918000000, gpu_max_hz=918000000)).ok
    kernel.write(f"{tree.gpu_freq_dir}/max_freq", "612000000")  # an operator, by hand
    assert tree.get(f"{tree.gpu_freq_dir}/min_freq") == "612000000"
    result = board.apply(OperatingPoint(gpu_min_hz=612000000, gpu_max_hz=1020000000))
    assert result.ok, result.mismatches
    assert (result.applied.gpu_min_hz, result.applied.gpu_max_hz) == (612000000, 1020000000)


def test_the_fake_kernel_refuses_digits_that_are_not_ascii_as_einval(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    kernel = FakeKernel(tree.root, 6)
    with pytest.raises(OSError) as caught:
        kernel.write(f"{tree.gpu_freq_dir}/max_freq", "６１２")
    assert caught.value.errno == errno.EINVAL


def test_jetpack_5_developer_preview_is_jetpack_5() -> None:
    assert jetpack_of(parse_release("# R34 (release), REVISION: 1.1, GCID: 1, BOARD: t186ref")) \
        == 5


def test_a_snapshot_with_a_control_the_board_cannot_reach_now_restores_the_rest(
        tmp_path: Path) -> None:
    # Saved while debugfs was readable; after a crash and a reboot it is not (not mounted yet,
    # or the agent now runs as a user): the GPU and CPU limits must still come back.
    with_debugfs = fake_board(tmp_path / "a", "orin-nano", 6)
    saved = open_board(with_debugfs)[0].snapshot()
    emc_files = [path for path in saved["files"] if path.startswith(EMC)]
    assert emc_files
    tree = fake_board(tmp_path / "b", "orin-nano", 6, debugfs=False)
    board, _ = open_board(tree)
    original = board.read_point()
    board.apply(OperatingPoint(gpu_min_hz=1020000000, gpu_max_hz=1020000000,
                               cpu_max_khz=729600))
    result = board.restore(saved)
    assert result.ok
    assert any(entry.startswith(f"snapshot: {len(emc_files)} limit(s)") and emc_files[0] in entry
               for entry in result.unsupported)
    assert board.read_point() == original


@pytest.mark.parametrize("content", ['{"snapshot": ', "", "[]", '{"snapshot": []}', "null"])
def test_a_damaged_saved_copy_fails_one_start_not_every_one(tmp_path: Path,
                                                            content: str) -> None:
    saved = SavedSnapshot(tmp_path / "saved.json")
    saved.path.write_text(content)
    with pytest.raises(PowerError, match="not readable"):
        saved.load()
    assert saved.load() is None
    assert (tmp_path / "saved.json.damaged").read_text() == content


def test_a_saved_copy_that_cannot_be_read_is_left_in_place(tmp_path: Path) -> None:
    saved = SavedSnapshot(tmp_path / "saved.json")
    saved.path.mkdir()  # EISDIR: not the copy's fault, nothing to move aside
    with pytest.raises(PowerError, match="cannot read"):
        saved.load()
    assert saved.path.is_dir() and not (tmp_path / "saved.json.damaged").exists()
