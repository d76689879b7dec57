"""nvpmodel's configuration parsed from real excerpts, its query output, mode changes through the
command runner (and the ways the real tool misreports), and jetson_clocks' store/restore."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board
from power.commands import CommandResult, SubprocessRunner
from power.jetson_clocks import JetsonClocks
from power.nvpmodel import (
    Nvpmodel,
    NvpmodelUnavailable,
    parse_conf,
    parse_query,
    read_status,
)
from power.sim.commands import FakeCommands
from power.sim.kernel import FakeKernel
from power.sim.tree import render_nvpmodel_conf
from power.types import OperatingPoint
from tests.power_boards import fake_board

# The Orin Nano super configuration as docs/reference/jetson_sysfs_layout.md quotes it (the
# r35-style paths of NVIDIA's template, cores spelled out where the excerpt elides them).
NANO_SUPER_EXCERPT = """\
< PARAM TYPE=FILE NAME=CPU_ONLINE >
CORE_0 /sys/devices/system/cpu/cpu0/online
CORE_1 /sys/devices/system/cpu/cpu1/online
CORE_5 /sys/devices/system/cpu/cpu5/online
< PARAM TYPE=CLOCK NAME=CPU_A78_0 >
FREQ_TABLE /sys/devices/system/cpu/cpu0/cpufreq/scaling_available_frequencies
MAX_FREQ /sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq
MIN_FREQ /sys/devices/system/cpu/cpu0/cpufreq/scaling_min_freq
< PARAM TYPE=CLOCK NAME=GPU >
FREQ_TABLE /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/available_frequencies
MAX_FREQ /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/max_freq
MIN_FREQ /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/min_freq
< PARAM TYPE=CLOCK NAME=EMC >
MAX_FREQ /sys/kernel/nvpmodel_emc_cap/emc_iso_cap
< POWER_MODEL ID=0 NAME=15W >
CPU_ONLINE CORE_0 1
CPU_A78_0 MIN_FREQ 729600
CPU_A78_0 MAX_FREQ 1497600
GPU MIN_FREQ 0
GPU MAX_FREQ 612000000
EMC MAX_FREQ 2133000000
< POWER_MODEL ID=1 NAME=25W >
CPU_A78_0 MAX_FREQ 1344000
GPU MAX_FREQ 918000000
EMC MAX_FREQ 3199000000
< POWER_MODEL ID=2 NAME=MAXN_SUPER >
CPU_A78_0 MAX_FREQ -1
GPU MAX_FREQ -1
EMC MAX_FREQ -1
# the default is UNCONFIRMED on the devkit (0 or 1)
< PM_CONFIG DEFAULT=1 >
"""


def test_the_orin_nano_super_excerpt_parses_into_its_modes_and_caps() -> None:
    conf = parse_conf(NANO_SUPER_EXCERPT, source="nvpmodel_p3767_0003_super.conf")
    assert [(mode.mode_id, mode.name) for mode in conf.modes] == [
        (0, "15W"), (1, "25W"), (2, "MAXN_SUPER")]
    assert conf.default_mode == 1
    assert conf.params["GPU"].kind == "CLOCK"
    assert conf.params["CPU_ONLINE"].paths["CORE_5"] == "/sys/devices/system/cpu/cpu5/online"
    fifteen, twenty_five, maxn = conf.modes
    assert fifteen.cap("GPU") == 612000000 and fifteen.cap("EMC") == 2133000000
    assert fifteen.value("CPU_A78_0", "MIN_FREQ") == 729600
    assert twenty_five.cap("CPU_A78_0") == 1344000
    assert maxn.cap("GPU") is None and maxn.cap("EMC") is None  # -1: no cap


def test_agx_orin_caps_use_the_other_no_cap_spellings() -> None:
    conf = parse_conf("""\
< PARAM TYPE=CLOCK NAME=GPU >
MAX_FREQ /sys/devices/17000000.ga10b/devfreq/17000000.ga10b/max_freq
< PARAM TYPE=CLOCK NAME=EMC >
MAX_FREQ /sys/kernel/nvpmodel_emc_cap/emc_iso_cap
< POWER_MODEL ID=0 NAME=MAXN >
GPU MAX_FREQ 2147483647
EMC MAX_FREQ 0
< POWER_MODEL ID=2 NAME=MODE_30W >
GPU MAX_FREQ 624750000
< PM_CONFIG DEFAULT=2 >
""")
    assert conf.mode(0).cap("GPU") is None and conf.mode(0).cap("EMC") is None
    assert conf.mode(2).cap("GPU") == 624750000 and conf.default_mode == 2
    with pytest.raises(PowerError, match="no such nvpmodel mode"):
        conf.mode(1)


@pytest.mark.parametrize(("text", "message"), [
    ("< POWER_MODEL ID=0 NAME=X >\n", "PM_CONFIG"),
    (("< PARAM TYPE=CLOCK NAME=GPU >\nMAX_FREQ /x\n< POWER_MODEL ID=0 NAME=A >\n"
      "GPU MAX_FREQ fast\n< PM_CONFIG DEFAULT=0 >\n"), "integer"),
    ("< POWER_MODEL ID=0 NAME=A >\nCPU MAX_FREQ 1\n< PM_CONFIG DEFAULT=0 >\n", "undeclared"),
    ("CORE_0 /sys/x\n", "before any section"),
    ("< POWER_MODEL NAME=A >\n", "numeric ID"),
    ("< PARAM TYPE=CLOCK NAME=GPU\n", "section header"),
    (("< PARAM TYPE=CLOCK NAME=GPU >\nMAX_FREQ /x\n< POWER_MODEL ID=0 NAME=A >\n"
      "< PM_CONFIG DEFAULT=3 >\n"), "default mode"),
])
def test_a_malformed_configuration_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(PowerError, match=message):
        parse_conf(text)


def test_query_output_with_a_warning_first_and_the_verbose_form() -> None:
    assert parse_query("NVPM WARN: fan mode is not set!\nNV Power Mode: 15W\n0\n") == (0, "15W")
    verbose = ("NVPM VERB: Config file: /etc/nvpmodel.conf\n"
               "NVPM VERB: parsing done for /etc/nvpmodel.conf\n"
               "NVPM VERB: Current mode: NV Power Mode: MAXN_SUPER\n2\n"
               "NVPM VERB: PARAM GPU: ARG MAX_FREQ: PATH /sys/devices/platform/17000000.gpu/"
               "devfreq_dev/max_freq: REAL_VAL: 1020000000 CONF_VAL: 9223372036854775807\n")
    assert parse_query(verbose) == (2, "MAXN_SUPER")
    with pytest.raises(PowerError, match="could not read the mode"):
        parse_query("NVPM ERROR: something\n")


def test_every_generated_conf_round_trips_through_the_parser(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6)
    conf = parse_conf(render_nvpmodel_conf(tree.board, tree.layout, tree.gpu_freq_dir))
    assert [mode.name for mode in conf.modes] == ["MAXN", "MODE_15W", "MODE_30W", "MODE_50W"]
    assert conf.mode(1).value("CPU_ONLINE", "CORE_4") == 0  # 15W keeps 4 cores
    assert conf.mode(1).cap("CPU_A78_2") == 1113600


@pytest.mark.parametrize(("name", "jetpack", "high", "low"), [
    ("orin-nano", 6, 2, 0), ("xavier-nx", 4, 2, 4), ("agx-orin-64gb", 5, 0, 1)])
def test_set_mode_writes_the_modes_caps_through_the_kernel(tmp_path: Path, name: str,
                                                           jetpack: int, high: int,
                                                           low: int) -> None:
    tree = fake_board(tmp_path, name, jetpack)
    kernel = FakeKernel(tree.root, jetpack)
    nvpmodel = Nvpmodel(tree.root, FakeCommands(tree.root, kernel))
    for mode_id in (high, low, high):
        nvpmodel.set_mode(mode_id)
        assert read_status(tree.root) == mode_id
        assert nvpmodel.query()[0] == mode_id
        mode = tree.board.mode(mode_id)
        assert int(tree.get(f"{tree.gpu_freq_dir}/max_freq")) == (
            mode.gpu_max_hz or tree.board.gpu_hz[-1])
        assert int(tree.get(f"{tree.policies[0]}/scaling_max_freq")) == (
            mode.cpu_max_khz or tree.board.cpu_khz[-1])
        online = mode.cpus_online or tree.board.cpus
        assert tree.get(f"sys/devices/system/cpu/cpu{tree.board.cpus - 1}/online") == (
            "1" if online == tree.board.cpus else "0")


def test_a_mode_that_needs_a_reboot_is_caught_although_nvpmodel_says_yes(tmp_path: Path
                                                                         ) -> None:
    tree = fake_board(tmp_path, "orin-nx-16gb", 6)
    runner = FakeCommands(tree.root, FakeKernel(tree.root, 6), reboot_modes=frozenset({0}))
    with pytest.raises(PowerError, match="did not change"):
        Nvpmodel(tree.root, runner).set_mode(0)


def test_set_mode_failures(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    user = FakeCommands(tree.root, FakeKernel(tree.root, 6), as_root=False)
    with pytest.raises(NvpmodelUnavailable, match="needs root") as caught:
        Nvpmodel(tree.root, user).set_mode(2)
    assert "Permission denied" in str(caught.value)
    root = FakeCommands(tree.root, FakeKernel(tree.root, 6))
    with pytest.raises(PowerError, match="no such nvpmodel mode"):
        Nvpmodel(tree.root, root).set_mode(7)
    assert root.calls == []  # refused before running anything

    class Missing:
        def run(self, argv: object, *, timeout_s: float = 30.0) -> CommandResult:
            return CommandResult(argv=("nvpmodel",), returncode=127)

    with pytest.raises(NvpmodelUnavailable, match="not installed"):
        Nvpmodel(tree.root, Missing()).set_mode(2)


def test_board_apply_through_nvpmodel_then_clocks(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    kernel = FakeKernel(tree.root, 6)
    board = Board.open(tree.root, writer=kernel, runner=FakeCommands(tree.root, kernel))
    result = board.apply(OperatingPoint(nvpmodel_mode=0, gpu_min_hz=408000000))
    assert result.ok and result.applied.nvpmodel_mode == 0
    assert (result.applied.gpu_min_hz, result.applied.gpu_max_hz) == (408000000, 612000000)
    failing = Board.open(tree.root, writer=kernel, runner=FakeCommands(
        tree.root, kernel, reboot_modes=frozenset({2})))
    result = failing.apply(OperatingPoint(nvpmodel_mode=2))
    assert [(m.path, m.wanted, m.found) for m in result.mismatches] == [
        ("var/lib/nvpmodel/status", 2, 0)]


def test_jetson_clocks_pin_store_restore_and_the_board_unlocks_the_emc(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    kernel = FakeKernel(tree.root, 6)
    runner = FakeCommands(tree.root, kernel)
    board = Board.open(tree.root, writer=kernel, runner=runner)
    before = board.snapshot()
    clocks = JetsonClocks(runner)
    stored = tmp_path / "l4t_dfs.conf"
    clocks.store(stored)
    clocks.pin()
    pinned = board.read_point()
    assert pinned.gpu_min_hz == pinned.gpu_max_hz == 918000000  # 25W's cap
    assert pinned.emc_hz == 3199000000 and tree.get(f"{tree.fan_pwm}/pwm1") == "255"
    assert "GPU MinFreq=918000000 MaxFreq=918000000" in clocks.show()
    clocks.restore(stored)
    assert tree.get("sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked") == "1"  # the quirk
    assert board.restore(before).ok and board.snapshot() == before
    with pytest.raises(PowerError, match="no jetson_clocks settings"):
        clocks.restore(tmp_path / "absent.conf")
    with pytest.raises(PowerError, match="jetson_clocks failed"):
        JetsonClocks(FakeCommands(tree.root, kernel, as_root=False)).pin()


def test_the_subprocess_runner_reports_missing_commands_and_output() -> None:
    runner = SubprocessRunner()
    assert runner.run(["/nonexistent/nvpmodel", "-q"]).returncode == 127
    done = runner.run([sys.executable, "-c", "print('NV Power Mode: 15W'); print(0)"])
    assert done.returncode == 0 and parse_query(done.stdout) == (0, "15W")
    slow = runner.run([sys.executable, "-c", "import time; time.sleep(5)"], timeout_s=0.2)
    assert slow.returncode == 124


# NVIDIA's Orin template (MLPerf's nvpmodel_orin.py writes these): the GPU's runtime power
# management is forced "on" around the clock changes and handed back ("auto") after them.
GPU_POWER_CONTROL_EXCERPT = """\
< PARAM TYPE=FILE NAME=GPU_POWER_CONTROL_ENABLE >
GPU_PWR_CNTL_EN /sys/devices/platform/bus@0/17000000.gpu/power/control
< PARAM TYPE=FILE NAME=GPU_POWER_CONTROL_DISABLE >
GPU_PWR_CNTL_DIS /sys/devices/platform/bus@0/17000000.gpu/power/control
< PARAM TYPE=CLOCK NAME=GPU >
FREQ_TABLE /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/available_frequencies
MAX_FREQ /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/max_freq
MIN_FREQ /sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu/min_freq
MAX_FREQ_KNEXT /sys/devices/platform/17000000.gpu/devfreq_dev/max_freq
< POWER_MODEL ID=0 NAME=15W >
GPU_POWER_CONTROL_ENABLE GPU_PWR_CNTL_EN on
GPU MIN_FREQ 0
GPU MAX_FREQ 612000000
GPU_POWER_CONTROL_DISABLE GPU_PWR_CNTL_DIS auto
< PM_CONFIG DEFAULT=0 >
"""


def test_word_values_parse_and_the_fake_writes_them_around_the_clocks(tmp_path: Path) -> None:
    conf = parse_conf(GPU_POWER_CONTROL_EXCERPT)
    assert conf.mode(0).value("GPU_POWER_CONTROL_ENABLE", "GPU_PWR_CNTL_EN") == "on"
    assert conf.mode(0).cap("GPU") == 612000000
    assert conf.params["GPU"].paths["MAX_FREQ_KNEXT"].endswith("devfreq_dev/max_freq")
    with pytest.raises(PowerError, match="needs an integer frequency"):
        parse_conf(GPU_POWER_CONTROL_EXCERPT.replace("MAX_FREQ 612000000", "MAX_FREQ high"))

    tree = fake_board(tmp_path, "orin-nano", 6)
    (tree.root / "etc/nvpmodel.conf").unlink()
    (tree.root / "etc/nvpmodel.conf").write_text(GPU_POWER_CONTROL_EXCERPT)
    kernel = FakeKernel(tree.root, 6)
    Nvpmodel(tree.root, FakeCommands(tree.root, kernel)).set_mode(0)
    assert [(path.rsplit("/", 1)[1], value) for path, value in kernel.log] == [
        ("control", "on"), ("max_freq", "612000000"), ("control", "auto")]
