"""The device model store (agent/store/), with real signed bundles around a tiny QDQ ONNX model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import agent.store.store
from agent.errors import BundleError, ConfigError, InternalError, SignatureError, StoreError
from agent.store import ModelRef, ModelStore
from models.bundle import pack_bundle, resign_bundle
from models.signing import generate_private_key, write_keypair

onnx = pytest.importorskip("onnx")
from tests.fakes.onnx_models import qdq_conv_model  # after the skip: it needs onnx

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "tinycnn"
FINGERPRINT = "orin-nano-jp6-trt10.3"
ENGINE_MEMBER = f"engines/{FINGERPRINT}.plan"


def make_manifest(name: str, version: int, **changes: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "name": name,
        "version": version,
        "created_at": "2024-05-01T12:00:00Z",
        "inputs": [{"name": "images", "dtype": "float32", "shape": [-1, 3, 16, 16], "layout": "NCHW"}],
        "outputs": [{"name": "features", "dtype": "float32", "shape": [-1, 4, 16, 16]}],
        "preprocessing": None,
        "precision": {"int8_layers": ["conv0"], "fp16_layers": ["conv1"], "fp32_layers": []},
        "max_batch": 8,
        "opt_batch": 4,
        "calibration": None,
        "accuracy": {"top1_fp32": 0.9, "top1_int8": 0.89},
        "engines": {FINGERPRINT: ENGINE_MEMBER},
        "min_agent_version": "0.1.0",
    }
    manifest.update(changes)
    return manifest


class Bundles:
    """Builds signed bundles of the tiny model, one version at a time."""

    def __init__(self, directory: Path, key: Ed25519PrivateKey) -> None:
        self.directory = directory
        self.key = key
        source = directory / "source"
        (source / "engines").mkdir(parents=True)
        qdq_conv_model(source / "model.onnx", height=16, width=16)
        (source / ENGINE_MEMBER).write_bytes(b"PLAN" * 256)
        self.files = {"model.onnx": source / "model.onnx", ENGINE_MEMBER: source / ENGINE_MEMBER}

    def make(
        self, version: int, *, name: str = MODEL_NAME, key: Ed25519PrivateKey | None = None,
        **changes: Any,
    ) -> Path:
        path = self.directory / f"{name}-v{version}-{len(os.listdir(self.directory))}.bundle"
        pack_bundle(path, make_manifest(name, version, **changes), self.files, key or self.key)
        return path


@pytest.fixture()
def signing_key() -> Ed25519PrivateKey:
    return generate_private_key()


@pytest.fixture()
def bundles(tmp_path: Path, signing_key: Ed25519PrivateKey) -> Bundles:
    directory = tmp_path / "bundles"
    directory.mkdir()
    return Bundles(directory, signing_key)


@pytest.fixture()
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture()
def store(state_dir: Path, signing_key: Ed25519PrivateKey) -> ModelStore:
    return ModelStore(state_dir, trusted_keys=[signing_key.public_key()]).open()


def install_versions(store: ModelStore, bundles: Bundles, *versions: int, name: str = MODEL_NAME) -> None:
    for version in versions:
        store.install(bundles.make(version, name=name))


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its content (None for directories)."""
    return {
        path.relative_to(directory).as_posix(): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x01]))


def pointer(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "current").read_text())


# --------------------------------------------------------------------------------------------------
# Opening, installing, activating


def test_a_fresh_store_is_laid_out_with_nothing_current(state_dir: Path, store: ModelStore) -> None:
    assert store.current() is None and store.previous() is None
    assert store.names() == [] and store.versions(MODEL_NAME) == []
    assert (state_dir / "models").is_dir() and (state_dir / "engines").is_dir()
    assert pointer(state_dir) == {"schema_version": 1, "current": None, "previous": None}
    # Opening it again keeps it as it is.
    ModelStore(state_dir, trusted_keys=[]).open()
    assert pointer(state_dir)["current"] is None


def test_a_store_touches_nothing_until_opened_and_lets_go_when_closed(
    state_dir: Path, signing_key: Ed25519PrivateKey
) -> None:
    store = ModelStore(state_dir, trusted_keys=[signing_key.public_key()])
    assert not state_dir.exists()
    for use in (store.current, store.names, lambda: store.versions(MODEL_NAME)):
        with pytest.raises(InternalError, match="before ModelStore.open"):
            use()
    with store:
        assert store.open() is store  # opening an open store changes nothing
        assert store.current() is None and (state_dir / "current").is_file()
    with pytest.raises(InternalError):
        store.current()
    with ModelStore(state_dir, trusted_keys=[]) as again:  # closed: free to open again
        assert again.current() is None


def test_install_activate_current(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    installed = store.install(bundles.make(3))
    directory = state_dir / "models" / MODEL_NAME / "3"
    assert (installed.name, installed.version, installed.directory) == (MODEL_NAME, 3, directory)
    assert installed.engine_cache_dir == state_dir / "engines" / MODEL_NAME / "3"
    assert not installed.engine_cache_dir.exists()  # made when TensorRT first caches a plan
    assert sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()) == [
        ENGINE_MEMBER, "manifest.json", "manifest.sig", "model.onnx",
    ]
    onnx.checker.check_model(onnx.load(str(installed.onnx_path)))
    assert installed.prebuilt_engines() == {FINGERPRINT: directory / ENGINE_MEMBER}
    assert (installed.max_batch, installed.opt_batch) == (8, 4)
    assert store.versions(MODEL_NAME) == [3] and store.names() == [MODEL_NAME]
    # Installing does not activate.
    assert store.current() is None

    activated = store.activate(MODEL_NAME, 3)
    assert activated == installed
    current = store.current()
    assert current is not None and (current.name, current.version) == (MODEL_NAME, 3)
    assert current.manifest == installed.manifest
    assert store.previous() is None
    assert pointer(state_dir)["current"] == {"name": MODEL_NAME, "version": 3}
    assert store.load(MODEL_NAME, 3) == installed
    # The pointer survives a restart.
    reopened = ModelStore(state_dir, trusted_keys=[bundles.key.public_key()]).open()
    assert reopened.current() == current


def test_activate_keeps_the_old_current_as_previous(store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1, 2, 3)
    store.activate(MODEL_NAME, 1)
    store.activate(MODEL_NAME, 2)
    previous = store.previous()
    assert previous is not None and previous.version == 1
    # Activating the current version again does not make it its own previous.
    store.activate(MODEL_NAME, 2)
    previous = store.previous()
    assert previous is not None and previous.version == 1
    store.activate(MODEL_NAME, 3)
    current, previous = store.current(), store.previous()
    assert current is not None and current.version == 3
    assert previous is not None and previous.version == 2


def test_activate_refuses_what_is_not_installed(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1)
    store.activate(MODEL_NAME, 1)
    with pytest.raises(StoreError, match="not installed") as excinfo:
        store.activate(MODEL_NAME, 2)
    assert excinfo.value.fields["version"] == 2
    before = pointer(state_dir)
    for name, version in [("../" + MODEL_NAME, 1), ("Tiny", 1), (MODEL_NAME, 0), (MODEL_NAME, True)]:
        with pytest.raises(StoreError, match="invalid model"):
            store.activate(name, version)
    assert pointer(state_dir) == before


def test_reinstalling_the_same_version_is_a_no_op(
    state_dir: Path, store: ModelStore, bundles: Bundles, signing_key: Ed25519PrivateKey
) -> None:
    bundle = bundles.make(3)
    first = store.install(bundle)
    before = snapshot(state_dir / "models")
    inode = first.directory.stat().st_ino
    assert store.install(bundle) == first
    # The same manifest signed by another trusted key is the same version too.
    other_key = generate_private_key()
    resigned = bundles.directory / "resigned.bundle"
    resign_bundle(bundle, resigned, other_key)
    both = ModelStore(state_dir, trusted_keys=[signing_key.public_key(), other_key.public_key()]).open()
    assert both.install(resigned) == first
    assert snapshot(state_dir / "models") == before
    assert first.directory.stat().st_ino == inode


def test_a_version_with_another_manifest_is_a_conflict(
    state_dir: Path, store: ModelStore, bundles: Bundles
) -> None:
    store.install(bundles.make(3))
    before = snapshot(state_dir)
    with pytest.raises(StoreError, match="immutable") as excinfo:
        store.install(bundles.make(3, accuracy={"top1_fp32": 0.91}))
    assert (excinfo.value.fields["name"], excinfo.value.fields["version"]) == (MODEL_NAME, 3)
    assert snapshot(state_dir) == before


def member_offset(path: Path, name: str) -> int:
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset_data


def tamper_artifact(path: Path) -> None:
    flip_byte(path, member_offset(path, "model.onnx") + 100)


def sign_with_stranger(bundles: Bundles, path: Path) -> None:
    resign_bundle(path, path, generate_private_key())


def needs_newer_agent(bundles: Bundles, path: Path) -> None:
    bundles.make(4, min_agent_version="99.0.0").replace(path)


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (lambda bundles, path: tamper_artifact(path), BundleError, "hash does not match"),
        (sign_with_stranger, SignatureError, "unknown signing key"),
        (needs_newer_agent, BundleError, "newer agent"),
    ],
    ids=["tampered", "untrusted", "incompatible"],
)
def test_a_bad_bundle_leaves_the_store_untouched(
    state_dir: Path,
    store: ModelStore,
    bundles: Bundles,
    damage: Callable[[Bundles, Path], None],
    error: type[Exception],
    message: str,
) -> None:
    install_versions(store, bundles, 3)
    store.activate(MODEL_NAME, 3)
    before = snapshot(state_dir)
    path = bundles.make(4)
    damage(bundles, path)
    with pytest.raises(error, match=message):
        store.install(path)
    assert snapshot(state_dir) == before


def test_install_drops_a_stale_engine_cache(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    # Plans built for an earlier install of this name and version (deleted since) were built from
    # another model.onnx for all the store knows.
    stale = state_dir / "engines" / MODEL_NAME / "3"
    stale.mkdir(parents=True)
    (stale / f"{FINGERPRINT}.plan").write_bytes(b"old plan")
    installed = store.install(bundles.make(3))
    assert installed.engine_cache_dir == stale
    assert not stale.exists()


def test_install_refuses_when_the_disk_is_too_full(
    state_dir: Path, store: ModelStore, bundles: Bundles, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    usage = shutil.disk_usage(state_dir)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1024))
    with pytest.raises(StoreError, match="free space"):
        store.install(bundles.make(1))
    assert store.versions(MODEL_NAME) == []


def test_keep_versions_below_two_is_refused(state_dir: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        ModelStore(state_dir, trusted_keys=[], keep_versions=1)
    assert excinfo.value.fields["key"] == "store.keep_versions"


# --------------------------------------------------------------------------------------------------
# Rollback and garbage collection


def test_rollback(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1, 2)
    store.activate(MODEL_NAME, 1)
    with pytest.raises(StoreError, match="nothing to roll back to"):
        store.rollback()
    store.activate(MODEL_NAME, 2)
    back = store.rollback()
    assert back.version == 1
    current = store.current()
    assert current is not None and current.version == 1
    assert store.previous() is None
    # A second rollback (a redelivered command) must not swing back to version 2.
    with pytest.raises(StoreError, match="nothing to roll back to"):
        store.rollback()
    assert pointer(state_dir)["current"] == {"name": MODEL_NAME, "version": 1}


def test_gc_keeps_current_and_previous(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1, 2, 3, 4)
    store.activate(MODEL_NAME, 2)
    store.activate(MODEL_NAME, 3)
    for version in (1, 2, 3, 4):
        (store.engine_cache_dir(MODEL_NAME, version) / f"{FINGERPRINT}.plan").write_bytes(b"built")
    deleted = store.garbage_collect()
    assert sorted(deleted) == [ModelRef(MODEL_NAME, 1), ModelRef(MODEL_NAME, 4)]
    assert store.versions(MODEL_NAME) == [2, 3]
    assert sorted(os.listdir(state_dir / "engines" / MODEL_NAME)) == ["2", "3"]
    assert sorted(os.listdir(state_dir / "models" / MODEL_NAME)) == ["2", "3"]  # nothing hidden left
    assert store.load(MODEL_NAME, 3).version == 3
    assert store.rollback().version == 2
    assert store.garbage_collect() == []  # keep_versions is a floor: 3 is now the newest other


def test_gc_fills_free_slots_with_the_newest_versions(store: ModelStore, bundles: Bundles) -> None:
    wide = ModelStore(store.state_dir, trusted_keys=[bundles.key.public_key()], keep_versions=3).open()
    install_versions(wide, bundles, 1, 2, 3, 4, 5)
    wide.activate(MODEL_NAME, 2)
    wide.activate(MODEL_NAME, 3)
    assert sorted(wide.garbage_collect()) == [ModelRef(MODEL_NAME, 1), ModelRef(MODEL_NAME, 4)]
    assert wide.versions(MODEL_NAME) == [2, 3, 5]


def test_gc_spares_pinned_versions_and_other_models(store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1, 2, 3)
    install_versions(store, bundles, 7, name="othernet")
    store.activate("othernet", 7)
    store.activate(MODEL_NAME, 2)
    # The updater has staged version 3 and not activated it yet.
    deleted = store.garbage_collect(pinned=[ModelRef(MODEL_NAME, 3)])
    assert deleted == [ModelRef(MODEL_NAME, 1)]
    assert store.versions(MODEL_NAME) == [2, 3] and store.versions("othernet") == [7]
    store.activate(MODEL_NAME, 3)
    assert store.garbage_collect() == [ModelRef("othernet", 7)]
    assert store.names() == [MODEL_NAME]
    assert not (store.state_dir / "models" / "othernet").exists()


def test_gc_refuses_to_run_with_an_unreadable_pointer(
    state_dir: Path, store: ModelStore, bundles: Bundles
) -> None:
    install_versions(store, bundles, 1, 2, 3)
    (state_dir / "current").write_text("{")
    with pytest.raises(StoreError, match="corrupt"):
        store.garbage_collect()
    assert store.versions(MODEL_NAME) == [1, 2, 3]


# --------------------------------------------------------------------------------------------------
# Damage on disk


@pytest.mark.parametrize("damage", ["flip", "empty"])
def test_reinstalling_repairs_a_damaged_manifest(
    state_dir: Path, store: ModelStore, bundles: Bundles, damage: str
) -> None:
    # A manifest that no longer verifies (a flipped bit; power lost mid-write) is damage, not a
    # different publication of the version: the signed bundle replaces it.
    bundle = bundles.make(3)
    store.install(bundle)
    store.activate(MODEL_NAME, 3)
    before = snapshot(state_dir / "models")
    manifest_path = state_dir / "models" / MODEL_NAME / "3" / "manifest.json"
    if damage == "flip":
        flip_byte(manifest_path, manifest_path.stat().st_size // 2)
    else:
        os.truncate(manifest_path, 0)
    with pytest.raises(StoreError):
        store.load(MODEL_NAME, 3)
    repaired = store.install(bundle)
    assert store.load(MODEL_NAME, 3) == repaired
    assert snapshot(state_dir / "models") == before


def test_a_different_publication_stays_a_conflict_after_a_key_rotation(
    state_dir: Path, store: ModelStore, bundles: Bundles
) -> None:
    # The installed copy no longer verifies only because its key is not trusted any more:
    # nothing shows it is damaged, so another v3 is still a second publication of v3.
    store.install(bundles.make(3))
    store.activate(MODEL_NAME, 3)
    store.close()
    rotated_key = generate_private_key()
    rotated = ModelStore(state_dir, trusted_keys=[rotated_key.public_key()]).open()
    try:
        before = snapshot(state_dir)
        other = bundles.make(3, key=rotated_key, accuracy={"top1_fp32": 0.5, "top1_int8": 0.1})
        with pytest.raises(StoreError, match="immutable"):
            rotated.install(other)
        assert snapshot(state_dir) == before
    finally:
        rotated.close()


def installed_store(store: ModelStore, bundles: Bundles) -> Path:
    return store.install(bundles.make(3)).directory


def test_load_detects_a_flipped_byte(store: ModelStore, bundles: Bundles) -> None:
    directory = installed_store(store, bundles)
    model = directory / "model.onnx"
    expected = hashlib.sha256(model.read_bytes()).hexdigest()
    flip_byte(model, model.stat().st_size // 2)
    with pytest.raises(StoreError, match="hash") as excinfo:
        store.load(MODEL_NAME, 3)
    assert excinfo.value.fields["path"] == model
    assert excinfo.value.fields["expected"] == expected
    assert str(model) in str(excinfo.value)


def test_load_detects_a_file_cut_short(store: ModelStore, bundles: Bundles) -> None:
    directory = installed_store(store, bundles)
    plan = directory / ENGINE_MEMBER
    size = plan.stat().st_size
    os.truncate(plan, size // 2)
    with pytest.raises(StoreError, match="wrong size") as excinfo:
        store.load(MODEL_NAME, 3)
    assert excinfo.value.fields["path"] == plan
    assert excinfo.value.fields["expected"] == f"{size} bytes"


def test_load_detects_a_missing_file(store: ModelStore, bundles: Bundles) -> None:
    directory = installed_store(store, bundles)
    (directory / "model.onnx").unlink()
    with pytest.raises(StoreError, match="missing") as excinfo:
        store.load(MODEL_NAME, 3)
    assert excinfo.value.fields["path"] == directory / "model.onnx"


def test_load_refuses_a_file_replaced_by_a_link(store: ModelStore, bundles: Bundles, tmp_path: Path) -> None:
    directory = installed_store(store, bundles)
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes((directory / "model.onnx").read_bytes())  # same bytes, wrong place
    (directory / "model.onnx").unlink()
    (directory / "model.onnx").symlink_to(outside)
    with pytest.raises(StoreError, match="symbolic link"):
        store.load(MODEL_NAME, 3)


def test_load_detects_an_edited_manifest(store: ModelStore, bundles: Bundles) -> None:
    directory = installed_store(store, bundles)
    manifest_path = directory / "manifest.json"
    manifest_path.write_bytes(manifest_path.read_bytes().replace(b'"max_batch": 8', b'"max_batch": 9'))
    with pytest.raises(StoreError, match="no longer verifies") as excinfo:
        store.load(MODEL_NAME, 3)
    assert excinfo.value.fields["path"] == manifest_path


def test_load_refuses_a_key_no_longer_trusted(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    installed_store(store, bundles)
    rotated = ModelStore(state_dir, trusted_keys=[generate_private_key().public_key()]).open()
    with pytest.raises(StoreError, match="no longer verifies") as excinfo:
        rotated.load(MODEL_NAME, 3)
    assert "unknown signing key" in excinfo.value.fields["reason"]


def test_load_without_any_trusted_key_says_to_give_one(state_dir: Path, store: ModelStore,
                                                       bundles: Bundles) -> None:
    # A restart that forgot --pubkey: not a changed file, and the message says what to do.
    installed_store(store, bundles)
    store.close()
    keyless = ModelStore(state_dir, trusted_keys=[]).open()
    try:
        with pytest.raises(StoreError, match="pass --pubkey or set trust.public_keys"):
            keyless.load(MODEL_NAME, 3)
    finally:
        keyless.close()


def test_load_of_a_version_that_is_not_installed(store: ModelStore) -> None:
    with pytest.raises(StoreError, match="not installed"):
        store.load(MODEL_NAME, 1)
    with pytest.raises(StoreError, match="not installed"):
        store.engine_cache_dir(MODEL_NAME, 1)


# --------------------------------------------------------------------------------------------------
# Crashes and the pointer


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
import models.bundle
from agent.store import ModelStore
from models.signing import load_public_key

real_hash_range = models.bundle.hash_range
written = []

def hash_then_die(handle, member, path, sink=None):
    if sink is not None and written:
        os._exit(17)  # the power goes out while the second member is being extracted
    digest = real_hash_range(handle, member, path, sink=sink)
    if sink is not None:
        written.append(member)
    return digest

models.bundle.hash_range = hash_then_die
store = ModelStore(Path(sys.argv[1]), trusted_keys=[load_public_key(Path(sys.argv[2]))]).open()
store.install(Path(sys.argv[3]))
"""


def test_a_crash_mid_install_leaves_only_a_hidden_directory_that_the_next_start_removes(
    tmp_path: Path, state_dir: Path, bundles: Bundles
) -> None:
    key = write_keypair(tmp_path / "release")
    bundle = bundles.make(3, key=key)
    result = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(state_dir), str(tmp_path / "release.pub"), str(bundle)],
        check=False,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 17, result.stderr
    leftovers = os.listdir(state_dir / "models" / MODEL_NAME)
    assert len(leftovers) == 1 and leftovers[0].startswith(".3.extract-")
    assert any((state_dir / "models" / MODEL_NAME / leftovers[0]).iterdir())  # half-written

    store = ModelStore(state_dir, trusted_keys=[key.public_key()]).open()
    assert os.listdir(state_dir / "models" / MODEL_NAME) == []
    assert store.versions(MODEL_NAME) == [] and store.current() is None
    assert store.install(bundle).version == 3


def test_other_leftovers_are_removed_at_start(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1, 2)
    store.activate(MODEL_NAME, 2)
    models = state_dir / "models" / MODEL_NAME
    (models / ".1.delete-0a1b2c").mkdir()  # a crash in the middle of a garbage collection
    (models / ".1.delete-0a1b2c" / "model.onnx").write_bytes(b"half")
    (state_dir / ".current.x1y2z3.tmp").write_text('{"half": ')  # a pointer write cut short
    orphan = state_dir / "engines" / MODEL_NAME / "9"  # the cache of a version already deleted
    orphan.mkdir(parents=True)
    (orphan / "plan").write_bytes(b"stale")
    kept = store.engine_cache_dir(MODEL_NAME, 1) / "plan"
    kept.write_bytes(b"built here")
    unrelated = models / ".keep-me"
    unrelated.write_text("not ours")

    reopened = ModelStore(state_dir, trusted_keys=[bundles.key.public_key()]).open()
    assert sorted(os.listdir(models)) == [".keep-me", "1", "2"]
    assert not (state_dir / ".current.x1y2z3.tmp").exists()
    assert not orphan.exists()
    assert kept.read_bytes() == b"built here"
    current = reopened.current()
    assert current is not None and current.version == 2


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not UTF-8 JSON"),
        (b'{"schema_version": 1, "current": {"name": "tinycnn"', "not UTF-8 JSON"),
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[]", "not a JSON object"),
        (b'{"current": null, "previous": null}', "schema_version"),
        (b'{"schema_version": 1, "current": "tinycnn", "previous": null}', "'current'"),
        (b'{"schema_version": 1, "current": {"name": "../x", "version": 1}, "previous": null}',
         "invalid model name"),
        (b'{"schema_version": 1, "current": null, "previous": {"name": "tinycnn", "version": "1"}}',
         "invalid model version"),
        (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
    ],
)
def test_a_corrupt_pointer_is_reported(state_dir: Path, store: ModelStore, content: bytes, reason: str) -> None:
    (state_dir / "current").write_bytes(content)
    for read in (store.current, store.previous, store.rollback):
        with pytest.raises(StoreError, match="pointer is corrupt") as excinfo:
            read()
        assert excinfo.value.fields["path"] == state_dir / "current"
        assert reason in excinfo.value.fields["reason"]


def test_a_missing_pointer_is_reported(state_dir: Path, store: ModelStore) -> None:
    (state_dir / "current").unlink()
    reopened = ModelStore(state_dir, trusted_keys=[]).open()  # not mistaken for a fresh store
    with pytest.raises(StoreError, match="pointer is missing") as excinfo:
        reopened.current()
    assert excinfo.value.fields["path"] == state_dir / "current"


def test_a_pointer_to_a_missing_version_is_reported(
    state_dir: Path, store: ModelStore, bundles: Bundles
) -> None:
    install_versions(store, bundles, 1, 2)
    store.activate(MODEL_NAME, 1)
    store.activate(MODEL_NAME, 2)
    import shutil

    shutil.rmtree(state_dir / "models" / MODEL_NAME / "2")
    with pytest.raises(StoreError, match="current version is not installed") as excinfo:
        store.current()
    assert excinfo.value.fields["version"] == 2
    shutil.rmtree(state_dir / "models" / MODEL_NAME / "1")
    with pytest.raises(StoreError, match="previous version is not installed"):
        store.rollback()


def test_activate_repairs_a_corrupt_pointer(state_dir: Path, store: ModelStore, bundles: Bundles) -> None:
    install_versions(store, bundles, 1)
    (state_dir / "current").write_bytes(b"garbage")
    store.activate(MODEL_NAME, 1)
    current = store.current()
    assert current is not None and current.version == 1
    assert store.previous() is None


# -- found by probing the daemon: two processes, a read-only disk ------------------------------


def test_a_second_process_cannot_open_a_store_in_use(state_dir: Path, store: ModelStore) -> None:
    import subprocess
    import sys

    probe = ("import sys; from agent.store import ModelStore; from agent.errors import StoreError\n"
             "try:\n    ModelStore(sys.argv[1], trusted_keys=[]).open()\n"
             "except StoreError as exc:\n    print(exc); sys.exit(3)\n")
    refused = subprocess.run([sys.executable, "-c", probe, str(state_dir)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert refused.returncode == 3, refused.stderr
    assert "in use by another edge-agent process" in refused.stdout
    assert f"pid={os.getpid()}" in refused.stdout
    again = ModelStore(state_dir, trusted_keys=[]).open()  # the same process may open it again
    again.close()
    store.close()
    allowed = subprocess.run([sys.executable, "-c", probe, str(state_dir)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_leftovers_that_cannot_be_removed_do_not_stop_the_store(
        state_dir: Path, store: ModelStore, bundles: Bundles,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A disk remounted read-only after errors still serves its intact current version, even
    with what a crash left behind."""
    install_versions(store, bundles, 1)
    store.activate(MODEL_NAME, 1)
    store.close()
    leftover = state_dir / "models" / MODEL_NAME / ".2.extract-crashed"
    leftover.mkdir()

    def read_only(path: Path) -> None:
        raise StoreError("cannot remove from the store", path=path, reason="Read-only file system")

    monkeypatch.setattr(agent.store.store, "remove_tree", read_only)
    reopened = ModelStore(state_dir, trusted_keys=[bundles.key.public_key()]).open()
    assert reopened.load(MODEL_NAME, 1).version == 1
    assert leftover.exists()
    assert "could not remove what an interrupted operation left behind" in caplog.text
