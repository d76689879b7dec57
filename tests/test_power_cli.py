"""``edge-agent power status|set|wake|trace`` (agent/cli/power.py): on the board's files when no
daemon runs, and through a running daemon's control socket, over a fake board tree with the real
board layer and controller."""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")

from agent.cli import main
from agent.daemon import Daemon
from agent.run import run_foreground
from tests.power_boards import fake_board
from tests.test_power_daemon import installed, until  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_status_and_trace_read_the_board_when_no_daemon_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = fake_board(tmp_path)
    no_daemon = ["--state-dir", str(tmp_path / "nothing-here"), "--root", str(tree.root)]
    assert main(["power", "status", *no_daemon, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "no daemon answered" in shown["source"]
    assert shown["telemetry"]["gpu_freq_hz"] == int(tree.get(f"{tree.gpu_freq_dir}/cur_freq"))
    assert shown["point"]["gpu_max_hz"] == int(tree.get(f"{tree.gpu_freq_dir}/max_freq"))

    out = tmp_path / "trace.csv"
    assert main(["power", "trace", *no_daemon, "--duration", "0.35", "--interval", "0.1",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "board files under" in err
    rows = list(csv.DictReader(out.open()))
    assert 3 <= len(rows) <= 5 and f"{len(rows)} readings" in err
    assert {"elapsed_s", "gpu_freq_hz", "total_power_mw", "cpu0_freq_khz"} <= set(rows[0])
    assert any(key.startswith("temp_") for key in rows[0])
    assert [float(row["elapsed_s"]) for row in rows] == sorted(float(r["elapsed_s"])
                                                               for r in rows)


def test_set_and_wake_need_the_daemon(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    tree = fake_board(tmp_path)
    for argv in (["set", "max"], ["wake"]):
        assert main(["power", *argv, "--state-dir", str(tmp_path / "none"), "--root",
                     str(tree.root)]) != 0
        assert "needs the running daemon" in capsys.readouterr().err
    # A bad key is refused before anything is asked.
    assert main(["power", "set", "speed=3", "--state-dir", str(tmp_path / "none")]) != 0
    assert "power.speed" in capsys.readouterr().err


def test_the_cli_through_a_running_daemon(installed: dict[str, Any],  # noqa: F811
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = installed["config"]
    daemon = Daemon(config)
    state = ["--state-dir", str(config.state_dir)]
    outputs: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])

        def cli() -> None:
            assert main(["power", "status", *state, "--json"]) == 0
            outputs["status"] = json.loads(capsys.readouterr().out)
            assert main(["power", "set", "max", "latency_target_s=0.02", *state,
                         "--json"]) == 0
            outputs["set"] = json.loads(capsys.readouterr().out)
            main(["power", "status", *state])
            outputs["summary"] = capsys.readouterr().out
            main(["power", "trace", *state, "--duration", "0.25", "--interval", "0.1",
                  "--out", str(config.state_dir / "t.csv")])
            outputs["trace_err"] = capsys.readouterr().err
        await loop.run_in_executor(None, cli)

    run_foreground(daemon, session=session)
    assert outputs["status"]["source"].startswith("daemon")
    assert outputs["set"]["policy"]["profile"] == "max"
    assert outputs["set"]["policy"]["latency_target_s"] == 0.02
    assert "policy: max" in outputs["summary"] and "source: daemon" in outputs["summary"]
    assert "from the daemon" in outputs["trace_err"]
    rows = list(csv.DictReader((config.state_dir / "t.csv").open()))
    assert rows and rows[0]["state"] in ("active", "idle", "sleeping", "waking")


def test_status_beside_a_daemon_without_power_reads_the_board(
        installed: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    import dataclasses

    config = installed["config"]
    tree = installed["tree"]
    daemon = Daemon(dataclasses.replace(config, power=dataclasses.replace(config.power,
                                                                          enabled=False)))
    outputs: dict[str, Any] = {}

    async def session(port: int) -> None:
        def cli() -> None:
            outputs["rc"] = main(["power", "status", "--state-dir", str(config.state_dir),
                                  "--root", str(tree.root)])
            outputs["out"] = capsys.readouterr().out
            outputs["set_rc"] = main(["power", "set", "max", "--state-dir",
                                      str(config.state_dir)])
            outputs["set_err"] = capsys.readouterr().err
        await asyncio.get_running_loop().run_in_executor(None, cli)

    run_foreground(daemon, session=session)
    assert outputs["rc"] == 0
    assert f"source: board files under {tree.root} (the daemon does not govern power)" in \
        outputs["out"]
    assert outputs["set_rc"] != 0 and "without power governance" in outputs["set_err"]
