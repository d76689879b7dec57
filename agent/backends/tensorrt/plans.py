"""Which plan a TensorRT instance runs, and where it came from.

An engine only loads on the TensorRT build and GPU it was made for, so plans are named by the
device fingerprint (models/fingerprint.py) and the first that loads wins (:class:`EngineLoader`):

1. the bundle's prebuilt plan for this fingerprint (``manifest["engines"]``);
2. the plan built earlier on this device, ``<engine_cache_dir>/<fingerprint>.plan``, when its record
   (``<fingerprint>.plan.json``: sha256 of the model and of the plan, and the build settings) still
   matches (:class:`EngineCache`);
3. a build from ``model.onnx`` (models/engine/: the profile from the manifest's
   ``engine_profile``, the FP16 fallback layers from its precision plan:
   :func:`engine_build_config`), cached atomically with its record and its timing cache. The
   bundle's ``timing.cache`` seeds the first build.

A plan TensorRT refuses (another TensorRT build, a corrupt file) is not fatal: a bundle plan is
skipped and a cached one deleted, each with a warning, and the engine is rebuilt. Only a plan that
was just built and still does not load is an EngineError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.backends.base import BackendOptions, ModelArtifacts
from agent.backends.cuda_buffers import CudaDevice
from agent.errors import EngineError
from agent.fsutil import atomic_write_bytes, atomic_write_text, sha256_file
from models.engine import EngineBuildConfig, build_engine, forwarding_logger
from models.fingerprint import DeviceFingerprint, GpuModel, read_l4t_release

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

BUILD_OPTION_KEYS = (
    "workspace_bytes", "dla_core", "gpu_fallback", "optimization_level", "strict_precision", "fp16",
)
PROFILE_AXES = ("batch", "height", "width")


def engine_build_config(artifacts: ModelArtifacts, extra: Mapping[str, Any], *,
                        timing_cache_path: Path | None = None) -> EngineBuildConfig:
    """The engine build for a bundle on this device: shapes from the manifest's ``engine_profile``
    (``batch``, ``height``, ``width``: ``[min, opt, max]``; without one, batch 1 to ``max_batch``
    tuned at ``opt_batch``), FP16 fallback layers from its precision plan, device settings from
    ``extra`` (:data:`BUILD_OPTION_KEYS`).

    Raises:
        EngineError: the manifest's profile or layouts are malformed.
        ConfigError: a build setting is invalid (names the key).
    """
    manifest = artifacts.manifest
    profile = manifest.get("engine_profile") or {"batch": [1, artifacts.opt_batch, artifacts.max_batch]}
    if not isinstance(profile, Mapping):
        raise EngineError("manifest engine_profile must be an object", found=repr(profile))
    values: dict[str, Any] = {}
    for axis in PROFILE_AXES:
        span = profile.get(axis)
        if span is None and axis == "batch":
            span = [1, artifacts.opt_batch, artifacts.max_batch]
        if span is None:
            continue
        if not isinstance(span, (list, tuple)) or len(span) != 3:
            raise EngineError(f"manifest engine_profile.{axis} must be [min, opt, max]", found=repr(span))
        values.update(zip((f"min_{axis}", f"opt_{axis}", f"max_{axis}"), span, strict=True))
    layouts = sorted({str(tensor["layout"]) for tensor in manifest.get("inputs") or ()
                      if isinstance(tensor, Mapping) and tensor.get("layout")})
    if len(layouts) > 1:
        raise EngineError("inputs with different layouts cannot share one build profile", found=layouts)
    if layouts:
        values["layout"] = layouts[0]
    precision = manifest.get("precision") or {}
    values["fp16_layers"] = tuple(precision.get("fp16_layers") or ())
    if precision.get("fp32_layers"):
        # The builder pins FP16 fallback layers only; FP32 ones are left to TensorRT's choice.
        log.warning("the precision plan's FP32 layers are not enforced in the TensorRT build: %s",
                    ", ".join(precision["fp32_layers"]))
    values.update({key: extra[key] for key in BUILD_OPTION_KEYS if key in extra})
    if values.get("dla_core") is not None:
        # DLA has no dynamic shapes: build for the optimum only. Smaller batches are padded to it
        # (TensorRTBackend.run); frames of another size are refused.
        collapsed = {axis: values[f"opt_{axis}"] for axis in PROFILE_AXES if f"opt_{axis}" in values}
        for axis, opt in collapsed.items():
            values[f"min_{axis}"] = values[f"max_{axis}"] = opt
        log.warning("DLA core %s runs static shapes only: the engine is built for %s; smaller "
                    "batches are padded to that batch", values["dla_core"],
                    ", ".join(f"{axis} {opt}" for axis, opt in collapsed.items()))
    return EngineBuildConfig(**values, timing_cache_path=timing_cache_path)


def build_settings(config: EngineBuildConfig) -> dict[str, Any]:
    """The settings that make one plan differ from another, as JSON values."""
    settings = dataclasses.asdict(config)
    settings.pop("timing_cache_path")
    settings["fp16_layers"] = list(config.fp16_layers)
    return settings


class EngineCache:
    """Plans built on this device for one fingerprint, in ``directory``: ``<key>.plan``, its record
    ``<key>.plan.json`` and the timing cache ``<key>.timing.cache``. Writes are atomic, and
    :meth:`lock` keeps two processes from building the same plan at once."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = Path(directory)
        self.key = key
        self.plan_path = self.directory / f"{key}.plan"
        self.record_path = self.directory / f"{key}.plan.json"
        self.timing_cache_path = self.directory / f"{key}.timing.cache"
        self._lock_path = self.directory / f"{key}.lock"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the build lock (blocks while another process builds this plan)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def load(self, expected: Mapping[str, Any]) -> bytes | None:
        """The cached plan if its record matches ``expected`` and its bytes their hash; a stale
        or damaged entry is discarded (with a warning when damaged) and None returned."""
        try:
            plan = self.plan_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            log.warning("cached engine %s has no readable record; rebuilding it", self.plan_path)
        elif any(record.get(name) != value for name, value in expected.items()):
            changed = sorted(name for name, value in expected.items() if record.get(name) != value)
            log.info("cached engine %s was built for another %s; rebuilding it", self.plan_path,
                     " and ".join(changed))
        elif record.get("plan_sha256") != hashlib.sha256(plan).hexdigest():
            log.warning("cached engine %s does not match its recorded sha256 (corrupt or torn); "
                        "rebuilding it", self.plan_path)
        else:
            return plan
        self.discard()
        return None

    def store(self, plan: bytes, expected: Mapping[str, Any]) -> None:
        # The record goes last: a crash in between leaves a plan without a record, which load()
        # treats as stale rather than trusting it.
        atomic_write_bytes(self.plan_path, plan)
        record = dict(expected, plan_sha256=hashlib.sha256(plan).hexdigest())
        atomic_write_text(self.record_path, json.dumps(record, indent=2, sort_keys=True) + "\n")

    def discard(self) -> None:
        for path in (self.record_path, self.plan_path):
            path.unlink(missing_ok=True)

    def seed_timing_cache(self, source: Path) -> None:
        """Start from ``source`` (the bundle's timing cache) when none was saved here yet. The
        builder drops a cache made on another device or TensorRT, so a foreign one is harmless."""
        if self.timing_cache_path.exists() or not source.is_file():
            return
        atomic_write_bytes(self.timing_cache_path, source.read_bytes())


@dataclass(frozen=True)
class EngineSource:
    """Where the running plan came from: ``bundle``, ``cache`` or ``built`` (now, on this device)."""

    origin: str
    path: Path
    fingerprint: str


class TensorRTLog:
    """A TensorRT logger that forwards to Python logging and keeps the recent errors for reports."""

    def __init__(self) -> None:
        self._errors: deque[str] = deque(maxlen=20)
        self.logger: trt.ILogger = forwarding_logger(log, on_error=self._errors.append)

    def note_error(self, message: str) -> None:
        """Keep an error TensorRT raised as an exception rather than logged."""
        log.error("TensorRT: %s", message)
        self._errors.append(message)

    def take_errors(self) -> list[str]:
        """The errors logged since the last call."""
        errors = list(self._errors)
        self._errors.clear()
        return errors


class EngineLoader:
    """Finds and deserializes the plan one instance runs: the bundle's, the cached one, or a new
    build (see the module docstring).

    Args:
        artifacts, options: The instance's (``options.extra`` holds the build settings).
        deserialize: The instance's, through its TensorRT runtime: an engine, or None when
            TensorRT refuses the plan. The loader holds no TensorRT object itself, so that an
            error's traceback cannot keep one alive past the instance's deactivate().
        trt_log: The runtime's logger, whose recent errors explain a refused plan.
        root: Filesystem root for ``etc/nv_tegra_release`` (part of the device fingerprint).
    """

    def __init__(self, artifacts: ModelArtifacts, options: BackendOptions, *,
                 deserialize: Callable[[bytes], trt.ICudaEngine | None], trt_log: TensorRTLog,
                 root: Path) -> None:
        self.artifacts = artifacts
        self.options = options
        self._deserialize = deserialize
        self._log = trt_log
        self._root = root

    def load(self, trt_version: str, device: CudaDevice) -> tuple[trt.ICudaEngine, EngineSource]:
        """Deserialize the first plan that loads: the bundle's, the cached one, or a new build.

        Raises:
            EngineError: the build failed, or its plan does not load either.
        """
        gpu = GpuModel(device.compute_capability, device.multiprocessors)
        key = DeviceFingerprint.of(trt_version, gpu, read_l4t_release(self._root)).key()
        bundled = self._from_bundle(trt_version, key)
        if bundled is not None:
            return bundled
        cache = EngineCache(self.artifacts.engine_cache_dir, key)
        config = engine_build_config(self.artifacts, self.options.extra,
                                     timing_cache_path=cache.timing_cache_path)
        expected = {"model_sha256": self._model_sha256(), "build": build_settings(config),
                    "tensorrt_version": trt_version}
        with cache.lock():
            cached = self._from_cache(cache, expected, trt_version)
            if cached is not None:
                return cached
            return self._build(cache, config, expected, gpu)

    def _from_bundle(self, trt_version: str,
                     key: str) -> tuple[trt.ICudaEngine, EngineSource] | None:
        bundled = self.artifacts.prebuilt_engines().get(key)
        if bundled is None:
            return None
        try:
            plan = bundled.read_bytes()
        except OSError as exc:
            log.warning("bundle plan %s unreadable (%s); using a plan built on this device", bundled, exc)
            return None
        engine = self._deserialize(plan)
        if engine is not None:
            return engine, EngineSource("bundle", bundled, key)
        log.warning("TensorRT %s refused the bundle's plan %s for %s (%s); using a plan built on "
                    "this device", trt_version, bundled, key,
                    "; ".join(self._log.take_errors()) or "no reason logged")
        return None

    def _from_cache(self, cache: EngineCache, expected: Mapping[str, Any],
                    trt_version: str) -> tuple[trt.ICudaEngine, EngineSource] | None:
        plan = cache.load(expected)
        if plan is None:
            return None
        engine = self._deserialize(plan)
        if engine is not None:
            return engine, EngineSource("cache", cache.plan_path, cache.key)
        log.warning("TensorRT %s refused the cached plan %s (%s); deleting and rebuilding it",
                    trt_version, cache.plan_path,
                    "; ".join(self._log.take_errors()) or "no reason logged")
        cache.discard()
        return None

    def _build(self, cache: EngineCache, config: EngineBuildConfig, expected: Mapping[str, Any],
               gpu: GpuModel) -> tuple[trt.ICudaEngine, EngineSource]:
        cache.seed_timing_cache(self.artifacts.directory / "timing.cache")
        log.info("building the TensorRT engine for %s v%d on this device (%s); this takes a while",
                 self.artifacts.name, self.artifacts.version, cache.key)
        result = build_engine(self.artifacts.onnx_path, config,
                              gpu=lambda: gpu, root=self._root,
                              stop_requested=self.options.stop_requested)
        for warning in result.warnings:
            log.warning("engine build: %s", warning)
        log.info("engine built in %.1f s", result.build_seconds)
        cache.store(result.plan, expected)
        engine = self._deserialize(result.plan)
        if engine is None:
            cache.discard()
            raise EngineError("TensorRT cannot load the engine it has just built", plan=cache.plan_path,
                              messages=self._log.take_errors())
        return engine, EngineSource("built", cache.plan_path, cache.key)

    def _model_sha256(self) -> str:
        entry = (self.artifacts.manifest.get("artifacts") or {}).get("model.onnx") or {}
        # The store verified model.onnx against this hash when it installed the bundle.
        if isinstance(entry, Mapping) and isinstance(entry.get("sha256"), str):
            return str(entry["sha256"])
        try:
            return sha256_file(self.artifacts.onnx_path)[0]
        except OSError as exc:
            raise EngineError("cannot read the ONNX model", path=self.artifacts.onnx_path,
                              reason=str(exc)) from None
