"""Ed25519 keys on disk and the detached manifest signature (models/signing.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import KeyFileError, SignatureError
from models.signing import (
    compute_key_id,
    generate_private_key,
    load_private_key,
    load_public_key,
    parse_signature_document,
    public_key_path,
    sign_manifest,
    verify_manifest,
    write_keypair,
    write_private_key,
    write_public_key,
)

MANIFEST = b'{\n  "name": "resnet8",\n  "version": 3\n}\n'


@pytest.fixture()
def key_files(tmp_path: Path) -> tuple[Path, Path]:
    private_key = generate_private_key()
    private_path = tmp_path / "release.pem"
    public_path = tmp_path / "release.pem.pub"
    write_private_key(private_path, private_key)
    write_public_key(public_path, private_key.public_key())
    return private_path, public_path


def test_key_id_is_sha256_prefix_of_raw_public_key() -> None:
    private_key = generate_private_key()
    raw = private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert len(raw) == 32
    assert compute_key_id(private_key.public_key()) == hashlib.sha256(raw).hexdigest()[:16]
    assert compute_key_id(generate_private_key().public_key()) != compute_key_id(
        private_key.public_key()
    )


def test_written_keys_load_back_with_the_right_formats_and_modes(key_files: tuple[Path, Path]) -> None:
    private_path, public_path = key_files
    assert private_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_path.stat().st_mode) == 0o644

    private_key = load_private_key(private_path)
    public_key = load_public_key(public_path)
    assert compute_key_id(private_key.public_key()) == compute_key_id(public_key)
    # The loaded halves belong together: what one signs the other verifies.
    public_key.verify(private_key.sign(b"data"), b"data")


def test_writing_refuses_to_replace_a_key_unless_asked(key_files: tuple[Path, Path]) -> None:
    private_path, public_path = key_files
    before = private_path.read_bytes()
    with pytest.raises(KeyFileError, match="already exists") as excinfo:
        write_private_key(private_path, generate_private_key())
    assert excinfo.value.fields["path"] == private_path
    assert private_path.read_bytes() == before

    with pytest.raises(KeyFileError, match="already exists"):
        write_public_key(public_path, generate_private_key().public_key())

    write_private_key(private_path, generate_private_key(), overwrite=True)
    assert private_path.read_bytes() != before
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600


def test_write_keypair_puts_the_public_half_beside_the_private_one(tmp_path: Path) -> None:
    private_path = tmp_path / "keys" / "release.pem"
    private_key = write_keypair(private_path)
    public_path = tmp_path / "keys" / "release.pem.pub"
    assert public_key_path(private_path) == public_path
    assert compute_key_id(load_public_key(public_path)) == compute_key_id(private_key.public_key())
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600


def test_write_keypair_refuses_before_writing_either_half(tmp_path: Path) -> None:
    private_path = tmp_path / "release.pem"
    public_key_path(private_path).write_text("kept\n")
    with pytest.raises(KeyFileError, match="already exists") as excinfo:
        write_keypair(private_path)
    assert excinfo.value.fields["path"] == public_key_path(private_path)
    assert not private_path.exists()
    assert public_key_path(private_path).read_text() == "kept\n"
    write_keypair(private_path, overwrite=True)
    assert load_public_key(public_key_path(private_path))


def test_missing_key_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    for loader in (load_private_key, load_public_key):
        with pytest.raises(KeyFileError, match="not found") as excinfo:
            loader(missing)
        assert excinfo.value.fields["path"] == missing
        assert str(missing) in str(excinfo.value)


def test_a_file_that_is_not_pem_is_refused(tmp_path: Path) -> None:
    not_pem = tmp_path / "key.txt"
    not_pem.write_bytes(b"just some text\n")
    for loader in (load_private_key, load_public_key):
        with pytest.raises(KeyFileError, match="not PEM") as excinfo:
            loader(not_pem)
        assert excinfo.value.fields["path"] == not_pem


def test_openssh_ed25519_keys_load(tmp_path: Path) -> None:
    # What `ssh-keygen -t ed25519` writes; its conversion options do not apply to Ed25519.
    from cryptography.hazmat.primitives import serialization

    key = generate_private_key()
    private = tmp_path / "id_ed25519"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public = tmp_path / "id_ed25519.pub"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH)
                       + b" user@host\n")
    assert compute_key_id(load_private_key(private).public_key()) == compute_key_id(
        load_public_key(public)) == compute_key_id(key.public_key())
    public.write_bytes(b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA user@host\n")  # cut short
    with pytest.raises(KeyFileError, match="cannot parse OpenSSH public key"):
        load_public_key(public)


def test_a_key_file_of_several_keys_is_refused(tmp_path: Path) -> None:
    write_keypair(tmp_path / "a")
    write_keypair(tmp_path / "b")
    both = tmp_path / "both.pub"
    both.write_bytes((tmp_path / "a.pub").read_bytes() + (tmp_path / "b.pub").read_bytes())
    with pytest.raises(KeyFileError, match="holds 2 PEM blocks; give one key per file"):
        load_public_key(both)
    both_private = tmp_path / "both.key"
    both_private.write_bytes((tmp_path / "a").read_bytes() + (tmp_path / "b").read_bytes())
    both_private.chmod(0o600)
    with pytest.raises(KeyFileError, match="holds 2 PEM blocks"):
        load_private_key(both_private)


def test_a_private_key_others_can_read_is_warned_about(tmp_path: Path, caplog) -> None:
    write_keypair(tmp_path / "k")
    (tmp_path / "k").chmod(0o644)
    with caplog.at_level("WARNING", logger="models.signing"):
        load_private_key(tmp_path / "k")
    assert "can be read by other users (mode 644)" in caplog.text


def test_public_key_where_private_is_needed_and_vice_versa(key_files: tuple[Path, Path]) -> None:
    private_path, public_path = key_files
    with pytest.raises(KeyFileError, match="holds a public key; a private key is needed"):
        load_private_key(public_path)
    with pytest.raises(KeyFileError, match="holds a private key; a public key is needed"):
        load_public_key(private_path)


def test_keys_of_another_algorithm_are_refused(tmp_path: Path) -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    private_path = tmp_path / "ec.pem"
    private_path.write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_path = tmp_path / "ec.pub"
    public_path.write_bytes(
        ec_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(KeyFileError, match="not an Ed25519 private key") as excinfo:
        load_private_key(private_path)
    # The class name differs between cryptography releases; it just must not claim Ed25519.
    assert excinfo.value.fields["expected"] == "Ed25519PrivateKey"
    assert "Ed25519" not in excinfo.value.fields["found"]
    assert excinfo.value.fields["path"] == private_path
    with pytest.raises(KeyFileError, match="not an Ed25519 public key"):
        load_public_key(public_path)


def test_encrypted_private_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "encrypted.pem"
    path.write_bytes(
        generate_private_key().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(KeyFileError, match="encrypted") as excinfo:
        load_private_key(path)
    assert excinfo.value.fields["path"] == path


def test_garbage_inside_pem_armour_is_a_key_file_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.pem"
    path.write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError, match="cannot parse private key"):
        load_private_key(path)


def test_sign_and_verify_round_trip() -> None:
    private_key = generate_private_key()
    document_bytes = sign_manifest(MANIFEST, private_key)
    document = json.loads(document_bytes)
    assert set(document) == {"algorithm", "key_id", "signature"}
    assert document["algorithm"] == "ed25519"
    assert document["key_id"] == compute_key_id(private_key.public_key())
    assert len(base64.b64decode(document["signature"], validate=True)) == 64

    other = generate_private_key().public_key()
    key_id = verify_manifest(MANIFEST, document_bytes, [other, private_key.public_key()])
    assert key_id == compute_key_id(private_key.public_key())


def test_signature_covers_every_byte_of_the_manifest() -> None:
    private_key = generate_private_key()
    document = sign_manifest(MANIFEST, private_key)
    # Even whitespace counts: the signature is over bytes, not over parsed JSON.
    for tampered in (MANIFEST.replace(b"3", b"4"), MANIFEST + b" ", MANIFEST[:-1]):
        with pytest.raises(SignatureError, match="bad signature"):
            verify_manifest(tampered, document, [private_key.public_key()])


def test_unknown_key_is_reported_with_its_id() -> None:
    signer = generate_private_key()
    trusted = generate_private_key().public_key()
    with pytest.raises(SignatureError, match="unknown signing key") as excinfo:
        verify_manifest(MANIFEST, sign_manifest(MANIFEST, signer), [trusted])
    assert excinfo.value.fields["key_id"] == compute_key_id(signer.public_key())
    assert excinfo.value.fields["trusted"] == compute_key_id(trusted)


def test_a_signature_claiming_a_trusted_key_id_is_still_checked() -> None:
    trusted = generate_private_key()
    forger = generate_private_key()
    forged = json.loads(sign_manifest(MANIFEST, forger))
    forged["key_id"] = compute_key_id(trusted.public_key())
    with pytest.raises(SignatureError, match="bad signature"):
        verify_manifest(MANIFEST, json.dumps(forged).encode(), [trusted.public_key()])


def test_no_trusted_keys_is_an_error() -> None:
    document = sign_manifest(MANIFEST, generate_private_key())
    with pytest.raises(SignatureError, match="no trusted public keys"):
        verify_manifest(MANIFEST, document, [])


def _good_document() -> dict[str, str]:
    return json.loads(sign_manifest(MANIFEST, generate_private_key()))


@pytest.mark.parametrize(
    ("document_bytes", "detail"),
    [
        (b"\xff\xfe not utf-8", "not UTF-8 JSON"),
        (b"{not json", "not UTF-8 JSON"),
        (b'["ed25519"]', "not a JSON object"),
        (json.dumps({k: v for k, v in _good_document().items() if k != "key_id"}).encode(), "key_id"),
        (json.dumps({**_good_document(), "signature": 12}).encode(), "signature"),
        (json.dumps({**_good_document(), "signature": "@@not base64@@"}).encode(), "not base64"),
        (
            json.dumps({**_good_document(), "signature": base64.b64encode(b"x" * 63).decode()}).encode(),
            "wrong length",
        ),
        (json.dumps({**_good_document(), "key_id": "ABCDEF"}).encode(), "16 lowercase hex"),
    ],
)
def test_malformed_signature_documents(document_bytes: bytes, detail: str) -> None:
    with pytest.raises(SignatureError, match="malformed signature document") as excinfo:
        parse_signature_document(document_bytes)
    assert detail in str(excinfo.value)
    with pytest.raises(SignatureError, match="malformed signature document"):
        verify_manifest(MANIFEST, document_bytes, [generate_private_key().public_key()])


def test_other_algorithms_are_refused() -> None:
    document = {**_good_document(), "algorithm": "rsa-pss"}
    with pytest.raises(SignatureError, match="unsupported signature algorithm") as excinfo:
        parse_signature_document(json.dumps(document).encode())
    assert excinfo.value.fields["found"] == "rsa-pss"
