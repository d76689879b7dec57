"""nvpmodel as a fleet meets it: a configuration saved by an editor, the tool missing or refused
for want of root (the board stops asking), and another writer changing a limit between the
board layer's write and its read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import PowerError
from power.board import Board
from power.commands import CommandResult
from power.jetson_clocks import JetsonClocks
from power.nvpmodel import parse_conf, parse_query
from power.sim.commands import FakeCommands
from power.sim.kernel import FakeKernel
from power.types import OperatingPoint
from tests.power_boards import fake_board


def test_a_configuration_with_a_byte_order_mark_parses(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    text = (tree.root / "etc/nvpmodel.conf").read_text()
    conf = parse_conf("\ufeff" + text.replace("\n", "\r\n"))
    assert [mode.name for mode in conf.modes] == ["15W", "25W", "MAXN_SUPER", "7W"]


class MissingCommands:
    """A board with nvpmodel's configuration but no nvpmodel binary (a container image)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv: object, *, timeout_s: float = 30.0) -> CommandResult:
        args = tuple(argv)  # type: ignore[call-overload]
        self.calls.append(args)
        return CommandResult(argv=args, returncode=127, stderr=f"{args[0]}: command not found")


def test_nvpmodel_not_installed_degrades_it_and_is_not_run_again(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    runner = MissingCommands()
    board = Board.open(tree.root, writer=FakeKernel(tree.root, 6), runner=runner)
    assert board.usable("nvpmodel")
    first = board.apply(OperatingPoint(nvpmodel_mode=0, gpu_max_hz=612000000))
    assert not first.mismatches and first.applied.gpu_max_hz == 612000000
    assert any("not installed" in reason for reason in first.unsupported)
    assert "not installed" in (board.capabilities()["nvpmodel"] or "")
    second = board.apply(OperatingPoint(nvpmodel_mode=0))
    assert len(runner.calls) == 1
    assert second.unsupported and not second.mismatches


def test_nvpmodel_refused_for_want_of_root_degrades_it(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    kernel = FakeKernel(tree.root, 6)
    commands = FakeCommands(tree.root, kernel, as_root=False)
    board = Board.open(tree.root, writer=kernel, runner=commands)
    result = board.apply(OperatingPoint(nvpmodel_mode=0))
    assert "root" in (board.capabilities()["nvpmodel"] or "")
    assert not result.mismatches
    board.apply(OperatingPoint(nvpmodel_mode=0))
    assert len(commands.calls) == 1


def test_a_mode_that_fails_for_another_reason_stays_a_mismatch(tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nx-16gb", 6)
    kernel = FakeKernel(tree.root, 6)
    commands = FakeCommands(tree.root, kernel, reboot_modes=frozenset({1}))
    board = Board.open(tree.root, writer=kernel, runner=commands)
    result = board.apply(OperatingPoint(nvpmodel_mode=1))
    assert [m.path for m in result.mismatches] == ["var/lib/nvpmodel/status"]
    assert board.usable("nvpmodel")  # another mode may still switch


class RacingWriter:
    """The kernel, with nvpmodel lowering the GPU's cap right after the board layer's write."""

    def __init__(self, kernel: FakeKernel, max_path: str, cap_hz: int) -> None:
        self.kernel = kernel
        self.max_path = max_path
        self.cap_hz = cap_hz

    def write(self, relpath: str, value: str) -> None:
        self.kernel.write(relpath, value)
        if relpath == self.max_path:
            self.kernel.write(relpath, str(self.cap_hz))


def test_a_limit_changed_by_another_writer_before_the_read_back_is_a_mismatch(
        tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "orin-nano", 6)
    max_path = f"{tree.gpu_freq_dir}/max_freq"
    kernel = FakeKernel(tree.root, 6)
    board = Board.open(tree.root, writer=RacingWriter(kernel, max_path, 408000000))
    result = board.apply(OperatingPoint(gpu_min_hz=612000000, gpu_max_hz=1020000000))
    found = {(m.path, m.wanted, m.found) for m in result.mismatches}
    # The clamping kernel lowers the minimum with the cap: both are reported, as read.
    assert (max_path, 1020000000, 408000000) in found
    assert result.applied.gpu_max_hz == 408000000
    assert board.usable("gpu")


def test_jetson_clocks_pins_the_online_clusters_of_a_mode_with_cpus_offline(
        tmp_path: Path) -> None:
    tree = fake_board(tmp_path, "agx-orin-64gb", 6, mode_id=1)  # MODE_15W: cpu4-11 offline
    kernel = FakeKernel(tree.root, 6)
    clocks = JetsonClocks(FakeCommands(tree.root, kernel))
    stored = tmp_path / "clocks.conf"
    clocks.store(stored)
    assert "policy4" not in stored.read_text()
    clocks.pin()
    policy0 = tree.policies[0]
    assert tree.get(f"{policy0}/scaling_min_freq") == tree.get(f"{policy0}/scaling_max_freq")
    assert tree.get(f"{tree.gpu_freq_dir}/min_freq") == tree.get(f"{tree.gpu_freq_dir}/max_freq")
    clocks.restore(stored)
    assert tree.get(f"{policy0}/scaling_min_freq") == "729600"


@pytest.mark.parametrize(("output", "expected"), [
    ("NV Power Mode: 15W\r\n0\r\n", (0, "15W")),
    ("NV Fan Mode:quiet\nNV Power Mode: MODE_10W\n1\n", (1, "MODE_10W")),  # r32 prints the fan
    ("NVPM WARN: fan mode is not set!\nNV Power Mode: 25W\n  1  \n", (1, "25W")),
    (("NVPM VERB: Config file: /etc/nvpmodel.conf\nNVPM VERB: Current mode: NV Power Mode: "
      "MAXN_SUPER\n2\nNVPM VERB: PARAM GPU: ARG MAX_FREQ: PATH /sys/x: REAL_VAL: 1020000000 "
      "CONF_VAL: 9223372036854775807\n"), (2, "MAXN_SUPER")),
])
def test_query_output_variants(output: str, expected: tuple[int, str]) -> None:
    assert parse_query(output) == expected


@pytest.mark.parametrize("output", ["", "NVPM ERROR: failed to parse /etc/nvpmodel.conf\n",
                                    "0\nNV Power Mode: 15W\n"])
def test_query_output_without_a_mode_is_a_clear_error(output: str) -> None:
    with pytest.raises(PowerError, match="could not read the mode"):
        parse_query(output)
