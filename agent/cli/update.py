"""``edge-agent update``: apply a model bundle to the running daemon, see where an update stands,
roll back (issue 16; the daemon does the work, these commands ask it over the local control
channel, agent/control/).

    edge-agent update apply resnet8-v4.bundle          # or an http(s):// or file:// URL
    edge-agent update apply https://cdn.example/resnet8-v4.bundle --no-wait
    edge-agent update status [--json]
    edge-agent update rollback

They run as the daemon's user or root, on the board. ``apply`` shows the update's progress (each
state change on its own line; the download's percentage in place on a terminal) and exits 0 once
the new version is committed, 1 with the reason when the update fails or is refused.
Interrupting it does not stop the update: the daemon goes on, and ``update status`` follows it.
``rollback`` exits 0 once the version before is back (or the update in progress cancelled), 1
with the reason when it is refused or the revert fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from agent.control import protocol
from agent.control.client import CommandError, ControlClient, OnEvent
from agent.control.protocol import ProgressEvent, StateEvent, UpdateStatus
from agent.errors import ConfigError, ControlError, InputError, printable

MIB = 1024 * 1024
# How often, at most, a terminal's in-place progress line is redrawn.
REDRAW_INTERVAL_S = 0.1
# Without a terminal, a line for each tenth of the download (or each 16 MiB when its size is not
# known): a log keeps a trace without a line per chunk.
PLAIN_STEP_FRACTION = 0.1
PLAIN_STEP_BYTES = 16 * MIB
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "update", help="apply, follow and roll back model updates on the running daemon",
        description=(
            "Ask the daemon running on this board, over its control socket in the state "
            "directory, to apply a bundle, report its update state, or roll back. Run as the "
            "daemon's user or root. The state directory comes from --state-dir, else from the "
            "configuration (--config, $EDGE_AGENT_CONFIG or /etc/edge-agent/agent.toml, and "
            "EDGE_AGENT_STATE_DIR), as for 'edge-agent serve'."
        ),
    )
    actions = parser.add_subparsers(dest="update_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, metavar="FILE", help="configuration file (TOML)")
    common.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="the daemon's state directory (its control socket is there)")
    common.add_argument("--json", action="store_true",
                        help="print the outcome as JSON instead of a summary")

    apply = actions.add_parser("apply", parents=[common], help="install a bundle and swap to it",
                               description="Download, verify, stage, warm, canary and commit a "
                               "bundle; the current version serves until the new one commits.")
    apply.add_argument("source", help="a bundle file, or an http, https or file URL")
    apply.add_argument("--no-wait", action="store_true",
                       help="return once the daemon has accepted the update")
    apply.add_argument("--timeout-s", type=seconds_argument, default=3600.0, metavar="S",
                       help="stop waiting after this long (the update goes on in the daemon)")
    apply.set_defaults(handler=run_apply)

    status = actions.add_parser("status", parents=[common], help="where the update stands")
    status.set_defaults(handler=run_status)

    rollback = actions.add_parser("rollback", parents=[common],
                                  help="return to the previous version")
    rollback.add_argument("--timeout-s", type=seconds_argument, default=600.0, metavar="S",
                          help="stop waiting after this long (the rollback goes on)")
    rollback.set_defaults(handler=run_rollback)


def seconds_argument(text: str) -> float:
    """argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number of seconds, not {text!r}")
    return value


def socket_path(args: argparse.Namespace) -> Path:
    """The daemon's control socket: in ``--state-dir``, else in the configured state directory."""
    if args.state_dir is not None:
        return Path(args.state_dir) / protocol.SOCKET_NAME
    from agent.config import load_config

    return load_config(args.config).state_dir / protocol.SOCKET_NAME


def source_url(source: str) -> str:
    """``source`` as ``update.apply`` takes it: a URL as given (http, https, file), a local path
    as the absolute ``file://`` URL of the file, which must exist (the daemon does not share the
    command's working directory).

    Raises:
        ConfigError: a URL of another scheme.
        InputError: no file at the path.
    """
    scheme, separator, _ = source.partition("://")
    if separator and _URL_SCHEME.fullmatch(scheme):
        if scheme.lower() not in protocol.URL_SCHEMES:
            raise ConfigError("the daemon fetches bundles over http, https or file URLs",
                              found=source)
        return source
    path = Path(source).expanduser()
    if not path.exists():
        raise InputError("no bundle at this path", path=path)
    if not path.is_file():
        raise InputError("a bundle is one file; this is not a file", path=path)
    return path.resolve().as_uri()


def run_apply(args: argparse.Namespace) -> int:
    url = source_url(args.source)
    client = ControlClient(socket_path(args))
    progress = ProgressPrinter(sys.stdout) if not args.json else None
    request = protocol.ApplyArgs(source=url, wait=not args.no_wait)
    try:
        result = _call(args, client, protocol.UPDATE_APPLY, request.to_json(),
                       on_event=progress, timeout_s=args.timeout_s)
    except KeyboardInterrupt:
        if progress is not None:
            progress.finish()
        print("edge-agent: the update goes on in the daemon; 'edge-agent update status' "
              "follows it", file=sys.stderr)
        raise
    finally:
        if progress is not None:
            progress.finish()
    if result is None:
        return 1
    status = UpdateStatus.from_json(result)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.no_wait:
        target = status.target or protocol.UpdateTarget(source=url)
        print(f"update requested: {_shown(str(target))} ({status.state}); "
              "'edge-agent update status' follows it")
    elif status.committed:
        print(f"committed: {_serving(status)} serves")
    if args.no_wait or status.committed:
        return 0
    _say_failed(status)
    return 1


def run_status(args: argparse.Namespace) -> int:
    client = ControlClient(socket_path(args))
    result = _call(args, client, protocol.UPDATE_STATUS, {}, timeout_s=30.0)
    if result is None:
        return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(summary(UpdateStatus.from_json(result)))
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    client = ControlClient(socket_path(args))
    progress = ProgressPrinter(sys.stdout) if not args.json else None
    try:
        result = _call(args, client, protocol.UPDATE_ROLLBACK, {}, on_event=progress,
                       timeout_s=args.timeout_s)
    finally:
        if progress is not None:
            progress.finish()
    if result is None:
        return 1
    status = UpdateStatus.from_json(result)
    failed = status.state == "failed"  # the revert itself failed: the version did not change
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif failed:
        _say_failed(status, what="rollback")
    else:
        print(f"rolled back: {_serving(status)} serves")
    return 1 if failed else 0


def _call(args: argparse.Namespace, client: ControlClient, command: str,
          request: dict[str, Any], *, timeout_s: float, on_event: OnEvent | None = None) -> Any:
    """The command's result; None when the daemon refused it and ``--json`` printed the error
    (without ``--json`` the refusal is raised, and the CLI prints it)."""
    try:
        return client.call(command, request, on_event=on_event, timeout_s=timeout_s)
    except CommandError as exc:
        if not args.json:
            raise
        print(json.dumps({"ok": False, "error": exc.message, "reason": exc.reason},
                         indent=2, sort_keys=True))
        return None


def _say_failed(status: UpdateStatus, *, what: str = "update") -> None:
    error = status.error
    why = f"{_shown(error.message)} (reason={_shown(error.reason)})" if error else "no reason given"
    print(f"edge-agent: error: the {what} ended {status.state}: {why}; {_serving(status)} "
          "serves", file=sys.stderr)


def _serving(status: UpdateStatus) -> str:
    return _shown(str(status.serving)) if status.serving else "no model"


def _shown(text: str) -> str:
    """Text from the daemon (a URL, a bundle's message) made safe for one terminal line."""
    return printable(text, 500)


def summary(status: UpdateStatus, *, now_unix_s: float | None = None) -> str:
    """``update status`` for a person: a few ``label: value`` lines."""
    now = time.time() if now_unix_s is None else now_unix_s
    state = status.state
    if status.since_unix_s is not None:
        state += f" for {format_duration(max(0.0, now - status.since_unix_s))}"
    lines = [f"state: {state}", f"serving: {_serving(status)}"]
    if status.target is not None:
        attempts = f", attempt {status.attempts}" if status.attempts else ""
        lines.append(f"update: {_shown(str(status.target))}{attempts}")
    if status.done_bytes is not None:
        done = ProgressEvent(done_bytes=status.done_bytes, total_bytes=status.total_bytes)
        lines.append(f"progress: {_amount(done)}")
    if status.error is not None:
        lines.append(f"last error: {_shown(status.error.reason)}: {_shown(status.error.message)}")
    return "\n".join(lines)


def format_duration(seconds: float) -> str:
    """A duration as people read it: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _amount(event: ProgressEvent) -> str:
    done = event.done_bytes / MIB
    fraction = event.fraction
    if fraction is None or event.total_bytes is None:
        return f"{done:.1f} MiB"
    return f"{fraction:.0%} ({done:.1f} of {event.total_bytes / MIB:.1f} MiB)"


class ProgressPrinter:
    """Shows an update's events as they arrive: a line per state change; the download's progress
    redrawn in place on a terminal, or a line per step of it otherwise (a log, a pipe).

    Args:
        stream: Where to write.
        tty: Whether ``stream`` is a terminal (default: ask it).
        clock: Monotonic seconds, for the redraw interval.
    """

    def __init__(self, stream: TextIO, *, tty: bool | None = None,
                 clock: Any = time.monotonic) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self._clock = clock
        self._in_place = False  # a progress line is drawn and not yet ended
        self._last_draw_s = float("-inf")
        self._last_step = -1

    def __call__(self, raw: dict[str, Any]) -> None:
        try:
            event = protocol.parse_event(raw)
        except ControlError:  # a garbled event must not end the command
            return
        if isinstance(event, StateEvent):
            self.finish()
            message = f": {_shown(event.message)}" if event.message else ""
            self._write(f"{event.state}{message}\n")
            self._last_step = -1
        elif isinstance(event, ProgressEvent):
            self._progress(event)

    def _progress(self, event: ProgressEvent) -> None:
        complete = event.total_bytes is not None and event.done_bytes >= event.total_bytes
        if self.tty:
            now = self._clock()
            if not complete and now - self._last_draw_s < REDRAW_INTERVAL_S:
                return
            self._last_draw_s = now
            self._write(f"\r  downloaded {_amount(event)}\x1b[K")
            self._in_place = True
            return
        fraction = event.fraction
        step = (int(fraction / PLAIN_STEP_FRACTION) if fraction is not None
                else event.done_bytes // PLAIN_STEP_BYTES)
        if step > self._last_step:
            self._last_step = step
            self._write(f"  downloaded {_amount(event)}\n")

    def finish(self) -> None:
        """End an in-place progress line, so what follows starts on its own line."""
        if self._in_place:
            self._write("\n")
            self._in_place = False

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
