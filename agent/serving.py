"""One served model: its backend instances behind a batcher, with metrics and statistics.

``ModelService`` is what the HTTP API talks to. It knows the model's name, version and tensors,
whether it is ready, and keeps the Triton-style statistics (``/v2/models/<m>/stats``) beside the
Prometheus metrics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.backends.base import Backend, TensorInfo
from agent.batcher import Batcher, BatchPolicy
from agent.metrics import ServingMetrics
from agent.observers import BatchDone, Observers, RequestDone, ServingObserver


@dataclass
class _Stat:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class _Statistics(ServingObserver):
    """Triton's statistics extension counters: success, fail, queue and the three compute
    phases of each successful request (its batch's input copy, run and output split)."""

    def __init__(self) -> None:
        self.success = _Stat()
        self.fail = _Stat()
        self.queue = _Stat()
        self.compute_input = _Stat()
        self.compute_infer = _Stat()
        self.compute_output = _Stat()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        # Per batch size: the executions of that size and their three phases.
        self.batches: dict[int, tuple[_Stat, _Stat, _Stat]] = {}

    def request_done(self, event: RequestDone) -> None:
        if event.outcome == "success":
            self.success.add(event.total_s)
            self.queue.add(event.queue_s)
            self.compute_input.add(event.compute_input_s)
            self.compute_infer.add(event.compute_s)
            self.compute_output.add(event.compute_output_s)
            self.last_inference_ms = int(time.time() * 1000)
        else:
            self.fail.add(event.total_s)

    def batch_done(self, event: BatchDone) -> None:
        self.inference_count += event.batch_size
        self.execution_count += 1
        phases = self.batches.get(event.batch_size)
        if phases is None:
            phases = self.batches[event.batch_size] = (_Stat(), _Stat(), _Stat())
        for stat, seconds in zip(phases, (event.compute_input_s, event.compute_s,
                                          event.compute_output_s)):
            stat.add(seconds)

    def batch_stats(self) -> list[dict[str, Any]]:
        """Triton's ``batch_stats``: one entry per batch size executed, smallest first."""
        return [{"batch_size": size, "compute_input": phases[0].to_json(),
                 "compute_infer": phases[1].to_json(), "compute_output": phases[2].to_json()}
                for size, phases in sorted(self.batches.items())]


class ModelService:
    """A model being served: call ``start()`` on the event loop, ``stop()`` to drain."""

    def __init__(self, name: str, version: int, backends: Sequence[Backend], policy: BatchPolicy,
                 *, metrics: ServingMetrics | None = None, buffer_sets: int = 2) -> None:
        self.name = name
        self.version = version
        self.metrics = metrics or ServingMetrics(name)
        self.statistics = _Statistics()
        # What the batcher reports goes to these and to whatever subscribes later (the power
        # governor, the updater's canary).
        self.observers = Observers(self.metrics, self.statistics)
        self.batcher = Batcher(backends, policy, observer=self.observers, buffer_sets=buffer_sets)
        self.ready = False
        self.metrics.set_model_version(version)
        # Threads the serving version's backends made (ONNX Runtime's pools), where known: with
        # the batcher's own (Batcher.thread_ids), where its batches' CPU time goes.
        self.backend_threads: set[int] = set()

    @property
    def backends(self) -> list[Backend]:
        return self.batcher.backends

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return self.backends[0].inputs

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return self.backends[0].outputs

    @property
    def platform(self) -> str:
        return {"tensorrt": "tensorrt_plan"}.get(self.backends[0].kind, "onnxruntime_onnx")

    def rejected(self, outcome: str) -> None:
        """A request refused before it reached the batcher (bad input, full queue, not ready):
        a failure in Triton's statistics too, so that their counts add up to what was sent."""
        self.metrics.request_rejected(outcome)
        self.statistics.fail.add(0.0)

    def start(self) -> None:
        self.batcher.start()
        self.ready = True

    def version_threads(self) -> set[int]:
        """Every thread known to work for the version serving (the canary's CPU accounting)."""
        return self.backend_threads | self.batcher.thread_ids(self.version)

    async def swap(self, version: int, backends: Sequence[Backend], policy: BatchPolicy, *,
                   drain_timeout_s: float | None = None,
                   backend_threads: set[int] | None = None) -> list[Backend]:
        """Serve ``version`` on ``backends`` (active, warmed up) from now on: new batches go to
        them at once, and the version everywhere (URLs, responses, statistics, the Prometheus
        metric) follows. Returns the old backends once their in-flight batches drained (at most
        ``drain_timeout_s``), for the caller to free."""
        self.version = version
        self.metrics.set_model_version(version)
        self.backend_threads = set(backend_threads or ())
        return await self.batcher.replace_backends(backends, policy=policy,
                                                   drain_timeout_s=drain_timeout_s)

    async def stop(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        self.ready = False
        await self.batcher.stop(drain=drain, timeout_s=timeout_s)

    # -- descriptions for the API -------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [str(self.version)],
            "platform": self.platform,
            "inputs": [info.to_json() for info in self.inputs],
            "outputs": [info.to_json() for info in self.outputs],
        }

    def config(self) -> dict[str, Any]:
        policy = self.batcher.policy

        def tensor(info: TensorInfo) -> dict[str, Any]:
            return {"name": info.name, "data_type": f"TYPE_{info.datatype}",
                    "dims": list(info.sample_shape)}

        kind = "KIND_GPU" if self.backends[0].kind == "tensorrt" else "KIND_CPU"
        return {
            "name": self.name,
            "platform": self.platform,
            "backend": self.backends[0].kind,
            "max_batch_size": self.batcher.max_batch_size,
            "input": [tensor(info) for info in self.inputs],
            "output": [tensor(info) for info in self.outputs],
            "dynamic_batching": {
                "preferred_batch_size": list(policy.preferred_batch_sizes),
                "max_queue_delay_microseconds": policy.max_queue_delay_us,
                "adaptive_delay": policy.adaptive_delay,
                "priority_levels": policy.priority_levels,
                "default_priority_level": policy.default_priority_level,
                "default_queue_policy": {
                    "max_queue_size": policy.max_queue_size,
                    "default_timeout_microseconds": policy.default_timeout_us,
                },
            },
            "instance_group": [{"count": len(self.backends), "kind": kind}],
            "parameters": {"execution": self.backends[0].describe()},
        }

    def stats(self) -> dict[str, Any]:
        stats = self.statistics
        never = _Stat().to_json()  # this server has no response cache: nothing hits or misses
        return {
            "name": self.name,
            "version": str(self.version),
            "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count,
            "execution_count": stats.execution_count,
            "inference_stats": {
                "success": stats.success.to_json(),
                "fail": stats.fail.to_json(),
                "queue": stats.queue.to_json(),
                "compute_input": stats.compute_input.to_json(),
                "compute_infer": stats.compute_infer.to_json(),
                "compute_output": stats.compute_output.to_json(),
                "cache_hit": never,
                "cache_miss": never,
            },
            "batch_stats": stats.batch_stats(),
        }
