"""The ``edge-agent`` command.

Each subcommand lives in its own module under ``agent/cli/`` and registers itself through
``register(subparsers)``; handlers take the parsed arguments and return an exit status. Host-only
subcommands (build, bench) import torch and the ONNX tooling inside their handler, so the command
starts on a board that has only the ``device`` extra.

Every :class:`~agent.errors.AgentError` ends the command with one line on stderr that names the
problem, and exit status 1; a usage error exits 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Sequence

from agent import __version__
from agent.errors import AgentError, Terminated
from agent.log import configure_logging

log = logging.getLogger(__name__)

# Subcommand modules, in the order they appear in --help.
SUBCOMMAND_MODULES = (
    "agent.cli.build",
    "agent.cli.bundle",
    "agent.cli.serve",
    "agent.cli.update",
    "agent.cli.power",
    "agent.cli.fleet",
    "agent.cli.demo",
    "agent.cli.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="Build, sign, serve and roll out INT8 vision models on NVIDIA Jetson fleets.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors in the log")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to the help of every option, in every subcommand, whose default is a
    value (not None or a flag's False) and whose help does not already name its default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in set(action.choices.values()):
                _show_defaults(subparser)
            continue
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or action.default in (None, False, argparse.SUPPRESS, [], ())
                or "default" in (action.help or "")):
            continue
        shown = ", ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) \
            else str(action.default)
        action.help = f"{action.help or ''} (default: {shown.replace('%', '%%')})".lstrip()


# Commands whose work (staging directories, temporary stores, the demo's daemon and shared
# memory) is cleaned up on the way out: a SIGTERM (systemd, a CI timeout, kill) unwinds them as
# Ctrl-C does. serve does too while it installs a bundle, then handles SIGTERM itself, by
# draining, once its event loop runs.
_UNWIND_ON_SIGTERM = ("build", "bench", "bundle", "train", "serve", "demo")


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(-1 if args.quiet else args.verbose)
    if args.command in _UNWIND_ON_SIGTERM:
        signal.signal(signal.SIGTERM, _raise_terminated)
    status = _run(args)
    # A daemon run that had to abandon a stuck thread ends here, not at interpreter exit
    # (which would wait for that thread for good); agent.run is loaded only by such runs.
    run = sys.modules.get("agent.run")
    if run is not None:
        run.exit_if_abandoned(status)
    return status


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args) or 0)
    except AgentError as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        log.debug("error details", exc_info=True)
        return 1
    except Terminated:
        print("edge-agent: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("edge-agent: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
