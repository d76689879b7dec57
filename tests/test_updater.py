"""The updater (agent/update/updater.py) with fake steps (tests/fakes/update_steps.py): the seam to
the serving path. Deadlines, cancel by a newer request in each state, the attempts budget,
operator rollbacks, recovery from each state, and a child process SIGKILLed at random instants."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.errors import InternalError, UpdateError
from agent.update.journal import BundleId, Journal, JournalDoc, Outcome, UpdateRecord
from agent.update.states import FORWARD, RESTING, TRANSITIONS, UpdatePolicy, UpdateState
from agent.update.updater import Updater, UpdateJob, UpdateRequest
from tests.fakes.update_steps import FakeSteps, bundle_of, source

S = UpdateState
REPO_ROOT = Path(__file__).resolve().parent.parent
FAST = {"watch_window_s": 0.02, "cancel_grace_s": 0.5}

# The step that does each state's work.
STEP_OF = {S.DOWNLOADING: "download", S.VERIFYING: "verify", S.STAGED: "stage",
           S.BUILDING_ENGINE: "build_engine", S.WARMING: "warm", S.CANARY: "canary",
           S.COMMITTED: "watch"}
DEADLINE_FIELD = {S.DOWNLOADING: "downloading_s", S.VERIFYING: "verifying_s",
                  S.STAGED: "staged_s", S.BUILDING_ENGINE: "building_engine_s",
                  S.WARMING: "warming_s", S.CANARY: "canary_s"}


def v(version: int) -> BundleId:
    return bundle_of(source("m", version))


def want(version: int, **facts: Any) -> UpdateRequest:
    return UpdateRequest(source=source("m", version), name="m", version=version, **facts)


def make(tmp_path: Path, steps: FakeSteps | None = None, *, serving: int | None = 1,
         **policy: Any) -> tuple[Updater, FakeSteps]:
    steps = steps or FakeSteps(tmp_path / "store")
    if serving is not None:
        steps.set_serving(v(serving))
    updater = Updater(state_dir=tmp_path, steps=steps, policy=UpdatePolicy(**{**FAST, **policy}))
    return updater, steps


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 10.0) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout_s))


def transitions(updater: Updater, update_id: str | None = None) -> list[tuple[S, S, str | None]]:
    """The journal's transitions on disk (notes left out), of one update when given."""
    return [(event.from_state, event.to_state, event.reason)
            for event in Journal(updater.journal.path.parent).load().doc.history
            if event.from_state is not event.to_state
            and (update_id is None or event.update_id == update_id)]


def pairs(updater: Updater, update_id: str | None = None) -> list[tuple[S, S]]:
    return [(a, b) for a, b, _ in transitions(updater, update_id)]


async def settle(updater: Updater) -> Outcome:
    outcome = await updater.wait()
    assert outcome is not None
    return outcome


# -- the forward path -------------------------------------------------------------------------

def test_an_update_goes_through_every_state_and_commits(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    events: list[dict[str, Any]] = []
    updater.add_listener(events.append)

    async def scenario() -> None:
        assert (await updater.recover()).action == "none"
        answer = await updater.request(want(2, request_id="r-2"))
        assert answer.result == "started" and answer.update_id == "r-2"
        outcome = await settle(updater)
        assert outcome.result == "committed" and outcome.bundle == v(2)

    run(scenario)
    assert steps.serving_now() == v(2) and steps.pointer()["previous"]["version"] == 1
    assert [name for name, _ in steps.calls] == list(STEP_OF.values())[:-1] + ["commit", "watch"]
    assert pairs(updater) == [(S.IDLE, S.DOWNLOADING), *zip(FORWARD, FORWARD[1:]),
                              (S.COMMITTED, S.IDLE)]
    assert [event["to"] for event in events if event["event"] == "state"] == [
        state.value for state in (*FORWARD, S.IDLE)]
    progress = [event for event in events if event["event"] == "progress"]
    assert progress[0] == {"event": "progress", "update_id": "r-2", "state": "downloading",
                           "received_bytes": 10, "total_bytes": 10}
    assert progress[1]["phase"] == "tactics" and progress[1]["state"] == "building-engine"
    assert events[-1]["event"] == "outcome" and events[-1]["result"] == "committed"
    status = updater.status()
    assert status["state"] == "idle" and status["update"] is None
    assert status["last_outcome"]["result"] == "committed"
    assert status["counters"]["swaps"] == 1 and status["counters"]["attempts"] == 1
    assert status["counters"]["canary_verdicts"] == {"healthy": 1, "unhealthy": 0}
    assert Journal(tmp_path).load().doc.update is None


def test_status_while_running_shows_state_deadline_progress_and_attempt(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, building_engine_s=30.0)
    steps.behaviour["build_engine"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await steps.event("build_engine").wait()
        status = updater.status()
        assert status["state"] == "building-engine"
        assert 29.0 < status["deadline_left_s"] <= 30.0
        assert status["attempt"] == 1 and status["update"]["bundle"]["version"] == 2
        assert status["history"][-1]["to"] == "building-engine"
        assert status["since"].endswith("Z")
        await updater.close()

    run(scenario)


def test_progress_reported_from_a_worker_thread_reaches_the_listeners(tmp_path: Path) -> None:
    class ThreadedBuild(FakeSteps):
        async def build_engine(self, job: UpdateJob) -> None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: job.progress(phase="layers", done=3))
            await asyncio.sleep(0.01)  # the report is handed to the loop, then delivered

    updater, _ = make(tmp_path, ThreadedBuild(tmp_path / "store"))
    seen: list[dict[str, Any]] = []
    updater.add_listener(lambda event: seen.append(event) if event["event"] == "progress"
                         else None)

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await settle(updater)

    run(scenario)
    assert {"event": "progress", "update_id": seen[-1]["update_id"], "state": "building-engine",
            "phase": "layers", "done": 3} in seen


def test_every_transition_of_the_table_is_taken(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, max_failures=10)
    seen: set[tuple[S, S]] = set()

    async def attempt(version: int, **behaviour: str) -> None:
        steps.behaviour = dict(behaviour)
        await updater.request(want(version))
        await settle(updater)

    async def scenario() -> None:
        await updater.recover()
        await attempt(2, download="fail")  # downloading -> failed
        await attempt(2, verify="fail")  # failed -> downloading, verifying -> failed
        await attempt(2, stage="fail")  # staged -> rolling-back -> failed
        await attempt(2, build_engine="fail")
        await attempt(2, warm="fail")
        await attempt(2, canary="unhealthy")
        await attempt(2, watch="unhealthy")  # committed -> rolling-back
        await attempt(2)  # v2 serves, v1 before it
        await attempt(3, download="fail")
        await updater.rollback()  # failed -> rolling-back -> idle
        await settle(updater)
        await attempt(2)  # idle -> ... -> committed -> idle
        await updater.rollback()  # idle -> rolling-back
        await settle(updater)
        steps.behaviour = {"download": "hang"}  # downloading -> idle (superseded)
        steps.started.clear()
        await updater.request(want(3))
        await steps.event("download").wait()
        steps.behaviour = {}
        await updater.request(UpdateRequest(source=source("m", 1)))  # verifying -> idle: serves
        await settle(updater)

    run(scenario)
    seen.update(pairs(updater))
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert seen <= table
    assert table - seen == set()


# -- deadlines --------------------------------------------------------------------------------

@pytest.mark.parametrize("state", list(DEADLINE_FIELD), ids=lambda state: state.value)
def test_a_step_past_its_deadline_is_cancelled_and_the_update_fails(tmp_path: Path,
                                                                    state: S) -> None:
    updater, steps = make(tmp_path, **{DEADLINE_FIELD[state]: 0.05})
    steps.behaviour[STEP_OF[state]] = "hang"

    async def scenario() -> None:
        await updater.recover()
        started = time.monotonic()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert time.monotonic() - started < 2.0
        assert (outcome.result, outcome.reason, outcome.state) == ("failed", "deadline", state)
        assert outcome.detail is not None and f"the {state.value} step" in outcome.detail

    run(scenario)
    assert STEP_OF[state] in steps.cancelled
    assert steps.serving_now() == v(1) and steps.installed() == {1} and not steps.downloads()
    ends = pairs(updater)[-2:]
    if state in (S.DOWNLOADING, S.VERIFYING):
        assert ends[-1] == (state, S.FAILED)
    else:
        assert ends == [(state, S.ROLLING_BACK), (S.ROLLING_BACK, S.FAILED)]
    assert updater.status()["counters"]["failures_by_reason"] == {"deadline": 1}


def test_the_deadline_is_for_the_whole_state_not_each_step(tmp_path: Path) -> None:
    # The canary state holds the canary and the commit: both together must fit its deadline.
    updater, steps = make(tmp_path, canary_s=0.15)
    steps.behaviour.update(canary="slow", commit="slow")
    steps.slow_s = 0.1

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.reason, outcome.state) == ("deadline", S.CANARY)

    run(scenario)
    assert "commit" in steps.cancelled and steps.serving_now() == v(1)


def test_a_rollback_past_its_deadline_ends_failed_saying_so(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, rolling_back_s=0.05)
    steps.behaviour.update(stage="fail", discard="hang")

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason, outcome.state) == (
            "failed", "rollback_failed", S.ROLLING_BACK)
        assert outcome.detail is not None and "deadline" in outcome.detail
        assert "injected" in outcome.detail  # what the rollback was for

    run(scenario)
    assert updater.state is S.FAILED and "discard" in steps.cancelled


def test_the_watch_window_passing_is_the_watch_succeeding(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, watch_window_s=0.06)  # the fake watch waits to be cancelled

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await steps.event("watch").wait()
        started = time.monotonic()
        outcome = await settle(updater)
        assert outcome.result == "committed" and time.monotonic() - started >= 0.04

    run(scenario)
    assert "watch" in steps.cancelled and steps.serving_now() == v(2)


def test_a_step_that_ignores_its_cancellation_is_abandoned(tmp_path: Path) -> None:
    class Stubborn(FakeSteps):
        async def warm(self, job: UpdateJob) -> None:
            for _ in range(10):  # swallows every cancellation, for about 0.2 s
                try:
                    await asyncio.sleep(0.02)
                except asyncio.CancelledError:
                    pass

    updater, steps = make(tmp_path, Stubborn(tmp_path / "store"), warming_s=0.05,
                          cancel_grace_s=0.05)

    async def scenario() -> None:
        await updater.recover()
        started = time.monotonic()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert outcome.reason == "deadline" and time.monotonic() - started < 0.3

    run(scenario)


# -- failures ---------------------------------------------------------------------------------

def test_an_unhealthy_canary_rolls_back_before_any_swap(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["canary"] = "unhealthy"

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason, outcome.state) == ("failed", "latency", S.CANARY)
        assert outcome.detail is not None and "p99 40 ms" in outcome.detail

    run(scenario)
    assert steps.called("commit") == 0 and steps.serving_now() == v(1)
    assert steps.installed() == {1}
    counters = updater.status()["counters"]
    assert counters["canary_verdicts"] == {"healthy": 0, "unhealthy": 1}
    assert counters["failures_by_reason"] == {"latency": 1} and counters["swaps"] == 0


def test_a_regression_in_the_watch_window_reverts_to_the_previous_version(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["watch"] = "unhealthy"

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason, outcome.state) == (
            "failed", "error_rate", S.COMMITTED)

    run(scenario)
    assert steps.called("revert") == 1 and steps.serving_now() == v(1)
    assert pairs(updater)[-3:] == [(S.CANARY, S.COMMITTED), (S.COMMITTED, S.ROLLING_BACK),
                                   (S.ROLLING_BACK, S.FAILED)]
    assert updater.status()["counters"]["rollbacks"] == 1


@pytest.mark.parametrize(("behaviour", "reason"), [("fail", "injected"),
                                                   ("raise", "internal_error")])
def test_a_step_error_fails_the_update_with_its_reason(tmp_path: Path, behaviour: str,
                                                       reason: str) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["warm"] = behaviour

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.reason, outcome.state) == (reason, S.WARMING)

    run(scenario)
    assert steps.serving_now() == v(1) and steps.installed() == {1}


def test_a_bundle_other_than_the_requested_one_fails_verification(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        await updater.request(UpdateRequest(source=source("m", 2), name="m", version=5))
        outcome = await settle(updater)
        assert (outcome.reason, outcome.state) == ("unexpected_bundle", S.VERIFYING)
        assert outcome.detail is not None and "version is 2" in outcome.detail

    run(scenario)
    assert steps.called("stage") == 0 and not steps.downloads()


# -- the newest request wins -------------------------------------------------------------------

@pytest.mark.parametrize("state", list(STEP_OF), ids=lambda state: state.value)
def test_a_newer_request_cancels_the_update_in_each_state(tmp_path: Path, state: S) -> None:
    updater, steps = make(tmp_path, watch_window_s=30.0)
    step = STEP_OF[state]
    if step != "watch":
        steps.behaviour[step] = "hang"
    ids: list[str | None] = []

    async def scenario() -> None:
        await updater.recover()
        ids.append((await updater.request(want(2))).update_id)
        await steps.event(step).wait()
        steps.behaviour.clear()
        steps.watch_s = 0.01  # from now on a watch passes quickly
        answer = await updater.request(want(3))
        assert answer.result == "started"
        ids.append(answer.update_id)
        outcome = await settle(updater)
        assert outcome.result == "committed" and outcome.bundle == v(3)

    run(scenario)
    assert step in steps.cancelled
    old = transitions(updater, ids[0])
    if state in (S.DOWNLOADING, S.VERIFYING):
        assert old[-1] == (state, S.IDLE, "superseded")
    elif state is S.COMMITTED:  # kept: it serves, and is what v3 would roll back to
        assert old[-1] == (S.COMMITTED, S.IDLE, "superseded")
        assert steps.pointer()["previous"]["version"] == 2
    else:
        assert old[-2:] == [(state, S.ROLLING_BACK, "superseded"),
                            (S.ROLLING_BACK, S.IDLE, "superseded")]
        assert 2 not in steps.installed()
    assert transitions(updater, ids[1])[0][:2] == (S.IDLE, S.DOWNLOADING)
    assert steps.serving_now() == v(3)


def test_a_newer_request_lets_a_rollback_finish_first(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour.update(stage="fail", discard="slow")
    steps.slow_s = 0.1
    ids: list[str | None] = []

    async def scenario() -> None:
        await updater.recover()
        ids.append((await updater.request(want(2))).update_id)
        await steps.event("discard").wait()
        assert updater.state is S.ROLLING_BACK
        answer = await updater.request(want(3))  # returns once the rollback ended
        assert answer.result == "started"
        ids.append(answer.update_id)
        steps.behaviour.clear()
        await settle(updater)

    run(scenario)
    assert "discard" not in steps.cancelled
    assert transitions(updater, ids[0])[-1] == (S.ROLLING_BACK, S.FAILED, "injected")
    assert pairs(updater, ids[1])[0] == (S.FAILED, S.DOWNLOADING)
    assert steps.serving_now() == v(3)


def test_of_concurrent_requests_only_the_newest_starts(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        answers = await asyncio.gather(*(updater.request(want(version)) for version in (2, 3, 4)))
        assert [answer.result for answer in answers] == ["superseded", "superseded", "started"]
        await settle(updater)

    run(scenario)
    assert [version for name, version in steps.calls if name == "download"] == [4]
    assert steps.serving_now() == v(4)


def test_a_request_for_the_version_serving_is_a_no_op(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        answer = await updater.request(want(1))
        assert answer.result == "already_current" and "m v1" in answer.detail
        answer = await updater.request(UpdateRequest(source="elsewhere", sha256=v(1).sha256))
        assert answer.result == "already_current"

    run(scenario)
    assert steps.calls == [] and not updater.journal.path.exists()


def test_a_request_for_the_version_serving_cancels_the_update_in_progress(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["warm"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        first = await updater.request(want(2))
        await steps.event("warm").wait()
        assert (await updater.request(want(1))).result == "already_current"
        assert updater.state is S.IDLE
        assert transitions(updater, first.update_id)[-1] == (S.ROLLING_BACK, S.IDLE,
                                                             "superseded")

    run(scenario)
    assert steps.serving_now() == v(1) and steps.installed() == {1}


def test_a_bundle_found_serving_by_verification_ends_idle(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        await updater.request(UpdateRequest(source=source("m", 1)))  # nothing known up front
        outcome = await settle(updater)
        assert (outcome.result, outcome.state) == ("already_current", S.VERIFYING)

    run(scenario)
    assert pairs(updater)[-1] == (S.VERIFYING, S.IDLE) and steps.called("stage") == 0


def test_a_duplicate_request_is_answered_in_progress(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["download"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        first = await updater.request(want(2))
        again = await updater.request(want(2, request_id="redelivered"))
        assert again.result == "in_progress" and again.update_id == first.update_id
        await updater.request(UpdateRequest(source="https://x/m.tar"))
        repeat = await updater.request(UpdateRequest(source="https://x/m.tar"))
        assert repeat.result == "in_progress"
        await asyncio.sleep(0.05)
        await updater.close()

    run(scenario)
    assert steps.called("download") == 2



def test_a_request_while_the_outcome_is_being_written_is_not_a_duplicate(tmp_path: Path) -> None:
    """The committed outcome is in the status before its journal write ends: a request for the
    same bundle then waits for that write and is answered as for a finished update (CI found a
    real daemon answering it in_progress with the state idle)."""
    updater, steps = make(tmp_path)
    release = threading.Event()
    writing = threading.Event()
    write = updater.journal.write_encoded

    def slow_final_write(text: str) -> None:
        if '"result": "committed"' in text.replace('":"', '": "'):
            writing.set()
            release.wait(5)
        write(text)

    updater.journal.write_encoded = slow_final_write  # type: ignore[method-assign]

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        while not writing.is_set():
            await asyncio.sleep(0.005)
        assert updater.status()["state"] == "idle"
        asyncio.get_running_loop().call_later(0.1, release.set)
        again = await updater.request(want(2))
        assert again.result == "already_current", again
        rolled = await updater.rollback()
        assert rolled.result == "rolling_back" and rolled.update_id != again.update_id
        await settle(updater)

    run(scenario)
    assert steps.serving_now() == v(1)


# -- the attempts budget ----------------------------------------------------------------------

def test_a_bundle_that_spent_its_budget_is_refused_until_a_newer_version(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, max_failures=2)
    steps.behaviour["warm"] = "fail"

    async def scenario() -> None:
        await updater.recover()
        for _ in range(2):
            await updater.request(want(2))
            assert (await settle(updater)).reason == "injected"
        downloads = steps.called("download")
        with pytest.raises(UpdateError) as caught:
            await updater.request(want(2))
        assert caught.value.reason == "attempts_exhausted"
        assert "failed 2 times" in str(caught.value) and "newer version" in str(caught.value)
        with pytest.raises(UpdateError, match="refused"):
            await updater.request(UpdateRequest(source="other", sha256=v(2).sha256))
        assert steps.called("download") == downloads
        [refused] = updater.status()["refused"]
        assert (refused["version"], refused["failures"], refused["last_reason"]) == (
            2, 2, "injected")

    run(scenario)

    again, steps = make(tmp_path, steps, max_failures=2)  # the refusal survives a restart

    async def after_restart() -> None:
        await again.recover()
        with pytest.raises(UpdateError):
            await again.request(want(2))
        # Known only once verified: refused there, which does not count as another failure.
        await again.request(UpdateRequest(source=source("m", 2)))
        outcome = await settle(again)
        assert (outcome.reason, outcome.state) == ("attempts_exhausted", S.VERIFYING)
        steps.behaviour.clear()
        await again.request(want(3))
        assert (await settle(again)).result == "committed"
        assert again.status()["refused"] == []

    run(after_restart)
    assert steps.serving_now() == v(3)
    assert list(Journal(tmp_path).load().doc.bundles) == [v(3).sha256]


def test_failures_before_staged_do_not_spend_the_budget(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, max_failures=1)
    steps.behaviour["download"] = "fail"

    async def scenario() -> None:
        await updater.recover()
        for _ in range(3):
            assert (await updater.request(want(2))).result == "started"
            assert (await settle(updater)).reason == "injected"
        assert updater.status()["refused"] == []

    run(scenario)


# -- operator rollback ------------------------------------------------------------------------

def test_an_operator_rollback_reverts_the_version_serving(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await settle(updater)
        answer = await updater.rollback()
        assert answer.result == "rolling_back"
        outcome = await settle(updater)
        assert (outcome.result, outcome.kind, outcome.bundle) == ("rolled_back", "rollback", v(2))

    run(scenario)
    assert steps.serving_now() == v(1)
    assert pairs(updater)[-2:] == [(S.IDLE, S.ROLLING_BACK), (S.ROLLING_BACK, S.IDLE)]


def test_an_operator_rollback_during_an_update_cancels_it(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["canary"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await steps.event("canary").wait()
        answer = await updater.rollback()
        assert answer.result == "rolling_back"
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason) == ("cancelled", "operator_rollback")

    run(scenario)
    assert steps.serving_now() == v(1) and steps.installed() == {1}
    assert steps.called("revert") == 0


def test_an_operator_rollback_in_the_watch_window_reverts_the_commit(tmp_path: Path) -> None:
    updater, steps = make(tmp_path, watch_window_s=30.0)

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await steps.event("watch").wait()
        await updater.rollback()
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason, outcome.state) == (
            "rolled_back", "operator_rollback", S.COMMITTED)

    run(scenario)
    assert steps.serving_now() == v(1) and updater.state is S.IDLE


def test_a_rollback_with_nothing_serving_or_no_previous_version_says_why(tmp_path: Path) -> None:
    """Both refused up front, the updater left as it was: a rollback with no version before
    the one serving used to run and end failed/rollback_failed, a failure counted for a
    request that had nothing to do."""
    updater, steps = make(tmp_path, serving=None)

    async def scenario() -> None:
        await updater.recover()
        with pytest.raises(UpdateError) as caught:
            await updater.rollback()
        assert caught.value.reason == "nothing_to_roll_back"
        steps.set_serving(v(1))  # serving, but nothing before it
        with pytest.raises(UpdateError) as caught:
            await updater.rollback()
        assert caught.value.reason == "nothing_to_roll_back"
        assert "serving" in caught.value.fields

    run(scenario)
    assert updater.state is S.IDLE and steps.serving_now() == v(1)
    assert "revert" not in [name for name, _ in steps.calls]


# -- recovery at start ------------------------------------------------------------------------

def left_in(tmp_path: Path, state: S, *, committed: bool = False, kind: str = "update",
            pending: str | None = None) -> None:
    """A journal as a process that died in ``state`` (updating v1 to v2) leaves it."""
    record = UpdateRecord(update_id="u-2", kind=kind, source=source("m", 2) if kind == "update"
                          else "", expected=BundleId(name="m", version=2) if kind == "update"
                          else BundleId(), bundle=None if state in (S.DOWNLOADING, S.VERIFYING)
                          else v(2), attempt=1, requested_at="2024-05-01T12:00:00.000Z",
                          committed=committed)
    outcome = None if pending is None else Outcome(
        update_id="u-2", kind=kind, result=pending, reason="latency", state=S.CANARY,
        detail="the canary judged it unhealthy", at="2024-05-01T12:00:00.000Z", bundle=v(2))
    Journal(tmp_path).write(JournalDoc(state=state, update=record, pending=outcome))


RECOVERIES = [
    # state, committed, kind, pending, serving (version, previous), action, final, result
    (S.DOWNLOADING, False, "update", None, (1, None), "resumed", S.IDLE, "committed"),
    (S.VERIFYING, False, "update", None, (1, None), "resumed", S.IDLE, "committed"),
    (S.STAGED, False, "update", None, (1, None), "discarded", S.FAILED, "failed"),
    (S.BUILDING_ENGINE, False, "update", None, (1, None), "discarded", S.FAILED, "failed"),
    (S.WARMING, False, "update", None, (1, None), "discarded", S.FAILED, "failed"),
    (S.CANARY, False, "update", None, (1, None), "discarded", S.FAILED, "failed"),
    (S.CANARY, False, "update", None, (2, 1), "commit_found", S.IDLE, "committed"),
    (S.COMMITTED, True, "update", None, (2, 1), "watch_restarted", S.IDLE, "committed"),
    (S.COMMITTED, True, "update", None, (1, None), "not_serving", S.FAILED, "failed"),
    (S.ROLLING_BACK, True, "update", "failed", (2, 1), "rollback_finished", S.FAILED, "failed"),
    (S.ROLLING_BACK, True, "update", "failed", (1, None), "rollback_finished", S.FAILED,
     "failed"),
    (S.ROLLING_BACK, False, "update", "cancelled", (1, None), "rollback_finished", S.IDLE,
     "cancelled"),
    (S.ROLLING_BACK, True, "rollback", "rolled_back", (2, 1), "rollback_finished", S.IDLE,
     "rolled_back"),
]


@pytest.mark.parametrize(("state", "committed", "kind", "pending", "serving", "action", "final",
                          "result"), RECOVERIES,
                         ids=[f"{case[0].value}-{case[5]}-v{case[4][0]}" for case in RECOVERIES])
def test_recover_settles_an_update_left_in_each_state(
        tmp_path: Path, state: S, committed: bool, kind: str, pending: str | None,
        serving: tuple[int, int | None], action: str, final: S, result: str) -> None:
    left_in(tmp_path, state, committed=committed, kind=kind, pending=pending)
    updater, steps = make(tmp_path, serving=None)
    steps.set_serving(v(serving[0]), None if serving[1] is None else v(serving[1]))
    if state is not S.DOWNLOADING:
        (steps.root / "installed" / "2").write_text("")  # staged (or committed) before the crash

    async def scenario() -> None:
        report = await updater.recover()
        assert (report.found, report.action, report.update_id) == (state, action, "u-2")
        outcome = await settle(updater)
        assert outcome.result == result
        assert updater.state is final

    run(scenario)
    expected_serving = 2 if result == "committed" else 1
    assert steps.serving_now() == v(expected_serving)
    if expected_serving == 1 and kind == "update":
        assert 2 not in steps.installed()
    history = Journal(tmp_path).load().doc.history
    assert any(event.reason in ("interrupted_by_restart", "commit_found_at_restart",
                                "watch_restarted", "not_serving_at_restart")
               for event in history), history
    assert updater.status()["recovery"]["action"] == action


def test_recover_from_a_crash_after_staged_counts_against_the_budget(tmp_path: Path) -> None:
    left_in(tmp_path, S.WARMING)
    updater, steps = make(tmp_path, max_failures=1)

    async def scenario() -> None:
        await updater.recover()
        outcome = await settle(updater)
        assert (outcome.reason, outcome.state) == ("interrupted_by_restart", S.WARMING)
        with pytest.raises(UpdateError, match="refused"):
            await updater.request(want(2))

    run(scenario)


def test_recover_does_not_resume_when_told_not_to(tmp_path: Path) -> None:
    left_in(tmp_path, S.DOWNLOADING)
    updater, steps = make(tmp_path, resume_on_restart=False)
    (steps.root / "downloads" / "u-2").write_text("partial")

    async def scenario() -> None:
        report = await updater.recover()
        assert report.action == "abandoned" and updater.state is S.IDLE
        outcome = await updater.wait()
        assert outcome is not None and outcome.result == "interrupted"

    run(scenario)
    assert not steps.downloads() and steps.called("download") == 0


def test_a_resumed_update_is_its_next_attempt(tmp_path: Path) -> None:
    left_in(tmp_path, S.DOWNLOADING)
    updater, steps = make(tmp_path)
    steps.behaviour["download"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        await steps.event("download").wait()
        assert updater.status()["attempt"] == 2 and updater.status()["update"]["id"] == "u-2"
        await updater.close()

    run(scenario)


def test_a_daemon_stop_leaves_the_update_for_the_next_start(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    steps.behaviour["warm"] = "hang"

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        await steps.event("warm").wait()
        await updater.close()
        assert updater.state is S.WARMING

    run(scenario)
    assert Journal(tmp_path).load().doc.state is S.WARMING
    again, steps = make(tmp_path, steps)
    steps.behaviour.clear()

    async def restart() -> None:
        assert (await again.recover()).action == "discarded"

    run(restart)
    assert steps.serving_now() == v(1) and steps.installed() == {1}


# -- the API's edges --------------------------------------------------------------------------

def test_a_request_before_recovery_is_told_to_retry_and_a_second_recover_is_a_bug(
        tmp_path: Path) -> None:
    updater, _ = make(tmp_path)

    async def scenario() -> None:
        for call in (updater.request(want(2)), updater.rollback()):
            with pytest.raises(UpdateError) as caught:
                await call
            assert caught.value.reason == "not_ready"
        await updater.recover()
        with pytest.raises(InternalError):
            await updater.recover()

    run(scenario)


@pytest.mark.parametrize(("field", "value"), [("source", ""), ("version", 0), ("version", True),
                                              ("sha256", "AB" * 32), ("sha256", "00"),
                                              ("name", "")])
def test_a_malformed_request_is_refused_naming_the_field(field: str, value: object) -> None:
    facts: dict[str, Any] = {"source": "fake://m/2", field: value}
    with pytest.raises(UpdateError) as caught:
        UpdateRequest(**facts)
    assert caught.value.reason == "invalid_request" and caught.value.fields["key"] == field


def test_a_journal_that_cannot_be_written_fails_the_update_before_any_work(
        tmp_path: Path) -> None:
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        await updater.recover()
        updater.journal.path.mkdir()  # a rename over a directory fails
        await updater.request(want(2))
        outcome = await settle(updater)
        assert (outcome.result, outcome.reason) == ("failed", "journal_unwritable")

    run(scenario)
    assert steps.called("download") == 0 and steps.serving_now() == v(1)


def test_run_recovers_serves_and_closes_when_cancelled(tmp_path: Path) -> None:
    left_in(tmp_path, S.STAGED)
    updater, steps = make(tmp_path)

    async def scenario() -> None:
        task = asyncio.ensure_future(updater.run())
        await asyncio.sleep(0.1)
        assert updater.status()["recovery"]["action"] == "discarded"
        steps.behaviour["warm"] = "hang"
        await updater.request(want(3))
        await steps.event("warm").wait()
        task.cancel()
        await asyncio.wait({task})
        assert "warm" in steps.cancelled and updater.state is S.WARMING

    run(scenario)


def test_a_listener_that_raises_does_not_stop_the_update(tmp_path: Path) -> None:
    updater, steps = make(tmp_path)
    seen: list[str] = []

    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    updater.add_listener(broken)
    updater.add_listener(lambda event: seen.append(event["event"]))

    async def scenario() -> None:
        await updater.recover()
        await updater.request(want(2))
        assert (await settle(updater)).result == "committed"

    run(scenario)
    assert seen.count("outcome") == 1 and "state" in seen


# -- a real crash, many times -----------------------------------------------------------------

CHILD = """
import asyncio, random, sys
from pathlib import Path
from agent.update.states import UpdatePolicy
from agent.update.updater import Updater, UpdateRequest
from tests.fakes.update_steps import FakeSteps, source

state_dir, seed, first = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
chance = random.Random(seed)
MISBEHAVIOURS = [("download", "fail"), ("stage", "fail"), ("build_engine", "raise"),
                 ("warm", "fail"), ("canary", "unhealthy"), ("watch", "unhealthy")]

async def main():
    steps = FakeSteps(state_dir / "store", delay_s=0.006, jitter=True, seed=seed)
    updater = Updater(state_dir=state_dir, steps=steps,
                      policy=UpdatePolicy(watch_window_s=0.02, max_failures=1000))
    await updater.recover()
    print("ready", flush=True)
    for version in range(first, first + 1000):
        steps.behaviour = dict([chance.choice(MISBEHAVIOURS)]) if chance.random() < 0.3 else {}
        await updater.request(UpdateRequest(source=source("m", version), name="m",
                                            version=version))
        if chance.random() < 0.2:  # cut it short: a newer request, or an operator rollback
            await asyncio.sleep(chance.random() * 0.04)
            if chance.random() < 0.5:
                await updater.rollback()
            else:
                continue
        await updater.wait()

asyncio.run(main())
"""


# What recovery may decide, by the state the kill left the journal in (no resuming here).
DECISIONS = {S.IDLE: {"none"}, S.FAILED: {"none"}, S.DOWNLOADING: {"abandoned"},
             S.VERIFYING: {"abandoned"}, S.STAGED: {"discarded"},
             S.BUILDING_ENGINE: {"discarded"}, S.WARMING: {"discarded"},
             S.CANARY: {"discarded", "commit_found"},
             S.COMMITTED: {"watch_restarted", "not_serving"},
             S.ROLLING_BACK: {"rollback_finished"}}


def check_consistent(updater: Updater, steps: FakeSteps) -> None:
    """What the journal says happened agrees with what the fake store serves."""
    assert updater.state in RESTING
    serving = steps.serving_now()
    assert serving is not None and serving.version in steps.installed()
    doc = Journal(updater.journal.path.parent).load().doc
    assert doc.state is updater.state and (doc.update is None) == (doc.state is S.IDLE)
    outcome = doc.last_outcome
    if outcome is not None and outcome.bundle is not None:
        if outcome.result == "committed":
            assert outcome.bundle.matches(serving), (outcome, serving)
        elif outcome.kind == "update" and outcome.result != "already_current":
            assert not outcome.bundle.matches(serving), (outcome, serving)
    history = doc.history
    for earlier, later in zip(history, history[1:]):
        assert later.from_state is earlier.to_state, (earlier, later)
        assert later.from_state is later.to_state or later.to_state in TRANSITIONS[
            later.from_state]


def test_sigkill_at_random_instants_always_recovers_to_a_consistent_state(tmp_path: Path) -> None:
    chance = random.Random(16)
    steps = FakeSteps(tmp_path / "store")
    steps.set_serving(v(1))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    found: list[S] = []
    kills = 30
    next_version = 2
    for round_index in range(kills):
        child = subprocess.Popen([sys.executable, "-S", "-c", CHILD, str(tmp_path),
                                  str(round_index), str(next_version)],
                                 stdout=subprocess.PIPE, env=env)
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(chance.random() * 0.12)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        next_version += 1000  # each child asks for versions newer than any before
        loaded = Journal(tmp_path).load()
        assert loaded.problem is None, loaded.problem
        found.append(loaded.doc.state)
        updater = Updater(state_dir=tmp_path, steps=steps, policy=UpdatePolicy(
            watch_window_s=0.01, max_failures=1000, resume_on_restart=False))

        async def recover(updater: Updater = updater, found: S = loaded.doc.state) -> None:
            report = await updater.recover()
            assert report.action in DECISIONS[found], (found, report)
            await updater.wait()
            check_consistent(updater, steps)

        run(recover)
    # The kills landed in working states, not only between updates.
    assert len(set(found) - RESTING) >= 3, found
