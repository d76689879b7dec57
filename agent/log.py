"""Logging set up once for every entry point.

Libraries in this project only call ``logging.getLogger(__name__)``; the CLI calls
:func:`configure_logging` once. Log lines go to stderr so that a command's stdout stays parseable.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_configured = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # the base class assigns it once; ignore that
        pass


def configure_logging(verbosity: int = 0) -> None:
    """Configure the root logger once.

    Args:
        verbosity: 0 logs warnings and info from this project, 1 adds debug, -1 keeps only errors.
            Without a flag (0), ``EDGE_AGENT_LOG_LEVEL`` (a level name) sets the level: the
            command line wins over the environment, as for every setting.
    """
    global _configured
    if _configured:
        return
    level_name = os.environ.get("EDGE_AGENT_LOG_LEVEL") if verbosity == 0 else None
    if level_name:
        level = logging.getLevelName(level_name.upper())
        if not isinstance(level, int):
            level = logging.INFO
    else:
        level = {-1: logging.ERROR, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for package in ("agent", "models", "pruning", "power"):
        logging.getLogger(package).setLevel(level)
    _configured = True


def apply_level(level_name: str) -> None:
    """Set the project's loggers to a level by name (the daemon's ``log.level`` setting)."""
    level = logging.getLevelName(level_name.upper())
    if isinstance(level, int):
        for package in ("agent", "models", "pruning", "power"):
            logging.getLogger(package).setLevel(level)
