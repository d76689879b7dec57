"""Board.apply/snapshot/restore on fake trees: every write lands in the right file, in the right
unit and in an order the kernel accepts (JetPack 4 refuses an inverted pair, 5+ clamps), is read
back, and a control that cannot be written degrades instead of crashing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board
from power.sim.kernel import FakeKernel
from power.sim.tree import FakeTree
from power.types import OperatingPoint
from tests.power_boards import fake_board

EMC = "sys/kernel/debug/bpmp/debug/clk/emc"


def open_board(tree: FakeTree, **kernel_options: object) -> tuple[Board, FakeKernel]:
    kernel = FakeKernel(tree.root, tree.layout.jetpack, **kernel_options)  # type: ignore[arg-type]
    return Board.open(tree.root, writer=kernel), kernel


def test_a_point_lands_in_each_file_in_the_kernels_units(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    result = board.apply(OperatingPoint(gpu_min_hz=510000000, gpu_max_hz=714000000,
                                        cpu_min_khz=960000, cpu_max_khz=1190400,
                                        emc_hz=665600000, gpu_railgate=False,
                                        gpu_railgate_delay_ms=20))
    assert result.ok and not result.unsupported
    assert tree.get(f"{tree.gpu_freq_dir}/min_freq") == "510000000"  # Hz
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == "714000000"
    for policy in tree.policies:
        assert tree.get(f"{policy}/scaling_min_freq") == "960000"  # kHz
        assert tree.get(f"{policy}/scaling_max_freq") == "1190400"
    assert tree.get(f"{EMC}/mrq_rate_locked") == "1" and tree.get(f"{EMC}/rate") == "665600000"
    assert tree.get(f"{tree.gpu_device_dir}/railgate_enable") == "0"
    assert tree.get(f"{tree.gpu_device_dir}/railgate_delay") == "20"  # ms
    assert result.applied == OperatingPoint(
        gpu_min_hz=510000000, gpu_max_hz=714000000, cpu_min_khz=960000, cpu_max_khz=1190400,
        emc_hz=665600000, gpu_railgate=False, gpu_railgate_delay_ms=20, nvpmodel_mode=1)
    assert result.writes == len(kernel.log)
    # The EMC is locked before its rate is written (BPMP ignores a rate while unlocked).
    emc_writes = [path for path, _ in kernel.log if path.startswith(EMC)]
    assert emc_writes == [f"{EMC}/mrq_rate_locked", f"{EMC}/rate"]


def test_applying_the_same_point_again_writes_nothing(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    board, kernel = open_board(tree)
    point = OperatingPoint(gpu_min_hz=306000000, gpu_max_hz=612000000, cpu_max_khz=1344000,
                           emc_hz=2133000000)
    board.apply(point)
    count = len(kernel.log)
    again = board.apply(point)
    assert again.writes == 0 and len(kernel.log) == count and again.ok


@pytest.mark.parametrize("jetpack", [4, 5])
def test_lowering_below_the_minimum_and_raising_above_the_maximum(tmp_path: Path,
                                                                  jetpack: int) -> None:
    """From pinned at the top to pinned at the bottom and back: on JetPack 4 any other order
    fails with EINVAL, and the result must read back exactly."""
    tree = fake_board(tmp_path, "xavier-nx", jetpack)
    board, kernel = open_board(tree)
    table = board.clock_table()
    top, bottom = table.gpu_hz[-1], table.gpu_hz[0]
    for low, high in ((top, top), (bottom, bottom), (top, top), (table.gpu_hz[3],
                                                                table.gpu_hz[7])):
        result = board.apply(OperatingPoint(gpu_min_hz=low, gpu_max_hz=high,
                                            cpu_min_khz=table.cpu_khz[-1] if low == top
                                            else table.cpu_khz[0],
                                            cpu_max_khz=table.cpu_khz[-1] if low == top
                                            else table.cpu_khz[0]))
        assert result.ok, result.mismatches
        assert (result.applied.gpu_min_hz, result.applied.gpu_max_hz) == (low, high)
    # Pinned at the top, lowering both: the minimum is floored first, never max below min.
    board.apply(OperatingPoint(gpu_min_hz=top, gpu_max_hz=top))
    kernel.log.clear()
    board.apply(OperatingPoint(gpu_min_hz=table.gpu_hz[2], gpu_max_hz=table.gpu_hz[2]))
    assert [(path.rsplit("/", 1)[1], value) for path, value in kernel.log] == [
        ("min_freq", str(bottom)), ("max_freq", str(table.gpu_hz[2])),
        ("min_freq", str(table.gpu_hz[2]))]


def test_jetpack_4_refuses_an_inverted_pair_and_5_clamps_it(tmp_path: Path) -> None:
    """The fake kernels themselves: what makes the order above matter."""
    old = fake_board(tmp_path, "xavier-nx", 4)
    kernel4 = FakeKernel(old.root, 4)
    kernel4.write(f"{old.gpu_freq_dir}/max_freq", "803250000")
    with pytest.raises(OSError) as caught:
        kernel4.write(f"{old.gpu_freq_dir}/min_freq", "1109250000")  # above max
    assert caught.value.errno == errno.EINVAL
    assert old.get(f"{old.gpu_freq_dir}/min_freq") == "114750000"
    with pytest.raises(OSError):
        kernel4.write(f"{old.policies[0]}/scaling_max_freq", "422400")  # below min 1190400

    new = fake_board(tmp_path, "orin-nano", 6)
    kernel6 = FakeKernel(new.root, 6)
    kernel6.write(f"{new.gpu_freq_dir}/max_freq", "612000000")
    kernel6.write(f"{new.gpu_freq_dir}/min_freq", "918000000")  # above max: clamped
    assert new.get(f"{new.gpu_freq_dir}/min_freq") == "612000000"
    kernel6.write(f"{new.gpu_freq_dir}/max_freq", "1020000000")  # the request comes back
    assert new.get(f"{new.gpu_freq_dir}/min_freq") == "918000000"
    assert new.get(f"{new.gpu_freq_dir}/cur_freq") == "918000000"  # moved into the limits
    kernel6.write(f"{new.gpu_freq_dir}/max_freq", "0")  # no cap
    assert new.get(f"{new.gpu_freq_dir}/max_freq") == "1020000000"
    kernel6.write(f"{new.policies[0]}/scaling_max_freq", "1000000")  # resolved to the table
    assert new.get(f"{new.policies[0]}/scaling_max_freq") == "960000"


class CoolingKernel(FakeKernel):
    """A kernel whose thermal cooling device caps the GPU at 612 MHz (a clamp that changes the
    value written), and whose BPMP drops EMC rates (a silent drop)."""

    def write(self, relpath: str, value: str) -> None:
        super().write(relpath, value)
        if relpath.endswith("devfreq/17000000.gpu/max_freq") and int(value) > 612000000:
            (self.root / relpath).write_text("612000000\n")
        if relpath == f"{EMC}/rate":
            (self.root / relpath).write_text("2133000000\n")


def test_a_clamp_or_a_silent_drop_is_a_mismatch_with_both_values(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=CoolingKernel(tree.root, 6))
    result = board.apply(OperatingPoint(gpu_max_hz=1020000000, emc_hz=204000000))
    assert not result.ok
    found = {(m.path.rsplit("/", 1)[1], m.wanted, m.found) for m in result.mismatches}
    assert found == {("max_freq", 1020000000, 612000000), ("rate", 204000000, 2133000000)}
    assert result.applied.gpu_max_hz == 612000000


@pytest.mark.parametrize(("point", "message"), [
    (OperatingPoint(gpu_max_hz=918), "gpu_max_hz is not a frequency"),  # MHz, not Hz
    (OperatingPoint(cpu_max_khz=1344000000), "cpu_max_khz is not a frequency"),  # Hz, not kHz
    (OperatingPoint(gpu_min_hz=612000000, gpu_max_hz=408000000), "minimum above its maximum"),
    (OperatingPoint(emc_hz=3199), "emc_hz is not a rate"),
    (OperatingPoint(gpu_max_hz=1300500000), "not a frequency"),  # the AGX Orin's top
    (OperatingPoint(nvpmodel_mode=9), "no such nvpmodel mode"),
])
def test_wrong_values_are_refused_before_any_write(tmp_path: Path, point: OperatingPoint,
                                                   message: str) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    before = board.snapshot()
    with pytest.raises(PowerError, match=message):
        board.apply(point)
    assert kernel.log == [] and board.snapshot() == before


def test_a_read_only_file_degrades_its_control_and_the_rest_still_applies(tmp_path: Path
                                                                          ) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree, read_only=frozenset({f"{tree.gpu_freq_dir}/max_freq"}))
    result = board.apply(OperatingPoint(gpu_min_hz=306000000, gpu_max_hz=510000000,
                                        cpu_max_khz=1190400))
    assert any(item.startswith("gpu: cannot write") and "max_freq" in item
               and "Permission denied" in item for item in result.unsupported)
    assert result.applied.cpu_max_khz == 1190400  # the CPU was still applied
    reason = board.capabilities()["gpu"]
    assert reason is not None and "max_freq" in reason
    kernel.log.clear()
    second = board.apply(OperatingPoint(gpu_max_hz=612000000))  # skipped, not retried
    assert kernel.log == [] and second.unsupported == (f"gpu: {reason}",)


def test_a_file_that_vanished_degrades_its_control(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, _ = open_board(tree)
    (tree.root / tree.policies[1] / "scaling_max_freq").unlink()
    result = board.apply(OperatingPoint(cpu_max_khz=1190400))
    assert any(item.startswith("cpu: cannot write") for item in result.unsupported)
    assert board.capabilities()["cpu"] is not None


def test_without_debugfs_the_emc_is_reported_and_skipped(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6, debugfs=False)
    board, _kernel = open_board(tree)
    assert board.capabilities()["emc"] == "no EMC control in debugfs (not mounted, or not root)"
    assert board.clock_table().emc_hz == ()
    result = board.apply(OperatingPoint(emc_hz=2133000000, gpu_max_hz=612000000))
    assert result.unsupported == ("emc: no EMC control in debugfs (not mounted, or not root)",)
    assert result.applied.gpu_max_hz == 612000000 and result.applied.emc_hz is None
    assert board.telemetry().emc_hz is None


def test_missing_nvpmodel_and_monitors_are_reported_not_fatal(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    (tree.root / "etc/nvpmodel.conf").unlink()
    (tree.root / "sys/bus/i2c/devices/1-0040").unlink()
    (tree.root / "sys/class/thermal/thermal_zone8").unlink()
    board, _ = open_board(tree)
    caps = board.capabilities()
    assert caps["nvpmodel"] == "no /etc/nvpmodel.conf" and caps["rails"] is not None
    reading = board.telemetry()
    assert reading.rails_mw == {} and reading.total_power_mw is None
    assert "tj" not in {zone.name for zone in reading.thermal}
    result = board.apply(OperatingPoint(nvpmodel_mode=2, gpu_max_hz=612000000))
    assert result.unsupported == ("nvpmodel: no /etc/nvpmodel.conf",)


def test_jetpack_7_rail_gating_goes_through_runtime_power_management(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 7)
    board, kernel = open_board(tree)
    result = board.apply(OperatingPoint(gpu_railgate=False))
    assert result.ok and kernel.log == [(f"{tree.gpu_device_dir}/power/control", "on")]
    assert board.telemetry().gpu_railgated is False
    assert board.apply(OperatingPoint(gpu_railgate=True)).applied.gpu_railgate is True


@pytest.mark.parametrize(("name", "jetpack"), [("xavier-nx", 4), ("orin-nano-8gb", 5),
                                               ("orin-nano", 6), ("agx-orin-64gb", 7)])
def test_restore_puts_every_limit_back_and_unlocks_the_emc(tmp_path: Path, name: str,
                                                           jetpack: int) -> None:
    tree = fake_board(tmp_path, name, jetpack)
    board, _ = open_board(tree)
    original = board.snapshot()
    table = board.clock_table()
    board.apply(OperatingPoint(gpu_min_hz=table.gpu_hz[-1], gpu_max_hz=table.gpu_hz[-1],
                               cpu_min_khz=table.cpu_khz[-1], cpu_max_khz=table.cpu_khz[-1],
                               emc_hz=table.emc_hz[-1], gpu_railgate=False))
    assert board.snapshot() != original
    result = board.restore(original)
    assert result.ok and not result.unsupported
    assert board.snapshot() == original
    assert tree.get(f"{EMC}/mrq_rate_locked") == "0"


def test_restore_refuses_another_boards_snapshot_or_foreign_files(tmp_path: Path) -> None:
    nano, _ = open_board(fake_board(tmp_path, "orin-nano", 6))
    agx, _ = open_board(fake_board(tmp_path, "agx-orin-64gb", 6))
    with pytest.raises(PowerError, match="another board"):
        nano.restore(agx.snapshot())
    forged = nano.snapshot()
    forged["files"]["etc/shadow"] = "x"
    with pytest.raises(PowerError, match="does not write"):
        nano.restore(forged)
    with pytest.raises(PowerError, match="not a board snapshot"):
        nano.restore({"format": 99})


def test_clusters_taken_offline_by_a_mode_are_skipped_not_reported(tmp_path: Path) -> None:
    """AGX Orin's MODE_15W keeps 4 of 12 cores: policies 4 and 8 have no CPU online and their
    files answer EBUSY until the mode changes."""
    from power.sim.commands import FakeCommands

    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    kernel = FakeKernel(tree.root, 6)
    board = Board.open(tree.root, writer=kernel, runner=FakeCommands(tree.root, kernel))
    assert board.apply(OperatingPoint(nvpmodel_mode=1)).ok
    assert tree.get("sys/devices/system/cpu/cpu4/online") == "0"
    with pytest.raises(OSError) as caught:
        kernel.write(f"{tree.policies[1]}/scaling_max_freq", "960000")
    assert caught.value.errno == errno.EBUSY
    result = board.apply(OperatingPoint(cpu_min_khz=729600, cpu_max_khz=960000))
    assert result.ok and not result.unsupported and board.capabilities()["cpu"] is None
    assert tree.get(f"{tree.policies[0]}/scaling_max_freq") == "960000"
    assert board.apply(OperatingPoint(nvpmodel_mode=0)).ok  # MAXN: all 12 back
    assert board.apply(OperatingPoint(cpu_max_khz=960000)).ok
    assert all(tree.get(f"{policy}/scaling_max_freq") == "960000" for policy in tree.policies)


def test_a_limit_given_alone_may_not_cross_the_other(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)  # 25W: GPU max 918 MHz
    board, kernel = open_board(tree)
    with pytest.raises(PowerError, match="minimum above its maximum"):
        board.apply(OperatingPoint(gpu_min_hz=1020000000))
    assert kernel.log == []
    assert board.apply(OperatingPoint(gpu_min_hz=918000000)).applied.gpu_min_hz == 918000000


class RefusingWriter(FakeKernel):
    """A privileged helper whose rules refuse the EMC (it raises PowerError, as
    power/helper_client.py does for a refused request)."""

    def write(self, relpath: str, value: str) -> None:
        if relpath.startswith(EMC):
            raise PowerError("the power helper refused: not allowed", path=relpath)
        super().write(relpath, value)


def test_a_writer_that_refuses_degrades_that_control_only(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=RefusingWriter(tree.root, 6))
    result = board.apply(OperatingPoint(emc_hz=204000000, gpu_max_hz=612000000))
    assert result.applied.gpu_max_hz == 612000000
    assert len(result.unsupported) == 1 and result.unsupported[0].startswith(
        "emc: writer refused")
    assert board.capabilities()["emc"] is not None


def test_a_sentinel_temperature_is_no_reading(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    tree.set(f"{tree.zones['soc0-thermal']}/temp", -256000)
    board, _ = open_board(tree)
    zones = {zone.name: zone.temp_c for zone in board.telemetry().thermal}
    assert zones["soc0"] is None and zones["soc1"] == 48.0



def test_real_read_only_files_give_a_degraded_board_for_a_user(tmp_path: Path) -> None:
    """chmod 0444 on the GPU limits, and the agent running as a user: no fake writer, the real
    FileWriter meets the file system's EACCES. As root (where chmod stops nothing) the board runs
    in a forked child that dropped to uid 65534."""
    import json
    import os

    tree = fake_board(tmp_path, "orin-nano", 6)
    os.chmod(tmp_path, 0o755)
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666)
    for name in ("min_freq", "max_freq"):
        os.chmod(tree.root / tree.gpu_freq_dir / name, 0o444)

    def probe() -> dict[str, object]:
        board = Board.open(tree.root)  # the files themselves, through FileWriter
        result = board.apply(OperatingPoint(gpu_max_hz=612000000, cpu_max_khz=1190400))
        return {"caps": board.capabilities(), "unsupported": list(result.unsupported),
                "cpu_max": result.applied.cpu_max_khz}

    if os.geteuid() != 0:
        answer = probe()
    else:
        # tmp_path's parents are root's 0700: let the user through them for this test only.
        modes = {folder: os.stat(folder).st_mode & 0o7777 for folder in tmp_path.parents
                 if str(folder).startswith(str(tmp_path.parents[2]))}
        for folder, mode in modes.items():
            os.chmod(folder, mode | 0o111)
        try:
            reader, writer = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: drop to nobody, probe, report, never return into pytest
                code = 1
                try:
                    os.close(reader)
                    os.setgid(65534)
                    os.setuid(65534)
                    os.write(writer, json.dumps(probe()).encode())
                    code = 0
                except BaseException as exc:  # noqa: BLE001 - reported through the pipe
                    os.write(writer, repr(exc).encode())
                finally:
                    os._exit(code)
            os.close(writer)
            with os.fdopen(reader) as stream:
                data = stream.read()
            _, status = os.waitpid(pid, 0)
        finally:
            for folder, mode in modes.items():
                os.chmod(folder, mode)
        assert os.waitstatus_to_exitcode(status) == 0, data
        answer = json.loads(data)
    caps = answer["caps"]
    assert isinstance(caps, dict)
    assert caps["gpu"] == f"cannot write {tree.gpu_freq_dir}/min_freq: permission denied"
    assert answer["unsupported"] == [f"gpu: {caps['gpu']}"]
    assert answer["cpu_max"] == 1190400  # the writable CPU limits were still applied
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == "918000000"


class PickyKernel(FakeKernel):
    """A kernel refusing one GPU rate with EINVAL (as 4.9 does for an inverted pair)."""

    def write(self, relpath: str, value: str) -> None:
        if relpath.endswith("17000000.gpu/max_freq") and value == "714000000":
            raise OSError(errno.EINVAL, "Invalid argument", str(self.root / relpath))
        super().write(relpath, value)


def test_a_value_the_kernel_refuses_is_a_mismatch_and_the_control_stays(tmp_path: Path
                                                                         ) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=PickyKernel(tree.root, 6))
    result = board.apply(OperatingPoint(gpu_min_hz=306000000, gpu_max_hz=714000000))
    assert [(m.path, m.wanted, m.found) for m in result.mismatches] == [
        (f"{tree.gpu_freq_dir}/max_freq", 714000000, 918000000)]
    assert board.capabilities()["gpu"] is None and not result.unsupported
    assert board.apply(OperatingPoint(gpu_max_hz=612000000)).ok


def test_a_governor_step_costs_well_under_the_budget(tmp_path: Path) -> None:
    """The governor calls apply() and telemetry() every ~50 ms: each must stay ~1-3 ms. Only the
    read-only paths are timed (a write's cost here is the test disk's, not sysfs's); the bound
    is 30 times the measured median so a loaded machine does not fail it, while a step that
    ran a command or rescanned the tree would."""
    import statistics
    import time

    from power.io import FileWriter

    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    board = Board.open(tree.root, writer=FileWriter(tree.root))
    point = OperatingPoint(gpu_min_hz=612000000, gpu_max_hz=612000000, cpu_min_khz=1497600,
                           cpu_max_khz=1497600, emc_hz=2133000000, gpu_railgate=True)
    board.apply(point)
    applies, readings = [], []
    for _ in range(200):
        start = time.perf_counter()
        board.apply(point)
        applies.append(time.perf_counter() - start)
        start = time.perf_counter()
        board.telemetry()
        readings.append(time.perf_counter() - start)
    assert statistics.median(applies) < 0.003
    assert statistics.median(readings) < 0.003


# -- one limit file broken, the other fine; a degraded control warns once -------------------

def test_a_gpu_min_freq_replaced_by_a_directory_names_it_and_the_max_is_still_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The files themselves (FileWriter): writing to a directory fails with EISDIR, and so does
    reading it, with no file name from the OS."""
    import shutil

    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root)
    min_path = tree.root / tree.gpu_freq_dir / "min_freq"
    min_path.unlink()
    min_path.mkdir()
    with caplog.at_level("WARNING", logger="power.board"):
        result = board.apply(OperatingPoint(gpu_min_hz=306000000, gpu_max_hz=306000000))
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == "306000000"  # written all the same
    assert [m.path for m in result.mismatches] == [f"{tree.gpu_freq_dir}/min_freq"]
    assert "min_freq" in caplog.text and "max_freq" not in caplog.text
    # The other limit moves too: a higher maximum lands, the minimum still reported.
    result = board.apply(OperatingPoint(gpu_min_hz=612000000, gpu_max_hz=612000000))
    assert tree.get(f"{tree.gpu_freq_dir}/max_freq") == "612000000"
    assert [m.path for m in result.mismatches] == [f"{tree.gpu_freq_dir}/min_freq"]
    shutil.rmtree(min_path)


def test_a_broken_limit_warns_once_per_state_change_not_every_apply(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root)
    min_path = tree.root / tree.gpu_freq_dir / "min_freq"
    min_path.unlink()
    min_path.mkdir()
    with caplog.at_level("INFO", logger="power.board"):
        for gpu_hz in (306000000, 612000000, 918000000) * 10:
            board.apply(OperatingPoint(gpu_min_hz=gpu_hz, gpu_max_hz=gpu_hz))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    caplog.clear()
    min_path.rmdir()
    min_path.write_text("306000000\n")
    with caplog.at_level("INFO", logger="power.board"):
        for gpu_hz in (306000000, 612000000) * 5:
            result = board.apply(OperatingPoint(gpu_min_hz=gpu_hz, gpu_max_hz=gpu_hz))
    assert result.ok
    assert [r.levelname for r in caplog.records] == ["INFO"]  # recovered, said once
    assert "gpu" in caplog.records[0].getMessage()


def test_the_rail_gate_delay_is_read_back_saved_and_restored(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    delay = f"{tree.gpu_device_dir}/railgate_delay"
    original = board.snapshot()
    assert original["files"][delay] == "500"  # ms, ga10b's default
    assert board.read_point().gpu_railgate_delay_ms == 500
    result = board.apply(OperatingPoint(gpu_railgate_delay_ms=10))
    assert result.ok and result.writes == 1 and result.applied.gpu_railgate_delay_ms == 10
    assert kernel.log == [(delay, "10")]
    assert tree.get(f"{tree.gpu_device_dir}/power/autosuspend_delay_ms") == "10"
    restored = board.restore(original)
    assert restored.ok and not restored.unsupported
    assert tree.get(delay) == "500" and board.snapshot() == original


@pytest.mark.parametrize("value", [-1, 60001, True, 0.5])
def test_a_rail_gate_delay_out_of_range_is_refused_before_any_write(tmp_path: Path,
                                                                    value: object) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board, kernel = open_board(tree)
    with pytest.raises(PowerError, match="gpu_railgate_delay_ms"):
        board.apply(OperatingPoint(gpu_railgate_delay_ms=value))  # type: ignore[arg-type]
    assert kernel.log == []


def test_a_missing_rail_gate_delay_is_a_degraded_control(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    for name in ("railgate_delay", "power/autosuspend_delay_ms"):
        (tree.root / tree.gpu_device_dir / name).unlink()
    board, kernel = open_board(tree)
    assert "railgate_delay" in (board.capabilities()["railgate_delay"] or "")
    assert board.capabilities()["railgate"] is None
    result = board.apply(OperatingPoint(gpu_railgate_delay_ms=10, gpu_railgate=True))
    assert result.ok and any(item.startswith("railgate_delay:") for item in result.unsupported)
    assert kernel.log == [] and result.applied.gpu_railgate_delay_ms is None
    assert "railgate_delay" not in " ".join(board.snapshot()["files"])


def test_a_read_only_rail_gate_delay_degrades_on_its_first_write(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    delay = f"{tree.gpu_device_dir}/railgate_delay"
    board, _kernel = open_board(tree, read_only=frozenset({delay}))
    result = board.apply(OperatingPoint(gpu_railgate_delay_ms=10, gpu_min_hz=306000000))
    assert tree.get(delay) == "500" and tree.get(f"{tree.gpu_freq_dir}/min_freq") == "306000000"
    assert any("railgate_delay" in item and "Permission denied" in item
               for item in result.unsupported)
    assert board.capabilities()["railgate_delay"] is not None
    assert board.apply(OperatingPoint(gpu_railgate_delay_ms=20)).writes == 0  # skipped now
