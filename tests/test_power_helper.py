"""The privileged power helper (power/helper.py) and its client (power/helper_client.py), over a
real Unix socket, against a fake Orin Nano tree (power/sim/tree.py): what it writes, what it
refuses and why, who it serves, and that the board is put back when the daemon goes away."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.errors import PowerError
from power.helper import PowerHelper, _restore_order
from power.commands import CommandResult
from power.helper_client import HelperRunner, HelperWriter
from power.io import FileWriter, allowed_writes, read_text
from power.sim.commands import FakeCommands
from power.profiles import profile
from power.sim.tree import write_tree
from tests.power_boards import serve_helper

REPO = Path(__file__).resolve().parents[1]
GPU = "sys/devices/platform/bus@0/17000000.gpu"
GPU_MIN = f"{GPU}/devfreq/17000000.gpu/min_freq"
GPU_MAX = f"{GPU}/devfreq/17000000.gpu/max_freq"
CPU0_MAX = "sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq"
CPU0_MIN = "sys/devices/system/cpu/cpufreq/policy0/scaling_min_freq"
RAILGATE = f"{GPU}/railgate_enable"
EMC_RATE = "sys/kernel/debug/bpmp/debug/clk/emc/rate"
STATUS = "var/lib/nvpmodel/status"


@dataclass
class Running:
    helper: PowerHelper
    socket_path: Path
    root: Path
    nvpmodel: FakeCommands
    stop: threading.Event
    thread: threading.Thread


@pytest.fixture
def board(tmp_path: Path) -> Path:
    root = tmp_path / "board"
    write_tree(root, profile("orin-nano"), jetpack=6)
    return root


def start(board: Path, tmp_path: Path, *, uid: int | None = None) -> Running:
    nvpmodel = FakeCommands(board, FileWriter(board))  # the strict nvpmodel, as root
    helper = PowerHelper(board, allowed_uid=os.getuid() if uid is None else uid,
                         runner=nvpmodel)
    path = tmp_path / "power.sock"
    stop, thread = serve_helper(helper, path)
    return Running(helper, path, board, nvpmodel, stop, thread)


@pytest.fixture
def running(board: Path, tmp_path: Path) -> Iterator[Running]:
    served = start(board, tmp_path)
    yield served
    served.stop.set()
    served.thread.join(timeout=10)
    assert not served.thread.is_alive()


def wait_for(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def raw_call(path: Path, *lines: bytes) -> list[dict[str, object]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5)
        connection.connect(str(path))
        connection.sendall(b"".join(lines))
        reader = connection.makefile("rb")
        return [json.loads(reader.readline()) for _ in lines]


def test_hello_names_the_board_its_files_and_modes(running: Running) -> None:
    with HelperWriter(running.socket_path) as writer:
        hello = writer.hello()
    assert hello["board"] == "orin-nano-super"
    assert hello["paths"] == sorted(allowed_writes(running.root))
    assert hello["modes"] == [0, 1, 2, 3]


def test_allowed_writes_are_made_and_the_board_restored_when_the_daemon_goes(
        running: Running) -> None:
    root = running.root
    before = {path: read_text(root, path) for path in (GPU_MIN, GPU_MAX, CPU0_MAX, RAILGATE)}
    writer = HelperWriter(running.socket_path)
    writer.write(GPU_MIN, "612000000")
    writer.write(GPU_MAX, "1020000000")
    writer.write(CPU0_MAX, "1728000")
    writer.write(RAILGATE, "0")
    writer.write(GPU_MIN, "714000000")  # a second change keeps the first snapshot
    assert read_text(root, GPU_MIN) == "714000000"
    assert read_text(root, GPU_MAX) == "1020000000"
    assert read_text(root, CPU0_MAX) == "1728000"
    assert read_text(root, RAILGATE) == "0"
    writer.close()  # the daemon stops (or dies): its connection closes
    wait_for(lambda: read_text(root, GPU_MIN) == before[GPU_MIN]
             and read_text(root, RAILGATE) == before[RAILGATE])
    assert {path: read_text(root, path) for path in before} == before


def test_a_daemon_killed_outright_gets_the_board_restored(board: Path, tmp_path: Path) -> None:
    served = start(board, tmp_path)
    before = read_text(board, GPU_MAX)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom power.helper_client import HelperWriter\n"
         f"w = HelperWriter({str(served.socket_path)!r})\n"
         f"w.write({GPU_MAX!r}, '306000000')\nprint('written', flush=True)\ntime.sleep(60)\n"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
        assert read_text(board, GPU_MAX) == "306000000"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        wait_for(lambda: read_text(board, GPU_MAX) == before)
    finally:
        child.kill()
        served.stop.set()
        served.thread.join(timeout=10)


@pytest.mark.parametrize(("path", "value", "reason"), [
    (GPU_MAX, "2000000000", "outside 306000000..1020000000"),
    (GPU_MAX, "fast", "expected a decimal integer"),
    (RAILGATE, "2", "expected one of"),
    (EMC_RATE, "1234", "not one of the rates"),
])
def test_values_outside_the_board_tables_are_refused_with_the_reason(
        running: Running, path: str, value: str, reason: str) -> None:
    before = read_text(running.root, path)
    with HelperWriter(running.socket_path) as writer:
        with pytest.raises(PowerError, match="refused") as raised:
            writer.write(path, value)
        assert reason in str(raised.value.fields.get("reason"))
        writer.write(GPU_MAX, "816000000")  # the connection stays usable
    wait_for(lambda: running.helper.snapshot.files == {})  # restored once it closed
    assert read_text(running.root, path) == before


@pytest.mark.parametrize("path", [
    "etc/shadow", f"{GPU}/devfreq/17000000.gpu/governor", f"{GPU}/devfreq/17000000.gpu/cur_freq",
    "sys/devices/system/cpu/cpu3/online", "proc/sys/kernel/sysrq",
])
def test_files_the_board_layer_does_not_write_are_refused(running: Running,
                                                          path: str) -> None:
    target = running.root / path
    before = target.read_bytes() if target.exists() else None
    answers = raw_call(running.socket_path,
                       json.dumps({"op": "write", "path": path, "value": "1"}).encode() + b"\n")
    assert answers[0]["ok"] is False and answers[0]["kind"] == "refused"
    assert "not one the board layer writes" in str(answers[0]["error"])
    assert (target.read_bytes() if target.exists() else None) == before
    assert running.helper.snapshot.files == {}  # nothing read or remembered for it


def test_paths_that_leave_the_root_are_refused_by_the_client_and_the_helper(
        running: Running) -> None:
    with HelperWriter(running.socket_path) as writer, pytest.raises(PowerError):
        writer.write("../etc/passwd", "1")
    answers = raw_call(running.socket_path, json.dumps(
        {"op": "write", "path": f"{GPU}/../../../../etc/passwd", "value": "1"}).encode() + b"\n")
    assert answers[0]["ok"] is False


def test_malformed_requests_are_answered_not_fatal(running: Running) -> None:
    answers = raw_call(running.socket_path, b"not json\n", b"[1, 2]\n",
                       b'{"op": "reboot"}\n', b'{"op": "write", "path": 5, "value": "1"}\n',
                       b'{"op": "nvpmodel", "mode": "2"}\n', b'{"op": "hello"}\n')
    assert [answer["ok"] for answer in answers] == [False, False, False, False, False, True]
    assert "unknown request" in str(answers[2]["error"])


def test_a_line_over_the_limit_ends_the_connection(running: Running) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5)
        connection.connect(str(running.socket_path))
        connection.sendall(b"x" * 10000)
        reader = connection.makefile("rb")
        assert "too long" in json.loads(reader.readline())["error"]
        assert reader.readline() == b""  # closed by the helper
    with HelperWriter(running.socket_path) as writer:
        assert writer.hello()["ok"]


def test_another_uid_is_refused(board: Path, tmp_path: Path) -> None:
    served = start(board, tmp_path, uid=os.getuid() + 4242)
    try:
        with HelperWriter(served.socket_path) as writer:
            with pytest.raises((PowerError, ConnectionError)) as raised:
                writer.write(GPU_MAX, "306000000")
        if isinstance(raised.value, PowerError):
            assert "may not use the power helper" in str(raised.value)
        assert read_text(board, GPU_MAX) != "306000000"
    finally:
        served.stop.set()
        served.thread.join(timeout=10)


def test_one_client_at_a_time(running: Running) -> None:
    first = HelperWriter(running.socket_path)
    first.write(GPU_MAX, "816000000")
    with HelperWriter(running.socket_path) as second:
        with pytest.raises((PowerError, ConnectionError)) as raised:
            second.write(GPU_MAX, "306000000")
        if isinstance(raised.value, PowerError):
            assert "one client at a time" in str(raised.value)
    assert read_text(running.root, GPU_MAX) == "816000000"
    first.close()
    wait_for(lambda: running.helper.snapshot.files == {})
    with HelperWriter(running.socket_path) as third:
        third.write(GPU_MAX, "714000000")


def test_a_write_the_kernel_refuses_comes_back_as_its_errno(running: Running) -> None:
    (running.root / CPU0_MIN).unlink()  # the attribute vanished (a CPU cluster went offline)
    with HelperWriter(running.socket_path) as writer, pytest.raises(FileNotFoundError):
        writer.write(CPU0_MIN, "729600")


def test_nvpmodel_modes_of_the_profile_only_and_the_mode_restored(running: Running) -> None:
    assert read_text(running.root, STATUS).startswith("pmode:0001")
    with HelperWriter(running.socket_path) as writer:
        writer.nvpmodel(2)
        assert read_text(running.root, STATUS).startswith("pmode:0002")
        with pytest.raises(PowerError, match="not an nvpmodel mode"):
            writer.nvpmodel(9)
        writer.nvpmodel(0)
    wait_for(lambda: read_text(running.root, STATUS).startswith("pmode:0001"))
    assert running.nvpmodel.calls == [("nvpmodel", "-m", "2"), ("nvpmodel", "-m", "0"),
                                      ("nvpmodel", "-m", "1")]


@dataclass
class RecordingRunner:
    """The unprivileged side's own runner: records what HelperRunner lets it run."""

    calls: list[tuple[str, ...]]

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0) -> CommandResult:
        self.calls.append(tuple(argv))
        return CommandResult(argv=tuple(argv), returncode=0, stdout="NV Power Mode: 15W\n1\n")


def test_the_daemons_runner_sends_mode_changes_to_the_helper_and_runs_only_queries(
        running: Running) -> None:
    local = RecordingRunner([])
    with HelperWriter(running.socket_path) as writer:
        runner = HelperRunner(writer, fallback=local)
        assert runner.run(["nvpmodel", "-m", "2"]).returncode == 0
        assert read_text(running.root, STATUS).startswith("pmode:0002")
        refused = runner.run(["nvpmodel", "-m", "7"])
        assert refused.returncode == 1 and "not an nvpmodel mode" in refused.stderr
        assert runner.run(["nvpmodel", "-q"]).stdout.endswith("1\n")
        blocked = runner.run(["jetson_clocks"])
        assert blocked.returncode == 1 and "not run by an unprivileged daemon" in blocked.stderr
        assert running.nvpmodel.calls == [("nvpmodel", "-m", "2")]
    assert local.calls == [("nvpmodel", "-q")]
    # The daemon's connection closed: the helper puts the board's mode back (a moment later,
    # on its own thread).
    wait_for(lambda: len(running.nvpmodel.calls) == 2)
    assert running.nvpmodel.calls == [("nvpmodel", "-m", "2"), ("nvpmodel", "-m", "1")]


def test_an_explicit_restore_puts_the_board_back_and_starts_a_new_snapshot(
        running: Running) -> None:
    before = read_text(running.root, CPU0_MAX)
    with HelperWriter(running.socket_path) as writer:
        writer.write(CPU0_MAX, "115200")
        assert writer.restore() == 1
        assert read_text(running.root, CPU0_MAX) == before
        assert writer.restore() == 0


def test_the_restore_order_never_leaves_a_minimum_above_its_maximum() -> None:
    # The daemon pinned the GPU at the top; the board had min 306 MHz and max 612 MHz. Writing
    # the maximum back first would leave min 1020 > max 612 (JetPack 4's kernel says EINVAL).
    current = {GPU_MIN: 1020000000, GPU_MAX: 1020000000}
    saved = {GPU_MIN: "408000000", GPU_MAX: "612000000"}
    rules = {GPU_MIN: allowed_rule(), GPU_MAX: allowed_rule()}
    for path, value in _restore_order(saved, rules):
        current[path] = int(value)
        assert current[GPU_MIN] <= current[GPU_MAX], (path, value)
    assert current == {GPU_MIN: 408000000, GPU_MAX: 612000000}
    # and the other way: the daemon had lowered both to the floor.
    current = {GPU_MIN: 306000000, GPU_MAX: 306000000}
    saved = {GPU_MIN: "510000000", GPU_MAX: "1020000000"}
    for path, value in _restore_order(saved, rules):
        current[path] = int(value)
        assert current[GPU_MIN] <= current[GPU_MAX], (path, value)
    assert current == {GPU_MIN: 510000000, GPU_MAX: 1020000000}


def allowed_rule():  # type: ignore[no-untyped-def]
    from power.io import WriteRule

    return WriteRule(what="gpu_hz", low=306000000, high=1020000000)


def test_the_command_restores_on_sigterm_and_takes_systemds_socket(board: Path,
                                                                  tmp_path: Path) -> None:
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    os.set_inheritable(listener.fileno(), True)
    # As systemd starts it: the socket as fd 3, LISTEN_FDS=1 and LISTEN_PID of the helper
    # itself (a small launcher sets them and execs, which keeps the pid).
    launcher = (f"import os, sys\nos.dup2({listener.fileno()}, 3)\n"
                "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid()))\n"
                f"os.execv(sys.executable, [sys.executable, '-m', 'power.helper', '--root', "
                f"{str(board)!r}, '--user', '{os.getuid()}'])\n")
    log = (tmp_path / "helper.log").open("w")
    helper = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO, pass_fds=[listener.fileno()],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=log)
    log.close()
    listener.close()
    before = read_text(board, GPU_MAX)
    try:
        writer = HelperWriter(path)
        writer.write(GPU_MAX, "306000000")
        assert read_text(board, GPU_MAX) == "306000000"
        helper.send_signal(signal.SIGTERM)  # systemctl stop, or the board shutting down
        assert helper.wait(timeout=20) == 0
        assert read_text(board, GPU_MAX) == before
        writer.close()
    finally:
        helper.kill()
        helper.wait(timeout=10)
    assert "serving power writes for uid" in (tmp_path / "helper.log").read_text()


def test_the_board_layer_governs_through_the_helper_and_the_kernel_sees_a_valid_order(
        tmp_path: Path) -> None:
    # The daemon's Board over the helper, on a Xavier NX with JetPack 4's kernel (a minimum
    # above the maximum is EINVAL): points applied through the socket read back as asked, and
    # the restore when the daemon goes puts the board back through that same strict kernel.
    from power.board import Board
    from power.sim.kernel import FakeKernel
    from power.types import OperatingPoint

    root = tmp_path / "xavier"
    write_tree(root, profile("xavier-nx"), jetpack=4)
    kernel = FakeKernel(root, 4)
    helper = PowerHelper(root, allowed_uid=os.getuid(), writer=kernel,
                         runner=FakeCommands(root, kernel))
    path = tmp_path / "power.sock"
    stop, thread = serve_helper(helper, path)
    try:
        writer = HelperWriter(path)
        board = Board.open(root, writer=writer, runner=HelperRunner(writer))
        before = board.read_point()
        table = board.clock_table()
        top, bottom = table.gpu_hz[-1], table.gpu_hz[0]
        pinned = board.apply(OperatingPoint(gpu_min_hz=top, gpu_max_hz=top))
        assert pinned.ok, pinned.mismatches
        assert (pinned.applied.gpu_min_hz, pinned.applied.gpu_max_hz) == (top, top)
        low = board.apply(OperatingPoint(gpu_min_hz=bottom, gpu_max_hz=table.gpu_hz[1]))
        assert low.ok, low.mismatches
        # Last, the CPUs pinned above the board's own cap: putting the cap back first would
        # leave the minimum above it, which this kernel refuses.
        cpu_top = table.cpu_khz[-1]
        assert before.cpu_max_khz is not None and before.cpu_max_khz < cpu_top
        cpus = board.apply(OperatingPoint(cpu_min_khz=cpu_top, cpu_max_khz=cpu_top))
        assert cpus.ok, cpus.mismatches
        writer.close()  # the daemon goes away
        wait_for(lambda: helper.snapshot.files == {})
        assert board.read_point() == before
    finally:
        stop.set()
        thread.join(timeout=10)


def test_board_access_uses_the_helper_only_for_an_unprivileged_daemon_on_the_real_board(
        running: Running) -> None:
    from power.helper_client import board_access

    access = board_access("/", socket_path=running.socket_path, euid=998)
    assert isinstance(access["writer"], HelperWriter)
    assert isinstance(access["runner"], HelperRunner)
    assert access["runner"].writer is access["writer"]
    assert board_access("/", socket_path=running.socket_path, euid=0) == {}
    assert board_access(running.root, socket_path=running.socket_path, euid=998) == {}
    assert board_access("/", socket_path=running.root / "absent.sock", euid=998) == {}
