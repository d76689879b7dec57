"""`edge-agent build`: placeholder until the subcommand lands."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    pass
