"""Instance autoscaling on a real daemon: an instance added under sustained load, removed when
requests become rare, none added past the memory floor or while the engines sleep released, and
no request lost on the way."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agent.autoscale import available_memory_mib
from agent.batcher.batcher import EngineState
from agent.config import load_config
from agent.daemon import Daemon
from agent.run import run_foreground
from models.signing import load_private_key, write_keypair
from tests.test_update_daemon import Clients
from tests.tiny_models import make_bundle

pytest.importorskip("onnxruntime")


def _daemon(tmp_path: Path, **serving: Any) -> Daemon:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir(parents=True)
    write_keypair(key_path)
    # The slow variant: a few milliseconds a batch, so that clients keep an instance busy.
    bundle, _ = make_bundle(tmp_path, key=load_private_key(key_path), fault="slow")
    overrides = {"state_dir": tmp_path / "state", "http.port": 0,
                 "serving.backend": "onnxruntime", "serving.threads": 1,
                 "trust.public_keys": [Path(str(key_path) + ".pub")],
                 "serving.max_instances": 2, "serving.scale_window_s": 0.3,
                 "serving.scale_up_utilization": 0.1, "serving.scale_down_rate": 5.0,
                 "serving.scale_min_free_mib": 0}
    overrides.update({f"serving.{name}": value for name, value in serving.items()})
    config = load_config(None, env={}, overrides=overrides)
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    return Daemon(config)


async def _until(condition: Any, daemon: Daemon, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {daemon.autoscaler.decisions[-5:]}"
        await asyncio.sleep(0.05)


def test_an_instance_is_added_under_load_and_removed_when_requests_are_rare(
        tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)

    async def session(port: int) -> dict[str, Any]:
        service = daemon.services["tiny"]
        async with Clients(port, count=4) as clients:
            await _until(lambda: len(service.backends) == 2, daemon)
            busy = len(service.backends)
            await asyncio.sleep(0.5)  # served by both
        # The decision is recorded once the removal returned, a moment after the instance left.
        await _until(lambda: len(service.backends) == 1 and any(
            decision.action == "removed" for decision in daemon.autoscaler.decisions), daemon)
        return {"busy": busy, "clients": clients, "decisions": daemon.autoscaler.decisions}

    out = run_foreground(daemon, session=session)
    assert out["busy"] == 2
    assert out["clients"].failures == []
    actions = [decision.action for decision in out["decisions"]]
    assert actions.index("added") < actions.index("removed")
    added = next(decision for decision in out["decisions"] if decision.action == "added")
    assert added.utilization > 0.1


def test_no_instance_is_added_past_the_memory_floor(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, scale_min_free_mib=512)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000000 kB\nMemAvailable:     400000 kB\n")
    daemon.autoscaler.meminfo = meminfo
    assert available_memory_mib(meminfo) == pytest.approx(390.6, abs=0.1)

    async def session(port: int) -> dict[str, Any]:
        service = daemon.services["tiny"]
        async with Clients(port, count=4) as clients:
            await _until(lambda: any(decision.why.startswith("memory")
                                     for decision in daemon.autoscaler.decisions), daemon)
        return {"instances": len(service.backends), "clients": clients,
                "why": [decision.why for decision in daemon.autoscaler.decisions]}

    out = run_foreground(daemon, session=session)
    assert out["instances"] == 1
    assert out["clients"].failures == []
    assert any("391 MiB available" in why for why in out["why"])


def test_autoscaling_is_off_unless_max_instances_is_above_instances(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, max_instances=0)
    assert not daemon.autoscaler.enabled
    assert [task.name for task in daemon.supervisor.status()] == ["updater"]
    assert [task.name for task in _daemon(tmp_path / "on").supervisor.status()] == [
        "updater", "autoscaler"]


def test_no_instance_is_added_while_the_engines_are_released(tmp_path: Path) -> None:
    """Busy windows, then the power governor's sleep released the engines: an instance made
    now would hold its memory through the sleep, for a load that is over. Once they are
    restored, the same windows add one."""
    daemon = _daemon(tmp_path, scale_window_s=3600.0)  # only the test's windows count

    async def session(port: int) -> dict[str, Any]:
        service = daemon.services["tiny"]
        batcher = service.batcher
        batcher.release_engine()
        await _until(lambda: batcher.engine_state is EngineState.RELEASED, daemon)
        for _ in range(3):  # three busy windows
            await daemon.autoscaler._decide(busy_s=1.0, requests=100, elapsed_s=1.0)
        asleep = (len(service.backends), daemon.autoscaler.decisions[-1])
        batcher.restore_engine()
        await _until(lambda: batcher.engine_state is EngineState.ACTIVE, daemon)
        for _ in range(2):
            await daemon.autoscaler._decide(busy_s=1.0, requests=100, elapsed_s=1.0)
        return {"asleep": asleep, "awake": len(service.backends),
                "active": [backend.active for backend in service.backends]}

    out = run_foreground(daemon, session=session)
    instances, decision = out["asleep"]
    assert instances == 1 and decision.action == "kept", decision
    assert decision.why == "the engines are released (the board sleeps)"
    assert out["awake"] == 2 and out["active"] == [True, True]
