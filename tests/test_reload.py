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


def test_only_the_power_policy_reloads_and_the_board_s_place_waits_for_a_restart(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    base = {"state_dir": tmp_path / "state", "power.enabled": True}
    old = load_config(None, env={}, overrides=base)
    new = load_config(None, env={}, overrides={
        **base, "power.latency_target_s": 0.02, "power.root": str(tmp_path / "board"),
        "power.control_period_s": 0.1})
    taken: list[object] = []
    daemon = SimpleNamespace(config=old, services={},
                             power=SimpleNamespace(reload=taken.append))
    result = reload(daemon, new)  # type: ignore[arg-type]
    assert result.applied == ("power.latency_target_s",)
    assert result.needs_restart == ("power.control_period_s", "power.root")
    assert taken == [new.power]
    assert daemon.config.power.latency_target_s == 0.02
    assert daemon.config.power.root == old.power.root
    assert daemon.config.power.control_period_s == old.power.control_period_s
    # Without power governed, every power key waits for a restart.
    daemon = SimpleNamespace(config=old, services={}, power=None)
    assert reload(daemon, new).needs_restart == (  # type: ignore[arg-type]
        "power.control_period_s", "power.latency_target_s", "power.root")
