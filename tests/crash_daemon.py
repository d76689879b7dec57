"""``edge-agent serve`` with the updater's policies set and its steps held, for the crash tests
(tests/test_update_crash.py): run as ``python -m tests.crash_daemon`` in a process of its own,
which the tests SIGKILL.

The canary's length, the watch window and the attempts budget come from flags here, with a
canary that never ends early (``[update]`` cannot say that); everything else is ``serve``'s (the
same configuration loading, the same :func:`agent.run.run_foreground` lifecycle and signal
handling).

``--hold STEP=S`` sleeps S seconds before the updater step STEP does its real work, and
``--hold-after STEP=S`` after it finished and before the updater journals the next state: a
state that takes milliseconds on a tiny model then lasts long enough for a test to kill the
daemon in it deterministically, on either side of the step's work. A hold only waits (on the
event loop, as the steps' contract asks); the step itself is the daemon's own.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.config import load_config
from agent.daemon import Daemon
from agent.log import configure_logging
from agent.run import check_can_listen, ignore_sighup, run_foreground
from agent.update.canary import CanaryPolicy
from agent.update.download import DownloadPolicy
from agent.update.states import UpdatePolicy

log = logging.getLogger("tests.crash_daemon")

# The DaemonSteps methods a hold may be put on.
STEPS = ("download", "verify", "stage", "build_engine", "warm", "canary", "commit", "watch",
         "discard", "revert")


def _hold(text: str) -> tuple[str, float]:
    step, _, seconds = text.partition("=")
    if step not in STEPS:
        raise argparse.ArgumentTypeError(f"unknown step {step!r}; one of {', '.join(STEPS)}")
    try:
        return step, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP=SECONDS") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.crash_daemon")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--pubkey", type=Path, action="append", required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--canary-s", type=float, default=1.0,
                        help="the canary's length (it never has enough samples to end early)")
    parser.add_argument("--watch-s", type=float, default=1.0, help="the watch window")
    parser.add_argument("--max-failures", type=int, default=3, help="the attempts budget")
    parser.add_argument("--hold", type=_hold, action="append", default=[], metavar="STEP=S")
    parser.add_argument("--hold-after", type=_hold, action="append", default=[],
                        metavar="STEP=S")
    return parser.parse_args(argv)


def held(step: Callable[..., Awaitable[Any]], before_s: float, after_s: float
         ) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(step)
    async def run(*args: Any) -> Any:
        if before_s:
            log.info("holding %s for %g s before its work", step.__name__, before_s)
            await asyncio.sleep(before_s)
        result = await step(*args)
        if after_s:
            log.info("holding %s for %g s after its work", step.__name__, after_s)
            await asyncio.sleep(after_s)
        return result

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    config = load_config(None, overrides={"state_dir": args.state_dir,
                                          "http.port": args.http_port,
                                          "serving.backend": "onnxruntime"},
                         extra_public_keys=args.pubkey)
    check_can_listen(config.http.host, config.http.port)
    signal.signal(signal.SIGHUP, ignore_sighup)
    # min_samples out of reach: the canary lasts its whole duration, traffic or not.
    canary = CanaryPolicy(duration_s=args.canary_s, min_samples=10**9,
                          watch_min_requests=10**9)
    policy = UpdatePolicy(watch_window_s=args.watch_s, max_failures=args.max_failures)
    download = DownloadPolicy(deadline_s=60.0, connect_timeout_s=2.0, stall_timeout_s=5.0,
                              retry_initial_s=0.2, retry_max_s=1.0, progress_interval_s=0.1)
    daemon = Daemon(config, update_policy=policy, canary_policy=canary,
                    download_policy=download)
    steps = daemon.update_steps
    before = dict(args.hold)
    after = dict(args.hold_after)
    for name in set(before) | set(after):
        setattr(steps, name, held(getattr(steps, name), before.get(name, 0.0),
                                  after.get(name, 0.0)))
    run_foreground(daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
