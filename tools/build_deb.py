#!/usr/bin/env python3
"""Build the edge-agent Debian package for boards already in the field.

    tools/build_deb.py --out dist/ --wheelhouse wheels/ [--extras device] [--arch arm64]

The wheelhouse holds wheels for the boards' architecture and Python (README, "Running it on a
board"); the package carries it, and its postinst builds the Python environment offline. What
the package holds and its maintainer scripts: agent/tooling/packaging/deb.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.errors import AgentError  # noqa: E402
from agent.tooling.packaging.deb import build_deb  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_deb.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="where to write edge-agent_VERSION_ARCH.deb")
    parser.add_argument("--wheelhouse", type=Path, required=True, metavar="DIR",
                        help="wheels for the boards, this agent's among them")
    parser.add_argument("--extras", default="device", help="the agent's extras (default device)")
    parser.add_argument("--arch", help="the Debian architecture (default: from the wheels)")
    args = parser.parse_args(argv)
    try:
        path = build_deb(REPO, args.out, wheelhouse=args.wheelhouse,
                         extras=[extra for extra in args.extras.split(",") if extra],
                         arch=args.arch)
    except AgentError as exc:
        print(f"build_deb.py: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
