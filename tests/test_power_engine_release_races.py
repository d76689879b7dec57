"""``release_engine_in_sleep`` against the rest of the daemon: the instances a batcher releases
and restores change under it (the autoscaler removes or adds one, an update's commit or a
rollback swaps them all), and the daemon stops while the engines are released or coming back.

Real ONNX Runtime backends of the tests' tiny model; the only addition is a gate on activate (a
restore that takes as long as the test wants, as a TensorRT engine's does). No test asserts a
duration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from agent.backends.base import BackendOptions
from agent.batcher import Batcher, BatchPolicy
from agent.batcher.batcher import EngineState
from agent.daemon import Daemon
from agent.run import run_foreground
from tests.test_power_daemon import infer, installed  # noqa: F401 - the fixture
from tests.tiny_models import GatedBackend, artifacts_for, tiny_classifier

OPTIONS = BackendOptions(max_batch_size=8, threads=1)


class GatedActivate(GatedBackend):
    """A real ORT backend whose run waits for ``gate`` (tests/tiny_models.py) and whose
    activate waits for ``activate_gate`` once one is set (a slow restore); it counts its
    activations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.activate_gate: threading.Event | None = None
        self.activations = 0
        self.activating = threading.Event()

    def activate(self) -> None:
        if not self.active:
            self.activating.set()
            if self.activate_gate is not None and not self.activate_gate.wait(10):
                raise RuntimeError("test gate never opened")
            self.activations += 1
        super().activate()


def images(count: int = 1) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(count, 3, 16, 16)).astype(np.float32)


@pytest.fixture()
def versions(tmp_path: Path) -> dict[int, Any]:
    return {1: artifacts_for(tiny_classifier(tmp_path / "v1" / "model.onnx")),
            2: artifacts_for(tiny_classifier(tmp_path / "v2" / "model.onnx", seed=3), version=2)}


def active(backends: list[GatedActivate]) -> list[GatedActivate]:
    for backend in backends:
        backend.activate()
    return backends


async def until(check: Any, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


async def released(batcher: Batcher) -> None:
    batcher.release_engine()
    await until(lambda: batcher.engine_state is EngineState.RELEASED)


async def off_loop(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10)


def test_an_instance_removed_while_the_engines_are_restored_fails_no_request(
        versions: dict[int, Any]) -> None:
    """The autoscaler removes an instance (its windows were quiet: the board slept) while the
    first requests after the sleep restore the engines: they are all answered, by the instance
    that stays, and the one removed is not activated again behind its owner's back."""
    first, second = active([GatedActivate(versions[1], OPTIONS) for _ in range(2)])
    batcher = Batcher([first, second], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        await released(batcher)
        gate = threading.Event()
        first.activate_gate = gate
        pending = [batcher.submit({"input": images()}) for _ in range(4)]
        await off_loop(first.activating)  # the restore is under way, on the first instance
        assert batcher.engine_state is EngineState.RESTORING
        removing = asyncio.ensure_future(batcher.remove_backends(1))
        await asyncio.sleep(0.05)  # the removal has shut the second instance's threads down
        gate.set()
        removed = await asyncio.wait_for(removing, 10)
        assert removed == [second]
        answers = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
        assert [getattr(answer, "version", answer) for answer in answers] == [1] * 4
        assert batcher.engine_state is EngineState.ACTIVE and batcher.backends == [first]
        await batcher.stop()

    asyncio.run(main())
    try:
        assert first.active and not second.active and second.activations == 1  # its first only
        assert batcher.engine_restores == 1
    finally:
        first.deactivate()
        second.deactivate()


def test_a_swap_while_the_engines_are_restored_answers_every_request_from_the_new_version(
        versions: dict[int, Any]) -> None:
    """An update's commit (or a rollback) swaps the instances while the old version's engines
    come back: the waiting requests go to the new version, the old instances are handed back
    for their owner to free and none of them is activated after it left."""
    old = active([GatedActivate(versions[1], OPTIONS) for _ in range(3)])
    batcher = Batcher(old, BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        await released(batcher)
        gate = threading.Event()
        old[0].activate_gate = gate
        pending = [batcher.submit({"input": images()}) for _ in range(4)]
        await off_loop(old[0].activating)
        new = active([GatedActivate(versions[2], OPTIONS) for _ in range(3)])
        swapping = asyncio.ensure_future(batcher.replace_backends(new))
        await asyncio.sleep(0.05)
        gate.set()
        returned = await asyncio.wait_for(swapping, 10)
        for backend in returned:  # the updater's _free
            backend.deactivate()
        answers = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
        assert [getattr(answer, "version", answer) for answer in answers] == [2] * 4
        await asyncio.sleep(0.05)  # a restore still going over the old ones would act now
        assert batcher.engine_state is EngineState.ACTIVE
        assert [backend.active for backend in batcher.backends] == [True] * 3
        await batcher.stop()
        for backend in new:
            backend.deactivate()

    asyncio.run(main())
    assert not any(backend.active for backend in old)
    # The one under way when the swap came finished; the others stayed released.
    assert [backend.activations for backend in old] == [2, 1, 1]


def test_instances_that_join_or_leave_while_the_engines_are_released_are_released_as_well(
        versions: dict[int, Any], caplog: pytest.LogCaptureFixture) -> None:
    """While a release waits for the batch in flight, the autoscaler removes an instance (its
    owner's to free: never released after its threads stopped) and adds one (released with the
    others: the board sleeps); the batch in flight is answered, and the next request restores
    the instances serving."""
    first, second = active([GatedActivate(versions[1], OPTIONS) for _ in range(2)])
    batcher = Batcher([first, second], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    joined = GatedActivate(versions[1], OPTIONS)

    async def main() -> None:
        batcher.start()
        first.gate.clear()  # the batch in flight runs until the test opens it
        in_flight = batcher.submit({"input": images()})
        await off_loop(first.running)
        batcher.release_engine()
        await asyncio.sleep(0)  # the release has begun: it waits for the batch
        assert batcher.engine_state is EngineState.RELEASING
        assert await asyncio.wait_for(batcher.remove_backends(1), 10) == [second]
        batcher.add_backends(active([joined]))
        first.gate.set()
        assert (await asyncio.wait_for(in_flight, 10)).version == 1
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        assert batcher.backends == [first, joined]
        assert not first.active and not joined.active
        assert second.active  # the autoscaler frees it
        second.deactivate()
        answer = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert answer.version == 1 and first.active and joined.active and not second.active
        await batcher.stop()

    with caplog.at_level(logging.ERROR, logger="agent.batcher.batcher"):
        asyncio.run(main())
    try:
        assert [record.getMessage() for record in caplog.records
                if record.levelno >= logging.ERROR] == []
        assert (batcher.engine_releases, batcher.engine_restores) == (1, 1)
    finally:
        for backend in (first, second, joined):
            backend.deactivate()


def test_an_instance_that_joins_once_the_engines_are_released_is_released_too(
        versions: dict[int, Any]) -> None:
    """The autoscaler made an instance while the board was busy, and the board went to sleep
    before it joined: it must not hold its engine through the sleep (the memory the release
    gave back), and the next request restores it with the others."""
    first = active([GatedActivate(versions[1], OPTIONS)])[0]
    batcher = Batcher([first], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    joined = GatedActivate(versions[1], OPTIONS)

    async def main() -> None:
        batcher.start()
        await released(batcher)
        batcher.add_backends(active([joined]))
        await until(lambda: batcher.engine_state is EngineState.RELEASED and not joined.active)
        assert not first.active
        answer = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert answer.version == 1 and first.active and joined.active
        await batcher.stop()

    try:
        asyncio.run(main())
        assert batcher.backends == [first, joined]
        assert batcher.engine_restores == 1
    finally:
        for backend in (first, joined):
            backend.deactivate()


def test_a_daemon_stopped_while_its_engines_are_released_does_not_restore_them(
        installed: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """SIGTERM (or any stop) while the board sleeps with the engines released: the stop wakes
    the controller, which puts the board's limits back, but the engines are not re-created only
    to be freed a moment later (a TensorRT engine's restore is seconds on a Jetson, and its
    memory is what the sleep had let go)."""
    config = installed["config"]
    config = dataclasses.replace(config, power=dataclasses.replace(
        config.power, release_engine_in_sleep=True))
    daemon = Daemon(config)
    seen: dict[str, Any] = {}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        batcher = daemon.services["tiny"].batcher
        for _ in range(2):  # the second sleep's release follows a restore
            await until(lambda: daemon.power is not None
                        and daemon.power.status()["state"] == "sleeping"
                        and batcher.engine_state is EngineState.RELEASED)
            await loop.run_in_executor(None, infer, port)
        await until(lambda: daemon.power is not None
                    and daemon.power.status()["state"] == "sleeping"
                    and batcher.engine_state is EngineState.RELEASED)
        seen["batcher"] = batcher
        seen["activations"] = activations()

    def activations() -> int:
        return sum(1 for record in caplog.records
                   if record.getMessage().startswith("onnxruntime backend active"))

    with caplog.at_level(logging.INFO, logger="agent.backends.onnxruntime"):
        run_foreground(daemon, session=session)
    batcher = seen["batcher"]
    assert seen["activations"] == 3  # the start's, and a restore after each of two sleeps
    assert activations() == seen["activations"]
    assert batcher.engine_restores == 2
    assert not any(backend.active for backend in batcher.backends)


def test_a_restore_that_fails_answers_503_naming_the_cause_and_the_next_request_recovers(
        installed: dict[str, Any]) -> None:  # noqa: F811
    """The model file is gone when the first request after a sleep restores the engine: the
    client is told the server cannot serve now (503, so it retries), not that its request was
    bad (a ModelError is an InputError: 400), with the file named; once the file is back the
    next request restores the engine and is answered."""
    import urllib.error
    import urllib.request

    from agent.tooling.loadgen import encode_request

    config = installed["config"]
    config = dataclasses.replace(config, power=dataclasses.replace(
        config.power, release_engine_in_sleep=True))
    daemon = Daemon(config)
    answers: list[tuple[int, str]] = []

    def post(port: int) -> tuple[int, str]:
        body, header_length = encode_request("input", images(), datatype="FP32")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v2/models/tiny/infer", data=body,
            headers={"Inference-Header-Content-Length": str(header_length),
                     "Content-Type": "application/octet-stream"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, ""
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        batcher = daemon.services["tiny"].batcher
        model = batcher.backends[0].artifacts.onnx_path
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        model.rename(model.with_name("aside"))
        answers.append(await loop.run_in_executor(None, post, port))
        # The wake that came with the request may try the restore again: its failure ends it.
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        model.with_name("aside").rename(model)
        answers.append(await loop.run_in_executor(None, post, port))

    run_foreground(daemon, session=session)
    (failed, failure), recovered = answers
    assert failed == 503, failure
    assert "could not be restored" in failure and "model file missing" in failure
    assert "tiny/1/model.onnx" in failure
    assert recovered == (200, "")


def test_a_request_whose_wake_comes_as_the_governor_stops_is_served_without_an_error_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while a request waits for the wake (the board asleep, its engine released): the
    governor's thread refuses the call as it stops, and the request is served without the
    boost. That is the shutdown doing its work, not a failed wake: no ERROR and traceback in
    the daemon's log for each such request."""
    from agent.config import load_config
    from agent.power.service import PowerService

    backend = GatedActivate(artifacts_for(tiny_classifier(tmp_path / "m" / "model.onnx")),
                            OPTIONS)
    backend.activate()
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    config = load_config(None, env={}, overrides={"state_dir": tmp_path / "state",
                                                  "power.enabled": True})
    service = PowerService(config.power, config.state_dir, batchers=lambda: [batcher])

    async def main() -> None:
        batcher.start()
        await released(batcher)
        # As PowerService._attach_serving sets it; then the governor stops (its run ended).
        batcher.set_wake_hook(service._wake_for_request, timeout_s=5.0)
        batcher.arm_wake()
        service._stopping.set()
        answer = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert answer.version == 1 and batcher.wakes == 1
        await batcher.stop()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    backend.deactivate()
    assert [record.getMessage() for record in caplog.records
            if record.levelno >= logging.ERROR] == []
    assert any("stopped" in record.getMessage() for record in caplog.records
               if record.name == "agent.power.service")


def test_the_canary_does_not_charge_the_old_versions_engine_restores_to_its_serving_cost(
        versions: dict[int, Any]) -> None:
    """A canary on a board that sleeps between bursts: each restore re-creates the old
    version's session on its run thread, whose CPU time the canary reads as the old version's
    serving cost; counted so, the same model reads as several times cheaper than itself
    (measured: cost ratio 0.28 across sleeps, 1.1 without, for identical versions), and a new
    version that slow would pass the speed gate. Same architecture on both sides here: the
    ratio stays near 1 however many restores the canary sees."""
    from agent.update.canary import CanaryPolicy, ShadowCanary
    from agent.update.priority import LowPriority

    old = active([GatedActivate(versions[1], OPTIONS)])
    batcher = Batcher(old, BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    worker = LowPriority("canary-test")
    candidate = worker.executor.submit(
        lambda: active([GatedActivate(versions[2], OPTIONS)])[0]).result(30)
    canary = ShadowCanary([candidate], worker, CanaryPolicy(duration_s=60.0, min_samples=96),
                          old_version=1, old_threads=lambda: batcher.thread_ids(1))
    frames = images(4)

    async def main() -> dict[str, Any]:
        batcher.start()
        batcher.set_tap(canary.tap)
        verdict = asyncio.ensure_future(canary.run())
        for _ in range(12):  # a burst, then a sleep that releases the engine
            for _ in range(3):
                await asyncio.wait_for(batcher.submit({"input": frames}), 10)
            await released(batcher)
        while not verdict.done():
            await asyncio.wait_for(batcher.submit({"input": frames}), 10)
        await batcher.stop()
        return (await verdict).figures

    try:
        figures = asyncio.run(main())
    finally:
        for backend in (*old, candidate):
            backend.deactivate()
        worker.close()
    assert batcher.engine_restores >= 11
    assert figures["cost_ratio"] is not None and 0.5 < figures["cost_ratio"] < 2.0, figures


class ColdFirstRun(GatedActivate):
    """A real ORT backend whose first run after each activate burns ``cold_cpu_s`` of CPU on
    the calling thread first: a re-created engine's first run allocating (3 times a steady run
    for the tiny model on this VM's CPU, 103 against 38 us; a TensorRT context's first enqueue
    on a board is its own figure)."""

    cold_cpu_s = 0.02

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cold = False

    def activate(self) -> None:
        if not self.active:
            self.cold = True
        super().activate()

    def run(self, batch: Any) -> dict[str, np.ndarray]:
        if self.cold:
            self.cold = False
            until = time.thread_time() + self.cold_cpu_s
            while time.thread_time() < until:
                pass
        return super().run(batch)


def test_the_canary_leaves_a_restored_engines_first_batch_out_of_the_cost(
        versions: dict[int, Any]) -> None:
    """A sleep between every two batches: the first batch of each restored engine is slower
    than the steady ones (not the version's serving cost, and the new version's shadow of it is
    a steady run): counted, the old version read several times costlier than it is, and a new
    version that much slower would pass the speed gate. Left out of the cost on both sides
    (its answers still compared), identical architectures read a ratio near 1."""
    from agent.update.canary import CanaryPolicy, ShadowCanary
    from agent.update.priority import LowPriority

    old = active([ColdFirstRun(versions[1], OPTIONS)])
    batcher = Batcher(old, BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    worker = LowPriority("canary-test")
    frames = images(4)

    def warmed() -> ColdFirstRun:  # as the update warms its candidate up before the canary
        backend = ColdFirstRun(versions[2], OPTIONS)
        backend.activate()
        backend.infer({"input": frames})
        return backend

    candidate = worker.executor.submit(warmed).result(30)
    canary = ShadowCanary([candidate], worker, CanaryPolicy(duration_s=60.0, min_samples=96),
                          old_version=1, old_threads=lambda: batcher.thread_ids(1))

    async def main() -> dict[str, Any]:
        batcher.start()
        batcher.set_tap(canary.tap)
        verdict = asyncio.ensure_future(canary.run())
        await asyncio.wait_for(batcher.submit({"input": frames}), 10)  # the cost starts here
        while not verdict.done():
            for _ in range(2):
                await asyncio.wait_for(batcher.submit({"input": frames}), 10)
            await released(batcher)
        await batcher.stop()
        return (await verdict).figures

    try:
        figures = asyncio.run(main())
    finally:
        for backend in (*old, candidate):
            backend.deactivate()
        worker.close()
    assert figures["cost_ratio"] is not None and 0.4 < figures["cost_ratio"] < 2.5, figures
    assert figures["batches_after_restore"] >= 10, figures
    assert figures["samples"] >= 96 and figures["agreement"] is not None  # all compared


def test_of_quick_sleeps_and_wakes_the_last_one_wins(versions: dict[int, Any]) -> None:
    """A sleep, a wake and a sleep again while the first release waits for its batch in flight:
    the board sleeps, so the engine ends released (it was restored and held through the sleep);
    a sleep that comes while a wake's restore runs releases it once the restore is done."""
    backend = active([GatedActivate(versions[1], OPTIONS)])[0]
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        backend.gate.clear()
        in_flight = batcher.submit({"input": images()})
        await off_loop(backend.running)
        batcher.release_engine()  # sleep
        batcher.restore_engine()  # wake
        batcher.release_engine()  # sleep again
        backend.gate.set()
        assert (await asyncio.wait_for(in_flight, 10)).version == 1
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        await asyncio.sleep(0.05)  # a restore left pending would run now
        assert batcher.engine_state is EngineState.RELEASED and not backend.active
        gate = threading.Event()
        backend.activate_gate = gate
        backend.activating.clear()
        batcher.restore_engine()  # a wake (by command: no request waits)
        await off_loop(backend.activating)
        batcher.release_engine()  # and the board sleeps again before the restore is done
        gate.set()
        await until(lambda: batcher.engine_state is EngineState.RELEASED and not backend.active)
        answer = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert answer.version == 1 and backend.active
        await batcher.stop()

    asyncio.run(main())
    backend.deactivate()
    assert (batcher.engine_releases, batcher.engine_restores) == (2, 2)
