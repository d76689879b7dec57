"""A model version's execution instances: created from the configuration, capped by what the
bundle was built for, activated and warmed up.

``start_backends`` is the slow part of every start and of every swap to a new version (on a board
a TensorRT engine may be built first, for minutes), so it takes a ``stop_requested`` check that
ends it early between instances, between warm-up batches and, in the TensorRT backend, between
engine build steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from agent.backends import (
    BackendOptions,
    ModelArtifacts,
    backend_class,
    resolve_backend_name,
)
from agent.backends.base import Backend, frame_shape
from agent.batcher import BatchPolicy
from agent.config import AgentConfig
from agent.errors import StopRequested

log = logging.getLogger(__name__)

DEFAULT_WARMUP_SIZE = 224


def batch_policy(config: AgentConfig, artifacts: ModelArtifacts) -> BatchPolicy:
    """The batcher's settings: the configuration, capped by what the bundle was built for."""
    serving = config.serving
    max_batch = min(serving.max_batch_size, artifacts.max_batch)
    if artifacts.fixed_batch is not None:
        log.info("%s v%d runs at batch %d only (its graph bakes the batch in): smaller batches "
                 "are padded to it, and no more than %d request rows run together",
                 artifacts.name, artifacts.version, artifacts.fixed_batch, max_batch)
    for name, axis in artifacts.output_batch_axes.items():
        log.info("%s v%d: output %r carries the batch on axis %d; batches are cut into requests "
                 "on that axis", artifacts.name, artifacts.version, name, axis)
    preferred = tuple(size for size in serving.preferred_batch_sizes if size <= max_batch)
    dropped = [size for size in serving.preferred_batch_sizes if size > max_batch]
    if dropped:
        log.warning("serving.preferred_batch_sizes %s exceed the largest batch %d (the bundle's "
                    "max_batch %d, serving.max_batch_size %d): not used", dropped, max_batch,
                    artifacts.max_batch, serving.max_batch_size)
    if not preferred and 1 < artifacts.opt_batch < max_batch:
        preferred = (artifacts.opt_batch,)
    return BatchPolicy(
        max_batch_size=max_batch,
        max_queue_delay_us=serving.max_queue_delay_us,
        preferred_batch_sizes=preferred,
        max_queue_size=serving.max_queue_size,
        default_timeout_us=serving.default_timeout_us,
        priority_levels=serving.priority_levels,
        default_priority_level=serving.resolved_default_priority_level,
        adaptive_delay=serving.adaptive_delay,
    )


def backend_options(config: AgentConfig, max_batch: int,
                    stop_requested: Callable[[], bool] | None = None) -> BackendOptions:
    """What every instance of the configured backend is created with."""
    serving, trt = config.serving, config.tensorrt
    return BackendOptions(
        max_batch_size=max_batch,
        stop_requested=stop_requested,
        threads=serving.threads_per_instance(os.cpu_count() or 1),
        extra={
            # TensorRT engine builds (the names of EngineBuildConfig's fields).
            "workspace_bytes": trt.workspace_mib << 20,
            "dla_core": None if trt.dla_core < 0 else trt.dla_core,
            "optimization_level": trt.optimization_level,
            "fp16": trt.fp16,
            # ONNX Runtime.
            "allow_spinning": serving.cpu_spin,
        },
    )


def warmup_shape(artifacts: ModelArtifacts, backend: Backend) -> dict[str, tuple[int, ...]] | None:
    """Per-sample input shapes for warm-up: fixed axes as they are, dynamic height and width at
    the engine profile's optimum (the deployment frame size)."""
    profile = artifacts.manifest.get("engine_profile") or {}
    height, width = (int(profile.get(axis, [0, DEFAULT_WARMUP_SIZE])[1])
                     for axis in ("height", "width"))
    shapes: dict[str, tuple[int, ...]] = {}
    for info in backend.inputs:
        shape = frame_shape(info.sample_shape, height, width)
        if shape is None:
            return None
        shapes[info.name] = shape
    return shapes


def warm_up(backend: Backend, artifacts: ModelArtifacts, batches: int, batch_size: int,
            stop_requested: Callable[[], bool] | None = None) -> float:
    """Run a few batches of zeros so the first real request does not pay for lazy setup; a stop
    request ends it between batches (``StopRequested``)."""
    shapes = warmup_shape(artifacts, backend)
    if shapes is None or batches <= 0:
        return 0.0
    started = time.perf_counter()
    inputs = {info.name: np.zeros((batch_size, *shapes[info.name]), dtype=info.dtype)
              for info in backend.inputs}
    for done in range(batches):
        if stop_requested is not None and stop_requested():
            raise StopRequested("stopped while warming up", model=artifacts.name,
                                batches_done=done)
        backend.infer(inputs)
    return time.perf_counter() - started


def start_backends(config: AgentConfig, artifacts: ModelArtifacts, policy: BatchPolicy,
                   stop_requested: Callable[[], bool] | None = None) -> list[Backend]:
    """Create, activate and warm up ``serving.instances`` backends; on any failure free the ones
    already made and re-raise. ``stop_requested`` ends the start early (``StopRequested``):
    checked before each instance and, by the TensorRT backend, during an engine build."""
    name = resolve_backend_name(config.serving.backend)
    cls = backend_class(name)
    options = backend_options(config, policy.max_batch_size, stop_requested)
    backends: list[Backend] = []
    try:
        for _ in range(config.serving.instances):
            if stop_requested is not None and stop_requested():
                raise StopRequested("stopped while starting the model's instances",
                                    model=artifacts.name, started=len(backends))
            backend = cls(artifacts, options)
            backends.append(backend)
            backend.activate()
            seconds = warm_up(backend, artifacts, config.serving.warmup_batches,
                              policy.preferred_batch_sizes[-1] if policy.preferred_batch_sizes
                              else 1, stop_requested)
            log.info("instance %d of %s v%d ready (%s, warm-up %.2f s)", len(backends),
                     artifacts.name, artifacts.version, name, seconds)
    except BaseException:
        for backend in backends:
            backend.deactivate()
        raise
    return backends
