"""The signed model bundle (design §5.1): pack, verify, extract, inspect.

A bundle is an uncompressed tar holding ``manifest.json``, ``manifest.sig``, ``model.onnx`` and
optionally ``engines/<fingerprint>.plan``, ``timing.cache`` and ``report.json``. The manifest lists
every other member with its sha256 and size; the signature covers the manifest's exact bytes. So one
signature check plus one hash per member proves the whole bundle.

Reading is defensive because bundles arrive over the network on the device:

1. the tar headers are scanned first and anything unsafe or unexpected is refused (absolute paths,
   ``..``, links, devices, duplicates, oversized or unknown members) before any content is read
   (models/tarscan.py);
2. the signature is checked over the raw manifest bytes *before* the JSON is parsed;
3. the manifest is validated (models/manifest.py), then every artifact is hashed by streaming it.

The tar is uncompressed on purpose: members can then be hashed and extracted by byte range, and the
bulk of a bundle (weights, engines) barely compresses anyway.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import io
import os
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import BundleError, SignatureError
from agent.fsutil import atomic_output_file, fsync_dir, sha256_file, staging_dir
from models.manifest import (
    ENGINES_DIR,
    MANIFEST_MEMBER,
    MANIFEST_SCHEMA_VERSION,
    METADATA_MEMBERS,
    MODEL_MEMBER,
    SIGNATURE_MEMBER,
    canonical_manifest_bytes,
    check_compatibility,
    describe_value,
    invalid_field,
    is_allowed_member_name,
    parse_manifest_bytes,
    parse_utc_timestamp,
    validate_manifest,
)
from models.signing import parse_signature_document, sign_manifest, verify_manifest
from models.tarscan import (
    DEFAULT_LIMITS,
    MEBIBYTE,
    BundleLimits,
    Member,
    hash_range,
    open_bundle_file,
    read_range,
    scan_members,
)

MEMBER_FILE_MODE = 0o644
EXTRACTED_DIR_MODE = 0o755


# --------------------------------------------------------------------------------------------------
# Packing


def pack_bundle(
    out_path: Path,
    manifest: Mapping[str, Any],
    files: Mapping[str, Path],
    signing_key: Ed25519PrivateKey,
    *,
    limits: BundleLimits = DEFAULT_LIMITS,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Write a signed bundle to ``out_path`` atomically.

    Args:
        out_path: The bundle to write; replaced only once the new one is complete.
        overwrite: False: fail if ``out_path`` exists when the bundle is complete (two builds
            that picked the same version), never replacing it.
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
        with atomic_output_file(out_path, mode=MEMBER_FILE_MODE, exclusive=not overwrite) as tmp_path:
            with tarfile.open(tmp_path, mode="w", format=tarfile.PAX_FORMAT) as tar:
                _add_bytes(tar, MANIFEST_MEMBER, manifest_bytes, mtime_s)
                _add_bytes(tar, SIGNATURE_MEMBER, signature_bytes, mtime_s)
                for name in _member_order(computed):
                    _add_file(tar, name, sources[name], computed[name], mtime_s)
    except FileExistsError:
        raise BundleError("bundle already exists", path=out_path) from None
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
        raise invalid_field("artifacts", "an object of member name to {sha256, size}", declared)
    for name in sorted(set(declared) | set(computed)):
        if name not in computed:
            raise BundleError("artifact listed in the manifest has no file", member=name)
        if name not in declared:
            raise BundleError("file is not listed in the manifest's artifacts", member=name)
        if declared[name] != computed[name]:
            raise BundleError(
                "artifact content does not match the manifest",
                member=name,
                expected=describe_value(declared[name]),
                found=describe_value(computed[name]),
            )


def _describe_file(path: Path) -> dict[str, Any]:
    digest, size_bytes = sha256_file(path)
    return {"sha256": digest, "size": size_bytes}


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
# Reading


def _read_manifest_member(
    handle: BinaryIO, members: Mapping[str, Member], path: Path
) -> bytes:
    member = members.get(MANIFEST_MEMBER)
    if member is None:
        raise BundleError("not a bundle: no manifest.json", path=path)
    return read_range(handle, member, path)


def _check_member_set(
    members: Mapping[str, Member], artifacts: Mapping[str, Mapping[str, Any]], path: Path
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
        members: Mapping[str, Member],
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
        with open_bundle_file(self.path) as handle:
            data = read_range(handle, member, self.path)
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

    def write_members(self, directory: Path) -> None:
        """Write the verified members into ``directory``, an empty directory that already
        exists, each hashed as it is written and fsynced, and the directory fsynced: what
        :meth:`extract` renames into place, for a caller that renames it itself (the model
        store, under its lock, once the update's file worker wrote it: agent/update/
        fileworker.py).

        Raises:
            BundleError: a member's bytes no longer match the manifest. What was written is
                left for the caller to remove.
            OSError: writing fails.
        """
        self._write_members(Path(directory))
        os.chmod(directory, EXTRACTED_DIR_MODE)

    def _write_members(self, staging: Path) -> None:
        _write_synced(staging / MANIFEST_MEMBER, self._manifest_bytes)
        _write_synced(staging / SIGNATURE_MEMBER, self._signature_bytes)
        artifacts = self._manifest["artifacts"]
        with open_bundle_file(self.path) as handle:
            for name in sorted(artifacts, key=lambda item: self._members[item].offset_data):
                target = staging / name
                target.parent.mkdir(exist_ok=True)
                with open(target, "xb") as out:
                    digest = hash_range(handle, self._members[name], self.path, sink=out)
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
    with open_bundle_file(path) as handle:
        members = scan_members(handle, path, limits)
        manifest_bytes = _read_manifest_member(handle, members, path)
        signature_member = members.get(SIGNATURE_MEMBER)
        if signature_member is None:
            raise SignatureError("unsigned bundle: no manifest.sig", path=path)
        signature_bytes = read_range(handle, signature_member, path)
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
            digest = hash_range(handle, members[name], path)
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
    with open_bundle_file(path) as handle:
        members = scan_members(handle, path, limits)
        manifest = parse_manifest_bytes(_read_manifest_member(handle, members, path))
        signature: dict[str, Any] = {"present": False, "key_id": None, "error": None}
        signature_member = members.get(SIGNATURE_MEMBER)
        if signature_member is not None:
            signature["present"] = True
            try:
                document = parse_signature_document(read_range(handle, signature_member, path))
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
    with open_bundle_file(source) as handle:
        members = scan_members(handle, source, limits)
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
                        hash_range(handle, member, source, sink=out)
                    files[name] = target
                return pack_bundle(out_path, manifest, files, signing_key, limits=limits)
        except OSError as exc:
            raise BundleError(
                "cannot stage bundle members", path=out_path, reason=str(exc)
            ) from exc
