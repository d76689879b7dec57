"""`edge-agent bundle` keygen / sign / verify / inspect, through the real command-line entry point."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from models.signing import compute_key_id, load_private_key, load_public_key

MODEL_BYTES = b"onnx" * 2048
ENGINE_BYTES = b"plan" * 100
FINGERPRINT = "orin-nx-jp6-trt10.3"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = main(["bundle", *(str(arg) for arg in argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status: int, err: str, *needles: str) -> None:
    assert status == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("edge-agent: error: ")
    for needle in needles:
        assert needle in lines[0]


def write_build_dir(directory: Path, **manifest_overrides: Any) -> Path:
    (directory / "engines").mkdir(parents=True)
    (directory / "model.onnx").write_bytes(MODEL_BYTES)
    (directory / "engines" / f"{FINGERPRINT}.plan").write_bytes(ENGINE_BYTES)
    manifest = {
        "name": "digits-cnn",
        "version": 7,
        "created_at": "2024-06-01T08:30:00Z",
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 1, 8, 8], "layout": "NCHW"}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [-1, 10]}],
        "preprocessing": {"mean": [0.5], "std": [0.25]},
        "precision": {"int8_layers": ["conv1", "conv2", "conv3"], "fp16_layers": ["head.fc"], "fp32_layers": []},
        "max_batch": 32,
        "opt_batch": 8,
        "calibration": {"method": "percentile-99.99", "samples": 256, "data_sha256": "cd" * 32},
        "accuracy": {"top1_fp32": 0.97, "top1_int8": 0.965},
        "engines": {FINGERPRINT: f"engines/{FINGERPRINT}.plan"},
        "min_agent_version": "0.1.0",
        **manifest_overrides,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.fixture()
def keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    private_path = tmp_path / "keys" / "release.pem"
    status, _, _ = run_cli(capsys, "keygen", "--out", private_path)
    assert status == 0
    return private_path, tmp_path / "keys" / "release.pem.pub"


@pytest.fixture()
def bundle(tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "digits-v7.bundle"
    status, _, _ = run_cli(capsys, "sign", write_build_dir(tmp_path / "build"), "--key", keys[0], "--out", out)
    assert status == 0
    return out


def key_id_of(public_path: Path) -> str:
    return compute_key_id(load_public_key(public_path))


# --------------------------------------------------------------------------------------------------
# keygen


def test_keygen_writes_a_pair_and_prints_its_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private_path = tmp_path / "release.pem"
    status, out, err = run_cli(capsys, "keygen", "--out", private_path)
    assert status == 0 and err == ""
    public_path = tmp_path / "release.pem.pub"
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    key_id = key_id_of(public_path)
    assert f"key id: {key_id}" in out.splitlines()
    assert compute_key_id(load_private_key(private_path).public_key()) == key_id


def test_keygen_refuses_to_overwrite_without_force(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private_path, public_path = keys
    before = (private_path.read_bytes(), public_path.read_bytes())
    status, out, err = run_cli(capsys, "keygen", "--out", private_path)
    assert_one_line_error(status, err, "already exists", "--force", str(private_path))
    assert out == ""
    assert (private_path.read_bytes(), public_path.read_bytes()) == before

    status, out, _ = run_cli(capsys, "keygen", "--out", private_path, "--force")
    assert status == 0
    assert private_path.read_bytes() != before[0]
    assert f"key id: {key_id_of(public_path)}" in out


def test_keygen_refuses_when_only_the_public_half_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    private_path = tmp_path / "release.pem"
    public_path = tmp_path / "release.pem.pub"
    public_path.write_text("someone else's key\n")
    status, _, err = run_cli(capsys, "keygen", "--out", private_path)
    assert_one_line_error(status, err, "already exists", str(public_path))
    assert not private_path.exists()
    assert public_path.read_text() == "someone else's key\n"


# --------------------------------------------------------------------------------------------------
# sign and verify


def test_sign_a_build_directory_then_verify(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private_path, public_path = keys
    out = tmp_path / "digits-v7.bundle"
    status, stdout, _ = run_cli(
        capsys, "sign", write_build_dir(tmp_path / "build"), "--key", private_path, "--out", out
    )
    assert status == 0
    key_id = key_id_of(public_path)
    assert f"digits-cnn version 7 signed by key {key_id}" in stdout
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == sorted(
            ["manifest.json", "manifest.sig", "model.onnx", f"engines/{FINGERPRINT}.plan"]
        )

    status, stdout, err = run_cli(capsys, "verify", out, "--pubkey", public_path)
    assert status == 0 and err == ""
    assert stdout == f"OK digits-cnn version 7 signed by key {key_id}\n"


def test_verify_accepts_any_of_several_keys(
    tmp_path: Path, bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli(capsys, "keygen", "--out", tmp_path / "other.pem")
    status, stdout, _ = run_cli(
        capsys, "verify", bundle, "--pubkey", tmp_path / "other.pem.pub", "--pubkey", keys[1]
    )
    assert status == 0
    assert stdout.startswith("OK digits-cnn version 7 ")


def test_sign_ignores_an_old_signature_in_an_extracted_directory(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build")
    (build / "manifest.sig").write_text("{}")
    status, _, err = run_cli(capsys, "sign", build, "--key", keys[0], "--out", tmp_path / "b.bundle")
    assert status == 0, err
    status, _, _ = run_cli(capsys, "verify", tmp_path / "b.bundle", "--pubkey", keys[1])
    assert status == 0


def test_sign_refuses_a_file_that_is_no_bundle_member(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build")
    (build / "notes.txt").write_text("todo")
    out = tmp_path / "b.bundle"
    status, _, err = run_cli(capsys, "sign", build, "--key", keys[0], "--out", out)
    assert_one_line_error(status, err, "notes.txt")
    assert not out.exists()


def test_sign_refuses_a_linked_directory_rather_than_skipping_it(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build")
    real_engines = tmp_path / "engines-store"
    (build / "engines").rename(real_engines)
    (build / "engines").symlink_to(real_engines)
    status, _, err = run_cli(capsys, "sign", build, "--key", keys[0], "--out", tmp_path / "b.bundle")
    assert_one_line_error(status, err, "symbolic link to a directory", str(build / "engines"))


def test_sign_refuses_an_invalid_manifest_naming_the_field(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build", opt_batch=64)
    status, _, err = run_cli(capsys, "sign", build, "--key", keys[0], "--out", tmp_path / "b.bundle")
    assert_one_line_error(status, err, "opt_batch", "max_batch (32)")


def test_sign_refuses_a_directory_without_manifest(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build")
    (build / "manifest.json").unlink()
    status, _, err = run_cli(capsys, "sign", build, "--key", keys[0], "--out", tmp_path / "b.bundle")
    assert_one_line_error(status, err, "manifest", str(build / "manifest.json"))


def test_sign_with_a_public_key_is_refused(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(
        capsys, "sign", write_build_dir(tmp_path / "build"), "--key", keys[1], "--out", tmp_path / "b.bundle"
    )
    assert_one_line_error(status, err, "public key", str(keys[1]))
    assert not (tmp_path / "b.bundle").exists()


def test_resign_an_existing_bundle_with_a_new_key(
    tmp_path: Path, bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli(capsys, "keygen", "--out", tmp_path / "new.pem")
    out = tmp_path / "resigned.bundle"
    status, stdout, _ = run_cli(capsys, "sign", bundle, "--key", tmp_path / "new.pem", "--out", out)
    assert status == 0
    new_id = key_id_of(tmp_path / "new.pem.pub")
    assert f"signed by key {new_id}" in stdout

    status, stdout, _ = run_cli(capsys, "verify", out, "--pubkey", tmp_path / "new.pem.pub")
    assert status == 0 and stdout == f"OK digits-cnn version 7 signed by key {new_id}\n"
    status, _, err = run_cli(capsys, "verify", out, "--pubkey", keys[1])
    assert_one_line_error(status, err, "unknown signing key", new_id)


def test_resign_refuses_a_bundle_whose_member_was_changed(
    tmp_path: Path, bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_member_byte(bundle, "model.onnx")
    out = tmp_path / "resigned.bundle"
    status, _, err = run_cli(capsys, "sign", bundle, "--key", keys[0], "--out", out)
    assert_one_line_error(status, err, "does not match the manifest", "model.onnx")
    assert not out.exists()


def _flip_member_byte(bundle: Path, member: str) -> None:
    with tarfile.open(bundle) as tar:
        offset = tar.getmember(member).offset_data
    with open(bundle, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0xFF]))


@pytest.mark.parametrize(
    ("damage", "needles"),
    [
        ("artifact", ("hash does not match", "model.onnx")),
        ("manifest", ("bad signature",)),
        ("not a tar", ("not a bundle",)),
        ("truncated", ("truncated",)),
    ],
)
def test_verify_failures_exit_1_with_one_line(
    bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str], damage: str, needles: tuple[str, ...]
) -> None:
    if damage == "artifact":
        _flip_member_byte(bundle, "model.onnx")
    elif damage == "manifest":
        _flip_member_byte(bundle, "manifest.json")
    elif damage == "not a tar":
        bundle.write_bytes(b"<html>404 not found</html>\n")
    else:
        with open(bundle, "r+b") as handle:
            handle.truncate(bundle.stat().st_size // 2)
    status, out, err = run_cli(capsys, "verify", bundle, "--pubkey", keys[1])
    assert out == ""
    assert_one_line_error(status, err, *needles, str(bundle))


def test_verify_with_a_missing_key_file(
    tmp_path: Path, bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(capsys, "verify", bundle, "--pubkey", tmp_path / "absent.pub")
    assert_one_line_error(status, err, "key file not found", "absent.pub")


def test_verify_refuses_a_bundle_for_a_newer_agent(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    build = write_build_dir(tmp_path / "build", min_agent_version="42.0.0")
    out = tmp_path / "b.bundle"
    assert run_cli(capsys, "sign", build, "--key", keys[0], "--out", out)[0] == 0
    status, _, err = run_cli(capsys, "verify", out, "--pubkey", keys[1])
    assert_one_line_error(status, err, "newer agent", "42.0.0")


def test_verify_needs_a_pubkey(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["bundle", "verify", str(bundle)])
    assert excinfo.value.code == 2
    assert "--pubkey" in capsys.readouterr().err


def test_the_installed_command_exits_nonzero(tmp_path: Path, bundle: Path, keys: tuple[Path, Path]) -> None:
    _flip_member_byte(bundle, "model.onnx")
    result = subprocess.run(
        [sys.executable, "-m", "agent", "bundle", "verify", str(bundle), "--pubkey", str(keys[1])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("edge-agent: error: artifact hash does not match")


# --------------------------------------------------------------------------------------------------
# inspect


def test_inspect_summary(bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "inspect", bundle)
    assert status == 0
    lines = out.splitlines()
    key_id = key_id_of(keys[1])
    for expected in (
        "name: digits-cnn",
        "version: 7",
        "created: 2024-06-01T08:30:00Z",
        "input: images float32 [-1, 1, 8, 8] NCHW",
        "output: logits float32 [-1, 10]",
        "precision: 3 int8, 1 fp16, 0 fp32 layers",
        "  fp16 fallback: head.fc",
        "batch: opt 8, max 32",
        "calibration: percentile-99.99, 256 samples, data sha256 cdcdcdcdcdcdcdcd...",
        "accuracy: top1_fp32=0.97, top1_int8=0.965",
        f"  {FINGERPRINT} -> engines/{FINGERPRINT}.plan",
        f"signing key: {key_id}",
        "signature: not checked",
    ):
        assert expected in lines, expected
    assert any(line.startswith("  model.onnx  8.0 KiB (8192 bytes)") for line in lines)
    assert any(line.startswith(f"  engines/{FINGERPRINT}.plan  400 bytes") for line in lines)


def test_inspect_with_a_key_verifies(
    bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_cli(capsys, "inspect", bundle, "--pubkey", keys[1])
    assert status == 0
    assert "signature: verified" in out.splitlines()


def test_inspect_shows_a_failed_verification_and_exits_1(
    tmp_path: Path, bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli(capsys, "keygen", "--out", tmp_path / "other.pem")
    status, out, _ = run_cli(capsys, "inspect", bundle, "--pubkey", tmp_path / "other.pem.pub")
    assert status == 1
    assert "name: digits-cnn" in out  # the summary is still shown
    failure = [line for line in out.splitlines() if line.startswith("verification: ")]
    assert len(failure) == 1 and failure[0].startswith("verification: FAILED: unknown signing key")


def test_inspect_json(bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "inspect", bundle, "--json", "--pubkey", keys[1])
    assert status == 0
    document = json.loads(out)
    assert document["manifest"]["name"] == "digits-cnn"
    assert document["manifest"]["artifacts"]["model.onnx"]["size"] == len(MODEL_BYTES)
    assert document["signature"]["status"] == "verified"
    assert document["signature"]["key_id"] == key_id_of(keys[1])

    status, out, _ = run_cli(capsys, "inspect", bundle, "--json")
    assert json.loads(out)["signature"]["status"] == "not checked"


def test_inspect_an_unsigned_bundle(
    tmp_path: Path, bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    unsigned = tmp_path / "unsigned.bundle"
    with tarfile.open(bundle) as source, tarfile.open(unsigned, "w") as target:
        for info in source.getmembers():
            if info.name != "manifest.sig":
                target.addfile(info, source.extractfile(info))
    status, out, _ = run_cli(capsys, "inspect", unsigned)
    assert status == 0
    assert "signature: missing (unsigned bundle)" in out.splitlines()
    status, out, _ = run_cli(capsys, "inspect", unsigned, "--pubkey", keys[1])
    assert status == 1
    assert "verification: FAILED: unsigned bundle" in out


def test_inspect_refuses_an_unsafe_tar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = tmp_path / "evil.bundle"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("model.onnx")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/shadow"
        tar.addfile(info)
    status, out, err = run_cli(capsys, "inspect", evil)
    assert out == ""
    assert_one_line_error(status, err, "symbolic link", "model.onnx")


# --------------------------------------------------------------------------------------------------
# bad input found by probing the command line


def test_keygen_force_never_leaves_a_half_replaced_pair(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private_path, public_path = keys
    before = private_path.read_bytes()
    public_path.unlink()
    public_path.mkdir()  # the public half cannot be written
    status, _, err = run_cli(capsys, "keygen", "--out", private_path, "--force")
    assert_one_line_error(status, err, "is a directory")
    assert private_path.read_bytes() == before
    for bad in ("", "keys/"):
        with pytest.raises(SystemExit) as usage:
            run_cli(capsys, "keygen", "--out", bad)
        assert usage.value.code == 2 and "expected a file path" in capsys.readouterr().err


def test_sign_refuses_outputs_that_would_destroy_inputs(
    tmp_path: Path, keys: tuple[Path, Path], bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    private_path, _ = keys
    key_bytes = private_path.read_bytes()
    status, _, err = run_cli(capsys, "sign", bundle, "--key", private_path, "--out", private_path)
    assert_one_line_error(status, err, "the signing key itself")
    assert private_path.read_bytes() == key_bytes
    status, _, err = run_cli(capsys, "sign", bundle, "--key", private_path, "--out", bundle)
    assert_one_line_error(status, err, "the bundle being signed")
    build = tmp_path / "build"  # the bundle fixture's build directory
    status, _, err = run_cli(capsys, "sign", build, "--key", private_path,
                             "--out", build / "model.onnx")
    assert_one_line_error(status, err, "inside the build directory")
    existing = tmp_path / "existing.bundle"
    existing.write_bytes(b"keep me")
    status, _, err = run_cli(capsys, "sign", bundle, "--key", private_path, "--out", existing)
    assert_one_line_error(status, err, "already exists", "--force")
    assert existing.read_bytes() == b"keep me"
    status, _, _ = run_cli(capsys, "sign", bundle, "--key", private_path, "--out", existing,
                           "--force")
    assert status == 0 and tarfile.is_tarfile(existing)


def test_a_trusted_key_file_that_also_holds_a_private_key_is_refused(
    tmp_path: Path, keys: tuple[Path, Path], bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    private_path, public_path = keys
    mixed = tmp_path / "mixed.pub"
    mixed.write_bytes(public_path.read_bytes() + private_path.read_bytes())
    status, _, err = run_cli(capsys, "verify", bundle, "--pubkey", mixed)
    assert_one_line_error(status, err, "holds a private key")


@pytest.mark.parametrize("member", ["manifest.sig", "manifest.json"])
def test_a_deeply_nested_document_is_a_one_line_error(
    tmp_path: Path, keys: tuple[Path, Path], bundle: Path, capsys: pytest.CaptureFixture[str],
    member: str
) -> None:
    """JSON nested 30,000 deep (60 KB) made the parser recurse out of stack: a traceback."""
    with tarfile.open(bundle) as source:
        members = {info.name: source.extractfile(info).read() for info in source.getmembers()}
    members[member] = b"[" * 30_000 + b"]" * 30_000
    if member == "manifest.json":
        del members["manifest.sig"]  # unsigned: inspect reads the manifest itself
    hostile = tmp_path / "hostile.bundle"
    with tarfile.open(hostile, "w") as target:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            target.addfile(info, io.BytesIO(data))
    if member == "manifest.sig":
        status, _, err = run_cli(capsys, "verify", hostile, "--pubkey", keys[1])
        assert_one_line_error(status, err, "nested too deeply")
        status, out, err = run_cli(capsys, "inspect", hostile)  # no key: shows, does not judge
        assert "nested too deeply" in out + err and "Traceback" not in err
    else:
        status, _, err = run_cli(capsys, "inspect", hostile)
        assert_one_line_error(status, err, "nested too deeply")


def test_help_shows_every_value_default_once() -> None:
    import argparse

    from agent.cli import build_parser

    parser = build_parser()
    subcommands = next(action for action in parser._actions
                       if isinstance(action, argparse._SubParsersAction)).choices
    build_help = " ".join(subcommands["build"].format_help().split())  # undo line wrapping
    assert "(default: 512)" in build_help and "(default: out)" in build_help
    assert "(default: None)" not in build_help and "(default: False)" not in build_help
    assert build_help.count("default: l2") == 1  # already named in its own help text
    bench_kinds = next(action for action in subcommands["bench"]._actions
                       if isinstance(action, argparse._SubParsersAction)).choices
    assert "(default: 0.75)" in " ".join(bench_kinds["pipeline"].format_help().split())


# --------------------------------------------------------------------------------------------------
# found by probing: hostile text stays on one escaped line; read and write agree


def _tar_of(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_text_from_a_hostile_signature_file_is_escaped_and_bounded(
    tmp_path: Path, bundle: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with tarfile.open(bundle) as tar:
        members = {info.name: tar.extractfile(info).read() for info in tar.getmembers()
                   if info.isfile()}
    document = json.loads(members["manifest.sig"])
    document["algorithm"] = "\x1b]0;owned\x07\x1b[2J\nsignature: verified"
    document["key_id"] = "k" * 60_000
    members["manifest.sig"] = json.dumps(document).encode()
    hostile = _tar_of(tmp_path / "hostile.bundle", members)
    status, _, err = run_cli(capsys, "verify", hostile, "--pubkey", keys[1])
    assert_one_line_error(status, err)
    assert "\x1b" not in err and "\\x1b" in err and len(err) < 5000


def test_inspect_escapes_an_unverified_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((write_build_dir(tmp_path / "b") / "manifest.json").read_text())
    manifest["name"] = "evil\x1b[2J\nsignature: verified"
    manifest["precision"]["fp16_layers"] = ["\x1b]0;title\x07layer"]
    hostile = _tar_of(tmp_path / "unsigned.bundle", {
        "manifest.json": json.dumps(manifest).encode(), "model.onnx": MODEL_BYTES})
    status, out, _ = run_cli(capsys, "inspect", hostile)
    assert status == 0
    assert "\x1b" not in out and "\x07" not in out
    assert [line for line in out.splitlines() if line.startswith("signature:")] == [
        "signature: missing (unsigned bundle)"]


@pytest.mark.parametrize("text, message", [
    ('{"a": ' * 40 + "1" + "}" * 40, "nested too deeply"),
    ('{"name": "x", "note": "\\ud800"}', "lone surrogate"),
    ('{"name": "x", "top1": NaN}', "NaN is not a JSON number"),
    ('{"name": "x", "top1": 1e999}', "1e999 is out of range"),
])
def test_a_manifest_the_writer_could_not_write_back_is_refused_on_read(text: str,
                                                                       message: str) -> None:
    from agent.errors import BundleError
    from models.manifest import parse_manifest_bytes

    with pytest.raises(BundleError, match=message):
        parse_manifest_bytes(text.encode())


def test_sign_refuses_to_write_over_the_keys_public_half(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before = keys[1].read_bytes()
    status, _, err = run_cli(capsys, "sign", write_build_dir(tmp_path / "b"), "--key", keys[0],
                             "--out", keys[1], "--force")
    assert_one_line_error(status, err, "--out is the signing key's public key")
    assert keys[1].read_bytes() == before


def test_help_shows_no_empty_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bundle", "inspect", "--help"])
    assert "(default: )" not in capsys.readouterr().out
