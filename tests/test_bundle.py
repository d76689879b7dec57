"""The signed model bundle (models/bundle.py): pack, verify, extract, inspect, and hostile tars.

Malicious archives are written directly with ``tarfile`` so that each test controls exactly which
header the reader meets.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.errors import BundleError, SignatureError
from models.bundle import inspect_bundle, open_bundle, pack_bundle, resign_bundle
from models.manifest import (
    MANIFEST_SCHEMA_VERSION,
    canonical_manifest_bytes,
    check_compatibility,
    parse_utc_timestamp,
    validate_manifest,
)
from models.signing import compute_key_id, generate_private_key, sign_manifest
from models.tarscan import BundleLimits

ENGINE_FINGERPRINT = "orin-nano-jp6-trt10.3"
ENGINE_MEMBER = f"engines/{ENGINE_FINGERPRINT}.plan"
CREATED_AT = "2024-05-01T12:00:00Z"

MODEL_BYTES = bytes(range(256)) * 40 + b"tail"
ENGINE_BYTES = b"PLAN" * 300
REPORT_BYTES = b'{"latency_ms": 1.5}\n'


def make_manifest() -> dict[str, Any]:
    return {
        "name": "resnet8",
        "version": 3,
        "created_at": CREATED_AT,
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, 32, 32], "layout": "NCHW"}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [-1, 10]}],
        "preprocessing": {"resize": [32, 32], "mean": [0.5] * 3, "std": [0.25] * 3, "channel_order": "RGB"},
        "precision": {"int8_layers": ["conv1", "conv2"], "fp16_layers": ["fc"], "fp32_layers": ["softmax"]},
        "max_batch": 16,
        "opt_batch": 4,
        "calibration": {"method": "entropy", "samples": 512, "data_sha256": "ab" * 32},
        "accuracy": {"top1_fp32": 0.93, "top1_int8": 0.925},
        "engines": {ENGINE_FINGERPRINT: ENGINE_MEMBER},
        "min_agent_version": "0.1.0",
    }


def make_valid_full_manifest() -> dict[str, Any]:
    manifest = make_manifest()
    manifest["schema_version"] = MANIFEST_SCHEMA_VERSION
    manifest["artifacts"] = {
        "model.onnx": {"sha256": hashlib.sha256(MODEL_BYTES).hexdigest(), "size": len(MODEL_BYTES)},
        ENGINE_MEMBER: {"sha256": hashlib.sha256(ENGINE_BYTES).hexdigest(), "size": len(ENGINE_BYTES)},
    }
    return manifest


@pytest.fixture()
def signing_key() -> Ed25519PrivateKey:
    return generate_private_key()


@pytest.fixture()
def source_files(tmp_path: Path) -> dict[str, Path]:
    source = tmp_path / "build"
    (source / "engines").mkdir(parents=True)
    files = {
        "model.onnx": (source / "model.onnx", MODEL_BYTES),
        ENGINE_MEMBER: (source / ENGINE_MEMBER, ENGINE_BYTES),
        "report.json": (source / "report.json", REPORT_BYTES),
    }
    for path, data in files.values():
        path.write_bytes(data)
    return {name: path for name, (path, _) in files.items()}


@pytest.fixture()
def bundle_path(tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey) -> Path:
    path = tmp_path / "resnet8-v3.bundle"
    pack_bundle(path, make_manifest(), source_files, signing_key)
    return path


def read_entries(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """Every entry of a (trusted, test-made) tar with its data."""
    entries = []
    with tarfile.open(path) as tar:
        for info in tar.getmembers():
            handle = tar.extractfile(info) if info.isfile() else None
            entries.append((info, handle.read() if handle else None))
    return entries


def write_tar(path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_entry(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special_entry(name: str, member_type: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = member_type
    info.linkname = linkname
    return info, None


def signed_tar(
    path: Path,
    manifest_bytes: bytes,
    signing_key: Ed25519PrivateKey,
    members: dict[str, bytes],
) -> Path:
    """A bundle made by hand: the given manifest bytes, signed, plus ``members``."""
    entries = [
        file_entry("manifest.json", manifest_bytes),
        file_entry("manifest.sig", sign_manifest(manifest_bytes, signing_key)),
    ]
    entries += [file_entry(name, data) for name, data in members.items()]
    return write_tar(path, entries)


def member_offset(path: Path, name: str) -> int:
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset_data


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x01]))


def leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


# --------------------------------------------------------------------------------------------------
# Round trip and the packer


def test_pack_verify_extract_round_trip(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey, source_files: dict[str, Path]
) -> None:
    bundle = open_bundle(bundle_path, [generate_private_key().public_key(), signing_key.public_key()])
    assert bundle.key_id == compute_key_id(signing_key.public_key())
    manifest = bundle.manifest
    assert manifest["name"] == "resnet8" and manifest["version"] == 3
    assert manifest["artifacts"]["model.onnx"] == {
        "sha256": hashlib.sha256(MODEL_BYTES).hexdigest(),
        "size": len(MODEL_BYTES),
    }
    assert set(manifest["artifacts"]) == {"model.onnx", ENGINE_MEMBER, "report.json"}

    dest = bundle.extract(tmp_path / "store" / "resnet8-3")
    assert dest == tmp_path / "store" / "resnet8-3"
    assert (dest / "model.onnx").read_bytes() == MODEL_BYTES
    assert (dest / ENGINE_MEMBER).read_bytes() == ENGINE_BYTES
    assert (dest / "report.json").read_bytes() == REPORT_BYTES
    assert (dest / "manifest.json").read_bytes() == canonical_manifest_bytes(manifest)
    assert json.loads((dest / "manifest.sig").read_bytes())["key_id"] == bundle.key_id
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == sorted(
        ["manifest.json", "manifest.sig", "model.onnx", ENGINE_MEMBER, "report.json"]
    )
    assert stat.S_IMODE((dest / "model.onnx").stat().st_mode) == 0o644
    assert leftovers(dest.parent) == []


def test_verified_manifest_is_a_copy(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    bundle.manifest["artifacts"].clear()
    assert "model.onnx" in bundle.manifest["artifacts"]


def test_pack_fills_defaults_and_writes_canonical_manifest(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    manifest = make_manifest()
    del manifest["created_at"]
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    final = pack_bundle(tmp_path / "b.bundle", manifest, source_files, signing_key)
    assert "artifacts" not in manifest and "created_at" not in manifest  # the caller's dict is untouched
    assert final["schema_version"] == MANIFEST_SCHEMA_VERSION
    created = parse_utc_timestamp(final["created_at"])
    assert created is not None and created >= before

    entries = {info.name: data for info, data in read_entries(tmp_path / "b.bundle")}
    manifest_bytes = entries["manifest.json"]
    assert manifest_bytes == (json.dumps(final, sort_keys=True, indent=2) + "\n").encode()
    assert json.loads(manifest_bytes) == final


def test_pack_is_deterministic(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    first = tmp_path / "first.bundle"
    second = tmp_path / "second.bundle"
    pack_bundle(first, make_manifest(), source_files, signing_key)
    pack_bundle(second, make_manifest(), source_files, signing_key)
    assert first.read_bytes() == second.read_bytes()

    entries = [info for info, _ in read_entries(first)]
    assert [info.name for info in entries] == [
        "manifest.json",
        "manifest.sig",
        "model.onnx",
        ENGINE_MEMBER,
        "report.json",
    ]
    created_s = int(datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.timezone.utc).timestamp())
    for info in entries:
        assert info.isreg()
        assert (info.uid, info.gid, info.uname, info.gname) == (0, 0, "", "")
        assert info.mode == 0o644
        assert info.mtime == created_s


def test_pack_failure_leaves_nothing_behind(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "b.bundle"
    out.write_bytes(b"previous bundle")
    manifest = make_manifest()
    manifest["opt_batch"] = 64
    with pytest.raises(BundleError, match="opt_batch"):
        pack_bundle(out, manifest, source_files, signing_key)
    assert out.read_bytes() == b"previous bundle"
    assert sorted(os.listdir(out_dir)) == ["b.bundle"]


def test_pack_detects_a_file_that_changes_while_packing(
    tmp_path: Path,
    source_files: dict[str, Path],
    signing_key: Ed25519PrivateKey,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import models.bundle as bundle_module

    real_describe = bundle_module._describe_file

    def describe_then_change(path: Path) -> dict[str, Any]:
        description = real_describe(path)
        if path.name == "model.onnx":
            path.write_bytes(MODEL_BYTES[::-1])  # same size, other bytes
        return description

    monkeypatch.setattr(bundle_module, "_describe_file", describe_then_change)
    out = tmp_path / "b.bundle"
    with pytest.raises(BundleError, match="changed while being packed") as excinfo:
        pack_bundle(out, make_manifest(), source_files, signing_key)
    assert excinfo.value.fields["member"] == "model.onnx"
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_pack_checks_declared_artifacts_against_the_files(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    final = pack_bundle(tmp_path / "a.bundle", make_manifest(), source_files, signing_key)
    # Declared artifacts that match are accepted unchanged (this is how re-signing works)...
    again = pack_bundle(tmp_path / "b.bundle", final, source_files, signing_key)
    assert again == final
    # ...and a mismatch is refused, naming the member.
    stale = copy.deepcopy(final)
    stale["artifacts"]["report.json"]["sha256"] = "0" * 64
    with pytest.raises(BundleError, match="does not match the manifest") as excinfo:
        pack_bundle(tmp_path / "c.bundle", stale, source_files, signing_key)
    assert excinfo.value.fields["member"] == "report.json"
    assert not (tmp_path / "c.bundle").exists()


@pytest.mark.parametrize("name", ["notes.txt", "engines/a.onnx", "manifest.sig", "../model.onnx"])
def test_pack_refuses_member_names_a_bundle_cannot_hold(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey, name: str
) -> None:
    files = {**source_files, name: source_files["report.json"]}
    with pytest.raises(BundleError) as excinfo:
        pack_bundle(tmp_path / "b.bundle", make_manifest(), files, signing_key)
    assert excinfo.value.fields["member"] == name
    assert not (tmp_path / "b.bundle").exists()


def test_pack_refuses_a_missing_source_file(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    files = {**source_files, "timing.cache": tmp_path / "absent.cache"}
    with pytest.raises(BundleError, match="not a regular file") as excinfo:
        pack_bundle(tmp_path / "b.bundle", make_manifest(), files, signing_key)
    assert excinfo.value.fields["member"] == "timing.cache"


def test_pack_needs_the_model(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    files = {name: path for name, path in source_files.items() if name != "model.onnx"}
    with pytest.raises(BundleError, match="artifacts") as excinfo:
        pack_bundle(tmp_path / "b.bundle", make_manifest(), files, signing_key)
    assert "model.onnx" in excinfo.value.fields["expected"]


# --------------------------------------------------------------------------------------------------
# Tampering and signatures


def test_tampered_manifest_byte_fails_the_signature(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    with tarfile.open(bundle_path) as tar:
        manifest_bytes = tar.extractfile("manifest.json").read()  # type: ignore[union-attr]
    position = manifest_bytes.index(b'"version": 3') + len(b'"version": ')
    with open(bundle_path, "r+b") as handle:
        handle.seek(member_offset(bundle_path, "manifest.json") + position)
        handle.write(b"4")
    with pytest.raises(SignatureError, match="bad signature"):
        open_bundle(bundle_path, [signing_key.public_key()])


def test_tampered_artifact_byte_fails_its_hash(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    flip_byte(bundle_path, member_offset(bundle_path, "model.onnx") + 1000)
    with pytest.raises(BundleError, match="hash does not match") as excinfo:
        open_bundle(bundle_path, [signing_key.public_key()])
    assert excinfo.value.fields["member"] == "model.onnx"
    assert excinfo.value.fields["expected"] == hashlib.sha256(MODEL_BYTES).hexdigest()


def test_swapped_signature_from_another_bundle_fails(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey, bundle_path: Path
) -> None:
    newer = make_manifest()
    newer["version"] = 4
    other_path = pack_bundle_to(tmp_path / "v4.bundle", newer, source_files, signing_key)
    entries = read_entries(bundle_path)
    other_signature = dict((info.name, data) for info, data in read_entries(other_path))["manifest.sig"]
    assert other_signature is not None
    swapped = [
        file_entry("manifest.sig", other_signature) if info.name == "manifest.sig" else (info, data)
        for info, data in entries
    ]
    write_tar(tmp_path / "swapped.bundle", swapped)
    with pytest.raises(SignatureError, match="bad signature"):
        open_bundle(tmp_path / "swapped.bundle", [signing_key.public_key()])


def pack_bundle_to(path: Path, manifest: dict[str, Any], files: dict[str, Path], key: Ed25519PrivateKey) -> Path:
    pack_bundle(path, manifest, files, key)
    return path


def test_wrong_key_is_an_unknown_key(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    stranger = generate_private_key().public_key()
    with pytest.raises(SignatureError, match="unknown signing key") as excinfo:
        open_bundle(bundle_path, [stranger])
    assert excinfo.value.fields["key_id"] == compute_key_id(signing_key.public_key())
    assert excinfo.value.fields["path"] == bundle_path


def test_unsigned_bundle_is_refused(tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    entries = [(info, data) for info, data in read_entries(bundle_path) if info.name != "manifest.sig"]
    write_tar(tmp_path / "unsigned.bundle", entries)
    with pytest.raises(SignatureError, match="unsigned"):
        open_bundle(tmp_path / "unsigned.bundle", [signing_key.public_key()])


def test_signature_is_checked_before_the_manifest_is_parsed(
    tmp_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    garbage = b"{ this is not json"
    path = signed_tar(tmp_path / "g.bundle", garbage, signing_key, {"model.onnx": MODEL_BYTES})
    # An untrusted signer's manifest is never parsed: the error is about the key, not the JSON.
    with pytest.raises(SignatureError, match="unknown signing key"):
        open_bundle(path, [generate_private_key().public_key()])
    with pytest.raises(BundleError, match="not valid UTF-8 JSON"):
        open_bundle(path, [signing_key.public_key()])


def test_signed_but_invalid_manifest_is_refused_with_the_field(
    tmp_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    manifest = make_valid_full_manifest()
    manifest["max_batch"] = 0
    path = signed_tar(
        tmp_path / "b.bundle",
        canonical_manifest_bytes(manifest),
        signing_key,
        {"model.onnx": MODEL_BYTES, ENGINE_MEMBER: ENGINE_BYTES},
    )
    with pytest.raises(BundleError, match="max_batch") as excinfo:
        open_bundle(path, [signing_key.public_key()])
    assert excinfo.value.fields["field"] == "max_batch"


def test_duplicate_json_keys_in_a_signed_manifest_are_refused(
    tmp_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    text = canonical_manifest_bytes(make_valid_full_manifest()).decode()
    doubled = text.replace('"version": 3', '"version": 3,\n  "version": 99', 1).encode()
    path = signed_tar(
        tmp_path / "b.bundle", doubled, signing_key, {"model.onnx": MODEL_BYTES, ENGINE_MEMBER: ENGINE_BYTES}
    )
    with pytest.raises(BundleError, match="duplicate key"):
        open_bundle(path, [signing_key.public_key()])


# --------------------------------------------------------------------------------------------------
# Files that are not (whole) bundles


@pytest.mark.parametrize(
    "content",
    [b"", b"just some text, not a tar\n", bytes(range(256)) * 8],
    ids=["empty", "text", "binary"],
)
def test_not_a_tar_is_not_a_bundle(tmp_path: Path, signing_key: Ed25519PrivateKey, content: bytes) -> None:
    path = tmp_path / "x.bundle"
    path.write_bytes(content)
    with pytest.raises(BundleError, match="not a bundle"):
        open_bundle(path, [signing_key.public_key()])
    with pytest.raises(BundleError, match="not a bundle"):
        inspect_bundle(path)


def test_compressed_tar_is_not_a_bundle(tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    path = tmp_path / "x.bundle.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in read_entries(bundle_path):
            tar.addfile(info, io.BytesIO(data or b""))
    with pytest.raises(BundleError, match="not a bundle"):
        open_bundle(path, [signing_key.public_key()])


def test_missing_bundle_file(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    with pytest.raises(BundleError, match="not found"):
        open_bundle(tmp_path / "absent.bundle", [signing_key.public_key()])


def test_a_tar_without_manifest_is_not_a_bundle(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    path = write_tar(tmp_path / "b.bundle", [file_entry("model.onnx", MODEL_BYTES)])
    with pytest.raises(BundleError, match="no manifest.json"):
        open_bundle(path, [signing_key.public_key()])


def _cut_points(path: Path) -> dict[str, int]:
    with tarfile.open(path) as tar:
        members = {info.name: info for info in tar.getmembers()}
    last = members["report.json"]
    return {
        "inside model data": members["model.onnx"].offset_data + 100,
        "inside a header": members[ENGINE_MEMBER].offset + 200,
        "at a header boundary": members[ENGINE_MEMBER].offset,
        "end-of-archive marker removed": last.offset_data + 512,
    }


@pytest.mark.parametrize(
    "where",
    ["inside model data", "inside a header", "at a header boundary", "end-of-archive marker removed"],
)
def test_truncated_bundle_is_reported_as_truncated(
    bundle_path: Path, signing_key: Ed25519PrivateKey, where: str
) -> None:
    cut = _cut_points(bundle_path)[where]
    with open(bundle_path, "r+b") as handle:
        handle.truncate(cut)
    with pytest.raises(BundleError, match="truncated"):
        open_bundle(bundle_path, [signing_key.public_key()])
    with pytest.raises(BundleError, match="truncated"):
        inspect_bundle(bundle_path)


def test_garbage_after_the_last_member_is_refused(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    with tarfile.open(bundle_path) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    with open(bundle_path, "r+b") as handle:
        handle.seek(end)
        handle.write(b"\x01" * 512)  # a garbled header that tarfile would take for the end
    with pytest.raises(BundleError, match="corrupt"):
        open_bundle(bundle_path, [signing_key.public_key()])


# --------------------------------------------------------------------------------------------------
# Hostile archives


@pytest.fixture()
def good_entries(bundle_path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return read_entries(bundle_path)


def _with_entry(
    good_entries: list[tuple[tarfile.TarInfo, bytes | None]], extra: tuple[tarfile.TarInfo, bytes | None]
) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [*good_entries, extra]


def _nul_name_entry() -> tuple[tarfile.TarInfo, bytes]:
    info, data = file_entry("report.json", b"x")
    info.pax_headers = {"path": "report.json\x00.evil"}
    return info, data


HOSTILE_ENTRIES: dict[str, tuple[Callable[[], tuple[tarfile.TarInfo, bytes | None]], str, str]] = {
    "absolute path": (lambda: file_entry("/etc/cron.d/evil", b"x"), "absolute path", "/etc/cron.d/evil"),
    "dot-dot": (lambda: file_entry("../evil.plan", b"x"), "'..' component", "../evil.plan"),
    "dot-dot inside": (
        lambda: file_entry("engines/../../evil", b"x"),
        "'..' component",
        "engines/../../evil",
    ),
    "backslash": (lambda: file_entry("engines\\evil.plan", b"x"), "backslash", "engines\\evil.plan"),
    "nul byte": (_nul_name_entry, "NUL", ascii("report.json\x00.evil")),
    "dot component": (lambda: file_entry("./timing.cache", b"x"), "'.' component", "./timing.cache"),
    "symlink": (
        lambda: special_entry("timing.cache", tarfile.SYMTYPE, "/etc/shadow"),
        "symbolic link",
        "timing.cache",
    ),
    "hardlink": (
        lambda: special_entry("timing.cache", tarfile.LNKTYPE, "model.onnx"),
        "hard link",
        "timing.cache",
    ),
    "char device": (lambda: special_entry("timing.cache", tarfile.CHRTYPE), "device", "timing.cache"),
    "block device": (lambda: special_entry("timing.cache", tarfile.BLKTYPE), "device", "timing.cache"),
    "fifo": (lambda: special_entry("timing.cache", tarfile.FIFOTYPE), "FIFO", "timing.cache"),
    "sparse file": (lambda: special_entry("timing.cache", tarfile.GNUTYPE_SPARSE), "not a regular file", "timing.cache"),
    "unknown type": (lambda: special_entry("timing.cache", b"9"), "not a regular file", "timing.cache"),
    "other directory": (lambda: special_entry("models", tarfile.DIRTYPE), "unexpected directory", "models"),
    "duplicate": (lambda: file_entry("model.onnx", b"evil weights"), "duplicate", "model.onnx"),
    "newline in name": (
        lambda: file_entry("report\n.json", b"x"),
        "unexpected member",
        ascii("report\n.json"),
    ),
    "unknown top-level": (lambda: file_entry("install.sh", b"x"), "unexpected member", "install.sh"),
    "nested engine": (
        lambda: file_entry("engines/sub/evil.plan", b"x"),
        "unexpected member",
        "engines/sub/evil.plan",
    ),
    "engine not a plan": (lambda: file_entry("engines/evil.so", b"x"), "unexpected member", "engines/evil.so"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ENTRIES))
def test_hostile_members_are_refused_by_the_header_scan(
    tmp_path: Path,
    good_entries: list[tuple[tarfile.TarInfo, bytes | None]],
    signing_key: Ed25519PrivateKey,
    case: str,
) -> None:
    make_entry, message, member = HOSTILE_ENTRIES[case]
    path = write_tar(tmp_path / "hostile.bundle", _with_entry(good_entries, make_entry()))
    # The scan runs before the signature is looked at: even an untrusted bundle gets this error.
    for check in (
        lambda: open_bundle(path, [signing_key.public_key()]),
        lambda: open_bundle(path, [generate_private_key().public_key()]),
        lambda: inspect_bundle(path),
    ):
        with pytest.raises(BundleError, match=message) as excinfo:
            check()
        assert not isinstance(excinfo.value, SignatureError)
        assert excinfo.value.fields["member"] == member


def test_hostile_member_first_in_the_archive_is_refused(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    path = write_tar(tmp_path / "b.bundle", [special_entry("model.onnx", tarfile.SYMTYPE, "/etc/passwd")])
    with pytest.raises(BundleError, match="symbolic link"):
        open_bundle(path, [signing_key.public_key()])


def test_an_engines_directory_entry_is_allowed(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]], signing_key: Ed25519PrivateKey
) -> None:
    # GNU tar writes directory entries; "engines/" is a legitimate one.
    directory = special_entry("engines", tarfile.DIRTYPE)
    for position in (2, len(good_entries)):  # before the plans, and as the very last entry
        entries = [*good_entries[:position], directory, *good_entries[position:]]
        path = write_tar(tmp_path / f"b{position}.bundle", entries)
        bundle = open_bundle(path, [signing_key.public_key()])
        dest = bundle.extract(tmp_path / f"out{position}")
        assert (dest / ENGINE_MEMBER).read_bytes() == ENGINE_BYTES


def test_member_size_limits(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    keys = [signing_key.public_key()]
    with pytest.raises(BundleError, match="member is too large") as excinfo:
        open_bundle(bundle_path, keys, limits=BundleLimits(max_member_bytes=len(MODEL_BYTES) - 1))
    assert excinfo.value.fields["member"] == "model.onnx"

    with pytest.raises(BundleError, match="member is too large") as excinfo:
        open_bundle(bundle_path, keys, limits=BundleLimits(max_metadata_bytes=100))
    assert excinfo.value.fields["member"] == "manifest.json"

    with pytest.raises(BundleError, match="too large in total"):
        open_bundle(bundle_path, keys, limits=BundleLimits(max_total_bytes=len(MODEL_BYTES)))

    with pytest.raises(BundleError, match="too many members"):
        open_bundle(bundle_path, keys, limits=BundleLimits(max_members=4))

    # Exactly at the limits is fine.
    open_bundle(bundle_path, keys, limits=BundleLimits(max_member_bytes=len(MODEL_BYTES), max_members=5))


def test_oversized_member_is_refused_before_its_data_is_read(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    # A header that claims 5 GiB with no data behind it: the size check must fire, not a read.
    info = tarfile.TarInfo("model.onnx")
    info.size = 5 * 1024**3
    header = info.tobuf(format=tarfile.PAX_FORMAT)
    path = tmp_path / "huge.bundle"
    path.write_bytes(header + b"\0" * 1024)
    with pytest.raises(BundleError, match="member is too large") as excinfo:
        open_bundle(path, [signing_key.public_key()])
    assert excinfo.value.fields["member"] == "model.onnx"


def test_oversized_extended_header_is_refused(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    info, data = file_entry("model.onnx", b"x")
    info.pax_headers = {"comment": "y" * 4096}
    path = write_tar(tmp_path / "b.bundle", [(info, data)])
    with pytest.raises(BundleError, match="extended tar header is too large"):
        open_bundle(path, [signing_key.public_key()], limits=BundleLimits(max_metadata_bytes=1024))


def test_a_flood_of_extended_headers_is_refused(tmp_path: Path, signing_key: Ed25519PrivateKey) -> None:
    record = b"17 comment=hello\n"
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = len(record)
    block = pax.tobuf(format=tarfile.USTAR_FORMAT) + record.ljust(512, b"\0")
    model, data = file_entry("model.onnx", b"x")
    path = tmp_path / "flood.bundle"
    path.write_bytes(block * 300 + model.tobuf(format=tarfile.USTAR_FORMAT) + data.ljust(512, b"\0") + b"\0" * 1024)
    with pytest.raises(BundleError, match="too many tar headers"):
        open_bundle(path, [signing_key.public_key()])


def _entry_header(name: str, entry_type: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = entry_type
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("hidden", ["huge_pax", "long_name_chain"])
@pytest.mark.parametrize("entry_type, name", [(tarfile.DIRTYPE, "engines"),
                                              (tarfile.AREGTYPE, "engines/"),
                                              (tarfile.SYMTYPE, "model.onnx")])
def test_a_dataless_entry_that_declares_data_cannot_hide_headers_from_the_guard(
        tmp_path: Path, signing_key: Ed25519PrivateKey, entry_type: bytes, name: str,
        hidden: str) -> None:
    # tarfile reads the next header straight after a directory or link, whatever its size field
    # says; a guard that skipped that size would miss the header behind it: a pax header claiming
    # 16 TiB (MemoryError in tarfile) or thousands of chained long names (RecursionError).
    if hidden == "huge_pax":
        pax = tarfile.TarInfo("././@PaxHeader")
        pax.type = tarfile.XHDTYPE
        pax.size = 1 << 44
        behind = pax.tobuf(format=tarfile.GNU_FORMAT)
    else:
        long_name = _entry_header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 8) + b"a" * 8 + b"\0" * 504
        behind = long_name * 2000
    path = tmp_path / "sneaky.bundle"
    path.write_bytes(_entry_header(name, entry_type, 512) + behind + b"\0" * 1024)
    for read in (lambda: open_bundle(path, [signing_key.public_key()]), lambda: inspect_bundle(path)):
        with pytest.raises(BundleError, match="declares data"):
            read()


def test_extra_member_not_in_the_manifest_is_refused(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]], signing_key: Ed25519PrivateKey
) -> None:
    path = write_tar(tmp_path / "b.bundle", _with_entry(good_entries, file_entry("timing.cache", b"cache")))
    with pytest.raises(BundleError, match="not listed in the manifest") as excinfo:
        open_bundle(path, [signing_key.public_key()])
    assert excinfo.value.fields["member"] == "timing.cache"


def test_missing_listed_artifact_is_refused(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]], signing_key: Ed25519PrivateKey
) -> None:
    entries = [(info, data) for info, data in good_entries if info.name != "report.json"]
    path = write_tar(tmp_path / "b.bundle", entries)
    with pytest.raises(BundleError, match="missing") as excinfo:
        open_bundle(path, [signing_key.public_key()])
    assert excinfo.value.fields["member"] == "report.json"


def test_artifact_of_the_wrong_size_is_refused(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]], signing_key: Ed25519PrivateKey
) -> None:
    entries = [
        file_entry("report.json", REPORT_BYTES + b" ") if info.name == "report.json" else (info, data)
        for info, data in good_entries
    ]
    path = write_tar(tmp_path / "b.bundle", entries)
    with pytest.raises(BundleError, match="size does not match") as excinfo:
        open_bundle(path, [signing_key.public_key()])
    assert excinfo.value.fields["member"] == "report.json"
    assert excinfo.value.fields["expected"] == len(REPORT_BYTES)


# --------------------------------------------------------------------------------------------------
# Manifest validation


def test_a_complete_manifest_is_valid_and_extra_fields_are_allowed() -> None:
    manifest = make_valid_full_manifest()
    validate_manifest(manifest)
    manifest["future_field"] = {"anything": [1, 2]}
    manifest["inputs"][0]["future_key"] = True
    validate_manifest(manifest)
    manifest["calibration"] = None
    manifest["preprocessing"] = None
    manifest["engines"] = {}
    del manifest["inputs"][0]["layout"]
    validate_manifest(manifest)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutator that sets a dotted path (list indexes as numbers) in the manifest."""

    def mutate(manifest: dict[str, Any]) -> None:
        keys: list[Any] = [int(part) if part.isdigit() else part for part in path.split(".")]
        target: Any = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return mutate


def _delete(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest.pop(field)


def _set_artifact_entry(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(manifest: dict[str, Any]) -> None:
        manifest["artifacts"][name] = value

    return mutate


INVALID_MANIFESTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("schema missing", _delete("schema_version"), "schema_version"),
    ("schema newer", _set("schema_version", 2), "schema_version"),
    ("schema string", _set("schema_version", "1"), "schema_version"),
    ("name upper", _set("name", "ResNet8"), "name"),
    ("name slash", _set("name", "a/b"), "name"),
    ("name leading dot", _set("name", ".hidden"), "name"),
    ("version zero", _set("version", 0), "version"),
    ("version bool", _set("version", True), "version"),
    ("version float", _set("version", 3.0), "version"),
    ("version too long", _set("version", 10**236), "version"),
    ("version past int64", _set("version", 2**63), "version"),
    ("created no tz", _set("created_at", "2024-05-01T12:00:00"), "created_at"),
    ("created other tz", _set("created_at", "2024-05-01T12:00:00+02:00"), "created_at"),
    ("created basic format", _set("created_at", "20240501T120000Z"), "created_at"),
    ("created month 13", _set("created_at", "2024-13-01T12:00:00Z"), "created_at"),
    ("inputs empty", _set("inputs", []), "inputs"),
    ("inputs missing", _delete("inputs"), "inputs"),
    ("input not object", _set("inputs.0", "images"), "inputs[0]"),
    ("input name empty", _set("inputs.0.name", ""), "inputs[0].name"),
    ("output names repeat", lambda m: m["outputs"].append(dict(m["outputs"][0])), "outputs[1].name"),
    ("input dtype", _set("inputs.0.dtype", "float"), "inputs[0].dtype"),
    ("input dtype object", _set("inputs.0.dtype", "object"), "inputs[0].dtype"),
    ("input shape zero", _set("inputs.0.shape.2", 0), "inputs[0].shape[2]"),
    ("input shape -2", _set("inputs.0.shape.0", -2), "inputs[0].shape[0]"),
    ("input shape str", _set("inputs.0.shape", "NCHW"), "inputs[0].shape"),
    ("input layout", _set("inputs.0.layout", 4), "inputs[0].layout"),
    ("output dtype", _set("outputs.0.dtype", "f4"), "outputs[0].dtype"),
    ("preprocessing list", _set("preprocessing", [1]), "preprocessing"),
    ("preprocessing missing", _delete("preprocessing"), "preprocessing"),
    ("precision missing list", lambda m: m["precision"].pop("fp32_layers"), "precision.fp32_layers"),
    ("precision not names", _set("precision.int8_layers", [1]), "precision.int8_layers"),
    ("precision twice", _set("precision.fp16_layers", ["conv1"]), "precision.fp16_layers"),
    ("max batch zero", _set("max_batch", 0), "max_batch"),
    ("opt over max", _set("opt_batch", 17), "opt_batch"),
    ("opt zero", _set("opt_batch", 0), "opt_batch"),
    ("calibration list", _set("calibration", []), "calibration"),
    ("calibration samples", _set("calibration.samples", 0), "calibration.samples"),
    ("calibration hash", _set("calibration.data_sha256", "xyz"), "calibration.data_sha256"),
    ("calibration method", _set("calibration.method", ""), "calibration.method"),
    ("accuracy null", _set("accuracy", None), "accuracy"),
    ("artifacts list", _set("artifacts", []), "artifacts"),
    ("artifacts no model", lambda m: m["artifacts"].pop("model.onnx"), "artifacts"),
    ("artifact hash", _set_artifact_entry("model.onnx", {"sha256": "AB" * 32, "size": 1}), "artifacts['model.onnx'].sha256"),
    ("artifact size", _set_artifact_entry("model.onnx", {"sha256": "ab" * 32, "size": -1}), "artifacts['model.onnx'].size"),
    ("artifact bad name", _set_artifact_entry("notes/x.txt", {"sha256": "ab" * 32, "size": 1}), "artifacts['notes/x.txt']"),
    ("artifact manifest", _set_artifact_entry("manifest.sig", {"sha256": "ab" * 32, "size": 1}), "artifacts['manifest.sig']"),
    ("engine not listed", _set("engines", {"xavier-nx": "engines/xavier-nx.plan"}), "engines['xavier-nx']"),
    ("engine bad member", _set("engines", {"xavier-nx": "model.onnx"}), "engines['xavier-nx']"),
    ("engines list", _set("engines", []), "engines"),
    ("min agent version", _set("min_agent_version", "1.2"), "min_agent_version"),
    ("min agent version missing", _delete("min_agent_version"), "min_agent_version"),
]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [(mutate, field) for _, mutate, field in INVALID_MANIFESTS],
    ids=[case for case, _, _ in INVALID_MANIFESTS],
)
def test_invalid_manifest_fields_are_named(mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    manifest = make_valid_full_manifest()
    mutate(manifest)
    with pytest.raises(BundleError) as excinfo:
        validate_manifest(manifest)
    error = excinfo.value
    assert error.fields["field"] == field
    assert "expected" in error.fields and "found" in error.fields
    assert field in str(error)


def test_missing_field_reports_missing() -> None:
    manifest = make_valid_full_manifest()
    del manifest["name"]
    with pytest.raises(BundleError) as excinfo:
        validate_manifest(manifest)
    assert excinfo.value.fields["found"] == "<missing>"


def test_a_manifest_must_be_an_object() -> None:
    with pytest.raises(BundleError, match="<manifest>"):
        validate_manifest([make_valid_full_manifest()])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text", ["2024-05-01T12:00:00Z", "2024-05-01T12:00:00+00:00", "2024-05-01T12:00:00.123Z", "2024-05-01T12:00:00.123456Z"]
)
def test_utc_timestamps_that_every_python_reads(text: str) -> None:
    parsed = parse_utc_timestamp(text)
    assert parsed is not None
    assert parsed.utcoffset() == datetime.timedelta(0)
    assert (parsed.year, parsed.month, parsed.hour) == (2024, 5, 12)


# --------------------------------------------------------------------------------------------------
# Compatibility


@pytest.mark.parametrize(
    ("required", "running", "ok"),
    [
        ("0.1.0", "0.1.0", True),
        ("0.1.0", "0.1.1", True),
        ("0.1.0", "0.1.0.dev3", True),
        ("0.9.0", "0.10.0", True),  # numeric, not string, comparison
        ("0.10.0", "0.9.9", False),
        ("1.0.0", "0.99.99", False),
        ("0.1.1", "0.1.0", False),
    ],
)
def test_check_compatibility(required: str, running: str, ok: bool) -> None:
    manifest = {"min_agent_version": required}
    if ok:
        check_compatibility(manifest, running)
    else:
        with pytest.raises(BundleError, match="newer agent") as excinfo:
            check_compatibility(manifest, running)
        assert excinfo.value.fields == {"required": required, "running": running}


def test_open_bundle_checks_compatibility_after_verifying(
    tmp_path: Path, source_files: dict[str, Path], signing_key: Ed25519PrivateKey
) -> None:
    from agent import __version__

    manifest = make_manifest()
    manifest["min_agent_version"] = "99.0.0"
    path = pack_bundle_to(tmp_path / "b.bundle", manifest, source_files, signing_key)
    keys = [signing_key.public_key()]
    open_bundle(path, keys)  # without an agent version only integrity is checked
    with pytest.raises(BundleError, match="newer agent") as excinfo:
        open_bundle(path, keys, agent_version=__version__)
    assert excinfo.value.fields["running"] == __version__


# --------------------------------------------------------------------------------------------------
# Extraction and member reads


def test_extracted_modes_do_not_depend_on_the_umask(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    previous_umask = os.umask(0o077)
    try:
        dest = bundle.extract(tmp_path / "v3")
    finally:
        os.umask(previous_umask)
    # The daemon may run as another user than the installer: the model must stay readable.
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "engines").stat().st_mode) == 0o755
    for name in ("manifest.json", "manifest.sig", "model.onnx", ENGINE_MEMBER):
        assert stat.S_IMODE((dest / name).stat().st_mode) == 0o644, name


def test_extract_refuses_an_existing_destination(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    dest = tmp_path / "store" / "v3"
    dest.mkdir(parents=True)  # empty: rename(2) would happily replace it
    with pytest.raises(BundleError, match="already exists"):
        bundle.extract(dest)
    assert list(dest.iterdir()) == []
    assert leftovers(dest.parent) == []


def test_extract_rehashes_and_leaves_nothing_when_the_file_changed(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    flip_byte(bundle_path, member_offset(bundle_path, ENGINE_MEMBER) + 5)
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(BundleError, match="changed since verification") as excinfo:
        bundle.extract(store / "v3")
    assert excinfo.value.fields["member"] == ENGINE_MEMBER
    assert list(store.iterdir()) == []


def test_extract_reports_a_bundle_file_cut_short_after_verification(
    tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey
) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    with open(bundle_path, "r+b") as handle:
        handle.truncate(member_offset(bundle_path, "model.onnx") + 10)
    with pytest.raises(BundleError, match="truncated"):
        bundle.extract(tmp_path / "v3")
    assert not (tmp_path / "v3").exists()
    assert leftovers(tmp_path) == []


def test_read_member(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    bundle = open_bundle(bundle_path, [signing_key.public_key()])
    assert bundle.read_member("report.json") == REPORT_BYTES
    assert json.loads(bundle.read_member("manifest.json")) == bundle.manifest
    with pytest.raises(BundleError, match="no such member"):
        bundle.read_member("timing.cache")
    with pytest.raises(BundleError, match="too large"):
        bundle.read_member("model.onnx", max_bytes=100)
    flip_byte(bundle_path, member_offset(bundle_path, "report.json"))
    with pytest.raises(BundleError, match="changed since verification"):
        bundle.read_member("report.json")


# --------------------------------------------------------------------------------------------------
# Inspect and re-sign


def test_inspect_reads_without_trusting(bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    flip_byte(bundle_path, member_offset(bundle_path, "model.onnx"))  # breaks verification only
    info = inspect_bundle(bundle_path)
    assert info["manifest"]["name"] == "resnet8"
    assert info["signature"] == {
        "present": True,
        "key_id": compute_key_id(signing_key.public_key()),
        "error": None,
    }
    assert info["members"]["model.onnx"] == len(MODEL_BYTES)


def test_inspect_reports_a_malformed_signature_without_failing(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    entries = [
        file_entry("manifest.sig", b"garbage") if info.name == "manifest.sig" else (info, data)
        for info, data in good_entries
    ]
    info = inspect_bundle(write_tar(tmp_path / "b.bundle", entries))
    assert info["signature"]["present"] is True
    assert info["signature"]["key_id"] is None
    assert "malformed signature document" in info["signature"]["error"]


def test_resign_with_a_new_key(tmp_path: Path, bundle_path: Path, signing_key: Ed25519PrivateKey) -> None:
    new_key = generate_private_key()
    out = tmp_path / "resigned.bundle"
    manifest = resign_bundle(bundle_path, out, new_key)
    original = open_bundle(bundle_path, [signing_key.public_key()]).manifest
    assert manifest == original
    bundle = open_bundle(out, [new_key.public_key()])
    assert bundle.key_id == compute_key_id(new_key.public_key())
    with pytest.raises(SignatureError, match="unknown signing key"):
        open_bundle(out, [signing_key.public_key()])
    assert leftovers(tmp_path) == []


def test_resign_in_place(bundle_path: Path) -> None:
    new_key = generate_private_key()
    resign_bundle(bundle_path, bundle_path, new_key)
    assert open_bundle(bundle_path, [new_key.public_key()]).manifest["version"] == 3


def test_resign_refuses_a_tampered_member(tmp_path: Path, bundle_path: Path) -> None:
    flip_byte(bundle_path, member_offset(bundle_path, ENGINE_MEMBER))
    out = tmp_path / "resigned.bundle"
    with pytest.raises(BundleError, match="does not match the manifest") as excinfo:
        resign_bundle(bundle_path, out, generate_private_key())
    assert excinfo.value.fields["member"] == ENGINE_MEMBER
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_resign_refuses_an_unlisted_member(
    tmp_path: Path, good_entries: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    path = write_tar(tmp_path / "b.bundle", _with_entry(good_entries, file_entry("timing.cache", b"c")))
    with pytest.raises(BundleError, match="not listed") as excinfo:
        resign_bundle(path, tmp_path / "out.bundle", generate_private_key())
    assert excinfo.value.fields["member"] == "timing.cache"


def test_a_bundle_names_the_device_classes_it_is_for() -> None:
    from models.manifest import check_target, validate_manifest
    from tests.tiny_models import tiny_manifest

    manifest = {**tiny_manifest(), "schema_version": 1, "created_at": "2026-12-01T00:00:00Z",
                "artifacts": {"model.onnx": {"sha256": "00" * 32, "size": 1}}}
    check_target(manifest, "")  # no targets: any device
    for targets, device_class in ((["orin-nano-8gb", "orin-nx-16gb"], "orin-nx-16gb"),
                                  (["*"], "")):
        validate_manifest({**manifest, "targets": targets})
        check_target({**manifest, "targets": targets}, device_class)
    with pytest.raises(BundleError, match="for other devices") as caught:
        check_target({**manifest, "targets": ["orin-agx-64gb"]}, "orin-nano-8gb")
    assert caught.value.fields["device_class"] == "orin-nano-8gb"
    with pytest.raises(BundleError, match="for other devices"):
        check_target({**manifest, "targets": ["orin-agx-64gb"]}, "")  # an undeclared device
    for bad in ([], "orin-nano-8gb", ["Orin Nano"], [3]):
        with pytest.raises(BundleError, match="targets"):
            validate_manifest({**manifest, "targets": bad})


def test_a_tar_header_checksum_is_taken_unsigned_or_signed_as_tarfile_does() -> None:
    import tarfile

    from models.tarscan import _header_checksum_ok

    info = tarfile.TarInfo("modèle-é.onnx")  # bytes above 127 in the header
    info.size = 10
    header = info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8")[-512:]
    assert _header_checksum_ok(header)  # tarfile writes the unsigned sum
    blanked = header[:148] + b" " * 8 + header[156:]
    signed = sum(byte - 256 if byte > 127 else byte for byte in blanked)
    assert signed != sum(blanked)
    old_style = header[:148] + b"%06o\0 " % signed + header[156:]
    assert _header_checksum_ok(old_style)
    wrong = header[:148] + b"%06o\0 " % (signed + 1) + header[156:]
    assert not _header_checksum_ok(wrong)
