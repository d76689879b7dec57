"""The board's identity and its sysfs groups, on fake trees of every profile and JetPack release:
detection, discovery of each group's files, units as the kernel writes them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.errors import MissingDependencyError, PowerError
from power.board import Board, jetpack_of, parse_release
from power.profiles import ALIASES, PROFILES, identify, profile
from power.sim.kernel import FakeKernel
from power.sim.tree import write_tree
from power.sysfs.discover import discover, read_device_tree
from power.sysfs.thermal import zone_name
from power.telemetry import JtopTelemetry, SysfsTelemetry, open_telemetry
from tests.power_boards import BOARD_RELEASES, board_ids, fake_board


@pytest.mark.parametrize(("name", "jetpack"), BOARD_RELEASES, ids=board_ids())
def test_every_profile_and_release_is_detected_with_its_tables(tmp_path: Path, name: str,
                                                               jetpack: int) -> None:
    tree = fake_board(tmp_path, name, jetpack)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, jetpack))
    assert board.profile is PROFILES[name]
    assert board.jetpack == jetpack
    table = board.clock_table()
    assert table.gpu_hz == PROFILES[name].gpu_hz
    assert table.cpu_khz == PROFILES[name].cpu_khz
    assert table.emc_hz == PROFILES[name].emc_hz
    assert [mode_id for mode_id, _ in table.nvpmodel_modes] == [
        mode.mode_id for mode in PROFILES[name].modes]
    assert len(board.cpu) == len(PROFILES[name].cpu_policies)
    assert board.paths.gpu is not None and board.paths.gpu.freq_dir == tree.gpu_freq_dir
    assert all(reason is None for reason in board.capabilities().values()), \
        board.capabilities()


def test_orin_nano_means_the_super_configuration() -> None:
    assert ALIASES["orin-nano"] == "orin-nano-super"
    board = profile("orin-nano")
    assert board.super_modes and board.gpu_hz[-1] == 1020000000
    assert [mode.name for mode in board.modes] == ["15W", "25W", "MAXN_SUPER", "7W"]


def test_the_super_device_tree_tells_the_two_orin_nano_configurations_apart() -> None:
    assert identify(("nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005",
                     "nvidia,tegra234")) is PROFILES["orin-nano-super"]
    assert identify(("nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005",
                     "nvidia,tegra234")) is PROFILES["orin-nano-8gb"]
    # A third-party carrier board with the same module: matched by the module's entry.
    assert identify(("acme,carrier+p3767-0005", "nvidia,p3767-0005",
                     "nvidia,tegra234")) is PROFILES["orin-nano-8gb"]
    assert identify(("nvidia,p3999", "nvidia,tegra239")) is None
    assert identify(()) is None


def test_an_unknown_profile_name_lists_the_known_ones() -> None:
    with pytest.raises(PowerError, match="unknown board profile") as caught:
        profile("orin-nanoo")
    assert "orin-nano-super" in str(caught.value)


def test_a_board_outside_the_profiles_runs_from_its_own_files(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nx-16gb", 6)
    compatible = tree.root / "sys/firmware/devicetree/base/compatible"
    compatible.write_bytes(b"acme,robot-9000\0nvidia,p3999-0001\0nvidia,tegra234\0")
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    assert board.profile is None and board.name.startswith("unknown (")
    assert board.clock_table().gpu_hz == PROFILES["orin-nx-16gb"].gpu_hz


def test_a_machine_that_is_no_jetson_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "sys/devices/system/cpu/cpufreq/policy0").mkdir(parents=True)
    with pytest.raises(PowerError, match="no Jetson board here"):
        Board.open(tmp_path)


def test_device_tree_strings_and_release(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    assert read_device_tree(tree.root, "model") == ("NVIDIA Jetson AGX Orin Developer Kit",)
    assert read_device_tree(tree.root, "compatible")[0] == "nvidia,p3737-0000+p3701-0005"
    assert parse_release("# R36 (release), REVISION: 4.3, GCID: 1, BOARD: generic") == "R36.4.3"
    assert parse_release("garbage") is None
    assert [jetpack_of(r) for r in ("R32.7.4", "R35.4.1", "R36.4.3", "R38.2.0", "R39.1")] == [
        4, 5, 6, 7, 7]


def test_the_releases_lay_the_gpu_out_differently_and_discovery_follows(tmp_path: Path) -> None:
    dirs = {}
    for jetpack in (5, 6, 7):
        tree = write_tree(tmp_path / f"jp{jetpack}", profile("orin-nx-16gb"), jetpack)
        paths = discover(tree.root)
        assert paths.gpu is not None
        dirs[jetpack] = (paths.gpu.freq_dir, paths.gpu.railgate_file)
    assert dirs[5] == ("sys/devices/17000000.ga10b/devfreq/17000000.ga10b",
                       "sys/devices/17000000.ga10b/railgate_enable")
    assert dirs[6] == ("sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu",
                       "sys/devices/platform/bus@0/17000000.gpu/railgate_enable")
    assert dirs[7] == ("sys/devices/platform/17000000.gpu/devfreq/17000000.gpu",
                       "sys/devices/platform/17000000.gpu/power/control")
    assert not (tmp_path / "jp7" / "sys/devices/platform/17000000.gpu/enable_3d_scaling").exists()


def test_a_devfreq_entry_that_is_a_plain_directory_is_not_the_gpu(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    link = tree.root / "sys/class/devfreq/17000000.gpu"
    link.unlink()
    link.mkdir()
    (link / "device").mkdir()
    assert discover(tree.root).gpu is None


def test_telemetry_in_the_kernels_units(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    tree.set(f"{tree.gpu_device_dir}/load", 353)  # per-mille
    tree.set(f"{tree.gpu_freq_dir}/cur_freq", 918000000)
    tree.set(f"{tree.gpu_device_dir}/power/runtime_status", "active")
    tree.set(f"{tree.zones['tj-thermal']}/temp", 71250)  # m°C
    hwmon, channel = tree.rails["VDD_IN"]
    tree.set(f"{hwmon}/in{channel}_input", 5000)  # mV
    tree.set(f"{hwmon}/curr{channel}_input", 2000)  # mA
    reading = board.telemetry()
    assert reading.gpu_load == pytest.approx(0.353)
    assert reading.gpu_freq_hz == 918000000 and reading.gpu_railgated is False
    assert reading.cpu_freq_khz == (1344000, 1344000)  # the 25W cap, both clusters
    assert reading.emc_hz == 3199000000
    zones = {zone.name: zone for zone in reading.thermal}
    assert zones["tj"].temp_c == pytest.approx(71.25)
    assert zones["tj"].trips_c == (("passive", 99.0), ("critical", 104.5))
    assert zones["cv0"].temp_c is None  # unreadable on the Orin Nano, not -256
    assert reading.rails_mw["VDD_IN"] == 10000
    assert reading.total_power_mw == 10000  # VDD_IN, not the sum
    assert reading.hottest_margin_c() == pytest.approx(99.0 - 71.25)
    assert reading.nvpmodel_mode == 1 and reading.source == "sysfs"


def test_agx_orin_total_is_the_sum_of_its_connected_rails(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    reading = board.telemetry()
    assert set(reading.rails_mw) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0",
                                     "VDDQ_VDD2_1V8AO"}  # the NC channels are skipped
    assert reading.total_power_mw == sum(reading.rails_mw.values())
    assert {zone.name for zone in reading.thermal if zone.temp_c is None} == set()


def test_trip_points_come_from_the_zone_files(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6, trips_c=(("active", 60.0), ("hot", 85.0),
                                                         ("critical", 97.0)))
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    zone = next(zone for zone in board.telemetry().thermal if zone.name == "cpu")
    # The active trip (a fan level) is not a limit: only hot and critical are kept.
    assert zone.trips_c == (("hot", 85.0), ("critical", 97.0))


def test_release_5_zone_names_are_normalised(tmp_path: Path) -> None:
    assert [zone_name(n) for n in ("CPU-therm", "tj-therm", "cpu-thermal", "PMIC-Die")] == [
        "cpu", "tj", "cpu", "PMIC-Die"]
    tree = fake_board(tmp_path, "orin-nano-8gb", 5)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 5))
    assert [zone.name for zone in board.telemetry().thermal][:3] == ["cpu", "gpu", "cv0"]


def test_fan_reads_pwm_and_rpm(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    assert board.fan.pwm() == 62 and board.fan.rpm() == 1636


# -- telemetry through jtop (jetson-stats), which must never be depended on -----------------

class JtopException(Exception):
    """jtop's own error type (raised when its service is not active)."""


class FakeJtop:
    """jtop's client as jetson-stats 4 shapes it: start() connects to the root service (raising
    JtopException when it is not running), ok() is False once the service went away."""

    service_running = True

    def __init__(self) -> None:
        self.started = self.closed = False
        self.alive = True
        self.power: dict[str, object] = {
            "rail": {"VDD_IN": {"volt": 5000, "curr": 1500, "power": 7500, "online": True},
                     "VDD_SOC": {"volt": 5000, "curr": 300, "power": 1500, "online": True}},
            "tot": {"power": 7500, "name": "VDD_IN"}}
        self.temperature = {"cpu": {"temp": 51.5, "online": True},
                            "cv0": {"temp": -256.0, "online": False},
                            "tj": {"temp": 53.0, "online": True}}
        self.memory = {"EMC": {"cur": 2133000, "max": 3199000, "online": True}}

    def start(self) -> None:
        if not self.service_running:
            raise JtopException("The jtop.service is not active. Please run:\n"
                                "sudo systemctl restart jtop.service")
        self.started = True

    def ok(self) -> bool:
        if not self.alive:
            raise JtopException("jtop.service crashed")
        return self.started

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_jtop_module(monkeypatch: pytest.MonkeyPatch) -> type[FakeJtop]:
    import types

    module = types.ModuleType("jtop")
    module.jtop = FakeJtop  # type: ignore[attr-defined]
    module.JtopException = JtopException  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jtop", module)
    FakeJtop.service_running = True
    return FakeJtop


def test_jtop_supplies_rails_temperatures_and_emc_and_sysfs_the_clocks(
        tmp_path: Path, fake_jtop_module: type[FakeJtop]) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    tree.set(f"{tree.gpu_freq_dir}/cur_freq", 714000000)
    source = open_telemetry(board, "auto")
    assert isinstance(source, JtopTelemetry)
    reading = source.read()
    assert reading.source == "jtop" and reading.gpu_freq_hz == 714000000
    assert reading.rails_mw == {"VDD_IN": 7500, "VDD_SOC": 1500}
    assert reading.total_power_mw == 7500 and reading.emc_hz == 2133000000
    zones = {zone.name: zone for zone in reading.thermal}
    assert zones["cpu"].temp_c == 51.5 and zones["cv0"].temp_c is None
    assert zones["tj"].trips_c == (("passive", 99.0), ("critical", 104.5))  # from sysfs


def test_a_jtop_that_crashes_mid_run_falls_back_to_sysfs_for_good(
        tmp_path: Path, fake_jtop_module: type[FakeJtop]) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    source = open_telemetry(board, "jtop")
    assert isinstance(source, JtopTelemetry)
    source.jetson.alive = False
    reading = source.read()
    assert reading.source == "sysfs" and reading.rails_mw["VDD_IN"] == 4801
    assert source.failed == "jtop.service crashed" and source.jetson.closed
    source.jetson.alive = True  # never goes back to a service that crashed once
    assert source.read().source == "sysfs"


def test_without_jtop_or_its_service_auto_uses_sysfs_and_jtop_says_why(
        tmp_path: Path, fake_jtop_module: type[FakeJtop], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    FakeJtop.service_running = False
    assert isinstance(open_telemetry(board, "auto"), SysfsTelemetry)
    with pytest.raises(PowerError, match="jtop service cannot be used"):
        open_telemetry(board, "jtop")
    monkeypatch.setitem(sys.modules, "jtop", None)  # not installed: import fails
    assert open_telemetry(board, "auto").read().source == "sysfs"
    with pytest.raises(MissingDependencyError, match=r"jetson-edge-agent\[jetson\]"):
        open_telemetry(board, "jtop")
    with pytest.raises(PowerError, match="unknown telemetry source"):
        open_telemetry(board, "tegrastats")


def test_describe_says_what_the_board_is_and_cannot_do(tmp_path: Path) -> None:
    import json

    tree = fake_board(tmp_path, "orin-nano", 6, debugfs=False)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    described = json.loads(json.dumps(board.describe()))
    assert described["board"] == "orin-nano-super" and described["release"] == "R36.4.3"
    assert described["jetpack"] == 6 and described["emc_hz"] == []
    assert described["nvpmodel_modes"]["2"] == "MAXN_SUPER"
    assert described["capabilities"]["emc"].startswith("no EMC control in debugfs")
    assert described["capabilities"]["gpu"] is None


def test_an_unreadable_cpu_policy_keeps_the_others_in_their_places(tmp_path: Path) -> None:
    from agent.metrics import _telemetry_families

    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6))
    before = board.telemetry().cpu_freq_khz
    assert len(before) == 3 and None not in before
    (tree.root / "sys/devices/system/cpu/cpufreq/policy4/scaling_cur_freq").unlink()
    reading = board.telemetry()
    assert reading.cpu_freq_khz == (before[0], None, before[2])  # the third stays the third
    families = {family.name: family for family in _telemetry_families(reading)}
    labels = {sample.labels["clock"]: sample.value
              for sample in families["edge_agent_power_frequency_hertz"].samples}
    assert labels["cpu0"] == before[0] * 1000.0 and labels["cpu2"] == before[2] * 1000.0
    assert "cpu1" not in labels
