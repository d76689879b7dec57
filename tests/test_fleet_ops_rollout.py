"""The rollout state machine (agent/fleet/ops/rollout.py) on recorded device documents: stage
planning, the per-stage abort rule in AWS IoT Jobs' terms, the stage timeout, the rollback of
every reached device, desired versions, and the signed rollout document and its JSON Schema."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.errors import ConfigError, DocumentError, FleetError
from agent.fleet.documents import (
    Applied,
    Desired,
    DesiredStatus,
    ErrorInfo,
    ModelSpec,
    Reported,
    Response,
    UpdaterStatus,
    open_envelope,
    sign,
)
from agent.fleet.ops.rollout import (
    DeviceView,
    Policy,
    PublishDesired,
    Rollout,
    SendCommand,
    advance,
    begin_rollback,
    changes,
    new_rollout,
    open_rollout,
    plan_stages,
    sign_rollout,
    snapshot,
)
from models.signing import generate_private_key

T0 = datetime.datetime(2025, 3, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
OLD = ModelSpec(name="det", version=1, url="https://files.example/det/1/det-1.bundle",
                sha256="a" * 64)
NEW = ModelSpec(name="det", version=2, url="https://files.example/det/2/det-2.bundle",
                sha256="b" * 64)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


class Fleet:
    """Recorded documents of a few devices: each starts on OLD with a desired document of
    version 4 naming it, and answers what the test says."""

    def __init__(self, devices: Sequence[str], *, online: Sequence[str] | None = None) -> None:
        self.views: dict[str, DeviceView] = {}
        self.sequence = 0
        for device in devices:
            self.views[device] = DeviceView(
                desired=Desired(fleet="plant", device=device, version=4, issued_at=T0,
                                model=OLD, rollout=None),
                desired_floor=4, reported=self._reported(device, 4, "converged", OLD),
                online=online is None or device in online)

    def _reported(self, device: str, version: int, status: str, applied: ModelSpec | None,
                  reason: str | None = None) -> Reported:
        self.sequence += 1
        return Reported(fleet="plant", device=device, sequence=self.sequence, reported_at=T0,
                        agent_version="0.1.0", updater=UpdaterStatus(state="idle"),
                        applied=None if applied is None else Applied(name=applied.name,
                                                                     version=applied.version),
                        desired=DesiredStatus(version=version, status=status, reason=reason))

    def answer(self, device: str, status: str, applied: ModelSpec | None = None,
               reason: str | None = None, version: int | None = None) -> None:
        """The device reports the newest desired version it was given with ``status``."""
        view = self.views[device]
        version = version if version is not None else view.desired_floor
        reported = self._reported(device, version, status, applied, reason)
        self.views[device] = DeviceView(desired=view.desired, desired_floor=view.desired_floor,
                                        reported=reported, online=view.online,
                                        responses=view.responses)

    def take(self, actions: Sequence[object]) -> list[str]:
        """What the broker holds after the actions were published; the devices they went to."""
        reached = []
        for action in actions:
            if isinstance(action, PublishDesired):
                document = action.document
                view = self.views.get(document.device, DeviceView())
                self.views[document.device] = DeviceView(
                    desired=document, desired_floor=document.version, reported=view.reported,
                    online=view.online, responses=view.responses)
                reached.append(document.device)
        return reached


def rollout_of(devices: Sequence[str], fleet: Fleet, **policy: object) -> Rollout:
    return new_rollout(fleet="plant", rollout_id="det-v2-test", model=NEW, devices=devices,
                       policy=Policy(**policy), now=T0, views=fleet.views)  # type: ignore[arg-type]


# -- planning --------------------------------------------------------------------------------

@pytest.mark.parametrize(("stages", "count", "sizes"), [
    (["3", "10%", "50%", "100%"], 300, [3, 30, 150, 300]),
    (["3", "10%", "50%", "100%"], 5, [3, 5]),  # 10% of 5 adds nobody after 3: dropped
    (["1", "10%"], 40, [1, 4, 40]),  # stops short: the rest make a last stage
    (["100%"], 7, [7]),
    (["50"], 7, [7]),
    (["1%"], 3, [1, 3]),
])
def test_stages_are_cumulative_and_cover_every_device(stages: list[str], count: int,
                                                      sizes: list[int]) -> None:
    assert plan_stages(stages, count) == sizes


@pytest.mark.parametrize("bad", [[], ["0"], ["0%"], ["101%"], ["ten"], ["-3"]])
def test_bad_stages_are_refused(bad: list[str]) -> None:
    with pytest.raises(ConfigError):
        Policy(stages=tuple(bad))


def test_policy_bounds() -> None:
    for bad in ({"abort_failure_share": 1.0}, {"abort_failure_share": -0.1},
                {"abort_min_finished": 0}, {"stage_timeout_s": 0},
                {"rollback_timeout_s": float("inf")}):
        with pytest.raises(ConfigError):
            Policy(**bad)  # type: ignore[arg-type]


def test_online_devices_go_first_and_each_device_is_in_one_stage() -> None:
    devices = [f"cam-{index}" for index in range(10)]
    fleet = Fleet(devices, online=["cam-7", "cam-8", "cam-9"])
    rollout = rollout_of(devices, fleet, stages=("3", "50%", "100%"))
    assert rollout.stages[0].devices == ("cam-7", "cam-8", "cam-9")
    assert [len(stage.devices) for stage in rollout.stages] == [3, 2, 5]
    assert sorted(d for stage in rollout.stages for d in stage.devices) == sorted(devices)
    with pytest.raises(ConfigError):
        rollout_of([], fleet)
    with pytest.raises(ConfigError):
        rollout_of(["cam-1", "cam-1"], fleet)


# -- the happy path --------------------------------------------------------------------------

def test_a_rollout_goes_stage_by_stage_and_completes() -> None:
    devices = ["a", "b", "c", "d", "e"]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("1", "100%"))
    actions = advance(rollout, fleet.views, at(0))
    assert fleet.take(actions) == ["a"]  # the canary only
    document = actions[0].document  # type: ignore[union-attr]
    assert (document.version, document.model, document.allow_downgrade, document.rollout) == (
        5, NEW, False, "det-v2-test")
    assert rollout.devices["a"].previous == OLD
    assert advance(rollout, fleet.views, at(1)) == []  # nothing to do until it answers
    fleet.answer("a", "applying")
    advance(rollout, fleet.views, at(2))
    assert rollout.devices["a"].status == "applying"
    fleet.answer("a", "converged", NEW)
    actions = advance(rollout, fleet.views, at(3))
    assert rollout.stages[0].result == "passed" and rollout.stage == 1
    assert sorted(fleet.take(actions)) == ["b", "c", "d", "e"]
    for device in "bcde":
        fleet.answer(device, "converged", NEW)
    advance(rollout, fleet.views, at(4))
    assert rollout.state == "completed"
    assert rollout.counts()["succeeded"] == 5
    assert advance(rollout, fleet.views, at(5)) == []  # final: nothing more


def test_the_next_desired_version_is_above_any_the_device_may_have_taken() -> None:
    fleet = Fleet(["a", "b", "c"])
    # a: the broker lost its desired document (restart without persistence), the device has 9;
    # b: a retained document not signed by our key claims 12; c: never seen.
    fleet.views["a"] = DeviceView(reported=fleet._reported("a", 9, "converged", OLD))
    fleet.views["b"] = DeviceView(desired_floor=12,
                                  reported=fleet._reported("b", 4, "converged", OLD))
    fleet.views["c"] = DeviceView()
    rollout = rollout_of(["a", "b", "c"], fleet)
    versions = {action.document.device: action.document.version  # type: ignore[union-attr]
                for action in advance(rollout, fleet.views, at(0))}
    assert versions == {"a": 10, "b": 13, "c": 1}
    # a's earlier model is not in its (lost) desired document and nothing resolves it.
    assert rollout.devices["a"].previous is None
    assert rollout.devices["c"].previous is None


def test_power_and_settings_of_the_devices_desired_document_are_kept() -> None:
    fleet = Fleet(["a"])
    fleet.views["a"] = DeviceView(
        desired=Desired(fleet="plant", device="a", version=4, issued_at=T0, model=OLD,
                        power={"profile": "eco"}, settings={"threshold": 0.5}),
        desired_floor=4, reported=fleet._reported("a", 4, "converged", OLD))
    rollout = rollout_of(["a"], fleet)
    document = advance(rollout, fleet.views, at(0))[0].document  # type: ignore[union-attr]
    assert document.power == {"profile": "eco"} and document.settings == {"threshold": 0.5}


# -- abort rules -----------------------------------------------------------------------------

def test_a_failing_canary_aborts_and_every_reached_device_is_rolled_back() -> None:
    devices = [f"cam-{index}" for index in range(10)]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("3", "100%"), abort_failure_share=0.2,
                         abort_min_finished=3)
    canaries = fleet.take(advance(rollout, fleet.views, at(0)))
    assert canaries == ["cam-0", "cam-1", "cam-2"]
    fleet.answer("cam-0", "failed", OLD, reason="canary_disagreement")
    advance(rollout, fleet.views, at(1))
    assert rollout.state == "running"  # 1 finished: below the minimum of 3
    fleet.answer("cam-1", "converged", NEW)
    advance(rollout, fleet.views, at(2))
    assert rollout.state == "running"
    fleet.answer("cam-2", "converged", NEW)
    actions = advance(rollout, fleet.views, at(3))
    assert rollout.state == "rolling_back" and rollout.stages[0].result == "aborted"
    assert rollout.abort is not None and rollout.abort.cause == "failure_share"
    assert (rollout.abort.finished, rollout.abort.failed) == (3, 1)
    assert "canary_disagreement" in rollout.abort.message
    # All three canaries go back, the ones that took the bad version and the one that refused
    # it; nobody else is touched.
    documents = [action.document for action in actions if isinstance(action, PublishDesired)]
    assert sorted(document.device for document in documents) == canaries
    for document in documents:
        assert (document.version, document.model, document.allow_downgrade) == (6, OLD, True)
    assert all(rollout.devices[device].status == "pending" for device in devices[3:])
    fleet.take(actions)
    for device in canaries[:2]:
        fleet.answer(device, "converged", OLD)
    advance(rollout, fleet.views, at(4))
    assert rollout.state == "rolling_back"
    fleet.answer("cam-2", "converged", OLD)
    advance(rollout, fleet.views, at(5))
    assert rollout.state == "aborted"
    backs = [rollout.devices[device].rollback for device in canaries]
    assert [back.status for back in backs if back is not None] == ["done"] * 3
    assert changes(None, rollout)[0] == "rollout det-v2-test aborted: 3 of 3 devices back"


def test_the_failure_share_must_be_above_the_threshold() -> None:
    devices = ["a", "b", "c", "d", "e"]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("100%",), abort_failure_share=0.2,
                         abort_min_finished=5)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "refused", None, reason="wrong_target")
    for device in "bcde":
        fleet.answer(device, "converged", NEW)
    advance(rollout, fleet.views, at(1))
    assert rollout.state == "completed"  # 1 of 5 is 20%: not above 20%
    assert rollout.devices["a"].status == "failed"
    assert rollout.devices["a"].reason == "wrong_target"


def test_a_large_stage_aborts_as_soon_as_the_minimum_finished() -> None:
    devices = [f"cam-{index:02d}" for index in range(20)]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("100%",), abort_failure_share=0.5,
                         abort_min_finished=3)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("cam-00", "failed", OLD, reason="nan_outputs")
    fleet.answer("cam-01", "failed", OLD, reason="nan_outputs")
    advance(rollout, fleet.views, at(1))
    assert rollout.state == "running"  # 2 finished, both failed: below the minimum
    fleet.answer("cam-02", "converged", NEW)
    actions = advance(rollout, fleet.views, at(2))
    assert rollout.state == "rolling_back"  # 2 of 3: above 50%, 17 devices still open
    assert len(actions) == 20  # every device of the stage had been given the new version


def test_a_canary_smaller_than_the_minimum_is_still_judged() -> None:
    fleet = Fleet(["a", "b", "c"])
    rollout = rollout_of(["a", "b", "c"], fleet, stages=("1", "100%"), abort_min_finished=3)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "failed", OLD)
    advance(rollout, fleet.views, at(1))
    assert rollout.state == "rolling_back" and rollout.reached() == ["a"]


def test_stragglers_time_out_as_failures_without_stalling_the_stage() -> None:
    devices = ["a", "b", "c", "d"]
    fleet = Fleet(devices, online=["a", "b", "c"])
    rollout = rollout_of(devices, fleet, stages=("3", "100%"), abort_failure_share=0.5,
                         abort_min_finished=3, stage_timeout_s=60)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "converged", NEW)
    fleet.answer("b", "converged", NEW)
    fleet.answer("c", "applying")
    advance(rollout, fleet.views, at(59))
    assert rollout.stage == 0 and rollout.devices["c"].status == "applying"
    actions = advance(rollout, fleet.views, at(60))
    assert rollout.devices["c"].status == "timed_out"
    assert rollout.stages[0].result == "passed"  # 1 of 3 is not above 50%
    assert fleet.take(actions) == ["d"]
    # The straggler finishing later is recorded; the stage's verdict stands.
    fleet.answer("c", "converged", NEW)
    advance(rollout, fleet.views, at(61))
    assert rollout.devices["c"].status == "succeeded"
    # d is offline past the timeout: a stage of one device timed out is a failure share of 1.
    advance(rollout, fleet.views, at(121))
    assert rollout.devices["d"].status == "timed_out" and rollout.state == "rolling_back"


def test_a_device_given_a_newer_desired_by_someone_else_is_superseded() -> None:
    fleet = Fleet(["a", "b"])
    rollout = rollout_of(["a", "b"], fleet, abort_min_finished=1, abort_failure_share=0)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "converged", OLD, version=9)
    fleet.answer("b", "converged", NEW)
    advance(rollout, fleet.views, at(1))
    assert rollout.devices["a"].status == "superseded"
    assert rollout.state == "completed"


def test_a_device_that_converges_on_another_model_failed() -> None:
    fleet = Fleet(["a"])
    rollout = rollout_of(["a"], fleet, abort_min_finished=1)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "converged", OLD)
    advance(rollout, fleet.views, at(1))
    assert rollout.devices["a"].status == "failed"
    assert rollout.devices["a"].reason == "converged on det 1"


# -- rollback ----------------------------------------------------------------------------------

def test_rollback_times_out_for_devices_that_stay_away() -> None:
    fleet = Fleet(["a", "b"])
    rollout = rollout_of(["a", "b"], fleet, abort_min_finished=1, rollback_timeout_s=30)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "failed", OLD)
    fleet.take(advance(rollout, fleet.views, at(1)))
    fleet.answer("a", "converged", OLD)  # b never answers
    advance(rollout, fleet.views, at(30))
    assert rollout.state == "rolling_back"
    advance(rollout, fleet.views, at(31))
    assert rollout.state == "aborted"
    assert rollout.devices["b"].rollback.status == "timed_out"  # type: ignore[union-attr]
    assert rollout.devices["a"].rollback.status == "done"  # type: ignore[union-attr]


def test_the_operator_rolls_back_a_completed_rollout() -> None:
    fleet = Fleet(["a"])
    rollout = rollout_of(["a"], fleet)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "converged", NEW)
    advance(rollout, fleet.views, at(1))
    assert rollout.state == "completed"
    actions = begin_rollback(rollout, fleet.views, at(2), cause="operator")
    assert [action.document.model for action in actions] == [OLD]  # type: ignore[union-attr]
    fleet.take(actions)
    fleet.answer("a", "converged", OLD)
    advance(rollout, fleet.views, at(3))
    assert rollout.state == "rolled_back"
    with pytest.raises(FleetError, match="has ended"):
        begin_rollback(rollout, fleet.views, at(4), cause="operator")


def test_a_device_whose_earlier_model_is_unknown_gets_the_updaters_rollback() -> None:
    fleet = Fleet(["a"])
    fleet.views["a"] = DeviceView(reported=fleet._reported("a", 2, "converged", OLD))
    rollout = rollout_of(["a"], fleet, abort_min_finished=1)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("a", "converged", NEW)
    advance(rollout, fleet.views, at(1))
    actions = begin_rollback(rollout, fleet.views, at(2), cause="operator")
    assert [action.document.model for action in actions] == [None]  # type: ignore[union-attr]
    fleet.take(actions)
    fleet.answer("a", "converged", NEW)  # model None: nothing to change, still on NEW
    actions = advance(rollout, fleet.views, at(3))
    assert len(actions) == 1 and isinstance(actions[0], SendCommand)
    command = actions[0].document
    assert command.command == "rollback" and command.needs_signature
    assert advance(rollout, fleet.views, at(4)) == []  # sent once
    # The device rolls back; its stored desired document is marked failed by the command.
    fleet.answer("a", "failed", OLD, reason="operator_rollback")
    advance(rollout, fleet.views, at(5))
    assert rollout.state == "rolled_back"

    # A refused rollback command fails that device's rollback.
    fleet2 = Fleet(["b"])
    fleet2.views["b"] = DeviceView(reported=fleet2._reported("b", 2, "converged", OLD))
    other = new_rollout(fleet="plant", rollout_id="r2", model=NEW, devices=["b"],
                        policy=Policy(abort_min_finished=1), now=T0, views=fleet2.views)
    fleet2.take(advance(other, fleet2.views, at(0)))
    fleet2.answer("b", "converged", NEW)
    advance(other, fleet2.views, at(1))
    fleet2.take(begin_rollback(other, fleet2.views, at(2), cause="operator"))
    fleet2.answer("b", "converged", NEW)
    request_id = advance(other, fleet2.views, at(3))[0].document.request_id  # type: ignore
    view = fleet2.views["b"]
    fleet2.views["b"] = DeviceView(
        desired=view.desired, desired_floor=view.desired_floor, reported=view.reported,
        responses={request_id: Response(
            fleet="plant", device="b", request_id=request_id, ok=False, answered_at=at(3),
            error=ErrorInfo(reason="no_previous", message="nothing to roll back to"))})
    advance(other, fleet2.views, at(4))
    assert other.devices["b"].rollback.status == "failed"  # type: ignore[union-attr]
    assert other.state == "rolled_back"


def test_the_rollback_resolves_an_earlier_model_from_the_artifact_index() -> None:
    fleet = Fleet(["a"])
    fleet.views["a"] = DeviceView(reported=fleet._reported("a", 2, "converged", OLD))

    def resolve(name: str, version: int) -> ModelSpec | None:
        return OLD if (name, version) == (OLD.name, OLD.version) else None

    rollout = rollout_of(["a"], fleet)
    advance(rollout, fleet.views, at(0), resolve=resolve)
    assert rollout.devices["a"].previous == OLD


# -- the document ----------------------------------------------------------------------------

def _mid_rollout() -> Rollout:
    devices = [f"cam-{index}" for index in range(6)]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("2", "100%"), abort_min_finished=2)
    fleet.take(advance(rollout, fleet.views, at(0)))
    fleet.answer("cam-0", "converged", NEW)
    fleet.answer("cam-1", "failed", OLD, reason="canary_slow")
    fleet.take(advance(rollout, fleet.views, at(1)))
    return rollout


def test_the_rollout_document_round_trips_signed_and_its_desired_documents_rebuild_exactly(
        ) -> None:
    rollout = _mid_rollout()
    assert rollout.state == "rolling_back"
    key = generate_private_key()
    restored = open_rollout(sign_rollout(rollout, key), [key.public_key()])
    assert restored.to_json() == rollout.to_json()
    for device in rollout.devices:
        original, rebuilt = rollout.wanted_desired(device), restored.wanted_desired(device)
        if original is None:
            assert rebuilt is None
            continue
        assert rebuilt is not None
        # Ed25519 is deterministic: a resumed driver republishes the very same bytes.
        assert sign(rebuilt, key) == sign(original, key)
        assert open_envelope(sign(rebuilt, key), [key.public_key()]).document == original


def test_a_rollout_document_not_signed_by_a_trusted_key_is_refused() -> None:
    rollout = _mid_rollout()
    key, other = generate_private_key(), generate_private_key()
    signed = sign_rollout(rollout, key)
    with pytest.raises(DocumentError) as refused:
        open_rollout(signed, [other.public_key()])
    assert refused.value.reason == "unknown_key"
    envelope = json.loads(signed)
    envelope["payload"] = envelope["payload"].replace('"rolling_back"', '"completed"')
    with pytest.raises(DocumentError) as tampered:
        open_rollout(json.dumps(envelope).encode(), [key.public_key()])
    assert tampered.value.reason == "bad_signature"
    for garbage in (b"", b"[]", b'{"payload": 1, "signature": {}}'):
        with pytest.raises(DocumentError):
            open_rollout(garbage, [key.public_key()])


def test_a_malformed_rollout_document_is_refused_with_a_reason() -> None:
    document = _mid_rollout().to_json()
    for change in ({"state": "exploded"}, {"stage": 7}, {"kind": "desired"},
                   {"schema_version": 2}, {"model": {"name": "x"}}):
        with pytest.raises(DocumentError) as refused:
            Rollout.from_json({**document, **change})
        assert refused.value.reason == "bad_rollout"


def test_the_rollout_document_matches_its_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[1] / "agent/fleet/schemas/"
                         "rollout.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    rollout = _mid_rollout()
    completed = snapshot(rollout)
    validator.validate(rollout.to_json())
    fresh = rollout_of(["a"], Fleet(["a"]))
    validator.validate(fresh.to_json())
    validator.validate(completed.to_json())
    broken = rollout.to_json()
    broken["devices"]["cam-0"]["status"] = "exploded"
    assert list(validator.iter_errors(broken))
    broken = rollout.to_json()
    broken["surprise"] = 1
    assert list(validator.iter_errors(broken))


def test_progress_lines_name_stages_devices_and_the_abort() -> None:
    devices = ["a", "b"]
    fleet = Fleet(devices)
    rollout = rollout_of(devices, fleet, stages=("1", "100%"), abort_min_finished=1)
    before = snapshot(rollout)
    fleet.take(advance(rollout, fleet.views, at(0)))
    lines = changes(before, rollout)
    assert lines == ["stage 1/2 started: 1 devices (a)", "  a: waiting"]
    before = snapshot(rollout)
    fleet.answer("a", "failed", OLD, reason="canary_nan")
    advance(rollout, fleet.views, at(1))
    lines = changes(before, rollout)
    assert lines[:3] == ["  a: failed (canary_nan)", "  a: rollback to det 1 waiting",
                         "stage 1/2 aborted"]
    assert lines[3].startswith("rollout det-v2-test aborting: stage 1: 1 of 1 finished")
    assert changes(None, rollout)[0].startswith("rollout det-v2-test aborting")
