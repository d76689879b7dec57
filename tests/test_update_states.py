"""The updater's state machine as data (agent/update/states.py): states, transitions, edges and
deadlines. That the updater really takes each transition is in tests/test_updater.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from agent.errors import ConfigError, InternalError
from agent.update.states import (
    FORWARD,
    ON_CANCEL,
    ON_FAILURE,
    RESTING,
    TRANSITIONS,
    UpdatePolicy,
    UpdateState,
    check_transition,
)

S = UpdateState


def test_state_values_are_those_of_the_design() -> None:
    assert [state.value for state in UpdateState] == [
        "idle", "downloading", "verifying", "staged", "building-engine", "warming", "canary",
        "committed", "rolling-back", "failed"]


def test_every_state_has_an_entry_in_the_table() -> None:
    assert set(TRANSITIONS) == set(UpdateState)


def test_every_transition_in_the_table_is_allowed() -> None:
    for from_state, targets in TRANSITIONS.items():
        for to_state in targets:
            check_transition(from_state, to_state)


def test_every_transition_not_in_the_table_is_refused() -> None:
    refused = [(a, b) for a, b in itertools.product(UpdateState, UpdateState)
               if b not in TRANSITIONS[a]]
    assert (S.IDLE, S.COMMITTED) in refused and (S.FAILED, S.IDLE) in refused
    for from_state, to_state in refused:
        with pytest.raises(InternalError, match=f"{from_state.value} -> {to_state.value}"):
            check_transition(from_state, to_state)


def test_the_forward_path_follows_the_table_and_a_request_starts_it() -> None:
    assert FORWARD[0] is S.DOWNLOADING and FORWARD[-1] is S.COMMITTED
    for resting in RESTING:
        assert S.DOWNLOADING in TRANSITIONS[resting]
    for earlier, later in zip(FORWARD, FORWARD[1:]):
        assert later in TRANSITIONS[earlier]
    assert S.IDLE in TRANSITIONS[S.COMMITTED]  # the watch window passed


def test_failure_before_staged_fails_directly_and_from_staged_on_rolls_back() -> None:
    assert ON_FAILURE[S.DOWNLOADING] is S.FAILED and ON_FAILURE[S.VERIFYING] is S.FAILED
    for state in FORWARD[FORWARD.index(S.STAGED):]:
        assert ON_FAILURE[state] is S.ROLLING_BACK
    assert ON_FAILURE[S.ROLLING_BACK] is S.FAILED
    assert TRANSITIONS[S.ROLLING_BACK] == {S.FAILED, S.IDLE}
    for state, target in ON_FAILURE.items():
        assert target in TRANSITIONS[state]


def test_cancel_edges_follow_the_table_and_a_rollback_is_never_cancelled() -> None:
    assert set(ON_CANCEL) == set(FORWARD)  # every working state but rolling-back
    for state, target in ON_CANCEL.items():
        assert target in TRANSITIONS[state]
    assert ON_CANCEL[S.COMMITTED] is S.IDLE  # the committed version is kept
    assert ON_CANCEL[S.CANARY] is S.ROLLING_BACK


def test_every_working_state_has_a_deadline_and_resting_ones_none() -> None:
    policy = UpdatePolicy()
    for state in UpdateState:
        deadline_s = policy.deadline_s(state)
        assert (deadline_s is None) == (state in RESTING), state
    assert policy.deadline_s(S.DOWNLOADING) == 3600.0
    assert policy.deadline_s(S.VERIFYING) == 120.0
    assert policy.deadline_s(S.STAGED) == 60.0
    assert policy.deadline_s(S.BUILDING_ENGINE) == 1800.0
    assert policy.deadline_s(S.WARMING) == 300.0
    assert policy.deadline_s(S.CANARY) == 300.0
    assert policy.deadline_s(S.COMMITTED) == 600.0  # the watch window
    assert policy.deadline_s(S.ROLLING_BACK) == 120.0
    assert UpdatePolicy(warming_s=0.5).deadline_s(S.WARMING) == 0.5


def test_policy_is_frozen_and_keyword_only() -> None:
    policy = UpdatePolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.canary_s = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        UpdatePolicy(3600.0)  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value"), [
    ("downloading_s", 0), ("canary_s", -1.0), ("warming_s", float("inf")),
    ("rolling_back_s", float("nan")), ("staged_s", "60"), ("watch_window_s", True),
    ("max_failures", 0), ("max_failures", 2.5), ("history_limit", 0),
])
def test_policy_refuses_bad_values_naming_the_key(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        UpdatePolicy(**{field: value})  # type: ignore[arg-type]
    assert caught.value.fields["key"] == f"update.{field}"
