"""The batcher's settings, its errors and what it hands back: a request's result and a snapshot
of its load."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent.errors import AgentError, ConfigError


class QueueFull(AgentError):
    """The request queue is at its limit (HTTP 503)."""


class DeadlineExceeded(AgentError):
    """A request's timeout passed before it ran."""


class NotServing(AgentError):
    """The batcher is stopped or stopping (HTTP 503)."""


class EngineUnavailable(NotServing):
    """The engines a sleep released could not be re-created for the request (HTTP 503, as the
    server's failure and not the request's: the next request tries the restore again). Carries
    the cause's message and facts (which model file, which engine)."""


# Triton's request timeout is an unsigned 64-bit count of microseconds.
MAX_TIMEOUT_US = 2**64 - 1


@dataclass(frozen=True)
class BatchPolicy:
    """Batching settings for one model (``[serving]`` in the configuration)."""

    max_batch_size: int = 32
    max_queue_delay_us: int = 5000
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 256  # 0 = unlimited
    default_timeout_us: int = 0  # 0 = none
    priority_levels: int = 2
    default_priority_level: int = 2
    # Triton waits out the delay whenever a batch is not full. With adaptive_delay an idle
    # instance takes a partial batch at once when, at the recent arrival rate, fewer than one
    # more request is expected before the delay ends, or when recent arrivals (nearly) all found
    # nothing else queued or running (one client sending its next request after each answer):
    # waiting would only add latency.
    adaptive_delay: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError("must be >= 1", key="serving.max_batch_size", found=self.max_batch_size)
        if self.max_queue_delay_us < 0:
            raise ConfigError("must be >= 0", key="serving.max_queue_delay_us",
                              found=self.max_queue_delay_us)
        bad = [size for size in self.preferred_batch_sizes if not 1 <= size <= self.max_batch_size]
        if bad:
            raise ConfigError("preferred batch sizes must be within 1..max_batch_size",
                              key="serving.preferred_batch_sizes", found=bad)
        if not 1 <= self.default_priority_level <= self.priority_levels:
            raise ConfigError("must be within 1..priority_levels",
                              key="serving.default_priority_level",
                              found=self.default_priority_level)


@dataclass(frozen=True)
class InferenceResult:
    """One request's outputs (owned arrays) and where its time went."""

    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_size: int
    compute_input_s: float = 0.0  # its batch's staging copy
    compute_output_s: float = 0.0  # cutting the batch's outputs into per-request arrays
    version: int | None = None  # the model version that computed it (a swap may be under way)


@dataclass(frozen=True)
class LoadSnapshot:
    """What the power governor watches."""

    queue_depth: int
    busy_instances: int  # instances running a batch (or with one staged next to run)
    instances: int
    arrivals_total: int
    completed_total: int  # requests answered, whatever the outcome: arrivals minus this is load
    batches_total: int
    mean_batch_compute_s: float  # recent (exponentially weighted)
