"""Lightweight agents: many per process, each the real device side minus the serving path.

One :class:`LightAgent` is what a board runs, less the HTTP API and the batcher:

- the real MQTT link (agent/fleet/mqtt.py: its own paho thread, TLS, the device's password),
- the real control plane (agent/fleet/device.py) and updater (agent/update/updater.py, its
  journal),
- a real model store (agent/store/) in the agent's own state directory,
- :class:`LightSteps`: the updater's steps, doing what agent/update/steps.py does wherever that
  needs no traffic: the bundle is downloaded over HTTP (agent/update/download.py, resumable,
  checked against the desired sha256), its signature and every hash verified (``open_bundle``),
  anti-rollback checked (unless the desired document allows a downgrade), installed into the
  store, loaded in ONNX Runtime (one single-threaded session) and warmed up; the canary runs a
  fixed probe batch through the old and the new session and refuses non-finite outputs or
  decisions that disagree (a daemon's canary shadows live traffic instead: these agents serve
  none); the commit is the store's pointer switch.

What is left out, and why it is fair for a fleet benchmark: no inference traffic (the fleet side
never sees it), no engine build (ONNX Runtime has none), and the watch window is the updater's
own wait. Everything the fleet side waits for (the download, the verification, the loading,
the journal, the reports) is real.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import __version__
from agent.backends.base import Backend, BackendOptions, ModelArtifacts
from agent.errors import BundleError, SignatureError, StoreError, UpdateError
from agent.fleet.device import FleetDevice
from agent.fleet.mqtt import BrokerOptions
from agent.fsutil import sha256_file
from agent.store import ModelStore
from agent.update.download import DownloadPolicy, discard_partial, download
from agent.update.journal import BundleId
from agent.update.states import UpdatePolicy
from agent.update.updater import Updater, UpdateJob, Verdict
from models.bundle import open_bundle

__all__ = ["LightAgent", "LightSteps"]

log = logging.getLogger(__name__)

PROBE_SAMPLES = 8
MIN_AGREEMENT = 0.9  # as the daemon's canary_min_agreement


def _probe(backend: Backend, artifacts: ModelArtifacts) -> dict[str, np.ndarray]:
    """A fixed batch (negative values included) through ``backend``."""
    from agent import runtime

    shapes = runtime.warmup_shape(artifacts, backend) or {}
    rng = np.random.default_rng(0)
    inputs = {info.name: rng.normal(size=(PROBE_SAMPLES, *shapes[info.name])).astype(info.dtype)
              for info in backend.inputs}
    return backend.infer(inputs)


class LightSteps:
    """:class:`~agent.update.updater.UpdateSteps` without a serving path (module docstring).

    Args:
        store: The agent's model store (open).
        downloads_dir: Where bundles are downloaded to.
        executor: Where the blocking work runs (shared by every agent of the process).
    """

    def __init__(self, store: ModelStore, downloads_dir: Path, *,
                 trusted_keys: Sequence[Ed25519PublicKey], executor: Executor | None,
                 download_policy: DownloadPolicy | None = None) -> None:
        self.store = store
        self.trusted_keys = tuple(trusted_keys)
        self.downloads_dir = downloads_dir
        self.executor = executor
        self.download_policy = download_policy or DownloadPolicy()
        self.serving_backend: Backend | None = None
        self._candidate: tuple[str, ModelArtifacts, Backend] | None = None
        self.attempted: list[str] = []  # the sha256 of every bundle an update downloaded

    async def _run(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)

    async def load_serving(self) -> None:
        """Load the current version, as a daemon does at start."""
        current = await self._run(self.store.current)
        if current is not None:
            artifacts = await self._run(self.store.load, current.name, current.version)
            self.serving_backend = await self._run(self._activate, artifacts)

    @staticmethod
    def _activate(artifacts: ModelArtifacts) -> Backend:
        from agent.backends.onnxruntime import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(artifacts, BackendOptions(max_batch_size=PROBE_SAMPLES,
                                                               threads=1, buffer_sets=1))
        backend.activate()
        return backend

    def _path(self, job: UpdateJob) -> Path:
        return self.downloads_dir / f"{job.update_id}.bundle"

    async def serving(self) -> BundleId | None:
        backend = self.serving_backend
        if backend is None:
            return None
        return BundleId(name=backend.artifacts.name, version=backend.artifacts.version)

    async def download(self, job: UpdateJob) -> None:
        self.downloads_dir.mkdir(parents=True, exist_ok=True)
        result = await download(job.source, self._path(job), policy=self.download_policy,
                                expected_sha256=job.expected.sha256)
        self.attempted.append(result.sha256)
        job.notes["sha256"] = result.sha256

    async def verify(self, job: UpdateJob) -> BundleId:
        path = self._path(job)
        keys = self.trusted_keys
        try:
            bundle = await self._run(lambda: open_bundle(path, keys, agent_version=__version__))
        except SignatureError as exc:
            raise UpdateError(f"the bundle's signature is not trusted: {exc.message}",
                              reason="bad_signature") from exc
        except BundleError as exc:
            raise UpdateError(f"the bundle is refused: {exc.message}", reason="bad_bundle") from exc
        name, version = bundle.manifest["name"], bundle.manifest["version"]
        serving = await self.serving()
        if serving is not None and name != serving.name:
            raise UpdateError("the bundle is of another model", reason="wrong_model")
        if (serving is not None and serving.version is not None and version < serving.version
                and not job.allow_downgrade):
            raise UpdateError("the bundle is older than the version serving", reason="downgrade")
        sha256 = job.notes.get("sha256") or (await self._run(sha256_file, path))[0]
        return BundleId(name=name, version=version, sha256=sha256)

    async def stage(self, job: UpdateJob) -> None:
        path = self._path(job)
        try:
            artifacts = await self._run(self.store.install, path)
        except (StoreError, BundleError) as exc:
            raise UpdateError(f"the bundle could not be installed: {exc.message}",
                              reason="install_failed") from exc
        job.notes["artifacts"] = artifacts
        await self._run(lambda: path.unlink(missing_ok=True))

    async def build_engine(self, job: UpdateJob) -> None:
        artifacts = job.notes.get("artifacts")
        if artifacts is None:
            bundle = job.bundle
            if bundle is None or bundle.name is None or bundle.version is None:
                raise UpdateError("the update has no verified bundle", reason="not_verified")
            artifacts = await self._run(self.store.load, bundle.name, bundle.version)
        await self.close()
        backend = await self._run(self._activate, artifacts)
        self._candidate = (job.update_id, artifacts, backend)

    def _require_candidate(self, job: UpdateJob) -> tuple[ModelArtifacts, Backend]:
        candidate = self._candidate
        if candidate is None or candidate[0] != job.update_id:
            raise UpdateError("the candidate is not loaded", reason="not_loaded")
        return candidate[1], candidate[2]

    async def warm(self, job: UpdateJob) -> None:
        artifacts, backend = self._require_candidate(job)
        outputs = await self._run(_probe_zeros, backend, artifacts)
        if any(value.dtype.kind == "f" and not np.isfinite(value).all()
               for value in outputs.values()):
            raise UpdateError("NaN or Inf on the warm-up batch", reason="non_finite")

    async def canary(self, job: UpdateJob) -> Verdict:
        artifacts, backend = self._require_candidate(job)
        new = await self._run(_probe, backend, artifacts)
        if any(value.dtype.kind == "f" and not np.isfinite(value).all()
               for value in new.values()):
            return Verdict(healthy=False, reason="nan_output",
                           detail="NaN or Inf on the probe batch")
        old_backend = self.serving_backend
        if old_backend is None:
            return Verdict(healthy=True, detail="nothing served before")
        old = await self._run(_probe, old_backend, old_backend.artifacts)
        agreement = min(float(np.mean(np.argmax(new[name], axis=-1)
                                      == np.argmax(old[name], axis=-1)))
                        for name in new if name in old)
        if agreement < MIN_AGREEMENT:
            return Verdict(healthy=False, reason="disagreement",
                           detail=f"{agreement:.0%} of the probe samples agree")
        return Verdict(healthy=True, detail=f"{agreement:.0%} agreement on the probe batch")

    async def commit(self, job: UpdateJob) -> None:
        artifacts, backend = self._require_candidate(job)
        await self._run(self.store.activate, artifacts.name, artifacts.version)
        old, self.serving_backend = self.serving_backend, backend
        self._candidate = None
        if old is not None:
            await self._run(old.deactivate)
        await self._run(self._collect_garbage)

    def _collect_garbage(self) -> None:
        try:
            self.store.garbage_collect()
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    async def watch(self, job: UpdateJob) -> Verdict:
        await asyncio.Event().wait()  # the watch window passing is the updater's deadline
        raise AssertionError("unreachable")

    async def discard(self, job: UpdateJob) -> None:
        await self.close()
        path = self._path(job)

        def remove() -> None:
            discard_partial(path)
            path.unlink(missing_ok=True)
            self._collect_garbage()

        await self._run(remove)

    async def revert(self, job: UpdateJob) -> None:
        await self.discard(job)
        bundle = job.bundle
        serving = await self.serving()
        if bundle is None or serving is None or serving.version != bundle.version:
            current = await self._run(self.store.current)
            if bundle is not None and current is not None and current.version == bundle.version:
                await self._run(self.store.rollback)
            return
        previous = await self._run(self.store.previous)
        if previous is None:
            raise UpdateError("there is no previous version to return to",
                              reason="nothing_to_roll_back")
        artifacts = await self._run(self.store.load, previous.name, previous.version)
        backend = await self._run(self._activate, artifacts)
        old, self.serving_backend = self.serving_backend, backend
        await self._run(self.store.rollback)
        if old is not None:
            await self._run(old.deactivate)

    async def close(self) -> None:
        """Free the candidate's session."""
        candidate, self._candidate = self._candidate, None
        if candidate is not None:
            await self._run(candidate[2].deactivate)

    async def shutdown(self) -> None:
        await self.close()
        backend, self.serving_backend = self.serving_backend, None
        if backend is not None:
            await self._run(backend.deactivate)


def _probe_zeros(backend: Backend, artifacts: ModelArtifacts) -> dict[str, np.ndarray]:
    from agent import runtime

    shapes = runtime.warmup_shape(artifacts, backend) or {}
    return backend.infer({info.name: np.zeros((1, *shapes[info.name]), dtype=info.dtype)
                          for info in backend.inputs})


class LightAgent:
    """One lightweight agent in ``root`` (its state directory).

    Args:
        root: The agent's state directory (store, journal, fleet files).
        fleet: The fleet id.
        device: The device id (MQTT client id and user name).
        options: Its broker options (TLS, its password).
        fleet_keys: The fleet's public keys.
        bundle_keys: The keys bundles are signed with.
        policy: The updater's deadlines and watch window.
        executor: Where the blocking work runs.
    """

    def __init__(self, root: Path, *, fleet: str, device: str, options: BrokerOptions,
                 fleet_keys: Sequence[Ed25519PublicKey], bundle_keys: Sequence[Ed25519PublicKey],
                 policy: UpdatePolicy, executor: Executor | None = None) -> None:
        self.root = root
        self.device = device
        self.store = ModelStore(root, trusted_keys=tuple(bundle_keys))
        self.steps = LightSteps(self.store, root / "downloads", trusted_keys=bundle_keys,
                                executor=executor)
        self.updater = Updater(state_dir=root, steps=self.steps, policy=policy)
        self.plane = FleetDevice(fleet=fleet, device=device, updater=self.updater,
                                 state_dir=root, keys=fleet_keys, options=options,
                                 fingerprint={"device_class": "bench-light",
                                              "agent": "agent/tooling/fleetbench"},
                                 health=lambda: {"light": True})
        self._executor = executor

    def install(self, bundle: Path) -> None:
        """Install and activate the first version (blocking: before the start)."""
        self.store.open()
        artifacts = self.store.install(bundle)
        self.store.activate(artifacts.name, artifacts.version)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.store.open)
        await self.steps.load_serving()
        await self.updater.recover()
        await self.plane.start()

    async def stop(self) -> None:
        await self.plane.close()
        await self.updater.close()
        await self.steps.shutdown()
        await asyncio.get_running_loop().run_in_executor(self._executor, self.store.close)

    @property
    def serving_version(self) -> int | None:
        backend = self.steps.serving_backend
        return None if backend is None else backend.artifacts.version
