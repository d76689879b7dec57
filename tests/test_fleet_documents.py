"""The fleet's topics, documents and signed envelope (agent/fleet/topics.py, documents.py): every
document the code writes validates against its published JSON Schema, every document a schema
refuses is refused by the code too, and no input at all makes the parser fail other than with a
DocumentError that names its reason."""

from __future__ import annotations

import copy
import datetime
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from agent.errors import DocumentError
from agent.fleet import documents as docs
from agent.fleet import topics
from models.signing import compute_key_id, generate_private_key

jsonschema = pytest.importorskip("jsonschema")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
T0 = datetime.datetime(2024, 5, 1, 12, 0, 0, 250000, tzinfo=datetime.timezone.utc)
SHA = "ab" * 32
MODEL = docs.ModelSpec(name="tiny", version=2, url="https://files.example/tiny-2.bundle",
                       sha256=SHA)
KINDS = ("desired", "cmd", "resp", "reported", "event", "online")


def validator(kind: str) -> Any:
    schema = docs.load_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


VALIDATORS = {kind: validator(kind) for kind in (*KINDS, "envelope")}


def samples() -> list[docs.Document]:
    """At least one document of every kind, and every optional part both present and absent."""
    base = {"fleet": "plant-a", "device": "cam-01"}
    return [
        docs.Desired(**base, version=1, issued_at=T0),
        docs.Desired(**base, version=7, issued_at=T0, model=MODEL, allow_downgrade=True,
                     rollout="r-2024.05", power={"profile": "15W"},
                     settings={"log": {"level": "debug"}}),
        docs.Command(**base, request_id="req:1", command="status", issued_at=T0),
        docs.Command(**base, request_id="r2", command="status", issued_at=T0,
                     expires_at=T0 + datetime.timedelta(minutes=5)),
        docs.Command(**base, request_id="r3", command="rollback", issued_at=T0,
                     expires_at=T0 + datetime.timedelta(minutes=5)),
        docs.Command(**base, request_id="r4", command="reload", issued_at=T0,
                     expires_at=T0 + datetime.timedelta(hours=24)),
        docs.Command(**base, request_id="r5", command="update", issued_at=T0,
                     args={"model": MODEL.to_json()},
                     expires_at=T0 + datetime.timedelta(seconds=1)),
        docs.Response(**base, request_id="r5", ok=True, answered_at=T0,
                      result={"result": "started"}),
        docs.Response(**base, request_id="r6", ok=False, answered_at=T0, repeated=True,
                      error=docs.ErrorInfo(reason="expired", message="it expired at ...")),
        docs.Reported(**base, sequence=0, reported_at=T0, agent_version="0.1.0",
                      updater=docs.UpdaterStatus(state="idle")),
        docs.Reported(**base, sequence=12, reported_at=T0, agent_version="0.1.0",
                      fingerprint={"device_class": "orin-nano-8gb", "platform": "aarch64"},
                      applied=docs.Applied(name="tiny", version=2, sha256=SHA),
                      desired=docs.DesiredStatus(version=7, status="failed",
                                                 reason="attempts_exhausted"),
                      updater=docs.UpdaterStatus(
                          state="failed", update_id="u1",
                          error=docs.ErrorInfo(reason="hash_mismatch", message="..."),
                          last_outcome={"result": "failed"}),
                      health={"state": "serving", "p99_ms": 12.5}),
        docs.Reported(**base, sequence=3, reported_at=T0, agent_version="0.1.0",
                      applied=docs.Applied(name="tiny", version=1),
                      desired=docs.DesiredStatus(version=2, status="converged"),
                      updater=docs.UpdaterStatus(state="canary", update_id="u2")),
        docs.Event(**base, at=T0, type="update.progress", detail={"received_bytes": 10}),
        docs.Event(**base, at=T0, type="desired.refused"),
        docs.Online(**base, online=True, since=T0, agent_version="0.1.0"),
        docs.Online(**base, online=False, since=T0, agent_version="0.1.0"),
    ]


@pytest.mark.parametrize("document", samples(), ids=lambda d: f"{d.kind}")
def test_every_document_round_trips_and_validates_against_its_schema(
        document: docs.Document) -> None:
    data = document.encode()
    as_json = json.loads(data)
    VALIDATORS[document.kind].validate(as_json)
    assert docs.decode(data) == document
    assert docs.decode(data, type(document)) == document
    assert type(document).from_json(as_json) == document


def test_every_kind_has_a_sample_and_a_schema_file() -> None:
    assert {document.kind for document in samples()} == set(KINDS) == set(docs.KINDS)
    for kind in (*KINDS, "envelope"):
        assert docs.schema_path(kind).is_file()


@pytest.mark.parametrize("document", [d for d in samples() if d.kind in ("desired", "cmd")],
                         ids=lambda d: d.kind)
def test_a_signed_envelope_validates_and_opens_with_the_trusted_key_only(
        document: docs.Document) -> None:
    key, other = generate_private_key(), generate_private_key()
    envelope = docs.sign(document, key)
    parsed = json.loads(envelope)
    VALIDATORS["envelope"].validate(parsed)
    VALIDATORS[document.kind].validate(json.loads(parsed["payload"]))
    received = docs.open_envelope(envelope, [other.public_key(), key.public_key()])
    assert received.document == document
    assert received.key_id == compute_key_id(key.public_key()) and received.signed
    assert docs.read_message(envelope, [key.public_key()]).document == document
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(envelope, [other.public_key()])
    assert refused.value.reason == "unknown_key"
    assert refused.value.fields["key_id"] == received.key_id


def test_a_plain_document_is_read_unsigned_and_refused_where_a_signature_is_needed() -> None:
    command = samples()[2]
    received = docs.read_message(command.encode(), [generate_private_key().public_key()])
    assert received.document == command and received.key_id is None and not received.signed
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(command.encode(), [generate_private_key().public_key()])
    assert refused.value.reason == "unsigned"


def _envelope(document: docs.Document, key: Any) -> dict[str, Any]:
    return json.loads(docs.sign(document, key))


@pytest.mark.parametrize(("change", "reason", "field"), [
    (lambda e: e.update(payload=e["payload"].replace('"version":7', '"version":8')),
     "bad_signature", "signature.signature"),
    (lambda e: e["signature"].update(signature="A" * 86 + "=="), "bad_signature",
     "signature.signature"),
    (lambda e: e["signature"].update(signature="AAAA"), "bad_envelope", "signature.signature"),
    (lambda e: e["signature"].update(key_id="ABCDEF0123456789"), "bad_envelope",
     "signature.key_id"),
    (lambda e: e["signature"].update(algorithm="rsa"), "bad_envelope", "signature"),
    (lambda e: e["signature"].update(extra=1), "bad_envelope", "signature.extra"),
    (lambda e: e.pop("signature"), "bad_field", "signature"),
    (lambda e: e.update(payload={"kind": "desired"}), "bad_envelope", "payload"),
    (lambda e: e.update(extra=True), "bad_field", "extra"),
])
def test_a_tampered_or_malformed_envelope_is_refused_naming_what(
        change: Any, reason: str, field: str) -> None:
    key = generate_private_key()
    envelope = _envelope(samples()[1], key)
    change(envelope)
    data = json.dumps(envelope).encode()
    assert not VALIDATORS["envelope"].is_valid(envelope) or reason == "bad_signature"
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(data, [key.public_key()])
    assert (refused.value.reason, refused.value.field) == (reason, field)


def test_an_envelope_is_refused_without_trusted_keys_and_its_payload_is_parsed_strictly() -> None:
    key = generate_private_key()
    envelope = docs.sign(samples()[1], key)
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(envelope, [])
    assert refused.value.reason == "no_trusted_keys"
    # A well-signed payload that is not a valid document is still refused.
    payload = b'{"kind":"desired","schema_version":1}'
    bad = json.dumps({"payload": payload.decode(), "signature": {
        "algorithm": "ed25519", "key_id": compute_key_id(key.public_key()),
        "signature": __import__("base64").b64encode(key.sign(payload)).decode()}}).encode()
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(bad, [key.public_key()])
    assert (refused.value.reason, refused.value.field) == ("bad_field", "fleet")


# -- documents the schemas refuse are refused by the code ------------------------------------

def _desired() -> dict[str, Any]:
    return samples()[1].to_json()


def _update() -> dict[str, Any]:
    return samples()[6].to_json()


def _resp() -> dict[str, Any]:
    return samples()[7].to_json()


def _reported() -> dict[str, Any]:
    return samples()[10].to_json()


def _set(path: str, value: Any) -> Any:
    def change(document: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = document
        for part in parents:
            target = target[part]
        target[last] = value
    return change


def _drop(path: str) -> Any:
    def change(document: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = document
        for part in parents:
            target = target[part]
        del target[last]
    return change


BAD = [
    # (name, document maker, change, the field the code names)
    ("kind", _desired, _set("kind", "wanted"), "kind"),
    ("schema_version", _desired, _set("schema_version", 2), "schema_version"),
    ("schema_version_text", _desired, _set("schema_version", "1"), "schema_version"),
    ("schema_version_bool", _desired, _set("schema_version", True), "schema_version"),
    ("fleet_wildcard", _desired, _set("fleet", "plant+"), "fleet"),
    ("device_slash", _desired, _set("device", "cam/01"), "device"),
    ("device_hash", _desired, _set("device", "#"), "device"),
    ("device_reserved", _desired, _set("device", "rollouts"), "device"),
    ("device_long", _desired, _set("device", "d" * 65), "device"),
    ("device_missing", _desired, _drop("device"), "device"),
    ("version_zero", _desired, _set("version", 0), "version"),
    ("version_text", _desired, _set("version", "7"), "version"),
    ("version_bool", _desired, _set("version", True), "version"),
    ("version_huge", _desired, _set("version", 2**63), "version"),
    ("version_float", _desired, _set("version", 7.5), "version"),
    ("issued_at_local", _desired, _set("issued_at", "2024-05-01T12:00:00+02:00"), "issued_at"),
    ("issued_at_date", _desired, _set("issued_at", "2024-05-01"), "issued_at"),
    ("issued_at_space", _desired, _set("issued_at", "2024-05-01 12:00:00Z"), "issued_at"),
    ("issued_at_number", _desired, _set("issued_at", 1714564800), "issued_at"),
    ("model_text", _desired, _set("model", "tiny"), "model"),
    ("model_name", _desired, _set("model.name", "Tiny Model"), "model.name"),
    ("model_name_long", _desired, _set("model.name", "t" * 101), "model.name"),
    ("model_version", _desired, _set("model.version", -1), "model.version"),
    ("model_url_scheme", _desired, _set("model.url", "ftp://x/y"), "model.url"),
    ("model_url_space", _desired, _set("model.url", "https://x/a b"), "model.url"),
    ("model_sha_upper", _desired, _set("model.sha256", SHA.upper()), "model.sha256"),
    ("model_sha_short", _desired, _set("model.sha256", "ab"), "model.sha256"),
    ("model_extra", _desired, _set("model.size", 1), "model.size"),
    ("model_missing_url", _desired, _drop("model.url"), "model.url"),
    ("allow_downgrade_int", _desired, _set("allow_downgrade", 1), "allow_downgrade"),
    ("allow_downgrade_missing", _desired, _drop("allow_downgrade"), "allow_downgrade"),
    ("rollout_int", _desired, _set("rollout", 3), "rollout"),
    ("rollout_slash", _desired, _set("rollout", "a/b"), "rollout"),
    ("power_list", _desired, _set("power", []), "power"),
    ("settings_null", _desired, _set("settings", None), "settings"),
    ("unknown_field", _desired, _set("urgent", True), "urgent"),
    ("cmd_unknown", _update, _set("command", "reboot"), "command"),
    ("cmd_request_id_space", _update, _set("request_id", "a b"), "request_id"),
    ("cmd_request_id_long", _update, _set("request_id", "r" * 65), "request_id"),
    ("cmd_request_id_empty", _update, _set("request_id", ""), "request_id"),
    ("cmd_no_expiry", _update, _drop("expires_at"), "expires_at"),
    ("cmd_update_no_model", _update, _set("args", {}), "args.model"),
    ("cmd_update_bad_model", _update, _set("args.model.sha256", "x"), "args.model.sha256"),
    ("cmd_update_extra_arg", _update, _set("args.force", True), "args.force"),
    ("cmd_status_arg", lambda: samples()[2].to_json(), _set("args", {"verbose": True}),
     "args.verbose"),
    ("cmd_args_list", _update, _set("args", []), "args"),
    ("cmd_expiry_bad", _update, _set("expires_at", "soon"), "expires_at"),
    ("resp_ok_with_error", _resp, _set("error", {"reason": "x", "message": "y"}), "error"),
    ("resp_not_ok_without_error", _resp, _set("ok", False), "error"),
    ("resp_error_reason", lambda: samples()[8].to_json(), _set("error.reason", "Bad Reason"),
     "error.reason"),
    ("resp_repeated_missing", _resp, _drop("repeated"), "repeated"),
    ("reported_sequence", _reported, _set("sequence", -1), "sequence"),
    ("reported_state", _reported, _set("updater.state", "sleeping"), "updater.state"),
    ("reported_desired_status", _reported, _set("desired.status", "done"), "desired.status"),
    ("reported_applied_sha", _reported, _set("applied.sha256", None), "applied.sha256"),
    ("reported_health_list", _reported, _set("health", [1]), "health"),
    ("reported_updater_missing", _reported, _drop("updater"), "updater"),
    ("event_type", lambda: samples()[12].to_json(), _set("type", "Update State"), "type"),
    ("event_detail_null", lambda: samples()[12].to_json(), _set("detail", None), "detail"),
    ("online_text", lambda: samples()[14].to_json(), _set("online", "yes"), "online"),
]


@pytest.mark.parametrize(("make", "change", "field"), [entry[1:] for entry in BAD],
                         ids=[entry[0] for entry in BAD])
def test_a_document_the_schema_refuses_is_refused_by_the_code_naming_the_field(
        make: Any, change: Any, field: str) -> None:
    document = make()
    kind = document["kind"]
    change(document)
    assert not VALIDATORS[kind].is_valid(document), "the schema accepts it"
    with pytest.raises(DocumentError) as refused:
        docs.decode(json.dumps(document).encode(), docs.KINDS[kind])
    assert refused.value.field == field, refused.value
    assert field.split(".")[-1] in str(refused.value)


@pytest.mark.parametrize(("document", "field"), [
    # Refused by the code beyond what a schema can say.
    ({**_update(), "expires_at": "2024-05-01T11:00:00.000Z"}, "expires_at"),  # before issued
    ({**_update(), "expires_at": "2024-05-03T12:00:00.000Z"}, "expires_at"),  # over a day
    ({**_desired(), "issued_at": "2024-02-30T12:00:00Z"}, "issued_at"),  # no such day
    ({**_desired(), "issued_at": "2024-05-01T25:00:00Z"}, "issued_at"),
    ({**_desired(), "schema_version": 1.0}, "schema_version"),
    ({**_desired(), "version": 7.0}, "version"),
])
def test_the_code_refuses_what_the_schema_cannot_express(document: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(DocumentError) as refused:
        docs.decode(json.dumps(document).encode())
    assert refused.value.field == field


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xff\xfe{}", "not_utf8"),
    (b"{", "not_json"),
    (b"", "not_json"),
    (b'{"kind":"desired","kind":"cmd"}', "not_json"),  # a duplicate key
    (b'{"kind":"event","x":NaN}', "not_json"),
    (b'{"kind":"event","x":1e999}', "not_json"),
    (b"[" * 100000 + b"]" * 100000, "too_large"),
    (b"[" * 60000 + b"]" * 60000, "too_large"),
    (b"[" * 30000 + b"]" * 30000, "not_json"),  # too deep for the parser
    (b'{"x":' + b"1" * 5000 + b"}", "not_json"),  # more digits than Python parses
    (b"[]", "bad_field"),
    (b'"desired"', "bad_field"),
    (b'{"kind":"wish"}', "unknown_kind"),
    (b'{"kind":"desired","schema_version":2}', "schema_version"),
])
def test_malformed_json_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(DocumentError) as refused:
        docs.decode(data)
    assert refused.value.reason == reason


def test_a_message_is_refused_by_size_before_it_is_parsed() -> None:
    huge = b'{"payload":"' + b"x" * docs.MAX_MESSAGE_BYTES + b'"}'
    with pytest.raises(DocumentError) as refused:
        docs.read_message(huge, [])
    assert refused.value.reason == "too_large"
    # A plain document is held to the document bound even inside the message bound.
    plain = json.dumps({**samples()[12].to_json(),
                        "detail": {"x": "y" * docs.MAX_DOCUMENT_BYTES}}).encode()
    assert len(plain) < docs.MAX_MESSAGE_BYTES
    with pytest.raises(DocumentError) as refused:
        docs.read_message(plain, [])
    assert refused.value.reason == "too_large"
    with pytest.raises(DocumentError) as refused:
        docs.Event(fleet="f", device="d", at=T0, type="x",
                   detail={"x": "y" * docs.MAX_DOCUMENT_BYTES}).encode()
    assert refused.value.reason == "too_large"


def test_the_largest_document_still_fits_its_envelope() -> None:
    # Quotes: two bytes each in the document (\"), and those two bytes each two more in the
    # envelope: the worst case of escaping.
    filler = '"' * ((docs.MAX_DOCUMENT_BYTES - 400) // 2)
    document = docs.Desired(fleet="f", device="d", version=1, issued_at=T0,
                            settings={"x": filler})
    assert docs.MAX_DOCUMENT_BYTES - 400 < len(document.encode()) <= docs.MAX_DOCUMENT_BYTES
    key = generate_private_key()
    envelope = docs.sign(document, key)
    assert len(envelope) <= docs.MAX_MESSAGE_BYTES
    assert docs.open_envelope(envelope, [key.public_key()]).document == document


def test_a_payload_with_a_lone_surrogate_is_refused_not_crashed_on() -> None:
    key = generate_private_key()
    envelope = json.dumps({"payload": "\ud800", "signature": {
        "algorithm": "ed25519", "key_id": compute_key_id(key.public_key()),
        "signature": "A" * 86 + "=="}}).encode()
    with pytest.raises(DocumentError) as refused:
        docs.open_envelope(envelope, [key.public_key()])
    assert refused.value.reason == "bad_signature"


# -- times ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("2024-05-01T12:00:00Z", T0.replace(microsecond=0)),
    ("2024-05-01T12:00:00.25Z", T0),
    ("2024-05-01T12:00:00.250000Z", T0),
    ("2024-02-29T00:00:00.000001Z",
     datetime.datetime(2024, 2, 29, 0, 0, 0, 1, tzinfo=datetime.timezone.utc)),
])
def test_times_parse_strictly_and_format_back(text: str, expected: datetime.datetime) -> None:
    parsed = docs.parse_time(text, "at")
    assert parsed == expected
    assert docs.parse_time(docs.format_time(parsed), "at") == parsed


@pytest.mark.parametrize("text", [
    "2024-05-01T12:00:00", "2024-05-01T12:00:00z", "2024-05-01T12:00:00.Z",
    "2024-05-01T12:00:00.1234567Z", "2023-02-29T00:00:00Z", "2024-05-01T12:00:60Z",
    "٢٠٢٤-05-01T12:00:00Z", " 2024-05-01T12:00:00Z", None, 0,
])
def test_times_of_any_other_form_are_refused(text: Any) -> None:
    with pytest.raises(DocumentError) as refused:
        docs.parse_time(text, "issued_at")
    assert refused.value.field == "issued_at"


def test_formatting_writes_milliseconds_and_utc() -> None:
    local = T0.astimezone(datetime.timezone(datetime.timedelta(hours=2)))
    assert docs.format_time(local) == "2024-05-01T12:00:00.250Z"


# -- topics ---------------------------------------------------------------------------------

def test_topics_are_built_and_parsed_back() -> None:
    assert topics.device_topic("plant-a", "cam-01", "desired") == "edge/plant-a/cam-01/desired"
    for leaf in topics.DEVICE_LEAVES:
        parsed = topics.parse_topic(topics.device_topic("plant-a", "cam-01", leaf))
        assert (parsed.fleet, parsed.device, parsed.leaf, parsed.rest) == (
            "plant-a", "cam-01", leaf, None)
    response = topics.parse_topic(topics.response_topic("plant-a", "cam-01", "req:7"))
    assert (response.leaf, response.request_id, response.rollout_id) == ("resp", "req:7", None)
    rollout = topics.parse_topic(topics.rollout_topic("plant-a", "r1"))
    assert (rollout.device, rollout.leaf, rollout.rollout_id) == (None, "rollouts", "r1")
    assert topics.fleet_filter("plant-a", "reported") == "edge/plant-a/+/reported"
    assert topics.fleet_filter("plant-a", "resp") == "edge/plant-a/+/resp/+"
    assert topics.rollouts_filter("plant-a") == "edge/plant-a/rollouts/+"


@pytest.mark.parametrize("topic", [
    "edge/plant-a/cam-01", "edge/plant-a/cam-01/desired/x", "edge/plant-a/cam-01/power",
    "edge/plant-a/cam-01/resp", "edge/plant-a/cam-01/resp/a b", "other/plant-a/cam-01/desired",
    "edge/plant+/cam-01/desired", "edge/plant-a/#/desired", "edge/plant-a/rollouts/r1/x",
    "edge//cam-01/desired", "",
])
def test_a_topic_that_is_not_the_fleets_is_refused(topic: str) -> None:
    with pytest.raises(DocumentError) as refused:
        topics.parse_topic(topic)
    assert refused.value.reason == "bad_topic"


@pytest.mark.parametrize(("value", "what"), [
    ("", "device"), ("-cam", "device"), ("cam/1", "device"), ("cam+", "device"),
    ("cam#", "device"), ("c" * 65, "device"), ("rollouts", "device"), (None, "fleet"),
    ("caméra", "device"),
])
def test_ids_that_could_break_a_topic_are_refused(value: Any, what: str) -> None:
    with pytest.raises(DocumentError) as refused:
        topics.check_id(value, what)
    assert (refused.value.reason, refused.value.field) == ("bad_id", what)
    with pytest.raises(DocumentError):
        topics.device_topic(value if what == "fleet" else "f", value if what == "device"
                            else "d", "desired")


# -- property tests: nothing but a DocumentError, and never more lenient than the schema --------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_fail_with_a_document_error(data: bytes) -> None:
    try:
        docs.read_message(data, [generate_private_key().public_key()])
    except DocumentError as exc:
        assert exc.reason


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(_paths(item, (*prefix, key)))
    return found


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(range(len(samples()))), st.data(), JSON)
def test_a_document_with_any_field_replaced_is_accepted_only_if_the_schema_accepts_it(
        index: int, data: Any, value: Any) -> None:
    document = samples()[index].to_json()
    paths = [path for path in _paths(document) if path]
    path = data.draw(st.sampled_from(paths))
    mutated = copy.deepcopy(document)
    target = mutated
    for part in path[:-1]:
        target = target[part]
    if data.draw(st.booleans()):
        target[path[-1]] = value
    else:
        del target[path[-1]]
    encoded = json.dumps(mutated).encode()
    try:
        parsed = docs.decode(encoded)
    except DocumentError as exc:
        assert exc.reason
        return
    assert VALIDATORS[parsed.kind].is_valid(mutated), mutated
    VALIDATORS[parsed.kind].validate(parsed.to_json())


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["payload", "signature", "kind", "x"]), JSON,
                       max_size=3))
def test_any_envelope_like_object_is_refused_with_a_reason(envelope: dict[str, Any]) -> None:
    with pytest.raises(DocumentError) as refused:
        docs.read_message(json.dumps(envelope).encode(), [generate_private_key().public_key()])
    assert refused.value.reason


# -- the schemas ship in the package --------------------------------------------------------

def test_the_schemas_are_in_the_built_wheel(tmp_path: Path) -> None:
    from importlib.metadata import version
    if int(version("setuptools").split(".")[0]) < 77:  # pyproject.toml's build requirement
        pytest.skip("the build needs setuptools >= 77 (without isolation, the venv's is used)")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("agent", "models", "power", "pruning"):
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(source), "-w", str(tmp_path / "wheel")],
                   check=True, capture_output=True, timeout=300)
    wheel, = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for kind in (*KINDS, "envelope"):
        assert f"agent/fleet/schemas/{kind}.schema.json" in names
