"""A configuration reload in a serving daemon (agent/reload.py): what can change is in force at
once (the batcher's policy, the store's trusted keys, the log level), what cannot is named and left
as it was, and the daemon's configuration stays the one in force."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

from agent.config import load_config
from agent.daemon import Daemon
from agent.reload import changed_keys, reload
from agent.run import run_foreground
from models.signing import load_private_key, load_public_key, write_keypair
from tests.tiny_models import make_bundle


def test_a_reload_applies_batching_keys_and_log_level_and_names_what_needs_a_restart(
        tmp_path: Path) -> None:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    other = tmp_path / "keys" / "next.key"
    write_keypair(other)
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path))
    base = {"state_dir": tmp_path / "state", "http.port": 0, "serving.backend": "onnxruntime",
            "trust.public_keys": [Path(str(key_path) + ".pub")]}
    config = load_config(None, env={}, overrides=base)
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    daemon = Daemon(config)
    new = load_config(None, env={}, overrides={
        **base, "serving.max_queue_delay_us": 1234, "serving.max_queue_size": 9,
        "serving.instances": 3, "log.level": "debug", "http.host": "0.0.0.0",
        "trust.public_keys": [Path(str(key_path) + ".pub"), Path(str(other) + ".pub")]})
    assert changed_keys(config, new) == [
        "http.host", "log.level", "serving.instances", "serving.max_queue_delay_us",
        "serving.max_queue_size", "trust.public_keys"]

    async def session(port: int) -> None:
        result = reload(daemon, new)
        assert result.applied == ("log.level", "serving.max_queue_delay_us",
                                  "serving.max_queue_size", "trust.public_keys")
        assert result.needs_restart == ("http.host", "serving.instances")
        policy = daemon.services["tiny"].batcher.policy
        assert policy.max_queue_delay_us == 1234 and policy.max_queue_size == 9
        assert len(daemon.store._trusted_keys) == 2
        assert logging.getLogger("agent").level == logging.DEBUG
        # The configuration in force: the old one plus what was applied.
        assert daemon.config.serving.instances == 1 and daemon.config.http.host == "127.0.0.1"
        assert daemon.config.serving.max_queue_delay_us == 1234
        assert reload(daemon, new).needs_restart == ("http.host", "serving.instances")
        assert reload(daemon, new).applied == ()

    try:
        run_foreground(daemon, session=session)
    finally:
        logging.getLogger("agent").setLevel(logging.NOTSET)


def test_keys_rewritten_in_the_same_files_count_as_a_change(tmp_path: Path) -> None:
    key_path = tmp_path / "fleet.key"
    write_keypair(key_path)
    overrides = {"state_dir": tmp_path / "state", "trust.public_keys": [
        Path(str(key_path) + ".pub")]}
    before = load_config(None, env={}, overrides=overrides)
    key_path.unlink()
    Path(str(key_path) + ".pub").unlink()
    write_keypair(key_path)
    after = load_config(None, env={}, overrides=overrides)
    assert load_public_key(Path(str(key_path) + ".pub")) is not None
    assert changed_keys(before, after) == ["trust.public_keys"]
