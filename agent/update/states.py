"""The updater's states, the transitions between them, and how long each state may last.

The forward path of an update (design section 6)::

    idle -> downloading -> verifying -> staged -> building-engine -> warming -> canary -> committed

``staged`` is the first state in which the candidate is on the device beside the version that
serves (installed in the store, not current), so it is the line between the two failure edges:

- before ``staged`` (downloading, verifying) a failure ends in ``failed`` directly: nothing was
  installed, the partial download is the download step's to clean;
- from ``staged`` on, a failure goes through ``rolling-back`` (the candidate is discarded, or, once
  committed, the previous version is made current again), then ``failed``.

``committed`` means the pointer names the new version. It lasts the watch window: the same health
signals as the canary keep being checked, and a regression rolls back to the previous version by
itself. When the window passes, the update is done and the updater is ``idle`` again. ``failed``
and ``idle`` are the resting states: nothing runs, a new request may start from either.

An operator rollback (``edge-agent update rollback``) from a resting state goes ``rolling-back ->
idle``; a rollback that is itself cut short by its deadline or an error ends in ``failed``.

Cancel by a newer request, state by state (the newest request wins, nothing queues):

=================  ==============================================================================
state              what a newer request (or an operator rollback) does to the update in it
=================  ==============================================================================
idle, failed       nothing runs: the new update starts at once
downloading        the download is cancelled, the update ends ``idle`` ("superseded")
verifying          the verification is cancelled, the update ends ``idle``
staged ... canary  the step is cancelled, then ``rolling-back`` discards the candidate (the old
                   version never stopped serving), then ``idle``
committed          the watch stops early and the committed version is kept (it serves, and
                   is what the newer update will roll back to); ``idle``. An operator rollback
                   instead reverts it: ``rolling-back`` to the previous version, then ``idle``
rolling-back       not interrupted: the rollback restores a known state and is bounded by its own
                   deadline; the newer update starts once it ends
=================  ==============================================================================

A transition not in :data:`TRANSITIONS` is a bug of the updater and raises
:class:`~agent.errors.InternalError` (:func:`check_transition`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from agent.errors import ConfigError, InternalError

__all__ = [
    "FORWARD",
    "ON_CANCEL",
    "ON_FAILURE",
    "RESTING",
    "TRANSITIONS",
    "UpdatePolicy",
    "UpdateState",
    "check_transition",
]


class UpdateState(enum.Enum):
    IDLE = "idle"  # nothing in progress; the last outcome says how the last update ended
    DOWNLOADING = "downloading"  # fetching the bundle from its source
    VERIFYING = "verifying"  # signature, hashes, target, agent version, anti-rollback
    STAGED = "staged"  # installing the candidate into the store beside the current version
    BUILDING_ENGINE = "building-engine"  # a TensorRT engine from model.onnx, unless one is cached
    WARMING = "warming"  # the candidate's instances load and run warm-up requests
    CANARY = "canary"  # the candidate shadows or answers a share of live traffic, then commits
    COMMITTED = "committed"  # the pointer names the candidate; the watch window runs
    ROLLING_BACK = "rolling-back"  # discarding the candidate, or making the previous one current
    FAILED = "failed"  # the last update failed; the version serving is the one before it


S = UpdateState

TRANSITIONS: dict[UpdateState, frozenset[UpdateState]] = {
    # A request starts a download; an operator rollback reverts the current version.
    S.IDLE: frozenset({S.DOWNLOADING, S.ROLLING_BACK}),
    # Failure, or cancelled by a newer request.
    S.DOWNLOADING: frozenset({S.VERIFYING, S.FAILED, S.IDLE}),
    # Idle also when the verified bundle is the version already serving.
    S.VERIFYING: frozenset({S.STAGED, S.FAILED, S.IDLE}),
    S.STAGED: frozenset({S.BUILDING_ENGINE, S.ROLLING_BACK}),
    S.BUILDING_ENGINE: frozenset({S.WARMING, S.ROLLING_BACK}),
    S.WARMING: frozenset({S.CANARY, S.ROLLING_BACK}),
    S.CANARY: frozenset({S.COMMITTED, S.ROLLING_BACK}),
    # Idle when the watch window passes (or a newer request cuts it short); rolling-back on a
    # regression or an operator rollback.
    S.COMMITTED: frozenset({S.IDLE, S.ROLLING_BACK}),
    S.ROLLING_BACK: frozenset({S.FAILED, S.IDLE}),
    S.FAILED: frozenset({S.DOWNLOADING, S.ROLLING_BACK}),
}

# The states of an update going well, in order.
FORWARD: tuple[UpdateState, ...] = (S.DOWNLOADING, S.VERIFYING, S.STAGED, S.BUILDING_ENGINE,
                                    S.WARMING, S.CANARY, S.COMMITTED)

# Where nothing runs and a request may start an update.
RESTING: frozenset[UpdateState] = frozenset({S.IDLE, S.FAILED})

# The failure edge of each state that does work.
ON_FAILURE: dict[UpdateState, UpdateState] = {
    S.DOWNLOADING: S.FAILED,
    S.VERIFYING: S.FAILED,
    S.STAGED: S.ROLLING_BACK,
    S.BUILDING_ENGINE: S.ROLLING_BACK,
    S.WARMING: S.ROLLING_BACK,
    S.CANARY: S.ROLLING_BACK,
    S.COMMITTED: S.ROLLING_BACK,
    S.ROLLING_BACK: S.FAILED,
}

# Where a newer request sends an update in each state (rolling-back is never interrupted).
ON_CANCEL: dict[UpdateState, UpdateState] = {
    S.DOWNLOADING: S.IDLE,
    S.VERIFYING: S.IDLE,
    S.STAGED: S.ROLLING_BACK,
    S.BUILDING_ENGINE: S.ROLLING_BACK,
    S.WARMING: S.ROLLING_BACK,
    S.CANARY: S.ROLLING_BACK,
    S.COMMITTED: S.IDLE,
}

del S


def check_transition(from_state: UpdateState, to_state: UpdateState) -> None:
    """Raise :class:`InternalError` unless ``from_state -> to_state`` is in :data:`TRANSITIONS`."""
    if to_state not in TRANSITIONS[from_state]:
        raise InternalError(
            f"illegal update transition {from_state.value} -> {to_state.value}; allowed from "
            f"{from_state.value}: {sorted(state.value for state in TRANSITIONS[from_state])}"
        )


@dataclass(frozen=True, kw_only=True)
class UpdatePolicy:
    """How long each state may last, and how many failures a bundle is allowed.

    A step still running at its state's deadline is cancelled and the update fails with reason
    ``deadline``, naming the state. The one exception is ``committed``: its deadline is the watch
    window, and reaching it without a regression is the watch passing.

    Args:
        downloading_s: The whole download, retries and resumes included.
        verifying_s: Signature, hashes and compatibility checks.
        staged_s: Installing the verified bundle into the store.
        building_engine_s: A TensorRT engine build (minutes on a board).
        warming_s: Loading the candidate's instances and running warm-up requests.
        canary_s: Shadowing or answering live traffic until a verdict, and the commit.
        watch_window_s: How long after commit the health signals are watched.
        rolling_back_s: Discarding the candidate or making the previous version current.
        max_failures: Failures of one bundle, from ``staged`` on, after which it is refused
            until a newer version is requested.
        cancel_grace_s: How long a cancelled step may take to end before it is abandoned.
        query_s: How long asking the steps which version serves may take.
        history_limit: Transitions kept in the journal (the oldest are dropped).
        resume_on_restart: Restart an update that a restart interrupted while downloading or
            verifying (a new attempt; the download may resume from its partial file).
    """

    downloading_s: float = 3600.0
    verifying_s: float = 120.0
    staged_s: float = 60.0
    building_engine_s: float = 1800.0
    warming_s: float = 300.0
    canary_s: float = 300.0
    watch_window_s: float = 600.0
    rolling_back_s: float = 120.0
    max_failures: int = 3
    cancel_grace_s: float = 5.0
    query_s: float = 10.0
    history_limit: int = 200
    resume_on_restart: bool = True

    def __post_init__(self) -> None:
        for name in ("downloading_s", "verifying_s", "staged_s", "building_engine_s", "warming_s",
                     "canary_s", "watch_window_s", "rolling_back_s", "cancel_grace_s",
                     "query_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ConfigError(f"invalid value for 'update.{name}'", key=f"update.{name}",
                                  expected="a finite number of seconds > 0", found=repr(value))
        for name in ("max_failures", "history_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"invalid value for 'update.{name}'", key=f"update.{name}",
                                  expected="an integer >= 1", found=repr(value))

    def deadline_s(self, state: UpdateState) -> float | None:
        """How long ``state`` may last, or None for the resting states (idle, failed)."""
        field = _DEADLINE_FIELDS.get(state)
        return None if field is None else float(getattr(self, field))


_DEADLINE_FIELDS: dict[UpdateState, str] = {
    UpdateState.DOWNLOADING: "downloading_s",
    UpdateState.VERIFYING: "verifying_s",
    UpdateState.STAGED: "staged_s",
    UpdateState.BUILDING_ENGINE: "building_engine_s",
    UpdateState.WARMING: "warming_s",
    UpdateState.CANARY: "canary_s",
    UpdateState.COMMITTED: "watch_window_s",
    UpdateState.ROLLING_BACK: "rolling_back_s",
}
