"""Ed25519 keys and the detached signature that travels as ``manifest.sig`` (design §5.1).

A bundle is trusted because its ``manifest.json`` is signed and the manifest holds the sha256 of
every other member. The signature document is small JSON::

    {"algorithm": "ed25519", "key_id": "<16 hex>", "signature": "<base64 of 64 bytes>"}

The key id is the first 16 hex characters of sha256 over the raw 32-byte public key, so a device can
pick the right trusted key without trying each one, and an operator can match a bundle to a key file
by eye. The id is a hint for lookup only; trust comes from the signature check itself.

Keys on disk are PEM: the private key as unencrypted PKCS8 (mode 0600), the public key as
SubjectPublicKeyInfo. Unencrypted because the signer runs in CI, where a passphrase would sit next
to the key anyway; protect the file instead.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import KeyFileError, SignatureError
from agent.fsutil import FileTooLargeError, atomic_output_file, atomic_write_bytes, read_bounded

log = logging.getLogger(__name__)

SIGNATURE_ALGORITHM = "ed25519"
KEY_ID_HEX_CHARS = 16
ED25519_SIGNATURE_BYTES = 64
PRIVATE_KEY_FILE_MODE = 0o600
PUBLIC_KEY_FILE_MODE = 0o644
# A PEM key is a few hundred bytes; anything far larger is not a key file, so do not read it whole.
MAX_KEY_FILE_BYTES = 64 * 1024
# Same bound for the signature document, which is about 150 bytes.
MAX_SIGNATURE_DOCUMENT_BYTES = 64 * 1024

_PEM_LABEL = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")
_KEY_ID_PATTERN = re.compile(r"[0-9a-f]{%d}" % KEY_ID_HEX_CHARS)


@dataclass(frozen=True)
class SignatureDocument:
    """The parsed content of ``manifest.sig``."""

    algorithm: str
    key_id: str
    signature: bytes


def generate_private_key() -> Ed25519PrivateKey:
    """Return a new random Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def compute_key_id(public_key: Ed25519PublicKey) -> str:
    """Return the key id: the first 16 hex characters of sha256 over the raw 32-byte public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX_CHARS]


def public_key_path(private_key_path: Path) -> Path:
    """Where the public half of ``private_key_path`` lives: the same name plus ``.pub``."""
    private_key_path = Path(private_key_path)
    return private_key_path.with_name(private_key_path.name + ".pub")


def write_keypair(private_key_path: Path, *, overwrite: bool = False) -> Ed25519PrivateKey:
    """Generate a key pair: the private key to ``private_key_path``, the public one beside it.

    Both paths are checked before either is written, so a refusal never leaves a pair half
    replaced.

    Returns:
        The new private key.

    Raises:
        KeyFileError: either file exists and ``overwrite`` is false, or a write fails.
    """
    private_key_path = Path(private_key_path)
    public_path = public_key_path(private_key_path)
    for path in (private_key_path, public_path):
        if path.is_dir():
            raise KeyFileError("key file path is a directory", path=path)
        if not overwrite and (path.exists() or path.is_symlink()):
            raise KeyFileError("key file already exists", path=path)
    private_key = generate_private_key()
    # Both files are written to temporaries first and renamed at the end (the public key's
    # first): a failure anywhere before the renames leaves the old pair as it was.
    try:
        with atomic_output_file(private_key_path, mode=PRIVATE_KEY_FILE_MODE) as private_tmp:
            private_tmp.write_bytes(_private_pem(private_key))
            with atomic_output_file(public_path, mode=PUBLIC_KEY_FILE_MODE) as public_tmp:
                public_tmp.write_bytes(_public_pem(private_key.public_key()))
    except OSError as exc:
        raise KeyFileError("cannot write the key pair", path=private_key_path,
                           reason=exc.strerror or str(exc)) from exc
    return private_key


def write_private_key(
    path: Path, private_key: Ed25519PrivateKey, *, overwrite: bool = False
) -> None:
    """Write ``private_key`` to ``path`` as unencrypted PKCS8 PEM with mode 0600.

    The file is written atomically; its temporary is created 0600 too, so the key is never readable
    by others, not even for an instant.

    Raises:
        KeyFileError: ``path`` exists and ``overwrite`` is false, or it cannot be written.
    """
    _write_key_file(Path(path), _private_pem(private_key), mode=PRIVATE_KEY_FILE_MODE,
                    overwrite=overwrite)


def _private_pem(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())


def _public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


def write_public_key(path: Path, public_key: Ed25519PublicKey, *, overwrite: bool = False) -> None:
    """Write ``public_key`` to ``path`` as SubjectPublicKeyInfo PEM with mode 0644.

    Raises:
        KeyFileError: ``path`` exists and ``overwrite`` is false, or it cannot be written.
    """
    _write_key_file(Path(path), _public_pem(public_key), mode=PUBLIC_KEY_FILE_MODE,
                    overwrite=overwrite)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load an Ed25519 private key from a PKCS8 PEM file (or an unencrypted OpenSSH one, as
    ``ssh-keygen -t ed25519`` writes).

    Raises:
        KeyFileError: the file is missing or unreadable, is not PEM, holds a public key, is
            encrypted, or holds a key of another algorithm. The error names the file.
    """
    path = Path(path)
    data = _read_key_file(path)
    label = _pem_label(path, data)
    _check_one_block(path, data)
    if label == "OPENSSH PRIVATE KEY":  # ssh-keygen -t ed25519 writes this format
        try:
            ssh_key = serialization.load_ssh_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise KeyFileError("cannot parse OpenSSH private key (encrypted ones are not "
                               "supported)", path=path, reason=str(exc)) from exc
        _warn_if_others_can_read(path)
        return _ed25519_private(ssh_key, path)
    if "PUBLIC" in label:
        raise KeyFileError(
            "key file holds a public key; a private key is needed here", path=path, found=label
        )
    if "ENCRYPTED" in label:
        raise KeyFileError("encrypted private keys are not supported", path=path, found=label)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError("cannot parse private key", path=path, reason=str(exc)) from exc
    _warn_if_others_can_read(path)
    return _ed25519_private(key, path)


def _ed25519_private(key: object, path: Path) -> Ed25519PrivateKey:
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(
            "key is not an Ed25519 private key",
            path=path,
            expected="Ed25519PrivateKey",
            found=type(key).__name__,
        )
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Load an Ed25519 public key from a SubjectPublicKeyInfo PEM file (or an OpenSSH
    ``ssh-ed25519 ...`` line).

    Raises:
        KeyFileError: the file is missing or unreadable, is not PEM, holds a private key, or holds
            a key of another algorithm. The error names the file.
    """
    path = Path(path)
    data = _read_key_file(path)
    if data.lstrip().startswith(b"ssh-"):  # an OpenSSH public key line (id_ed25519.pub)
        try:
            ssh_key = serialization.load_ssh_public_key(data.strip())
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise KeyFileError("cannot parse OpenSSH public key", path=path,
                               reason=str(exc)) from exc
        if not isinstance(ssh_key, Ed25519PublicKey):
            raise KeyFileError("key is not an Ed25519 public key", path=path,
                               expected="Ed25519PublicKey", found=type(ssh_key).__name__)
        return ssh_key
    # Any PRIVATE block counts, not only the first: a private key may follow the public one.
    label = next((found.decode("ascii") for found in _PEM_LABEL.findall(data)
                  if b"PRIVATE" in found), None) or _pem_label(path, data)
    if "PRIVATE" in label:
        # Refuse rather than derive the public half: a private key handed out as a "trusted key"
        # has most likely been copied somewhere it should not be.
        raise KeyFileError(
            "key file holds a private key; a public key is needed here", path=path, found=label
        )
    _check_one_block(path, data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyFileError("cannot parse public key", path=path, reason=str(exc)) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(
            "key is not an Ed25519 public key",
            path=path,
            expected="Ed25519PublicKey",
            found=type(key).__name__,
        )
    return key


def sign_manifest(manifest_bytes: bytes, private_key: Ed25519PrivateKey) -> bytes:
    """Sign the exact bytes of ``manifest.json`` and return the ``manifest.sig`` document bytes."""
    document = {
        "algorithm": SIGNATURE_ALGORITHM,
        "key_id": compute_key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(manifest_bytes)).decode("ascii"),
    }
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode("utf-8")


def parse_signature_document(data: bytes) -> SignatureDocument:
    """Parse ``manifest.sig`` without checking the signature itself.

    Raises:
        SignatureError: the document is not the JSON object described in the module docstring
            (message starts with "malformed signature document").
    """
    if len(data) > MAX_SIGNATURE_DOCUMENT_BYTES:
        raise _malformed("it is too large", found=f"{len(data)} bytes")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _malformed("it is not UTF-8 JSON", reason=str(exc)) from exc
    except RecursionError:
        raise _malformed("it is nested too deeply") from None
    return signature_from_json(document)


def signature_from_json(document: object) -> SignatureDocument:
    """Check an already parsed signature document (``manifest.sig``'s content, or the
    ``signature`` part of a fleet document's envelope) without checking the signature itself.

    Raises:
        SignatureError: as :func:`parse_signature_document`.
    """
    if not isinstance(document, dict):
        raise _malformed("it is not a JSON object", found=type(document).__name__)
    for field_name in ("algorithm", "key_id", "signature"):
        if not isinstance(document.get(field_name), str):
            raise _malformed(f"field '{field_name}' is missing or not a string", field=field_name)
    algorithm = document["algorithm"]
    if algorithm != SIGNATURE_ALGORITHM:
        raise SignatureError(
            "unsupported signature algorithm", expected=SIGNATURE_ALGORITHM, found=algorithm
        )
    key_id = document["key_id"]
    if not _KEY_ID_PATTERN.fullmatch(key_id):
        raise _malformed(
            "field 'key_id' is not 16 lowercase hex characters", field="key_id", found=key_id
        )
    try:
        signature = base64.b64decode(document["signature"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _malformed("field 'signature' is not base64", field="signature") from exc
    if len(signature) != ED25519_SIGNATURE_BYTES:
        raise _malformed(
            "field 'signature' has the wrong length",
            field="signature",
            expected=f"{ED25519_SIGNATURE_BYTES} bytes",
            found=f"{len(signature)} bytes",
        )
    return SignatureDocument(algorithm=algorithm, key_id=key_id, signature=signature)


def verify_manifest(
    manifest_bytes: bytes, signature_document: bytes, trusted_keys: Iterable[Ed25519PublicKey]
) -> str:
    """Check that ``signature_document`` signs ``manifest_bytes`` with one of ``trusted_keys``.

    Args:
        manifest_bytes: The exact bytes of ``manifest.json``.
        signature_document: The bytes of ``manifest.sig``.
        trusted_keys: The public keys this caller trusts.

    Returns:
        The key id of the trusted key that made the signature.

    Raises:
        SignatureError: the document is malformed, no trusted key has its key id ("unknown signing
            key"), or the signature does not match the manifest ("bad signature").
    """
    document = parse_signature_document(signature_document)
    keys_by_id = {compute_key_id(key): key for key in trusted_keys}
    if not keys_by_id:
        raise SignatureError("no trusted public keys were given", key_id=document.key_id)
    public_key = keys_by_id.get(document.key_id)
    if public_key is None:
        raise SignatureError(
            "unknown signing key: the bundle is signed by a key that is not trusted",
            key_id=document.key_id,
            trusted=",".join(sorted(keys_by_id)),
        )
    try:
        public_key.verify(document.signature, manifest_bytes)
    except InvalidSignature as exc:
        raise SignatureError(
            "bad signature: manifest.sig does not match manifest.json", key_id=document.key_id
        ) from exc
    return document.key_id


def _malformed(detail: str, **fields: object) -> SignatureError:
    return SignatureError(f"malformed signature document: {detail}", **fields)


def _read_key_file(path: Path) -> bytes:
    try:
        return read_bounded(path, MAX_KEY_FILE_BYTES)
    except FileNotFoundError as exc:
        raise KeyFileError("key file not found", path=path) from exc
    except FileTooLargeError:
        raise KeyFileError("file is too large to be a PEM key", path=path) from None
    except OSError as exc:
        raise KeyFileError("cannot read key file", path=path, reason=exc.strerror) from exc


def _check_one_block(path: Path, data: bytes) -> None:
    """Refuse a file of several PEM blocks: only the first would be used, silently (a trust
    file made with ``cat a.pub b.pub`` would trust only ``a``). One key per file; give several
    files to trust several keys."""
    count = len(_PEM_LABEL.findall(data))
    if count > 1:
        raise KeyFileError(f"key file holds {count} PEM blocks; give one key per file (several "
                           "files to trust several keys)", path=path)


def _warn_if_others_can_read(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        log.warning("private key %s can be read by other users (mode %o): chmod 600 it",
                    path, mode & 0o777)


def _pem_label(path: Path, data: bytes) -> str:
    """Return the label of the first PEM block (``PUBLIC KEY``, ``PRIVATE KEY``, ...)."""
    match = _PEM_LABEL.search(data)
    if match is None:
        raise KeyFileError("key file is not PEM (no '-----BEGIN ...-----' line)", path=path)
    return match.group(1).decode("ascii")


def _write_key_file(path: Path, data: bytes, *, mode: int, overwrite: bool) -> None:
    if not overwrite and path.exists():
        raise KeyFileError("key file already exists", path=path)
    try:
        if overwrite:
            atomic_write_bytes(path, data, mode=mode)
        else:  # exclusive: a file another process wrote meanwhile is never replaced
            with atomic_output_file(path, mode=mode, exclusive=True) as temporary:
                temporary.write_bytes(data)
    except FileExistsError:
        raise KeyFileError("key file already exists", path=path) from None
    except OSError as exc:
        raise KeyFileError("cannot write key file", path=path, reason=exc.strerror) from exc
