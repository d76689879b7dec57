"""Where a build's bundle goes: the output directory (made writable, cleared of killed builds'
staging directories), the bundle's name and next version, and the checks on them that are made
before any work."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from agent.errors import ConfigError
from models.manifest import MAX_NAME_LENGTH
from models.pipeline.options import BuildOptions

log = logging.getLogger(__name__)

_BUNDLE_NAME = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]*)-(?P<version>\d+)\.bundle$")


def next_version(out_dir: Path, name: str) -> int:
    """One more than the highest version of ``name`` already in ``out_dir``."""
    versions = [
        int(match["version"])
        for path in (out_dir.iterdir() if out_dir.is_dir() else [])
        if (match := _BUNDLE_NAME.match(path.name)) and match["name"] == name
    ]
    return max(versions, default=0) + 1


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    return slug[:MAX_NAME_LENGTH].rstrip("-._") or "model"


def _prepare_out_dir(out_dir: Path) -> bool:
    """Make sure ``--out`` is a directory this process can write (creating it when missing;
    returns whether it did, so that a failed build can remove it again) and remove the staging
    directories of builds that were killed."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--out is not a directory", key="--out", path=out_dir)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("cannot create the output directory", key="--out", path=out_dir,
                          reason=exc.strerror or str(exc)) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError("the output directory is not writable", key="--out", path=out_dir)
    for stale in out_dir.glob(".build-*"):
        match = re.fullmatch(r"\.build-(\d+)-.*", stale.name)
        if match and stale.is_dir() and not _process_alive(int(match[1])):
            log.info("removing %s, left by a build that was killed", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return created


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _planned_name(options: BuildOptions) -> str:
    """The bundle's name, known before any work (the same rules as the loaders use)."""
    if options.name:
        return options.name
    if options.model is not None:
        from models import zoo

        return zoo.get(options.model).name
    if options.user_model is not None:
        return _slug(options.user_model.split(":")[-1])
    assert options.onnx is not None  # BuildOptions allows exactly one source
    return _slug(options.onnx.stem)


def _check_before_work(options: BuildOptions) -> None:
    """Refuse what would only fail after minutes of pruning and calibration."""
    if options.version is not None:
        bundle_path = options.out_dir / f"{_planned_name(options)}-{options.version}.bundle"
        if bundle_path.exists():
            raise ConfigError("bundle already exists; pick another --version", path=bundle_path)
    if options.build_engine:
        from models.engine import require_tensorrt

        require_tensorrt()


def _bundle_path(options: BuildOptions) -> tuple[str, int, Path]:
    """The bundle's name, version and path; refuses a bundle that is there already (another
    build into the same directory may have made it since this one started)."""
    name = _planned_name(options)
    version = options.version or next_version(options.out_dir, name)
    bundle_path = options.out_dir / f"{name}-{version}.bundle"
    if bundle_path.exists():
        raise ConfigError("bundle already exists; pick another --version", path=bundle_path)
    return name, version, bundle_path
