"""Instance autoscaling: more execution instances of the model serving while they stay busy, fewer
while requests are rare (``serving.max_instances`` and the ``scale_*`` keys).

Every ``scale_window_s`` the autoscaler looks at the window just past, from what the batcher
reported (agent/observers.py):

- utilisation: the instances' busy time (each batch's compute time) over the window's length
  times the number of instances;
- the request rate: answered requests a second.

Two windows in a row above ``scale_up_utilization`` add an instance (up to ``max_instances``,
and only when the memory available, ``MemAvailable`` in ``/proc/meminfo``, stays above
``scale_min_free_mib`` after an instance's estimated size); two windows in a row under
``scale_down_rate`` requests a second remove one (down to ``instances``). A new instance is made
and warmed up on a low-priority thread (agent/update/priority.py), as a new version is, then
joins the batcher; one removed first stops getting batches, drains and is freed. While an update
runs the autoscaler waits: the update's new version starts with ``instances`` instances. While
the power governor's sleep has the engines released (``release_engine_in_sleep``) none is added
(the load it measured is over, and the instance would hold its memory through the sleep); one
made as the board went to sleep is released with the others when it joins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import runtime
from agent.backends import backend_class, resolve_backend_name
from agent.backends.base import Backend
from agent.batcher.batcher import EngineState
from agent.observers import BatchDone, RequestDone, ServingObserver
from agent.update.priority import LowPriority

if TYPE_CHECKING:
    from agent.daemon import Daemon

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
# An instance's memory is estimated as this many times its model file (weights, the session's
# copies and its workspace); MemAvailable must stay above scale_min_free_mib after it.
INSTANCE_MEMORY_FACTOR = 3
WINDOWS_TO_ACT = 2


def available_memory_mib(meminfo: Path = MEMINFO) -> float | None:
    """``MemAvailable`` in MiB, None where the file does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Window(ServingObserver):
    """Busy time and answered requests since the last :meth:`take`."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.requests = 0

    def batch_done(self, event: BatchDone) -> None:
        self.busy_s += event.compute_s + event.compute_input_s + event.compute_output_s

    def request_done(self, event: RequestDone) -> None:
        self.requests += 1

    def take(self) -> tuple[float, int]:
        busy_s, requests = self.busy_s, self.requests
        self.busy_s, self.requests = 0.0, 0
        return busy_s, requests


@dataclass(frozen=True)
class ScaleDecision:
    """One window's figures and what was done about them (``added``, ``removed`` or ``kept``,
    with why)."""

    utilization: float
    rate_per_s: float
    instances: int
    action: str
    why: str


class Autoscaler:
    """The daemon's autoscaling task (see the module docstring).

    Args:
        daemon: The running daemon (configuration, service, updater).
        meminfo: Where the memory available is read (a test's fake file).
        clock: Monotonic seconds.
    """

    def __init__(self, daemon: Daemon, *, meminfo: Path = MEMINFO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.daemon = daemon
        self.meminfo = meminfo
        self.clock = clock
        self.decisions: list[ScaleDecision] = []
        self._busy_windows = 0
        self._quiet_windows = 0
        self._added: list[tuple[int, LowPriority]] = []  # (version, its thread) per instance added

    @property
    def enabled(self) -> bool:
        serving = self.daemon.config.serving
        return serving.max_instances > serving.instances

    async def run(self) -> None:
        serving = self.daemon.config.serving
        window = _Window()
        subscribed_to: Any = None
        unsubscribe: Callable[[], None] | None = None
        try:
            started = self.clock()
            while True:
                await asyncio.sleep(serving.scale_window_s)
                service = self._service()
                if service is None:
                    continue
                if service is not subscribed_to:  # a swap made a new service object, or first
                    if unsubscribe is not None:
                        unsubscribe()
                    unsubscribe = service.observers.subscribe(window)
                    subscribed_to = service
                    window.take()
                    started = self.clock()
                    continue
                now = self.clock()
                busy_s, requests = window.take()
                elapsed_s, started = max(now - started, 1e-9), now
                await self._decide(busy_s, requests, elapsed_s)
        finally:
            if unsubscribe is not None:
                unsubscribe()

    def _service(self) -> Any:
        services = self.daemon.services
        return next(iter(services.values())) if len(services) == 1 else None

    async def _decide(self, busy_s: float, requests: int, elapsed_s: float) -> None:
        serving = self.daemon.config.serving
        service = self._service()
        count = len(service.backends)
        utilization = busy_s / (elapsed_s * count)
        rate = requests / elapsed_s
        self._busy_windows = self._busy_windows + 1 if utilization > serving.scale_up_utilization \
            else 0
        self._quiet_windows = self._quiet_windows + 1 if rate < serving.scale_down_rate else 0
        updater = self.daemon.updater
        if updater is not None and updater.state.value not in ("idle", "failed"):
            self._record(utilization, rate, count, "kept", "an update is under way")
            return
        self._forget_other_versions(service.version)
        if self._busy_windows >= WINDOWS_TO_ACT and count < serving.max_instances:
            why = self._asleep(service) or self._memory_refusal(service)
            if why is not None:
                self._record(utilization, rate, count, "kept", why)
                return
            await self._add(service)
            self._busy_windows = 0
            self._record(utilization, rate, count + 1, "added",
                         f"utilisation {utilization:.0%} over {serving.scale_up_utilization:.0%}")
        elif self._quiet_windows >= WINDOWS_TO_ACT and count > serving.instances:
            await self._remove(service)
            self._quiet_windows = 0
            self._record(utilization, rate, count - 1, "removed",
                         f"{rate:.1f} requests/s under {serving.scale_down_rate:g}")
        else:
            self._record(utilization, rate, count, "kept", "within bounds")

    def _record(self, utilization: float, rate: float, instances: int, action: str,
                why: str) -> None:
        decision = ScaleDecision(round(utilization, 3), round(rate, 2), instances, action, why)
        self.decisions.append(decision)
        del self.decisions[:-100]
        if action != "kept":
            log.info("autoscaling: %s an instance (%s); %d now", action, why, instances)

    @staticmethod
    def _asleep(service: Any) -> str | None:
        """Why no instance is added now that the power governor's sleep released the engines
        (``release_engine_in_sleep``): the busy windows are over (the board slept for want of
        requests), and a new instance would hold the memory the sleep gave back."""
        state = getattr(service.batcher, "engine_state", EngineState.ACTIVE)
        if state in (EngineState.RELEASING, EngineState.RELEASED):
            return f"the engines are {state.value} (the board sleeps)"
        return None

    def _memory_refusal(self, service: Any) -> str | None:
        available = available_memory_mib(self.meminfo)
        if available is None:
            return None  # nothing to go by: the bound of max_instances alone
        model = service.backends[0].artifacts.directory / "model.onnx"
        try:
            estimate_mib = INSTANCE_MEMORY_FACTOR * model.stat().st_size / 2**20
        except OSError:
            estimate_mib = 0.0
        floor = self.daemon.config.serving.scale_min_free_mib
        if available - estimate_mib < floor:
            return (f"memory: {available:.0f} MiB available, an instance needs about "
                    f"{estimate_mib:.0f} and {floor} must stay free")
        return None

    async def _add(self, service: Any) -> None:
        config = self.daemon.config
        artifacts = service.backends[0].artifacts
        policy = service.batcher.policy
        worker = LowPriority(f"scale-v{artifacts.version}")
        made: list[Backend] = []

        def make() -> None:
            cls = backend_class(resolve_backend_name(config.serving.backend))
            options = runtime.backend_options(config, policy.max_batch_size)
            backend = cls(artifacts, options)
            backend.activate()
            made.append(backend)
            runtime.warm_up(backend, artifacts, max(1, config.serving.warmup_batches),
                            policy.preferred_batch_sizes[-1] if policy.preferred_batch_sizes
                            else 1)

        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(worker.executor, make)
        except BaseException:
            for backend in made:
                await loop.run_in_executor(None, backend.deactivate)
            worker.close()
            raise
        service.batcher.add_backends(made)
        worker.restore()
        self._added.append((artifacts.version, worker))

    async def _remove(self, service: Any) -> None:
        drain_s = self.daemon.config.update.drain_timeout_s
        removed = await service.batcher.remove_backends(1, drain_timeout_s=drain_s)
        loop = asyncio.get_running_loop()
        for backend in removed:
            await loop.run_in_executor(None, backend.deactivate)
        if self._added:
            _, worker = self._added.pop()
            worker.close()

    def _forget_other_versions(self, version: int) -> None:
        """Instances added to an earlier version left with it at its swap."""
        for added_version, worker in [item for item in self._added if item[0] != version]:
            worker.close()
            self._added.remove((added_version, worker))
