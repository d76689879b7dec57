"""``edge-agent demo``: build (if needed), serve and query the example model end to end."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent.backends import BACKEND_CHOICES


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="build the example bundle if missing, serve it and send it real digit images",
        description=(
            "The main job on the embedded defaults: builds OUT/resnet18-digits-N.bundle when "
            "there is none (needs the host extra), installs it into a fresh store under "
            "OUT/state, starts the daemon on a free loopback port, sends the held-out digits "
            "from concurrent clients and through shared memory, prints predictions, latency and "
            "metrics; then publishes the bundle again as the next version and applies it over "
            "the control socket while the clients go on, and shuts down cleanly."
        ),
    )
    demo.add_argument("--out", type=Path, default=Path("out/demo"), metavar="OUT",
                      help="where the bundle, its key and the daemon's state go")
    demo.add_argument("--requests", type=_positive, default=360,
                      help="images to send (at most the 360 held-out ones)")
    demo.add_argument("--concurrency", type=_positive, default=8, help="concurrent clients")
    demo.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    demo.add_argument("--no-update", dest="update", action="store_false",
                      help="skip the second act (a new version applied while serving)")
    demo.set_defaults(handler=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from agent.tooling.demo import DemoOptions, run_demo

    return run_demo(DemoOptions(out_dir=args.out, requests=args.requests,
                                concurrency=args.concurrency, backend=args.backend,
                                update=args.update))
