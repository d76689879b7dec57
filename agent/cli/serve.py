"""``edge-agent serve``: the on-device daemon in the foreground (systemd runs exactly this)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agent.backends import BACKEND_CHOICES


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the inference daemon in the foreground",
        description=(
            "Serve the store's current model over KServe v2 HTTP (Triton's protocol). Settings come "
            "from the TOML file (--config, $EDGE_AGENT_CONFIG or /etc/edge-agent/agent.toml), "
            "EDGE_AGENT_* variables, then the flags below. For quick use, --bundle B --pubkey PUB "
            "verifies and installs one bundle into --state-dir and serves it."
        ),
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="configuration file (TOML)")
    serve.add_argument("--bundle", type=Path, help="install this bundle and make it current")
    serve.add_argument("--pubkey", type=Path, action="append", metavar="PUB",
                       help="trusted Ed25519 public key (repeatable; adds to trust.public_keys)")
    serve.add_argument("--state-dir", metavar="DIR", help="model store directory")
    serve.add_argument("--http-host", metavar="HOST", help="listen address (default loopback)")
    serve.add_argument("--http-port", type=int, metavar="PORT", help="listen port (default 8000)")
    serve.add_argument("--backend", choices=BACKEND_CHOICES, help="inference backend")
    serve.add_argument("--print-config", action="store_true",
                       help="print the effective configuration as JSON and exit")
    serve.set_defaults(handler=run_serve)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line flags as dotted configuration keys (they win over file and environment)."""
    overrides: dict[str, Any] = {}
    if args.state_dir is not None:
        overrides["state_dir"] = args.state_dir
    if args.http_host is not None:
        overrides["http.host"] = args.http_host
    if args.http_port is not None:
        overrides["http.port"] = args.http_port
    if args.backend is not None:
        overrides["serving.backend"] = args.backend
    return overrides


def load_with_keys(args: argparse.Namespace) -> Any:
    from agent.config import load_config

    return load_config(args.config, overrides=overrides_from(args),
                       extra_public_keys=args.pubkey or ())


def run_serve(args: argparse.Namespace) -> int:
    from agent.run import run_daemon
    from agent.log import apply_level

    config = load_with_keys(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str))
        return 0
    if not (args.verbose or args.quiet):
        apply_level(config.log.level)
    return run_daemon(config, bundle=args.bundle, reload_config=lambda: load_with_keys(args))
