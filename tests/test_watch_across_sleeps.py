"""The watch window after a commit, across the board's sleeps: a request that waited for the
wake (the power governor's wake hook, a sleep's engine restore with ``release_engine_in_sleep``)
or ran in a restored engine's first batch is counted and checked, but its latency is not held
against the committed version (``RequestDone.after_wake``).

The batcher's flag on a real ONNX Runtime backend; the watch's judgement on its events; and a real
daemon (the real board layer and controller over a fake board tree, the real updater) committing
a version identical to the one serving, then sleeping with its engines released in the watch
window. No test asserts a duration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from agent.backends.base import BackendOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import Batcher, BatchPolicy
from agent.batcher.batcher import EngineState
from agent.config import load_config
from agent.control.client import ControlClient
from agent.control.protocol import SOCKET_NAME, UPDATE_APPLY
from agent.daemon import Daemon
from agent.observers import RequestDone, ServingObserver
from agent.run import run_foreground
from agent.update.canary import CanaryPolicy, HealthWatch, ShadowCanary
from agent.update.priority import LowPriority
from agent.update.states import UpdatePolicy
from models.bundle import pack_bundle
from models.signing import load_private_key, write_keypair
from tests.power_boards import fake_board
from tests.test_power_daemon import images, infer, until
from tests.test_update_daemon import Clients
from tests.tiny_models import CLASSES, artifacts_for, tiny_classifier, tiny_manifest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Seen(ServingObserver):
    """Every answered request's (version, after_wake), in order."""

    def __init__(self) -> None:
        self.events: list[RequestDone] = []

    def request_done(self, event: RequestDone) -> None:
        self.events.append(event)

    def flags(self) -> list[bool]:
        return [event.after_wake for event in self.events]


# -- the batcher's flag ------------------------------------------------------------------------

@pytest.fixture()
def backend(tmp_path: Path) -> Any:
    made = OnnxRuntimeBackend(artifacts_for(tiny_classifier(tmp_path / "m" / "model.onnx")),
                              BackendOptions(max_batch_size=8, threads=1))
    made.activate()
    yield made
    made.deactivate()


def test_requests_that_waited_for_a_restore_or_a_wake_or_ran_first_after_one_are_flagged(
        backend: OnnxRuntimeBackend) -> None:
    seen = Seen()
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0),
                      observer=seen)

    async def one() -> None:
        await asyncio.wait_for(batcher.submit({"input": images()}), 10)

    async def main() -> dict[str, list[bool]]:
        flags: dict[str, list[bool]] = {}
        batcher.start()
        await one()
        flags["awake"] = seen.flags()
        # Three requests while the engine is released: each waits for the restore.
        batcher.release_engine()
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        del seen.events[:]
        await asyncio.wait_for(asyncio.gather(
            *(batcher.submit({"input": images()}) for _ in range(3))), 10)
        await one()
        flags["restored by requests"] = seen.flags()
        # A wake restores it before any request: the first batch is a restored session's first.
        batcher.release_engine()
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        batcher.restore_engine()
        await until(lambda: batcher.engine_state is EngineState.ACTIVE)
        del seen.events[:]
        await one()
        await one()
        flags["restored by a wake"] = seen.flags()
        # The board went idle: the first request waits for the wake hook.
        woken = asyncio.Event()

        async def hook() -> None:
            await asyncio.sleep(0.01)
            woken.set()

        batcher.set_wake_hook(hook)
        batcher.arm_wake()
        del seen.events[:]
        await one()
        await one()
        flags["woken by a request"] = seen.flags()
        assert woken.is_set()
        await batcher.stop()
        return flags

    flags = asyncio.run(main())
    assert flags == {
        "awake": [False],
        "restored by requests": [True, True, True, False],
        "restored by a wake": [True, False],
        "woken by a request": [True, False],
    }


# -- the watch's judgement ---------------------------------------------------------------------

def _done(total_s: float, *, version: int = 2, outcome: str = "success",
          after_wake: bool = False) -> RequestDone:
    return RequestDone(outcome, version, total_s, total_s * 0.1, after_wake=after_wake)


def test_the_watch_counts_requests_after_a_wake_but_does_not_time_them() -> None:
    policy = CanaryPolicy(watch_min_requests=20)
    watch = HealthWatch(2, policy, old_p95_s=0.010)
    for _ in range(30):
        watch.request_done(_done(0.010))
    for _ in range(10):  # each waited 0.5 s for a restore: 25 % of the answers
        watch.request_done(_done(0.5, after_wake=True))
    assert watch.check() is None
    figures = watch.figures()
    assert figures["requests"] == 40 and figures["requests_after_wake"] == 10
    assert figures["p95_ms"] == 10.0
    # The same answers, not flagged, are a regression: the flag is what keeps them out.
    unflagged = HealthWatch(2, policy, old_p95_s=0.010)
    for event in [_done(0.010)] * 30 + [_done(0.5)] * 10:
        unflagged.request_done(event)
    verdict = unflagged.check()
    assert verdict is not None and verdict.reason == "slow"
    # Failures after a wake still count as failures.
    for _ in range(5):
        watch.request_done(_done(0.5, outcome="failure", after_wake=True))
    verdict = watch.check()
    assert verdict is not None and verdict.reason == "failures"
    assert verdict.figures["failures"] == 5


def test_the_old_versions_p95_from_the_canary_leaves_out_the_requests_after_a_wake(
        backend: OnnxRuntimeBackend) -> None:
    """The watch's reference: a sleep during the canary must not make the old version look
    slower than it is (the watch would then let a slow version through)."""
    canary = ShadowCanary([backend], LowPriority("test-canary"), CanaryPolicy(), old_version=1)
    try:
        for _ in range(30):
            canary.old_latency.request_done(_done(0.010, version=1))
        for _ in range(10):
            canary.old_latency.request_done(_done(0.5, version=1, after_wake=True))
        assert canary.old_latency.p95_s() == pytest.approx(0.010)
        assert canary.old_latency.outcomes["success"] == 40
    finally:
        canary.worker.close()


# -- a real daemon -----------------------------------------------------------------------------

def heavy_classifier(path: Path, weights_mib: int) -> Path:
    """The tiny classifier with a detour through a square zero matrix of ``weights_mib`` MiB
    (logits + (logits @ widen) @ big @ narrow, all zeros: the answers do not change), as
    tools/bench_sleep_release.py makes it: its session takes tens of milliseconds to re-create
    on this CPU, a request to the awake board a few, as a TensorRT engine's restore on a board
    takes far longer than its requests."""
    import onnx
    from onnx import numpy_helper

    tiny_classifier(path)
    model = onnx.load(str(path))
    size = int((weights_mib * 2**20 / 4) ** 0.5)
    graph = model.graph
    graph.node[-1].output[0] = "clean"
    for name, shape in (("widen", (CLASSES, size)), ("big", (size, size)),
                        ("narrow", (size, CLASSES))):
        graph.initializer.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
    graph.node.extend([
        onnx.helper.make_node("MatMul", ["clean", "widen"], ["wide"]),
        onnx.helper.make_node("MatMul", ["wide", "big"], ["wider"]),
        onnx.helper.make_node("MatMul", ["wider", "narrow"], ["detour"]),
        onnx.helper.make_node("Add", ["clean", "detour"], ["logits"]),
    ])
    onnx.save(model, str(path))
    return path


@pytest.fixture()
def sleeping(tmp_path: Path) -> dict[str, Any]:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    key = load_private_key(key_path)
    model = heavy_classifier(tmp_path / "src" / "model.onnx", 32)
    bundles = {}
    for version in (1, 2):  # the same model: v2 is exactly as fast as v1
        bundles[version] = tmp_path / f"heavy-{version}.bundle"
        pack_bundle(bundles[version], tiny_manifest("tiny", version), {"model.onnx": model}, key)
    tree = fake_board(tmp_path)
    config = load_config(None, env={}, overrides={
        "state_dir": tmp_path / "state", "http.port": 0, "serving.backend": "onnxruntime",
        "trust.public_keys": [Path(str(key_path) + ".pub")],
        "power.enabled": True, "power.root": tree.root, "power.release_engine_in_sleep": True,
        "power.idle_after_s": 0.05, "power.sleep_after_s": 0.1,
        "power.control_period_s": 0.01, "power.telemetry_period_s": 0.05})
    installer = Daemon(config)
    installer.make_current(installer.install(bundles[1]))
    installer.close()
    return {"config": config, "bundle": bundles[2]}


def test_sleeps_in_the_watch_window_do_not_roll_back_a_version_as_fast_as_the_old_one(
        sleeping: dict[str, Any]) -> None:
    """Found with this set-up: v2 identical to v1, three sleeps in its watch window and a burst
    of 8 requests on each wake; the watch read P95 191 ms against the old version's 10.7 ms
    (the restores' 50-90 ms and the queue behind them) and rolled v2 back as slow."""
    config = sleeping["config"]
    daemon = Daemon(config, canary_policy=CanaryPolicy(duration_s=10.0, min_samples=64,
                                                       watch_min_requests=20),
                    update_policy=UpdatePolicy(watch_window_s=12.0))
    seen = Seen()
    out: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        service = daemon.services["tiny"]
        batcher = service.batcher
        service.observers.subscribe(seen)
        client = ControlClient(config.state_dir / SOCKET_NAME)

        async def asleep() -> None:
            await until(lambda: daemon.power is not None
                        and daemon.power.status()["state"] == "sleeping"
                        and batcher.engine_state is EngineState.RELEASED, 30)

        # One sleep first, so that the governor has measured a restore: sized on its 2 s guess,
        # its sleep's break-even is about 20 s of idle once any gap was seen (a pause in the
        # canary's traffic is one).
        await asleep()
        await loop.run_in_executor(None, infer, port)
        async with Clients(port):  # the canary's traffic: the old version's P95 comes from it
            await asyncio.sleep(0.3)
            out["apply"] = await loop.run_in_executor(None, lambda: client.call(
                UPDATE_APPLY, {"source": sleeping["bundle"].resolve().as_uri()}, timeout_s=60))
        assert daemon.updater is not None
        for _ in range(3):
            await asleep()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                await asyncio.gather(*(loop.run_in_executor(pool, infer, port)
                                       for _ in range(8)))
        async with Clients(port):  # steady requests: these the watch times
            await asyncio.sleep(1.0)
        out["state_after_traffic"] = daemon.updater.state.value
        out["restores"] = batcher.engine_restores
        await until(lambda: daemon.updater is not None
                    and daemon.updater.state.value in ("idle", "failed"), 30)
        out["status"] = daemon.updater.status()
        out["version"] = service.version

    run_foreground(daemon, session=session)
    assert out["apply"]["state"] == "committed"
    outcome = out["status"]["last_outcome"]
    assert outcome["result"] == "committed", outcome  # failed/slow before
    assert out["version"] == 2
    # The traffic ran inside the window, and the watch had requests of both kinds.
    assert out["state_after_traffic"] == "committed"
    assert out["restores"] >= 4
    new = [event for event in seen.events if event.version == 2 and event.outcome == "success"]
    assert sum(event.after_wake for event in new) >= 24
    assert sum(not event.after_wake for event in new) >= 20
