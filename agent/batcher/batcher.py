"""The :class:`Batcher`: queues, batch forming and dispatch over a model's instances (the rules
are in agent/batcher/__init__.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.backends.base import Backend
from agent.batcher.policy import (
    MAX_TIMEOUT_US,
    BatchPolicy,
    DeadlineExceeded,
    EngineUnavailable,
    InferenceResult,
    LoadSnapshot,
    NotServing,
    QueueFull,
)
from agent.batcher.work import Instance, Ran, Request, run_and_split, stage
from agent.errors import AgentError, ConfigError, InputError, InternalError
from agent.observers import BatchDone, RequestDone, ServingObserver
from agent.scattered import DeferredArray

log = logging.getLogger(__name__)

CANDIDATE_SCAN = 1024  # queued requests looked at to form the next batches

WakeHook = Callable[[], Awaitable[None]]
"""Called before the first dispatch after :meth:`Batcher.arm_wake` (the power governor's wake:
the board boosts its clocks before the request runs)."""


class EngineState(enum.Enum):
    """Whether the instances hold their engines (their model's memory). The power governor's
    sleep may release them (``release_engine_in_sleep``); the next request restores them.

    Transitions: ACTIVE -> RELEASING (:meth:`Batcher.release_engine`) -> RELEASED;
    RELEASED -> RESTORING (:meth:`Batcher.restore_engine`, or a request to dispatch) -> ACTIVE;
    a restore asked for while RELEASING runs right after the release. Batches are dispatched
    in ACTIVE only: a request that comes meanwhile waits (its deadline still counts)."""

    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    RESTORING = "restoring"


@dataclass(frozen=True)
class Tapped:
    """A batch that ran, as the tap sees it (:meth:`Batcher.set_tap`): each answered request's
    inputs (arrays, or shared-memory views that may change once answered) and outputs."""

    version: int
    requests: list[tuple[Mapping[str, np.ndarray | DeferredArray], dict[str, np.ndarray]]]
    compute_s: float
    samples: int
    # CPU seconds the version's run threads have spent releasing and restoring its engines so
    # far (Batcher.engine_cpu_s): not its serving cost, which the canary reads off those threads
    engine_cpu_s: float = 0.0
    # The first batch its instance ran since its engine was restored: slower than the steady
    # ones (the session allocates on its first run, and no warm-up follows a restore); its run
    # thread's CPU time for it is in engine_cpu_s, and the canary leaves it out of the cost
    after_restore: bool = False


@dataclass
class _Counters:
    arrivals: int = 0
    completed: int = 0
    batches: int = 0
    compute_ewma_s: float = 0.0


class Batcher:
    """Batches requests for one model over its backend instances (all active already)."""

    def __init__(self, instances: Sequence[Backend], policy: BatchPolicy, *,
                 observer: ServingObserver | None = None, buffer_sets: int = 2) -> None:
        if not instances:
            raise ConfigError("at least one backend instance is needed", key="serving.instances")
        self.policy = policy
        self._observer = observer
        self._buffer_sets = buffer_sets
        self._instances = [self._wrap(backend) for backend in instances]
        self._queues: list[collections.deque[Request]] = [
            collections.deque() for _ in range(policy.priority_levels)
        ]
        self._queued = 0
        self._sequence = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()
        self._accepting = False
        self._closed = False  # stop() ends the scheduler
        self._counters = _Counters()
        self._last_arrival: float | None = None
        self._arrival_interval_s: float | None = None  # exponentially weighted mean
        self._last_gap_s: float | None = None
        self._found_alone = 0.0  # EWMA of arrivals that found the batcher empty
        self._max_batch_size = min(policy.max_batch_size,
                                   *(backend.max_batch_size for backend in instances))
        self._tap: Callable[[Tapped], None] | None = None
        self._wake_hook: WakeHook | None = None
        self._wake_timeout_s = 1.0
        self._wake_armed = False  # the next dispatch waits for the hook first
        self._waking: asyncio.Task[None] | None = None
        self.wakes = 0  # hooks called
        self.wake_timeouts = 0  # hooks that did not finish within the bound
        self._engine = EngineState.ACTIVE
        self._engine_task: asyncio.Task[None] | None = None
        self._restore_after_release = False
        self._release_after_restore = False
        self._engine_tried: set[int] = set()  # instances (by index) the release or restore took
        self.engine_releases = 0  # releases done
        self.engine_restores = 0  # restores done
        self.last_restore_s: float | None = None  # how long the last restore took
        # The last time dispatch was held for a wake or a restore with requests queued: a
        # request that arrived by then and is dispatched later waited for it, until dispatch
        # resumed (its latency from then on is judged apart: RequestDone.awake_s)
        self._held_at = -math.inf
        self._resumed_at = -math.inf

    def _wrap(self, backend: Backend) -> Instance:
        index = next(_instance_numbers)
        threads: set[int] = set()

        def remember() -> None:
            threads.add(threading.get_native_id())

        return Instance(
            backend, index, backend.artifacts.version,
            ThreadPoolExecutor(1, thread_name_prefix=f"stage-{index}", initializer=remember),
            ThreadPoolExecutor(1, thread_name_prefix=f"run-{index}", initializer=remember),
            thread_ids=threads,
        )

    def thread_ids(self, version: int) -> set[int]:
        """The worker threads (staging, running) of the instances serving ``version``: where
        its batches' CPU time is spent, with the backend's own threads (the canary's cost)."""
        return {tid for instance in self._instances if instance.version == version
                for tid in instance.thread_ids}

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def backends(self) -> list[Backend]:
        return [instance.backend for instance in self._instances]

    @property
    def version(self) -> int:
        """The model version new batches go to (the newest instances')."""
        return self._instances[0].version

    def start(self) -> None:
        """Start scheduling (call from the event loop)."""
        self._wakeup = asyncio.Event()
        self._accepting = True
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name="batcher")

    async def stop(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Stop accepting requests; with ``drain`` finish every queued and running request
        first (queued ones still waiting after ``timeout_s`` get NotServing), else fail the
        queued ones with NotServing at once. A batch that is running always finishes. Worker
        threads are shut down; the backends stay active (their owner deactivates them)."""
        self._accepting = False
        if not drain:
            self._fail_queued(NotServing("server is shutting down"))
        self._poke()
        deadline = time.monotonic() + timeout_s
        while (self._queued or self._batches) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            self._poke()
        self._fail_queued(NotServing("server shut down before the request ran"))
        if self._task is not None:
            # The scheduler ends at its next turn by itself: a cancellation alone can be lost
            # before Python 3.12, whose wait_for may return the result of a wait that completed
            # in the same turn instead of raising, and the scheduler would then run on forever.
            self._closed = True
            self._poke()
            await asyncio.wait({self._task}, timeout=1.0)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # A batch still running past the timeout runs to its end (its backend is freed only
        # after this returns), waited for off the loop: signals and requests (refused now) are
        # still handled meanwhile.
        await asyncio.get_running_loop().run_in_executor(None, _shut_down, self._instances)

    async def replace_backends(self, backends: Sequence[Backend], *,
                               policy: BatchPolicy | None = None,
                               drain_timeout_s: float | None = None) -> list[Backend]:
        """Swap in new (active) backend instances, and with them ``policy`` (a new version's
        batch limits and preferred sizes); new batches go to them at once and the old
        instances finish their in-flight batches. Returns the old backends once drained (or
        once ``drain_timeout_s`` passed: their batches still running are left to finish on
        their own threads), for the caller to deactivate: the blue-green swap."""
        if not backends:
            raise ConfigError("at least one backend instance is needed", key="serving.instances")
        old = self._instances
        for instance in old:
            instance.retired = True
        if policy is not None:
            if policy.priority_levels != self.policy.priority_levels:
                raise ConfigError("a swap cannot change the number of priority levels",
                                  key="serving.priority_levels")
            self.policy = policy
        self._instances = [self._wrap(backend) for backend in backends]
        if self._engine is EngineState.RELEASED:
            self._engine = EngineState.ACTIVE  # the new instances hold their engines
        self._max_batch_size = min(self.policy.max_batch_size,
                                   *(backend.max_batch_size for backend in backends))
        self._fail_oversized()
        self._poke()
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while any(instance.outstanding for instance in old):
            if deadline is not None and time.monotonic() > deadline:
                log.warning("old instances still ran %d batch(es) after %.1f s of draining",
                            sum(instance.outstanding for instance in old), drain_timeout_s)
                break
            await asyncio.sleep(0.002)
        # Off the loop: past the drain bound, this waits for the batches still running.
        await asyncio.get_running_loop().run_in_executor(None, _shut_down, old)
        return [instance.backend for instance in old]

    def add_backends(self, backends: Sequence[Backend]) -> None:
        """Serve with ``backends`` (active, warmed up, of the version serving) too: more
        instances (the autoscaler's). Call on the event loop. Joining while the engines are
        released (the board went to sleep while they were made), they are released too: the
        next request restores them with the others."""
        for backend in backends:
            if backend.artifacts.version != self.version:
                raise InternalError(f"an instance of v{backend.artifacts.version} cannot join "
                                    f"the instances of v{self.version}")
        self._instances = [*self._instances, *(self._wrap(backend) for backend in backends)]
        self._max_batch_size = min(self.policy.max_batch_size,
                                   *(instance.backend.max_batch_size
                                     for instance in self._instances))
        # RELEASING takes them with the others (it goes over the instances serving as it
        # goes), RESTORING leaves them be (they are active already).
        if self._engine is EngineState.RELEASED and not self._closed:
            self._engine = EngineState.RELEASING
            self._restore_after_release = False
            self._engine_tried = set()
            self._engine_task = asyncio.get_running_loop().create_task(
                self._release(), name="release-engine")
        self._poke()

    async def remove_backends(self, count: int, *,
                              drain_timeout_s: float | None = None) -> list[Backend]:
        """Stop sending batches to the last ``count`` instances (at least one stays) and return
        their backends once drained, for the caller to free."""
        count = min(count, len(self._instances) - 1)
        if count <= 0:
            return []
        leaving = self._instances[-count:]
        for instance in leaving:
            instance.retired = True
        self._instances = self._instances[:-count]
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while any(instance.outstanding for instance in leaving):
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(0.002)
        await asyncio.get_running_loop().run_in_executor(None, _shut_down, leaving)
        return [instance.backend for instance in leaving]

    def set_tap(self, tap: Callable[[Tapped], None] | None) -> None:
        """Hand every batch that ran to ``tap`` (the canary's shadow, the watch window), on
        the event loop; None removes it. ``tap`` must only queue the work: it delays answers."""
        self._tap = tap

    def set_wake_hook(self, hook: WakeHook | None, *, timeout_s: float = 1.0) -> None:
        """Call ``await hook()`` before dispatching the first request after :meth:`arm_wake`
        (the power service's: it wakes a sleeping board); None removes it. Requests wait for
        the hook at most ``timeout_s``: one that hangs or fails is logged and dispatching goes
        on without it. Without a hook, or while not armed, dispatch costs one flag test."""
        self._wake_hook = hook
        self._wake_timeout_s = timeout_s
        if hook is None:
            self._wake_armed = False

    def arm_wake(self) -> None:
        """The board went idle or to sleep: the next dispatch calls the wake hook first (call
        on the event loop; from another thread through ``loop.call_soon_threadsafe``)."""
        if self._wake_hook is not None:
            self._wake_armed = True

    def disarm_wake(self) -> None:
        """The board is awake again by other means (a command, the governor): no wake needed."""
        self._wake_armed = False

    @property
    def wake_armed(self) -> bool:
        return self._wake_armed

    def _start_wake(self) -> None:
        if self._waking is not None:
            return
        hook = self._wake_hook
        if hook is None:
            self._wake_armed = False
            return
        self.wakes += 1
        self._waking = asyncio.get_running_loop().create_task(self._wake(hook), name="wake")

    async def _wake(self, hook: WakeHook) -> None:
        try:
            # Bounded with wait(), not wait_for(): a hook that swallows its cancellation must
            # not hold the requests either. It is left to finish (or not) by itself.
            hook_task = asyncio.ensure_future(hook())
            done, _ = await asyncio.wait({hook_task}, timeout=self._wake_timeout_s)
            if not done:
                self.wake_timeouts += 1
                log.warning("the wake hook did not finish within %.2f s: dispatching anyway",
                            self._wake_timeout_s)
                hook_task.cancel()
            elif not hook_task.cancelled() and hook_task.exception() is not None:
                log.error("the wake hook failed: dispatching anyway",
                          exc_info=hook_task.exception())
        finally:
            self._wake_armed = False
            self._waking = None
            self._poke()

    # -- releasing the engines while the board sleeps ------------------------------------

    @property
    def engine_state(self) -> EngineState:
        return self._engine

    def engine_cpu_s(self, version: int) -> float:
        """CPU seconds the run threads of ``version``'s instances spent releasing and restoring
        their engines: time on the threads :meth:`thread_ids` names that served nothing."""
        return sum(instance.engine_cpu_s for instance in self._instances
                   if instance.version == version)

    def release_engine(self) -> None:
        """Free every instance's engine (``Backend.deactivate``) once its batches in flight are
        done; nothing is dispatched until :meth:`restore_engine` (or the next request) brings
        them back. Call on the event loop. While RESTORING, right after (unless requests are
        waiting); while RELEASING, a restore asked for meanwhile is dropped: of quick sleeps
        and wakes, the last one wins."""
        if self._closed:
            return
        if self._engine is EngineState.RELEASING:
            self._restore_after_release = False
            return
        if self._engine is EngineState.RESTORING:
            self._release_after_restore = True
            return
        if self._engine is not EngineState.ACTIVE:
            return
        self._engine = EngineState.RELEASING
        self._restore_after_release = False
        self._engine_tried = set()
        self._engine_task = asyncio.get_running_loop().create_task(self._release(),
                                                                   name="release-engine")

    def restore_engine(self) -> None:
        """Re-create every instance's engine (``Backend.activate``), then dispatch again. Call
        on the event loop. No-op while ACTIVE or RESTORING (where it drops a release asked for
        meanwhile); while RELEASING, right after."""
        if self._closed:
            return
        if self._engine is EngineState.RESTORING:
            self._release_after_restore = False
        elif self._engine is EngineState.RELEASING:
            self._restore_after_release = True
        elif self._engine is EngineState.RELEASED:
            self._engine = EngineState.RESTORING
            self._release_after_restore = False
            self._engine_tried = set()
            self._engine_task = asyncio.get_running_loop().create_task(self._restore(),
                                                                       name="restore-engine")

    async def _release(self) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        released = 0
        try:
            # Over the instances serving as it goes, never over a list taken at the start: an
            # autoscaler's removal or a swap may take instances away meanwhile (their owner
            # frees them and their threads are shut down); a swap's new ones are released too.
            while (instance := await self._next_instance(active=True)) is not None:
                # On the instance's run thread: where its engine runs (a CUDA context's thread).
                await loop.run_in_executor(instance.run_pool, _engine_call, instance,
                                           instance.backend.deactivate)
                released += 1
        except Exception as exc:  # a failed release leaves the engines as they are
            log.error("releasing the engines failed: %s", exc, exc_info=exc)
        self._engine = EngineState.RELEASED
        self.engine_releases += 1
        log.info("released the engines of %d instance(s) in %.3f s", released,
                 time.monotonic() - started)
        if self._restore_after_release or self._queued:
            self._restore_after_release = False
            self.restore_engine()
        self._poke()

    async def _next_instance(self, *, active: bool) -> Instance | None:
        """The next instance serving whose engine is (``active``) or is not held, once no
        instance has a batch in flight; None when there is none, or once the batcher stopped
        (its threads are shut down). Each instance is handed out once per release or restore
        (one whose deactivate or activate did not take is not tried again)."""
        tried = self._engine_tried
        while not self._closed:
            if active and any(instance.outstanding for instance in self._instances):
                await asyncio.sleep(0.002)  # a release waits for the batches in flight
                continue
            instance = next((i for i in self._instances
                             if i.backend.active is active and i.index not in tried), None)
            if instance is not None:
                tried.add(instance.index)
            return instance
        return None

    async def _restore(self) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            # Over the instances serving as it goes (see _release): one that left meanwhile is
            # its owner's to free, and its stopped threads are never asked to activate it.
            while (instance := await self._next_instance(active=False)) is not None:
                await loop.run_in_executor(instance.run_pool, _engine_call, instance,
                                           instance.backend.activate)
                instance.restored = True
        except Exception as exc:  # the waiting requests get the error
            self._engine = EngineState.RELEASED  # the next request tries again
            log.error("restoring the engines failed: %s", exc, exc_info=exc)
            # Not the cause itself: a ModelError is an InputError, which the API answers with
            # 400, as if the request were bad.
            cause = exc.message if isinstance(exc, AgentError) else f"{type(exc).__name__}: {exc}"
            self._fail_queued(EngineUnavailable(
                f"the engine could not be restored after sleep: {cause}",
                **(exc.fields if isinstance(exc, AgentError) else {})))
        else:
            if not self._closed:
                self._engine = EngineState.ACTIVE
                self.engine_restores += 1
                self.last_restore_s = time.monotonic() - started
                log.info("restored the engines of %d instance(s) in %.3f s",
                         len(self._instances), self.last_restore_s)
        finally:
            self._engine_task = None
            self._poke()
        if self._release_after_restore:  # the board went back to sleep meanwhile
            self._release_after_restore = False
            if not self._queued:
                self.release_engine()

    # -- submission ---------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray | DeferredArray], *,
               priority: int | None = None,
               timeout_us: int | None = None) -> asyncio.Future[InferenceResult]:
        """Queue one request (arrays with the batch axis first, already of the model's dtypes;
        a :class:`~agent.scattered.DeferredArray` is copied straight into the batch).

        Raises:
            NotServing: the batcher is not running.
            QueueFull: ``max_queue_size`` requests are already waiting.
            InputError: bad priority, or more samples than the maximum batch.
        """
        if not self._accepting:
            raise NotServing("server is not accepting requests")
        policy = self.policy
        level = int(priority or 0)
        if level < 0:
            raise InputError("priority must be >= 0", found=priority)
        if level == 0 or level > policy.priority_levels:  # as Triton: the default level
            level = policy.default_priority_level
        sizes = {int(array.shape[0]) for array in inputs.values()}
        if len(sizes) != 1:
            raise InputError("inputs disagree on the batch size", found=sorted(sizes))
        batch_size = sizes.pop()
        if not 1 <= batch_size <= self.max_batch_size:
            raise InputError("request batch size out of range", found=batch_size,
                             maximum=self.max_batch_size)
        if policy.max_queue_size and self._queued >= policy.max_queue_size:
            raise QueueFull("request queue is full", limit=policy.max_queue_size)
        now = time.monotonic()
        timeout = int(timeout_us or policy.default_timeout_us)
        if not 0 <= timeout <= MAX_TIMEOUT_US:
            raise InputError(f"timeout must be from 0 to {MAX_TIMEOUT_US} microseconds",
                             found=timeout_us)
        if policy.default_timeout_us:  # as Triton's allow_timeout_override: only shorter
            timeout = min(timeout, policy.default_timeout_us)
        future: asyncio.Future[InferenceResult] = asyncio.get_running_loop().create_future()
        request = Request(
            inputs=inputs, batch_size=batch_size,
            shape_key=tuple(sorted((name, tuple(array.shape[1:])) for name, array in inputs.items())),
            priority=level, arrival=now, deadline=now + timeout / 1e6 if timeout else None,
            future=future, sequence=next(self._sequence),
        )
        # Did it find nothing else waiting or running? Almost always so means one client that
        # sends its next request when the last is answered: no company will come while it waits.
        alone = self._queued == 0 and not any(i.outstanding for i in self._instances)
        self._found_alone = 0.7 * self._found_alone + 0.3 * alone  # ~6 arrivals to settle
        future.add_done_callback(self._on_future_done)
        self._queues[level - 1].append(request)
        self._queued += 1
        self._counters.arrivals += 1
        if self._last_arrival is not None:
            gap = now - self._last_arrival
            self._last_gap_s = gap
            self._arrival_interval_s = (gap if self._arrival_interval_s is None
                                        else 0.9 * self._arrival_interval_s + 0.1 * gap)
        self._last_arrival = now
        self._report_depth()
        self._poke()
        return future

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(
            queue_depth=self._queued,
            busy_instances=sum(1 for instance in self._instances if instance.running > 0),
            instances=len(self._instances),
            arrivals_total=self._counters.arrivals,
            completed_total=self._counters.completed,
            batches_total=self._counters.batches,
            mean_batch_compute_s=self._counters.compute_ewma_s,
        )

    @property
    def queue_depth(self) -> int:
        return self._queued

    # -- scheduling ---------------------------------------------------------------------

    def _poke(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _on_future_done(self, future: asyncio.Future[InferenceResult]) -> None:
        if future.cancelled():  # the client went away: free its place in the queue now
            self._poke()

    async def _schedule(self) -> None:
        assert self._wakeup is not None  # start() sets it; not input validation
        while not self._closed:
            self._wakeup.clear()
            wait_s = self._dispatch_ready()
            if wait_s is None:
                await self._wakeup.wait()
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout=max(wait_s, 0.0))

    def _dispatch_ready(self) -> float | None:
        """Send every batch that may go now; return how long until something may change by
        itself (a delay or deadline expiring), or None to wait for an event."""
        while True:
            now = time.monotonic()
            self._expire(now)
            if not self._queued:
                return None
            if self._engine is not EngineState.ACTIVE:
                # Released in sleep: bring the engines back (beside the wake hook's boost);
                # the restore's end pokes the scheduler.
                self._held_at = now
                self.restore_engine()
                if self._wake_armed:
                    self._start_wake()
                return self._until_next_deadline(None, now)
            if self._wake_armed:
                self._held_at = now
                self._start_wake()  # its end pokes the scheduler
                return self._until_next_deadline(None, now)
            if self._held_at > self._resumed_at:  # the first dispatch since the hold
                self._resumed_at = now
            candidates = self._candidates()
            batch, total = candidates[0]
            full = total >= self.max_batch_size
            idle = next((i for i in self._instances if not i.retired and i.outstanding == 0), None)
            if idle is not None:
                due = self._due(batch)
                if full or now >= due or not self._accepting:
                    self._launch(idle, batch)
                elif preferred := self._preferred_prefix(batch):
                    self._launch(idle, preferred)
                elif self._waiting_is_futile(batch, now, due):
                    self._launch(idle, batch)
                elif other := next((group for group, size in candidates[1:]
                                    if size >= self.max_batch_size or now >= self._due(group)),
                                   None):
                    # The first batch waits for company; one of other frames is ready, as in
                    # Triton (a request of another shape sends the pending batch).
                    self._launch(idle, other)
                else:
                    wait_s = min(self._due(group) for group, _ in candidates) - now
                    return self._until_next_deadline(wait_s, now)
                continue
            spare = next((i for i in self._instances
                          if not i.retired and i.outstanding < self._buffer_sets), None)
            ready = next((group for group, size in candidates if size >= self.max_batch_size),
                         None)
            if spare is not None and ready is not None:
                self._launch(spare, ready)
                continue
            return self._until_next_deadline(None, now)

    def _due(self, batch: list[Request]) -> float:
        """When ``batch``'s oldest request has waited ``max_queue_delay_us``."""
        return min(request.arrival for request in batch) + self.policy.max_queue_delay_us / 1e6

    def _waiting_is_futile(self, batch: list[Request], now: float, due: float) -> bool:
        """Whether waiting until ``due`` for company would only add latency (adaptive_delay: no
        company expected, or a lone client) or time a request out on an idle instance."""
        if self.policy.adaptive_delay and (self._expected_arrivals(due - now) < 1.0
                                           or self._found_alone >= 0.85):
            return True
        deadlines = [request.deadline for request in batch if request.deadline is not None]
        return bool(deadlines) and min(deadlines) - self._counters.compute_ewma_s <= due

    def _expected_arrivals(self, window_s: float) -> float:
        """Requests expected within ``window_s``: at the recent mean arrival interval, or at the
        last gap when that is shorter (a burst has begun and more of it is on the way)."""
        if self._arrival_interval_s is None or self._last_gap_s is None:
            return 0.0
        interval = min(self._arrival_interval_s, self._last_gap_s)
        return window_s / max(interval, 1e-9)

    def _until_next_deadline(self, wait_s: float | None, now: float) -> float | None:
        deadlines = [request.deadline for queue in self._queues for request in queue
                     if request.deadline is not None]
        if deadlines:
            until = min(deadlines) - now
            wait_s = until if wait_s is None else min(wait_s, until)
        return wait_s

    def _candidates(self) -> list[tuple[list[Request], int]]:
        """The next batch for each frame shape waiting, with its sample count, in the order of
        each shape's first request by priority and arrival: that request, then every request of
        its shape in the same order that still fits."""
        groups: dict[Any, tuple[list[Request], int]] = {}
        requests = (request for queue in self._queues for request in queue)
        # Bounded: at a deep queue, shapes first seen further back wait for the ones ahead.
        for request in itertools.islice(requests, CANDIDATE_SCAN):
            batch, total = groups.get(request.shape_key, ([], 0))
            if not batch or total + request.batch_size <= self.max_batch_size:
                batch.append(request)
                groups[request.shape_key] = (batch, total + request.batch_size)
        return list(groups.values())

    def _preferred_prefix(self, batch: list[Request]) -> list[Request] | None:
        """The longest leading run of ``batch`` (in priority and arrival order) whose samples
        add up to exactly a preferred size, or None: a batch goes early only at a preferred
        size, as in Triton; anything else waits for company or the delay."""
        preferred = set(self.policy.preferred_batch_sizes)
        found, total = None, 0
        for index, request in enumerate(batch):
            total += request.batch_size
            if total in preferred:
                found = index + 1
        return batch[:found] if found else None

    def _expire(self, now: float) -> None:
        """Answer queued requests whose deadline passed; drop those whose client gave up."""
        queued = self._queued
        for queue in self._queues:
            if not any(r.future.done() or (r.deadline is not None and r.deadline <= now)
                       for r in queue):
                continue
            kept: collections.deque[Request] = collections.deque()
            for request in queue:
                if request.future.done():  # cancelled: the HTTP client went away
                    self._queued -= 1
                    self._finish(request, "cancelled")
                elif request.deadline is not None and request.deadline <= now:
                    self._queued -= 1
                    self._finish(request, "timeout", error=DeadlineExceeded(
                        "request timed out in the queue",
                        waited_ms=round((now - request.arrival) * 1e3, 3)))
                else:
                    kept.append(request)
            queue.clear()
            queue.extend(kept)
        if self._queued != queued:
            self._report_depth()

    @staticmethod
    def _timed_out_while_staged(request: Request) -> None:
        """Answer a request whose deadline passed before its batch began to run, at once (its
        rows still run with the batch; it is counted when the batch finishes)."""
        if request.started or request.future.done():
            return
        request.future.set_exception(DeadlineExceeded(
            "request timed out before its batch ran",
            waited_ms=round((time.monotonic() - request.arrival) * 1e3, 3)))

    def _fail_oversized(self) -> None:
        """Answer queued requests with more samples than the (new) maximum batch."""
        for queue in self._queues:
            for request in [r for r in queue if r.batch_size > self.max_batch_size]:
                queue.remove(request)
                self._queued -= 1
                self._finish(request, "invalid", error=InputError(
                    "request batch size exceeds the maximum of the model now served",
                    found=request.batch_size, maximum=self.max_batch_size))
        self._report_depth()

    def _fail_queued(self, error: AgentError) -> None:
        for queue in self._queues:
            while queue:
                self._queued -= 1
                self._finish(queue.popleft(), "rejected", error=error)
        self._report_depth()

    def _launch(self, instance: Instance, batch: list[Request]) -> None:
        chosen = set(map(id, batch))
        for queue in self._queues:
            if any(id(request) in chosen for request in queue):
                remaining = [request for request in queue if id(request) not in chosen]
                queue.clear()
                queue.extend(remaining)
        self._queued -= len(batch)
        self._report_depth()
        instance.outstanding += 1
        loop = asyncio.get_running_loop()
        for request in batch:  # staged behind a running batch, a request may pass its deadline
            request.version = instance.version
            if request.arrival <= self._held_at:  # it waited for the wake or the restore
                request.after_wake = True
                request.resumed = self._resumed_at
            if request.deadline is not None:
                request.timer = loop.call_later(max(0.0, request.deadline - time.monotonic()),
                                                self._timed_out_while_staged, request)
        task = loop.create_task(self._execute(instance, batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _execute(self, instance: Instance, batch: list[Request]) -> None:
        loop = asyncio.get_running_loop()
        staged = None
        counted = False
        after_restore, instance.restored = instance.restored, False
        if after_restore:  # a restored session's first run is slower than its steady ones
            for request in batch:
                request.after_wake = True
        try:
            staged, failed, stage_s = await loop.run_in_executor(instance.stage_pool, stage,
                                                                 instance.backend, batch)
            instance.running += 1
            counted = True
            ran = await loop.run_in_executor(instance.run_pool,
                                             _first_run if after_restore else _run,
                                             instance, staged, batch)
        except Exception as exc:  # the batch's requests get the error, not the loop
            error = exc if isinstance(exc, AgentError) else AgentError(
                f"inference failed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, AgentError):
                log.error("batch of %d failed on instance %d", len(batch), instance.index,
                          exc_info=exc)
            for request in batch:
                self._finish(request, "failure", error=error)
            return
        finally:
            if staged is not None:
                staged.release()
            if counted:
                instance.running -= 1
            instance.outstanding -= 1
            self._poke()
        self._answer(instance, batch, failed, stage_s, ran, after_restore=after_restore)

    def _answer(self, instance: Instance, batch: list[Request], failed: dict[int, InputError],
                stage_s: float, ran: Ran, *, after_restore: bool = False) -> None:
        """Count a batch that ran and answer each of its requests."""
        samples = sum(request.batch_size for request in batch)
        counters = self._counters
        counters.batches += 1
        counters.compute_ewma_s = (ran.compute_s if counters.batches == 1
                                   else 0.8 * counters.compute_ewma_s + 0.2 * ran.compute_s)
        if self._observer is not None:
            self._observer.batch_done(BatchDone(instance.version, samples, ran.compute_s,
                                                  stage_s, ran.split_s))
        for index, (request, result) in enumerate(zip(batch, ran.outputs)):
            if index in failed:
                self._finish(request, "invalid", error=failed[index])
                continue
            if request.deadline is not None and request.deadline < ran.started:
                # Staged ahead, it waited for the running batch past its deadline: no late
                # success (its rows ran, the answer is dropped).
                self._finish(request, "timeout", error=DeadlineExceeded(
                    "request timed out before its batch ran",
                    waited_ms=round((ran.started - request.arrival) * 1e3, 3)))
                continue
            # Until its batch began to run, less the copy into the batch: that is
            # compute_input, as in Triton, whose phases never overlap.
            queue_s = max(0.0, ran.started - request.arrival - stage_s)
            self._finish(request, "success", result=InferenceResult(
                result, queue_s, ran.compute_s, samples, stage_s, ran.split_s,
                version=instance.version))
        if self._tap is not None:
            answered = [(request.inputs, result) for index, (request, result)
                        in enumerate(zip(batch, ran.outputs)) if index not in failed]
            try:
                self._tap(Tapped(instance.version, answered, ran.compute_s, samples,
                                 self.engine_cpu_s(instance.version), after_restore))
            except Exception:  # noqa: BLE001 - a faulty tap must not fail answered requests
                log.exception("the batch tap failed")

    def _finish(self, request: Request, outcome: str, *, result: InferenceResult | None = None,
                error: BaseException | None = None) -> None:
        if request.future.cancelled():  # its client went away while the batch ran
            outcome, result, error = "cancelled", None, None
        if request.timer is not None:
            request.timer.cancel()
        if (outcome != "cancelled" and request.future.done() and not request.future.cancelled()
                and isinstance(request.future.exception(), DeadlineExceeded)):
            # Answered as timed out while staged: counted as the client saw it.
            outcome, result, error = "timeout", None, None
        self._counters.completed += 1
        if not request.future.done():
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(result)  # type: ignore[arg-type]
        if self._observer is not None:
            total_s = time.monotonic() - request.arrival
            version = request.version if request.version is not None else self.version
            # A restored engine's first batch, never held: from its arrival (resumed 0.0)
            awake_s = (total_s - max(0.0, request.resumed - request.arrival)
                       if request.after_wake else 0.0)
            self._observer.request_done(
                RequestDone(outcome, version, total_s, total_s, after_wake=request.after_wake,
                            awake_s=awake_s)
                if result is None else
                RequestDone(outcome, version, total_s, result.queue_s, result.compute_input_s,
                            result.compute_s, result.compute_output_s,
                            after_wake=request.after_wake, awake_s=awake_s))

    def _report_depth(self) -> None:
        if self._observer is not None:
            self._observer.queue_depth(self._queued)


_instance_numbers = itertools.count()


def _engine_call(instance: Instance, call: Callable[[], None]) -> None:
    """A release's or a restore's ``call`` on ``instance``'s run thread, with the CPU time it
    took kept apart (``Instance.engine_cpu_s``)."""
    started = time.thread_time()
    try:
        call()
    finally:
        instance.engine_cpu_s += time.thread_time() - started


def _run(instance: Instance, staged: Any, batch: list[Request]) -> Ran:
    return run_and_split(instance.backend, staged, batch)


def _first_run(instance: Instance, staged: Any, batch: list[Request]) -> Ran:
    """The first batch of a restored engine, its CPU time kept apart with the restore's: on
    this VM's CPU (ONNX Runtime, the tests' tiny model, a restore before every batch) it cost
    the old version about 1.3 times a steady batch, and the canary read a version as that much
    cheaper than itself."""
    started = time.thread_time()
    try:
        return run_and_split(instance.backend, staged, batch)
    finally:
        instance.engine_cpu_s += time.thread_time() - started


def _shut_down(instances: Sequence[Instance]) -> None:
    """Let each instance's worker threads finish their work and end."""
    for instance in instances:
        instance.stage_pool.shutdown(wait=True)
        instance.run_pool.shutdown(wait=True)
