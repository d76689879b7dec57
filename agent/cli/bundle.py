"""`edge-agent bundle`: make keys, sign, verify and inspect model bundles (design §5.1).

    edge-agent bundle keygen --out keys/release.pem
    edge-agent bundle sign build/resnet8/ --key keys/release.pem --out resnet8-v3.bundle
    edge-agent bundle verify resnet8-v3.bundle --pubkey keys/release.pem.pub
    edge-agent bundle inspect resnet8-v3.bundle [--pubkey keys/release.pem.pub] [--json]

Only the base install (``cryptography``) is needed, so these commands run on a board too.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent import __version__
from agent.errors import AgentError, BundleError, KeyFileError, printable


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bundle", help="make keys, sign, verify and inspect model bundles"
    )
    actions = parser.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)

    keygen = actions.add_parser("keygen", help="make an Ed25519 signing key pair")
    keygen.add_argument(
        "--out", type=_file_path, required=True,
        help="private key file; PATH.pub gets the public key"
    )
    keygen.add_argument("--force", action="store_true", help="overwrite existing key files")
    keygen.set_defaults(handler=run_keygen)

    sign = actions.add_parser("sign", help="pack a build directory, or re-sign a bundle")
    sign.add_argument(
        "source", type=Path, help="a directory holding manifest.json and the artifacts, or a bundle"
    )
    sign.add_argument("--key", type=Path, required=True, help="private key (PEM)")
    sign.add_argument("--out", type=_file_path, required=True, help="bundle file to write")
    sign.add_argument("--force", action="store_true", help="replace an existing --out file")
    sign.set_defaults(handler=run_sign)

    verify = actions.add_parser("verify", help="check a bundle's signature, hashes and manifest")
    verify.add_argument("bundle", type=Path)
    verify.add_argument(
        "--pubkey", type=Path, action="append", required=True, help="trusted public key; repeatable"
    )
    verify.set_defaults(handler=run_verify)

    inspect = actions.add_parser("inspect", help="show what a bundle holds")
    inspect.add_argument("bundle", type=Path)
    inspect.add_argument(
        "--pubkey", type=Path, action="append", default=[], help="verify against this key too"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    inspect.set_defaults(handler=run_inspect)


def _file_path(text: str) -> Path:
    """An argparse type for a file to write: not empty, not ending in a slash."""
    if not text or text.endswith(("/", "/.", "/..")) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    return Path(text)


def _check_sign_output(out: Path, source: Path, key: Path, force: bool) -> None:
    """Refuse an --out that would overwrite the key, the source or a file inside the build
    directory being packed, or any existing file without --force."""
    from models.signing import public_key_path

    target = out.resolve()
    if target == key.resolve():
        raise BundleError("--out is the signing key itself", path=out)
    if target == public_key_path(key).resolve():
        raise BundleError("--out is the signing key's public key", path=out)
    if target == source.resolve():
        raise BundleError("--out is the bundle being signed; write the new bundle elsewhere",
                          path=out)
    if source.is_dir() and target.is_relative_to(source.resolve()):
        raise BundleError("--out is inside the build directory being packed", path=out,
                          directory=source)
    if out.is_dir():
        raise BundleError("--out is a directory", path=out)
    if (out.exists() or out.is_symlink()) and not force:
        raise BundleError("--out already exists (use --force to replace it)", path=out)


def run_keygen(args: argparse.Namespace) -> int:
    from models.signing import compute_key_id, public_key_path, write_keypair

    private_path: Path = args.out
    public_path = public_key_path(private_path)
    if not args.force:
        # write_keypair refuses too; checking here lets the message name the flag.
        for path in (private_path, public_path):
            if path.is_dir():
                raise KeyFileError("key file path is a directory", path=path)
            if path.exists() or path.is_symlink():
                raise KeyFileError("key file already exists (use --force to replace it)", path=path)
    private_key = write_keypair(private_path, overwrite=args.force)
    print(f"private key: {private_path}")
    print(f"public key: {public_path}")
    print(f"key id: {compute_key_id(private_key.public_key())}")
    return 0


def run_sign(args: argparse.Namespace) -> int:
    from models.bundle import pack_bundle, resign_bundle
    from models.signing import compute_key_id, load_private_key

    signing_key = load_private_key(args.key)
    source: Path = args.source
    _check_sign_output(args.out, source, args.key, args.force)
    if source.is_dir():
        manifest, files = read_build_directory(source)
        manifest = pack_bundle(args.out, manifest, files, signing_key)
    elif source.is_file():
        manifest = resign_bundle(source, args.out, signing_key)
    else:
        raise BundleError("sign source not found (expected a directory or a bundle)", path=source)
    key_id = compute_key_id(signing_key.public_key())
    print(
        f"wrote {args.out}: {manifest['name']} version {manifest['version']} "
        f"signed by key {key_id}"
    )
    return 0


def read_build_directory(source: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """Read ``manifest.json`` and list the artifacts of a build directory.

    Every file in ``source`` (``engines/`` included) becomes an artifact named by its path
    relative to ``source``; a ``manifest.sig`` left from an earlier extraction is ignored because
    signing writes a new one. A link to a file is packed as the file it points to.

    Raises:
        BundleError: no readable manifest.json, a linked directory, or an entry that is neither
            a file nor a directory (a FIFO, a dangling link).
    """
    from models.manifest import MANIFEST_MEMBER, SIGNATURE_MEMBER, parse_manifest_bytes

    manifest_path = source / MANIFEST_MEMBER
    try:
        manifest_bytes = manifest_path.read_bytes()
    except OSError as exc:
        raise BundleError("cannot read the build directory's manifest", path=manifest_path) from exc
    try:
        manifest = parse_manifest_bytes(manifest_bytes)
    except BundleError as exc:
        raise BundleError(exc.message, path=manifest_path, **exc.fields) from exc

    files: dict[str, Path] = {}
    for directory, subdirectories, filenames in os.walk(source):
        subdirectories.sort()
        for subdirectory in subdirectories:
            # os.walk does not descend into linked directories; say so rather than skip files.
            if Path(directory, subdirectory).is_symlink():
                raise BundleError(
                    "symbolic link to a directory in the build directory",
                    path=Path(directory, subdirectory),
                )
        for filename in sorted(filenames):
            path = Path(directory, filename)
            name = path.relative_to(source).as_posix()
            if name in (MANIFEST_MEMBER, SIGNATURE_MEMBER):
                continue
            if not path.is_file():
                raise BundleError("not a regular file", path=path)
            files[name] = path
    return manifest, files


def run_verify(args: argparse.Namespace) -> int:
    from models.bundle import open_bundle
    from models.signing import load_public_key

    trusted_keys = [load_public_key(path) for path in args.pubkey]
    bundle = open_bundle(args.bundle, trusted_keys, agent_version=__version__)
    manifest = bundle.manifest
    print(f"OK {manifest['name']} version {manifest['version']} signed by key {bundle.key_id}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from models.bundle import inspect_bundle, open_bundle
    from models.signing import load_public_key

    info = inspect_bundle(args.bundle)
    signature: dict[str, Any] = {
        "present": info["signature"]["present"],
        "key_id": info["signature"]["key_id"],
        "status": "not checked",
        "error": info["signature"]["error"],
    }
    if args.pubkey:
        trusted_keys = [load_public_key(path) for path in args.pubkey]
        try:
            open_bundle(args.bundle, trusted_keys, agent_version=__version__)
        except AgentError as exc:
            signature["status"] = "failed"
            signature["error"] = str(exc)
        else:
            signature["status"] = "verified"
    if args.json:
        document = {"manifest": info["manifest"], "signature": signature}
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        # An unverified manifest is anybody's text: escaped, so that it cannot steer the
        # terminal or fake a line of this summary.
        print("\n".join(printable(line) for line in
                        format_summary(info["manifest"], info["members"], signature)))
    return 1 if signature["status"] == "failed" else 0


def format_summary(
    manifest: Mapping[str, Any], members: Mapping[str, int], signature: Mapping[str, Any]
) -> list[str]:
    """Lines describing a bundle for a person.

    The manifest may be unverified (and so malformed): every field is read defensively.
    """
    lines = [
        f"name: {manifest.get('name', '?')}",
        f"version: {manifest.get('version', '?')}",
        f"created: {manifest.get('created_at', '?')}",
        f"min agent version: {manifest.get('min_agent_version', '?')}",
    ]
    for field in ("inputs", "outputs"):
        for tensor in _list(manifest.get(field)):
            lines.append(f"{field[:-1]}: {_describe_tensor(tensor)}")

    precision = _mapping(manifest.get("precision"))
    int8_layers = _list(precision.get("int8_layers"))
    fp16_layers = _list(precision.get("fp16_layers"))
    fp32_layers = _list(precision.get("fp32_layers"))
    lines.append(
        f"precision: {len(int8_layers)} int8, {len(fp16_layers)} fp16, "
        f"{len(fp32_layers)} fp32 layers"
    )
    if fp16_layers:
        lines.append(f"  fp16 fallback: {', '.join(map(str, fp16_layers))}")
    if fp32_layers:
        lines.append(f"  fp32 fallback: {', '.join(map(str, fp32_layers))}")
    opt_batch = manifest.get("opt_batch", "?")
    max_batch = manifest.get("max_batch", "?")
    fixed = manifest.get("fixed_batch")
    lines.append(f"batch: opt {opt_batch}, max {max_batch}"
                 + (f" (fixed: the graph runs at batch {fixed} only)" if fixed is not None else ""))
    axes = manifest.get("output_batch_axes")
    if isinstance(axes, Mapping) and axes:
        lines.append("  batch axis: " + ", ".join(f"{name} {axis}" for name, axis in axes.items()))

    calibration = manifest.get("calibration")
    if isinstance(calibration, Mapping):
        data_hash = str(calibration.get("data_sha256", "?"))[:16]
        lines.append(
            f"calibration: {calibration.get('method', '?')}, {calibration.get('samples', '?')} "
            f"samples, data sha256 {data_hash}..."
        )
    else:
        lines.append("calibration: none")
    accuracy = _mapping(manifest.get("accuracy"))
    accuracy_text = ", ".join(f"{key}={value}" for key, value in sorted(accuracy.items()))
    lines.append(f"accuracy: {accuracy_text or 'none'}")

    lines.append("artifacts:")
    for name, entry in sorted(_mapping(manifest.get("artifacts")).items()):
        entry = _mapping(entry)
        size_bytes = entry.get("size", members.get(name, "?"))
        digest = str(entry.get("sha256", "?"))[:16]
        lines.append(f"  {name}  {_format_size(size_bytes)}  sha256 {digest}...")
    engines = _mapping(manifest.get("engines"))
    lines.append("engines:" if engines else "engines: none")
    for fingerprint, member in sorted(engines.items()):
        lines.append(f"  {fingerprint} -> {member}")

    lines.append(f"signing key: {signature.get('key_id') or 'none'}")
    status = signature.get("status")
    if status == "failed":
        # open_bundle checks the signature, then every artifact's hash, then compatibility.
        lines.append(f"verification: FAILED: {signature.get('error')}")
    elif not signature.get("present"):
        lines.append("signature: missing (unsigned bundle)")
    elif signature.get("error"):
        lines.append(f"signature: unreadable: {signature.get('error')}")
    else:
        lines.append(f"signature: {status}")
    return lines


def _describe_tensor(tensor: object) -> str:
    tensor = _mapping(tensor)
    layout = tensor.get("layout")
    shape = tensor.get("shape", "?")
    text = f"{tensor.get('name', '?')} {tensor.get('dtype', '?')} {shape}"
    return f"{text} {layout}" if layout else text


def _format_size(size_bytes: object) -> str:
    if not isinstance(size_bytes, int):
        return "?"
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size_bytes >= factor:
            return f"{size_bytes / factor:.1f} {unit} ({size_bytes} bytes)"
    return f"{size_bytes} bytes"


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
