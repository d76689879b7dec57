"""A build's progress and cancellation: TensorRT's progress monitor (10.0+), which logs the build's
phases and ends the build early when a stop is requested.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.errors import EngineError, StopRequested

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


class EngineBuildCancelled(EngineError, StopRequested):
    """The build was stopped on request (the daemon is shutting down) before it finished."""


class BuildProgress:
    """What a build's progress monitor saw: whether it asked TensorRT to stop, and an interrupt
    (Ctrl-C, or SIGTERM turned into one by the CLI) that arrived inside a callback."""

    def __init__(self, stop_requested: Callable[[], bool] | None) -> None:
        self.stop_requested = stop_requested
        self.cancelled = threading.Event()
        # TensorRT may report steps from several threads at once: the stop question is asked
        # by one at a time, so a stop is seen once and never asked again.
        self._asking = threading.Lock()
        self.interrupt: BaseException | None = None
        self.phase_started: dict[str, tuple[float, bool]] = {}  # name -> (start, top-level)

    def guarded(self, callback: Callable[[], bool]) -> bool:
        """Run a callback for TensorRT: nothing may escape into its C++ caller (declared
        noexcept, it would abort the process). A failure is logged and the build goes on; an
        interrupt stops the build and is raised again once TensorRT has returned."""
        try:
            return callback()
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("engine build: a progress callback failed; building on")
            return True
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit
            if self.interrupt is None:
                self.interrupt = exc
            self.cancelled.set()
            return False

    def should_go_on(self) -> bool:
        with self._asking:
            if self.cancelled.is_set():
                return False
            if self.stop_requested is not None and self.stop_requested():
                log.info("engine build: stop requested, asking TensorRT to end the build")
                self.cancelled.set()
                return False
            return True

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> bool:
        top = parent_phase is None
        self.phase_started[phase_name] = (time.monotonic(), top)
        log.log(logging.INFO if top else logging.DEBUG, "engine build: %s (%d step(s))",
                phase_name, num_steps)
        return True

    def phase_finish(self, phase_name: str) -> bool:
        started = self.phase_started.pop(phase_name, None)
        if started is not None:
            log.log(logging.INFO if started[1] else logging.DEBUG, "engine build: %s done in %.1f s",
                    phase_name, time.monotonic() - started[0])
        return True


def make_progress_monitor(progress: BuildProgress) -> trt.IProgressMonitor:
    """A TensorRT progress monitor that logs the build's phases (top-level ones at INFO, with how
    long they took) and stops the build when ``progress.stop_requested`` says so. TensorRT calls
    it from its own threads and from the building one; every call goes through
    ``progress.guarded``."""
    import tensorrt as trt

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            # pybind11 requires the base __init__ when a Python class overrides the interface.
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name: str, parent_phase: str, num_steps: int) -> None:
            progress.guarded(lambda: progress.phase_start(phase_name, parent_phase, num_steps))

        def step_complete(self, phase_name: str, step: int) -> bool:
            return progress.guarded(progress.should_go_on)

        def phase_finish(self, phase_name: str) -> None:
            progress.guarded(lambda: progress.phase_finish(phase_name))

    return _Monitor()
