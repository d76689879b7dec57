"""Whether an installed version is still what its publisher signed.

Bytes rot on disk, a power loss cuts a file short, someone edits a file: before a version is
served its manifest's signature is checked against the trusted keys, the manifest validated and
checked against this agent's version, and every artifact's size and sha256 compared with the
manifest (:func:`verify_installed`). A reinstall tells a damaged copy of the same publication
(repaired from the bundle) from a different publication of the version (refused: versions are
immutable) with :func:`publishes_other_content`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__
from agent.errors import BundleError, SignatureError, StoreError
from agent.store.files import read_small, verify_file
from agent.store.pointer import ModelRef
from models.manifest import (
    MANIFEST_MEMBER,
    SIGNATURE_MEMBER,
    check_compatibility,
    parse_manifest_bytes,
    validate_manifest,
)
from models.signing import compute_key_id, parse_signature_document, verify_manifest


def verify_installed(directory: Path, ref: ModelRef,
                     trusted_keys: Sequence[Ed25519PublicKey]) -> dict[str, Any]:
    """Verify an installed version as if it had just arrived; returns its manifest.

    Raises:
        StoreError: a file is missing, unreadable, of the wrong size or hash, or the manifest no
            longer verifies (or no key is trusted at all).
    """
    manifest_path = directory / MANIFEST_MEMBER
    signature_path = directory / SIGNATURE_MEMBER
    manifest_bytes = read_small(manifest_path)
    signature_bytes = read_small(signature_path)
    if not trusted_keys:
        raise StoreError("no trusted public keys: every installed model is re-verified at "
                         "start; pass --pubkey or set trust.public_keys", path=manifest_path)
    try:
        verify_manifest(manifest_bytes, signature_bytes, trusted_keys)
    except SignatureError as exc:
        raise StoreError(
            "installed manifest no longer verifies (manifest.json or manifest.sig changed on "
            "disk, or the signing key is no longer trusted)",
            path=manifest_path,
            signature=signature_path,
            reason=exc.message,
            key_id=exc.fields.get("key_id"),
        ) from exc
    manifest = parse_installed_manifest(manifest_bytes, manifest_path, ref)
    try:
        check_compatibility(manifest, __version__)
    except BundleError as exc:
        raise StoreError(
            f"installed version cannot run on this agent: {exc.message}",
            path=manifest_path,
            **exc.fields,
        ) from exc
    for member in sorted(manifest["artifacts"]):
        verify_file(directory / member, manifest["artifacts"][member])
    return manifest


def parse_installed_manifest(data: bytes, path: Path, ref: ModelRef) -> dict[str, Any]:
    """An installed manifest, validated, that must describe ``ref``.

    Raises:
        StoreError: it is invalid, or describes another version.
    """
    try:
        manifest = parse_manifest_bytes(data)
        validate_manifest(manifest)
    except BundleError as exc:
        raise StoreError(
            f"installed manifest is invalid: {exc.message}", path=path, **exc.fields
        ) from exc
    found = ModelRef(manifest["name"], manifest["version"])
    if found != ref:
        raise StoreError(
            "installed manifest describes another version",
            path=path,
            expected=str(ref),
            found=str(found),
        )
    return manifest


def publishes_other_content(directory: Path, manifest_bytes: bytes,
                            trusted_keys: Sequence[Ed25519PublicKey]) -> bool:
    """Whether an installed version holds a different, intact publication than
    ``manifest_bytes``: its manifest differs and is not merely damaged. Damaged means
    unreadable, or signed by a trusted key whose signature no longer matches; a manifest
    signed by a key no longer trusted is taken as intact (nothing shows it is not), so
    versions stay immutable across key rotations."""
    try:
        installed = read_small(directory / MANIFEST_MEMBER)
        signature = parse_signature_document(read_small(directory / SIGNATURE_MEMBER))
    except (StoreError, SignatureError):
        return False  # unreadable: damage, repaired from the bundle
    if installed == manifest_bytes:
        return False
    trusted = {compute_key_id(key): key for key in trusted_keys}
    key = trusted.get(signature.key_id)
    if key is None:
        return True
    try:
        key.verify(signature.signature, installed)
    except InvalidSignature:
        return False  # changed on disk after it was signed: damage
    return True
