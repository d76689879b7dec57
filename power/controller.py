"""The power controller: drives a board through the power states with the governor's choices.

``Controller(board, policy, clock=..., saved=...)`` is what the daemon's power thread and the
simulator's serving loop call:

* :meth:`~Controller.start` takes the board's snapshot (its limits before we touch them) and saves
  it where a crash cannot lose it; a snapshot already saved means the last run died without
  restoring, so that one is put back first and kept as the original.
* :meth:`~Controller.step` (every ~50 ms) learns from the completions, reads telemetry at a lower
  cadence (temperature and power change slowly; a full read costs more than a step may), moves
  between the states of :data:`~power.types.TRANSITIONS` and applies the governor's point.
* :meth:`~Controller.wake` is the batcher's wake hook: before the first request after the clocks
  were parked is dispatched, it boosts them (one apply, no telemetry): to the top after sleep or a
  long idle (for that first request only; the point sized for the last busy period follows once
  it is answered), else straight to that sized point. :meth:`~Controller.needs_wake` says whether
  the hook must be called. Clocks are parked (lowest, rail-gating allowed) in ``idle`` and
  ``sleeping``, and inside ``active`` after a quiet moment longer than a few of the stream's own
  gaps (race to idle between bursts; a steady stream is never parked between its requests).
* :meth:`~Controller.stop` restores the snapshot and forgets the saved copy (kept when the
  restore was not complete, for the next start to try again).

Profiles: ``governed`` (the governor), ``max``/``min`` (the top or bottom point pinned) and
``stock`` (the board's own governors: the snapshot restored and nothing written after).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from agent.errors import PowerError
from power.governor import UP_HEADROOM, Governor, point_for
from power.latency_model import PointKey
from power.sleep import RailgatePlanner, SleepDepth, SleepPlanner, default_depth
from power.thermal_guard import ThermalCap, ThermalGuard
from power.types import (
    TRANSITIONS,
    ApplyResult,
    BoardControl,
    ClockTable,
    Completion,
    Decision,
    LoadSample,
    OperatingPoint,
    PowerPolicy,
    PowerState,
    Telemetry,
)

log = logging.getLogger(__name__)

PROFILES = ("governed", "max", "min", "stock")
TELEMETRY_PERIOD_S = 1.0  # a full telemetry read, at most this often
SETTLE_S = 0.010  # a clock change is in force this long after its write (GPU 5 ms, EMC 8 ms)
DECISIONS_KEPT = 64
SIZE_LEAST = 30  # requests in a busy period before its P99 corrects the wake's sizing
SIZE_LOW, SIZE_HIGH = 0.75, 0.90  # its P99 under / over these shares of the target ...
SIZE_UP, SIZE_DOWN = 1.05, 0.85  # ... scales the share the next wake is sized for by these
SIZE_SHARE_MIN, SIZE_SHARE_MAX = 0.70, 1.15
COLD_AFTER_S = 8.0  # idle this long: a wake boosts to the top point
QUIET_S = 0.1  # no request this long while active: park the clocks until the next
QUIET_GAPS = 3.0  # ... and never sooner than this many of the stream's mean gaps
RAILGATE_HOLD_S = 2.0  # the rail-gate delay changes at most this often
RAILGATE_WINDOW_S = 10.0  # the P99 the latency room is judged on
RAILGATE_ROOM_ENTER = 0.80  # shorten the delay only if P99 + the unrailgate stays under this share
RAILGATE_ROOM_KEEP = 0.90  # ... and put it back once P99 (the unrailgate in it) passes this share


class SnapshotStore(Protocol):
    """Where the board's original limits survive a crash (``power/saved.py`` on a device)."""

    def save(self, snapshot: dict[str, Any]) -> None: ...

    def load(self) -> dict[str, Any] | None: ...

    def clear(self) -> None: ...


class MemoryStore:
    """A :class:`SnapshotStore` that does not survive the process (tests, the simulator)."""

    def __init__(self, snapshot: dict[str, Any] | None = None) -> None:
        self.snapshot = snapshot

    def save(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = dict(snapshot)

    def load(self) -> dict[str, Any] | None:
        return None if self.snapshot is None else dict(self.snapshot)

    def clear(self) -> None:
        self.snapshot = None


class Controller:
    """Runs one board's power states and operating point.

    Args:
        board: the board (``power/board.py``'s ``Board``, or a double).
        policy: what to aim for.
        clock: monotonic seconds (the simulator passes its own time).
        saved: where the snapshot for a restore after a crash is kept (default: memory only).
        on_engine: called with ``False`` when sleep releases the engine's memory and ``True`` when
            a wake needs it back (only when the policy's ``release_engine_in_sleep``).
        engine_reload_s: how long getting the engine back takes (for sleep's break-even).
        telemetry_period_s: how often a step reads the full telemetry.
    """

    def __init__(self, board: BoardControl, policy: PowerPolicy, *,
                 clock: Callable[[], float] = time.monotonic,
                 saved: SnapshotStore | None = None,
                 on_engine: Callable[[bool], None] | None = None,
                 engine_reload_s: float = 2.0,
                 telemetry_period_s: float = TELEMETRY_PERIOD_S) -> None:
        check_policy(policy)
        self.board = board
        self.policy = policy
        self._clock = clock
        self._saved: SnapshotStore = saved if saved is not None else MemoryStore()
        self._on_engine = on_engine
        self._engine_reload_s = engine_reload_s
        self._telemetry_period_s = telemetry_period_s
        self.state = PowerState.ACTIVE
        self._table: ClockTable | None = None
        self._governor: Governor | None = None
        self._guard: ThermalGuard | None = None
        self._planner: SleepPlanner | None = None
        self._snapshot: dict[str, Any] | None = None
        self._started = False
        self._point: OperatingPoint | None = None
        self._key: PointKey | None = None
        self._applies: deque[tuple[float, PointKey | None]] = deque(maxlen=256)
        self._last_activity_s = 0.0
        self._idle_since_s: float | None = None
        self._last_arrivals: int | None = None
        self._last_telemetry_s = -float("inf")
        self.telemetry: Telemetry | None = None
        self._cap: ThermalCap | None = None
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)
        self.changes = 0
        self.steps = 0
        self.step_cpu_s: deque[float] = deque(maxlen=4096)  # whole steps, board I/O included
        self.governor_cpu_s: deque[float] = deque(maxlen=4096)  # the same less the board's calls
        self._board_cpu_s = 0.0
        self.wake_call_ms: deque[float] = deque(maxlen=64)
        self.wake_ms: deque[float] = deque(maxlen=64)  # the first request's extra latency
        self._woke_at_s: float | None = None
        self._woke_key: PointKey | None = None
        self._after_first_key: PointKey | None = None
        self._engine_released = False
        self._active_key: PointKey | None = None  # the governor's last choice while active
        # The point sized at the last park for the next wake: (key, rate, P99 estimate).
        self._sized: tuple[PointKey, float, float] | None = None
        self._stock = False
        self._mode_before_sleep: int | None = None
        self._parked = False  # the lowest clocks until the next request (idle, sleep, quiet)
        self._mismatched: tuple[str, ...] = ()  # the limits the last apply found different
        self._size_share = UP_HEADROOM  # the share of the target a wake's point is sized for
        self._busy_since_s: float | None = None  # the last wake, until the next park
        self._railgate = RailgatePlanner()
        self._gate_long_ms: int | None = None  # the board's own rail-gate delay (restored)
        self._gate_short = False  # the delay is shortened (the GPU gates between frames)
        self._gate_changed_s = -float("inf")
        self._gate_degraded = False  # the board cannot write the delay (given up for good)
        self._gate_warned = False  # a failed write of the delay was warned about

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Save the board's original limits (restoring a crashed run's first), read the clock
        table and put the policy's first point in force."""
        if self._started:
            raise PowerError("the power controller is already started")
        left_over = self._left_over()
        if left_over is not None:
            self._snapshot = left_over
        else:
            self._snapshot = self.board.snapshot()
            self._saved.save(self._snapshot)
        table = self.board.clock_table()
        if not table.gpu_hz or not table.cpu_khz:
            raise PowerError("the board offers no GPU or CPU frequency table to govern",
                             gpu_entries=len(table.gpu_hz), cpu_entries=len(table.cpu_khz))
        self._table = table
        self._governor = Governor(table, self.policy)
        self._guard = ThermalGuard(table, margin_c=self.policy.thermal_margin_c)
        self._planner = SleepPlanner(sleep_after_s=self.policy.sleep_after_s,
                                     depth=self._sleep_depth())
        self._started = True
        now = self._clock()
        self._last_activity_s = now
        self._gate_long_ms = self.board.read_point().gpu_railgate_delay_ms
        self._gate_short = False
        self._enter_profile(now)

    def _left_over(self) -> dict[str, Any] | None:
        """The limits a previous run saved and did not restore (it crashed), put back now; None
        when there are none, or when they cannot be used: a damaged copy, or one this board
        refuses (another board's, after a JetPack upgrade changed the device tree, say). Such a
        copy is moved aside, and the limits in force now are taken as the board's own: refusing
        to start would leave power governance off on this board for good."""
        try:
            left_over = self._saved.load()
        except PowerError as exc:
            log.error("the saved board limits cannot be used (%s); the limits in force now are "
                      "taken as the board's own", exc)
            return None
        if left_over is None:
            return None
        log.warning("restoring the board limits a previous run left (it did not stop)")
        try:
            result = self.board.restore(left_over)
        except PowerError as exc:
            discard = getattr(self._saved, "discard", None)
            if callable(discard):
                discard()
            else:
                self._saved.clear()
            log.error("this board refuses the limits a previous run saved (%s): the copy is set "
                      "aside and the limits in force now are taken as the board's own", exc)
            return None
        if not result.ok:
            log.warning("restore after a crash left %d limit(s) different: %s",
                        len(result.mismatches), ", ".join(m.path for m in result.mismatches))
        return left_over

    def stop(self) -> ApplyResult | None:
        """Put the board's original limits back and forget the saved copy, unless the restore
        was not complete (a limit read back different, or a control skipped): the copy then
        stays, so that the next start tries again."""
        if not self._started:
            return None
        self._started = False
        result = None
        if self._snapshot is not None:
            result = self.board.restore(self._snapshot)
        if result is not None and (result.mismatches or result.unsupported):
            left = [f"{m.path} wanted {m.wanted} found {m.found}" for m in result.mismatches]
            left += list(result.unsupported)
            log.warning("restoring the board left %d limit(s) not put back (%s); the saved copy "
                        "is kept for the next start", len(left), "; ".join(left[:5]))
        else:
            self._saved.clear()
        if self._engine_released and self._on_engine is not None:
            self._on_engine(True)
            self._engine_released = False
        return result

    def set_engine_hook(self, on_engine: Callable[[bool], None] | None) -> None:
        """Who releases and restores the engine's memory (the constructor's ``on_engine``), for
        a caller that makes the controller before it has one (the daemon's power service)."""
        self._on_engine = on_engine

    def set_engine_reload_s(self, seconds: float) -> None:
        """How long getting the engine back took, as measured (a restore after sleep): the
        sleep's break-even is sized on it from now on, instead of the constructor's guess."""
        if not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise PowerError("an engine reload time must be a finite number of seconds >= 0",
                             found=repr(seconds)[:40])
        self._engine_reload_s = float(seconds)
        if self._planner is not None:
            self._planner.depth = self._sleep_depth()

    def _sleep_depth(self) -> SleepDepth:
        return default_depth(idle_mw=None, sleep_mw=None, engine_reload_s=self._engine_reload_s,
                             release_engine=self.policy.release_engine_in_sleep)

    def set_policy(self, policy: PowerPolicy) -> None:
        """Aim for ``policy`` from the next step (a profile change takes effect now)."""
        check_policy(policy)
        old = self.policy
        self.policy = policy
        if not self._started:
            return
        self._require_governor().set_policy(policy)
        if self._guard is not None:
            self._guard.margin_c = policy.thermal_margin_c
        if self._planner is not None:
            self._planner.sleep_after_s = policy.sleep_after_s
            self._planner.depth = self._sleep_depth()  # release_engine_in_sleep may change it
        if old.profile != policy.profile:
            self._enter_profile(self._clock())

    def _enter_profile(self, now_s: float) -> None:
        governor = self._require_governor()
        profile = self.policy.profile
        mode = self._leave_rest(now_s)
        self._set_railgate_delay(False, now_s)
        self._stock = profile == "stock"
        if self._stock:
            if self._snapshot is not None:
                self.board.restore(self._snapshot)
            self._point, self._key = None, None
            return
        key = governor.bottom if profile == "min" else governor.top
        self._apply(key, now_s, reason=f"profile {profile}", nvpmodel_mode=mode)
        governor.placed(key, now_s)

    def _leave_rest(self, now_s: float) -> int | None:
        """Back to ``active`` for a profile change, along the transition table (``sleeping``
        goes through ``waking``), with the engine back if sleep released it. Returns the
        nvpmodel mode sleep left, to be put back (None: none was changed)."""
        if self.state is PowerState.SLEEPING:
            self._set_state(PowerState.WAKING, now_s)
            if self._engine_released and self._on_engine is not None:
                self._on_engine(True)
                self._engine_released = False
        self._set_state(PowerState.ACTIVE, now_s)
        mode, self._mode_before_sleep = self._mode_before_sleep, None
        self._idle_since_s = None
        self._parked = False
        self._after_first_key = None
        return mode

    # -- the step ----------------------------------------------------------------------------

    def step(self, load: LoadSample, completions: Sequence[Completion] = ()) -> Decision:
        """One governor step: learn, move between states, apply the point chosen."""
        started_cpu = time.process_time()
        self._board_cpu_s = 0.0
        try:
            return self._step(load, completions)
        finally:
            spent = time.process_time() - started_cpu
            self.step_cpu_s.append(spent)
            self.governor_cpu_s.append(spent - self._board_cpu_s)

    def _step(self, load: LoadSample, completions: Sequence[Completion]) -> Decision:
        if not self._started:
            raise PowerError("the power controller was stepped before start() or after stop()")
        governor = self._require_governor()
        now = self._clock()
        self.steps += 1
        arrivals = load.arrivals_total - (self._last_arrivals if self._last_arrivals is not None
                                          else load.arrivals_total)
        self._last_arrivals = load.arrivals_total
        busy = arrivals > 0 or load.queue_depth > 0 or load.busy_instances > 0
        governor.observe(load, completions, self._key_of)
        self._note_wake_latency(completions)
        if now - self._last_telemetry_s >= self._telemetry_period_s:
            self._read_telemetry(now)
        if self._stock or self.policy.profile in ("max", "min"):
            return self._decide(now, changed=False, reason=f"profile {self.policy.profile}")
        self._railgate.observe(completions)
        if self.state is PowerState.ACTIVE and not self._parked:
            self._railgate_step(now)
        if busy:
            self._last_activity_s = now
            if self._parked or self.state in (PowerState.IDLE, PowerState.SLEEPING):
                # A request came without the wake hook (or during the step): wake now.
                self._wake(now, reason="arrival")
        idle_for = now - self._last_activity_s
        if self.state is PowerState.ACTIVE and not busy and idle_for >= self.policy.idle_after_s:
            return self._park(now)
        if self.state is PowerState.ACTIVE and self._parked:
            return self._decide(now, changed=False, reason="parked between requests")
        if self.state is PowerState.ACTIVE and not busy and idle_for >= self._quiet_s(governor):
            return self._park(now, idle=False)
        if self.state is PowerState.IDLE:
            planner = self._planner
            if planner is None:
                raise PowerError("the power controller is not started")
            since = now - (self._idle_since_s if self._idle_since_s is not None else now)
            if planner.should_sleep(since + self.policy.idle_after_s):
                return self._sleep(now)
            return self._decide(now, changed=False, reason="idle")
        if self.state is PowerState.SLEEPING:
            return self._decide(now, changed=False, reason="sleeping")
        if self.state is PowerState.WAKING:
            self._set_state(PowerState.ACTIVE, now)
        if self._after_first_key is not None and self._woke_at_s is None:
            key, self._after_first_key = self._after_first_key, None
            result = self._apply(key, now, reason="first request answered: the sized point")
            self._place(key, now, wake=False)
            return self._decide(now, changed=True, reason="after the wake", applied=result)
        choice = governor.choose(load, self._cap)
        self._active_key = choice.key
        self._sized = None
        if choice.key != self._key:
            result = self._apply(choice.key, now, reason=choice.reason)
            return self._decide(now, changed=True, reason=choice.reason,
                                predicted_s=choice.predicted_s, applied=result)
        return self._decide(now, changed=False, reason=choice.reason,
                            predicted_s=choice.predicted_s)

    # -- states ------------------------------------------------------------------------------

    def needs_wake(self) -> bool:
        """Whether the batcher must call :meth:`wake` before dispatching a request: the clocks
        are parked low (idle) or the board sleeps."""
        return self._started and not self._stock and (self._parked or self.state in (
            PowerState.IDLE, PowerState.SLEEPING))

    def wake(self, reason: str = "request") -> None:
        """Boost before the first request after idle or sleep is dispatched (the batcher's wake
        hook; an MQTT wake command calls it too). One apply: fast."""
        if not self.needs_wake():
            return
        started = time.perf_counter()
        self._wake(self._clock(), reason=reason)
        self.wake_call_ms.append((time.perf_counter() - started) * 1000.0)

    def _wake(self, now_s: float, *, reason: str) -> None:
        self._require_governor()
        if self.state is PowerState.SLEEPING:
            self._set_state(PowerState.WAKING, now_s)
            if self._engine_released and self._on_engine is not None:
                self._on_engine(True)
                self._engine_released = False
        mode = self._mode_before_sleep
        self._mode_before_sleep = None
        planner = self._planner
        if planner is not None and self._idle_since_s is not None:
            planner.forecast.record(now_s - self._idle_since_s + self.policy.idle_after_s)
        idle_s = 0.0 if self._idle_since_s is None else now_s - self._idle_since_s
        cold = self.state is PowerState.WAKING or idle_s >= COLD_AFTER_S
        key = self._boost_key(cold=cold)
        warm = self._boost_key()
        # After a cold boost, the point sized for the last busy period takes over once the
        # first request is answered (the top point is for that request's latency only).
        self._after_first_key = warm if cold and warm != key else None
        self._apply(key, now_s, reason=f"wake ({reason})", nvpmodel_mode=mode)
        self._idle_since_s = None
        self._parked = False
        self._place(key, now_s, wake=True)
        self._last_activity_s = now_s
        self._woke_at_s = now_s
        self._busy_since_s = now_s
        self._woke_key = key
        self._set_state(PowerState.ACTIVE, now_s)

    def _place(self, key: PointKey, now_s: float, *, wake: bool) -> None:
        """Tell the governor of a point a wake put in force, with the rate and estimate it was
        sized for when it is the sized one (``wake``: the wake itself, not the sized point
        that follows a cold boost's first answer)."""
        sized = self._sized
        if sized is not None and sized[0] == key:
            self._require_governor().placed(key, now_s, rate_hz=sized[1], predicted_s=sized[2],
                                            wake=wake)
        else:
            self._require_governor().placed(key, now_s, wake=wake)

    def _boost_key(self, *, cold: bool = False) -> PointKey:
        """The point a wake boosts to: the top after sleep or a long idle (the first request
        must not wait for the governor to relearn the load), else the last point held active."""
        governor = self._require_governor()
        key = self._active_key
        top = governor.capped_top(self._cap)
        if cold or key is None or not governor.model.ready:
            return top
        if self._cap is not None and (
                (self._cap.gpu_max_hz is not None and key.gpu_hz > self._cap.gpu_max_hz)
                or (self._cap.cpu_max_khz is not None and key.cpu_khz > self._cap.cpu_max_khz)):
            return top
        return key

    def _quiet_s(self, governor: Governor) -> float:
        """No request for this long inside ``active``: park the clocks until the next one (the
        wake hook boosts). Never shorter than a few of the stream's own gaps, so a steady
        stream is not parked between its requests (each park and boost costs clock changes)."""
        rate = governor.arrival_rate_hz
        return max(QUIET_S, QUIET_GAPS / rate) if rate > 0 else QUIET_S

    def _park(self, now_s: float, *, idle: bool = True) -> Decision:
        """The lowest clocks, rail-gating allowed: in ``idle``, or (``idle=False``) parked
        inside ``active`` after a quiet moment."""
        governor = self._require_governor()
        reason = "idle: lowest clocks" if idle else "quiet: lowest clocks until the next request"
        if idle:
            self._set_state(PowerState.IDLE, now_s)
            self._idle_since_s = now_s
        if not self._parked and governor.model.ready:
            # Size the next wake's boost for the load just seen, not for wherever the governor
            # happened to be when it ended.
            self._correct_sizing(now_s)
            sized = governor.point_for_rate(now_s, governor.peak_rate_hz, self._cap,
                                            share_of_target=self._size_share)
            if sized is not None:
                self._active_key = sized[0]
                self._sized = (sized[0], governor.peak_rate_hz, sized[1])
            governor.peak_rate_hz = 0.0
        key = governor.bottom
        result = None
        if not self._parked or self._key != key:
            result = self._apply(key, now_s, reason=reason, railgate=True)
            governor.placed(key, now_s)
        self._parked = True
        return self._decide(now_s, changed=result is not None, reason=reason, applied=result)

    def _correct_sizing(self, now_s: float) -> None:
        """Learn how pessimistic the wake's sizing is: the busy period just ended, its P99
        against the target, nudges the share of the target the next one is sized for (the
        estimates carry every burst's start transients; a burst well under the target means
        the next may be sized lower, one near it that it must be sized higher)."""
        governor = self._require_governor()
        since = self._busy_since_s
        self._busy_since_s = None
        if since is None:
            return
        totals = sorted(total for time_s, total in governor.recent if time_s >= since)
        if len(totals) < SIZE_LEAST:
            return
        p99 = totals[min(len(totals) - 1, int(0.99 * len(totals)))]
        target = self.policy.latency_target_s
        if p99 > SIZE_HIGH * target:
            self._size_share = max(SIZE_SHARE_MIN, self._size_share * SIZE_DOWN)
        elif p99 < SIZE_LOW * target:
            self._size_share = min(SIZE_SHARE_MAX, self._size_share * SIZE_UP)

    def _sleep(self, now_s: float) -> Decision:
        governor = self._require_governor()
        self._set_state(PowerState.SLEEPING, now_s)
        if self.policy.sleep_nvpmodel_mode is not None:
            # Leave the sleep mode for the one in force now, on wake.
            self._mode_before_sleep = self.board.read_point().nvpmodel_mode
        result = self._apply(governor.bottom, now_s, reason="sleep", railgate=True,
                             nvpmodel_mode=self.policy.sleep_nvpmodel_mode)
        if self.policy.release_engine_in_sleep and self._on_engine is not None:
            self._on_engine(False)
            self._engine_released = True
        return self._decide(now_s, changed=True, reason="sleep", applied=result)

    def _railgate_step(self, now_s: float) -> None:
        """Shorten the GPU's rail-gate delay under a periodic load whose gaps pass the
        break-even, when the latency target has room for the unrailgate; put it back when the
        load goes continuous or the room goes."""
        planner = self._railgate
        long_ms = self._gate_long_ms
        if long_ms is None or long_ms <= planner.short_ms or self._gate_degraded:
            return  # no delay to change here, the board's own is short already, or no writes
        want = planner.wants_short(short_now=self._gate_short)
        p99 = self._require_governor().observed_p99_s(RAILGATE_WINDOW_S, now_s)
        target = self.policy.latency_target_s
        if want and not self._gate_short:
            want = p99 is not None and \
                p99 + planner.cost.unrailgate_s <= RAILGATE_ROOM_ENTER * target
        elif want and p99 is not None and p99 > RAILGATE_ROOM_KEEP * target:
            want = False
        if want != self._gate_short and now_s - self._gate_changed_s >= RAILGATE_HOLD_S:
            self._set_railgate_delay(want, now_s)

    @property
    def railgate_short(self) -> bool:
        """Whether the GPU's rail-gate delay is shortened (as last read back from the board)."""
        return self._gate_short

    def _set_railgate_delay(self, short: bool, now_s: float) -> None:
        """The short delay (rail-gating allowed with it), or the board's own back. What the
        controller believes afterwards is what the board reads back: a write refused, skipped
        (a read-only file degrades the control) or read back different changes nothing, and is
        tried again no sooner than the hold."""
        if short == self._gate_short or self._gate_long_ms is None:
            return
        wanted_ms = self._railgate.short_ms if short else self._gate_long_ms
        point = OperatingPoint(gpu_railgate_delay_ms=wanted_ms,
                               gpu_railgate=True if short else None)
        started_cpu = time.process_time()
        result = self.board.apply(point)
        self._board_cpu_s += time.process_time() - started_cpu
        self._gate_changed_s = now_s
        read_back_ms = result.applied.gpu_railgate_delay_ms
        if result.ok and read_back_ms == wanted_ms:
            self._gate_short = short
            self._gate_warned = False
            log.info("GPU rail-gate delay %d ms (%s)", wanted_ms,
                     "gating between requests" if short else "the board's own")
            return
        if read_back_ms is not None:
            # Whatever the board holds now decides (a delay at the short one or under is short).
            self._gate_short = read_back_ms <= self._railgate.short_ms
        if any(item.startswith("railgate_delay:") for item in result.unsupported):
            # The board gave the control up (no file, no permission): for good, so stop asking.
            self._gate_degraded = True
        problems = [*(f"{m.path} wanted {m.wanted} found {m.found}" for m in result.mismatches),
                    *result.unsupported]
        # Warned once until a write takes again (a refusing file would otherwise be warned about
        # every hold).
        log.log(logging.DEBUG if self._gate_warned else logging.WARNING,
                "GPU rail-gate delay %d ms not in force (it reads %s)%s", wanted_ms,
                "nothing" if read_back_ms is None else f"{read_back_ms} ms",
                f": {'; '.join(problems)}" if problems else "")
        self._gate_warned = True

    def _set_state(self, state: PowerState, now_s: float) -> None:
        if state is self.state:
            return
        if state not in TRANSITIONS[self.state]:
            raise PowerError("a power state change outside the transition table",
                             state=self.state.value, wanted=state.value)
        log.debug("power state %s -> %s at %.3f", self.state.value, state.value, now_s)
        self.state = state

    # -- board I/O ---------------------------------------------------------------------------

    def _apply(self, key: PointKey, now_s: float, *, reason: str, railgate: bool | None = None,
               nvpmodel_mode: int | None = None) -> ApplyResult:
        point = point_for(key, railgate=railgate, nvpmodel_mode=nvpmodel_mode)
        started_cpu = time.process_time()
        result = self.board.apply(point)
        self._board_cpu_s += time.process_time() - started_cpu
        paths = tuple(sorted({m.path for m in result.mismatches}))
        if paths != self._mismatched:
            # Once per change of which limits do not stick (a broken file would otherwise be
            # warned about on every apply, several a second under traffic), and once when all
            # stick again.
            if paths:
                log.warning("applying %s (%s): %d limit(s) read back different: %s (said once "
                            "until it changes)", point.to_json(), reason, len(result.mismatches),
                            ", ".join(f"{m.path} wanted {m.wanted} found {m.found}"
                                      for m in result.mismatches))
            else:
                log.info("every limit reads back as applied again (%s)", reason)
            self._mismatched = paths
        self._point = point
        self._key = key
        self._applies.append((now_s, key))
        self.changes += 1
        return result

    def _key_of(self, completion: Completion) -> PointKey | None:
        """The clocks that were in force for the whole batch, or ``None`` if they changed."""
        start = completion.time_s - completion.compute_s
        in_force: PointKey | None = None
        for applied_s, key in self._applies:
            if applied_s <= start - SETTLE_S:
                in_force = key
            elif applied_s <= completion.time_s:
                return None
        if in_force is None and not self._applies:
            return None
        return in_force

    def _read_telemetry(self, now_s: float) -> None:
        self._last_telemetry_s = now_s
        started_cpu = time.process_time()
        try:
            telemetry = self.board.telemetry()
        except (OSError, PowerError) as exc:
            log.warning("power telemetry unreadable: %s", exc)
            return
        finally:
            self._board_cpu_s += time.process_time() - started_cpu
        self.telemetry = telemetry
        guard = self._guard
        if guard is not None:
            self._cap = guard.update(telemetry)
        governor = self._governor
        if governor is not None and self._key is not None and telemetry.total_power_mw:
            busy = telemetry.gpu_load if telemetry.gpu_load is not None else 0.0
            governor.observe_power(self._key, telemetry.total_power_mw, busy)

    def _note_wake_latency(self, completions: Sequence[Completion]) -> None:
        woke = self._woke_at_s
        if woke is None or not completions:
            return
        governor = self._require_governor()
        for completion in completions:
            if completion.time_s < woke:
                continue
            expected = governor.model.predict_s(self._woke_key or governor.top,
                                                completion.batch_size)
            extra = completion.total_s - (expected if expected is not None else 0.0)
            self.wake_ms.append(max(0.0, extra) * 1000.0)
            self._woke_at_s = None
            return

    # -- reporting ---------------------------------------------------------------------------

    def _decide(self, now_s: float, *, changed: bool, reason: str,
                predicted_s: float | None = None, applied: ApplyResult | None = None
                ) -> Decision:
        decision = Decision(time_s=now_s, state=self.state,
                            point=self._point if self._point is not None else OperatingPoint(),
                            changed=changed, reason=reason, predicted_s=predicted_s,
                            applied=applied)
        self.decisions.append(decision)
        return decision

    def status(self) -> dict[str, Any]:
        """What ``edge-agent power status`` and ``reported.power`` show (JSON-able)."""
        governor = self._governor
        telemetry = self.telemetry
        return {
            "profile": self.policy.profile,
            "state": self.state.value,
            "point": None if self._point is None else self._point.to_json(),
            "latency_target_ms": round(self.policy.latency_target_s * 1000, 3),
            "arrival_rate_hz": None if governor is None else round(governor.arrival_rate_hz, 3),
            "observed_p99_ms": None if governor is None or (
                p99 := governor.observed_p99_s(10.0, self._clock())) is None
            else round(p99 * 1000, 3),
            "misses": 0 if governor is None else governor.misses,
            "margin": None if governor is None else round(governor.margin(), 3),
            "thermal_cap": None if self._cap is None or self._cap.gpu_max_hz is None else {
                "gpu_max_hz": self._cap.gpu_max_hz, "cpu_max_khz": self._cap.cpu_max_khz},
            "power_mw": None if telemetry is None else telemetry.total_power_mw,
            "changes": self.changes,
            "steps": self.steps,
            "step_cpu_ms": cpu_figures_ms(self.step_cpu_s),
            "governor_cpu_ms": cpu_figures_ms(self.governor_cpu_s),
            "wake_ms": None if not self.wake_ms else round(self.wake_ms[-1], 3),
            "wake_call_ms": None if not self.wake_call_ms else round(self.wake_call_ms[-1], 3),
            "decisions": [decision.to_json() for decision in list(self.decisions)[-8:]],
        }

    def _require_governor(self) -> Governor:
        if self._governor is None:
            raise PowerError("the power controller is not started")
        return self._governor


def cpu_figures_ms(samples: Sequence[float]) -> dict[str, float] | None:
    """Mean and P99 of CPU seconds per step, in ms."""
    if not samples:
        return None
    ordered = sorted(samples)
    return {"mean": round(sum(ordered) / len(ordered) * 1000, 4),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 4)}


def check_policy(policy: PowerPolicy) -> None:
    """Refuse a policy the controller cannot run, naming the field."""
    if policy.profile not in PROFILES:
        raise PowerError("unknown power profile", key="power.profile", found=policy.profile,
                         expected=", ".join(PROFILES))
    if not 0 < policy.latency_target_s < 60:
        raise PowerError("the latency target must be between 0 and 60 s",
                         key="power.latency_target_s", found=policy.latency_target_s)
    if not 0.5 <= policy.percentile < 1:
        raise PowerError("the latency percentile must be in [0.5, 1)", key="power.percentile",
                         found=policy.percentile)
    if policy.max_changes_per_s <= 0:
        raise PowerError("max_changes_per_s must be positive", key="power.max_changes_per_s",
                         found=policy.max_changes_per_s)
    if policy.idle_after_s <= 0 or policy.sleep_after_s < 0:
        raise PowerError("idle_after_s must be positive and sleep_after_s not negative",
                         key="power.idle_after_s", found=policy.idle_after_s)


__all__ = ["PROFILES", "Controller", "MemoryStore", "SnapshotStore", "check_policy"]
