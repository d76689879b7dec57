"""The updater: drives one update at a time through the states of agent/update/states.py,
journalling every transition (agent/update/journal.py) before the work of the new state starts.

It runs in the daemon's event loop and does no heavy work itself: each state's work is a step of
an :class:`UpdateSteps` object (download, verify, install into the store, engine build, warm-up,
canary, commit, watch, discard, revert), which does it elsewhere (a thread, a subprocess at low
priority) and is awaited under the state's deadline. So a step that hangs is cancelled at its
deadline and the update fails with reason ``deadline``; nothing waits forever.

The newest request wins: :meth:`Updater.request` cancels the update in progress (which then takes
its state's failure path, see the table in agent/update/states.py) and starts the new one; nothing
queues. A bundle that failed ``max_failures`` times from ``staged`` on is refused
(``attempts_exhausted``) until a newer version of it is requested: failures before ``staged`` (a
dropped link, a bad signature) are transport or verification failures that the bundle's content
did not cause, and the verifier refuses a bad bundle by itself every time.

Recovery at start (:meth:`Updater.recover`), by the state the journal was left in:

=================  ==============================================================================
journal state      what happens
=================  ==============================================================================
idle, failed       nothing
downloading,       the attempt ends ``interrupted`` (idle); with ``resume_on_restart`` the same
verifying          request starts again as its next attempt (the download may resume its partial
                   file); otherwise the download's leftovers are discarded
staged, building-  the candidate never served: ``rolling-back`` discards it, the update ends
engine, warming    ``failed`` with reason ``interrupted_by_restart`` and that counts against the
                   bundle's budget (a bundle that crashes the daemon must not be retried forever)
canary             as above, unless the store already serves the candidate: the commit happened
                   and the crash came before the journal said so; then ``committed`` and the
                   watch starts
committed          the committed version is kept and its watch window starts again, in full
                   (what it had watched died with the process); if the store does not serve it
                   (the daemon fell back because it failed verification), the update ends failed
rolling-back       the rollback is done again (its steps are idempotent) and the update ends as
                   the rollback was going to end it
=================  ==============================================================================

Every one of these is written in the journal's history with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agent.errors import AgentError, InternalError, UpdateError, first_line
from agent.update.journal import (
    BundleAttempts,
    BundleId,
    Event,
    Journal,
    JournalDoc,
    Outcome,
    UpdateRecord,
    utc_now,
)
from agent.update.states import (
    FORWARD,
    ON_CANCEL,
    ON_FAILURE,
    RESTING,
    UpdatePolicy,
    UpdateState,
    check_transition,
)

__all__ = [
    "RecoveryReport",
    "RequestAnswer",
    "UpdateJob",
    "UpdateRequest",
    "UpdateSteps",
    "Updater",
    "Verdict",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Listener = Callable[[dict[str, Any]], None]
HISTORY_TAIL = 10  # history entries status() shows

_SHA256 = re.compile(r"[0-9a-f]{64}")
# The states from staged on: the candidate is on the device and its content was tried.
_CANDIDATE_STATES = frozenset(FORWARD[FORWARD.index(UpdateState.STAGED):])


@dataclass(frozen=True, kw_only=True)
class UpdateRequest:
    """A wanted bundle. ``name``, ``version`` and ``sha256`` are what the requester knows of it
    (a fleet's desired document has all three; a path on the command line none): whatever is
    given must match what verification finds, and lets a refusal or a no-op be answered at once.

    Args:
        source: A bundle path, a ``file://`` or an ``http(s)://`` URL.
        request_id: The requester's id (an MQTT correlation id); a new one when None.
        allow_downgrade: The bundle may be older than the version serving: an authorised
            rollback (a signed fleet document says so). Otherwise the steps refuse it
            (anti-rollback).
    """

    source: str
    name: str | None = None
    version: int | None = None
    sha256: str | None = None
    request_id: str | None = None
    allow_downgrade: bool = False

    def __post_init__(self) -> None:
        problems: list[tuple[str, str, object]] = []
        if not isinstance(self.source, str) or not self.source:
            problems.append(("source", "a path or URL", self.source))
        if self.name is not None and not (isinstance(self.name, str) and self.name):
            problems.append(("name", "a model name", self.name))
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(
                self.version, int) or self.version < 1):
            problems.append(("version", "an integer >= 1", self.version))
        if self.sha256 is not None and (not isinstance(self.sha256, str)
                                        or _SHA256.fullmatch(self.sha256) is None):
            problems.append(("sha256", "64 lower-case hex digits", self.sha256))
        if not isinstance(self.allow_downgrade, bool):
            problems.append(("allow_downgrade", "true or false", self.allow_downgrade))
        if problems:
            key, expected, found = problems[0]
            raise UpdateError(f"invalid update request: bad {key}", reason="invalid_request",
                              key=key, expected=expected, found=repr(found))

    @property
    def expected(self) -> BundleId:
        return BundleId(name=self.name, version=self.version, sha256=self.sha256)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A canary's or a watch's judgement of the candidate's health.

    Args:
        healthy: Whether the candidate may go on (canary) or stay (watch).
        reason: When unhealthy, a short code (``error_rate``, ``latency``, ``nan_output``,
            ``disagreement``): the failure's reason in the journal and the metrics.
        detail: The facts, in words (``p99 41 ms against 18 ms``).
    """

    healthy: bool
    reason: str | None = None
    detail: str | None = None


@dataclass(frozen=True, kw_only=True)
class RequestAnswer:
    """What became of a request or a rollback.

    ``result``: ``started``; ``already_current`` (the bundle serves: nothing to do);
    ``in_progress`` (the same bundle is already being applied: a duplicate request);
    ``superseded`` (a newer request came before this one could start); ``rolling_back`` (an
    operator rollback is under way, or already was).
    """

    result: str
    update_id: str | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, "update_id": self.update_id, "detail": self.detail}


@dataclass(frozen=True, kw_only=True)
class RecoveryReport:
    """What :meth:`Updater.recover` found in the journal and did about it.

    ``action``: ``none``, ``resumed``, ``abandoned``, ``discarded``, ``commit_found``,
    ``watch_restarted``, ``not_serving`` or ``rollback_finished`` (see the module's table).
    """

    found: UpdateState
    action: str
    detail: str
    update_id: str | None = None
    journal_problem: str | None = None  # the journal was unusable: why (it was moved aside)
    moved_aside: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"found": self.found.value, "action": self.action, "detail": self.detail,
                "update_id": self.update_id, "journal_problem": self.journal_problem,
                "moved_aside": None if self.moved_aside is None else str(self.moved_aside)}


class UpdateJob:
    """One update as the steps see it. ``notes`` is the steps' own, to pass facts from one step
    to the next (the downloaded file's path); it is not journalled, so after a restart it is
    empty and a step finds what it needs from the bundle's identity."""

    def __init__(self, record: UpdateRecord, state: UpdateState,
                 on_progress: Callable[[UpdateJob, dict[str, Any]], None]) -> None:
        self.record = record
        self.state = state
        self.notes: dict[str, Any] = {}
        self._on_progress = on_progress

    @property
    def update_id(self) -> str:
        return self.record.update_id

    @property
    def source(self) -> str:
        return self.record.source

    @property
    def expected(self) -> BundleId:
        return self.record.expected

    @property
    def bundle(self) -> BundleId | None:
        """The verified bundle (None before verification); for an operator rollback, the
        version being reverted."""
        return self.record.bundle

    @property
    def attempt(self) -> int:
        return self.record.attempt

    @property
    def allow_downgrade(self) -> bool:
        """Whether the bundle may be older than the version serving (an authorised rollback);
        the verify step's anti-rollback check reads it."""
        return self.record.allow_downgrade

    def progress(self, **facts: Any) -> None:
        """Report progress (``received_bytes=..., total_bytes=...``, ``phase="tactics"``) to the
        updater's listeners; JSON-able values. Safe to call from any thread."""
        self._on_progress(self, facts)


class UpdateSteps(Protocol):
    """The work of each state, done off the event loop. Every step may be cancelled (a newer
    request, its deadline): it must then stop and leave nothing that serves half-made. A step
    fails by raising, best an :class:`~agent.errors.UpdateError` whose ``reason`` is the code
    the journal and the metrics record.

    ``discard`` and ``revert`` may be called again for the same update after a restart, so they
    must be idempotent; ``discard`` never removes the version that serves. A step must never
    block the event loop: a deadline cancels an await, it cannot interrupt synchronous code.
    """

    async def serving(self) -> BundleId | None:
        """The version that serves now (name, version, sha256), None when none does."""

    async def download(self, job: UpdateJob) -> None:
        """Fetch ``job.source`` into a staging place (resuming a partial file when it can)."""

    async def verify(self, job: UpdateJob) -> BundleId:
        """Verify the downloaded bundle (signature, hashes, target, agent version,
        anti-rollback) and say what it is: name, version and sha256, all three."""

    async def stage(self, job: UpdateJob) -> None:
        """Install the verified bundle into the store beside the current version (not current)."""

    async def build_engine(self, job: UpdateJob) -> None:
        """Build (or find in the cache) the candidate's engine, at low priority."""

    async def warm(self, job: UpdateJob) -> None:
        """Load the candidate's instances and run warm-up requests, off the serving path."""

    async def canary(self, job: UpdateJob) -> Verdict:
        """Shadow or answer a share of live traffic and judge the candidate against the old."""

    async def commit(self, job: UpdateJob) -> None:
        """Make the candidate current (the store's pointer switch) and let the old instances
        drain; after this returns, the candidate serves."""

    async def watch(self, job: UpdateJob) -> Verdict:
        """Watch the committed version's health; return an unhealthy verdict on a regression,
        or a healthy one to end the watch early. The updater cancels it at the end of the watch
        window, which is the watch passing."""

    async def discard(self, job: UpdateJob) -> None:
        """Remove what the update made that does not serve: the partial download, the staged
        candidate and its instances. Idempotent; never the version that serves."""

    async def revert(self, job: UpdateJob) -> None:
        """Make the version before ``job.bundle`` current again (the store's rollback), swap
        serving back to it and let ``job.bundle``'s instances drain. Idempotent."""

    async def previous(self) -> BundleId | None:
        """The version a revert of the one serving returns to (name and version), None when
        there is none. Raises when it cannot tell (the revert then says why)."""


class _Stop(Exception):
    """Ends the forward path of an update: ``kind`` is ``failure``, ``cancel`` (a newer
    request or an operator rollback) or ``noop`` (the bundle already serves)."""

    def __init__(self, kind: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.reason = reason
        self.detail = detail


@dataclass(eq=False)
class _Run:
    job: UpdateJob
    interrupt: asyncio.Event = field(default_factory=asyncio.Event)
    interrupt_reason: str = "superseded"
    interrupt_detail: str = ""
    task: asyncio.Task[None] | None = None
    ended: bool = False  # its outcome is set: only the journal write of it is left


@dataclass
class _Counters:
    """Plain counters for the metrics (the daemon exports them to Prometheus)."""

    attempts: int = 0  # update runs started, resumed ones included
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    canary_verdicts: dict[str, int] = field(default_factory=lambda: {"healthy": 0, "unhealthy": 0})
    watch_verdicts: dict[str, int] = field(default_factory=lambda: {"healthy": 0, "unhealthy": 0})
    swaps: int = 0
    swap_seconds_total: float = 0.0
    last_swap_s: float | None = None
    rollbacks: int = 0  # reverts to a previous version, automatic or by an operator

    def to_json(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "failures_by_reason": dict(self.failures_by_reason),
                "canary_verdicts": dict(self.canary_verdicts),
                "watch_verdicts": dict(self.watch_verdicts), "swaps": self.swaps,
                "swap_seconds_total": round(self.swap_seconds_total, 6),
                "last_swap_s": self.last_swap_s, "rollbacks": self.rollbacks}


class Updater:
    """Applies updates one at a time, newest request first, journalled in ``state_dir``.

    Cheap to construct; :meth:`recover` reads the journal and must be awaited once, in the
    event loop that then runs the updater, before anything else.

    Args:
        state_dir: Where the journal lives (the store's state directory).
        steps: The work of each state.
        policy: Deadlines and the attempts budget.
    """

    def __init__(self, *, state_dir: Path, steps: UpdateSteps,
                 policy: UpdatePolicy | None = None) -> None:
        self.policy = policy or UpdatePolicy()
        self.steps = steps
        self.journal = Journal(state_dir, history_limit=self.policy.history_limit)
        self.counters = _Counters()
        self._doc = JournalDoc()
        self._since = time.monotonic()  # when the current state was entered, for its deadline
        self._progress: dict[str, Any] | None = None
        self._listeners: list[Listener] = []
        self._run: _Run | None = None
        self._recovery: RecoveryReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._lock: asyncio.Lock | None = None
        self._write_lock: asyncio.Lock | None = None
        self._sequence = 0  # of requests and rollbacks, so that only the newest one starts

    # -- the public API ---------------------------------------------------------------------

    @property
    def state(self) -> UpdateState:
        return self._doc.state

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` on the event loop for every state change (``{"event":
        "state", ...}``), progress report (``"progress"``) and outcome (``"outcome"``). A
        listener must not block; one that raises is logged and skipped."""
        self._listeners.append(listener)

    async def until_recovered(self, *, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until :meth:`recover` has settled the last run, so that
        a command arriving as the daemon starts waits instead of being refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._lock is None or self._recovery is None) and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def running_update_id(self) -> str | None:
        """The id of the update (or rollback) running now, None when none does."""
        run = self._run
        if run is None or run.task is None or run.task.done():
            return None
        return run.job.update_id

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener`` (one not added is ignored)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def recover(self) -> RecoveryReport:
        """Read the journal and settle what a previous process left (see the module's table).
        Rollbacks and discards are done before this returns; a resumed download and a restarted
        watch go on in the background.

        Raises:
            InternalError: called twice.
        """
        if self._recovery is not None:
            raise InternalError("Updater.recover() was already called")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        loaded = await self._loop.run_in_executor(
            None, partial(self.journal.load, recover=True))
        self._doc = loaded.doc
        self._since = time.monotonic()  # a resumed state's deadline counts from the restart
        if loaded.problem is not None:
            self._note(None, "journal_unusable", loaded.problem + (
                f"; moved aside to {loaded.moved_aside}" if loaded.moved_aside else ""))
            await self._save(strict=False)
        report = await self._settle()
        self._recovery = replace(report, journal_problem=loaded.problem,
                                 moved_aside=loaded.moved_aside)
        log.info("update recovery: %s (%s)", self._recovery.action, self._recovery.detail)
        return self._recovery

    async def request(self, request: UpdateRequest) -> RequestAnswer:
        """Apply a bundle, cancelling the update in progress (the newest request wins). Returns
        once the update started (it goes on in the background), or with why it did not.

        Raises:
            UpdateError: ``attempts_exhausted``: the bundle failed its attempts budget and is
                refused until a newer version is requested; ``not_ready``: :meth:`recover` has
                not finished.
        """
        lock = self._require_recovered()
        self._sequence += 1
        sequence = self._sequence
        async with lock:
            if sequence != self._sequence:
                return RequestAnswer(result="superseded", update_id=None,
                                     detail="a newer request came before this one started")
            expected = request.expected
            self._forget_older(expected)
            self._check_budget(expected)
            run = await self._current_run()
            if run is not None and self._is_duplicate(run, request):
                return RequestAnswer(result="in_progress", update_id=run.job.update_id,
                                     detail=f"this bundle is being applied ({self.state.value})")
            serving = await self._query_serving()
            if expected.matches(serving):
                if run is not None:
                    await self._interrupt(run, "superseded",
                                          f"a newer request asks for {serving}, which serves")
                return RequestAnswer(result="already_current", update_id=None,
                                     detail=f"{serving} already serves")
            if run is not None:
                await self._interrupt(run, "superseded", f"superseded by a request for "
                                                         f"{request.source}")
            if sequence != self._sequence:
                return RequestAnswer(result="superseded", update_id=None,
                                     detail="a newer request came before this one started")
            record = UpdateRecord(
                update_id=request.request_id or uuid.uuid4().hex, kind="update",
                source=request.source, expected=expected, bundle=None, attempt=1,
                requested_at=utc_now(), allow_downgrade=request.allow_downgrade)
            self._start(record, UpdateState.DOWNLOADING)
            return RequestAnswer(result="started", update_id=record.update_id,
                                 detail=f"applying {request.source}")

    async def rollback(self) -> RequestAnswer:
        """An operator rollback. With an update in progress before its commit, that update is
        cancelled (the version serving never changed); in the watch window after a commit, the
        committed version is reverted; otherwise the version serving is reverted to the one
        before it. Returns once the rollback is done, or under way for a revert.

        Raises:
            UpdateError: ``nothing_to_roll_back``: no version serves, or none was installed
                before it; ``not_ready``: as for :meth:`request`.
        """
        lock = self._require_recovered()
        self._sequence += 1
        sequence = self._sequence
        async with lock:
            if sequence != self._sequence:
                return RequestAnswer(result="superseded", update_id=None,
                                     detail="a newer request came before this rollback started")
            run = await self._current_run()
            if run is not None:
                if self.state is UpdateState.ROLLING_BACK:
                    return RequestAnswer(result="rolling_back", update_id=run.job.update_id,
                                         detail="a rollback is already under way")
                await self._interrupt(run, "operator_rollback", "an operator asked for a rollback")
                outcome = self._doc.last_outcome
                return RequestAnswer(result="rolling_back", update_id=run.job.update_id,
                                     detail=(outcome.detail or outcome.result) if outcome
                                     else "the update was rolled back")
            serving = await self._query_serving()
            if serving is None:
                raise UpdateError("no version serves, so there is nothing to roll back",
                                  reason="nothing_to_roll_back")
            if not await self._has_previous():
                # Refused, not started: a rollback run would fail rollback_failed, counted
                # among the failures, for a request that has nothing to do.
                raise UpdateError("there is no version before the one serving to roll back to",
                                  reason="nothing_to_roll_back", serving=str(serving))
            record = UpdateRecord(update_id=uuid.uuid4().hex, kind="rollback", source="",
                                  expected=BundleId(), bundle=serving, attempt=1,
                                  requested_at=utc_now(), committed=True)
            self._start(record, UpdateState.ROLLING_BACK)
            return RequestAnswer(result="rolling_back", update_id=record.update_id,
                                 detail=f"reverting {serving} to the version before it")

    async def _current_run(self) -> _Run | None:
        """The run in progress, None once it has ended. A run whose outcome is set (its state
        resting in the status) may still be writing it: that write is waited for, so a
        request right after an outcome is not taken for a duplicate of the finished update."""
        run = self._run
        while run is not None and run.ended and run.task is not None:
            await asyncio.wait({run.task})
            run = self._run
        return run

    async def _has_previous(self) -> bool:
        """Whether a revert has a version to return to; True when the steps cannot tell (a
        store that cannot be read): the rollback then runs and its failure says why."""
        try:
            return await self.steps.previous() is not None
        except AgentError as exc:
            log.warning("cannot tell the version before the one serving: %s", exc)
            return True

    def status(self) -> dict[str, Any]:
        """The updater's state for the control channel and the fleet: JSON-able."""
        deadline_s = self.policy.deadline_s(self.state)
        left_s = None if deadline_s is None else max(0.0, deadline_s - (time.monotonic() -
                                                                        self._since))
        record = self._run.job.record if self._run is not None else self._doc.update
        outcome = self._doc.last_outcome
        return {
            "state": self.state.value,
            "since": self._doc.entered_at,
            "deadline_left_s": None if left_s is None else round(left_s, 3),
            "update": None if record is None else record.to_json(),
            "attempt": None if record is None else record.attempt,
            "progress": self._progress,
            "last_outcome": None if outcome is None else outcome.to_json(),
            "history": [event.to_json() for event in self._doc.history[-HISTORY_TAIL:]],
            "refused": [entry.to_json() for entry in self._doc.bundles.values()
                        if entry.refused_at is not None],
            "counters": self.counters.to_json(),
            "recovery": None if self._recovery is None else self._recovery.to_json(),
        }

    async def wait(self) -> Outcome | None:
        """Wait until no update runs (a request's or a recovery's); the last outcome."""
        while self._run is not None and self._run.task is not None:
            await asyncio.wait({self._run.task})
        return self._doc.last_outcome

    async def run(self) -> None:
        """The daemon's background task (agent/supervisor.py): :meth:`recover`, then serve
        requests until cancelled, then :meth:`close`."""
        if self._recovery is None:
            await self.recover()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the update in progress where it is, for a daemon shutdown: the journal keeps its
        state and the next start's :meth:`recover` settles it, as after a crash."""
        run = self._run
        if run is not None and run.task is not None:
            run.task.cancel()
            await asyncio.wait({run.task})

    # -- one update's run -------------------------------------------------------------------

    def _start(self, record: UpdateRecord, state: UpdateState) -> _Run:
        run = _Run(job=UpdateJob(record, self.state, self._on_progress))
        self._run = run
        if record.kind == "update" and state is not UpdateState.COMMITTED:
            self.counters.attempts += 1
        run.task = asyncio.ensure_future(self._drive(run, state))
        return run

    async def _drive(self, run: _Run, start: UpdateState) -> None:
        try:
            if run.job.record.kind == "rollback":
                await self._operator_rollback(run)
            else:
                try:
                    await self._forward(run, start)
                except _Stop as stop:
                    await self._unwind(run, stop)
                except Exception as exc:  # a bug of ours: still take the failure edge
                    log.exception("the updater failed in %s", self.state.value)
                    await self._unwind(run, _Stop("failure", "internal_error",
                                                  f"the updater failed: {first_line(exc)}"))
        except asyncio.CancelledError:
            log.info("update %s stopped in %s; the next start settles it", run.job.update_id,
                     self.state.value)
            raise
        except Exception:
            # A bug of ours (an illegal transition): logged, and the updater stays usable.
            log.exception("the updater failed in %s", self.state.value)
        finally:
            if self._run is run:
                self._run = None

    async def _forward(self, run: _Run, start: UpdateState) -> None:
        for state in FORWARD[FORWARD.index(start):]:
            if self.state is not state:
                await self._enter(run, state)
            await self._do_state(run, state)
        await self._end(run, UpdateState.IDLE, result="committed", reason=None,
                        state=UpdateState.COMMITTED, detail=f"{run.job.bundle} is committed and "
                                                            "passed its watch window")

    async def _do_state(self, run: _Run, state: UpdateState) -> None:
        steps = self.steps
        if state is UpdateState.DOWNLOADING:
            await self._step(run, partial(steps.download, run.job))
        elif state is UpdateState.VERIFYING:
            await self._identify(run, await self._step(run, partial(steps.verify, run.job)))
        elif state is UpdateState.STAGED:
            await self._step(run, partial(steps.stage, run.job))
        elif state is UpdateState.BUILDING_ENGINE:
            await self._step(run, partial(steps.build_engine, run.job))
        elif state is UpdateState.WARMING:
            await self._step(run, partial(steps.warm, run.job))
        elif state is UpdateState.CANARY:
            verdict = await self._step(run, partial(steps.canary, run.job))
            self._count_verdict(self.counters.canary_verdicts, verdict)
            if not verdict.healthy:
                raise _Stop("failure", verdict.reason or "canary",
                            f"the canary judged {run.job.bundle} unhealthy"
                            + (f": {verdict.detail}" if verdict.detail else ""))
            started = time.monotonic()
            await self._step(run, partial(steps.commit, run.job))
            swap_s = time.monotonic() - started
            self.counters.swaps += 1
            self.counters.swap_seconds_total += swap_s
            self.counters.last_swap_s = round(swap_s, 6)
            run.job.record = replace(run.job.record, committed=True)
        elif state is UpdateState.COMMITTED:
            verdict = await self._step(run, partial(steps.watch, run.job), deadline_passes=True)
            if verdict is not None:
                self._count_verdict(self.counters.watch_verdicts, verdict)
                if not verdict.healthy:
                    raise _Stop("failure", verdict.reason or "watch",
                                f"the watch found {run.job.bundle} regressed"
                                + (f": {verdict.detail}" if verdict.detail else ""))
        else:
            raise InternalError(f"no work is defined for the state {state.value}")

    async def _identify(self, run: _Run, bundle: object) -> None:
        """Check what verification found against the request, the budget and what serves."""
        name, version, sha256 = (getattr(bundle, part, None)
                                 for part in ("name", "version", "sha256"))
        if not (isinstance(bundle, BundleId) and name is not None and version is not None
                and sha256 is not None):
            raise _Stop("failure", "internal_error",
                        f"the verify step returned {bundle!r}, not a name, version and sha256")
        expected = run.job.expected
        for part in ("name", "version", "sha256"):
            wanted, found = getattr(expected, part), getattr(bundle, part)
            if wanted is not None and wanted != found:
                raise _Stop("failure", "unexpected_bundle",
                            f"the bundle's {part} is {found!r}, the request wanted {wanted!r}")
        run.job.record = replace(run.job.record, bundle=bundle)
        self._forget_older(bundle)
        refused = self._refused(bundle)
        if refused is not None:
            raise _Stop("failure", "attempts_exhausted", self._refusal_text(refused))
        if bundle.matches(await self._query_serving()):
            raise _Stop("noop", "already_current", f"{bundle} already serves")
        entry = self._doc.bundles.get(sha256) or BundleAttempts(name=name, version=version,
                                                                 sha256=sha256)
        self._doc.bundles[sha256] = replace(entry, attempts=entry.attempts + 1)

    async def _unwind(self, run: _Run, stop: _Stop) -> None:
        """Take the failure or cancel edge of the state the update stopped in."""
        state = self.state
        failed = stop.kind == "failure"
        if stop.kind == "noop":
            await self._discard_quietly(run)
            await self._end(run, UpdateState.IDLE, result="already_current", reason=stop.reason,
                            state=state, detail=stop.detail)
            return
        if failed:
            self._count_failure(run, stop.reason, state)
        target = ON_FAILURE[state] if failed else ON_CANCEL[state]
        if state is UpdateState.COMMITTED and stop.reason == "operator_rollback":
            target = UpdateState.ROLLING_BACK  # an operator wants the committed version gone
        if target is not UpdateState.ROLLING_BACK:
            if state is UpdateState.COMMITTED:  # cut short by a newer request: keep it
                await self._end(run, target, result="committed", reason=stop.reason,
                                state=state, detail=f"{run.job.bundle} is committed; its watch "
                                                    f"was cut short: {stop.detail}")
                return
            await self._discard_quietly(run)
            await self._end(run, target, result="failed" if failed else "cancelled",
                            reason=stop.reason, state=state, detail=stop.detail)
            return
        if failed:
            result = "failed"
        elif state is UpdateState.COMMITTED:  # only an operator rollback cancels into a revert
            result = "rolled_back"
        else:
            result = "cancelled"
        self._doc.pending = self._outcome(run, result, stop.reason, state, stop.detail)
        await self._enter(run, UpdateState.ROLLING_BACK, reason=stop.reason, detail=stop.detail,
                          strict=False)
        await self._roll_back(run)

    async def _operator_rollback(self, run: _Run) -> None:
        self._doc.pending = self._outcome(run, "rolled_back", "operator_rollback", self.state,
                                          f"an operator rolled {run.job.bundle} back")
        await self._enter(run, UpdateState.ROLLING_BACK, reason="operator_rollback",
                          detail=f"reverting {run.job.bundle}", strict=False)
        await self._roll_back(run)

    async def _roll_back(self, run: _Run) -> None:
        """The work of rolling-back, then its end: revert a committed candidate that serves,
        discard one that does not (it never did, or a revert before a restart already
        happened). Not interrupted by requests; bounded by its deadline."""
        pending = self._doc.pending or self._outcome(run, "failed", "interrupted_by_restart",
                                                     UpdateState.ROLLING_BACK, None)
        try:
            reverting = run.job.record.committed and run.job.bundle is not None and (
                run.job.bundle.matches(await self._step(run, self.steps.serving,
                                                        interruptible=False)))
            if reverting:
                await self._step(run, partial(self.steps.revert, run.job), interruptible=False)
                self.counters.rollbacks += 1
            elif run.job.record.kind == "update":  # never served, or no longer does
                await self._step(run, partial(self.steps.discard, run.job), interruptible=False)
        except _Stop as stop:
            await self._end(run, UpdateState.FAILED, result="failed", reason="rollback_failed",
                            state=UpdateState.ROLLING_BACK,
                            detail=f"rolling back failed ({stop.reason}: {stop.detail}) after: "
                                   f"{pending.detail or pending.reason}")
            return
        target = UpdateState.FAILED if pending.result == "failed" else UpdateState.IDLE
        await self._end(run, target, result=pending.result, reason=pending.reason,
                        state=pending.state, detail=pending.detail)

    async def _discard_quietly(self, run: _Run) -> None:
        """Discard before staged: a failure here is logged; nothing serves from it."""
        try:
            await self._step(run, partial(self.steps.discard, run.job), interruptible=False,
                             deadline_s=self.policy.rolling_back_s)
        except _Stop as stop:
            log.warning("could not discard what update %s left: %s", run.job.update_id,
                        stop.detail)

    async def _step(self, run: _Run, call: Callable[[], Awaitable[T]], *,
                    interruptible: bool = True, deadline_passes: bool = False,
                    deadline_s: float | None = None) -> T:
        """Await one step under the current state's deadline (what is left of it).

        Raises:
            _Stop: the step failed, ran past the deadline (``deadline``) or was interrupted by a
                newer request (``cancel``). With ``deadline_passes``, reaching the deadline
                returns None instead (the watch window).
        """
        state = self.state
        run.job.state = state
        full_s = deadline_s if deadline_s is not None else self.policy.deadline_s(state)
        if full_s is None:
            raise InternalError(f"a step was started in the resting state {state.value}")
        left_s = full_s if deadline_s is not None else full_s - (time.monotonic() - self._since)
        task: asyncio.Future[T] = asyncio.ensure_future(call())
        waiter = asyncio.ensure_future(run.interrupt.wait()) if interruptible else None
        awaited: set[asyncio.Future[Any]] = {task} if waiter is None else {task, waiter}
        try:
            done, _ = await asyncio.wait(awaited, timeout=max(left_s, 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            if waiter is not None:
                waiter.cancel()
        if task in done:
            return self._step_result(task, state)
        await self._abandon(task, state)
        if waiter is not None and waiter in done:
            raise _Stop("cancel", run.interrupt_reason, run.interrupt_detail)
        if deadline_passes:
            return None  # type: ignore[return-value]  # the watch's window passed
        raise _Stop("failure", "deadline", f"the {state.value} step took longer than its "
                                           f"{full_s:g} s deadline (state={state.value})")

    def _step_result(self, task: asyncio.Future[T], state: UpdateState) -> T:
        if task.cancelled():
            raise _Stop("failure", "step_cancelled", f"the {state.value} step was cancelled")
        exc = task.exception()
        if exc is None:
            return task.result()
        if isinstance(exc, UpdateError):
            raise _Stop("failure", exc.reason, str(exc))
        if isinstance(exc, AgentError):
            raise _Stop("failure", "error", f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, Exception):
            raise exc
        log.error("the %s step raised", state.value, exc_info=exc)
        raise _Stop("failure", "internal_error", f"the {state.value} step raised "
                                                 f"{type(exc).__name__}: {first_line(exc)}")

    async def _abandon(self, task: asyncio.Future[Any], state: UpdateState) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=self.policy.cancel_grace_s)
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as unhandled
            return
        log.warning("the %s step did not stop within %g s of being cancelled; abandoned",
                    state.value, self.policy.cancel_grace_s)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _interrupt(self, run: _Run, reason: str, detail: str) -> None:
        """Cancel ``run`` (unless it is rolling back) and wait until it ended its state's way."""
        run.interrupt_reason = reason
        run.interrupt_detail = detail
        run.interrupt.set()
        if run.task is not None:
            await asyncio.wait({run.task})

    # -- recovery ---------------------------------------------------------------------------

    async def _settle(self) -> RecoveryReport:
        doc = self._doc
        found = doc.state
        record = doc.update
        if found in RESTING or record is None:
            return RecoveryReport(found=found, action="none", detail=f"{found.value}: nothing "
                                  "was in progress", update_id=None if record is None else
                                  record.update_id)
        run = _Run(job=UpdateJob(record, found, self._on_progress))
        self._run = run
        try:
            return await self._settle_run(run, found, record)
        finally:
            if self._run is run and run.task is None:
                self._run = None

    async def _settle_run(self, run: _Run, found: UpdateState,
                          record: UpdateRecord) -> RecoveryReport:
        ident = record.update_id
        if found in (UpdateState.DOWNLOADING, UpdateState.VERIFYING):
            await self._end(run, UpdateState.IDLE, result="interrupted",
                            reason="interrupted_by_restart", state=found,
                            detail=f"a restart interrupted the update in {found.value}")
            if self.policy.resume_on_restart:
                self._start(replace(record, attempt=record.attempt + 1, bundle=None),
                            UpdateState.DOWNLOADING)
                return RecoveryReport(found=found, action="resumed", update_id=ident,
                                      detail=f"interrupted in {found.value}; started again as "
                                             f"attempt {record.attempt + 1}")
            await self._discard_quietly(run)
            return RecoveryReport(found=found, action="abandoned", update_id=ident,
                                  detail=f"interrupted in {found.value}; not resumed")
        if found is UpdateState.ROLLING_BACK:
            self._note(run, "interrupted_by_restart", "a restart interrupted the rollback; "
                                                      "finishing it")
            await self._roll_back(run)
            return RecoveryReport(found=found, action="rollback_finished", update_id=ident,
                                  detail="the interrupted rollback was finished")
        serving = await self._query_serving()
        serves = record.bundle is not None and record.bundle.matches(serving)
        if found is UpdateState.CANARY and serves:
            run.job.record = replace(record, committed=True)
            await self._enter(run, UpdateState.COMMITTED, reason="commit_found_at_restart",
                              detail=f"{record.bundle} serves: the commit was done before the "
                                     "restart", strict=False)
            self._start_watch(run)
            return RecoveryReport(found=found, action="commit_found", update_id=ident,
                                  detail=f"{record.bundle} was committed; its watch started")
        if found is UpdateState.COMMITTED and serves:
            self._note(run, "watch_restarted", "a restart interrupted the watch window; "
                                               "watching again in full")
            self._since = time.monotonic()
            self._start_watch(run)
            return RecoveryReport(found=found, action="watch_restarted", update_id=ident,
                                  detail=f"{record.bundle} stays committed; its watch restarted")
        reason = "not_serving_at_restart" if found is UpdateState.COMMITTED else (
            "interrupted_by_restart")
        detail = (f"{record.bundle} was committed but does not serve after the restart"
                  if found is UpdateState.COMMITTED else
                  f"a restart interrupted the update in {found.value}; the version before it "
                  "serves")
        self._count_failure(run, reason, found)
        self._doc.pending = self._outcome(run, "failed", reason, found, detail)
        await self._enter(run, UpdateState.ROLLING_BACK, reason=reason, detail=detail,
                          strict=False)
        await self._roll_back(run)
        return RecoveryReport(found=found, update_id=ident, detail=detail,
                              action="not_serving" if found is UpdateState.COMMITTED
                              else "discarded")

    def _start_watch(self, run: _Run) -> None:
        self._run = run
        run.task = asyncio.ensure_future(self._drive(run, UpdateState.COMMITTED))

    # -- the journal, the budget and the listeners -------------------------------------------

    async def _enter(self, run: _Run, state: UpdateState, *, reason: str | None = None,
                     detail: str | None = None, strict: bool = True,
                     keep_update: bool = True) -> None:
        """Make ``state`` current, journalled before its work starts. With ``strict``, a
        journal that cannot be written fails the update (a crash would otherwise recover from
        a state it is not in). Without ``keep_update`` the journal forgets the update (idle)."""
        previous = self.state
        check_transition(previous, state)
        self._doc.history.append(Event(at=utc_now(), update_id=run.job.update_id,
                                       from_state=previous, to_state=state, reason=reason,
                                       detail=detail))
        self._doc.state = state
        self._doc.entered_at = utc_now()
        self._doc.update = run.job.record if keep_update else None
        self._since = time.monotonic()
        self._progress = None
        run.job.state = state
        await self._save(strict=strict)
        self._emit({"event": "state", "update_id": run.job.update_id, "from": previous.value,
                    "to": state.value, "reason": reason, "detail": detail,
                    "at": self._doc.entered_at})

    async def _end(self, run: _Run, to_state: UpdateState, *, result: str,
                   reason: str | None, state: UpdateState, detail: str | None) -> None:
        """End the update in a resting state with its outcome (``state``: where it failed, was
        cancelled or finished), journalled in one write."""
        run.ended = True
        outcome = self._outcome(run, result, reason, state, detail)
        if result == "failed" and reason is not None:
            self._count_reason(reason)
        self._doc.last_outcome = outcome
        self._doc.pending = None
        transition_reason = reason or ("watch_passed" if result == "committed" else None)
        await self._enter(run, to_state, reason=transition_reason, detail=detail, strict=False,
                          keep_update=to_state is not UpdateState.IDLE)
        log.log(logging.WARNING if result == "failed" else logging.INFO,
                "update %s ended %s in %s: %s", run.job.update_id, result, state.value, detail)
        self._emit({"event": "outcome", **outcome.to_json()})

    def _outcome(self, run: _Run, result: str, reason: str | None, state: UpdateState,
                 detail: str | None) -> Outcome:
        return Outcome(update_id=run.job.update_id, kind=run.job.record.kind, result=result,
                       reason=reason, state=state, detail=detail, at=utc_now(),
                       bundle=run.job.bundle)

    def _note(self, run: _Run | None, reason: str, detail: str) -> None:
        """A history entry that is not a transition (journalled by the next write)."""
        self._doc.history.append(Event(at=utc_now(), update_id=None if run is None else
                                       run.job.update_id, from_state=self.state,
                                       to_state=self.state, reason=reason, detail=detail))

    async def _save(self, *, strict: bool) -> None:
        if self._write_lock is None or self._loop is None:
            raise InternalError("the journal is written before Updater.recover() ran")
        async with self._write_lock:
            text = self.journal.encode(self._doc)
            try:
                await self._loop.run_in_executor(None, self.journal.write_encoded, text)
            except OSError as exc:
                if strict:
                    raise _Stop("failure", "journal_unwritable",
                                f"the journal {self.journal.path} cannot be written: {exc}") \
                        from exc
                log.error("the journal %s cannot be written: %s", self.journal.path, exc)

    def _emit(self, event: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("an update listener failed on %s", event.get("event"))

    def _on_progress(self, job: UpdateJob, facts: dict[str, Any]) -> None:
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._on_progress, job, facts)
            return
        run = self._run
        if run is None or run.job is not job or job.state is not self.state:
            return  # a late report from a step that has been cancelled
        self._progress = {"state": self.state.value, **facts}
        self._emit({"event": "progress", "update_id": job.update_id, **self._progress})

    async def _query_serving(self) -> BundleId | None:
        """What serves, asked of the steps under ``query_s``; None (with a warning) when they
        cannot say, so that a broken query never blocks an update or a recovery."""
        task = asyncio.ensure_future(self.steps.serving())
        done, _ = await asyncio.wait({task}, timeout=self.policy.query_s)
        if task in done and not task.cancelled() and task.exception() is None:
            return task.result()
        if task not in done:
            await self._abandon(task, self.state)
            log.warning("asking which version serves took longer than %g s",
                        self.policy.query_s)
        elif not task.cancelled():
            log.warning("asking which version serves failed: %s", task.exception())
        return None

    def _require_recovered(self) -> asyncio.Lock:
        # A command can reach the daemon while the updater still settles the last run: that is
        # the requester's timing, not a bug, so it gets an answer it can retry on.
        if self._lock is None or self._recovery is None:
            raise UpdateError("the updater is still recovering from the last run; try again",
                              reason="not_ready")
        return self._lock

    def _is_duplicate(self, run: _Run, request: UpdateRequest) -> bool:
        """Whether ``request`` asks for the update ``run`` is applying (a redelivered message)."""
        record = run.job.record
        if (record.kind != "update" or self.state is UpdateState.ROLLING_BACK
                or run.interrupt.is_set()):
            return False
        expected = request.expected
        if expected.is_known():
            return expected.matches(record.expected) or expected.matches(record.bundle)
        return not record.expected.is_known() and request.source == record.source

    def _forget_older(self, bundle: BundleId) -> None:
        """A newer version of a model lifts the refusals (and drops the counts) of its older
        versions."""
        if bundle.name is None or bundle.version is None:
            return
        for key, entry in list(self._doc.bundles.items()):
            if entry.name == bundle.name and entry.version < bundle.version:
                del self._doc.bundles[key]

    def _refused(self, bundle: BundleId) -> BundleAttempts | None:
        for entry in self._doc.bundles.values():
            if entry.refused_at is not None and entry.bundle.matches(bundle):
                return entry
        return None

    def _check_budget(self, expected: BundleId) -> None:
        refused = self._refused(expected)
        if refused is not None:
            raise UpdateError(self._refusal_text(refused), reason="attempts_exhausted",
                              bundle=str(refused.bundle), failures=refused.failures,
                              last_reason=refused.last_reason)

    def _refusal_text(self, entry: BundleAttempts) -> str:
        return (f"{entry.bundle} failed {entry.failures} times (last: {entry.last_reason}) and is "
                f"refused until a newer version is requested")

    def _count_failure(self, run: _Run, reason: str, state: UpdateState) -> None:
        """Count a failure against the bundle's budget when its content was tried (from staged
        on); refuse the bundle once the budget is spent."""
        bundle = run.job.bundle
        if (state not in _CANDIDATE_STATES or run.job.record.kind != "update" or bundle is None
                or bundle.sha256 is None or bundle.name is None or bundle.version is None):
            return
        entry = self._doc.bundles.get(bundle.sha256) or BundleAttempts(
            name=bundle.name, version=bundle.version, sha256=bundle.sha256, attempts=1)
        failures = entry.failures + 1
        refused_at = entry.refused_at
        if refused_at is None and failures >= self.policy.max_failures:
            refused_at = utc_now()
            log.warning("%s failed %d times; refused until a newer version is requested",
                        bundle, failures)
        self._doc.bundles[bundle.sha256] = replace(entry, failures=failures, last_reason=reason,
                                                   refused_at=refused_at)

    def _count_reason(self, reason: str) -> None:
        self.counters.failures_by_reason[reason] = self.counters.failures_by_reason.get(
            reason, 0) + 1

    @staticmethod
    def _count_verdict(counts: dict[str, int], verdict: Verdict) -> None:
        key = "healthy" if verdict.healthy else "unhealthy"
        counts[key] += 1
