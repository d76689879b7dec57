"""The on-device daemon: configuration -> model store -> backend instances -> batcher -> HTTP.

:class:`Daemon` is cheap to construct; :meth:`Daemon.start` brings up the current model from the
store, the HTTP API and then the background tasks; :meth:`Daemon.stop` stops the tasks (the last
started first), drains in-flight requests, closes the listener and frees every backend. Its
states and the transitions between them are :class:`DaemonState` and :data:`TRANSITIONS`;
components that follow them (systemd notification) subscribe with
:meth:`Daemon.add_state_listener`. ``agent/run.py`` drives this one lifecycle for every entry
point (``serve``, the demo), with the signal handling.

The updater, the MQTT control plane, the power governor and the watchdog attach here: each is a
background task (:meth:`Daemon.add_task`), they reach the store (``daemon.store``) and what the
serving path reports (``daemon.services[name].observers.subscribe``), and the blue-green swap
builds on ``Batcher.replace_backends``. Commands on the board reach them through the local
control channel (``daemon.control``, agent/control/): parts register their commands there before
the start (``daemon.control.register("update.status", handler)``); it listens while the daemon
serves, and answers ``daemon.status`` itself.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import runtime
from agent.autoscale import Autoscaler
from agent.api.server import InferenceServer
from agent.backends import ModelArtifacts
from agent.backends.base import Backend
from agent.config import AgentConfig
from agent.control import protocol
from agent.control.server import ControlServer, Emit
from agent.errors import (
    AgentError,
    BundleError,
    InternalError,
    SignatureError,
    StopRequested,
    StoreError,
)
from agent.metrics import ServingMetrics, TaskMetrics, UpdateMetrics
from agent.serving import ModelService
from agent.store import ModelStore
from agent.supervisor import Supervisor, TaskFactory, TaskState, TaskStatus
from agent.update import canary
from agent.update.canary import CanaryPolicy
from agent.update.download import DownloadPolicy
from agent.update.service import attach_updater
from agent.update.priority import thread_ids
from agent.update.states import UpdatePolicy, UpdateState
from agent.update.steps import DaemonSteps
from agent.update.updater import Updater

if TYPE_CHECKING:
    from agent.fleet.device import FleetDevice
    from agent.power.service import PowerParts, PowerService

log = logging.getLogger(__name__)


class DaemonState(enum.Enum):
    CREATED = "created"  # constructed: nothing opened, nothing running
    STARTING = "starting"  # loading the model's instances (minutes, when an engine is built)
    SERVING = "serving"  # the API answers and the background tasks run
    STOPPING = "stopping"  # tasks stopping, then in-flight requests draining
    STOPPED = "stopped"  # everything freed and the state directory let go
    FAILED = "failed"  # as STOPPED, after a failed start or a critical task's failure


TRANSITIONS: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.CREATED: frozenset({DaemonState.STARTING, DaemonState.STOPPED}),
    DaemonState.STARTING: frozenset({DaemonState.SERVING, DaemonState.STOPPING,
                                     DaemonState.FAILED}),
    DaemonState.SERVING: frozenset({DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset({DaemonState.STOPPED, DaemonState.FAILED}),
    DaemonState.STOPPED: frozenset(),
    DaemonState.FAILED: frozenset(),
}

StateListener = Callable[["DaemonState"], None]


class Daemon:
    """Everything the daemon runs, from the store to the background tasks. A daemon runs once
    (start, then stop); running again takes a new one.

    Args:
        config: The validated configuration.
        shm_root: Where clients' POSIX shared memory regions live.
        task_stop_timeout_s: How long each background task may take to end once cancelled.
    """

    def __init__(self, config: AgentConfig, *, shm_root: Path = Path("/dev/shm"),
                 task_stop_timeout_s: float = 10.0,
                 update_policy: UpdatePolicy | None = None,
                 canary_policy: CanaryPolicy | None = None,
                 download_policy: DownloadPolicy | None = None,
                 power_parts: PowerParts | None = None) -> None:
        self.config = config
        self.shm_root = shm_root
        self.state = DaemonState.CREATED
        self.store = ModelStore(config.state_dir, trusted_keys=config.trust.keys,
                                keep_versions=config.store.keep_versions)
        self.services: dict[str, ModelService] = {}
        self.server: InferenceServer | None = None
        self.task_metrics = TaskMetrics()
        self.supervisor = Supervisor(on_change=self._task_changed,
                                     stop_timeout_s=task_stop_timeout_s)
        self.control = ControlServer(config.state_dir / protocol.SOCKET_NAME)
        self.control.register(protocol.DAEMON_STATUS, self._status_command)
        self.failure: AgentError | None = None  # why the daemon stopped itself
        self._listeners: list[StateListener] = []
        self._stop_requested = threading.Event()  # read by the start's worker thread
        self._stop_wanted: asyncio.Event | None = None
        self._start_done: asyncio.Event | None = None
        self._stop_task: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.updater: Updater | None = None
        self.update_steps: DaemonSteps | None = None
        updater = attach_updater(self, policy=update_policy, canary=canary_policy,
                                 download=download_policy)
        # Before the fleet: its reported documents and commands include the governor's.
        self.power: PowerService | None = None
        if config.power.enabled:
            from agent.power.service import attach_power

            self.power = attach_power(self, power_parts)
        self.fleet: FleetDevice | None = None
        if config.fleet.enabled:
            # Imported here: paho (the device extra) only on boards that use fleet control.
            from agent.fleet.service import attach_fleet

            attach_fleet(self)
        self.autoscaler = Autoscaler(self)
        if self.autoscaler.enabled:
            self.add_task("autoscaler", self.autoscaler.run)
        self.update_metrics = UpdateMetrics(
            updater.status, [state.value for state in UpdateState],
            lambda: {name: len(service.backends) for name, service in self.services.items()})

    # -- parts attached before the start --------------------------------------------------------

    def add_task(self, name: str, run: TaskFactory, *, critical: bool = False) -> None:
        """Run ``run()`` as a background task once the model serves (see agent/supervisor.py);
        a ``critical`` task's failure stops the daemon."""
        self.supervisor.add(name, run, critical=critical)

    def add_state_listener(self, listener: StateListener) -> None:
        """Call ``listener(state)`` on every state change, on the thread that made it."""
        self._listeners.append(listener)

    # -- the store ------------------------------------------------------------------------------

    def install(self, bundle: Path) -> ModelArtifacts:
        """Verify and install a bundle (``serve --bundle``); :meth:`start` given the result makes
        it current once it serves. Versions beyond ``store.keep_versions`` are deleted first, to
        make room."""
        self.store.open()
        self._collect_garbage()
        return self.store.install(bundle, device_class=self.config.device_class)

    def make_current(self, artifacts: ModelArtifacts) -> None:
        """Activate an installed version, then delete versions beyond ``store.keep_versions``."""
        self.store.open()
        self.store.activate(artifacts.name, artifacts.version)
        log.info("%s v%d is current", artifacts.name, artifacts.version)
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        try:
            self.store.garbage_collect()
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    def close(self) -> None:
        """Let go of the state directory."""
        self.store.close()

    # -- the lifecycle --------------------------------------------------------------------------

    async def start(self, candidate: ModelArtifacts | None = None) -> int:
        """Load the current model, or ``candidate`` (an installed version), start the HTTP API
        and then the background tasks; returns the port. A candidate becomes current only once
        its model has loaded: one that does not load (a broken ONNX, a backend this device
        lacks) leaves current as it was.

        Raises:
            StopRequested: a stop was requested before the model served (the daemon is then
                STOPPED).
            AgentError: the model could not be loaded or served (the daemon is then FAILED).
            In both cases everything is freed and the state directory let go.
        """
        self._loop = asyncio.get_running_loop()
        self._stop_wanted = asyncio.Event()
        self._start_done = asyncio.Event()
        if self._stop_requested.is_set():
            self._stop_wanted.set()
        self._set_state(DaemonState.STARTING)
        try:
            try:
                port = await self._start(candidate)
            except StopRequested:
                self.close()
                self._set_state(DaemonState.STOPPING)
                self._set_state(DaemonState.STOPPED)
                raise
            except BaseException as exc:
                if isinstance(exc, AgentError):
                    self._name_unused_candidate(candidate)
                self.close()
                self._set_state(DaemonState.FAILED)
                raise
            self._set_state(DaemonState.SERVING)
            self.supervisor.start()
        finally:
            self._start_done.set()
        return port

    async def _start(self, candidate: ModelArtifacts | None) -> int:
        self.store.open()
        artifacts = self._verified(candidate)
        policy = runtime.batch_policy(self.config, artifacts)

        def start_backends() -> list[Backend]:
            # Before serving, and off the loop: left to the first update, the canary's verdict
            # did numpy's first-time work on the loop while requests waited.
            canary.warm_up()
            return runtime.start_backends(self.config, artifacts, policy,
                                          self._stop_requested.is_set)

        before = thread_ids()
        backends = await asyncio.get_running_loop().run_in_executor(None, start_backends)
        metrics = ServingMetrics(artifacts.name)
        service = ModelService(artifacts.name, artifacts.version, backends, policy,
                               metrics=metrics)
        # The instances' own threads (ONNX Runtime's pools; the default executor's thread that
        # made them is among them, and does nothing else heavy).
        service.backend_threads = thread_ids() - before
        self.services[artifacts.name] = service
        http = self.config.http
        self.server = InferenceServer(
            self.services, host=http.host, port=http.port,
            token=http.token.reveal() if http.token is not None else None,
            max_body_bytes=http.max_body_bytes,
            metrics_render=lambda: (metrics.render() + self.task_metrics.render()
                                    + self.update_metrics.render()
                                    + (self.power.metrics.render() if self.power else b"")),
            shm_root=self.shm_root, access_log=http.access_log)
        service.start()
        try:
            if self._stop_requested.is_set():  # asked to stop while the instances started
                raise StopRequested("stopped before serving", model=artifacts.name)
            if candidate is not None:  # its model loaded: it is the one to serve from now on
                self.make_current(artifacts)
            await self.control.start()
            return await self.server.start()
        except BaseException:
            await self.control.stop()
            await service.stop(drain=False)
            self._free()
            raise

    def _name_unused_candidate(self, candidate: ModelArtifacts | None) -> None:
        """Say that a bundle installed for this start is not the current version: its start
        failed (an error reading the pointer must not hide the start's own error)."""
        if candidate is None:
            return
        try:
            current = self.store.current()
        except StoreError as exc:
            log.error("%s v%d is installed but was not made current, since its start failed; "
                      "the current version cannot be read: %s", candidate.name,
                      candidate.version, exc)
            return
        if current is None or (current.name, current.version) != (candidate.name,
                                                                   candidate.version):
            log.error("%s v%d is installed but was not made current, since its start failed; "
                      "current is still %s", candidate.name, candidate.version,
                      f"{current.name} v{current.version}" if current else "none")

    def _verified(self, candidate: ModelArtifacts | None) -> ModelArtifacts:
        """The version to serve, verified again: the disk may have changed since install (a
        power loss, a damaged file)."""
        current = candidate or self._current_or_previous()
        if current is None:
            installed = {name: self.store.versions(name) for name in self.store.names()}
            if any(installed.values()):
                raise StoreError("no current model: 'edge-agent serve --bundle B --pubkey PUB' "
                                 "installs and activates one", state_dir=self.config.state_dir,
                                 installed=", ".join(f"{name} v{versions}" for name, versions
                                                     in installed.items() if versions))
            raise StoreError("no model installed: install a bundle with "
                             "'edge-agent serve --bundle B --pubkey PUB'",
                             state_dir=self.config.state_dir)
        return self.store.load(current.name, current.version)

    def _current_or_previous(self) -> ModelArtifacts | None:
        """The current version; the previous one when the current one no longer verifies (a
        damaged file, a key no longer trusted), which then becomes current again."""
        current = self.store.current()
        if current is None:
            return None
        try:
            return self.store.load(current.name, current.version)
        except (StoreError, BundleError, SignatureError) as exc:
            previous = self.store.previous()
            if previous is None:
                raise
            log.error("%s v%d fails verification (%s): falling back to %s v%d", current.name,
                      current.version, exc, previous.name, previous.version)
            return self.store.rollback()

    def request_stop(self) -> None:
        """Ask the daemon to stop (thread-safe): :meth:`wait_for_stop` returns, and a start that
        is still building or loading the model's instances raises ``StopRequested`` instead of
        finishing."""
        self._stop_requested.set()
        loop, wanted = self._loop, self._stop_wanted
        if loop is None or wanted is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            wanted.set()
        else:
            loop.call_soon_threadsafe(wanted.set)

    async def wait_for_stop(self) -> None:
        """Return once a stop is requested: :meth:`request_stop` (a signal), :meth:`stop`, or a
        critical background task's failure (then :attr:`failure` says which)."""
        if self._stop_wanted is None:
            raise InternalError("Daemon.wait_for_stop() before start()")
        await self._stop_wanted.wait()

    async def stop(self, *, timeout_s: float = 30.0) -> None:
        """Stop the background tasks, drain in-flight requests (queued ones for at most
        ``timeout_s``; a running batch always finishes), free the model's instances and let go
        of the state directory. Safe from anywhere on the loop, a background task included:
        every caller waits for the one stop, and a caller that is cancelled meanwhile does not
        cut it short. A start in progress is asked to end first."""
        self.request_stop()
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(timeout_s))
        await asyncio.shield(self._stop_task)

    async def _stop(self, timeout_s: float) -> None:
        if self.state is DaemonState.STARTING and self._start_done is not None:
            await self._start_done.wait()  # it ends at its next check, or serves first
        if self.state in (DaemonState.STOPPED, DaemonState.FAILED):
            self.close()
            return
        if self.state is DaemonState.CREATED:
            self.close()
            self._set_state(DaemonState.STOPPED)
            return
        self._set_state(DaemonState.STOPPING)
        try:
            # Commands first: none starts while the parts they drive are stopping.
            await self.control.stop()
            await self.supervisor.stop()
            if self.server is not None:
                log.info("stopping: draining in-flight requests")
                await self.server.stop(drain=True, timeout_s=timeout_s)
                self.server = None
        finally:
            self._free()
            self.close()
            self._set_state(DaemonState.FAILED if self.failure else DaemonState.STOPPED)

    def status(self) -> dict[str, Any]:
        """What the daemon is doing: its state, the versions it serves and its tasks."""
        return {
            "state": self.state.value,
            "models": {name: service.version for name, service in self.services.items()},
            "tasks": [task.to_json() for task in self.supervisor.status()],
            "failure": str(self.failure) if self.failure else None,
            "fleet": self.fleet.status() if self.fleet is not None else None,
            "power": self.power.reported() if self.power is not None else None,
        }

    async def _status_command(self, args: dict[str, Any], emit: Emit) -> dict[str, Any]:
        return self.status()

    def _free(self) -> None:
        for service in self.services.values():
            for backend in service.backends:
                backend.deactivate()
        self.services.clear()

    def _set_state(self, state: DaemonState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise InternalError(f"the daemon cannot go from {self.state.value} to {state.value}")
        log.debug("daemon %s -> %s", self.state.value, state.value)
        self.state = state
        for listener in tuple(self._listeners):
            try:
                listener(state)
            except Exception:  # noqa: BLE001 - a listener's bug must not break the lifecycle
                log.exception("daemon state listener failed")

    def _task_changed(self, status: TaskStatus, error: BaseException | None) -> None:
        failed = status.state is TaskState.FAILED
        self.task_metrics.task_changed(status.name, running=status.state is TaskState.RUNNING,
                                       failed=failed)
        # A failure while the daemon stops (a task that raises as it is cancelled) is logged
        # and counted, but the stop was asked for: it does not turn into the daemon's failure.
        if (failed and status.critical and self.failure is None
                and self.state is DaemonState.SERVING):
            self.failure = AgentError("a critical background task failed", task=status.name,
                                      reason=status.error)
            self.request_stop()
