"""Fake update steps: the seam between the updater and the serving path (agent/update/updater.py).

:class:`FakeSteps` keeps a tiny "store" on disk, so that a process killed mid-update leaves
something real for the next one to find:

    <root>/serving.json        {"current": bundle | null, "previous": bundle | null}, written
                               crash-safe (the store's pointer, in miniature)
    <root>/installed/<v>       a staged or committed version
    <root>/downloads/<id>      a download in progress

Sources are ``fake://<name>/<version>``; a bundle's sha256 is that of its source text. Each step can
be told to misbehave (:attr:`FakeSteps.behaviour`): ``fail`` (an UpdateError with reason
``injected``), ``raise`` (a RuntimeError: a bug in a step), ``hang`` (never returns),
``unhealthy`` (the canary or watch verdict), ``slow`` (sleeps ``slow_s`` first), ``ok``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from agent.errors import UpdateError
from agent.fsutil import atomic_write_text
from agent.update.journal import BundleId
from agent.update.updater import UpdateJob, Verdict

STEPS = ("download", "verify", "stage", "build_engine", "warm", "canary", "commit", "watch",
         "discard", "revert")


def source(name: str, version: int) -> str:
    return f"fake://{name}/{version}"


def bundle_of(source_text: str) -> BundleId:
    name, version = source_text.removeprefix("fake://").split("/")
    return BundleId(name=name, version=int(version),
                    sha256=hashlib.sha256(source_text.encode()).hexdigest())


class FakeSteps:
    """Steps that record their calls and do their work in a small on-disk store.

    Args:
        root: The fake store's directory.
        delay_s: How long each step takes (a random share of it, with ``jitter``).
        watch_s: How long the watch runs before saying healthy; None: until cancelled (the
            window passing).
    """

    def __init__(self, root: Path, *, delay_s: float = 0.0, jitter: bool = False,
                 watch_s: float | None = None, seed: int | None = None) -> None:
        self.root = Path(root)
        (self.root / "installed").mkdir(parents=True, exist_ok=True)
        (self.root / "downloads").mkdir(parents=True, exist_ok=True)
        self.delay_s = delay_s
        self.jitter = jitter
        self.watch_s = watch_s
        self.behaviour: dict[str, str] = {}
        self.slow_s = 0.0
        self.calls: list[tuple[str, int | None]] = []
        self.started: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self._random = random.Random(seed)

    # -- the fake store -------------------------------------------------------------------------

    def pointer(self) -> dict[str, Any]:
        path = self.root / "serving.json"
        return json.loads(path.read_text()) if path.exists() else {"current": None,
                                                                     "previous": None}

    def set_serving(self, current: BundleId | None, previous: BundleId | None = None) -> None:
        atomic_write_text(self.root / "serving.json", json.dumps({
            "current": None if current is None else current.to_json(),
            "previous": None if previous is None else previous.to_json()}))
        if current is not None:
            (self.root / "installed" / str(current.version)).write_text("")

    def serving_now(self) -> BundleId | None:
        current = self.pointer()["current"]
        return None if current is None else BundleId(**current)

    def installed(self) -> set[int]:
        return {int(path.name) for path in (self.root / "installed").iterdir()}

    def downloads(self) -> set[str]:
        return {path.name for path in (self.root / "downloads").iterdir()}

    def called(self, step: str) -> int:
        return sum(1 for name, _ in self.calls if name == step)

    def event(self, step: str) -> asyncio.Event:
        """Set when ``step`` starts (made on first use, in the running loop)."""
        return self.started.setdefault(step, asyncio.Event())

    # -- the steps ------------------------------------------------------------------------------

    async def serving(self) -> BundleId | None:
        return self.serving_now()

    async def download(self, job: UpdateJob) -> None:
        await self._act("download", job)
        (self.root / "downloads" / job.update_id).write_text(job.source)
        job.progress(received_bytes=10, total_bytes=10)

    async def verify(self, job: UpdateJob) -> BundleId:
        await self._act("verify", job)
        return bundle_of(job.source)

    async def stage(self, job: UpdateJob) -> None:
        await self._act("stage", job)
        (self.root / "installed" / str(self._version(job))).write_text("")

    async def build_engine(self, job: UpdateJob) -> None:
        await self._act("build_engine", job)
        job.progress(phase="tactics")

    async def warm(self, job: UpdateJob) -> None:
        await self._act("warm", job)

    async def canary(self, job: UpdateJob) -> Verdict:
        if await self._act("canary", job) == "unhealthy":
            return Verdict(healthy=False, reason="latency", detail="p99 40 ms against 10 ms")
        return Verdict(healthy=True)

    async def commit(self, job: UpdateJob) -> None:
        await self._act("commit", job)
        bundle = job.bundle
        old = self.serving_now()
        self.set_serving(bundle, old)
        keep = {version for version in (self._version(job), old and old.version) if version}
        for version in self.installed() - keep:
            (self.root / "installed" / str(version)).unlink()

    async def watch(self, job: UpdateJob) -> Verdict:
        if await self._act("watch", job) == "unhealthy":
            return Verdict(healthy=False, reason="error_rate", detail="5% of requests failed")
        try:
            if self.watch_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.watch_s or 0.0)
        except asyncio.CancelledError:
            self.cancelled.append("watch")
            raise
        return Verdict(healthy=True)

    async def discard(self, job: UpdateJob) -> None:
        await self._act("discard", job)
        (self.root / "downloads" / job.update_id).unlink(missing_ok=True)
        serving = self.serving_now()
        version = self._version(job)
        if version is not None and (serving is None or serving.version != version):
            (self.root / "installed" / str(version)).unlink(missing_ok=True)

    async def previous(self) -> BundleId | None:
        previous = self.pointer()["previous"]
        return None if previous is None else BundleId(**previous)

    async def revert(self, job: UpdateJob) -> None:
        await self._act("revert", job)
        pointer = self.pointer()
        if job.bundle is None or pointer["current"] is None:
            return
        if BundleId(**pointer["current"]).matches(job.bundle):
            if pointer["previous"] is None:
                raise UpdateError("no previous version to roll back to", reason="no_previous")
            self.set_serving(BundleId(**pointer["previous"]), None)
            (self.root / "installed" / str(job.bundle.version)).unlink(missing_ok=True)

    # -- behaviour ------------------------------------------------------------------------------

    @staticmethod
    def _version(job: UpdateJob) -> int | None:
        if job.bundle is not None:
            return job.bundle.version
        return bundle_of(job.source).version if job.source.startswith("fake://") else None

    async def _act(self, step: str, job: UpdateJob) -> str:
        self.calls.append((step, self._version(job)))
        self.event(step).set()
        behaviour = self.behaviour.get(step, "ok")
        try:
            delay_s = self.delay_s * (self._random.random() if self.jitter else 1.0)
            if behaviour == "slow":
                delay_s += self.slow_s
            if delay_s:
                await asyncio.sleep(delay_s)
            if behaviour == "hang":
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(step)
            raise
        if behaviour == "fail":
            raise UpdateError(f"the {step} step was told to fail", reason="injected")
        if behaviour == "raise":
            raise RuntimeError(f"the {step} step has a bug")
        return behaviour
