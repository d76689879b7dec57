"""``release_engine_in_sleep``: the board's sleep frees the model's engines (the backends'
ONNX Runtime sessions, here) and the wake, or the first request itself, re-creates them before
anything runs; no request is lost or fails across a sleep and a wake.

The batcher's half on a real ORT backend; the daemon's with the real board layer and controller
over a fake board tree, serving the tests' tiny model over HTTP. No test asserts a duration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")

from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import Batcher, BatchPolicy
from agent.batcher.batcher import EngineState
from agent.daemon import Daemon
from agent.errors import AgentError
from agent.run import run_foreground
from tests import serving_fixtures
from tests.test_power_daemon import images, infer, installed, until  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

backend = serving_fixtures.backend  # the tiny classifier, active


def test_a_release_frees_the_session_and_the_next_request_brings_it_back(
        backend: OnnxRuntimeBackend) -> None:
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        before = await batcher.submit({"input": images()})
        batcher.release_engine()
        assert batcher.engine_state is EngineState.RELEASING
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        assert not backend.active and backend._session is None  # the memory is let go
        after = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert backend.active and batcher.engine_state is EngineState.ACTIVE
        assert after.outputs["logits"].tolist() == before.outputs["logits"].tolist()
        await batcher.stop()

    asyncio.run(main())
    assert (batcher.engine_releases, batcher.engine_restores) == (1, 1)


def test_requests_that_come_during_the_release_wait_and_are_answered(
        backend: OnnxRuntimeBackend) -> None:
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        batcher.release_engine()
        # Before the release task has run a turn: these must wait for release then restore.
        pending = [batcher.submit({"input": images()}) for _ in range(5)]
        answers = await asyncio.wait_for(asyncio.gather(*pending), 10)
        assert all(answer.outputs for answer in answers)
        assert batcher.engine_state is EngineState.ACTIVE and backend.active
        await batcher.stop()

    asyncio.run(main())
    assert (batcher.engine_releases, batcher.engine_restores) == (1, 1)


def test_a_restore_that_fails_fails_the_waiting_requests_and_the_next_one_tries_again(
        backend: OnnxRuntimeBackend) -> None:
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))
    model = backend.artifacts.onnx_path
    aside = model.with_name("aside.onnx")

    async def main() -> None:
        batcher.start()
        batcher.release_engine()
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        model.rename(aside)  # the model file gone: the session cannot be made
        with pytest.raises(AgentError, match="model file missing"):
            await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert batcher.engine_state is EngineState.RELEASED and not backend.active
        aside.rename(model)
        answer = await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        assert answer.outputs and backend.active
        await batcher.stop()

    asyncio.run(main())


def test_without_releasing_nothing_is_freed_and_restore_is_a_no_op(
        backend: OnnxRuntimeBackend) -> None:
    batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=0))

    async def main() -> None:
        batcher.start()
        batcher.restore_engine()
        assert batcher.engine_state is EngineState.ACTIVE
        await asyncio.wait_for(batcher.submit({"input": images()}), 10)
        await batcher.stop()

    asyncio.run(main())
    assert backend.active and (batcher.engine_releases, batcher.engine_restores) == (0, 0)


@pytest.mark.parametrize("release", [True, False])
def test_the_daemons_sleep_releases_the_engine_and_requests_across_sleeps_all_succeed(
        installed: dict[str, Any], release: bool) -> None:  # noqa: F811
    """The real board layer and controller over the fake tree, ``release_engine_in_sleep`` on
    (off: the engine stays): through several sleeps, every request is answered."""
    config = installed["config"]
    config = dataclasses.replace(config, power=dataclasses.replace(
        config.power, release_engine_in_sleep=release))
    daemon = Daemon(config)
    seen: dict[str, Any] = {"asleep_active": [], "answered": 0}

    async def session(port: int) -> None:
        loop = asyncio.get_running_loop()
        await until(lambda: daemon.power is not None and daemon.power.status()["running"])
        service = daemon.services["tiny"]
        batcher = service.batcher
        for cycle in range(3):
            await until(lambda: daemon.power is not None
                        and daemon.power.status()["state"] == "sleeping"
                        and (not release or batcher.engine_state is EngineState.RELEASED))
            seen["asleep_active"].append([b.active for b in batcher.backends])
            # One request, then a burst of concurrent ones, right after the sleep.
            await loop.run_in_executor(None, infer, port)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                burst = [loop.run_in_executor(pool, infer, port) for _ in range(8)]
                await asyncio.gather(*burst)
            seen["answered"] += 9
        seen["releases"] = batcher.engine_releases
        seen["restores"] = batcher.engine_restores
        seen["engine"] = daemon.power.status()["engine"] if daemon.power else None
        seen["stats"] = service.stats()

    run_foreground(daemon, session=session)
    assert seen["answered"] == 27  # every infer() asserted its 200
    engine = seen["engine"]
    assert (engine["releases"], engine["restores"]) == (seen["releases"], seen["restores"])
    if release:
        assert seen["asleep_active"] == [[False]] * 3  # freed in each sleep
        assert seen["releases"] >= 3 and seen["restores"] >= 3
        assert engine["last_restore_s"] is not None and engine["last_restore_s"] >= 0
    else:
        assert seen["asleep_active"] == [[True]] * 3
        assert (seen["releases"], seen["restores"]) == (0, 0)
        assert engine["last_restore_s"] is None


def test_a_measured_engine_restore_sizes_the_sleeps_break_even() -> None:
    """The constructor's guess (2 s, a TensorRT engine's order) keeps a board whose gaps are
    ~4 s from sleeping with the engine released; told the restore takes 5 ms, it sleeps."""
    from power.controller import Controller
    from power.types import LoadSample, PowerPolicy
    from tests.power_doubles import FakeClock, StrictBoard, serve

    def sleeps(reload_s: float | None) -> int:
        clock = FakeClock()
        board = StrictBoard(clock=clock)
        released: list[bool] = []
        controller = Controller(board, PowerPolicy(idle_after_s=0.5, sleep_after_s=2.0,
                                                   release_engine_in_sleep=True),
                                clock=clock, on_engine=released.append, engine_reload_s=2.0)
        controller.start()
        if reload_s is not None:
            controller.set_engine_reload_s(reload_s)
        arrivals = 0
        for _ in range(12):  # busy, then ~4 s of nothing, again and again
            start = clock.now_s
            result = serve(controller, board, clock, [start + 0.05 * i for i in range(1, 6)],
                           until_s=start + 0.5)
            arrivals += len(result.latencies_s)
            for _ in range(80):
                clock.advance(0.05)
                controller.step(LoadSample(time_s=clock.now_s, queue_depth=0, busy_instances=0,
                                           instances=1, arrivals_total=arrivals,
                                           completed_total=arrivals))
            controller.wake()
        controller.stop()
        return released.count(False)

    assert sleeps(None) <= 1  # only the first gap, when nothing is known
    assert sleeps(0.005) >= 10
    with pytest.raises(AgentError, match="finite number of seconds"):
        Controller(StrictBoard(clock=FakeClock()), PowerPolicy()).set_engine_reload_s(-1.0)


def test_a_tensorrt_engine_is_freed_in_sleep_and_comes_back_from_its_cached_plan(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same cycle on the TensorRT backend (the strict fake TensorRT and CUDA of
    tests/fakes): the release frees the engine, context and device memory; the restore
    deserializes the plan cached at the first activation instead of building again."""
    pytest.importorskip("onnx")
    import numpy as np

    from tests.fakes.trt_board import (
        live_objects,
        make_artifacts,
        make_board,
        reference,
    )

    board = make_board(monkeypatch, tmp_path)
    artifacts = make_artifacts(tmp_path)
    backend = board.backend(artifacts)
    backend.activate()
    batcher = Batcher([backend], BatchPolicy(max_batch_size=4, max_queue_delay_us=0))
    frames = np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)

    async def main() -> None:
        batcher.start()
        batcher.release_engine()
        await until(lambda: batcher.engine_state is EngineState.RELEASED)
        assert live_objects(board) == {} and board.state.gpu.live_regions == 0
        answer = await asyncio.wait_for(batcher.submit({"images": frames}), 10)
        np.testing.assert_allclose(answer.outputs["features"], reference(artifacts, frames),
                                   rtol=1e-4, atol=1e-4)
        assert live_objects(board) == {"Runtime": 1, "ICudaEngine": 1, "IExecutionContext": 1}
        await batcher.stop()

    try:
        asyncio.run(main())
        assert backend.engine_source is not None and backend.engine_source.origin == "cache"
        assert len(board.state.builds) == 1  # built once, at the first activation
    finally:
        backend.deactivate()
