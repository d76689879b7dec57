"""A staged rollout: the plan, the abort rules, the rollback, as a state machine in the open.

A rollout takes a list of devices, in a fixed order, through growing stages (``3,10%,50%,100%``:
cumulative sizes, a percentage of all the rollout's devices rounded up). A stage starts by giving
each of its devices a signed ``desired`` document naming the new model; a device *finishes* when
its ``reported`` document answers that desired version:

=============  =======================================================================
device status  when
=============  =======================================================================
``pending``    its stage has not started
``waiting``    its desired document is out; the device has not taken it up yet
``applying``   the device reports the version ``applying``
``succeeded``  the device reports it ``converged`` with the new model applied
``failed``     the device reports it ``failed`` or ``refused`` (reason kept), or converged
               on another model
``timed_out``  the stage timed out first (``stage_timeout_s``): stragglers never stall it
``superseded`` the device reports a newer desired version than the rollout's (someone else
               wrote one); finished, not a failure
=============  =======================================================================

**Abort rule**, in AWS IoT Jobs' terms, per stage: once at least ``abort_min_finished`` of the
stage's devices finished (capped at the stage's size, so a canary smaller than that is still
judged), the rollout aborts as soon as the failure share, (failed + timed out) / finished, is
above ``abort_failure_share``. A stage passes when all its devices finished without an abort; the
last stage passing completes the rollout.

**On abort** (or ``fleet rollback``), *every device the rollout gave the new version to*, whatever
it made of it, gets a signed desired document one version higher naming the model it ran before
(``allow_downgrade``: an authorised rollback), and the rollout waits for them to converge
(``rollback_timeout_s``; a device still away then converges when it returns, since its retained
desired document is the rollback). Unlike AWS IoT Jobs' abort, which only cancels devices that
have not started, devices that already took the bad version go back. A device whose earlier
model cannot be named (no desired document, not in the artifact index) gets a desired document
with no model and, once it reports the new version applied, a signed ``rollback`` command.

The state lives in a *rollout document* (``kind: rollout``, schema
agent/fleet/schemas/rollout.schema.json), retained and signed on
``edge/<fleet>/rollouts/<id>``: everything :func:`advance` needs is in it, and the desired
documents it implies are rebuilt from it byte for byte (Ed25519 signatures are deterministic), so
any operator machine resumes a rollout whose driver died. ``revision`` increases with every
publication; ``driver`` names the process driving it and when it last said so.

:func:`advance` is pure: the rollout, what the broker shows of each device, and the time in; the
documents to publish out (the rollout is updated in place).
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import ConfigError, DocumentError, FleetError, SignatureError
from agent.fleet.documents import (
    Command,
    Desired,
    ModelSpec,
    Reported,
    Response,
    format_time,
    parse_time,
)
from agent.fleet.topics import check_id
from models.signing import SIGNATURE_ALGORITHM, compute_key_id, signature_from_json

__all__ = [
    "DEVICE_STATUSES",
    "FINAL_STATES",
    "ROLLBACK_STATUSES",
    "STATES",
    "Abort",
    "DeviceEntry",
    "DeviceView",
    "Driver",
    "Issued",
    "Policy",
    "RollbackEntry",
    "Rollout",
    "Stage",
    "advance",
    "begin_rollback",
    "changes",
    "new_rollout",
    "open_rollout",
    "plan_stages",
    "sign_rollout",
]

SCHEMA_VERSION = 1
STATES = ("running", "rolling_back", "completed", "aborted", "rolled_back")
FINAL_STATES = frozenset({"completed", "aborted", "rolled_back"})
DEVICE_STATUSES = ("pending", "waiting", "applying", "succeeded", "failed", "timed_out",
                   "superseded")
ROLLBACK_STATUSES = ("waiting", "applying", "done", "failed", "timed_out", "superseded")
_OPEN = frozenset({"waiting", "applying"})
_FAILURES = frozenset({"failed", "timed_out"})
ABORT_CAUSES = ("failure_share", "operator")
# A rollout document lists every device of the rollout: far larger than a device's documents.
MAX_ROLLOUT_BYTES = 4 * 1024 * 1024
COMMAND_LIFETIME = datetime.timedelta(hours=1)
_STAGE = re.compile(r"([0-9]+)(%?)")


# -- the parts -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the rollout goes: ``stages`` as given (``"3"``, ``"10%"``) and the abort rules."""

    stages: tuple[str, ...] = ("100%",)
    abort_failure_share: float = 0.2
    abort_min_finished: int = 3
    stage_timeout_s: float = 1800.0
    rollback_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError("a rollout needs at least one stage", key="stages")
        for stage in self.stages:
            found = _STAGE.fullmatch(stage)
            if found is None or int(found.group(1)) == 0 or (
                    found.group(2) and int(found.group(1)) > 100):
                raise ConfigError("a stage is a device count (3) or a percentage (10%) of the "
                                  "rollout's devices, above zero", key="stages", found=stage)
        if not (0.0 <= self.abort_failure_share < 1.0) or math.isnan(self.abort_failure_share):
            raise ConfigError("the abort failure share is a fraction from 0 to below 1 (0.2: "
                              "abort once more than 20% failed)", key="abort_failure_share",
                              found=self.abort_failure_share)
        if isinstance(self.abort_min_finished, bool) or self.abort_min_finished < 1:
            raise ConfigError("the abort rule needs at least one finished device",
                              key="abort_min_finished", found=self.abort_min_finished)
        for name in ("stage_timeout_s", "rollback_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or math.isinf(value):
                raise ConfigError("a timeout is a positive number of seconds", key=name,
                                  found=value)

    def to_json(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "abort_failure_share": self.abort_failure_share,
                "abort_min_finished": self.abort_min_finished,
                "stage_timeout_s": self.stage_timeout_s,
                "rollback_timeout_s": self.rollback_timeout_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Policy:
        return cls(stages=tuple(data["stages"]),
                   abort_failure_share=float(data["abort_failure_share"]),
                   abort_min_finished=int(data["abort_min_finished"]),
                   stage_timeout_s=float(data["stage_timeout_s"]),
                   rollback_timeout_s=float(data["rollback_timeout_s"]))


def plan_stages(stages: Sequence[str], count: int) -> list[int]:
    """The cumulative stage sizes for ``count`` devices. Each stage is the total reached by its
    end: a count, or a percentage of all the devices rounded up; at least one device, at most
    all. A stage that would add no device (``10%`` of 5 devices after a canary of 3) is dropped,
    and all the devices make a last stage when the plan stops short of them."""
    sizes: list[int] = []
    for stage in stages:
        found = _STAGE.fullmatch(stage)
        if found is None:
            raise ConfigError("not a stage", key="stages", found=stage)
        number = int(found.group(1))
        size = math.ceil(number * count / 100) if found.group(2) else number
        size = max(1, min(count, size))
        if not sizes or size > sizes[-1]:
            sizes.append(size)
    if count and (not sizes or sizes[-1] < count):
        sizes.append(count)
    return sizes if count else []


@dataclass(kw_only=True)
class Issued:
    """A desired document the rollout wrote: its version and issue time (the rest follows from
    the rollout, so the document can be rebuilt exactly)."""

    version: int
    issued_at: datetime.datetime

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "issued_at": format_time(self.issued_at)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Issued:
        return cls(version=int(data["version"]),
                   issued_at=parse_time(data["issued_at"], "issued_at"))


@dataclass(kw_only=True)
class RollbackEntry:
    """A device's way back: the desired document naming its earlier model (None: unknown) and
    where it stands; ``command``: the request id of a rollback command sent to it."""

    desired: Issued
    model: ModelSpec | None
    status: str = "waiting"
    reason: str | None = None
    finished_at: datetime.datetime | None = None
    command: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"desired": self.desired.to_json(),
                "model": None if self.model is None else self.model.to_json(),
                "status": self.status, "reason": self.reason,
                "finished_at": _time_or_none(self.finished_at), "command": self.command}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RollbackEntry:
        model = data.get("model")
        return cls(desired=Issued.from_json(data["desired"]),
                   model=None if model is None else ModelSpec.from_json(model, "rollback.model"),
                   status=data["status"], reason=data.get("reason"),
                   finished_at=_parse_or_none(data.get("finished_at")),
                   command=data.get("command"))


@dataclass(kw_only=True)
class DeviceEntry:
    """One device of the rollout. ``previous``: the model it ran when its stage started (where
    a rollback takes it); ``carry``: the ``power`` and ``settings`` of the desired document it
    had, which the rollout's documents keep."""

    stage: int
    status: str = "pending"
    reason: str | None = None
    previous: ModelSpec | None = None
    carry: dict[str, Any] = field(default_factory=dict)
    desired: Issued | None = None
    finished_at: datetime.datetime | None = None
    rollback: RollbackEntry | None = None

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "status": self.status, "reason": self.reason,
                "previous": None if self.previous is None else self.previous.to_json(),
                "carry": self.carry,
                "desired": None if self.desired is None else self.desired.to_json(),
                "finished_at": _time_or_none(self.finished_at),
                "rollback": None if self.rollback is None else self.rollback.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceEntry:
        previous, desired, rollback = data.get("previous"), data.get("desired"), \
            data.get("rollback")
        return cls(stage=int(data["stage"]), status=data["status"], reason=data.get("reason"),
                   previous=None if previous is None else ModelSpec.from_json(previous,
                                                                              "previous"),
                   carry=dict(data.get("carry") or {}),
                   desired=None if desired is None else Issued.from_json(desired),
                   finished_at=_parse_or_none(data.get("finished_at")),
                   rollback=None if rollback is None else RollbackEntry.from_json(rollback))


@dataclass(kw_only=True)
class Stage:
    devices: tuple[str, ...]
    started_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    result: str | None = None  # "passed" or "aborted"

    def to_json(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "started_at": _time_or_none(self.started_at),
                "finished_at": _time_or_none(self.finished_at), "result": self.result}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Stage:
        return cls(devices=tuple(data["devices"]),
                   started_at=_parse_or_none(data.get("started_at")),
                   finished_at=_parse_or_none(data.get("finished_at")),
                   result=data.get("result"))


@dataclass(kw_only=True)
class Abort:
    """Why and when the rollout turned back: ``failure_share`` (the abort rule fired, with the
    stage's counts) or ``operator`` (``fleet rollback``)."""

    at: datetime.datetime
    cause: str
    stage: int
    finished: int = 0
    failed: int = 0
    message: str = ""

    @property
    def share(self) -> float:
        return self.failed / self.finished if self.finished else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"at": format_time(self.at), "cause": self.cause, "stage": self.stage,
                "finished": self.finished, "failed": self.failed,
                "share": round(self.share, 4), "message": self.message}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Abort:
        return cls(at=parse_time(data["at"], "abort.at"), cause=data["cause"],
                   stage=int(data["stage"]), finished=int(data["finished"]),
                   failed=int(data["failed"]), message=str(data.get("message", "")))


@dataclass(kw_only=True)
class Driver:
    """The process driving the rollout, and when it last said so."""

    id: str
    heartbeat_at: datetime.datetime

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "heartbeat_at": format_time(self.heartbeat_at)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Driver:
        return cls(id=str(data["id"]), heartbeat_at=parse_time(data["heartbeat_at"],
                                                               "driver.heartbeat_at"))


@dataclass(kw_only=True)
class Rollout:
    """A rollout's whole state (the rollout document)."""

    fleet: str
    rollout_id: str
    model: ModelSpec
    policy: Policy
    created_at: datetime.datetime
    stages: list[Stage]
    devices: dict[str, DeviceEntry]
    revision: int = 0
    updated_at: datetime.datetime | None = None
    state: str = "running"
    stage: int = 0
    abort: Abort | None = None
    driver: Driver | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "rollout", "schema_version": SCHEMA_VERSION, "fleet": self.fleet,
            "rollout_id": self.rollout_id, "revision": self.revision,
            "created_at": format_time(self.created_at),
            "updated_at": _time_or_none(self.updated_at),
            "model": self.model.to_json(), "policy": self.policy.to_json(),
            "state": self.state, "stage": self.stage,
            "stages": [stage.to_json() for stage in self.stages],
            "devices": {device: entry.to_json() for device, entry in sorted(self.devices.items())},
            "abort": None if self.abort is None else self.abort.to_json(),
            "driver": None if self.driver is None else self.driver.to_json(),
        }

    @classmethod
    def from_json(cls, data: object) -> Rollout:
        """Parse a rollout document.

        Raises:
            DocumentError: (``bad_rollout``) it is not a valid one.
        """
        try:
            if not isinstance(data, dict) or data.get("kind") != "rollout":
                raise ValueError("not a rollout document")
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {data.get('schema_version')!r}")
            rollout = cls(
                fleet=check_id(data["fleet"], "fleet"),
                rollout_id=check_id(data["rollout_id"], "rollout"),
                model=ModelSpec.from_json(data["model"]),
                policy=Policy.from_json(data["policy"]),
                created_at=parse_time(data["created_at"], "created_at"),
                stages=[Stage.from_json(stage) for stage in data["stages"]],
                devices={check_id(device, "device"): DeviceEntry.from_json(entry)
                         for device, entry in data["devices"].items()},
                revision=int(data["revision"]),
                updated_at=_parse_or_none(data.get("updated_at")),
                state=data["state"], stage=int(data["stage"]),
                abort=None if data.get("abort") is None else Abort.from_json(data["abort"]),
                driver=None if data.get("driver") is None else Driver.from_json(data["driver"]))
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError,
                DocumentError) as exc:
            raise DocumentError(f"not a valid rollout document: {exc}", reason="bad_rollout",
                                found=type(exc).__name__) from None
        problems = [rollout.state not in STATES,
                    not 0 <= rollout.stage < max(1, len(rollout.stages)),
                    any(entry.status not in DEVICE_STATUSES for entry in rollout.devices.values()),
                    any(entry.rollback is not None and entry.rollback.status
                        not in ROLLBACK_STATUSES for entry in rollout.devices.values()),
                    any(device not in rollout.devices for stage in rollout.stages
                        for device in stage.devices)]
        if any(problems):
            raise DocumentError("not a valid rollout document: inconsistent state",
                                reason="bad_rollout", rollout=rollout.rollout_id)
        return rollout

    # -- the documents it implies

    def forward_desired(self, device: str) -> Desired | None:
        """The desired document the rollout gave ``device`` (None before its stage)."""
        entry = self.devices[device]
        if entry.desired is None:
            return None
        return Desired(fleet=self.fleet, device=device, version=entry.desired.version,
                       issued_at=entry.desired.issued_at, model=self.model,
                       allow_downgrade=False, rollout=self.rollout_id,
                       power=entry.carry.get("power"), settings=entry.carry.get("settings", {}))

    def rollback_desired(self, device: str) -> Desired | None:
        entry = self.devices[device]
        if entry.rollback is None:
            return None
        return Desired(fleet=self.fleet, device=device, version=entry.rollback.desired.version,
                       issued_at=entry.rollback.desired.issued_at, model=entry.rollback.model,
                       allow_downgrade=True, rollout=self.rollout_id,
                       power=entry.carry.get("power"), settings=entry.carry.get("settings", {}))

    def wanted_desired(self, device: str) -> Desired | None:
        """The desired document ``device`` should have now: its rollback once there is one."""
        return self.rollback_desired(device) or self.forward_desired(device)

    def counts(self) -> dict[str, int]:
        result = dict.fromkeys(DEVICE_STATUSES, 0)
        for entry in self.devices.values():
            result[entry.status] += 1
        return result

    def reached(self) -> list[str]:
        """The devices the rollout gave the new version to."""
        return sorted(device for device, entry in self.devices.items()
                      if entry.desired is not None)


def _time_or_none(moment: datetime.datetime | None) -> str | None:
    return None if moment is None else format_time(moment)


def _parse_or_none(value: object) -> datetime.datetime | None:
    return None if value is None else parse_time(value, "time")


# -- what the broker shows of a device ---------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DeviceView:
    """A device as the broker shows it: its retained desired document (verified; ``None`` when
    absent or not signed by a trusted key), the highest desired version seen for it at all
    (``desired_floor``: any document a device might have accepted), its retained reported
    document, whether it is online, and the answers to commands."""

    desired: Desired | None = None
    desired_floor: int = 0
    reported: Reported | None = None
    online: bool | None = None
    responses: Mapping[str, Response] = field(default_factory=dict)

    def next_version(self, *at_least: int) -> int:
        """The version a new desired document for this device must have."""
        reported = self.reported.desired.version if (
            self.reported is not None and self.reported.desired is not None) else 0
        own = self.desired.version if self.desired is not None else 0
        return max(own, reported, self.desired_floor, *at_least) + 1


# A function naming the bundle of a model version (the artifact index), or None.
Resolver = Callable[[str, int], "ModelSpec | None"]


def new_rollout(*, fleet: str, rollout_id: str, model: ModelSpec, devices: Sequence[str],
                policy: Policy, now: datetime.datetime,
                views: Mapping[str, DeviceView] | None = None) -> Rollout:
    """A rollout of ``model`` to ``devices``, in stages: devices online now go first (a canary
    that is away would only time out), then by id.

    Raises:
        ConfigError: no devices, or the same device twice.
    """
    check_id(fleet, "fleet")
    check_id(rollout_id, "rollout")
    if not devices:
        raise ConfigError("a rollout needs at least one device", key="devices")
    if len(set(devices)) != len(devices):
        raise ConfigError("a device is named twice", key="devices")
    for device in devices:
        check_id(device, "device")
    views = views or {}
    ordered = sorted(devices, key=lambda device: (views.get(device, DeviceView()).online
                                                  is not True, device))
    sizes = plan_stages(policy.stages, len(ordered))
    stages: list[Stage] = []
    entries: dict[str, DeviceEntry] = {}
    start = 0
    for index, size in enumerate(sizes):
        members = tuple(ordered[start:size])
        stages.append(Stage(devices=members))
        for device in members:
            entries[device] = DeviceEntry(stage=index)
        start = size
    return Rollout(fleet=fleet, rollout_id=rollout_id, model=model, policy=policy,
                   created_at=now, stages=stages, devices=entries)


# -- the state machine ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PublishDesired:
    document: Desired


@dataclass(frozen=True)
class SendCommand:
    document: Command


Action = PublishDesired | SendCommand


def advance(rollout: Rollout, views: Mapping[str, DeviceView], now: datetime.datetime, *,
            resolve: Resolver | None = None) -> list[Action]:
    """Take the rollout as far as what the broker shows allows, at ``now``.

    Starts stages, classifies devices, applies the abort rule and the stage timeout, moves to
    the next stage, starts and follows the rollback. ``resolve`` names a model version's bundle
    (for a device whose earlier model is known only from its reported document).

    Returns:
        The desired documents to publish and commands to send, in order.
    """
    actions: list[Action] = []
    while not rollout.final:
        before = (rollout.state, rollout.stage)
        if rollout.state == "running":
            actions += _run_stage(rollout, views, now, resolve)
        if rollout.state == "rolling_back":
            actions += _follow_rollback(rollout, views, now)
        if (rollout.state, rollout.stage) == before:
            break
    return actions


def _run_stage(rollout: Rollout, views: Mapping[str, DeviceView], now: datetime.datetime,
               resolve: Resolver | None) -> list[Action]:
    actions: list[Action] = []
    stage = rollout.stages[rollout.stage]
    if stage.started_at is None:
        stage.started_at = now
        for device in stage.devices:
            actions.append(PublishDesired(_start_device(rollout, device,
                                                        views.get(device, DeviceView()), now,
                                                        resolve)))
    for device, entry in rollout.devices.items():
        if entry.desired is not None:
            _classify(rollout, device, entry, views.get(device, DeviceView()), now)
    timed_out = now - stage.started_at >= _seconds(rollout.policy.stage_timeout_s)
    if timed_out:
        for device in stage.devices:
            entry = rollout.devices[device]
            if entry.status in _OPEN:
                entry.status, entry.finished_at = "timed_out", now
                entry.reason = (f"no answer within the stage timeout of "
                                f"{rollout.policy.stage_timeout_s:g} s")
    members = [rollout.devices[device] for device in stage.devices]
    finished = [entry for entry in members if entry.status not in _OPEN]
    failed = [entry for entry in finished if entry.status in _FAILURES]
    needed = min(rollout.policy.abort_min_finished, len(members))
    if len(finished) >= needed and len(failed) / len(finished) > rollout.policy.abort_failure_share:
        share = len(failed) / len(finished)
        stage.finished_at, stage.result = now, "aborted"
        reasons = sorted({entry.reason or entry.status for entry in failed})
        message = (f"stage {rollout.stage + 1}: {len(failed)} of {len(finished)} finished "
                   f"devices failed ({share:.0%} > {rollout.policy.abort_failure_share:.0%}): "
                   + "; ".join(reasons)[:500])
        actions += begin_rollback(rollout, views, now, cause="failure_share",
                                  finished=len(finished), failed=len(failed), message=message)
    elif len(finished) == len(members):
        stage.finished_at, stage.result = now, "passed"
        if rollout.stage + 1 < len(rollout.stages):
            rollout.stage += 1
        else:
            rollout.state = "completed"
    return actions


def _start_device(rollout: Rollout, device: str, view: DeviceView, now: datetime.datetime,
                  resolve: Resolver | None) -> Desired:
    entry = rollout.devices[device]
    entry.previous = _running_model(view, resolve)
    carry: dict[str, Any] = {}
    if view.desired is not None:
        if view.desired.power is not None:
            carry["power"] = view.desired.power
        if view.desired.settings:
            carry["settings"] = view.desired.settings
    entry.carry = carry
    entry.desired = Issued(version=view.next_version(), issued_at=now)
    entry.status, entry.reason = "waiting", None
    document = rollout.forward_desired(device)
    assert document is not None
    return document


def _running_model(view: DeviceView, resolve: Resolver | None) -> ModelSpec | None:
    """The model a device runs, with where its bundle is: from its desired document when that
    names the applied version, else from the artifact index."""
    applied = view.reported.applied if view.reported is not None else None
    desired_model = view.desired.model if view.desired is not None else None
    if applied is None:
        return desired_model if view.reported is None else None
    if desired_model is not None and (desired_model.name, desired_model.version) == (
            applied.name, applied.version):
        return desired_model
    return resolve(applied.name, applied.version) if resolve is not None else None


def _matches(applied: Any, model: ModelSpec | None) -> bool:
    return applied is not None and model is not None and (applied.name, applied.version) == (
        model.name, model.version)


def _classify(rollout: Rollout, device: str, entry: DeviceEntry, view: DeviceView,
              now: datetime.datetime) -> None:
    """A device's status from its reported document (a timed-out device that answers later is
    classified again: the stage's verdict stands, the device's record follows the truth)."""
    assert entry.desired is not None
    reported = view.reported
    status = reported.desired if reported is not None else None
    if status is None or status.version < entry.desired.version:
        return
    if status.version > entry.desired.version:
        new, reason = "superseded", f"the device took desired version {status.version}"
    elif status.status == "applying":
        new, reason = "applying", None
    elif status.status == "converged":
        applied = reported.applied if reported is not None else None
        if _matches(applied, rollout.model):
            new, reason = "succeeded", None
        else:
            new = "failed"
            reason = (f"converged on {applied.name} {applied.version}" if applied is not None
                      else "converged with no model applied")
    else:  # failed, refused
        new = "failed"
        updater_error = reported.updater.error if reported is not None else None
        reason = status.reason or (updater_error.reason if updater_error else status.status)
    if new == "applying" and entry.status not in _OPEN:
        return  # finished (timed out) stays finished until the device finishes for real
    if (new, reason) != (entry.status, entry.reason):
        entry.status, entry.reason = new, reason
        entry.finished_at = None if new in _OPEN else now


def begin_rollback(rollout: Rollout, views: Mapping[str, DeviceView], now: datetime.datetime, *,
                   cause: str, finished: int = 0, failed: int = 0,
                   message: str = "") -> list[Action]:
    """Turn the rollout back: every device it reached gets a desired document naming its
    earlier model (see the module's docstring).

    Raises:
        FleetError: the rollout is final already, other than completed (a completed rollout can
            be rolled back by the operator).
    """
    if cause not in ABORT_CAUSES:
        raise ConfigError("unknown abort cause", found=cause)
    if rollout.state == "rolling_back":
        return []
    if rollout.final and not (rollout.state == "completed" and cause == "operator"):
        raise FleetError("this rollout has ended; nothing to roll back", reason="final",
                         rollout=rollout.rollout_id, state=rollout.state)
    rollout.state = "rolling_back"
    rollout.abort = Abort(at=now, cause=cause, stage=rollout.stage, finished=finished,
                          failed=failed, message=message or "rolled back by the operator")
    actions: list[Action] = []
    for device in rollout.reached():
        entry = rollout.devices[device]
        assert entry.desired is not None
        view = views.get(device, DeviceView())
        entry.rollback = RollbackEntry(
            desired=Issued(version=view.next_version(entry.desired.version), issued_at=now),
            model=entry.previous)
        document = rollout.rollback_desired(device)
        assert document is not None
        actions.append(PublishDesired(document))
    for device, entry in rollout.devices.items():
        if entry.status == "pending":
            entry.reason = "not reached: the rollout turned back first"
    return actions


def _follow_rollback(rollout: Rollout, views: Mapping[str, DeviceView],
                     now: datetime.datetime) -> list[Action]:
    assert rollout.abort is not None
    actions: list[Action] = []
    deadline_passed = now - rollout.abort.at >= _seconds(rollout.policy.rollback_timeout_s)
    open_count = 0
    for device, entry in rollout.devices.items():
        back = entry.rollback
        if back is None:
            continue
        view = views.get(device, DeviceView())
        reported = view.reported
        status = reported.desired if reported is not None else None
        if status is not None and status.version > back.desired.version:
            back.status, back.reason = "superseded", f"desired version {status.version}"
        elif status is not None and status.version == back.desired.version:
            applied = reported.applied if reported is not None else None
            if back.model is None:
                actions += _without_model(rollout, device, back, view, now)
            elif status.status == "applying":
                back.status = "applying"
            elif status.status == "converged":
                if _matches(applied, back.model):
                    back.status, back.reason = "done", None
                else:
                    back.status, back.reason = "failed", "converged on another model"
            else:
                back.status, back.reason = "failed", status.reason or status.status
        if back.status in _OPEN and deadline_passed:
            back.status = "timed_out"
            back.reason = (f"not back within {rollout.policy.rollback_timeout_s:g} s; its "
                           "retained desired document takes it back when it returns")
        if back.status not in _OPEN and back.finished_at is None:
            back.finished_at = now
        elif back.status in _OPEN:
            back.finished_at = None
            open_count += 1
    if open_count == 0:
        rollout.state = "aborted" if rollout.abort.cause == "failure_share" else "rolled_back"
    return actions


def _without_model(rollout: Rollout, device: str, back: RollbackEntry, view: DeviceView,
                   now: datetime.datetime) -> list[Action]:
    """A device whose earlier model cannot be named has taken the rollback's desired document
    (no model: nothing to change): if it runs the rollout's model, the updater's own rollback
    takes it back (a signed ``rollback`` command, sent once); done once it runs another one."""
    reported = view.reported
    assert reported is not None and reported.desired is not None
    on_new_model = _matches(reported.applied, rollout.model)
    if back.command is None:
        if reported.desired.status == "applying":
            back.status = "applying"
        elif on_new_model:
            back.command = f"{rollout.rollout_id[:40]}.rb.{back.desired.version}"
            back.status = "applying"
            return [SendCommand(Command(fleet=rollout.fleet, device=device,
                                        request_id=back.command, command="rollback", args={},
                                        issued_at=now, expires_at=now + COMMAND_LIFETIME))]
        else:
            back.status, back.reason = "done", None
        return []
    response = view.responses.get(back.command)
    if response is not None and not response.ok:
        back.status = "failed"
        back.reason = response.error.reason if response.error else "rollback refused"
    elif not on_new_model:  # (its answer may have been lost; what it runs is what counts)
        back.status, back.reason = "done", None
    return []


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


# -- what changed, for progress lines ------------------------------------------------------------

def changes(before: Rollout | None, after: Rollout) -> list[str]:
    """One line for each thing that changed between two states of a rollout: stages started,
    its devices, stages ended, then its state (first, as a heading, with no earlier state)."""
    started: list[str] = []
    ended: list[str] = []
    for index, stage in enumerate(after.stages):
        old = before.stages[index] if before is not None else None
        if stage.started_at is not None and (old is None or old.started_at is None):
            started.append(f"stage {index + 1}/{len(after.stages)} started: "
                           f"{len(stage.devices)} devices ({', '.join(stage.devices[:8])}"
                           f"{', ...' if len(stage.devices) > 8 else ''})")
        if stage.result is not None and (old is None or old.result != stage.result):
            ended.append(f"stage {index + 1}/{len(after.stages)} {stage.result}")
    devices: list[str] = []
    for device, entry in sorted(after.devices.items()):
        old_entry = before.devices.get(device) if before is not None else None
        if old_entry is None or (old_entry.status, old_entry.reason) != (entry.status,
                                                                          entry.reason):
            if entry.status != "pending":
                devices.append(f"  {device}: {entry.status}"
                               + (f" ({entry.reason})" if entry.reason else ""))
        back, old_back = entry.rollback, old_entry.rollback if old_entry is not None else None
        if back is not None and (old_back is None or (old_back.status, old_back.reason)
                                 != (back.status, back.reason)):
            target = (f"{back.model.name} {back.model.version}" if back.model
                      else "its earlier model")
            devices.append(f"  {device}: rollback to {target} {back.status}"
                           + (f" ({back.reason})" if back.reason else ""))
    lines = started + devices + ended
    if before is None:
        lines.insert(0, _state_line(after))
    elif before.state != after.state:
        lines.append(_state_line(after))
    return lines


def _state_line(rollout: Rollout) -> str:
    model = f"{rollout.model.name} {rollout.model.version}"
    counts = rollout.counts()
    if rollout.state == "running":
        return f"rollout {rollout.rollout_id}: {model} to {len(rollout.devices)} devices"
    if rollout.state == "completed":
        return (f"rollout {rollout.rollout_id} completed: {counts['succeeded']} succeeded, "
                f"{counts['failed']} failed, {counts['timed_out']} timed out")
    if rollout.state == "rolling_back":
        assert rollout.abort is not None
        return (f"rollout {rollout.rollout_id} aborting: {rollout.abort.message}; rolling back "
                f"{len(rollout.reached())} devices")
    back = [entry.rollback.status for entry in rollout.devices.values() if entry.rollback]
    return (f"rollout {rollout.rollout_id} {rollout.state.replace('_', ' ')}: "
            f"{back.count('done')} of {len(back)} devices back"
            + (f", {len(back) - back.count('done')} not (yet)" if back.count("done") < len(back)
               else ""))


# -- the signed document ---------------------------------------------------------------------------

def sign_rollout(rollout: Rollout, private_key: Ed25519PrivateKey) -> bytes:
    """The rollout document in a signed envelope (the same form as the devices' documents')."""
    payload = json.dumps(rollout.to_json(), separators=(",", ":"), ensure_ascii=False)
    if len(payload.encode("utf-8")) > MAX_ROLLOUT_BYTES:
        raise FleetError("the rollout document is too large; roll out to fewer devices at once",
                         reason="too_large", devices=len(rollout.devices))
    envelope = {"payload": payload, "signature": {
        "algorithm": SIGNATURE_ALGORITHM,
        "key_id": compute_key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(payload.encode("utf-8"))).decode()}}
    return json.dumps(envelope, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def open_rollout(data: bytes, trusted_keys: Sequence[Ed25519PublicKey]) -> Rollout:
    """Verify and parse a signed rollout document.

    Raises:
        DocumentError: too large, not an envelope, not signed by a trusted key, or not a valid
            rollout document.
    """
    if len(data) > 2 * MAX_ROLLOUT_BYTES:
        raise DocumentError("the rollout document is too large", reason="too_large")
    try:
        envelope = json.loads(data)
        payload = envelope["payload"]
        signature = signature_from_json(envelope["signature"])
        if not isinstance(payload, str):
            raise TypeError("payload")
    except (ValueError, TypeError, KeyError, SignatureError) as exc:
        raise DocumentError(f"not a signed rollout document: {exc}",
                            reason="bad_envelope") from None
    keys = {compute_key_id(key): key for key in trusted_keys}
    key = keys.get(signature.key_id)
    if key is None:
        raise DocumentError("the rollout document is signed by a key that is not trusted",
                            reason="unknown_key", key_id=signature.key_id)
    try:
        key.verify(signature.signature, payload.encode("utf-8"))
    except InvalidSignature:
        raise DocumentError("the rollout document's signature does not match",
                            reason="bad_signature", key_id=signature.key_id) from None
    return Rollout.from_json(json.loads(payload))


def snapshot(rollout: Rollout) -> Rollout:
    """A copy to compare later states with (:func:`changes`)."""
    return copy.deepcopy(rollout)
