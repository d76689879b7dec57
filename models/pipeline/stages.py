"""The timer of a build's stages: what each took, for the report and the summary."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class _Stages:
    """Times and logs the stages of a build. A stage may run stages of its own: ``within`` maps
    it to them, so that a summary does not add nested times to the ones around them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.within: dict[str, list[str]] = {}
        self._running: list[str] = []

    def run(self, name: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        log.info("== %s", name)
        if self._running:
            self.within.setdefault(self._running[-1], []).append(name)
        self._running.append(name)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            self._running.pop()
            self.seconds[name] = round(time.perf_counter() - started, 2)
