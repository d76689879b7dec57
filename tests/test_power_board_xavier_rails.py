"""INA3221 rails on Xavier under JetPack 4: NVIDIA's ``ina3221x`` iio driver (``rail_name_N``,
``in_voltageN_input`` mV, ``in_currentN_input`` mA, ``in_powerN_input`` mW for N = 0..2), found
and read with the same interface and units as the hwmon rails of JetPack 5 and later; a channel
whose files are missing or unreadable is reported, never a crash."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from agent.cli import main
from agent.metrics import PowerMetrics
from power.board import Board
from power.sim.kernel import FakeKernel
from power.sim.tree import FakeTree
from power.sysfs.discover import discover
from tests.power_boards import fake_board


def open_board(tree: FakeTree) -> Board:
    return Board.open(tree.root, writer=FakeKernel(tree.root, tree.layout.jetpack))


def iio_file(tree: FakeTree, label: str, kind: str) -> str:
    """The file of ``label``'s channel: kind ``power``, ``voltage`` or ``current``."""
    iio, number = tree.rails[label]
    return f"{iio}/in_{kind}{number}_input"


def test_the_jetpack_4_tree_is_the_iio_layout_not_hwmon(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    root = tree.root
    for address, device in (("1-0040", 0), ("1-0041", 1)):
        driver_entry = root / "sys/bus/i2c/drivers/ina3221x" / address
        assert driver_entry.is_symlink()
        iio = driver_entry / f"iio:device{device}"
        assert (iio / "name").read_text() == "ina3221x\n"
        assert sorted(name for name in os.listdir(iio) if name.startswith("rail_name_")) == [
            "rail_name_0", "rail_name_1", "rail_name_2"]
        assert not (driver_entry / "hwmon").exists()
    assert (root / "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0/rail_name_0"
            ).read_text() == "GPU\n"
    assert (root / "sys/bus/i2c/drivers/ina3221x/1-0041/iio:device1/rail_name_2"
            ).read_text() == "SYS5V\n"
    assert not (root / "sys/bus/i2c/drivers/ina3221").exists()
    assert discover(root).power_monitors == (
        "sys/devices/c240000.i2c/i2c-1/1-0040/iio:device0",
        "sys/devices/c240000.i2c/i2c-1/1-0041/iio:device1")
    # JetPack 5 on the same module is the upstream hwmon driver again.
    newer = fake_board(tmp_path, "agx-xavier", 5)
    assert all("/hwmon/" in monitor for monitor in discover(newer.root).power_monitors)


def test_agx_xavier_rails_read_in_milliwatts_and_sum_to_the_total(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    board = open_board(tree)
    assert board.capabilities()["rails"] is None
    powers = {"GPU": 3150, "CPU": 1432, "SOC": 1187, "CV": 0, "VDDRQ": 812, "SYS5V": 2403}
    for label, milliwatts in powers.items():
        tree.set(iio_file(tree, label, "power"), milliwatts)
    reading = board.telemetry()
    assert reading.rails_mw == powers
    assert reading.total_power_mw == sum(powers.values())  # no input rail on AGX Xavier


def test_xavier_nx_total_is_its_input_rail_read_from_the_drivers_power(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "xavier-nx", 4)
    board = open_board(tree)
    tree.set(iio_file(tree, "VDD_IN", "voltage"), 5000)  # mV
    tree.set(iio_file(tree, "VDD_IN", "current"), 1200)  # mA
    tree.set(iio_file(tree, "VDD_IN", "power"), 6004)  # mW: the driver's, not 5000 x 1200
    reading = board.telemetry()
    assert reading.rails_mw["VDD_IN"] == 6004
    assert reading.total_power_mw == 6004
    assert set(reading.rails_mw) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}


def test_without_the_drivers_power_file_it_is_volts_times_amps(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "xavier-nx", 4)
    (tree.root / iio_file(tree, "VDD_SOC", "power")).unlink()
    tree.set(iio_file(tree, "VDD_SOC", "voltage"), 4960)
    tree.set(iio_file(tree, "VDD_SOC", "current"), 290)
    board = open_board(tree)
    assert board.telemetry().rails_mw["VDD_SOC"] == 4960 * 290 // 1000
    assert board.capabilities()["rails"] is None


def test_a_channel_without_its_files_is_left_out_and_reported(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "xavier-nx", 4)
    for kind in ("power", "voltage", "current"):
        (tree.root / iio_file(tree, "VDD_IN", kind)).unlink()
    board = open_board(tree)
    caps = board.capabilities()
    assert caps["rails"] is not None and caps["rails"].startswith("degraded: VDD_IN: no ")
    assert "in_voltage0_input" in caps["rails"]
    reading = board.telemetry()
    assert set(reading.rails_mw) == {"VDD_CPU_GPU_CV", "VDD_SOC"}
    # The input rail exists but cannot be read: the rails it feeds are not its total.
    assert reading.total_power_mw is None


@pytest.mark.parametrize("breakage", ["directory", "garbage", "vanished"])
def test_a_channel_unreadable_at_a_reading_is_reported_until_it_reads_again(
        tmp_path: Path, breakage: str) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    board = open_board(tree)
    path = tree.root / iio_file(tree, "CPU", "power")
    if breakage == "directory":  # a read fails for anyone, root included
        path.unlink()
        path.mkdir()
    elif breakage == "garbage":
        path.write_text("\n")  # empty, as a read mid-update can be
    else:
        path.unlink()
    reading = board.telemetry()
    assert "CPU" not in reading.rails_mw and {"GPU", "SOC", "SYS5V"} <= set(reading.rails_mw)
    assert reading.total_power_mw is None  # a sum missing one of its rails is no total
    problem = board.capabilities()["rails"]
    assert problem is not None and problem.startswith("degraded: CPU: ")
    assert "in_power1_input" in problem

    if path.is_dir():
        path.rmdir()
    path.write_text("1432\n")
    reading = board.telemetry()
    assert reading.rails_mw["CPU"] == 1432 and reading.total_power_mw is not None
    assert board.capabilities()["rails"] is None


def test_a_not_connected_channel_is_skipped(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    tree.set(f"{tree.rails['CV'][0]}/rail_name_{tree.rails['CV'][1]}", "NC")
    board = open_board(tree)
    assert "CV" not in board.telemetry().rails_mw and "NC" not in board.telemetry().rails_mw
    assert board.capabilities()["rails"] is None


def test_prometheus_shows_the_xavier_rails_in_watts(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    board = open_board(tree)
    tree.set(iio_file(tree, "GPU", "power"), 3150)
    reading = board.telemetry()
    metrics = PowerMetrics(lambda: {"state": "active", "states": ["active"], "decisions": 0,
                                    "wakes": 0, "wake_timeouts": 0, "telemetry": reading})
    text = generate_latest(metrics.registry).decode()
    assert 'edge_agent_power_rail_watts{rail="GPU"} 3.15' in text
    assert 'edge_agent_power_rail_watts{rail="SYS5V"}' in text


def test_power_status_on_the_xavier_tree_shows_the_rails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    tree.set(iio_file(tree, "GPU", "power"), 3150)
    no_daemon = ["--state-dir", str(tmp_path / "nothing-here"), "--root", str(tree.root)]
    assert main(["power", "status", *no_daemon]) == 0
    out = capsys.readouterr().out
    assert "  GPU: 3150 mW" in out and "  SYS5V: " in out and "rails:" not in out
    assert main(["power", "status", *no_daemon, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["telemetry"]["rails_mw"]["GPU"] == 3150
    assert set(shown["telemetry"]["rails_mw"]) == {"GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V"}

    # A channel that cannot be read is named, and the others still show.
    broken = tree.root / iio_file(tree, "SOC", "power")
    broken.unlink()
    broken.mkdir()
    assert main(["power", "status", *no_daemon]) == 0
    out = capsys.readouterr().out
    assert "  GPU: 3150 mW" in out and "  SOC:" not in out
    assert "rails: degraded: SOC: cannot read " in out


def test_a_monitor_directory_gone_is_no_monitor_not_a_crash(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-xavier", 4)
    shutil.rmtree(tree.root / tree.rails["GPU"][0])
    board = open_board(tree)
    reading = board.telemetry()
    assert set(reading.rails_mw) == {"CV", "VDDRQ", "SYS5V"}
