"""The fleet's certificates: a certificate authority, the broker's server certificate and client
certificates, made with ``cryptography`` (no openssl command line).

Two authorities, on purpose: the *fleet CA* signs the broker's server certificate (every device
and operator checks the broker with it) and, in certificate mode, the devices' client
certificates; the *operator CA* signs only operator client certificates. The broker's operator
listener accepts client certificates of the operator CA alone, so a device's credentials never open
it, whatever the device does with its client id there.

Keys are ECDSA P-256 (small, fast on a Jetson's CPU, accepted by every TLS stack Mosquitto is
built with). Private keys are written 0600, atomically.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.errors import KeyFileError
from agent.fsutil import atomic_write_bytes, read_bounded

__all__ = [
    "Authority",
    "CA_VALIDITY_DAYS",
    "LEAF_VALIDITY_DAYS",
    "load_authority",
    "make_authority",
    "make_client_certificate",
    "make_server_certificate",
]

CA_VALIDITY_DAYS = 3650
LEAF_VALIDITY_DAYS = 825
MAX_PEM_BYTES = 64 * 1024
# Certificates are valid from a little before now: a board whose clock runs a few minutes behind
# must not see a brand new certificate as not yet valid.
BACKDATE = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class Authority:
    """A CA's certificate and private key, and where they are on disk."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    cert_path: Path
    key_path: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    atomic_write_bytes(path, pem, mode=0o600)


def _write_cert(path: Path, certificate: x509.Certificate) -> None:
    atomic_write_bytes(path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)


def make_authority(cert_path: Path, key_path: Path, *, common_name: str) -> Authority:
    """Make a new self-signed CA and write its certificate and key.

    Raises:
        KeyFileError: either file exists already (a CA is never silently replaced: every
            certificate it signed would stop working).
    """
    for path in (cert_path, key_path):
        if path.exists():
            raise KeyFileError("refusing to replace an existing CA file", path=path)
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, certificate)
    return Authority(certificate, key, cert_path, key_path)


def load_authority(cert_path: Path, key_path: Path) -> Authority:
    """Read a CA made by :func:`make_authority`.

    Raises:
        KeyFileError: a file is missing, unreadable or not what it should be.
    """
    try:
        cert_pem = read_bounded(cert_path, MAX_PEM_BYTES)
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the CA certificate: {exc}", path=cert_path) from exc
    try:
        key = serialization.load_pem_private_key(read_bounded(key_path, MAX_PEM_BYTES), None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"cannot read the CA key: {exc}", path=key_path) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KeyFileError("the CA key is not an EC private key", path=key_path,
                           found=type(key).__name__)
    certified = certificate.public_key()
    if not isinstance(certified, ec.EllipticCurvePublicKey) or (
            key.public_key().public_numbers() != certified.public_numbers()):
        raise KeyFileError("the CA key does not belong to the CA certificate", path=key_path,
                           certificate=cert_path)
    return Authority(certificate, key, cert_path, key_path)


def _leaf(authority: Authority, common_name: str, key: ec.EllipticCurvePrivateKey,
          usage: x509.ObjectIdentifier, names: list[x509.GeneralName]) -> x509.Certificate:
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=LEAF_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=True, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            authority.private_key.public_key()), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(authority.private_key, hashes.SHA256())


def make_server_certificate(authority: Authority, cert_path: Path, key_path: Path, *,
                            hosts: list[str]) -> None:
    """A TLS server certificate for the broker, naming each of ``hosts`` (DNS names or IP
    addresses) as a subject alternative name; the first is also the common name."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = _new_key()
    certificate = _leaf(authority, hosts[0], key, ExtendedKeyUsageOID.SERVER_AUTH, names)
    _write_key(key_path, key)
    _write_cert(cert_path, certificate)


def make_client_certificate(authority: Authority, cert_path: Path, key_path: Path, *,
                            common_name: str) -> None:
    """A TLS client certificate whose common name is the identity the broker takes as the
    user name (``use_identity_as_username``)."""
    key = _new_key()
    certificate = _leaf(authority, common_name, key, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write_key(key_path, key)
    _write_cert(cert_path, certificate)
