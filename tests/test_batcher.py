"""The dynamic batcher on real ONNX Runtime instances of a tiny classifier.

Where a test must hold a batch on an instance (deadlines, priorities, overlap), the backend is
wrapped in a gate: the run waits until the test opens it. That is the only stand-in here.

No test asserts how long something took (speed is for the benchmarks): whether a request waited
for the queue delay is told by the order of events on the event loop, or by the batches formed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from agent.backends.base import BackendOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.batcher import (
    Batcher,
    BatchPolicy,
    DeadlineExceeded,
    NotServing,
    QueueFull,
)
from agent.errors import ConfigError, InputError
from agent.observers import BatchDone, RequestDone, ServingObserver
from agent.scattered import DeferredArray
from tests.tiny_models import (
    GatedBackend,
    artifacts_for,
    reference_logits,
    tiny_classifier,
)


@pytest.fixture()
def model_path(tmp_path: Path) -> Path:
    return tiny_classifier(tmp_path / "model" / "model.onnx")


class Recorder(ServingObserver):
    def __init__(self) -> None:
        self.batches: list[int] = []
        self.outcomes: list[str] = []
        self.depths: list[int] = []

    def request_done(self, event: RequestDone) -> None:
        self.outcomes.append(event.outcome)

    def batch_done(self, event: BatchDone) -> None:
        self.batches.append(event.batch_size)

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)


def make_backend(model_path: Path, cls: type[OnnxRuntimeBackend] = OnnxRuntimeBackend,
                 max_batch: int = 32) -> Any:
    backend = cls(artifacts_for(model_path), BackendOptions(max_batch_size=max_batch, threads=1))
    backend.activate()
    return backend


def images(count: int, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, 3, size, size)).astype(np.float32)


async def occupy(batcher: Batcher, backend: GatedBackend, **submit: Any) -> Any:
    """Hold the backend's gate shut and submit one request; return its future once the instance
    is running it (and so is busy)."""
    backend.gate.clear()
    future = batcher.submit({"input": images(1)}, **submit)
    await asyncio.get_running_loop().run_in_executor(None, backend.running.wait, 5)
    return future


async def scheduler_turns() -> None:
    """Let the batcher's scheduler take its turns. Whether it sends a batch now is decided on the
    event loop within a few iterations of it, so these are counted, not timed: afterwards a
    request it sent at once has left the queue, however loaded the machine."""
    for _ in range(50):
        await asyncio.sleep(0)


class Timeline:
    """The order in which things happened on the event loop.

    A request that must wait out the queue delay is answered after a mark set, right after its
    submission, for half the delay: that timer is due before the batcher may send the request,
    so the loop runs it first however slow the machine; a batcher that sent it at once answers
    first."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def mark_after(self, seconds: float, name: str) -> None:
        asyncio.get_running_loop().call_later(seconds, self.events.append, name)

    def mark_when_done(self, future: asyncio.Future[Any], name: str) -> None:
        future.add_done_callback(lambda _: self.events.append(name))


def test_concurrent_requests_form_batches_with_correct_results(model_path: Path) -> None:
    recorder = Recorder()
    data = images(20)
    expected = reference_logits(model_path, data)

    async def main() -> list[Any]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=200_000),
                          observer=recorder)
        batcher.start()
        futures = [batcher.submit({"input": data[i:i + 1]}) for i in range(20)]
        results = await asyncio.gather(*futures)
        await batcher.stop()
        return results

    results = asyncio.run(main())
    assert recorder.batches == [8, 8, 4]
    for index, result in enumerate(results):
        np.testing.assert_allclose(result.outputs["logits"][0], expected[index], rtol=1e-4,
                                   atol=1e-5)
        assert result.outputs["logits"].shape == (1, 10)
    assert recorder.outcomes == ["success"] * 20


def test_a_lone_request_waits_for_the_queue_delay(model_path: Path) -> None:
    timeline = Timeline()

    async def main() -> tuple[int, Any]:
        backend = make_backend(model_path)
        # Under a delay no test outlasts, the request stays queued whatever the scheduler does.
        held = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=60_000_000))
        held.start()
        waiting = held.submit({"input": images(1)})
        await scheduler_turns()
        depth = held.queue_depth
        await held.stop()  # drains it
        await waiting
        # Under a delay that ends, it goes alone once it has.
        batcher = Batcher([backend], BatchPolicy(max_batch_size=8, max_queue_delay_us=150_000))
        batcher.start()
        request = batcher.submit({"input": images(1)})
        timeline.mark_after(0.075, "half the delay")
        timeline.mark_when_done(request, "answered")
        result = await asyncio.wait_for(request, 30)  # a hang guard
        await batcher.stop()
        return depth, result

    depth, result = asyncio.run(main())
    assert depth == 1
    assert timeline.events[0] == "half the delay"
    assert result.batch_size == 1


@pytest.mark.parametrize("adaptive", [False, True])
def test_adaptive_delay_skips_the_wait_only_for_sparse_arrivals(model_path: Path,
                                                                adaptive: bool) -> None:
    recorder = Recorder()

    async def main() -> tuple[list[bool], list[list[str]], list[int]]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=100_000,
                                      adaptive_delay=adaptive), observer=recorder)
        batcher.start()
        sent_at_once, timelines = [], []
        for index in range(3):  # one camera at about 3 frames/s
            timeline = Timeline()
            request = batcher.submit({"input": images(1, seed=index)})
            timeline.mark_after(0.05, "half the delay")
            timeline.mark_when_done(request, "answered")
            await scheduler_turns()
            sent_at_once.append(batcher.queue_depth == 0)
            await asyncio.wait_for(request, 30)  # a hang guard
            timelines.append(timeline.events)
            await asyncio.sleep(0.3)
        # Then a stream at 200 requests/s: more are due within the delay, so batches form.
        stream = []
        for index in range(12):
            stream.append(batcher.submit({"input": images(1, seed=index)}))
            await asyncio.sleep(0.005)
        await asyncio.gather(*stream)
        await batcher.stop()
        return sent_at_once, timelines, recorder.batches[3:]

    sent_at_once, timelines, stream_batches = asyncio.run(main())
    if adaptive:  # each left the queue as soon as the scheduler looked at it
        assert sent_at_once == [True] * 3
    else:  # each waited for the delay
        assert [events[0] for events in timelines] == ["half the delay"] * 3
    assert sum(stream_batches) == 12
    assert max(stream_batches) >= 4


def test_a_preferred_batch_size_goes_without_waiting(model_path: Path) -> None:
    recorder = Recorder()

    async def main() -> None:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=32, max_queue_delay_us=60_000_000,
                                      preferred_batch_sizes=(4,)), observer=recorder)
        batcher.start()
        futures = [batcher.submit({"input": images(1, seed=i)}) for i in range(4)]
        await scheduler_turns()
        assert batcher.queue_depth == 0  # all four went at once, not after the minute's delay
        await asyncio.wait_for(asyncio.gather(*futures), 30)  # a hang guard
        await batcher.stop()

    asyncio.run(main())
    assert recorder.batches == [4]


def test_requests_carrying_several_samples_share_a_batch(model_path: Path) -> None:
    recorder = Recorder()
    data = images(7)
    expected = reference_logits(model_path, data)

    async def main() -> list[Any]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=100_000),
                          observer=recorder)
        batcher.start()
        results = await asyncio.gather(batcher.submit({"input": data[:3]}),
                                       batcher.submit({"input": data[3:7]}))
        await batcher.stop()
        return results

    first, second = asyncio.run(main())
    assert recorder.batches == [7]
    np.testing.assert_allclose(first.outputs["logits"], expected[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(second.outputs["logits"], expected[3:], rtol=1e-4, atol=1e-5)


def test_different_frame_sizes_never_share_a_batch(model_path: Path) -> None:
    recorder = Recorder()
    small, large = images(2, size=16), images(2, size=24, seed=1)

    async def main() -> list[Any]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=50_000),
                          observer=recorder)
        batcher.start()
        results = await asyncio.gather(
            *(batcher.submit({"input": array[i:i + 1]}) for array in (small, large)
              for i in range(2)))
        await batcher.stop()
        return results

    results = asyncio.run(main())
    assert sorted(recorder.batches) == [2, 2]
    np.testing.assert_allclose(np.concatenate([r.outputs["logits"] for r in results[2:]]),
                               reference_logits(model_path, large), rtol=1e-4, atol=1e-5)


def test_full_queue_rejects_at_once(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)

    async def main() -> None:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                 max_queue_size=2), buffer_sets=1)
        batcher.start()
        running = await occupy(batcher, backend)
        # The instance is busy with the first and has no spare buffer set: these two wait.
        queued = [batcher.submit({"input": images(1)}) for _ in range(2)]
        with pytest.raises(QueueFull):
            batcher.submit({"input": images(1)})
        backend.gate.set()
        await asyncio.gather(running, *queued)
        await batcher.stop()

    asyncio.run(main())


def test_deadline_passes_in_the_queue(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    recorder = Recorder()

    async def main() -> None:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0),
                          observer=recorder, buffer_sets=1)
        batcher.start()
        first = await occupy(batcher, backend)
        late = batcher.submit({"input": images(1)}, timeout_us=30_000)
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(late, 2)
        backend.gate.set()
        await first
        await batcher.stop()

    asyncio.run(main())
    assert sorted(recorder.outcomes) == ["success", "timeout"]


def test_higher_priority_runs_first(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    order: list[str] = []

    async def main() -> None:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                 priority_levels=2, default_priority_level=2),
                          buffer_sets=1)
        batcher.start()
        blocker = await occupy(batcher, backend)
        low = batcher.submit({"input": images(1)})
        high = batcher.submit({"input": images(1)}, priority=1)
        low.add_done_callback(lambda _: order.append("low"))
        high.add_done_callback(lambda _: order.append("high"))
        backend.gate.set()
        await asyncio.gather(blocker, low, high)
        await batcher.stop()

    asyncio.run(main())
    assert order == ["high", "low"]


def test_a_failed_batch_fails_only_its_own_requests(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    poisoned = np.full((1, 3, 16, 16), -999, dtype=np.float32)

    async def main() -> list[Any]:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0))
        batcher.start()
        futures = [batcher.submit({"input": images(1)}), batcher.submit({"input": poisoned}),
                   batcher.submit({"input": images(1)})]
        results = await asyncio.gather(*futures, return_exceptions=True)
        await batcher.stop()
        return results

    good, bad, also_good = asyncio.run(main())
    assert "poisoned batch" in str(bad)
    assert good.outputs["logits"].shape == also_good.outputs["logits"].shape == (1, 10)


class _Unreadable(DeferredArray):
    """An input whose bytes are gone by the time its batch is assembled (as when a client
    shrinks a shared memory region after sending the request)."""

    def copy_into(self, target: np.ndarray) -> None:
        raise InputError("shared memory object is smaller than when it was registered")


def test_an_unreadable_input_fails_only_its_request(model_path: Path) -> None:
    recorder = Recorder()
    data = images(3)
    expected = reference_logits(model_path, data)

    async def main() -> list[Any]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=4, max_queue_delay_us=200_000),
                          observer=recorder)
        batcher.start()
        futures = [batcher.submit({"input": data[0:1]}),
                   batcher.submit({"input": _Unreadable(np.float32, (1, 3, 16, 16))}),
                   batcher.submit({"input": data[1:3]})]
        results = await asyncio.gather(*futures, return_exceptions=True)
        await batcher.stop()
        return results

    first, unreadable, rest = asyncio.run(main())
    assert recorder.batches == [4]  # one batch: the unreadable request's row ran as zeros
    assert isinstance(unreadable, InputError) and "smaller" in str(unreadable)
    np.testing.assert_allclose(first.outputs["logits"], expected[0:1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rest.outputs["logits"], expected[1:3], rtol=1e-4, atol=1e-5)
    assert sorted(recorder.outcomes) == ["invalid", "success", "success"]


def test_next_full_batch_is_staged_while_the_current_one_runs(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=4)

    async def main() -> None:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=4, max_queue_delay_us=0))
        batcher.start()
        backend.gate.clear()
        futures = [batcher.submit({"input": images(1, seed=i)}) for i in range(8)]
        await asyncio.get_running_loop().run_in_executor(None, backend.running.wait, 5)
        for _ in range(200):
            if backend.events.count("stage4") == 2:
                break
            await asyncio.sleep(0.01)
        # Both batches staged, only the first one running.
        assert backend.events == ["stage4", "run-start", "stage4"] or \
            backend.events == ["stage4", "stage4", "run-start"]
        backend.gate.set()
        await asyncio.gather(*futures)
        await batcher.stop()

    asyncio.run(main())


def test_two_instances_run_batches_at_the_same_time(model_path: Path) -> None:
    first = make_backend(model_path, GatedBackend, max_batch=2)
    second = make_backend(model_path, GatedBackend, max_batch=2)

    async def main() -> None:
        batcher = Batcher([first, second], BatchPolicy(max_batch_size=2, max_queue_delay_us=0))
        batcher.start()
        first.gate.clear()
        second.gate.clear()
        futures = [batcher.submit({"input": images(2, seed=i)}) for i in range(2)]
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, first.running.wait, 5)
        assert await loop.run_in_executor(None, second.running.wait, 5)
        first.gate.set()
        second.gate.set()
        await asyncio.gather(*futures)
        await batcher.stop()

    asyncio.run(main())


def test_stop_drains_queued_requests_then_refuses_new_ones(model_path: Path) -> None:
    async def main() -> None:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=60_000_000))
        batcher.start()
        futures = [batcher.submit({"input": images(1, seed=i)}) for i in range(6)]
        await scheduler_turns()
        assert batcher.queue_depth == 6  # a partial batch, waiting for the delay
        stopping = asyncio.ensure_future(batcher.stop(drain=True))
        await scheduler_turns()
        # Draining does not sit out the queue delay.
        assert batcher.queue_depth == 0
        await stopping
        assert all(future.done() and future.exception() is None for future in futures)
        with pytest.raises(NotServing):
            batcher.submit({"input": images(1)})

    asyncio.run(main())


def test_bad_submissions_are_rejected(model_path: Path) -> None:
    async def main() -> None:
        batcher = Batcher([make_backend(model_path)], BatchPolicy(max_batch_size=4))
        batcher.start()
        with pytest.raises(InputError, match="batch size"):
            batcher.submit({"input": images(5)})
        with pytest.raises(InputError, match="priority"):
            batcher.submit({"input": images(1)}, priority=-1)
        with pytest.raises(InputError, match="timeout"):  # beyond Triton's uint64
            batcher.submit({"input": images(1)}, timeout_us=10**400)
        # As Triton: a priority beyond the levels is the default level.
        assert await batcher.submit({"input": images(1)}, priority=7)
        await batcher.stop()

    asyncio.run(main())


def test_policy_validation_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        BatchPolicy(max_batch_size=8, preferred_batch_sizes=(16,))
    assert info.value.fields["key"] == "serving.preferred_batch_sizes"
    with pytest.raises(ConfigError):
        BatchPolicy(priority_levels=1, default_priority_level=2)


def test_replace_backends_moves_new_batches_and_drains_the_old_instance(tmp_path: Path) -> None:
    old_model = tiny_classifier(tmp_path / "old" / "model.onnx", seed=1)
    new_model = tiny_classifier(tmp_path / "new" / "model.onnx", seed=2)
    old = make_backend(old_model, GatedBackend, max_batch=4)
    new = make_backend(new_model, max_batch=4)
    data = images(1, seed=9)

    async def main() -> tuple[Any, Any, list[Any]]:
        batcher = Batcher([old], BatchPolicy(max_batch_size=4, max_queue_delay_us=0))
        batcher.start()
        old.gate.clear()
        in_flight = batcher.submit({"input": data})
        await asyncio.get_running_loop().run_in_executor(None, old.running.wait, 5)
        swap = asyncio.ensure_future(batcher.replace_backends([new]))
        after = await batcher.submit({"input": data})  # served by the new model at once
        assert not swap.done()  # the old instance still holds a batch
        old.gate.set()
        retired = await swap
        before = await in_flight
        await batcher.stop()
        return before, after, retired

    before, after, retired = asyncio.run(main())
    np.testing.assert_allclose(before.outputs["logits"], reference_logits(old_model, data),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(after.outputs["logits"], reference_logits(new_model, data),
                               rtol=1e-4, atol=1e-5)
    assert retired == [old]


# -- semantics found by probing the daemon over HTTP ----------------------------------------


def test_a_staged_request_past_its_deadline_is_not_a_late_success(model_path: Path) -> None:
    """A full batch staged into the spare buffers waits for the running one; its deadline still
    holds there, and the wait counts as queue time."""
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    recorder = Recorder()

    async def main() -> tuple[Any, Any]:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0),
                          observer=recorder)  # two buffer sets: the second request is staged
        batcher.start()
        submitting = time.monotonic()
        first = await occupy(batcher, backend)
        seen_running = time.monotonic()
        staged_late = batcher.submit({"input": images(1)}, timeout_us=50_000)
        for _ in range(200):
            if backend.events.count("stage1") == 2:
                break
            await asyncio.sleep(0.005)
        assert backend.events.count("stage1") == 2  # it was staged, not left in the queue
        await asyncio.sleep(0.15)
        backend.gate.set()
        results = await asyncio.gather(first, staged_late, return_exceptions=True)
        await batcher.stop()
        return results[0], results[1], seen_running - submitting

    first, staged_late, until_seen_running_s = asyncio.run(main())
    assert isinstance(staged_late, DeadlineExceeded) and "before its batch ran" in str(staged_late)
    # Its queue time ended when its run began, before the test saw it running: the gate's hold
    # after that is compute.
    assert first.queue_s <= until_seen_running_s
    assert sorted(recorder.outcomes) == ["success", "timeout"]


def test_queue_time_runs_until_the_batch_starts(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)

    async def main() -> tuple[Any, Any]:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0))
        batcher.start()
        backend.gate.clear()
        first = batcher.submit({"input": images(1)})
        second = batcher.submit({"input": images(1)})  # here before the first batch runs
        await asyncio.get_running_loop().run_in_executor(None, backend.running.wait, 5)
        await asyncio.sleep(0.2)
        backend.gate.set()
        ahead = await first
        result = await second
        await batcher.stop()
        return ahead, result

    ahead, result = asyncio.run(main())
    # It waited, staged, through the whole run of the batch ahead: all of that is queue time.
    assert result.queue_s >= ahead.compute_s


def test_a_request_timeout_may_only_shorten_the_default(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)

    async def main() -> None:
        # A second's default: room for the request holding the instance to start running.
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                 default_timeout_us=1_000_000), buffer_sets=1)
        batcher.start()
        first = await occupy(batcher, backend, timeout_us=600_000_000)
        longer = batcher.submit({"input": images(1)}, timeout_us=600_000_000)  # ten minutes
        plain = batcher.submit({"input": images(1)})  # the default, from a moment later
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(plain, 30)  # a hang guard
        assert longer.done()  # cut to the default, its deadline came first
        with pytest.raises(DeadlineExceeded):
            await longer
        backend.gate.set()
        await first
        await batcher.stop()

    asyncio.run(main())


def test_a_cancelled_request_leaves_the_queue_at_once(model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    recorder = Recorder()

    async def main() -> int:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0,
                                                 max_queue_size=1), observer=recorder,
                          buffer_sets=1)
        batcher.start()
        first = await occupy(batcher, backend)
        abandoned = batcher.submit({"input": images(1)})
        abandoned.cancel()  # what the HTTP layer does when the client goes away
        await asyncio.sleep(0.05)
        depth = batcher.queue_depth
        replacement = batcher.submit({"input": images(1)})  # the queue has room again
        backend.gate.set()
        await asyncio.gather(first, replacement)
        await batcher.stop()
        return depth

    assert asyncio.run(main()) == 0
    assert sorted(recorder.outcomes) == ["cancelled", "success", "success"]


@pytest.mark.parametrize(("sizes", "batches", "early"), [
    ((3, 5), [8], True),      # 3 + 5 is the preferred 8: it goes at once
    ((5, 4), [9], False),     # no leading run adds up to 8: both wait for the delay, together
    ((3, 3, 3), [9], False)])
def test_preferred_sizes_with_multi_sample_requests(model_path: Path, sizes: tuple[int, ...],
                                                    batches: list[int], early: bool) -> None:
    recorder = Recorder()
    timeline = Timeline()

    async def main() -> int:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=32, max_queue_delay_us=200_000,
                                      preferred_batch_sizes=(8,)), observer=recorder)
        batcher.start()
        futures = [batcher.submit({"input": images(size, seed=i)}) for i, size in enumerate(sizes)]
        timeline.mark_after(0.1, "half the delay")
        for future in futures:
            timeline.mark_when_done(future, "answered")
        await scheduler_turns()
        depth = batcher.queue_depth
        await asyncio.wait_for(asyncio.gather(*futures), 30)  # a hang guard
        await batcher.stop()
        return depth

    depth = asyncio.run(main())
    assert recorder.batches == batches
    if early:  # left the queue as soon as the scheduler looked at it
        assert depth == 0
    else:  # waited for the delay: none was answered before half of it had passed
        assert timeline.events[0] == "half the delay"


def test_adaptive_delay_does_not_hold_a_lone_client_that_sends_back_to_back(
        model_path: Path) -> None:
    async def main() -> list[bool]:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=100_000,
                                      adaptive_delay=True))
        batcher.start()
        sent_at_once = []
        for index in range(20):  # the next request only once the last is answered
            request = batcher.submit({"input": images(1, seed=index)})
            await scheduler_turns()
            sent_at_once.append(batcher.queue_depth == 0)
            await asyncio.wait_for(request, 30)  # a hang guard
        await batcher.stop()
        return sent_at_once

    sent_at_once = asyncio.run(main())
    # The median request did not wait the delay: more than half left the queue at once.
    assert sum(sent_at_once) > len(sent_at_once) // 2


def test_a_deadline_inside_the_delay_runs_on_an_idle_instance(model_path: Path) -> None:
    async def main() -> None:
        batcher = Batcher([make_backend(model_path)],
                          BatchPolicy(max_batch_size=8, max_queue_delay_us=60_000_000))
        batcher.start()
        request = batcher.submit({"input": images(1)}, timeout_us=20_000_000)
        await scheduler_turns()
        assert batcher.queue_depth == 0  # sent at once, not held until its deadline
        await asyncio.wait_for(request, 30)  # a hang guard; answered, not timed out
        await batcher.stop()

    asyncio.run(main())


# -- found by probing the batcher ----------------------------------------------------------------


def test_a_staged_request_is_answered_at_its_deadline_not_after_the_running_batch(
        model_path: Path) -> None:
    backend = make_backend(model_path, GatedBackend, max_batch=1)
    recorder = Recorder()

    async def main() -> Any:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0),
                          observer=recorder)
        batcher.start()
        first = await occupy(batcher, backend)
        staged = batcher.submit({"input": images(1)}, timeout_us=50_000)
        # The gate stays shut: the running batch ends only when the test opens it (or the gate
        # gives up); the timeout is a hang guard.
        done, _ = await asyncio.wait({first, staged}, timeout=30,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done == {staged}  # at its deadline, not after the running batch
        with pytest.raises(DeadlineExceeded, match="before its batch ran"):
            await staged
        backend.gate.set()
        await first
        await batcher.stop()
        return batcher.load()

    load = asyncio.run(main())
    assert sorted(recorder.outcomes) == ["success", "timeout"]  # counted once, as the client saw
    assert load.completed_total == load.arrivals_total == 2


class _OneGatePerRun(OnnxRuntimeBackend):
    """Each run waits for its own gate, so a test can hold the second batch after the first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import threading

        self.started = [threading.Event() for _ in range(2)]
        self.gates = [threading.Event() for _ in range(2)]
        self.runs = 0

    def run(self, batch: Any) -> dict[str, np.ndarray]:
        index, self.runs = self.runs, self.runs + 1
        self.started[index].set()
        if not self.gates[index].wait(10):
            raise RuntimeError("test gate never opened")
        return super().run(batch)


def test_an_instance_running_its_staged_batch_counts_as_busy(model_path: Path) -> None:
    # The staged batch marked the instance running, then the batch before it finished and
    # marked it idle while the staged one ran: the governor saw an idle instance at work.
    backend = make_backend(model_path, _OneGatePerRun, max_batch=1)

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1, max_queue_delay_us=0))
        batcher.start()
        first = batcher.submit({"input": images(1)})
        await loop.run_in_executor(None, backend.started[0].wait, 5)
        second = batcher.submit({"input": images(1, seed=1)})
        await asyncio.sleep(0.05)  # staged behind the first
        busy = [batcher.load().busy_instances]
        backend.gates[0].set()
        await first
        await loop.run_in_executor(None, backend.started[1].wait, 5)
        await asyncio.sleep(0.05)
        busy.append(batcher.load().busy_instances)
        backend.gates[1].set()
        await second
        busy.append(batcher.load().busy_instances)
        await batcher.stop()
        return busy

    assert asyncio.run(main()) == [1, 1, 0]


def test_a_full_batch_of_another_frame_size_does_not_wait_behind_a_lone_request(
        model_path: Path) -> None:
    # Triton sends the pending batch when a request of another shape arrives; here the lone
    # 16x16 request waits for its delay, but a full 32x32 batch goes at once.
    first, second = make_backend(model_path, max_batch=4), make_backend(model_path, max_batch=4)

    async def main() -> None:
        batcher = Batcher([first, second], BatchPolicy(max_batch_size=4,
                                                       max_queue_delay_us=60_000_000))
        batcher.start()
        lone = batcher.submit({"input": images(1, size=16)})
        await scheduler_turns()
        full = batcher.submit({"input": images(4, size=32)})
        await scheduler_turns()
        assert batcher.queue_depth == 1  # the full batch left the queue, the lone one waits
        await asyncio.wait_for(full, 30)  # a hang guard
        assert not lone.done()  # the full batch was answered while the lone one still waited
        await batcher.stop()  # drains the lone request
        await lone

    asyncio.run(main())


def test_a_swap_to_a_smaller_maximum_answers_queued_requests_it_cannot_take(
        tmp_path: Path) -> None:
    old_model = tiny_classifier(tmp_path / "old" / "model.onnx", seed=1)
    new_model = tiny_classifier(tmp_path / "new" / "model.onnx", seed=2)
    old = make_backend(old_model, GatedBackend, max_batch=4)
    new = make_backend(new_model, max_batch=2)

    async def main() -> tuple[Any, Any]:
        batcher = Batcher([old], BatchPolicy(max_batch_size=4, max_queue_delay_us=0),
                          buffer_sets=1)
        batcher.start()
        busy = await occupy(batcher, old)
        too_big = batcher.submit({"input": images(4, seed=3)})  # queued behind the busy one
        swap = asyncio.ensure_future(batcher.replace_backends([new]))
        with pytest.raises(InputError, match="exceeds the maximum of the model now served"):
            await asyncio.wait_for(too_big, 5)
        later = await asyncio.wait_for(batcher.submit({"input": images(1, seed=4)}), 5)
        old.gate.set()
        await busy
        await swap
        await batcher.stop()
        return later, batcher.load()

    later, load = asyncio.run(main())
    assert later.outputs["logits"].shape == (1, 10)
    assert load.completed_total == load.arrivals_total == 3


class _SlowStaging(OnnxRuntimeBackend):
    """Copying a batch's inputs in takes a while (a large frame on a slow board)."""

    def stage(self, batch_size: int, sample_shapes: Any) -> Any:
        time.sleep(0.4)
        return super().stage(batch_size, sample_shapes)


def test_the_copy_into_the_batch_is_compute_input_not_queue_time(model_path: Path) -> None:
    # Triton's phases never overlap: queue time ends where the copy into the batch begins.
    backend = make_backend(model_path, _SlowStaging)

    async def main() -> Any:
        batcher = Batcher([backend], BatchPolicy(max_batch_size=1))  # each request goes at once
        batcher.start()
        result = await batcher.submit({"input": images(1)})
        await batcher.stop()
        return result

    try:
        result = asyncio.run(main())
    finally:
        backend.deactivate()
    assert result.compute_input_s >= 0.4  # the sleep's own guarantee
    assert result.queue_s < result.compute_input_s
