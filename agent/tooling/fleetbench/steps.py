"""The update steps of one benchmark agent: :class:`~agent.update.updater.UpdateSteps` for a
device that loads its model but serves no traffic.

What each state does here, against agent/update/steps.py's :class:`DaemonSteps`:

=================  ==============================================================================
state              work
=================  ==============================================================================
downloading        the same: agent/update/download.py fetches the URL (the fleet's file server)
                   into ``<state_dir>/downloads``, resumable, checked against the sha256
verifying          the same: ``open_bundle`` with the trusted keys and the agent version
                   (signature, every hash, compatibility), then the model's name, anti-rollback
                   (unless ``allow_downgrade``), the target and the inputs and outputs against
                   the serving version
staged             the same: installed into the agent's own store (agent/store), the download
                   removed
building-engine    the installed version loaded back from the store (verified again, as the
                   daemon's store load does) and one ONNX Runtime session made of it (1 intra-op
                   thread, no spinning)
warming            the same warm-up (``serving.warmup_batches`` batches of zeros) and the same
                   refusal of a NaN or Inf on the warm-up batch (reason ``non_finite``)
canary             **skipped**: a healthy verdict at once. The shadow canary compares the new
                   version with the serving one on live traffic, and there is none here
committed          the store's pointer switched, the new session kept as the serving one, the old
                   one freed, old versions collected
watch              **skipped**: a healthy verdict at once (the watch window also needs traffic)
rolling-back       the same: the candidate freed and its files removed; after a commit, the
                   previous version loaded from the store, warmed up and made current again
=================  ==============================================================================

There is no HTTP inference server, no batcher and no hot swap under load: the serving version
is one session held here. The blocking work (hashing, checks, installs, session loads, warm-up)
runs on a thread pool the process's agents share (``pool``) rather than on a thread of low
priority per agent, as a daemon has: hundreds of agents share two cores here, and what is
measured is the fleet's control path, not one board's CPU scheduling.

:attr:`record` keeps what this agent did (the versions it verified, committed and refused), the
benchmark's ground truth besides what the agent reports over MQTT.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import types
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent import runtime
from agent.backends.base import Backend, BackendOptions, ModelArtifacts
from agent.errors import BundleError, StoreError, UpdateError
from agent.store import ModelStore
from agent.update.download import DownloadPolicy, discard_partial
from agent.update.journal import BundleId
from agent.update.steps import (
    DOWNLOADS_DIR,
    _facts,
    check_bundle,
    downloaded_bundle,
    fetch_bundle,
)
from agent.update.updater import UpdateJob, Verdict

__all__ = ["AgentRecord", "BenchSteps", "load_version", "warm_up"]

log = logging.getLogger(__name__)

WARMUP_BATCHES = 2  # serving.warmup_batches' default
SKIPPED = "skipped: the fleet benchmark has no live traffic"


@dataclass
class AgentRecord:
    """What one agent's updates did, for the benchmark's figures."""

    verified: list[int] = field(default_factory=list)  # versions that passed verification
    committed: list[int] = field(default_factory=list)  # versions made current
    refused: list[tuple[int, str]] = field(default_factory=list)  # (version, reason) at warm-up
    reverted: list[int] = field(default_factory=list)  # versions reverted after a commit

    def to_json(self) -> dict[str, Any]:
        return {"verified": self.verified, "committed": self.committed,
                "refused": [list(item) for item in self.refused], "reverted": self.reverted}


@dataclass
class _Loaded:
    update_id: str
    artifacts: ModelArtifacts
    backend: Backend

    @property
    def version(self) -> int:
        return self.artifacts.version


def _backend(artifacts: ModelArtifacts) -> Backend:
    from agent.backends.onnxruntime import OnnxRuntimeBackend

    # One buffer set: nothing but the warm-up ever runs on it.
    options = BackendOptions(max_batch_size=artifacts.max_batch, threads=1, buffer_sets=1,
                             extra={"allow_spinning": False})
    return OnnxRuntimeBackend(artifacts, options)


def _warm_batch(artifacts: ModelArtifacts) -> int:
    """The batch the daemon's policy would warm up with: the bundle's ``opt_batch`` when it is
    between 1 and ``max_batch`` (agent/runtime.py's batch_policy without a configuration)."""
    return artifacts.opt_batch if 1 < artifacts.opt_batch < artifacts.max_batch else 1


def warm_up(backend: Backend, artifacts: ModelArtifacts) -> None:
    """The daemon's warm-up (agent/update/steps.py's ``warming``): ``WARMUP_BATCHES`` batches of
    zeros, then one more whose outputs must all be finite (blocking: for a worker thread).

    Raises:
        UpdateError: (``non_finite``) a NaN or Inf on the warm-up batch.
    """
    batch = _warm_batch(artifacts)
    runtime.warm_up(backend, artifacts, WARMUP_BATCHES, batch)
    shapes = runtime.warmup_shape(artifacts, backend)
    if shapes is None:
        return
    inputs = {info.name: np.zeros((batch, *shapes[info.name]), dtype=info.dtype)
              for info in backend.inputs}
    bad = [name for name, value in backend.infer(inputs).items()
           if value.dtype.kind == "f" and not np.isfinite(value).all()]
    if bad:
        raise UpdateError("the new version gives NaN or Inf on its warm-up batch",
                          reason="non_finite", outputs=", ".join(bad))


def load_version(artifacts: ModelArtifacts) -> Backend:
    """An ONNX Runtime session of an installed version, warmed up (:func:`warm_up`; blocking)."""
    backend = _backend(artifacts)
    backend.activate()
    try:
        warm_up(backend, artifacts)
    except BaseException:
        backend.deactivate()
        raise
    return backend


class BenchSteps:
    """The steps of one agent (module docstring).

    Args:
        store: The agent's model store (open).
        state_dir: The agent's state directory (downloads go under it).
        keys: The trusted bundle keys.
        pool: Where the blocking work runs (shared by the process's agents).
        device_class: The target the bundles are checked against (empty: none).
        download_policy: The download's bounds.
    """

    def __init__(self, *, store: ModelStore, state_dir: Path, keys: list[Ed25519PublicKey],
                 pool: Executor, device_class: str = "",
                 download_policy: DownloadPolicy | None = None) -> None:
        self.store = store
        self.keys = list(keys)
        self.pool = pool
        self.device_class = device_class
        self.download_policy = download_policy or DownloadPolicy()
        self.downloads_dir = state_dir / DOWNLOADS_DIR
        self.record = AgentRecord()
        self._serving: _Loaded | None = None
        self._candidate: _Loaded | None = None

    # -- what serves --------------------------------------------------------------------------

    def start_serving(self, artifacts: ModelArtifacts, backend: Backend) -> None:
        """The version the agent starts with (installed and current, its session loaded)."""
        self._serving = _Loaded("initial", artifacts, backend)

    async def serving(self) -> BundleId | None:
        loaded = self._serving
        if loaded is None:
            return None
        return BundleId(name=loaded.artifacts.name, version=loaded.version)

    def _require_serving(self) -> _Loaded:
        if self._serving is None:
            raise UpdateError("the agent serves no model yet", reason="not_serving")
        return self._serving

    async def _in_pool(self, work: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)

    # -- download and verification --------------------------------------------------------------

    def _destination(self, source: str) -> Path:
        digest = hashlib.sha256(source.encode()).hexdigest()[:24]
        return self.downloads_dir / f"{digest}.bundle"

    async def download(self, job: UpdateJob) -> None:
        await self._in_pool(lambda: self.downloads_dir.mkdir(parents=True, exist_ok=True))
        await fetch_bundle(job, self._destination(job.source), self.download_policy)

    async def verify(self, job: UpdateJob) -> BundleId:
        path = downloaded_bundle(job, self._destination(job.source))
        serving = self._require_serving()
        # What check_bundle reads of a ModelService: the name and version serving, and the
        # serving session's inputs and outputs.
        described = types.SimpleNamespace(
            name=serving.artifacts.name, version=serving.version,
            inputs=serving.backend.inputs, outputs=serving.backend.outputs)
        verified: BundleId = await self._in_pool(lambda: check_bundle(
            path, self.keys, serving=described, device_class=self.device_class,
            allow_downgrade=job.allow_downgrade, sha256=job.notes.get("sha256")))
        if verified.version is not None:  # check_bundle always says it
            self.record.verified.append(verified.version)
        return verified

    # -- staging and loading ----------------------------------------------------------------------

    async def stage(self, job: UpdateJob) -> None:
        path = Path(job.notes.get("bundle_path") or self._destination(job.source))
        try:
            artifacts = await self._in_pool(self.store.install, path)
        except (StoreError, BundleError) as exc:
            raise UpdateError(f"the bundle could not be installed: {exc.message}",
                              reason="install_failed", **_facts(exc)) from exc
        job.notes["artifacts"] = artifacts
        await self._in_pool(lambda: path.unlink(missing_ok=True))

    async def build_engine(self, job: UpdateJob) -> None:
        bundle = job.bundle
        if bundle is None or bundle.name is None or bundle.version is None:
            raise UpdateError("the update has no verified bundle", reason="not_verified")
        await self.close()
        # Loaded back from the store, verified again, as a daemon loads a version.
        artifacts = await self._in_pool(self.store.load, bundle.name, bundle.version)
        backend = _backend(artifacts)
        self._candidate = _Loaded(job.update_id, artifacts, backend)
        await self._in_pool(backend.activate)
        job.progress(instances=1)

    async def warm(self, job: UpdateJob) -> None:
        candidate = self._require_candidate(job)
        try:
            await self._in_pool(warm_up, candidate.backend, candidate.artifacts)
        except UpdateError as exc:
            self.record.refused.append((candidate.version, exc.reason))
            raise

    # -- canary, commit, watch ----------------------------------------------------------------

    async def canary(self, job: UpdateJob) -> Verdict:
        self._require_candidate(job)
        return Verdict(healthy=True, detail=SKIPPED)

    async def commit(self, job: UpdateJob) -> None:
        candidate = self._require_candidate(job)
        await self._in_pool(self.store.activate, candidate.artifacts.name, candidate.version)
        old, self._serving, self._candidate = self._serving, candidate, None
        self.record.committed.append(candidate.version)
        if old is not None:
            await self._in_pool(old.backend.deactivate)
        try:
            await self._in_pool(self.store.garbage_collect)
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    async def watch(self, job: UpdateJob) -> Verdict:
        return Verdict(healthy=True, detail=SKIPPED)

    # -- undoing --------------------------------------------------------------------------------

    async def discard(self, job: UpdateJob) -> None:
        await self.close()
        destination = self._destination(job.source) if job.source else None
        await self._in_pool(self._remove_files, destination)

    def _remove_files(self, destination: Path | None) -> None:
        if destination is not None:
            discard_partial(destination)
            destination.unlink(missing_ok=True)
        try:
            self.store.garbage_collect()
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    async def previous(self) -> BundleId | None:
        found = await self._in_pool(self.store.previous)
        return None if found is None else BundleId(name=found.name, version=found.version)

    async def revert(self, job: UpdateJob) -> None:
        await self.discard(job)
        bundle = job.bundle
        if bundle is None or bundle.version is None:
            raise UpdateError("the update has no verified bundle", reason="not_verified")
        serving = self._require_serving()
        if serving.version != bundle.version:
            current = await self._in_pool(self.store.current)
            if current is not None and current.version == bundle.version:
                await self._in_pool(self.store.rollback)
            return
        previous = await self._in_pool(self.store.previous)
        if previous is None:
            raise UpdateError("there is no previous version to return to",
                              reason="nothing_to_roll_back", serving=str(bundle))
        artifacts = await self._in_pool(self.store.load, previous.name, previous.version)
        backend = await self._in_pool(load_version, artifacts)
        old, self._serving = self._serving, _Loaded(job.update_id, artifacts, backend)
        self.record.reverted.append(bundle.version)
        await self._in_pool(self.store.rollback)
        if old is not None:
            await self._in_pool(old.backend.deactivate)

    # -- helpers --------------------------------------------------------------------------------

    def _require_candidate(self, job: UpdateJob) -> _Loaded:
        candidate = self._candidate
        if candidate is None or candidate.update_id != job.update_id:
            raise UpdateError("the new version's session is not loaded (the agent restarted "
                              "since?)", reason="not_loaded")
        return candidate

    async def close(self) -> None:
        """Free the candidate's session (a discarded update, an agent stopping)."""
        candidate, self._candidate = self._candidate, None
        if candidate is not None:
            await self._in_pool(candidate.backend.deactivate)

    async def shutdown(self) -> None:
        """Free every session (the agent stops)."""
        await self.close()
        serving, self._serving = self._serving, None
        if serving is not None:
            await self._in_pool(serving.backend.deactivate)
