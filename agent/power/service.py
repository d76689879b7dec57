"""The power governor attached to a daemon: a supervised task whose thread steps the controller.

:func:`attach_power` (the daemon calls it when ``[power] enabled``) makes a :class:`PowerService`,
registers its background task ``power``, its control commands (``power.status``, ``power.set``,
``power.wake``) and its metrics. Once the model serves, the task starts the power thread, where
every read and write of the board's files happens (never on the event loop):

1. the board is opened (``power/board.py``, over ``[power] root``);
2. the controller (``power/controller.py``) starts with ``<state_dir>/power/saved.json``
   (``power/saved.py``) as its snapshot store: if the file is there, the previous run did not
   stop cleanly (a crash, a SIGKILL, a power loss with the file system kept) and the limits it
   saved are put back first; otherwise the limits as they are now are saved there;
3. the controller is stepped every ``control_period_s``
   with a :class:`~power.types.LoadSample` from the batchers' load and the
   :class:`~power.types.Completion` of every answered request since the last step (a serving
   observer collects them on the loop); telemetry is read every ``telemetry_period_s``;
4. when the controller says the board is idle or sleeping, the batchers are armed: the first
   request after that waits (at most ``wake_timeout_s``) for :meth:`PowerService.wake`, which
   has the controller boost the board before the request is dispatched; with
   ``release_engine_in_sleep`` the controller's sleep also has every batcher free its
   instances' engines (``Batcher.release_engine``), and the wake (or the first request itself)
   re-creates them before anything is dispatched (not bounded by ``wake_timeout_s``: there is
   nothing to serve with until they are back);
5. on stop (the daemon's shutdown, or the thread's own failure) the controller stops: it
   restores the saved limits and removes the file (which stays, for the next start, when the
   restore fails). At the daemon's shutdown the engines that sleep released stay released (a
   request that still comes re-creates them itself); after the thread's failure they come back.

A failure of the power thread fails the task, which the supervisor logs and reports
(``edge_agent_task_up{task="power"} 0``); the model serves on, on the board's restored limits.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.config import PowerConfig
from agent.errors import AgentError, ConfigError, InternalError, PowerError, first_line
from agent.metrics import PowerMetrics
from agent.observers import RequestDone, ServingObserver
from agent.power.policy import POLICY_KEYS, policy_from_config, policy_to_json, with_changes
from power.saved import SavedSnapshot
from power.types import (
    BoardControl,
    Completion,
    LoadSample,
    PowerPolicy,
    PowerState,
    Telemetry,
)

if TYPE_CHECKING:
    from agent.daemon import Daemon

__all__ = ["POWER_SET", "POWER_STATUS", "POWER_WAKE", "PowerController", "PowerParts",
           "PowerService", "attach_power"]

log = logging.getLogger(__name__)

POWER_STATUS = "power.status"
POWER_SET = "power.set"
POWER_WAKE = "power.wake"
SAVED_NAME = "saved.json"
MAX_COMPLETIONS = 10_000  # kept between two steps; beyond it the oldest are dropped
THREAD_JOIN_S = 10.0
CALL_TIMEOUT_S = 10.0  # a control command's call onto the power thread


class PowerController(Protocol):
    """What the service drives (``power/controller.py``'s ``Controller``). Every method is
    called on the power thread only. ``status()`` is JSON-able and has at least ``state`` (a
    :class:`~power.types.PowerState` value) and ``point`` (the operating point in force, as
    ``OperatingPoint.to_json``), and ``changes`` (operating point changes so far) when the
    controller counts them; its ``telemetry`` attribute is its latest reading, if it reads."""

    def start(self) -> None: ...

    def step(self, load: LoadSample, completions: Sequence[Completion]) -> Any: ...

    def needs_wake(self) -> bool: ...

    def wake(self, reason: str = "request") -> None: ...

    def set_policy(self, policy: PowerPolicy) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def stop(self) -> Any: ...


STEP_SILENCE_S = 10.0
"""The power thread not stepping for this long (or 100 control periods) makes the daemon
unhealthy for the systemd watchdog (a wedged sysfs read, a deadlock)."""


def open_board(config: PowerConfig) -> BoardControl:
    """The board under ``[power] root`` (``power/board.py``), of the profile ``[power] board``
    names, or identified from its device tree."""
    from power.board import Board
    from power.profiles import profile

    from power.helper_client import board_access

    access: dict[str, Any]
    if config.helper_socket is not None:
        from power.helper_client import HelperRunner, HelperWriter

        writer = HelperWriter(config.helper_socket)
        access = {"writer": writer, "runner": HelperRunner(writer)}
    else:
        # Not root on the real board, with the privileged helper's socket there (the service's
        # units): limits and nvpmodel go through it. Otherwise the board layer's own writer.
        access = board_access(config.root)
    return Board.open(config.root, profile=profile(config.board) if config.board else None,
                      **access)


def make_controller(board: BoardControl, policy: PowerPolicy, saved: SavedSnapshot,
                    config: PowerConfig) -> PowerController:
    """The governor's controller (``power/controller.py``) on ``board``."""
    from power.controller import Controller

    return Controller(board, policy, saved=saved,
                      telemetry_period_s=config.telemetry_period_s)


@dataclass(frozen=True)
class PowerParts:
    """How the service gets its board and controller (injected by tests and the simulator)."""

    open_board: Callable[[PowerConfig], BoardControl] = open_board
    make_controller: Callable[[BoardControl, PowerPolicy, SavedSnapshot, PowerConfig],
                              PowerController] = make_controller


class _Completions(ServingObserver):
    """Collects answered requests on the event loop for the power thread's next step."""

    def __init__(self) -> None:
        self.queue: collections.deque[Completion] = collections.deque(maxlen=MAX_COMPLETIONS)

    def request_done(self, event: RequestDone) -> None:
        if event.outcome == "cancelled":
            return
        self.queue.append(Completion(time_s=time.monotonic(), total_s=event.total_s,
                                     compute_s=event.compute_s,
                                     ok=event.outcome == "success"))

    def drain(self) -> list[Completion]:
        taken = []
        while True:
            try:
                taken.append(self.queue.popleft())
            except IndexError:
                return taken


class PowerService:
    """The power governor of one daemon. Cheap to construct; the task's :meth:`run` does the
    work.

    Args:
        config: ``[power]``.
        state_dir: The daemon's state directory (the saved limits go to ``power/`` in it).
        parts: Where the board and the controller come from.
        batchers: The batchers to wake and to read the load of (``agent.batcher.Batcher``).
        observers: Where the answered requests are reported (the services' ``Observers``).
    """

    def __init__(self, config: PowerConfig, state_dir: Path, *,
                 batchers: Callable[[], Sequence[Any]],
                 observers: Callable[[], Sequence[Any]] = lambda: (),
                 parts: PowerParts | None = None) -> None:
        self.config = config
        self.parts = parts or PowerParts()
        self.saved = SavedSnapshot(state_dir / "power" / SAVED_NAME)
        self.metrics = PowerMetrics(self.metrics_view)
        self._batchers = batchers
        self._observers = observers
        self._controller: PowerController | None = None
        self._serving: list[Any] = []
        self._in_force = config  # the section with the policy in force (set, desired)
        # The run-time changes in force over the configured section (desired.power's keys,
        # then power set's): a reload of [power] keeps them over the new section.
        self._overrides: dict[str, Any] = {}
        self._policy = policy_from_config(config)
        self._reloads: set[asyncio.Task[None]] = set()
        self._completions = _Completions()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]
                                       | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future[None] | None = None
        self._running = False
        self._status: dict[str, Any] = {"state": None}
        self._telemetry: Telemetry | None = None
        self._decisions = 0
        self._wakes = 0
        self._last_wake_s: float | None = None
        self._restored_at_start = False
        self._needs_wake = False
        self._reload_told_s: float | None = None  # the engine restore the controller was told
        self._unsubscribe: list[Callable[[], None]] = []
        self.last_step_at: float | None = None  # monotonic; set by the power thread

    # -- the task -------------------------------------------------------------------------------

    async def run(self) -> None:
        """The daemon's ``power`` task: the power thread, until cancelled (then the board is
        restored before this returns) or until the thread fails (this raises its error)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._failed = loop.create_future()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._thread_main, args=(started,),
                                        name="power", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(started)  # the board opened and the controller started
            self._attach_serving()
            self._running = True
            await asyncio.shield(self._failed)
        finally:
            self._running = False
            self._detach_serving()
            self._stopping.set()
            self._calls.put(None)
            thread = self._thread
            if thread is not None:
                await loop.run_in_executor(None, thread.join, THREAD_JOIN_S)
                if thread.is_alive():
                    log.error("the power thread did not end within %.0f s", THREAD_JOIN_S)

    def _attach_serving(self) -> None:
        # Taken once, on the loop: the power thread reads their load from this list (a swap
        # keeps each model's batcher; load() only reads counters).
        self._serving = list(self._batchers())
        for batcher in self._serving:
            batcher.set_wake_hook(self._wake_for_request, timeout_s=self.config.wake_timeout_s)
        self._subscribe()

    def _subscribe(self) -> None:
        self._unsubscribe = [observers.subscribe(self._completions)
                             for observers in self._observers()]

    def _detach_serving(self) -> None:
        for batcher in self._batchers():
            batcher.set_wake_hook(None)
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    # -- the power thread -----------------------------------------------------------------------

    def _thread_main(self, started: concurrent.futures.Future[None]) -> None:
        controller: PowerController | None = None
        board: BoardControl | None = None
        error: BaseException | None = None
        try:
            board = self.parts.open_board(self.config)
            self.saved.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Left by a run that did not stop: the controller's start puts it back first.
            self._restored_at_start = self.saved.load() is not None
            controller = self.parts.make_controller(board, self._policy, self.saved,
                                                    self.config)
            # release_engine_in_sleep: the controller's sleep frees the batchers' engines and
            # a wake brings them back (a controller double without the hook releases nothing).
            set_engine_hook = getattr(controller, "set_engine_hook", None)
            if callable(set_engine_hook):
                set_engine_hook(self._on_engine)
            controller.start()
            self._controller = controller
            self._after_step(controller)
            self._read_telemetry(board, controller)
            started.set_result(None)
            self._loop_steps(board, controller)
        except BaseException as exc:  # noqa: BLE001 - handed to the task, which raises it
            error = exc
        finally:
            self._refuse_waiting_calls()
            error = self._stop_controller(controller, board) or error
            # A privileged helper's connection is its lease: closed once the board is back.
            close = getattr(getattr(board, "writer", None), "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - the stop goes on
                    log.warning("closing the board's writer failed: %s", first_line(exc))
            if not started.done():
                started.set_exception(error or InternalError("the power thread ended early"))
            elif error is not None or not self._stopping.is_set():
                self._fail(error or InternalError("the power thread ended by itself"))

    def _refuse_waiting_calls(self) -> None:
        """Answer the calls still queued (a command that came as the thread ended)."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call is not None and call[1].set_running_or_notify_cancel():
                call[1].set_exception(PowerError("the power governor stopped before this ran"))

    def _read_telemetry(self, board: BoardControl, controller: PowerController) -> None:
        """The controller's own latest reading where it reads telemetry, else the board's."""
        reading = getattr(controller, "telemetry", None)
        self._telemetry = reading if isinstance(reading, Telemetry) else board.telemetry()

    def _loop_steps(self, board: BoardControl, controller: PowerController) -> None:
        period_s = self.config.control_period_s
        next_step = time.monotonic() + period_s
        next_telemetry = time.monotonic() + self.config.telemetry_period_s
        while not self._stopping.is_set():
            try:
                call = self._calls.get(timeout=max(0.0, next_step - time.monotonic()))
            except queue.Empty:
                call = None
            if call is not None:
                self._run_call(controller, *call)
                continue
            if self._stopping.is_set():
                break
            now = time.monotonic()
            if now < next_step:
                continue
            controller.step(self._load(now), self._completions.drain())
            self._after_step(controller)
            next_step = max(next_step + period_s, now)  # no burst of steps after a stall
            if now >= next_telemetry:
                self._read_telemetry(board, controller)
                next_telemetry = now + self.config.telemetry_period_s

    def _run_call(self, controller: PowerController, function: Callable[[], Any],
                  future: concurrent.futures.Future[Any]) -> None:
        """One call from the loop. The status is taken before the caller is answered, so that
        what it reports next (a wake's answer: the state) is the state the call left."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = function()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            try:
                self._after_step(controller)
            finally:
                future.set_exception(exc)
            return
        try:
            self._after_step(controller)
        except BaseException:  # the call's caller is answered, then the thread fails
            future.set_result(result)
            raise
        future.set_result(result)

    def _load(self, now: float) -> LoadSample:
        snapshots = [batcher.load() for batcher in self._serving]
        return LoadSample(time_s=now,
                          queue_depth=sum(s.queue_depth for s in snapshots),
                          busy_instances=sum(s.busy_instances for s in snapshots),
                          instances=sum(s.instances for s in snapshots),
                          arrivals_total=sum(s.arrivals_total for s in snapshots),
                          completed_total=sum(s.completed_total for s in snapshots))

    def liveness(self) -> str | None:
        """For the systemd watchdog's health check: None while the power thread steps (or has
        not started), else why not."""
        if not self._running or self.last_step_at is None:
            return None
        quiet_s = time.monotonic() - self.last_step_at
        limit_s = max(STEP_SILENCE_S, 100 * self.config.control_period_s)
        if quiet_s > limit_s:
            return f"the power thread has not stepped for {quiet_s:.0f} s"
        return None

    def _after_step(self, controller: PowerController) -> None:
        self.last_step_at = time.monotonic()
        status = controller.status()
        before = self._status
        if isinstance(status.get("changes"), int):
            self._decisions = status["changes"]
        elif before.get("point") is not None and status.get("point") != before.get("point"):
            self._decisions += 1
        self._status = status
        needs_wake = controller.needs_wake()
        if needs_wake and not self._needs_wake:
            self._on_loop(self._arm)
        elif self._needs_wake and not needs_wake:
            # Raised by other means (a profile set, the governor itself): the next request
            # goes straight on. The loop runs these in the order they were sent.
            self._on_loop(self._disarm)
        self._needs_wake = needs_wake
        self._tell_engine_reload(controller)

    def _tell_engine_reload(self, controller: PowerController) -> None:
        """Hand the controller the longest engine restore the batchers measured (sleep's
        break-even with ``release_engine_in_sleep``), each time it changes."""
        measured = [seconds for batcher in self._serving
                    if isinstance(seconds := getattr(batcher, "last_restore_s", None), float)]
        if not measured or max(measured) == self._reload_told_s:
            return
        self._reload_told_s = max(measured)
        setter = getattr(controller, "set_engine_reload_s", None)
        if callable(setter):
            setter(self._reload_told_s)

    def _stop_controller(self, controller: PowerController | None,
                         board: BoardControl | None) -> BaseException | None:
        """Stop the controller, which puts the board's saved limits back; its error, if any
        (the saved file then stays, and the next start restores from it).

        The controller forgets the saved limits once it has tried; where the board then does
        not read back as saved (a limit's file gone or refusing the write: a degraded control
        is skipped, not a mismatch), they are saved again, so that the next start restores
        what this stop could not."""
        if controller is None:
            return None
        try:
            wanted = self.saved.load()
        except Exception as exc:  # noqa: BLE001 - the controller's stop still restores
            log.warning("the saved board limits could not be read before the stop: %s",
                        first_line(exc))
            wanted = None
        try:
            result = controller.stop()
        except Exception as exc:  # noqa: BLE001 - reported as the task's failure
            log.error("the power controller failed to stop and restore the board (the next "
                      "start restores it): %s", first_line(exc))
            return exc
        mismatches = getattr(result, "mismatches", ())
        left = self._not_restored(board, wanted)
        if left and wanted is not None:
            try:
                self.saved.save(wanted)
                kept = f"kept in {self.saved.path} for the next start"
            except Exception as exc:  # noqa: BLE001 - said, the stop goes on
                kept = f"and could not be kept for the next start: {first_line(exc)}"
            log.error("the board's limits are not all back: %s; %s", ", ".join(left[:5]), kept)
        elif mismatches:
            log.error("restoring the board left %d limit(s) different: %s", len(mismatches),
                      ", ".join(str(getattr(m, "path", m)) for m in mismatches[:5]))
        else:
            log.info("the board's limits are restored")
        return None

    @staticmethod
    def _not_restored(board: BoardControl | None, wanted: dict[str, Any] | None) -> list[str]:
        """What of the saved limits ``wanted`` the board does not read back (paths, or the
        snapshot's keys where it has no files)."""
        if board is None or wanted is None:
            return []
        try:
            found = board.snapshot()
        except Exception as exc:  # noqa: BLE001 - unreadable is not restored
            return [f"the board cannot be read ({first_line(exc)})"]
        if found == wanted:
            return []
        files, found_files = wanted.get("files"), found.get("files")
        if isinstance(files, dict) and isinstance(found_files, dict):
            left = [f"{path} (wanted {value}, found {found_files.get(path, 'no file')})"
                    for path, value in sorted(files.items()) if found_files.get(path) != value]
            if wanted.get("nvpmodel_mode") != found.get("nvpmodel_mode"):
                left.append(f"nvpmodel mode (wanted {wanted.get('nvpmodel_mode')}, found "
                            f"{found.get('nvpmodel_mode')})")
            return left
        return [str(key) for key in sorted(wanted) if found.get(key) != wanted[key]]

    # -- the loop's side ------------------------------------------------------------------------

    def _on_loop(self, callback: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:
                pass  # the loop closed meanwhile: nothing left to arm

    def _on_engine(self, restore: bool) -> None:
        """The controller's engine hook (power thread): sleep releases every model's engines,
        a wake restores them, on the loop. The batcher holds requests until they are back, so
        a request that comes before the restore is done waits, and one that comes while they
        are released restores them itself."""
        if restore and self._stopping.is_set():
            # The governor is stopping (the daemon's shutdown): its controller's stop puts the
            # board back, but re-creating the engines only for the daemon to free them would
            # hold its stop for each instance's restore (seconds for a TensorRT engine) and take
            # back the memory the sleep let go. A request that still comes restores them itself.
            log.info("the engines stay released: the power governor is stopping")
            return

        def apply() -> None:
            for batcher in self._batchers():
                if restore:
                    batcher.restore_engine()
                else:
                    batcher.release_engine()

        self._on_loop(apply)

    def _arm(self) -> None:
        if self._running:
            for batcher in self._batchers():
                batcher.arm_wake()

    def _disarm(self) -> None:
        for batcher in self._batchers():
            batcher.disarm_wake()

    def _fail(self, error: BaseException) -> None:
        def fail() -> None:
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(error)
        self._on_loop(fail)

    async def _call(self, function: Callable[[], Any], what: str) -> Any:
        """Run ``function`` on the power thread and return its result."""
        if not self._running:
            raise PowerError("the power governor is not running", command=what,
                             state=self._status.get("state"))
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((function, future))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise PowerError("the power thread did not answer", command=what,
                             timeout_s=CALL_TIMEOUT_S) from None

    async def _wake_for_request(self) -> None:
        try:
            await self.wake("request")
        except PowerError as exc:
            if not self._stopping.is_set():
                raise
            # The governor stopped while the request waited for it (the daemon's shutdown):
            # the board is back on its own limits and the request is served without the boost.
            log.info("a request's wake was not needed: the power governor stopped (%s)",
                     exc.message)

    async def wake(self, trigger: str) -> float:
        """Have the controller wake the board (boost before the next request runs); returns
        the seconds it took, which the wake histogram records by ``trigger``."""
        started = time.monotonic()
        await self._call(lambda: self._on_thread().wake(trigger), f"wake ({trigger})")
        seconds = time.monotonic() - started
        # A request's wake is counted even where the controller's own step raised the board
        # for the same requests a moment before the call ran (they waited for either).
        self._wakes += 1
        self._last_wake_s = seconds
        self.metrics.observe_wake(trigger, seconds)
        for batcher in self._batchers():
            batcher.disarm_wake()
        log.info("woke the board for a %s in %.1f ms", trigger, seconds * 1e3)
        return seconds

    def _on_thread(self) -> PowerController:
        if self._controller is None:
            raise InternalError("a power call ran before the controller started")
        return self._controller

    async def set_policy(self, changes: dict[str, Any], *, base: PowerConfig | None = None
                         ) -> PowerPolicy:
        """Apply ``changes`` (policy keys, JSON values) to ``base`` (default: the policy in
        force) and hand the result to the controller.

        Raises:
            ConfigError: a bad key or value (nothing changes).
            PowerError: the governor is not running.
        """
        changed = with_changes(base if base is not None else self._in_force, changes)
        policy = policy_from_config(changed)
        if self._running or self._controller is not None:
            await self._call(lambda: self._controller_set_policy(policy), "set")
        # Else not started yet (a stored desired document converged to at start): the
        # controller is made with it.
        self._in_force, self._policy = changed, policy
        # On a base (desired.power over the configured section) these are all the changes;
        # else (power set) they add to those in force.
        self._overrides = dict(changes) if base is not None else {**self._overrides,
                                                                   **changes}
        return policy

    def _controller_set_policy(self, policy: PowerPolicy) -> None:
        controller = self._on_thread()
        if (policy.profile != self._policy.profile
                and controller.status().get("state") == PowerState.SLEEPING.value):
            # A new profile places the board at once (max: the top point, stock: the board's
            # own settings), which a sleeping board reaches only through a wake: the
            # controller refuses sleeping -> active, after it has taken the policy.
            controller.wake("policy")
        controller.set_policy(policy)

    def reload(self, config: PowerConfig) -> None:
        """SIGHUP: the policy keys of a new ``[power]`` take effect (others need a restart),
        under the run-time changes in force (desired.power, power set), which stay unless
        they no longer fit the new section."""
        self.config = dataclasses.replace(self.config, **{name: getattr(config, name)
                                                         for name in POLICY_KEYS})
        reloaded = self.config
        if self._overrides:
            try:
                reloaded = with_changes(self.config, self._overrides)
            except ConfigError as exc:
                log.warning("the run-time power policy changes (%s) do not fit the reloaded "
                            "[power] and are dropped: %s", ", ".join(sorted(self._overrides)),
                            exc)
                self._overrides = {}
        policy = policy_from_config(reloaded)
        if not (self._running and self._loop is not None):
            self._in_force, self._policy = reloaded, policy
            return

        async def apply() -> None:
            try:
                await self._call(lambda: self._controller_set_policy(policy), "reload")
                self._in_force, self._policy = reloaded, policy
            except AgentError as exc:
                log.error("the reloaded power policy was not applied: %s", exc)

        task = self._loop.create_task(apply(), name="power-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    # -- what it reports ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The governor's state, the point in force, the policy and the latest telemetry."""
        telemetry = self._telemetry
        return {
            "running": self._running,
            "state": self._status.get("state"),
            "controller": self._status,
            "policy": policy_to_json(self._policy),
            "decisions": self._decisions,
            "wakes": self._wakes,
            "last_wake_s": self._last_wake_s,
            "restored_at_start": self._restored_at_start,
            "telemetry_period_s": self.config.telemetry_period_s,
            "telemetry": None if telemetry is None else telemetry_to_json(telemetry),
            "engine": self._engine_status(),
        }

    def _engine_status(self) -> dict[str, Any]:
        """``release_engine_in_sleep`` as it went: how many models' engines are released now,
        the releases and restores so far, the longest last restore (seconds)."""
        batchers = [batcher for batcher in self._batchers()
                    if hasattr(batcher, "engine_state")]
        restores = [batcher.last_restore_s for batcher in batchers
                    if batcher.last_restore_s is not None]
        return {"released": sum(1 for batcher in batchers
                                if batcher.engine_state.value != "active"),
                "releases": sum(batcher.engine_releases for batcher in batchers),
                "restores": sum(batcher.engine_restores for batcher in batchers),
                "last_restore_s": max(restores) if restores else None}

    def reported(self) -> dict[str, Any]:
        """``reported.power``: whether the governor runs, its state, the point in force, power
        and the hottest temperature (no state, point or readings once it has stopped: the
        board is back on its own settings)."""
        running = self._running
        telemetry = self._telemetry if running else None
        temps = [zone.temp_c for zone in (telemetry.thermal if telemetry else ())
                 if zone.temp_c is not None]
        return {
            "running": running,
            "state": self._status.get("state") if running else None,
            "profile": self._policy.profile,
            "point": self._status.get("point") if running else None,
            "power_mw": telemetry.total_power_mw if telemetry else None,
            "temperature_c": max(temps) if temps else None,
        }

    def metrics_view(self) -> dict[str, Any]:
        # Once the governor has stopped (failed, or the daemon stopping) its last state and
        # reading are no longer the board's: the counters stay, the gauges go.
        running = self._running
        return {"state": self._status.get("state") if running else None,
                "states": [state.value for state in PowerState],
                "decisions": self._decisions, "wakes": self._wakes,
                "wake_timeouts": sum(getattr(batcher, "wake_timeouts", 0)
                                     for batcher in self._batchers()),
                "telemetry": self._telemetry if running else None}


def telemetry_to_json(telemetry: Telemetry) -> dict[str, Any]:
    """One reading as JSON (``power status``, ``power trace``)."""
    result = dataclasses.asdict(telemetry)
    result["thermal"] = [{"name": zone.name, "temp_c": zone.temp_c}
                         for zone in telemetry.thermal]
    result["cpu_freq_khz"] = list(telemetry.cpu_freq_khz)
    return result


def attach_power(daemon: Daemon, parts: PowerParts | None = None) -> PowerService:
    """Give ``daemon`` its power governor: the ``power`` task, the ``power.*`` control commands
    and the metrics (call before the start, when ``[power] enabled``)."""
    config = daemon.config
    service = PowerService(
        config.power, config.state_dir, parts=parts,
        batchers=lambda: [model.batcher for model in daemon.services.values()],
        observers=lambda: [model.observers for model in daemon.services.values()])

    async def status_command(args: dict[str, Any], emit: Any) -> dict[str, Any]:
        return service.status()

    async def set_command(args: dict[str, Any], emit: Any) -> dict[str, Any]:
        changes = args.get("changes", {})
        if not isinstance(changes, dict):
            raise PowerError("power.set's changes must be an object of policy keys",
                             found=type(changes).__name__)
        await service.set_policy(changes)
        return service.status()

    async def wake_command(args: dict[str, Any], emit: Any) -> dict[str, Any]:
        seconds = await service.wake("command")
        return {"wake_s": seconds, **service.status()}

    daemon.control.register(POWER_STATUS, status_command)
    daemon.control.register(POWER_SET, set_command)
    daemon.control.register(POWER_WAKE, wake_command)
    daemon.add_task("power", service.run)
    return service
