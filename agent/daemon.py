"""The on-device daemon: configuration -> model store -> backend instances -> batcher -> HTTP.

``Daemon.start()`` brings up the current model from the store and the HTTP API; ``stop()`` drains
in-flight requests, closes the listener and frees every backend. ``run_daemon`` runs it in the
foreground until SIGTERM or SIGINT (systemd's stop, or Ctrl-C). The MQTT control channel, the
updater and the power governor of later issues attach here: they get the store, the batcher's
``load()`` signals and ``Batcher.replace_backends`` for the blue-green swap.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.api.server import InferenceServer
from agent.backends import (
    BackendOptions,
    ModelArtifacts,
    backend_class,
    resolve_backend_name,
)
from agent.backends.base import Backend, frame_shape
from agent.batcher import BatchPolicy
from agent.config import AgentConfig
from agent.errors import AgentError, StopRequested, StoreError
from agent.metrics import ServingMetrics
from agent.serving import ModelService
from agent.store import ModelStore

log = logging.getLogger(__name__)

DEFAULT_WARMUP_SIZE = 224


def batch_policy(config: AgentConfig, artifacts: ModelArtifacts) -> BatchPolicy:
    """The batcher's settings: the configuration, capped by what the bundle was built for."""
    serving = config.serving
    max_batch = min(serving.max_batch_size, artifacts.max_batch)
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


@dataclass
class Daemon:
    """Everything the foreground daemon runs."""

    config: AgentConfig
    shm_root: Path = Path("/dev/shm")

    def __post_init__(self) -> None:
        self.store = ModelStore(self.config.state_dir, trusted_keys=self.config.trust.keys,
                                keep_versions=self.config.store.keep_versions).open()
        self.services: dict[str, ModelService] = {}
        self.server: InferenceServer | None = None
        self._stop_requested = threading.Event()

    def request_stop(self) -> None:
        """Ask work in progress to end early: a start that is still building or loading the
        model's instances raises ``StopRequested`` instead of finishing (thread-safe)."""
        self._stop_requested.set()

    def install(self, bundle: Path) -> ModelArtifacts:
        """Verify and install a bundle (``serve --bundle``); :meth:`start` given the result makes
        it current once it serves. Versions beyond ``store.keep_versions`` are deleted first, to
        make room."""
        self._collect_garbage()
        return self.store.install(bundle)

    def make_current(self, artifacts: ModelArtifacts) -> None:
        """Activate an installed version, then delete versions beyond ``store.keep_versions``."""
        self.store.activate(artifacts.name, artifacts.version)
        log.info("%s v%d is current", artifacts.name, artifacts.version)
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        try:
            self.store.garbage_collect()
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    def close(self) -> None:
        """Let go of the state directory."""
        self.store.close()

    async def start(self, candidate: ModelArtifacts | None = None) -> int:
        """Load the current model, or ``candidate`` (an installed version), and start the HTTP
        API; returns the port. A candidate becomes current only once its model has loaded: one
        that does not load (a broken ONNX, a backend this device lacks) leaves current as it
        was."""
        current = candidate or self.store.current()
        if current is None:
            installed = {name: self.store.versions(name) for name in self.store.names()}
            if any(installed.values()):
                raise StoreError("no current model: 'edge-agent serve --bundle B --pubkey PUB' "
                                 "installs and activates one", state_dir=self.config.state_dir,
                                 installed=", ".join(f"{name} v{versions}" for name, versions
                                                     in installed.items() if versions))
            raise StoreError("no model installed: install a bundle with "
                             "'edge-agent serve --bundle B --pubkey PUB'",
                             state_dir=self.config.state_dir)
        # Re-verify signature and hashes: the disk may have changed since install (power loss).
        artifacts = self.store.load(current.name, current.version)
        policy = batch_policy(self.config, artifacts)
        loop = asyncio.get_running_loop()
        backends = await loop.run_in_executor(None, start_backends, self.config, artifacts, policy,
                                              self._stop_requested.is_set)
        metrics = ServingMetrics(artifacts.name)
        service = ModelService(artifacts.name, artifacts.version, backends, policy,
                               metrics=metrics)
        self.services[artifacts.name] = service
        http = self.config.http
        self.server = InferenceServer(
            self.services, host=http.host, port=http.port,
            token=http.token.reveal() if http.token is not None else None,
            max_body_bytes=http.max_body_bytes, metrics_render=metrics.render,
            shm_root=self.shm_root, access_log=http.access_log)
        service.start()
        try:
            if self._stop_requested.is_set():  # asked to stop while the instances started
                raise StopRequested("stopped before serving", model=artifacts.name)
            if candidate is not None:  # its model loaded: it is the one to serve from now on
                self.make_current(artifacts)
            return await self.server.start()
        except BaseException:
            await service.stop(drain=False)
            self._free()
            raise

    async def stop(self, *, timeout_s: float = 30.0) -> None:
        if self.server is not None:
            await self.server.stop(drain=True, timeout_s=timeout_s)
            self.server = None
        self._free()
        self.close()

    def _free(self) -> None:
        for service in self.services.values():
            for backend in service.backends:
                backend.deactivate()
        self.services.clear()


def _ignore_sighup(*_: object) -> None:
    log.warning("SIGHUP ignored: the daemon does not reload its configuration; restart it instead")


def check_can_listen(host: str, port: int) -> None:
    """Raise the error the HTTP server would raise if ``host:port`` cannot be listened on now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        raise AgentError("cannot listen for HTTP", host=host, port=port,
                         reason=exc.strerror or str(exc)) from None


def run_daemon(config: AgentConfig, *, bundle: Path | None = None,
               on_ready: Callable[[int], Any] | None = None) -> int:
    """Run in the foreground until SIGTERM/SIGINT; returns the exit status."""
    # A busy port would only be found once the model has loaded (minutes, when a TensorRT
    # engine is built first): look now.
    check_can_listen(config.http.host, config.http.port)
    # SIGHUP (a closed terminal, or an operator expecting a reload) would kill the daemon
    # outright, even mid-install: there is nothing to reload, so it is ignored throughout.
    signal.signal(signal.SIGHUP, _ignore_sighup)
    daemon = Daemon(config)
    candidate = None
    if bundle is not None:
        candidate = daemon.install(bundle)
        log.info("installed %s v%d from %s", candidate.name, candidate.version, bundle)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            stop.set()
            daemon.request_stop()  # a start still under way (an engine build) ends early

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal)
        loop.add_signal_handler(signal.SIGHUP, _ignore_sighup)
        try:
            port = await daemon.start(candidate)
        except StopRequested as exc:
            log.info("stopped while starting: %s", exc)
            daemon.close()
            return
        except AgentError:
            current = daemon.store.current()
            if candidate is not None and (current is None or (current.name, current.version)
                                          != (candidate.name, candidate.version)):
                log.error("%s v%d is installed but was not made current, since its start "
                          "failed; current is still %s", candidate.name, candidate.version,
                          f"{current.name} v{current.version}" if current else "none")
            raise
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        log.info("stopping: draining in-flight requests")
        await daemon.stop()

    asyncio.run(main())
    return 0
