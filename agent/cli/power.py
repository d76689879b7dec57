"""``edge-agent power status|set|trace``: the board's power state, its policy, and a telemetry trace.

``status`` and ``trace`` ask the running daemon over its control socket (``power.status``); when
no daemon answers they read the board's files directly under ``--root`` (default ``[power] root``,
``/`` on a board), read-only, and say so. ``set`` changes the running daemon's policy
(``power.set``): it needs the daemon, which puts the board back when it stops; without one it
refuses rather than leave clocks changed that nothing restores.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from agent.cli.update import seconds_argument, socket_path
from agent.control.client import CommandError, ControlClient
from agent.errors import ConfigError, ControlError, PowerError
from agent.power.policy import parse_assignment
from agent.power.service import POWER_SET, POWER_STATUS, POWER_WAKE, telemetry_to_json

PROFILES = ("governed", "max", "min", "stock")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "power", help="the board's power state and policy; a telemetry trace",
        description="Show the board's clocks, power, temperatures and power state, change the "
        "running daemon's power policy, or record telemetry to a CSV file. The daemon is "
        "reached over its control socket (--state-dir, else the configuration's state_dir); "
        "status and trace read the board's files directly when no daemon runs.")
    actions = parser.add_subparsers(dest="power_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, metavar="FILE", help="configuration file (TOML)")
    common.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="the daemon's state directory (its control socket is there)")
    common.add_argument("--root", type=Path, metavar="DIR",
                        help="the board's files, when no daemon runs (default: [power] root)")

    status = actions.add_parser("status", parents=[common], help="the board's state now")
    status.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    status.set_defaults(handler=run_status)

    change = actions.add_parser(
        "set", parents=[common], help="change the running daemon's power policy",
        description="Apply a profile (governed, max, min, stock) and/or policy keys "
        "(latency_target_s=0.03, power_cap_mw=7000, power_cap_mw=none) to the running daemon; "
        "it lasts until the daemon stops or a desired document sets another. For good, set "
        "[power] in the configuration.")
    change.add_argument("settings", nargs="+", metavar="PROFILE|KEY=VALUE",
                        help="a profile (" + ", ".join(PROFILES) + ") and/or policy keys")
    change.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    change.set_defaults(handler=run_set)

    wake = actions.add_parser("wake", parents=[common], help="wake the board now")
    wake.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    wake.set_defaults(handler=run_wake)

    trace = actions.add_parser(
        "trace", parents=[common], help="record telemetry to a CSV file",
        description="One CSV row per telemetry reading, with a header: clocks, load, power by "
        "rail, temperatures (and the power state, from a daemon).")
    trace.add_argument("--out", type=Path, metavar="FILE", help="the CSV file (default stdout)")
    trace.add_argument("--duration", type=seconds_argument, default=10.0, metavar="S",
                       help="how long to record (default 10 s)")
    trace.add_argument("--interval", type=seconds_argument, default=1.0, metavar="S",
                       help="seconds between readings (default 1 s)")
    trace.set_defaults(handler=run_trace)


# -- where the readings come from ----------------------------------------------------------------

class Source:
    """The daemon when one answers, else the board's files read directly."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client = ControlClient(socket_path(args), connect_timeout_s=2.0)
        self.board: Any = None
        self.where = ""
        self.telemetry_period_s: float | None = None  # a daemon's; None on the board's files
        try:
            status = self.client.call(POWER_STATUS, timeout_s=5.0)
            self.where = f"daemon (control socket {self.client.socket_path})"
            period_s = status.get("telemetry_period_s") if isinstance(status, dict) else None
            if isinstance(period_s, (int, float)):
                self.telemetry_period_s = float(period_s)
        except (CommandError, ControlError) as exc:
            # No daemon, or one that does not govern power (no power.* commands): the board's
            # files, read-only.
            self.client = None  # type: ignore[assignment]
            root = board_root(args)
            from power.board import Board

            self.board = Board.open(root)
            why = ("the daemon does not govern power" if isinstance(exc, CommandError)
                   else "no daemon answered")
            self.where = f"board files under {root} ({why})"

    @property
    def daemon(self) -> bool:
        return self.client is not None

    def reading(self) -> dict[str, Any]:
        """One reading: ``telemetry`` (JSON), and ``state``/``point`` where known."""
        if self.client is not None:
            status = self.client.call(POWER_STATUS, timeout_s=10.0)
            return {"telemetry": status.get("telemetry"), "state": status.get("state"),
                    "point": (status.get("controller") or {}).get("point"),
                    "policy": status.get("policy"), "status": status}
        return {"telemetry": telemetry_to_json(self.board.telemetry()), "state": None,
                "point": self.board.read_point().to_json(),
                "capabilities": self.board.capabilities()}


def board_root(args: argparse.Namespace) -> Path:
    if args.root is not None:
        return Path(args.root)
    from agent.config import load_config

    return load_config(args.config).power.root


# -- the actions ---------------------------------------------------------------------------------

def run_status(args: argparse.Namespace) -> int:
    source = Source(args)
    reading = source.reading()
    if args.json:
        print(json.dumps({"source": source.where, **reading}, indent=2, sort_keys=True))
        return 0
    print(f"source: {source.where}")
    if reading.get("state") is not None:
        print(f"state: {reading['state']}")
    if reading.get("policy"):
        policy = reading["policy"]
        print(f"policy: {policy['profile']}, p{policy['percentile'] * 100:g} under "
              f"{policy['latency_target_s'] * 1000:g} ms"
              + (f", cap {policy['power_cap_mw']} mW" if policy.get("power_cap_mw") else ""))
    if reading.get("point"):
        print("limits: " + ", ".join(f"{key}={value}" for key, value in
                                     sorted(reading["point"].items())))
    print_telemetry(reading.get("telemetry"), sys.stdout)
    # On the board's files: what this board cannot do or read, so a rail missing from the
    # list above is explained (a channel's files missing or unreadable) rather than silent.
    for control, why in sorted((reading.get("capabilities") or {}).items()):
        if why is not None:
            print(f"{control}: {why}")
    return 0


def print_telemetry(telemetry: dict[str, Any] | None, out: IO[str]) -> None:
    if telemetry is None:
        print("telemetry: none yet", file=out)
        return
    if telemetry.get("gpu_freq_hz") is not None:
        print(f"gpu: {telemetry['gpu_freq_hz'] / 1e6:g} MHz", file=out)
    if telemetry.get("cpu_freq_khz"):
        print("cpu: " + ", ".join("?" if khz is None else f"{khz / 1e3:g}"
                                  for khz in telemetry["cpu_freq_khz"]) + " MHz", file=out)
    if telemetry.get("emc_hz") is not None:
        print(f"emc: {telemetry['emc_hz'] / 1e6:g} MHz", file=out)
    if telemetry.get("total_power_mw") is not None:
        print(f"power: {telemetry['total_power_mw']} mW", file=out)
    for rail, milliwatts in sorted((telemetry.get("rails_mw") or {}).items()):
        print(f"  {rail}: {milliwatts} mW", file=out)
    zones = [zone for zone in telemetry.get("thermal") or () if zone.get("temp_c") is not None]
    if zones:
        print("temperatures: " + ", ".join(f"{zone['name']} {zone['temp_c']:.1f} C"
                                           for zone in zones), file=out)


def _daemon_only(args: argparse.Namespace, what: str) -> ControlClient:
    client = ControlClient(socket_path(args), connect_timeout_s=2.0)
    try:
        client.call(POWER_STATUS, timeout_s=5.0)
    except CommandError as exc:
        raise PowerError("the daemon runs without power governance ([power] enabled is false)",
                         reason=exc.message) from None
    except ControlError as exc:
        raise PowerError(f"'power {what}' needs the running daemon (it puts the board back when "
                         "it stops); none answered", reason=exc.message) from None
    return client


def run_set(args: argparse.Namespace) -> int:
    changes: dict[str, Any] = {}
    for text in args.settings:
        if "=" not in text:
            if text not in PROFILES:
                raise ConfigError("not a power profile", key="power.profile",
                                  expected="one of " + ", ".join(PROFILES), found=text)
            name, value = "profile", text
        else:
            name, value = parse_assignment(text)
        if name in changes and changes[name] != value:
            # 'set max min' is a typo or a script's mistake: neither is more likely meant.
            raise ConfigError("one profile (and one value of each key) per 'power set'",
                              key=f"power.{name}", found=f"{changes[name]} and {value}")
        changes[name] = value
    client = _daemon_only(args, "set")
    status = client.call(POWER_SET, {"changes": changes}, timeout_s=30.0)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        policy = status["policy"]
        print("policy now: " + ", ".join(f"{key}={policy[key]}" for key in sorted(policy)))
    return 0


def run_wake(args: argparse.Namespace) -> int:
    client = _daemon_only(args, "wake")
    result = client.call(POWER_WAKE, timeout_s=30.0)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"woke in {result['wake_s'] * 1000:.1f} ms; state: {result.get('state')}")
    return 0


def trace_row(reading: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """One CSV row: flat columns for every clock, rail and zone of a reading."""
    telemetry = reading.get("telemetry") or {}
    row: dict[str, Any] = {
        "elapsed_s": round(elapsed_s, 3), "state": reading.get("state") or "",
        "gpu_freq_hz": telemetry.get("gpu_freq_hz"), "gpu_load": telemetry.get("gpu_load"),
        "gpu_railgated": telemetry.get("gpu_railgated"), "emc_hz": telemetry.get("emc_hz"),
        "total_power_mw": telemetry.get("total_power_mw"),
        "nvpmodel_mode": telemetry.get("nvpmodel_mode"),
    }
    for index, khz in enumerate(telemetry.get("cpu_freq_khz") or ()):
        row[f"cpu{index}_freq_khz"] = khz
    for rail, milliwatts in sorted((telemetry.get("rails_mw") or {}).items()):
        row[f"rail_{rail}_mw"] = milliwatts
    for zone in telemetry.get("thermal") or ():
        row[f"temp_{zone['name']}_c"] = zone.get("temp_c")
    return {key: "" if value is None else value for key, value in row.items()}


def open_out(path: Path | None) -> IO[str]:
    """The trace's CSV file (stdout without one), opened before anything is read.

    Raises:
        ConfigError: the file cannot be written (a missing directory, a directory, no
            permission, a read-only file system), naming it.
    """
    if path is None:
        return sys.stdout
    try:
        return open(path, "w", newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError("cannot write the trace's CSV file", key="--out", path=str(path),
                          reason=exc.strerror or str(exc)) from None


def run_trace(args: argparse.Namespace) -> int:
    out = open_out(args.out)
    rows = 0
    where = f" to {args.out}" if args.out else ""
    try:
        source = Source(args)
        print(f"tracing from the {source.where} for {args.duration:g} s every "
              f"{args.interval:g} s", file=sys.stderr)
        period_s = source.telemetry_period_s
        if period_s is not None and args.interval < period_s:
            print(f"note: the daemon reads telemetry every {period_s:g} s ([power] "
                  "telemetry_period_s): rows closer than that repeat a reading", file=sys.stderr)
        writer: csv.DictWriter[str] | None = None
        started = time.monotonic()
        next_at = started
        while True:
            now = time.monotonic()
            if now - started > args.duration:
                break
            row = trace_row(source.reading(), now - started)
            if writer is None:
                # The columns of the first reading: a board's clocks, rails and zones do not
                # change while it runs.
                writer = csv.DictWriter(out, fieldnames=list(row), extrasaction="ignore",
                                        restval="")
                writer.writeheader()
            writer.writerow(row)
            rows += 1
            out.flush()
            next_at += args.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    except BaseException:
        # Ctrl-C, the daemon gone: every row written is whole (each is flushed); say how many.
        if rows:
            print(f"{rows} readings written{where} before the trace stopped", file=sys.stderr)
        raise
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"{rows} readings written{where}", file=sys.stderr)
    return 0
