"""The one writer every board write goes through (power/io.py) and the rules a privileged
helper checks requests against (allowed_writes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import PowerError
from power.io import FileWriter, allowed_writes, read_text
from power.profiles import profile
from power.sim.tree import write_tree
from tests.power_boards import fake_board


def test_file_writer_replaces_the_value_without_a_newline(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    path = f"{tree.gpu_freq_dir}/max_freq"
    FileWriter(tree.root).write(path, "918000000")
    assert (tree.root / path).read_bytes() == b"918000000"
    assert read_text(tree.root, path) == "918000000"


def test_file_writer_never_creates_a_file(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    with pytest.raises(FileNotFoundError):
        FileWriter(tree.root).write(f"{tree.gpu_freq_dir}/max_freqq", "918000000")
    assert not (tree.root / tree.gpu_freq_dir / "max_freqq").exists()


@pytest.mark.parametrize("relpath", ["/sys/x", "sys/../etc/passwd", "", "sys//x", "sys/x/",
                                     "sys\\x", "./sys/x"])
def test_file_writer_refuses_paths_outside_the_root(tmp_path: Path, relpath: str) -> None:
    with pytest.raises(PowerError, match="relative"):
        FileWriter(tmp_path).write(relpath, "1")


@pytest.mark.parametrize("value", ["", " 1", "1\n", "1 2\n", "x" * 40])
def test_file_writer_refuses_odd_values(tmp_path: Path, value: str) -> None:
    tree = fake_board(tmp_path)
    with pytest.raises(PowerError, match="value"):
        FileWriter(tree.root).write(f"{tree.gpu_freq_dir}/max_freq", value)


def test_allowed_writes_lists_exactly_the_controls_of_an_orin_nano(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    rules = allowed_writes(tree.root)
    gpu = "sys/devices/platform/bus@0/17000000.gpu"
    emc = "sys/kernel/debug/bpmp/debug/clk/emc"
    cpu = "sys/devices/system/cpu/cpufreq"
    assert set(rules) == {
        f"{gpu}/devfreq/17000000.gpu/min_freq", f"{gpu}/devfreq/17000000.gpu/max_freq",
        f"{gpu}/railgate_enable", f"{gpu}/railgate_delay",
        f"{cpu}/policy0/scaling_min_freq", f"{cpu}/policy0/scaling_max_freq",
        f"{cpu}/policy4/scaling_min_freq", f"{cpu}/policy4/scaling_max_freq",
        f"{emc}/mrq_rate_locked", f"{emc}/rate"}
    gpu_max = rules[f"{gpu}/devfreq/17000000.gpu/max_freq"]
    assert gpu_max.check("1020000000") is None and gpu_max.check("306000000") is None
    assert gpu_max.check("1020000001") is not None and gpu_max.check("-1") is not None
    assert gpu_max.check("1e9") is not None
    assert rules[f"{emc}/rate"].check("3199000000") is None
    assert rules[f"{emc}/rate"].check("3000000000") is not None  # BPMP would drop it
    assert rules[f"{gpu}/railgate_enable"].check("0") is None
    assert rules[f"{gpu}/railgate_enable"].check("2") is not None
    delay = rules[f"{gpu}/railgate_delay"]  # ms
    assert delay.check("20") is None and delay.check("500") is None
    assert delay.check("-1") is not None and delay.check("60001") is not None
    assert delay.check("0.5") is not None
    assert rules[f"{cpu}/policy4/scaling_max_freq"].check("1728000") is None
    assert rules[f"{cpu}/policy4/scaling_max_freq"].check("1728001") is not None


def test_allowed_writes_follow_the_layout_of_jetpack_7_and_of_a_board_without_debugfs(
        tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "jp7", profile("orin-nano"), 7, debugfs=False)
    rules = allowed_writes(tree.root)
    railgate = "sys/devices/platform/17000000.gpu/power/control"
    assert railgate in rules and rules[railgate].check("auto") is None
    assert rules[railgate].check("1") is not None
    # No nvgpu railgate_delay there: runtime PM's own delay file (ms) takes its place.
    delay = "sys/devices/platform/17000000.gpu/power/autosuspend_delay_ms"
    assert delay in rules and rules[delay].check("10") is None
    assert not any(path.endswith("/railgate_delay") for path in rules)
    assert not any("debug" in path for path in rules)


def test_a_writer_with_rules_refuses_what_they_do_not_allow(tmp_path: Path) -> None:
    tree = fake_board(tmp_path)
    writer = FileWriter(tree.root, rules=allowed_writes(tree.root))
    writer.write(f"{tree.gpu_freq_dir}/max_freq", "612000000")
    assert read_text(tree.root, f"{tree.gpu_freq_dir}/max_freq") == "612000000"
    with pytest.raises(PowerError, match="not one the board layer writes"):
        writer.write("sys/class/hwmon/hwmon0/pwm1", "255")
    with pytest.raises(PowerError, match="refused"):
        writer.write(f"{tree.gpu_freq_dir}/max_freq", "2000000000")
    assert read_text(tree.root, f"{tree.gpu_freq_dir}/max_freq") == "612000000"
