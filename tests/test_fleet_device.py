"""The device's control plane (agent/fleet/device.py) on a real updater, its handlers fed
messages directly: desired documents accepted, stored before acting and converged to (the newest
wins, older ones refused), commands answered once per request id across restarts, and hostile
payloads of every kind ending in an event with a reason, never an action or a crash.

The end-to-end tests with real Mosquitto brokers and real daemons are in
tests/test_fleet_e2e.py."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.errors import ConfigError
from agent.fleet import documents as docs
from agent.fleet.device import FleetDevice, Publication
from agent.fleet.mqtt import Message
from agent.fleet.state import FleetFiles
from agent.update.journal import BundleId
from agent.update.states import UpdatePolicy
from agent.update.updater import Updater, UpdateJob
from models.signing import generate_private_key
from tests.fakes.update_steps import FakeSteps

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FLEET, DEVICE = "plant-a", "cam-01"
ROOT = f"edge/{FLEET}/{DEVICE}"
KEY = generate_private_key()
OTHER_KEY = generate_private_key()
FAST = {"watch_window_s": 0.05, "cancel_grace_s": 0.5}


def url(version: int, name: str = "tiny") -> str:
    return f"file:///fleet/{name}/{version}.bundle"


def model(version: int, name: str = "tiny") -> docs.ModelSpec:
    return docs.ModelSpec(name=name, version=version, url=url(version, name),
                          sha256=hashlib.sha256(url(version, name).encode()).hexdigest())


class UrlSteps(FakeSteps):
    """FakeSteps whose sources are the file URLs above (a bundle's sha256 is its URL's)."""

    @staticmethod
    def bundle(source_text: str) -> BundleId:
        name, version = source_text.removeprefix("file:///fleet/").removesuffix(
            ".bundle").split("/")
        return BundleId(name=name, version=int(version),
                        sha256=hashlib.sha256(source_text.encode()).hexdigest())

    async def verify(self, job: UpdateJob) -> BundleId:
        await self._act("verify", job)
        bundle = self.bundle(job.source)
        serving = self.serving_now()
        if (serving is not None and bundle.version is not None and serving.version is not None
                and bundle.version < serving.version and not job.allow_downgrade):
            from agent.errors import UpdateError
            raise UpdateError("older than the version serving", reason="downgrade")
        return bundle

    @staticmethod
    def _version(job: UpdateJob) -> int | None:
        if job.bundle is not None:
            return job.bundle.version
        return UrlSteps.bundle(job.source).version if job.source else None


class Clock:
    def __init__(self) -> None:
        self.now = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.timezone.utc)

    def __call__(self) -> datetime.datetime:
        return self.now


class Plane:
    """A control plane on a real updater with fake steps, no broker: what it would publish
    waits in its outbox."""

    def __init__(self, directory: Path, *, serving: int = 1, delay_s: float = 0.0,
                 recover: bool = True) -> None:
        self.directory = directory
        self.recover = recover
        self.steps = UrlSteps(directory / "store", delay_s=delay_s)
        if not (directory / "store" / "serving.json").exists():
            self.steps.set_serving(UrlSteps.bundle(url(serving)))
        self.clock = Clock()
        self.updater = Updater(state_dir=directory / "state", steps=self.steps,
                               policy=UpdatePolicy(**FAST))
        self.device = FleetDevice(fleet=FLEET, device=DEVICE, updater=self.updater,
                                  state_dir=directory / "state", keys=[KEY.public_key()],
                                  options=None, clock=self.clock)
        self.seen = 0

    async def __aenter__(self) -> Plane:
        if self.recover:
            await self.updater.recover()
        await self.device.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.device.close()
        await self.updater.close()

    async def send(self, leaf: str, payload: bytes, **properties: Any) -> list[Publication]:
        """Hand one message to the plane; what it published because of it."""
        self.seen = len(self.device.pending())
        await self.device.handle_message(Message(topic=f"{ROOT}/{leaf}", payload=payload, qos=1,
                                                 retain=False, **properties))
        await asyncio.sleep(0)
        return self.device.pending()[self.seen:]

    def events(self, publications: list[Publication] | None = None) -> list[docs.Event]:
        publications = self.device.pending() if publications is None else publications
        return [docs.decode(p.payload) for p in publications if p.topic.endswith("/events")]

    def responses(self, publications: list[Publication]) -> list[tuple[Publication,
                                                                       docs.Response]]:
        return [(p, docs.decode(p.payload)) for p in publications if p.what == "resp"]

    async def settled(self) -> None:
        await self.device.settle()


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout_s))


def desired(version: int, model_version: int | None = 2, **fields: Any) -> docs.Desired:
    return docs.Desired(fleet=fields.pop("fleet", FLEET), device=fields.pop("device", DEVICE),
                        version=version, issued_at=Clock()(),
                        model=None if model_version is None else model(model_version), **fields)


def command(request_id: str, name: str, key: Any = KEY, **fields: Any) -> bytes:
    issued = Clock()()
    document = docs.Command(fleet=fields.pop("fleet", FLEET), device=fields.pop("device", DEVICE),
                            request_id=request_id, command=name, issued_at=issued,
                            expires_at=fields.pop("expires_at",
                                                  issued + datetime.timedelta(minutes=5)),
                            **fields)
    return docs.sign(document, key) if key is not None else document.encode()


# -- desired ----------------------------------------------------------------------------------

def test_a_signed_desired_is_stored_before_it_is_acted_on_and_converged_to(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path, delay_s=0.05) as plane:
            envelope = docs.sign(desired(1, 2), KEY)
            sent = plane.send("desired", envelope)
            task = asyncio.ensure_future(sent)
            await plane.steps.event("download").wait()
            # The download started: the document was on disk already.
            assert FleetFiles(tmp_path / "state").read_desired() == envelope
            await task
            await plane.settled()
            assert plane.steps.serving_now().version == 2
            status = plane.device.status()["desired"]
            assert status == {"version": 1, "status": "converged", "reason": None}
            types = [event.type for event in plane.events()]
            assert types[0] == "desired.accepted"
            assert "update.state" in types and "update.outcome" in types
            saved = FleetFiles(tmp_path / "state").read_state()
            assert (saved.desired_version, saved.desired_status) == (1, "converged")
            # The same document again (a resubscription, a redelivery): nothing happens.
            again = await plane.send("desired", envelope)
            assert again == [] and plane.updater.counters.attempts == 1

    run(scenario)


def test_an_older_desired_is_refused_with_an_event_and_the_newest_wins(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path, delay_s=0.05) as plane:
            for version, model_version in ((1, 2), (2, 3), (3, 4)):
                await plane.send("desired", docs.sign(desired(version, model_version), KEY))
            replay = await plane.send("desired", docs.sign(desired(2, 3), KEY))
            await plane.settled()
            assert plane.steps.serving_now().version == 4
            assert plane.updater.counters.swaps == 1  # only the newest was committed
            (event,) = plane.events(replay)
            assert event.type == "desired.refused"
            assert (event.detail["reason"], event.detail["accepted_version"]) == (
                "old_version", 3)
            assert plane.device.status()["desired"]["version"] == 3

    run(scenario)


def test_the_stored_desired_is_converged_to_at_start_without_any_broker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path, delay_s=0.2) as plane:
            await plane.send("desired", docs.sign(desired(5, 3), KEY))
            await plane.steps.event("download").wait()
        # Stopped mid-update (as by a crash), then started again with no broker at all.
        async with Plane(tmp_path) as plane:
            await asyncio.sleep(0.05)
            await plane.settled()
            assert plane.steps.serving_now().version == 3
            assert plane.device.status()["desired"] == {"version": 5, "status": "converged",
                                                        "reason": None}
        # Converged: a third start does nothing.
        async with Plane(tmp_path) as plane:
            await plane.settled()
            assert plane.updater.counters.attempts == 0

    run(scenario)


def test_a_stored_desired_that_no_longer_verifies_is_not_used(tmp_path: Path) -> None:
    async def scenario() -> None:
        files = FleetFiles(tmp_path / "state")
        files.write_desired(docs.sign(desired(1, 2), OTHER_KEY))
        async with Plane(tmp_path) as plane:
            await plane.settled()
            assert plane.updater.counters.attempts == 0
            (event,) = plane.events()
            assert (event.type, event.detail["reason"]) == ("desired.refused", "unknown_key")

    run(scenario)


def test_an_authorised_downgrade_is_applied_and_an_unauthorised_one_fails(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path, serving=3) as plane:
            await plane.send("desired", docs.sign(desired(1, 2), KEY))
            await plane.settled()
            assert plane.steps.serving_now().version == 3
            assert plane.device.status()["desired"] == {"version": 1, "status": "failed",
                                                        "reason": "downgrade"}
            await plane.send("desired", docs.sign(desired(2, 2, allow_downgrade=True), KEY))
            await plane.settled()
            assert plane.steps.serving_now().version == 2
            assert plane.device.status()["desired"]["status"] == "converged"

    run(scenario)


def test_a_desired_without_a_model_converges_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            await plane.send("desired", docs.sign(desired(1, None), KEY))
            await plane.settled()
            assert plane.device.status()["desired"]["status"] == "converged"
            assert plane.updater.counters.attempts == 0

    run(scenario)


# -- commands -----------------------------------------------------------------------------------

def test_a_command_repeated_is_answered_again_and_run_once_even_across_a_restart(
        tmp_path: Path) -> None:
    update = command("req-1", "update", args={"model": model(2).to_json()})

    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            first = plane.responses(await plane.send(
                "cmd", update, response_topic=f"{ROOT}/resp/x", correlation_data=b"c1"))
            second = plane.responses(await plane.send(
                "cmd", update, response_topic=f"{ROOT}/resp/x", correlation_data=b"c2"))
            await plane.settled()
            assert plane.updater.counters.attempts == 1
        async with Plane(tmp_path) as plane:
            third = plane.responses(await plane.send("cmd", update))
            await plane.settled()
            assert plane.updater.counters.attempts == 0
        (p1, r1), (p2, r2), (p3, r3) = first + second + third
        assert r1.ok and r1.result["result"] == "started" and not r1.repeated
        for response in (r2, r3):
            assert response.repeated and response.ok and response.result == r1.result
            assert response.answered_at == r1.answered_at
        # Each answer on the asked response topic with its own message's correlation data.
        assert (p1.topic, p1.correlation_data) == (f"{ROOT}/resp/x", b"c1")
        assert (p2.topic, p2.correlation_data) == (f"{ROOT}/resp/x", b"c2")
        assert (p3.topic, p3.correlation_data) == (f"{ROOT}/resp/req-1", None)

    run(scenario)


def test_a_command_interrupted_by_a_restart_is_never_run_again(tmp_path: Path) -> None:
    rollback = command("req-2", "rollback")

    async def scenario() -> None:
        # An updater that never finishes its recovery: the command waits for it, and the
        # daemon stops meanwhile.
        async with Plane(tmp_path, recover=False) as plane:
            plane.steps.set_serving(UrlSteps.bundle(url(2)), UrlSteps.bundle(url(1)))
            task = asyncio.ensure_future(plane.send("cmd", rollback))
            await asyncio.sleep(0.2)
            assert not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async with Plane(tmp_path) as plane:
            ((_, response),) = plane.responses(await plane.send("cmd", rollback))
            assert not response.ok and response.error.reason == "interrupted"
            ((_, again),) = plane.responses(await plane.send("cmd", rollback))
            assert again.repeated and again.error == response.error
            await plane.settled()
            assert plane.steps.called("revert") == 0
            assert plane.steps.serving_now().version == 2

    run(scenario)


def test_a_response_topic_outside_the_devices_own_is_not_used(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            status = command("s1", "status", key=None, expires_at=None)
            for asked in ("edge/plant-a/cam-02/resp/x", "edge/plant-a/+/resp/x", "elsewhere",
                          f"{ROOT}/reported"):
                ((publication, response),) = plane.responses(await plane.send(
                    "cmd", status, response_topic=asked, correlation_data=b"k"))
                assert publication.topic == f"{ROOT}/resp/s1"
                assert publication.correlation_data == b"k"

    run(scenario)


def test_status_may_come_unsigned_and_reports_the_device(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            ((_, response),) = plane.responses(await plane.send(
                "cmd", command("s1", "status", key=None, expires_at=None)))
            assert response.ok
            reported = docs.Reported.from_json(response.result["reported"])
            assert reported.applied == docs.Applied(name="tiny", version=1,
                                                    sha256=model(1).sha256)
            assert reported.updater.state == "idle"

    run(scenario)


@pytest.mark.parametrize(("payload", "reason"), [
    (command("u1", "update", key=None, args={"model": model(2).to_json()}), "unsigned"),
    (command("u2", "rollback", key=None), "unsigned"),
    (command("u3", "update", key=OTHER_KEY, args={"model": model(2).to_json()}), "unknown_key"),
    (command("u4", "reload", device="cam-02"), "wrong_device"),
    (command("u5", "rollback", fleet="plant-b"), "wrong_device"),
    (command("u6", "rollback", expires_at=Clock()() + datetime.timedelta(seconds=1)), None),
])
def test_a_command_that_must_not_run_is_refused_with_an_answer_and_an_event(
        tmp_path: Path, payload: bytes, reason: str | None) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            plane.clock.now += datetime.timedelta(seconds=2)  # u6 has expired by now
            published = await plane.send("cmd", payload)
            ((_, response),) = plane.responses(published)
            (event,) = plane.events(published)
            assert not response.ok
            assert response.error.reason == (reason or "expired")
            assert (event.type, event.detail["reason"]) == ("cmd.refused", reason or "expired")
            await plane.settled()
            assert plane.updater.counters.attempts == 0 and plane.steps.calls == []

    run(scenario)


def test_reload_retries_the_stored_desired_after_a_failure(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            plane.steps.behaviour["download"] = "fail"
            await plane.send("desired", docs.sign(desired(1, 2), KEY))
            await plane.settled()
            assert plane.device.status()["desired"]["status"] == "failed"
            plane.steps.behaviour.clear()
            ((_, response),) = plane.responses(await plane.send("cmd", command("r1", "reload")))
            assert response.ok and response.result["desired_version"] == 1
            await plane.settled()
            assert plane.steps.serving_now().version == 2
            assert plane.device.status()["desired"]["status"] == "converged"

    run(scenario)


def test_a_rollback_command_rolls_back_and_the_desired_does_not_return_at_restart(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Plane(tmp_path) as plane:
            await plane.send("desired", docs.sign(desired(1, 2), KEY))
            await plane.settled()
            ((_, response),) = plane.responses(await plane.send("cmd",
                                                                command("b1", "rollback")))
            assert response.ok and response.result["result"] == "rolling_back"
            await plane.settled()
            assert plane.steps.serving_now().version == 1
        async with Plane(tmp_path) as plane:
            await plane.settled()
            assert plane.steps.serving_now().version == 1
            assert plane.device.status()["desired"]["reason"] == "operator_rollback"

    run(scenario)


def test_reported_sequences_keep_increasing_across_restarts(tmp_path: Path) -> None:
    async def scenario() -> None:
        sequences = []
        for _ in range(3):
            async with Plane(tmp_path) as plane:
                for index in range(3):
                    ((_, response),) = plane.responses(await plane.send(
                        "cmd", command(f"s{len(sequences)}", "status", key=None,
                                       expires_at=None)))
                    sequences.append(response.result["reported"]["sequence"])
        assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)

    run(scenario)


# -- hostile payloads -------------------------------------------------------------------------

def _tamper(envelope: bytes) -> bytes:
    data = json.loads(envelope)
    data["payload"] = data["payload"].replace('"version":9', '"version":10')
    return json.dumps(data).encode()


HOSTILE_DESIRED = [
    b"", b"{", b"null", b"[]", b'"x"', b"\xff" * 10, b"{" * 5000, b"1" * 200000,
    desired(9, 5).encode(),  # unsigned
    docs.sign(desired(9, 5), OTHER_KEY),  # an unknown key
    _tamper(docs.sign(desired(9, 5), KEY)),  # a payload changed after signing
    docs.sign(desired(9, 5, device="cam-02"), KEY),  # another device's
    docs.sign(desired(9, 5, fleet="plant-b"), KEY),
    docs.sign(docs.Command(fleet=FLEET, device=DEVICE, request_id="x", command="status",
                           issued_at=Clock()()), KEY),  # signed, but not a desired document
    json.dumps({"payload": 5, "signature": {}}).encode(),
]


HOSTILE_CMD = [
    b"", b"{", b"\xff", b"{" * 5000, b"1" * 200000,
    command("c1", "update", key=None, args={"model": model(5).to_json()}),  # unsigned
    command("c2", "rollback", key=None),
    command("c3", "reload", key=None),
    command("c4", "rollback", key=OTHER_KEY),  # an unknown key
    _tamper(command("c5", "rollback", key=KEY).replace(b"c5", b"c6")),  # changed after signing
    command("c7", "rollback", device="cam-02"),  # another device's
    command("c8", "update", fleet="plant-b", args={"model": model(5).to_json()}),
    docs.sign(desired(9, 5), KEY),  # a signed desired document on the cmd topic
]


def _envelope_of(document: dict[str, Any], key: Any) -> bytes:
    import base64

    from models.signing import compute_key_id
    payload = json.dumps(document).encode()
    return json.dumps({"payload": payload.decode(), "signature": {
        "algorithm": "ed25519", "key_id": compute_key_id(key.public_key()),
        "signature": base64.b64encode(key.sign(payload)).decode()}}).encode()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**64, max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=10), children, max_size=3), max_leaves=12)


@st.composite
def mutated(draw: Any, base: dict[str, Any]) -> dict[str, Any]:
    """A document with one field (at any depth) replaced by anything, or removed."""
    document = json.loads(json.dumps(base))
    target = document
    while True:
        key = draw(st.sampled_from(sorted(target)))
        if isinstance(target[key], dict) and target[key] and draw(st.booleans()):
            target = target[key]
            continue
        break
    if draw(st.booleans()):
        target[key] = draw(JSON)
    else:
        del target[key]
    return document


def hostile(kind: str) -> Any:
    if kind == "desired":
        base = desired(9, 5).to_json()
    else:
        base = docs.Command(fleet=FLEET, device=DEVICE, request_id="h1", command="update",
                            issued_at=Clock()(), args={"model": model(5).to_json()},
                            expires_at=Clock()() + datetime.timedelta(minutes=5)).to_json()
    signed_mutation = mutated(base).map(lambda document: _envelope_of(document, KEY))
    return st.one_of(
        st.sampled_from(HOSTILE_DESIRED if kind == "desired" else HOSTILE_CMD),
        st.binary(max_size=200),
        JSON.map(lambda value: json.dumps(value).encode()),
        mutated(base).map(lambda document: json.dumps(document).encode()),  # unsigned
        signed_mutation.filter(lambda payload: _invalid(kind, payload)),  # signed, invalid
        mutated(base).map(lambda document: _envelope_of(document, OTHER_KEY)),
    )


def _invalid(kind: str, payload: bytes) -> bool:
    try:
        document = docs.open_envelope(payload, [KEY.public_key()]).document
    except docs.DocumentError:
        return True
    # Validly signed and well formed: hostile only if it is not for this device, or not of the
    # kind the topic carries (a signed command for this device is the operator's, and runs).
    expected = docs.Desired if kind == "desired" else docs.Command
    return not (isinstance(document, expected)
                and (document.fleet, document.device) == (FLEET, DEVICE))


@pytest.mark.parametrize("leaf", ["desired", "cmd"])
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
def test_hostile_payloads_end_in_an_event_with_a_reason_never_an_action(
        tmp_path_factory: pytest.TempPathFactory, leaf: str, data: Any) -> None:
    payloads = data.draw(st.lists(hostile("desired" if leaf == "desired" else "cmd"),
                                  min_size=1, max_size=4))
    directory = tmp_path_factory.mktemp("hostile")

    async def scenario() -> None:
        async with Plane(directory) as plane:
            for payload in payloads:
                published = await plane.send(leaf, payload)
                answers = plane.responses(published)
                for _, response in answers:
                    assert not response.ok or response.result.get("reported"), response
                events = plane.events(published)
                harmless_status = any(response.ok for _, response in answers)
                if payload == b"" and leaf == "desired":
                    assert [event.type for event in events] == ["desired.cleared"]
                elif not harmless_status:
                    assert events, payload
                    assert all(event.detail.get("reason") for event in events), events
                    assert all(event.type.endswith(".refused") for event in events), events
            await plane.settled()
            assert plane.steps.calls == [] and plane.updater.counters.attempts == 0
            assert plane.device.desired is None
            assert FleetFiles(directory / "state").read_desired() is None

    run(scenario)


# -- configuration ---------------------------------------------------------------------------

def test_fleet_configuration_is_validated_naming_the_key(tmp_path: Path) -> None:
    from agent.config import load_config
    from models.signing import write_keypair

    key_path = tmp_path / "fleet.key"
    write_keypair(key_path)
    base = {"fleet.enabled": True, "fleet.broker": "broker.local", "fleet.fleet": FLEET,
            "fleet.public_keys": [str(key_path) + ".pub"], "device_id": DEVICE}
    config = load_config(None, env={}, overrides=base)
    assert len(config.fleet.keys) == 1 and config.fleet.port == 8883 and config.fleet.tls
    (tmp_path / "password").write_text("s3cret\n")
    config = load_config(None, env={"EDGE_AGENT_FLEET_USERNAME": DEVICE}, overrides={
        **base, "fleet.password_file": str(tmp_path / "password")})
    assert config.fleet.password.reveal() == "s3cret" and "s3cret" not in repr(config)
    for change, key in [({"device_id": ""}, "device_id"),
                        ({"device_id": "rollouts"}, "device_id"),
                        ({"fleet.broker": ""}, "fleet.broker"),
                        ({"fleet.fleet": "a/b"}, "fleet.fleet"),
                        ({"fleet.public_keys": []}, "fleet.public_keys"),
                        ({"fleet.public_keys": [str(tmp_path / "none.pub")]},
                         "fleet.public_keys"),
                        ({"fleet.protocol": "4"}, "fleet.protocol"),
                        ({"fleet.password_file": str(tmp_path / "password")}, "fleet.username"),
                        ({"fleet.username": "u", "fleet.password_file": str(tmp_path / "no")},
                         "fleet.password_file"),
                        ({"fleet.tls": False, "fleet.ca_file": "ca.pem"}, "fleet.ca_file"),
                        ({"fleet.cert_file": "c.pem"}, "fleet.key_file"),
                        ({"fleet.reconnect_min_s": 5.0, "fleet.reconnect_max_s": 1.0},
                         "fleet.reconnect_max_s"),
                        ({"fleet.keepalive_s": 1}, "fleet.keepalive_s")]:
        with pytest.raises(ConfigError) as refused:
            load_config(None, env={}, overrides={**base, **change})
        assert refused.value.fields["key"] == key, (change, refused.value)
    # Disabled, nothing of it is needed.
    assert not load_config(None, env={}).fleet.enabled
