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


@dataclass
class _Stat:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class _Statistics:
    """Triton's statistics extension counters (success, fail, queue, compute)."""

    def __init__(self) -> None:
        self.success = _Stat()
        self.fail = _Stat()
        self.queue = _Stat()
        self.compute_infer = _Stat()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0

    def request_done(self, outcome: str, *, queue_s: float, compute_s: float,
                     total_s: float) -> None:
        if outcome == "success":
            self.success.add(total_s)
            self.queue.add(queue_s)
            self.compute_infer.add(compute_s)
            self.last_inference_ms = int(time.time() * 1000)
        else:
            self.fail.add(total_s)

    def batch_done(self, batch_size: int, compute_s: float) -> None:
        self.inference_count += batch_size
        self.execution_count += 1

    def queue_depth(self, depth: int) -> None:
        pass


class _Observers:
    def __init__(self, *observers: Any) -> None:
        self._observers = observers

    def request_done(self, outcome: str, *, queue_s: float, compute_s: float,
                     total_s: float) -> None:
        for observer in self._observers:
            observer.request_done(outcome, queue_s=queue_s, compute_s=compute_s, total_s=total_s)

    def batch_done(self, batch_size: int, compute_s: float) -> None:
        for observer in self._observers:
            observer.batch_done(batch_size, compute_s)

    def queue_depth(self, depth: int) -> None:
        for observer in self._observers:
            observer.queue_depth(depth)


class ModelService:
    """A model being served: call ``start()`` on the event loop, ``stop()`` to drain."""

    def __init__(self, name: str, version: int, backends: Sequence[Backend], policy: BatchPolicy,
                 *, metrics: ServingMetrics | None = None, buffer_sets: int = 2) -> None:
        self.name = name
        self.version = version
        self.metrics = metrics or ServingMetrics(name)
        self.statistics = _Statistics()
        self.batcher = Batcher(backends, policy, observer=_Observers(self.metrics, self.statistics),
                               buffer_sets=buffer_sets)
        self.ready = False
        self.metrics.set_model_version(version)

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
        zero = _Stat().to_json()
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
                "compute_input": zero,
                "compute_infer": stats.compute_infer.to_json(),
                "compute_output": zero,
                "cache_hit": zero,
                "cache_miss": zero,
            },
            "batch_stats": [],
        }
