"""The updater's steps on a running daemon: what each state of an update does (agent/update/
updater.py drives them, journals them and bounds each by its deadline).

=================  ==============================================================================
state              work
=================  ==============================================================================
downloading        the source (a path, ``file://``, ``http(s)://``) into ``<state_dir>/downloads``,
                   resumable (agent/update/download.py), in the file worker process
verifying          the bundle's signature, every hash and the agent version it needs
                   (``open_bundle``, in the file worker); then, in the daemon, that it is the
                   model this daemon serves, with the same inputs and outputs, and newer than the
                   version serving (anti-rollback)
staged             installed into the store beside the current version, not current: the store
                   makes a staging directory, the file worker verifies the bundle again and
                   writes its members there, the store checks them and renames it into place
                   under its lock; the downloaded file is then removed
building-engine    the new version's instances created and activated (a TensorRT engine is built
                   here, or found in the cache) on a thread of lower CPU priority
warming            warm-up batches on that thread; a NaN or Inf on them fails the update
canary             the old version's batches shadowed on the new one (agent/update/canary.py)
committed          the store's pointer switched, new batches sent to the new instances, the old
                   ones drained (at most ``drain_timeout_s``) and freed; then the watch window
rolling-back       after a commit, the version before it is loaded again, swapped back and made
                   current; before, the candidate's instances are freed
=================  ==============================================================================

Nothing here blocks the event loop, and nothing here takes the serving instances' CPU or, for
the file work, the daemon's GIL: the download, the bundle checks and the writing of its members
run in the file worker process (agent/update/fileworker.py: one process at nice +10, started
with the updater and reused), called from one ``update-files`` thread, which also does the
store's own part (the staging directory, the final checks and rename) and the removals; the
candidate's loading and warm-up run on a thread of its own at low priority (agent/update/
priority.py); the journal and the freeing of instances use the loop's default executor.

A step in the worker that is cancelled (a newer request) or runs past its state's deadline kills
the worker, so it ends at once; a worker that dies fails its step with reason ``worker_died``; the
next call starts a new one. Where no worker process can be started (reason
``worker_unavailable``: a sandbox, no memory), the same work runs on the ``update-files`` thread
as before, with a warning: updates keep working, at the cost of the daemon's GIL. Measured on
the development VM (docs/benchmarks.md, 2026-12-03): the daemon's own CPU for an update's file
work went from about 8 ms to 1.3 ms (``7c422b8``, ``17fb88f``); the worker holds 29-34 MiB;
``bench swap``'s ratio did not measurably change within that session's noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent import __version__, runtime
from agent.backends import ModelArtifacts, backend_class, resolve_backend_name
from agent.backends.base import Backend
from agent.batcher import BatchPolicy
from agent.errors import AgentError, BundleError, SignatureError, StoreError, UpdateError
from agent.update.canary import CanaryPolicy, HealthWatch, ShadowCanary
from agent.update.download import (
    DownloadPolicy,
    DownloadProgress,
    DownloadResult,
    discard_partial,
    download,
)
from agent.update.fileworker import FileWorker
from agent.update.journal import BundleId
from agent.update.priority import LOAD_NICE_INCREMENT, LowPriority
from agent.update.updater import UpdateJob, Verdict
from models.bundle import open_bundle
from models.manifest import check_target

if TYPE_CHECKING:
    from agent.daemon import Daemon
    from agent.serving import ModelService

log = logging.getLogger(__name__)

T = TypeVar("T")

DOWNLOADS_DIR = "downloads"


@dataclass
class _Loaded:
    """A version's instances, loaded beside the serving ones (or serving, once committed)."""

    update_id: str
    artifacts: ModelArtifacts
    policy: BatchPolicy
    backends: list[Backend]
    worker: LowPriority

    @property
    def version(self) -> int:
        return self.artifacts.version

    def free(self) -> None:
        """Deactivate every instance (a worker thread, never the loop)."""
        for backend in self.backends:
            try:
                backend.deactivate()
            except Exception:  # noqa: BLE001 - free the others whatever one does
                log.exception("could not free an instance of %s v%d", self.artifacts.name,
                              self.version)
        self.backends = []


class DaemonSteps:
    """:class:`~agent.update.updater.UpdateSteps` for a :class:`~agent.daemon.Daemon` serving one
    model.

    Args:
        daemon: The running daemon (its store, configuration and service).
        canary: The canary's and the watch window's gates.
        download: Retry, deadline and size bounds of downloads.
        drain_timeout_s: How long the old instances may take to finish their batches at a swap.
    """

    def __init__(self, daemon: Daemon, *, canary: CanaryPolicy | None = None,
                 download: DownloadPolicy | None = None, drain_timeout_s: float = 30.0) -> None:
        self.daemon = daemon
        self.canary_policy = canary or CanaryPolicy()
        self.download_policy = download or DownloadPolicy()
        self.drain_timeout_s = drain_timeout_s
        self.downloads_dir = daemon.config.state_dir / DOWNLOADS_DIR
        self._candidate: _Loaded | None = None
        # The old version's steady P95 and median after a wake, measured during the canary
        self._old_p95_s: float | None = None
        self._old_after_wake_p50_s: float | None = None
        # The update's own file work (hashing, signature and member checks, installing into
        # the store, loading it back, removing files) on one thread of low priority, like the
        # candidate's loading: staging must not take the serving instances' CPU either. The
        # heavy part of it (opening the bundle, writing its members) goes on from that thread
        # to the file worker process, out of the daemon's GIL.
        self._files = LowPriority("update-files")
        self.file_worker = FileWorker(
            nice=os.getpriority(os.PRIO_PROCESS, 0) + LOAD_NICE_INCREMENT)
        self._warned_in_process = False

    # -- what serves ------------------------------------------------------------------------

    @property
    def service(self) -> ModelService:
        services = self.daemon.services
        if len(services) != 1:
            raise UpdateError("the daemon serves no model yet", reason="not_serving")
        return next(iter(services.values()))

    async def serving(self) -> BundleId | None:
        if not self.daemon.services:
            return None
        service = self.service
        return BundleId(name=service.name, version=service.version)

    # -- download and verification -----------------------------------------------------------

    def _destination(self, source: str) -> Path:
        digest = hashlib.sha256(source.encode()).hexdigest()[:24]
        return self.downloads_dir / f"{digest}.bundle"

    async def download(self, job: UpdateJob) -> None:
        self.downloads_dir.mkdir(parents=True, exist_ok=True)
        destination = self._destination(job.source)

        def work() -> DownloadResult | None:
            try:
                return self.file_worker.call(  # type: ignore[no-any-return]
                    "fetch", on_progress=_download_progress(job), source=job.source,
                    destination=str(destination), policy=self.download_policy,
                    expected_sha256=job.expected.sha256)
            except UpdateError as exc:
                if exc.reason != "worker_unavailable":
                    raise
                self._warn_in_process(exc)
                return None

        result = await self._killable(work)
        if result is None:
            await fetch_bundle(job, destination, self.download_policy)
            return
        job.notes["bundle_path"] = result.path
        job.notes["sha256"] = result.sha256

    async def verify(self, job: UpdateJob) -> BundleId:
        path = downloaded_bundle(job, self._destination(job.source))
        service = self.service
        keys, device_class = self.daemon.config.trust.keys, self.daemon.config.device_class
        sha256 = job.notes.get("sha256")

        def work() -> BundleId:
            try:
                opened = self.file_worker.call(
                    "open_checked", path=str(path), public_keys=_raw_keys(keys),
                    agent_version=__version__, sha256=sha256)
            except UpdateError as exc:
                if exc.reason != "worker_unavailable":
                    raise
                self._warn_in_process(exc)
                return check_bundle(path, keys, serving=service, device_class=device_class,
                                    allow_downgrade=job.allow_downgrade, sha256=sha256)
            except BundleError as exc:  # SignatureError included
                raise _refusal(exc) from exc
            job.notes["manifest"] = opened["manifest"]
            return judge_bundle(opened["manifest"], opened["sha256"], serving=service,
                                device_class=device_class, allow_downgrade=job.allow_downgrade)

        return await self._killable(work)

    async def start_worker(self) -> None:
        """Start the file worker process ahead of the first update (at low priority, off the
        loop); one that cannot start is warned about, and the updates then do their file work
        in the daemon."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._files.executor,
                                                             self.file_worker.start)
        except UpdateError as exc:
            self._warn_in_process(exc)

    async def _killable(self, work: Callable[[], T]) -> T:
        """``work`` (which calls the file worker) on the file thread; a cancellation (a newer
        request, the state's deadline) kills the worker, so the call ends at once instead of
        when its file is written, and waits for ``work`` to see it (it removes what it
        started). The next call starts a new worker."""
        future = asyncio.get_running_loop().run_in_executor(self._files.executor, work)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self.file_worker.kill()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await future
            raise

    def _warn_in_process(self, exc: UpdateError) -> None:
        """No worker process (a sandbox that forbids it, no memory for it): the update's file
        work is done on the daemon's file thread instead, as correct, only holding the
        daemon's GIL. Said once per daemon at warning level, then at info level."""
        level = logging.INFO if self._warned_in_process else logging.WARNING
        self._warned_in_process = True
        log.log(level, "the update's file work runs in the daemon (%s)", exc)

    # -- staging and loading -----------------------------------------------------------------

    async def stage(self, job: UpdateJob) -> None:
        path = Path(job.notes.get("bundle_path") or self._destination(job.source))
        store = self.daemon.store
        loop = asyncio.get_running_loop()
        manifest = job.notes.get("manifest")
        keys = self.daemon.config.trust.keys

        def work() -> ModelArtifacts:
            # The worker writes the members into a staging directory the store made; the store
            # checks it and renames it into place under its lock. A version installed already,
            # or no worker: the store's own install, on this thread.
            staging = None if manifest is None else store.begin_install(manifest)
            if manifest is None or staging is None:
                return store.install(path)
            try:
                written = self.file_worker.call(
                    "write_members", path=str(path), public_keys=_raw_keys(keys),
                    agent_version=__version__, directory=str(staging),
                    name=manifest["name"], version=manifest["version"])
            except UpdateError as exc:
                store.abandon_install(staging)
                if exc.reason != "worker_unavailable":
                    raise
                self._warn_in_process(exc)
                return store.install(path)
            except BaseException:
                store.abandon_install(staging)
                raise
            return store.finish_install(staging, written["manifest"], written["manifest_bytes"],
                                        written["key_id"])

        try:
            artifacts = await self._killable(work)
        except (StoreError, BundleError) as exc:
            raise UpdateError(f"the bundle could not be installed: {exc.message}",
                              reason="install_failed", **_facts(exc)) from exc
        job.notes["artifacts"] = artifacts
        # The store has its own verified copy now, and nothing after staged reads the download
        # (a restart does not resume from staged on): left there, every committed update would
        # keep a bundle-sized file in downloads/ for good.
        await loop.run_in_executor(self._files.executor, lambda: path.unlink(missing_ok=True))

    async def _artifacts(self, job: UpdateJob) -> ModelArtifacts:
        artifacts = job.notes.get("artifacts")
        if artifacts is not None:
            return artifacts  # type: ignore[no-any-return]
        name, version = _require_bundle_ref(job)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._files.executor, self.daemon.store.load, name,
                                          version)

    async def build_engine(self, job: UpdateJob) -> None:
        artifacts = await self._artifacts(job)
        await self.close()  # a candidate of an earlier update, left loaded
        config = self.daemon.config
        policy = runtime.batch_policy(config, artifacts)
        worker = LowPriority(f"update-v{artifacts.version}")
        loaded = _Loaded(job.update_id, artifacts, policy, [], worker)
        self._candidate = loaded
        stop = _StopFlag()

        def create() -> None:
            cls = backend_class(resolve_backend_name(config.serving.backend))
            options = runtime.backend_options(config, policy.max_batch_size, stop.is_set)
            for _ in range(config.serving.instances):
                if stop.is_set():
                    return
                backend = cls(artifacts, options)
                backend.activate()
                loaded.backends.append(backend)

        await _run_on(worker, create, stop)
        job.progress(instances=len(loaded.backends))

    async def warm(self, job: UpdateJob) -> None:
        loaded = self._require_candidate(job)
        config = self.daemon.config
        stop = _StopFlag()
        batch = (loaded.policy.preferred_batch_sizes[-1] if loaded.policy.preferred_batch_sizes
                 else 1)

        def warm_all() -> None:
            for backend in loaded.backends:
                runtime.warm_up(backend, loaded.artifacts, max(1, config.serving.warmup_batches),
                                batch, stop.is_set)
                shapes = runtime.warmup_shape(loaded.artifacts, backend)
                if shapes is None:
                    continue
                inputs = {info.name: np.zeros((batch, *shapes[info.name]), dtype=info.dtype)
                          for info in backend.inputs}
                outputs = backend.infer(inputs)
                bad = [name for name, value in outputs.items()
                       if value.dtype.kind == "f" and not np.isfinite(value).all()]
                if bad:
                    raise UpdateError("the new version gives NaN or Inf on its warm-up batch",
                                      reason="non_finite", outputs=", ".join(bad))

        await _run_on(loaded.worker, warm_all, stop)

    # -- canary, commit, watch ---------------------------------------------------------------

    async def canary(self, job: UpdateJob) -> Verdict:
        loaded = self._require_candidate(job)
        service = self.service
        canary = ShadowCanary(loaded.backends, loaded.worker, self.canary_policy,
                              old_version=service.version, old_threads=service.version_threads)
        unsubscribe = service.observers.subscribe(canary.old_latency)
        service.batcher.set_tap(canary.tap)
        try:
            verdict = await canary.run()
        finally:
            service.batcher.set_tap(None)
            unsubscribe()
        self._old_p95_s = canary.old_latency.p95_s()
        self._old_after_wake_p50_s = canary.old_latency.after_wake_p50_s()
        job.progress(canary=verdict.to_json())
        log.info("canary of %s v%d: %s", loaded.artifacts.name, loaded.version,
                 verdict.describe())
        return Verdict(healthy=verdict.passed, reason=None if verdict.passed else verdict.reason,
                       detail=verdict.describe())

    async def commit(self, job: UpdateJob) -> None:
        loaded = self._require_candidate(job)
        loop = asyncio.get_running_loop()
        store = self.daemon.store
        await loop.run_in_executor(None, store.activate, loaded.artifacts.name, loaded.version)
        started = time.perf_counter()
        old = await self.service.swap(loaded.version, loaded.backends, loaded.policy,
                                      drain_timeout_s=self.drain_timeout_s,
                                      backend_threads=loaded.worker.new_threads())
        swap_s = time.perf_counter() - started
        self._candidate = None
        restored = loaded.worker.restore()
        # Its work is done: the next update loads on a worker of its own. (Left open, the idle
        # thread would live on, one per swap: its initializer holds the executor.)
        loaded.worker.close()
        await loop.run_in_executor(None, _free, old)
        log.info("%s v%d serves (swap %.3f s; %d old instance(s) freed, %d thread(s) back to "
                 "the daemon's priority)", loaded.artifacts.name, loaded.version, swap_s,
                 len(old), restored)
        job.progress(swap_s=round(swap_s, 4))
        with contextlib.suppress(StoreError):
            await loop.run_in_executor(self._files.executor, store.garbage_collect)

    async def watch(self, job: UpdateJob) -> Verdict:
        service = self.service
        bundle = _require_bundle(job)
        watch = HealthWatch(bundle.version or service.version, self.canary_policy,
                            old_p95_s=self._old_p95_s,
                            old_after_wake_p50_s=self._old_after_wake_p50_s)
        unsubscribe = service.observers.subscribe(watch)
        service.batcher.set_tap(watch.tap)
        try:
            verdict = await watch.run()
        finally:
            service.batcher.set_tap(None)
            unsubscribe()
        return Verdict(healthy=verdict.passed, reason=None if verdict.passed else verdict.reason,
                       detail=verdict.describe())

    # -- undoing -----------------------------------------------------------------------------

    async def discard(self, job: UpdateJob) -> None:
        await self.close()
        destination = self._destination(job.source) if job.source else None
        await asyncio.get_running_loop().run_in_executor(None, self._remove_files, destination)

    def _remove_files(self, destination: Path | None) -> None:
        """The download's files, and installed versions beyond ``store.keep_versions``: a
        candidate that was staged and then failed or was cut short by a restart stays installed
        otherwise, and a run of failing versions would fill the disk (the store never deletes
        the current or the previous version). Blocking I/O, for an executor thread."""
        if destination is not None:
            try:
                discard_partial(destination)
                destination.unlink(missing_ok=True)
            except OSError as exc:
                # A disk gone read-only or failing: the update's own failure is the news, and
                # the files left behind harm nothing (a download resumes or replaces its part).
                log.warning("could not remove the download's files beside %s: %s", destination,
                            exc)
        try:
            self.daemon.store.garbage_collect()
        except StoreError as exc:
            log.warning("could not delete old model versions: %s", exc)

    async def previous(self) -> BundleId | None:
        found = await asyncio.get_running_loop().run_in_executor(
            self._files.executor, self.daemon.store.previous)
        return None if found is None else BundleId(name=found.name, version=found.version)

    async def revert(self, job: UpdateJob) -> None:
        await self.discard(job)
        bundle = _require_bundle(job)
        service = self.service
        loop = asyncio.get_running_loop()
        store = self.daemon.store
        if service.version != bundle.version:
            # Not serving (any more): only the pointer may still name it.
            current = await loop.run_in_executor(None, store.current)
            if current is not None and current.version == bundle.version:
                await loop.run_in_executor(None, store.rollback)
            return
        previous = await loop.run_in_executor(None, store.previous)
        if previous is None:
            raise UpdateError("there is no previous version to return to",
                              reason="nothing_to_roll_back", serving=str(bundle))
        artifacts = await loop.run_in_executor(None, store.load, previous.name, previous.version)
        config = self.daemon.config
        policy = runtime.batch_policy(config, artifacts)
        worker = LowPriority(f"rollback-v{artifacts.version}")
        stop = _StopFlag()
        loaded: list[Backend] = []

        def start() -> None:
            loaded.extend(runtime.start_backends(config, artifacts, policy, stop.is_set))

        try:
            await _run_on(worker, start, stop)
        except BaseException:
            await loop.run_in_executor(None, _free, loaded)
            worker.close()
            raise
        made = worker.new_threads()
        old = await service.swap(artifacts.version, loaded, policy,
                                 drain_timeout_s=self.drain_timeout_s, backend_threads=made)
        worker.restore()
        worker.close()
        await loop.run_in_executor(None, store.rollback)
        await loop.run_in_executor(None, _free, old)
        log.warning("rolled back from %s to %s v%d", bundle, artifacts.name, artifacts.version)

    # -- helpers -------------------------------------------------------------------------------

    def _require_candidate(self, job: UpdateJob) -> _Loaded:
        candidate = self._candidate
        if candidate is None or candidate.update_id != job.update_id:
            raise UpdateError("the new version's instances are not loaded (the daemon restarted "
                              "since?)", reason="not_loaded")
        return candidate

    def shutdown(self) -> None:
        """The daemon stops: end the file thread and the file worker (after :meth:`close`)."""
        self._files.close()
        self.file_worker.close()

    async def close(self) -> None:
        """Free the candidate's instances, off the loop (a discarded update, a daemon stopping
        mid-update)."""
        candidate = self._candidate
        self._candidate = None
        if candidate is not None:
            await asyncio.get_running_loop().run_in_executor(None, candidate.free)
            candidate.worker.close()


class _StopFlag:
    """Set when the step awaiting the work is cancelled: the work checks it between pieces
    (instances, warm-up batches, a TensorRT build's phases) and ends."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


async def _run_on(worker: LowPriority, work: Callable[[], T], stop: _StopFlag) -> T:
    """``work`` on the low-priority thread; a cancellation sets ``stop`` and waits for the work
    to notice, so nothing it made is left half-built behind the caller's back."""
    future = asyncio.get_running_loop().run_in_executor(worker.executor, work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await future
        raise


def _free(backends: list[Backend]) -> None:
    for backend in backends:
        try:
            backend.deactivate()
        except Exception:  # noqa: BLE001
            log.exception("could not free an old instance")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _facts(exc: AgentError) -> dict[str, Any]:
    """An error's facts for the UpdateError that reports it (its own ``reason`` renamed, since
    the update's reason is the code)."""
    facts = dict(exc.fields)
    if "reason" in facts:
        facts["cause"] = facts.pop("reason")
    return facts


def _require_bundle(job: UpdateJob) -> BundleId:
    bundle = job.bundle
    if bundle is None or bundle.name is None or bundle.version is None:
        raise UpdateError("the update has no verified bundle", reason="not_verified")
    return bundle


def _require_bundle_ref(job: UpdateJob) -> tuple[str, int]:
    bundle = _require_bundle(job)
    assert bundle.name is not None and bundle.version is not None  # checked just above
    return bundle.name, bundle.version


async def fetch_bundle(job: UpdateJob, destination: Path, policy: DownloadPolicy) -> None:
    """The downloading state's work: ``job.source`` to ``destination`` (resumed when a part is
    there), with progress on the job; the file and its sha256 go into ``job.notes``."""
    result = await download(job.source, destination, policy=policy,
                            expected_sha256=job.expected.sha256,
                            on_progress=_download_progress(job))
    job.notes["bundle_path"] = result.path
    job.notes["sha256"] = result.sha256


def _download_progress(job: UpdateJob) -> Callable[[DownloadProgress], None]:
    def progress(update: DownloadProgress) -> None:
        job.progress(received_bytes=update.received_bytes, total_bytes=update.total_bytes,
                     bytes_per_s=round(update.bytes_per_s))

    return progress


def downloaded_bundle(job: UpdateJob, destination: Path) -> Path:
    """The file :func:`fetch_bundle` left for ``job`` (``destination`` after a restart).

    Raises:
        UpdateError: ``not_downloaded``: it is gone.
    """
    path = Path(job.notes.get("bundle_path") or destination)
    if not path.is_file():
        raise UpdateError("the downloaded bundle is gone", reason="not_downloaded", path=path)
    return path


def _raw_keys(keys: Sequence[Ed25519PublicKey]) -> list[bytes]:
    """Public keys as the file worker takes them (raw Ed25519 bytes: key objects do not
    pickle)."""
    return [key.public_bytes(Encoding.Raw, PublicFormat.Raw) for key in keys]


def _refusal(exc: BundleError) -> UpdateError:
    """What ``open_bundle`` refused, as the verifying state's failure."""
    if isinstance(exc, SignatureError):
        return UpdateError(f"the bundle's signature is not trusted: {exc.message}",
                           reason="bad_signature", **_facts(exc))
    return UpdateError(f"the bundle is refused: {exc.message}", reason="bad_bundle",
                       **_facts(exc))


def check_bundle(path: Path, keys: Sequence[Ed25519PublicKey], *, serving: Any,
                 device_class: str, allow_downgrade: bool = False,
                 sha256: str | None = None) -> BundleId:
    """The verifying state's checks of a downloaded bundle, blocking (for an executor thread):
    its signature, every hash and the agent version it needs (``open_bundle``); that it is the
    model ``serving`` serves (``name``, ``version``, ``inputs``, ``outputs``: a ModelService),
    with the same inputs and outputs, made for ``device_class``, and not older than the version
    serving unless ``allow_downgrade``. Returns what it is; ``sha256`` is the file's, when the
    download computed it already.

    Raises:
        UpdateError: with the reason: ``bad_signature``, ``bad_bundle``, ``wrong_model``,
            ``downgrade``, ``wrong_target``, ``incompatible``.
    """
    if sha256 is None:
        sha256 = _file_sha256(path)
    try:
        bundle = open_bundle(path, keys, agent_version=__version__)
    except BundleError as exc:  # SignatureError included
        raise _refusal(exc) from exc
    return judge_bundle(bundle.manifest, sha256, serving=serving, device_class=device_class,
                        allow_downgrade=allow_downgrade)


def judge_bundle(manifest: dict[str, Any], sha256: str, *, serving: Any, device_class: str,
                 allow_downgrade: bool = False) -> BundleId:
    """The verifying state's checks of an opened bundle's verified ``manifest`` (cheap: what
    :func:`check_bundle` does after ``open_bundle``): the model, anti-rollback, the target, the
    inputs and outputs.

    Raises:
        UpdateError: ``wrong_model``, ``downgrade``, ``wrong_target``, ``incompatible``.
    """
    name, version = manifest["name"], manifest["version"]
    if name != serving.name:
        raise UpdateError("the bundle is of another model than the one this daemon serves",
                          reason="wrong_model", bundle=name, serving=serving.name)
    if version < serving.version and not allow_downgrade:
        raise UpdateError("the bundle is older than the version serving (anti-rollback; "
                          "'edge-agent update rollback' returns to the previous version, "
                          "a signed fleet document can allow a downgrade)",
                          reason="downgrade", bundle_version=version,
                          serving_version=serving.version)
    try:
        check_target(manifest, device_class)
    except BundleError as exc:
        raise UpdateError(f"the bundle is refused: {exc.message}", reason="wrong_target",
                          **_facts(exc)) from exc
    _check_interface(manifest, serving)
    return BundleId(name=name, version=version, sha256=sha256)


def _check_interface(manifest: dict[str, Any], service: Any) -> None:
    """The new version must take and give what clients of the old one send and read: the same
    input and output names and data types (shapes may differ in their dynamic axes)."""
    def described(entries: Any) -> dict[str, str]:
        return {entry["name"]: str(entry["dtype"]) for entry in entries or ()}

    for role, new, old in (("inputs", described(manifest.get("inputs")), service.inputs),
                           ("outputs", described(manifest.get("outputs")), service.outputs)):
        served = {info.name: np.dtype(info.dtype).name for info in old}
        wanted = {name: np.dtype(dtype).name for name, dtype in new.items()}
        if served != wanted:
            raise UpdateError(f"the new version's {role} differ from the serving version's: a "
                              "hot swap would break its clients", reason="incompatible",
                              serving=str(served), bundle=str(wanted))


__all__ = ["DOWNLOADS_DIR", "DaemonSteps"]
