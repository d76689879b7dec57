"""The manifest contract of a signed model bundle (design §5.1): its fields and its bytes.

``manifest.json`` lists every member of a bundle with its sha256 and size, and the signature covers
its exact bytes. This module holds what the packer and every reader must agree on: the schema
version, the member names a bundle may hold, the one canonical serialisation that is signed, a
parser that refuses duplicate keys, the field validation and the agent-version compatibility rule.
It reads no files; models/bundle.py does that.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from agent.errors import BundleError

MANIFEST_SCHEMA_VERSION = 1

MANIFEST_MEMBER = "manifest.json"
SIGNATURE_MEMBER = "manifest.sig"
MODEL_MEMBER = "model.onnx"
ENGINES_DIR = "engines"
OPTIONAL_MEMBERS = ("timing.cache", "report.json")
METADATA_MEMBERS = (MANIFEST_MEMBER, SIGNATURE_MEMBER)

_FIXED_MEMBERS = frozenset({MANIFEST_MEMBER, SIGNATURE_MEMBER, MODEL_MEMBER, *OPTIONAL_MEMBERS})
_ENGINE_MEMBER = re.compile(r"engines/[A-Za-z0-9][A-Za-z0-9._+-]*\.plan")
_NAME_SLUG = re.compile(r"[a-z0-9][a-z0-9._-]*")
# Names become directory and file names (store, bundles, engine caches): well under NAME_MAX.
MAX_NAME_LENGTH = 100
# Versions become directory names (with a prefix and suffix for staging and deletion): a bound
# keeps them well inside a file name's 255 bytes, and fits an int64 for tools downstream.
MAX_VERSION = 2**63 - 1
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SEMVER = re.compile(r"(\d+)\.(\d+)\.(\d+)")
# Only the shapes Python 3.10's datetime.fromisoformat reads too, so that a manifest the host
# (3.11+, which accepts many more ISO forms) writes is never refused by a device on 3.10.
_UTC_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{3}|\.\d{6})?(Z|\+00:00)")
# numpy's canonical names for the dtypes an inference tensor can have.
TENSOR_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
PRECISION_FIELDS = ("int8_layers", "fp16_layers", "fp32_layers")

_MISSING = object()


def is_allowed_member_name(name: str) -> bool:
    """Whether ``name`` is a file a bundle may hold (the fixed names or ``engines/<id>.plan``)."""
    return name in _FIXED_MEMBERS or _ENGINE_MEMBER.fullmatch(name) is not None


def canonical_manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """Serialise a manifest the one way it is signed: sorted keys, 2-space indent, UTF-8, newline.

    Raises:
        BundleError: a value is not representable in strict JSON (NaN, a Path, ...).
    """
    try:
        text = json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
        return (text + "\n").encode("utf-8")  # a lone surrogate fails here (a ValueError)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BundleError("manifest is not representable as JSON", reason=str(exc)) from exc


def parse_manifest_bytes(data: bytes) -> dict[str, Any]:
    """Parse ``manifest.json`` bytes into a dict (no validation).

    Duplicate keys are refused: two parsers that keep different duplicates would read different
    manifests from the same signed bytes. So is what the writer (:func:`canonical_manifest_bytes`)
    cannot write back: NaN and infinities, lone surrogate escapes, and nesting deeper than
    :data:`MAX_MANIFEST_DEPTH` (a manifest is a few levels deep; thousands of levels would
    exhaust the stack of whatever copies or prints it later).

    Raises:
        BundleError: not UTF-8, not strict JSON, a duplicate key, too deep, or not an object.
    """
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys,
                              parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError("manifest.json is not valid UTF-8 JSON", reason=str(exc)) from exc
    except RecursionError:
        raise BundleError("manifest.json is nested too deeply") from None
    if not isinstance(manifest, dict):
        raise invalid_field("<manifest>", "a JSON object", manifest)
    _check_plain(manifest)
    return manifest


MAX_MANIFEST_DEPTH = 32


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 is a valid literal that no float holds
        raise ValueError(f"{text} is out of range for a float")
    return value


def _check_plain(manifest: dict[str, Any]) -> None:
    """Refuse nesting deeper than MAX_MANIFEST_DEPTH and text with lone surrogates (walked
    without recursion)."""
    pending: list[tuple[Any, int]] = [(manifest, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_MANIFEST_DEPTH:
            raise BundleError("manifest.json is nested too deeply",
                              expected=f"<= {MAX_MANIFEST_DEPTH} levels")
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
            texts = list(value)
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)
            texts = []
        else:
            texts = [value] if isinstance(value, str) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise BundleError("manifest.json holds text that is not valid Unicode (a lone "
                                  "surrogate escape)", found=ascii(text)[:80]) from None


def validate_manifest(manifest: Mapping[str, Any]) -> None:
    """Check every required manifest field (design §5.1); extra fields are allowed.

    Raises:
        BundleError: with ``field`` (a path such as ``inputs[0].shape[1]``), ``expected`` and
            ``found``.
    """
    if not isinstance(manifest, Mapping):
        raise invalid_field("<manifest>", "a JSON object", manifest)

    schema_version = _required(manifest, "schema_version", "an integer")
    _check_int(schema_version, "schema_version", minimum=1)
    if schema_version != MANIFEST_SCHEMA_VERSION:
        raise invalid_field(
            "schema_version",
            f"{MANIFEST_SCHEMA_VERSION} (the schema this agent reads)",
            schema_version,
        )

    rule = f"a slug [a-z0-9][a-z0-9._-]* of at most {MAX_NAME_LENGTH} characters"
    name = _required(manifest, "name", rule)
    if (not isinstance(name, str) or _NAME_SLUG.fullmatch(name) is None
            or len(name) > MAX_NAME_LENGTH):
        raise invalid_field("name", rule, name)

    version = _required(manifest, "version", f"an integer from 1 to {MAX_VERSION}")
    if not _is_int(version) or not 1 <= version <= MAX_VERSION:
        raise invalid_field("version", f"an integer from 1 to {MAX_VERSION}", version)

    created_at = _required(manifest, "created_at", "an ISO-8601 UTC time")
    if parse_utc_timestamp(created_at) is None:
        raise invalid_field(
            "created_at", "an ISO-8601 UTC time like 2024-05-01T12:00:00Z", created_at
        )

    for tensors_field in ("inputs", "outputs"):
        _check_tensors(_required(manifest, tensors_field, "a non-empty list"), tensors_field)

    preprocessing = _required(manifest, "preprocessing", "an object or null")
    if preprocessing is not None and not isinstance(preprocessing, dict):
        raise invalid_field("preprocessing", "an object or null", preprocessing)

    _check_precision(_required(manifest, "precision", "an object"))

    max_batch = _required(manifest, "max_batch", "an integer >= 1")
    _check_int(max_batch, "max_batch", minimum=1)
    opt_batch = _required(manifest, "opt_batch", "an integer >= 1")
    _check_int(opt_batch, "opt_batch", minimum=1)
    if opt_batch > max_batch:
        raise invalid_field("opt_batch", f"an integer <= max_batch ({max_batch})", opt_batch)
    _check_batch_fields(manifest, max_batch)

    _check_calibration(_required(manifest, "calibration", "an object or null"))

    accuracy = _required(manifest, "accuracy", "an object")
    if not isinstance(accuracy, dict):
        raise invalid_field("accuracy", "an object", accuracy)

    artifacts = _required(manifest, "artifacts", "an object")
    _check_artifacts(artifacts)
    _check_engines(_required(manifest, "engines", "an object"), artifacts)

    min_agent_version = _required(manifest, "min_agent_version", "a version X.Y.Z")
    if not isinstance(min_agent_version, str) or _SEMVER.fullmatch(min_agent_version) is None:
        raise invalid_field("min_agent_version", "a version X.Y.Z", min_agent_version)

    targets = manifest.get("targets")
    if targets is not None and (not isinstance(targets, list) or not targets or not all(
            isinstance(item, str) and (item == "*" or _NAME_SLUG.fullmatch(item))
            for item in targets)):
        raise invalid_field("targets", 'a non-empty list of device classes (slugs) or "*"',
                            targets)


def check_target(manifest: Mapping[str, Any], device_class: str) -> None:
    """Refuse a bundle whose ``targets`` (the device classes it was built and tested for, such
    as ``orin-nano-8gb``; absent or ``"*"``: any) do not name ``device_class``, this device's
    (``device_class`` in the configuration; empty: undeclared, which only an untargeted bundle
    suits).

    Raises:
        BundleError: the bundle is for other devices.
    """
    targets = manifest.get("targets")
    if targets is None or "*" in targets:
        return
    if device_class not in targets:
        raise BundleError("the bundle is for other devices", targets=", ".join(targets),
                          device_class=device_class or "(none: set device_class)")


def check_compatibility(manifest: Mapping[str, Any], agent_version: str) -> None:
    """Refuse a bundle whose ``min_agent_version`` is newer than ``agent_version``.

    Raises:
        BundleError: the bundle needs a newer agent, or either version is not X.Y.Z.
    """
    required = manifest.get("min_agent_version")
    required_match = _SEMVER.fullmatch(required) if isinstance(required, str) else None
    if required_match is None:
        raise invalid_field("min_agent_version", "a version X.Y.Z", required)
    # The running version may carry a suffix (0.2.0.dev3, 0.2.0+local); its X.Y.Z prefix decides.
    running_match = _SEMVER.match(agent_version)
    if running_match is None:
        raise BundleError("cannot read the agent version", expected="X.Y.Z...", found=agent_version)
    required_tuple = tuple(int(part) for part in required_match.groups())
    running_tuple = tuple(int(part) for part in running_match.groups())
    if required_tuple > running_tuple:
        raise BundleError("bundle needs a newer agent", required=required, running=agent_version)


def parse_utc_timestamp(value: object) -> datetime.datetime | None:
    """Parse an ISO-8601 UTC time (``...Z`` or ``...+00:00``); None when it is not one."""
    if not isinstance(value, str) or _UTC_TIMESTAMP.fullmatch(value) is None:
        return None
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:  # matches the pattern but names no real time (month 13, ...)
        return None


def invalid_field(field: str, expected: str, found: object) -> BundleError:
    """The error for a manifest field that breaks the contract, naming the field and both values."""
    return BundleError(
        f"invalid manifest field '{field}'",
        field=field,
        expected=expected,
        found=describe_value(found),
    )


def describe_value(value: object) -> str:
    """A manifest value shown in one short line for an error (JSON scalars as JSON)."""
    if value is _MISSING:
        return "<missing>"
    if isinstance(value, (str, int, float, bool, type(None))):
        text = json.dumps(value)
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_tensors(tensors: object, field: str) -> None:
    if not isinstance(tensors, list) or not tensors:
        raise invalid_field(field, "a non-empty list of tensors", tensors)
    seen_names: set[str] = set()
    for index, tensor in enumerate(tensors):
        where = f"{field}[{index}]"
        if not isinstance(tensor, dict):
            raise invalid_field(where, "an object with name, dtype, shape", tensor)
        name = tensor.get("name", _MISSING)
        if not isinstance(name, str) or not name:
            raise invalid_field(f"{where}.name", "a non-empty string", name)
        if name in seen_names:
            raise invalid_field(f"{where}.name", "a name not used by another tensor", name)
        seen_names.add(name)
        dtype = tensor.get("dtype", _MISSING)
        if dtype not in TENSOR_DTYPES:
            raise invalid_field(f"{where}.dtype", "a numpy dtype name such as float32", dtype)
        shape = tensor.get("shape", _MISSING)
        if not isinstance(shape, list) or not shape:
            raise invalid_field(f"{where}.shape", "a non-empty list of integers", shape)
        for axis, extent in enumerate(shape):
            if _is_int(extent) and (extent >= 1 or extent == -1):
                continue
            raise invalid_field(
                f"{where}.shape[{axis}]", "an integer >= 1, or -1 for dynamic", extent
            )
        layout = tensor.get("layout")
        if layout is not None and not isinstance(layout, str):
            raise invalid_field(f"{where}.layout", "a string such as NCHW, or absent", layout)


def _check_batch_fields(manifest: Mapping[str, Any], max_batch: int) -> None:
    """The optional batch fields: ``fixed_batch``, the one batch size a model's graph runs at
    (the daemon pads smaller batches to it; ``max_batch`` is that size), and
    ``output_batch_axes``, output name to the axis that carries the batch where it is not 0."""
    fixed = manifest.get("fixed_batch")
    if fixed is not None:
        _check_int(fixed, "fixed_batch", minimum=1)
        if fixed != max_batch:
            raise invalid_field("fixed_batch", f"max_batch ({max_batch}): a graph that runs at "
                                "one batch size is served at that size", fixed)
    axes = manifest.get("output_batch_axes")
    if axes is None:
        return
    if not isinstance(axes, dict):
        raise invalid_field("output_batch_axes", "an object of output name to axis", axes)
    ranks = {tensor.get("name"): len(tensor.get("shape") or ())
             for tensor in manifest.get("outputs") or () if isinstance(tensor, dict)}
    for name, axis in axes.items():
        where = f"output_batch_axes[{name!r}]"
        if name not in ranks:
            raise invalid_field(where, "the name of an output", name)
        if not _is_int(axis) or not 0 <= axis < ranks[name]:
            raise invalid_field(where, f"an axis from 0 to {ranks[name] - 1}", axis)


def _check_precision(precision: object) -> None:
    if not isinstance(precision, dict):
        raise invalid_field("precision", "an object with " + ", ".join(PRECISION_FIELDS), precision)
    owner_of_layer: dict[str, str] = {}
    for list_field in PRECISION_FIELDS:
        layers = precision.get(list_field, _MISSING)
        where = f"precision.{list_field}"
        if not isinstance(layers, list) or not all(isinstance(layer, str) for layer in layers):
            raise invalid_field(where, "a list of layer names", layers)
        for layer in layers:
            # A layer runs at one precision; listing it twice means the plan is ambiguous.
            if layer in owner_of_layer:
                raise invalid_field(
                    where, f"no layer also listed in {owner_of_layer[layer]}", layer
                )
            owner_of_layer[layer] = where


def _check_calibration(calibration: object) -> None:
    if calibration is None:
        return
    if not isinstance(calibration, dict):
        raise invalid_field(
            "calibration", "an object (method, samples, data_sha256) or null", calibration
        )
    method = calibration.get("method", _MISSING)
    if not isinstance(method, str) or not method:
        raise invalid_field("calibration.method", "a non-empty string", method)
    _check_int(calibration.get("samples", _MISSING), "calibration.samples", minimum=1)
    data_sha256 = calibration.get("data_sha256", _MISSING)
    if not isinstance(data_sha256, str) or _SHA256_HEX.fullmatch(data_sha256) is None:
        raise invalid_field("calibration.data_sha256", "64 lowercase hex characters", data_sha256)


def _check_artifacts(artifacts: object) -> None:
    if not isinstance(artifacts, dict):
        raise invalid_field("artifacts", "an object of member name to {sha256, size}", artifacts)
    for name, entry in artifacts.items():
        where = f"artifacts[{name!r}]"
        if name in METADATA_MEMBERS or not is_allowed_member_name(name):
            raise invalid_field(
                where, "model.onnx, timing.cache, report.json or engines/<id>.plan", name
            )
        if not isinstance(entry, dict):
            raise invalid_field(where, "an object with sha256 and size", entry)
        sha256 = entry.get("sha256", _MISSING)
        if not isinstance(sha256, str) or _SHA256_HEX.fullmatch(sha256) is None:
            raise invalid_field(f"{where}.sha256", "64 lowercase hex characters", sha256)
        _check_int(entry.get("size", _MISSING), f"{where}.size", minimum=0)
    if MODEL_MEMBER not in artifacts:
        raise invalid_field("artifacts", f"an entry for {MODEL_MEMBER}", sorted(artifacts))


def _check_engines(engines: object, artifacts: Mapping[str, Any]) -> None:
    if not isinstance(engines, dict):
        raise invalid_field(
            "engines", "an object of device fingerprint to engines/<id>.plan", engines
        )
    for fingerprint, member in engines.items():
        where = f"engines[{fingerprint!r}]"
        if not fingerprint:
            raise invalid_field("engines", "non-empty device fingerprints", fingerprint)
        if not isinstance(member, str) or _ENGINE_MEMBER.fullmatch(member) is None:
            raise invalid_field(where, "a member name engines/<id>.plan", member)
        if member not in artifacts:
            raise invalid_field(where, "a member listed in artifacts", member)


def _check_int(value: object, field: str, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise invalid_field(field, f"an integer >= {minimum}", value)


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python, but `true` is not a count in a manifest.
    return isinstance(value, int) and not isinstance(value, bool)


def _required(manifest: Mapping[str, Any], field: str, expected: str) -> Any:
    value = manifest.get(field, _MISSING)
    if value is _MISSING:
        raise invalid_field(field, expected, value)
    return value


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result
