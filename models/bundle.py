"""The signed model bundle (design §5.1): pack, verify, extract, inspect.

A bundle is an uncompressed tar holding ``manifest.json``, ``manifest.sig``, ``model.onnx`` and
optionally ``engines/<fingerprint>.plan``, ``timing.cache`` and ``report.json``. The manifest lists
every other member with its sha256 and size; the signature covers the manifest's exact bytes. So one
signature check plus one hash per member proves the whole bundle.

Reading is defensive because bundles arrive over the network on the device:

1. the tar headers are scanned first and anything unsafe or unexpected is refused (absolute paths,
   ``..``, links, devices, duplicates, oversized or unknown members) before any content is read;
2. the signature is checked over the raw manifest bytes *before* the JSON is parsed;
3. the manifest is validated, then every artifact is hashed by streaming it.

Member contents are read by byte range from the file (``offset_data``/``size`` of the scanned
header), never through ``tarfile``'s extraction, so no name from the archive ever becomes a path on
disk except the fixed names this module allows.

The tar is uncompressed on purpose: members can then be hashed and extracted by byte range, and the
bulk of a bundle (weights, engines) barely compresses anyway.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import BundleError, SignatureError
from agent.fsutil import atomic_output_file, fsync_dir, staging_dir
from models.signing import parse_signature_document, sign_manifest, verify_manifest

MANIFEST_SCHEMA_VERSION = 1

MANIFEST_MEMBER = "manifest.json"
SIGNATURE_MEMBER = "manifest.sig"
MODEL_MEMBER = "model.onnx"
ENGINES_DIR = "engines"
OPTIONAL_MEMBERS = ("timing.cache", "report.json")
METADATA_MEMBERS = (MANIFEST_MEMBER, SIGNATURE_MEMBER)

MEBIBYTE = 1024 * 1024
GIBIBYTE = 1024 * MEBIBYTE
CHUNK_BYTES = 1 * MEBIBYTE
TAR_BLOCK_BYTES = 512
MEMBER_FILE_MODE = 0o644
EXTRACTED_DIR_MODE = 0o755

_FIXED_MEMBERS = frozenset({MANIFEST_MEMBER, SIGNATURE_MEMBER, MODEL_MEMBER, *OPTIONAL_MEMBERS})
_ENGINE_MEMBER = re.compile(r"engines/[A-Za-z0-9][A-Za-z0-9._+-]*\.plan")
_NAME_SLUG = re.compile(r"[a-z0-9][a-z0-9._-]*")
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
# tar header types that carry metadata for the next member and that tarfile reads whole into memory.
_EXTENDED_HEADER_TYPES = frozenset({b"x", b"g", b"L", b"K"})

_MISSING = object()


@dataclass(frozen=True)
class BundleLimits:
    """Bounds applied while scanning a bundle, before any content is read.

    Attributes:
        max_metadata_bytes: Largest ``manifest.json``/``manifest.sig`` (they are read into memory),
            and largest extended tar header.
        max_member_bytes: Largest other member.
        max_total_bytes: Largest sum of all member sizes.
        max_members: Most tar entries (files and directories).
    """

    max_metadata_bytes: int = 1 * MEBIBYTE
    max_member_bytes: int = 4 * GIBIBYTE
    max_total_bytes: int = 16 * GIBIBYTE
    max_members: int = 64


DEFAULT_LIMITS = BundleLimits()


@dataclass(frozen=True)
class _Member:
    """A regular file in the bundle, located by byte range in the tar file."""

    name: str
    offset_data: int
    size: int


# --------------------------------------------------------------------------------------------------
# Manifest


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
    except (TypeError, ValueError) as exc:
        raise BundleError("manifest is not representable as JSON", reason=str(exc)) from exc
    return (text + "\n").encode("utf-8")


def parse_manifest_bytes(data: bytes) -> dict[str, Any]:
    """Parse ``manifest.json`` bytes into a dict (no validation).

    Duplicate keys are refused: two parsers that keep different duplicates would read different
    manifests from the same signed bytes.

    Raises:
        BundleError: not UTF-8, not JSON, a duplicate key, or not a JSON object.
    """
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError("manifest.json is not valid UTF-8 JSON", reason=str(exc)) from exc
    if not isinstance(manifest, dict):
        raise _invalid("<manifest>", "a JSON object", manifest)
    return manifest


def validate_manifest(manifest: Mapping[str, Any]) -> None:
    """Check every required manifest field (design §5.1); extra fields are allowed.

    Raises:
        BundleError: with ``field`` (a path such as ``inputs[0].shape[1]``), ``expected`` and
            ``found``.
    """
    if not isinstance(manifest, Mapping):
        raise _invalid("<manifest>", "a JSON object", manifest)

    schema_version = _required(manifest, "schema_version", "an integer")
    _check_int(schema_version, "schema_version", minimum=1)
    if schema_version != MANIFEST_SCHEMA_VERSION:
        raise _invalid(
            "schema_version",
            f"{MANIFEST_SCHEMA_VERSION} (the schema this agent reads)",
            schema_version,
        )

    name = _required(manifest, "name", "a slug [a-z0-9][a-z0-9._-]*")
    if not isinstance(name, str) or _NAME_SLUG.fullmatch(name) is None:
        raise _invalid("name", "a slug [a-z0-9][a-z0-9._-]*", name)

    _check_int(_required(manifest, "version", "an integer >= 1"), "version", minimum=1)

    created_at = _required(manifest, "created_at", "an ISO-8601 UTC time")
    if parse_utc_timestamp(created_at) is None:
        raise _invalid("created_at", "an ISO-8601 UTC time like 2024-05-01T12:00:00Z", created_at)

    for tensors_field in ("inputs", "outputs"):
        _check_tensors(_required(manifest, tensors_field, "a non-empty list"), tensors_field)

    preprocessing = _required(manifest, "preprocessing", "an object or null")
    if preprocessing is not None and not isinstance(preprocessing, dict):
        raise _invalid("preprocessing", "an object or null", preprocessing)

    _check_precision(_required(manifest, "precision", "an object"))

    max_batch = _required(manifest, "max_batch", "an integer >= 1")
    _check_int(max_batch, "max_batch", minimum=1)
    opt_batch = _required(manifest, "opt_batch", "an integer >= 1")
    _check_int(opt_batch, "opt_batch", minimum=1)
    if opt_batch > max_batch:
        raise _invalid("opt_batch", f"an integer <= max_batch ({max_batch})", opt_batch)

    _check_calibration(_required(manifest, "calibration", "an object or null"))

    accuracy = _required(manifest, "accuracy", "an object")
    if not isinstance(accuracy, dict):
        raise _invalid("accuracy", "an object", accuracy)

    artifacts = _required(manifest, "artifacts", "an object")
    _check_artifacts(artifacts)
    _check_engines(_required(manifest, "engines", "an object"), artifacts)

    min_agent_version = _required(manifest, "min_agent_version", "a version X.Y.Z")
    if not isinstance(min_agent_version, str) or _SEMVER.fullmatch(min_agent_version) is None:
        raise _invalid("min_agent_version", "a version X.Y.Z", min_agent_version)


def check_compatibility(manifest: Mapping[str, Any], agent_version: str) -> None:
    """Refuse a bundle whose ``min_agent_version`` is newer than ``agent_version``.

    Raises:
        BundleError: the bundle needs a newer agent, or either version is not X.Y.Z.
    """
    required = manifest.get("min_agent_version")
    required_match = _SEMVER.fullmatch(required) if isinstance(required, str) else None
    if required_match is None:
        raise _invalid("min_agent_version", "a version X.Y.Z", required)
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


def _check_tensors(tensors: object, field: str) -> None:
    if not isinstance(tensors, list) or not tensors:
        raise _invalid(field, "a non-empty list of tensors", tensors)
    seen_names: set[str] = set()
    for index, tensor in enumerate(tensors):
        where = f"{field}[{index}]"
        if not isinstance(tensor, dict):
            raise _invalid(where, "an object with name, dtype, shape", tensor)
        name = tensor.get("name", _MISSING)
        if not isinstance(name, str) or not name:
            raise _invalid(f"{where}.name", "a non-empty string", name)
        if name in seen_names:
            raise _invalid(f"{where}.name", "a name not used by another tensor", name)
        seen_names.add(name)
        dtype = tensor.get("dtype", _MISSING)
        if dtype not in TENSOR_DTYPES:
            raise _invalid(f"{where}.dtype", "a numpy dtype name such as float32", dtype)
        shape = tensor.get("shape", _MISSING)
        if not isinstance(shape, list) or not shape:
            raise _invalid(f"{where}.shape", "a non-empty list of integers", shape)
        for axis, extent in enumerate(shape):
            if _is_int(extent) and (extent >= 1 or extent == -1):
                continue
            raise _invalid(f"{where}.shape[{axis}]", "an integer >= 1, or -1 for dynamic", extent)
        layout = tensor.get("layout")
        if layout is not None and not isinstance(layout, str):
            raise _invalid(f"{where}.layout", "a string such as NCHW, or absent", layout)


def _check_precision(precision: object) -> None:
    if not isinstance(precision, dict):
        raise _invalid("precision", "an object with " + ", ".join(PRECISION_FIELDS), precision)
    owner_of_layer: dict[str, str] = {}
    for list_field in PRECISION_FIELDS:
        layers = precision.get(list_field, _MISSING)
        where = f"precision.{list_field}"
        if not isinstance(layers, list) or not all(isinstance(layer, str) for layer in layers):
            raise _invalid(where, "a list of layer names", layers)
        for layer in layers:
            # A layer runs at one precision; listing it twice means the plan is ambiguous.
            if layer in owner_of_layer:
                raise _invalid(where, f"no layer also listed in {owner_of_layer[layer]}", layer)
            owner_of_layer[layer] = where


def _check_calibration(calibration: object) -> None:
    if calibration is None:
        return
    if not isinstance(calibration, dict):
        raise _invalid(
            "calibration", "an object (method, samples, data_sha256) or null", calibration
        )
    method = calibration.get("method", _MISSING)
    if not isinstance(method, str) or not method:
        raise _invalid("calibration.method", "a non-empty string", method)
    _check_int(calibration.get("samples", _MISSING), "calibration.samples", minimum=1)
    data_sha256 = calibration.get("data_sha256", _MISSING)
    if not isinstance(data_sha256, str) or _SHA256_HEX.fullmatch(data_sha256) is None:
        raise _invalid("calibration.data_sha256", "64 lowercase hex characters", data_sha256)


def _check_artifacts(artifacts: object) -> None:
    if not isinstance(artifacts, dict):
        raise _invalid("artifacts", "an object of member name to {sha256, size}", artifacts)
    for name, entry in artifacts.items():
        where = f"artifacts[{name!r}]"
        if name in METADATA_MEMBERS or not is_allowed_member_name(name):
            raise _invalid(
                where, "model.onnx, timing.cache, report.json or engines/<id>.plan", name
            )
        if not isinstance(entry, dict):
            raise _invalid(where, "an object with sha256 and size", entry)
        sha256 = entry.get("sha256", _MISSING)
        if not isinstance(sha256, str) or _SHA256_HEX.fullmatch(sha256) is None:
            raise _invalid(f"{where}.sha256", "64 lowercase hex characters", sha256)
        _check_int(entry.get("size", _MISSING), f"{where}.size", minimum=0)
    if MODEL_MEMBER not in artifacts:
        raise _invalid("artifacts", f"an entry for {MODEL_MEMBER}", sorted(artifacts))


def _check_engines(engines: object, artifacts: Mapping[str, Any]) -> None:
    if not isinstance(engines, dict):
        raise _invalid("engines", "an object of device fingerprint to engines/<id>.plan", engines)
    for fingerprint, member in engines.items():
        where = f"engines[{fingerprint!r}]"
        if not fingerprint:
            raise _invalid("engines", "non-empty device fingerprints", fingerprint)
        if not isinstance(member, str) or _ENGINE_MEMBER.fullmatch(member) is None:
            raise _invalid(where, "a member name engines/<id>.plan", member)
        if member not in artifacts:
            raise _invalid(where, "a member listed in artifacts", member)


def _check_int(value: object, field: str, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise _invalid(field, f"an integer >= {minimum}", value)


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python, but `true` is not a count in a manifest.
    return isinstance(value, int) and not isinstance(value, bool)


def _required(manifest: Mapping[str, Any], field: str, expected: str) -> Any:
    value = manifest.get(field, _MISSING)
    if value is _MISSING:
        raise _invalid(field, expected, value)
    return value


def _invalid(field: str, expected: str, found: object) -> BundleError:
    return BundleError(
        f"invalid manifest field '{field}'", field=field, expected=expected, found=_describe(found)
    )


def _describe(value: object) -> str:
    if value is _MISSING:
        return "<missing>"
    if isinstance(value, (str, int, float, bool, type(None))):
        text = json.dumps(value)
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


# --------------------------------------------------------------------------------------------------
# Packing


def pack_bundle(
    out_path: Path,
    manifest: Mapping[str, Any],
    files: Mapping[str, Path],
    signing_key: Ed25519PrivateKey,
    *,
    limits: BundleLimits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Write a signed bundle to ``out_path`` atomically.

    Args:
        out_path: The bundle to write; replaced only once the new one is complete.
        manifest: The manifest without ``artifacts`` (computed here). ``schema_version`` and
            ``created_at`` are filled in when absent. When ``artifacts`` is present (re-signing),
            it must match the files exactly.
        files: Member name (``model.onnx``, ``engines/<id>.plan``, ...) to the file holding it.
        signing_key: The Ed25519 key that signs ``manifest.json``.
        limits: The limits a reader will apply; a bundle they would refuse is not written.

    Returns:
        The manifest as written and signed.

    Raises:
        BundleError: a bad member name or source file, an invalid manifest, declared artifacts that
            do not match the files, a file that changed while being packed, or a write failure.
    """
    out_path = Path(out_path)
    sources = _check_sources(files, limits)
    final = copy.deepcopy(dict(manifest))
    final.setdefault("schema_version", MANIFEST_SCHEMA_VERSION)
    final.setdefault("created_at", _utc_now_text())
    computed = {name: _describe_file(sources[name]) for name in sorted(sources)}
    if "artifacts" in final:
        _compare_artifacts(final["artifacts"], computed)
    final["artifacts"] = computed
    validate_manifest(final)

    manifest_bytes = canonical_manifest_bytes(final)
    if len(manifest_bytes) > limits.max_metadata_bytes:
        raise BundleError(
            "manifest.json is too large",
            expected=f"<= {limits.max_metadata_bytes} bytes",
            found=f"{len(manifest_bytes)} bytes",
        )
    signature_bytes = sign_manifest(manifest_bytes, signing_key)
    created = parse_utc_timestamp(final["created_at"])
    mtime_s = max(0, int(created.timestamp())) if created is not None else 0

    try:
        with atomic_output_file(out_path, mode=MEMBER_FILE_MODE) as tmp_path:
            with tarfile.open(tmp_path, mode="w", format=tarfile.PAX_FORMAT) as tar:
                _add_bytes(tar, MANIFEST_MEMBER, manifest_bytes, mtime_s)
                _add_bytes(tar, SIGNATURE_MEMBER, signature_bytes, mtime_s)
                for name in _member_order(computed):
                    _add_file(tar, name, sources[name], computed[name], mtime_s)
    except OSError as exc:
        raise BundleError("cannot write bundle", path=out_path, reason=str(exc)) from exc
    return final


def _check_sources(files: Mapping[str, Path], limits: BundleLimits) -> dict[str, Path]:
    sources: dict[str, Path] = {}
    for name, source in files.items():
        if name in METADATA_MEMBERS:
            raise BundleError(
                f"{name} is written by the packer, not taken from a file", member=name
            )
        if not is_allowed_member_name(name):
            raise BundleError(
                "not a bundle member name (allowed: model.onnx, timing.cache, report.json, "
                "engines/<id>.plan)",
                member=name,
                path=source,
            )
        source = Path(source)
        if not source.is_file():
            raise BundleError("artifact source is not a regular file", member=name, path=source)
        size_bytes = source.stat().st_size
        if size_bytes > limits.max_member_bytes:
            raise BundleError(
                "artifact is too large",
                member=name,
                expected=f"<= {limits.max_member_bytes} bytes",
                found=f"{size_bytes} bytes",
            )
        sources[name] = source
    total_bytes = sum(path.stat().st_size for path in sources.values())
    if total_bytes > limits.max_total_bytes:
        raise BundleError(
            "artifacts are too large in total",
            expected=f"<= {limits.max_total_bytes} bytes",
            found=f"{total_bytes} bytes",
        )
    if len(sources) + len(METADATA_MEMBERS) > limits.max_members:
        raise BundleError("too many artifacts", expected=f"<= {limits.max_members} members")
    return sources


def _compare_artifacts(declared: object, computed: Mapping[str, Mapping[str, Any]]) -> None:
    if not isinstance(declared, dict):
        raise _invalid("artifacts", "an object of member name to {sha256, size}", declared)
    for name in sorted(set(declared) | set(computed)):
        if name not in computed:
            raise BundleError("artifact listed in the manifest has no file", member=name)
        if name not in declared:
            raise BundleError("file is not listed in the manifest's artifacts", member=name)
        if declared[name] != computed[name]:
            raise BundleError(
                "artifact content does not match the manifest",
                member=name,
                expected=_describe(declared[name]),
                found=_describe(computed[name]),
            )


def _describe_file(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size_bytes = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            size_bytes += len(chunk)
    return {"sha256": digest.hexdigest(), "size": size_bytes}


def _member_order(artifacts: Mapping[str, Any]) -> list[str]:
    # The model right after the metadata, so a streaming reader meets what it needs first.
    return sorted(artifacts, key=lambda name: (name != MODEL_MEMBER, name))


def _tar_info(name: str, size_bytes: int, mtime_s: int) -> tarfile.TarInfo:
    # Fixed metadata so that the same inputs give the same bytes, whoever packs them.
    info = tarfile.TarInfo(name)
    info.size = size_bytes
    info.mtime = mtime_s
    info.mode = MEMBER_FILE_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime_s: int) -> None:
    tar.addfile(_tar_info(name, len(data), mtime_s), io.BytesIO(data))


class _HashingReader:
    """A read-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._digest = hashlib.sha256()
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._handle.read(size)
        self._digest.update(chunk)
        self.bytes_read += len(chunk)
        return chunk

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _add_file(
    tar: tarfile.TarFile, name: str, source: Path, expected: Mapping[str, Any], mtime_s: int
) -> None:
    size_bytes = int(expected["size"])
    with open(source, "rb") as handle:
        reader = _HashingReader(handle)
        try:
            tar.addfile(_tar_info(name, size_bytes, mtime_s), reader)  # type: ignore[arg-type]
        except OSError as exc:
            if reader.bytes_read < size_bytes:  # tarfile's "unexpected end of data"
                raise BundleError(
                    "artifact shrank while being packed", member=name, path=source
                ) from exc
            raise
    # The manifest was hashed before the tar was written; what went into the tar must be the same.
    if reader.hexdigest() != expected["sha256"]:
        raise BundleError("artifact changed while being packed", member=name, path=source)


def _utc_now_text() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------------
# Safe reading


def _open_bundle_file(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError as exc:
        raise BundleError("bundle not found", path=path) from exc
    except OSError as exc:
        raise BundleError("cannot read bundle", path=path, reason=exc.strerror) from exc


def _scan_members(handle: BinaryIO, path: Path, limits: BundleLimits) -> dict[str, _Member]:
    """Scan every tar header and return the regular members; refuse anything unsafe.

    Raises:
        BundleError: not a tar ("not a bundle"), truncated, or a member that is unsafe, unknown,
            duplicated or too large (the error names the member).
    """
    file_size_bytes = os.fstat(handle.fileno()).st_size
    _check_extended_headers(handle, path, limits)
    handle.seek(0)
    try:
        tar = tarfile.open(fileobj=handle, mode="r:")
    except (tarfile.TarError, EOFError, ValueError) as exc:
        raise BundleError("not a bundle: not an uncompressed tar file", path=path) from exc

    members: dict[str, _Member] = {}
    seen_names: set[str] = set()
    total_bytes = 0
    entry_count = 0
    archive_end = 0
    while True:
        try:
            info = tar.next()
        except (tarfile.TarError, EOFError, ValueError) as exc:
            raise BundleError("truncated or corrupt bundle", path=path, reason=str(exc)) from exc
        if info is None:
            break
        entry_count += 1
        if entry_count > limits.max_members:
            raise BundleError("too many members", path=path, expected=f"<= {limits.max_members}")
        name = info.name
        _check_member_name(name, path)
        _check_member_type(info, path)
        if name in seen_names:
            raise BundleError("duplicate member", path=path, member=_shown(name))
        seen_names.add(name)
        if info.isdir():
            # tarfile reads the next header straight after a directory's, whatever its size says.
            archive_end = max(archive_end, info.offset_data)
            continue
        if not is_allowed_member_name(name):
            raise BundleError("unexpected member", path=path, member=_shown(name))
        limit_bytes = (
            limits.max_metadata_bytes if name in METADATA_MEMBERS else limits.max_member_bytes
        )
        if info.size > limit_bytes:
            raise BundleError(
                "member is too large",
                path=path,
                member=name,
                expected=f"<= {limit_bytes} bytes",
                found=f"{info.size} bytes",
            )
        total_bytes += info.size
        if total_bytes > limits.max_total_bytes:
            raise BundleError(
                "bundle is too large in total",
                path=path,
                expected=f"<= {limits.max_total_bytes} bytes",
            )
        if info.offset_data + info.size > file_size_bytes:
            raise BundleError("truncated bundle: member data is cut off", path=path, member=name)
        members[name] = _Member(name=name, offset_data=info.offset_data, size=info.size)
        archive_end = max(archive_end, info.offset_data + _round_up_to_block(info.size))
    _check_archive_end(handle, path, archive_end)
    return members


def _shown(name: str) -> str:
    """A member name fit for a one-line error (control characters escaped)."""
    return name if name.isprintable() else ascii(name)


def _check_member_name(name: str, path: Path) -> None:
    shown = _shown(name)
    if "\x00" in name:
        raise BundleError("member name contains a NUL byte", path=path, member=shown)
    if "\\" in name:
        raise BundleError("member name contains a backslash", path=path, member=shown)
    if name.startswith("/"):
        raise BundleError("member has an absolute path", path=path, member=shown)
    parts = name.split("/")
    if ".." in parts:
        raise BundleError("member path has a '..' component", path=path, member=shown)
    if any(part in ("", ".") for part in parts):
        raise BundleError("member path has an empty or '.' component", path=path, member=shown)


def _check_member_type(info: tarfile.TarInfo, path: Path) -> None:
    name = _shown(info.name)
    if info.issym():
        raise BundleError(
            "member is a symbolic link", path=path, member=name, target=_shown(info.linkname)
        )
    if info.islnk():
        raise BundleError(
            "member is a hard link", path=path, member=name, target=_shown(info.linkname)
        )
    if info.ischr() or info.isblk():
        raise BundleError("member is a device file", path=path, member=name)
    if info.isfifo():
        raise BundleError("member is a FIFO", path=path, member=name)
    if info.isdir():
        if info.name != ENGINES_DIR:
            raise BundleError("unexpected directory member", path=path, member=name)
        return
    # tarfile counts GNU sparse files as regular; their data is not one contiguous byte range.
    if not info.isfile() or info.issparse():
        raise BundleError("member is not a regular file", path=path, member=name)


def _check_extended_headers(handle: BinaryIO, path: Path, limits: BundleLimits) -> None:
    """Refuse oversized pax / GNU long-name headers before tarfile reads them whole into memory."""
    offset = 0
    # A member has at most a few extension headers in front of it; more is a flood, not a bundle.
    max_headers = 4 * (limits.max_members + 1)
    for header_count in range(max_headers + 1):
        if header_count == max_headers:
            raise BundleError("too many tar headers", path=path, expected=f"<= {max_headers}")
        handle.seek(offset)
        header = handle.read(TAR_BLOCK_BYTES)
        if len(header) < TAR_BLOCK_BYTES or not _header_checksum_ok(header):
            return  # end of archive, or something tarfile itself will report
        size_bytes = _header_size(header)
        if size_bytes is None:
            return
        if header[156:157] in _EXTENDED_HEADER_TYPES and size_bytes > limits.max_metadata_bytes:
            raise BundleError(
                "extended tar header is too large",
                path=path,
                offset=offset,
                expected=f"<= {limits.max_metadata_bytes} bytes",
            )
        offset += TAR_BLOCK_BYTES + _round_up_to_block(size_bytes)


def _header_number(field: bytes) -> int | None:
    """A numeric header field read the way tarfile reads it (octal up to NUL, or base-256)."""
    if field[0] & 0x80:  # GNU base-256, used for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\x00", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def _header_size(header: bytes) -> int | None:
    return _header_number(header[124:136])


def _header_checksum_ok(header: bytes) -> bool:
    # tarfile accepts the unsigned and the signed byte sum (old tars wrote the latter), so must we,
    # or this guard would stop early where tarfile goes on reading.
    stored = _header_number(header[148:156])
    blanked = header[:148] + b" " * 8 + header[156:]
    unsigned_sum = sum(blanked)
    signed_sum = sum(byte - 256 if byte > 127 else byte for byte in blanked)
    return stored in (unsigned_sum, signed_sum)


def _check_archive_end(handle: BinaryIO, path: Path, archive_end: int) -> None:
    # tarfile silently stops at a cut-off or garbled header after the first member; a whole tar
    # ends with zero blocks, so demand one where the last member ends.
    handle.seek(archive_end)
    block = handle.read(TAR_BLOCK_BYTES)
    if len(block) < TAR_BLOCK_BYTES:
        raise BundleError("truncated bundle: the tar has no end-of-archive marker", path=path)
    if block.count(0) != TAR_BLOCK_BYTES:
        raise BundleError("corrupt bundle: unreadable tar header", path=path, offset=archive_end)


def _round_up_to_block(size_bytes: int) -> int:
    return -(-size_bytes // TAR_BLOCK_BYTES) * TAR_BLOCK_BYTES


def _read_range(handle: BinaryIO, member: _Member, path: Path) -> bytes:
    handle.seek(member.offset_data)
    data = handle.read(member.size)
    if len(data) != member.size:
        raise BundleError("truncated bundle: member data is cut off", path=path, member=member.name)
    return data


def _hash_range(
    handle: BinaryIO, member: _Member, path: Path, sink: BinaryIO | None = None
) -> str:
    """Stream a member's bytes through sha256 (and into ``sink``); return the hex digest."""
    handle.seek(member.offset_data)
    digest = hashlib.sha256()
    remaining = member.size
    while remaining > 0:
        chunk = handle.read(min(CHUNK_BYTES, remaining))
        if not chunk:
            raise BundleError(
                "truncated bundle: member data is cut off", path=path, member=member.name
            )
        digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
        remaining -= len(chunk)
    return digest.hexdigest()


def _read_manifest_member(
    handle: BinaryIO, members: Mapping[str, _Member], path: Path
) -> bytes:
    member = members.get(MANIFEST_MEMBER)
    if member is None:
        raise BundleError("not a bundle: no manifest.json", path=path)
    return _read_range(handle, member, path)


def _check_member_set(
    members: Mapping[str, _Member], artifacts: Mapping[str, Mapping[str, Any]], path: Path
) -> None:
    for name in sorted(members):
        if name not in METADATA_MEMBERS and name not in artifacts:
            raise BundleError(
                "member is not listed in the manifest's artifacts", path=path, member=name
            )
    for name in sorted(artifacts):
        member = members.get(name)
        if member is None:
            raise BundleError("artifact listed in the manifest is missing", path=path, member=name)
        if member.size != artifacts[name]["size"]:
            raise BundleError(
                "artifact size does not match the manifest",
                path=path,
                member=name,
                expected=artifacts[name]["size"],
                found=member.size,
            )


# --------------------------------------------------------------------------------------------------
# Verified bundle


class VerifiedBundle:
    """A bundle whose signature, manifest and artifact hashes have been checked.

    Built by :func:`open_bundle`. The bundle file is read again by :meth:`extract` and
    :meth:`read_member`, which hash what they read, so a file that changed after verification is
    caught rather than trusted.
    """

    def __init__(
        self,
        *,
        path: Path,
        manifest: dict[str, Any],
        key_id: str,
        manifest_bytes: bytes,
        signature_bytes: bytes,
        members: Mapping[str, _Member],
    ) -> None:
        self.path = path
        self.key_id = key_id
        self._manifest = manifest
        self._manifest_bytes = manifest_bytes
        self._signature_bytes = signature_bytes
        self._members = dict(members)

    @property
    def manifest(self) -> dict[str, Any]:
        """The verified manifest (a copy: changing it changes nothing here)."""
        return copy.deepcopy(self._manifest)

    @property
    def member_names(self) -> list[str]:
        """The names of every member, the metadata first."""
        return [*METADATA_MEMBERS, *_member_order(self._manifest["artifacts"])]

    def read_member(self, name: str, *, max_bytes: int = 16 * MEBIBYTE) -> bytes:
        """Return a small member's bytes, checked against the manifest.

        Raises:
            BundleError: no such member, larger than ``max_bytes``, or its bytes changed since
                verification.
        """
        if name == MANIFEST_MEMBER:
            return self._manifest_bytes
        if name == SIGNATURE_MEMBER:
            return self._signature_bytes
        member = self._members.get(name)
        if member is None:
            raise BundleError("no such member in the bundle", path=self.path, member=name)
        if member.size > max_bytes:
            raise BundleError(
                "member is too large to read into memory",
                path=self.path,
                member=name,
                expected=f"<= {max_bytes} bytes",
                found=f"{member.size} bytes",
            )
        with _open_bundle_file(self.path) as handle:
            data = _read_range(handle, member, self.path)
        expected = self._manifest["artifacts"][name]["sha256"]
        if hashlib.sha256(data).hexdigest() != expected:
            raise BundleError("member changed since verification", path=self.path, member=name)
        return data

    def extract(self, dest_dir: Path) -> Path:
        """Extract the verified members into the new directory ``dest_dir``, atomically.

        Members are written into a temporary directory beside ``dest_dir``, hashed as they are
        written, fsynced, and the directory is renamed into place only when every hash matches.

        Returns:
            ``dest_dir``.

        Raises:
            BundleError: ``dest_dir`` exists, a member's bytes no longer match the manifest, or
                writing fails. Nothing is left behind in any of these cases.
        """
        dest_dir = Path(dest_dir)
        if dest_dir.exists() or dest_dir.is_symlink():
            raise BundleError("extract destination already exists", path=dest_dir)
        try:
            with staging_dir(dest_dir.parent, prefix=f".{dest_dir.name}.extract-") as staging:
                self._write_members(staging)
                os.chmod(staging, EXTRACTED_DIR_MODE)
                # rename(2) would silently replace an empty directory created since the check.
                if dest_dir.exists() or dest_dir.is_symlink():
                    raise BundleError("extract destination already exists", path=dest_dir)
                os.rename(staging, dest_dir)
        except OSError as exc:
            raise BundleError("cannot extract bundle", path=dest_dir, reason=str(exc)) from exc
        fsync_dir(dest_dir.parent)
        return dest_dir

    def _write_members(self, staging: Path) -> None:
        _write_synced(staging / MANIFEST_MEMBER, self._manifest_bytes)
        _write_synced(staging / SIGNATURE_MEMBER, self._signature_bytes)
        artifacts = self._manifest["artifacts"]
        with _open_bundle_file(self.path) as handle:
            for name in sorted(artifacts, key=lambda item: self._members[item].offset_data):
                target = staging / name
                target.parent.mkdir(exist_ok=True)
                with open(target, "xb") as out:
                    digest = _hash_range(handle, self._members[name], self.path, sink=out)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(target, MEMBER_FILE_MODE)
                if digest != artifacts[name]["sha256"]:
                    raise BundleError(
                        "member changed since verification",
                        path=self.path,
                        member=name,
                        expected=artifacts[name]["sha256"],
                        found=digest,
                    )
        if (staging / ENGINES_DIR).is_dir():
            os.chmod(staging / ENGINES_DIR, EXTRACTED_DIR_MODE)
            fsync_dir(staging / ENGINES_DIR)
        fsync_dir(staging)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(path, MEMBER_FILE_MODE)


def open_bundle(
    path: Path,
    trusted_keys: Iterable[Ed25519PublicKey],
    *,
    limits: BundleLimits = DEFAULT_LIMITS,
    agent_version: str | None = None,
) -> VerifiedBundle:
    """Verify a bundle completely and return it.

    Order (design §5.1): header scan, signature over the raw manifest bytes, manifest validation,
    member set, every artifact hash, then (when ``agent_version`` is given) compatibility.

    Args:
        path: The bundle file.
        trusted_keys: Public keys whose signatures are accepted.
        limits: Size and count bounds for the header scan.
        agent_version: The running agent's version; None skips the compatibility check.

    Raises:
        SignatureError: no ``manifest.sig``, a malformed one, an unknown key or a bad signature.
        BundleError: anything else (unsafe or unknown member, truncated, invalid manifest, hash or
            size mismatch, bundle needs a newer agent).
    """
    path = Path(path)
    with _open_bundle_file(path) as handle:
        members = _scan_members(handle, path, limits)
        manifest_bytes = _read_manifest_member(handle, members, path)
        signature_member = members.get(SIGNATURE_MEMBER)
        if signature_member is None:
            raise SignatureError("unsigned bundle: no manifest.sig", path=path)
        signature_bytes = _read_range(handle, signature_member, path)
        try:
            key_id = verify_manifest(manifest_bytes, signature_bytes, trusted_keys)
        except SignatureError as exc:
            raise SignatureError(exc.message, path=path, **exc.fields) from exc
        # Only now are the manifest's bytes known to come from a trusted signer.
        manifest = parse_manifest_bytes(manifest_bytes)
        validate_manifest(manifest)
        artifacts = manifest["artifacts"]
        _check_member_set(members, artifacts, path)
        for name in sorted(artifacts, key=lambda item: members[item].offset_data):
            digest = _hash_range(handle, members[name], path)
            if digest != artifacts[name]["sha256"]:
                raise BundleError(
                    "artifact hash does not match the manifest",
                    path=path,
                    member=name,
                    expected=artifacts[name]["sha256"],
                    found=digest,
                )
    if agent_version is not None:
        check_compatibility(manifest, agent_version)
    return VerifiedBundle(
        path=path,
        manifest=manifest,
        key_id=key_id,
        manifest_bytes=manifest_bytes,
        signature_bytes=signature_bytes,
        members=members,
    )


def inspect_bundle(path: Path, *, limits: BundleLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Read a bundle's manifest and signing key id for display, trusting neither.

    The header scan is the same as :func:`open_bundle`'s; nothing is verified or validated.

    Returns:
        ``{"manifest": dict, "members": {name: size}, "signature": {"present": bool,
        "key_id": str | None, "error": str | None}}``.

    Raises:
        BundleError: the file is not a bundle, is unsafe to read, or its manifest is not JSON.
    """
    path = Path(path)
    with _open_bundle_file(path) as handle:
        members = _scan_members(handle, path, limits)
        manifest = parse_manifest_bytes(_read_manifest_member(handle, members, path))
        signature: dict[str, Any] = {"present": False, "key_id": None, "error": None}
        signature_member = members.get(SIGNATURE_MEMBER)
        if signature_member is not None:
            signature["present"] = True
            try:
                document = parse_signature_document(_read_range(handle, signature_member, path))
                signature["key_id"] = document.key_id
            except SignatureError as exc:
                signature["error"] = str(exc)
    return {
        "manifest": manifest,
        "members": {name: member.size for name, member in members.items()},
        "signature": signature,
    }


def resign_bundle(
    source: Path,
    out_path: Path,
    signing_key: Ed25519PrivateKey,
    *,
    limits: BundleLimits = DEFAULT_LIMITS,
) -> dict[str, Any]:
    """Sign an existing bundle's manifest and members again with ``signing_key``.

    The old signature is not checked (the operator vouches by re-signing), but every member must
    match the manifest's artifacts exactly, so re-signing cannot launder a tampered member.
    ``out_path`` may be ``source`` itself.

    Returns:
        The manifest as re-signed (unchanged content).

    Raises:
        BundleError: the source is unsafe or not a bundle, or its members do not match its manifest.
    """
    source = Path(source)
    out_path = Path(out_path)
    with _open_bundle_file(source) as handle:
        members = _scan_members(handle, source, limits)
        manifest = parse_manifest_bytes(_read_manifest_member(handle, members, source))
        try:
            with staging_dir(out_path.parent, prefix=f".{out_path.name}.resign-") as staging:
                files: dict[str, Path] = {}
                for name, member in members.items():
                    if name in METADATA_MEMBERS:
                        continue
                    target = staging / name
                    target.parent.mkdir(exist_ok=True)
                    with open(target, "xb") as out:
                        _hash_range(handle, member, source, sink=out)
                    files[name] = target
                return pack_bundle(out_path, manifest, files, signing_key, limits=limits)
        except OSError as exc:
            raise BundleError(
                "cannot stage bundle members", path=out_path, reason=str(exc)
            ) from exc
