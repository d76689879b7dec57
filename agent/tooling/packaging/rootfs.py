"""Installing the service into a root file system tree, such as the ``Linux_for_Tegra/rootfs``
that NVIDIA's flash tools write to a board, and taking it out again.

What goes in is :func:`agent.tooling.packaging.layout.service_entries`. The install is
idempotent: a file whose content and mode are already right is left alone (its time stamp
too), so a second run with the same inputs leaves the same tree. It is reversible: the tree
keeps a manifest (``usr/share/edge-agent/installed.json``) of every path it wrote and every
directory it made, and :func:`uninstall` removes exactly those, plus the Python environments
the board built at boot. A configuration the operator changed is kept (an install beside it
writes the new one as ``agent.toml.new``, as dpkg does with a changed conffile), unless
purged.

Nothing is written outside the tree: a path whose parent resolves outside it (an absolute link
in the tree, read on the host) is refused. Files are made root-owned when run as root, as the
flash tools expect of a root file system (run it with sudo, as ``apply_binaries.sh``).
"""

from __future__ import annotations

import hashlib
import json
import re
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes
from agent.tooling.packaging.layout import PREFIX, Entry

__all__ = ["MANIFEST", "Report", "board_python", "check_wheels", "install",
           "install_first_model", "uninstall"]

log = logging.getLogger(__name__)

MANIFEST = PurePosixPath("usr/share/edge-agent/installed.json")
# Made on the board at boot by build-venv, never by the install; an uninstall removes them.
GENERATED_GLOBS = ("venv", "venv-*", "venv.new")
# The unit's StateDirectory= and CacheDirectory=: models and engines. Only a purge removes them.
DATA_DIRS = (PurePosixPath("var/lib/edge-agent"), PurePosixPath("var/cache/edge-agent"))


@dataclass
class Report:
    """What an install or uninstall did, by path relative to the tree."""

    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inside(rootfs: Path, relative: PurePosixPath) -> Path:
    """``rootfs/relative``, checked to stay inside the tree once its parent's links resolve."""
    if relative.is_absolute() or ".." in relative.parts:
        raise ConfigError("not a path inside the tree", path=str(relative))
    path = rootfs / relative
    real_root = os.path.realpath(rootfs)
    real_parent = os.path.realpath(path.parent)
    if os.path.commonpath([real_root, real_parent]) != real_root:
        raise ConfigError("this path leads outside the root file system (a link in the tree "
                          "points out of it)", path=str(relative), resolves_to=real_parent)
    return path


@dataclass
class _Manifest:
    """What an earlier install recorded: its entries by path, and the directories it made."""

    entries: dict[str, dict[str, object]] = field(default_factory=dict)
    created_dirs: set[str] = field(default_factory=set)


def _read_manifest(rootfs: Path) -> _Manifest:
    path = _inside(rootfs, MANIFEST)
    if not path.exists():
        return _Manifest()
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("the install manifest cannot be read", path=path,
                          reason=str(exc)) from None
    entries = manifest.get("entries") if isinstance(manifest, dict) else None
    created = manifest.get("created_dirs") if isinstance(manifest, dict) else None
    if (not isinstance(entries, list) or not isinstance(created, list)
            or not all(isinstance(item, dict) and isinstance(item.get("path"), str)
                       for item in entries)
            or not all(isinstance(directory, str) for directory in created)):
        raise ConfigError("the install manifest is not one this installer wrote", path=path)
    return _Manifest(entries={item["path"]: item for item in entries},
                     created_dirs=set(created))


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        os.lchown(path, 0, 0)


def install(rootfs: Path, entries: Sequence[Entry]) -> Report:
    """Write ``entries`` into the tree ``rootfs`` (see the module docstring).

    Raises:
        ConfigError: ``rootfs`` is not a directory, a path would leave it, or something that
            is not ours stands where a file or link goes (a directory, a foreign link).
    """
    rootfs = Path(rootfs)
    if not rootfs.is_dir():
        raise ConfigError("the root file system is not a directory", path=rootfs)
    if os.geteuid() != 0:
        log.warning("not running as root: the files keep this user's owner; a root file "
                    "system for flashing must be root-owned (run the installer with sudo)")
    previous = _read_manifest(rootfs)
    previous_entries = previous.entries
    created = set(previous.created_dirs)
    report = Report()
    manifest_dir = _inside(rootfs, MANIFEST.parent)
    if not manifest_dir.is_dir():
        manifest_dir.mkdir(mode=0o755, parents=True)
        created.add(str(MANIFEST.parent))
    recorded: list[dict[str, object]] = []
    for entry in entries:
        path = _inside(rootfs, entry.path)
        key = str(entry.path)
        if entry.kind == "dir":
            if not path.is_dir() or path.is_symlink():
                if path.exists() or path.is_symlink():
                    raise ConfigError("something other than a directory is in the way",
                                      path=key)
                path.mkdir(mode=entry.mode)
                created.add(key)
                report.written.append(key)
            if key in created:
                os.chmod(path, entry.mode)
                _own(path)
            continue
        if entry.kind == "link":
            assert entry.target is not None  # the layout makes links with targets
            if path.is_symlink() and os.readlink(path) == entry.target:
                report.unchanged.append(key)
            else:
                if path.exists() or path.is_symlink():
                    if key not in previous_entries:
                        raise ConfigError("a file or link that this install did not make is "
                                          "in the way", path=key)
                    path.unlink()
                os.symlink(entry.target, path)
                _own(path)
                report.written.append(key)
            recorded.append({"path": key, "kind": "link", "target": entry.target})
            continue
        assert entry.data is not None  # files always carry their content
        digest = _sha256(entry.data)
        written_as = key
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ConfigError("something other than a regular file is in the way", path=key)
        if path.exists():
            current = path.read_bytes()
            if _sha256(current) == digest:
                if (path.stat().st_mode & 0o7777) != entry.mode:
                    os.chmod(path, entry.mode)
                    report.written.append(key)
                else:
                    report.unchanged.append(key)
                _own(path)
                recorded.append({"path": key, "kind": "file", "sha256": digest,
                                 "config": entry.config})
                continue
            ours = previous_entries.get(key, {}).get("sha256")
            if entry.config and ours != _sha256(current):
                # Changed by the operator (or not written by us): theirs stays, ours beside it.
                report.kept.append(key)
                recorded.append({"path": key, "kind": "file", "sha256": ours or "",
                                 "config": True})
                written_as = key + ".new"
                path = _inside(rootfs, PurePosixPath(written_as))
                if path.exists() and _sha256(path.read_bytes()) == digest:
                    report.unchanged.append(written_as)
                    recorded.append({"path": written_as, "kind": "file", "sha256": digest,
                                     "config": False})
                    continue
        atomic_write_bytes(path, entry.data, mode=entry.mode)
        os.chmod(path, entry.mode)  # atomic_write_bytes honours the umask
        _own(path)
        report.written.append(written_as)
        recorded.append({"path": written_as, "kind": "file", "sha256": digest,
                         "config": entry.config and written_as == key})

    wanted = {str(item["path"]) for item in recorded}
    for stale, item in previous_entries.items():
        if stale not in wanted and stale != str(MANIFEST):
            _remove_entry(rootfs, item, report, force=False)
    manifest = {"entries": sorted(recorded, key=lambda item: str(item["path"])),
                "created_dirs": sorted(created)}
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    manifest_path = _inside(rootfs, MANIFEST)
    if not manifest_path.exists() or manifest_path.read_bytes() != data:
        atomic_write_bytes(manifest_path, data, mode=0o644)
        os.chmod(manifest_path, 0o644)
        _own(manifest_path)
    return report


def _remove_entry(rootfs: Path, item: dict[str, object], report: Report, *,
                  force: bool) -> None:
    key = str(item["path"])
    path = _inside(rootfs, PurePosixPath(key))
    if item.get("kind") == "link":
        if path.is_symlink() and os.readlink(path) == item.get("target"):
            path.unlink()
            report.removed.append(key)
        return
    if not path.is_file() or path.is_symlink():
        return
    if item.get("config") and not force and _sha256(path.read_bytes()) != item.get("sha256"):
        report.kept.append(key)
        log.warning("kept %s: it was changed after the install", key)
        return
    path.unlink()
    report.removed.append(key)


def uninstall(rootfs: Path, *, purge: bool = False) -> Report:
    """Remove what :func:`install` put in ``rootfs``, and the environments built at boot.

    Args:
        purge: Also the changed configuration and the state and cache directories (the
            installed models and engines).

    Raises:
        ConfigError: the tree has no manifest (nothing was installed, or not by this tool).
    """
    rootfs = Path(rootfs)
    if not _inside(rootfs, MANIFEST).exists():
        raise ConfigError("no edge-agent install in this tree (its manifest is missing)",
                          path=rootfs / MANIFEST)
    manifest = _read_manifest(rootfs)
    report = Report()
    prefix = _inside(rootfs, PREFIX)
    for pattern in GENERATED_GLOBS:
        for generated in sorted(prefix.glob(pattern)) if prefix.is_dir() else []:
            if generated.is_symlink() or generated.is_file():
                generated.unlink()
            else:
                shutil.rmtree(generated)
            report.removed.append(str(generated.relative_to(rootfs)))
    for item in manifest.entries.values():
        _remove_entry(rootfs, item, report, force=purge)
    if purge:
        for directory in DATA_DIRS:
            path = _inside(rootfs, directory)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
                report.removed.append(str(directory))
    _inside(rootfs, MANIFEST).unlink()
    report.removed.append(str(MANIFEST))
    for made in sorted(manifest.created_dirs, key=lambda d: -len(PurePosixPath(d).parts)):
        path = _inside(rootfs, PurePosixPath(made))
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
            report.removed.append(made)
    return report


def install_first_model(rootfs: Path, bundle: Path, trusted_keys: Sequence[Path]) -> str:
    """Install ``bundle`` into the tree's model store and make it current, so that the daemon
    has a model to serve at first boot (it does not start without one). The bundle is
    verified against ``trusted_keys`` (the keys the device will trust) as the daemon would.

    The files are root's until the daemon's first start: ``StateDirectory=`` then gives the
    whole store to the edge-agent user, because its top directory is not the user's yet.
    Installing the version that is current already does nothing.

    Returns:
        ``name vVERSION`` of the installed model.

    Raises:
        BundleError, SignatureError: the bundle does not verify.
        StoreError: the tree's state directory cannot be used.
    """
    from agent.store.store import ModelStore
    from models.signing import load_public_key

    state_dir = _inside(Path(rootfs), DATA_DIRS[0])
    keys = [load_public_key(Path(path)) for path in trusted_keys]
    with ModelStore(state_dir, trusted_keys=keys) as store:
        current = store.current()
        installed = store.install(Path(bundle))
        if current is None or (current.name, current.version) != (installed.name,
                                                                   installed.version):
            store.activate(installed.name, installed.version)
    os.chmod(state_dir, 0o750)
    return f"{installed.name} v{installed.version}"


ELF_MACHINES = {0xB7: "aarch64", 0x3E: "x86_64"}


def board_python(rootfs: Path) -> tuple[tuple[int, int], str] | None:
    """The tree's ``python3``: its version (from the ``python3 -> python3.X`` link) and its
    machine (from the binary's ELF header); None when the tree has no such link."""
    link = _inside(Path(rootfs), PurePosixPath("usr/bin/python3"))
    if not link.is_symlink():
        return None
    found = re.fullmatch(r"python(\d+)\.(\d+)", os.path.basename(os.readlink(link)))
    binary = _inside(Path(rootfs), PurePosixPath("usr/bin") / os.path.basename(os.readlink(link)))
    if found is None or not binary.is_file():
        return None
    with open(binary, "rb") as handle:
        header = handle.read(20)
    if header[:4] != b"\x7fELF":
        return None
    machine = ELF_MACHINES.get(int.from_bytes(header[18:20], "little"), f"elf-{header[18]}")
    return (int(found.group(1)), int(found.group(2))), machine


def check_wheels(rootfs: Path, wheel_names: Sequence[str]) -> list[str]:
    """The wheels that the tree's Python cannot install (wrong machine or Python version), so
    that a mismatch is found before flashing rather than by a board that is offline at its
    first boot. Empty when all fit, or when the tree's Python is not found (then nothing can
    be said)."""
    found = board_python(rootfs)
    if found is None:
        log.warning("no usr/bin/python3 in the tree: the wheels' platform is not checked")
        return []
    (major, minor), machine = found
    unfit = []
    for name in wheel_names:
        parts = name[:-4].split("-")
        if len(parts) < 5:
            unfit.append(name)
            continue
        python_tag, abi_tag, platform_tag = parts[-3], parts[-2], parts[-1]
        if platform_tag != "any" and machine not in platform_tag:
            unfit.append(name)
            continue
        versions = []
        for tag in python_tag.split("."):
            number = re.fullmatch(r"(?:cp|py)(\d)(\d*)", tag)
            if number:
                versions.append((int(number.group(1)), int(number.group(2) or -1), tag))
        if not versions:
            continue
        fits = False
        for tag_major, tag_minor, tag in versions:
            if tag_major != major:
                continue
            if tag.startswith("py") or tag_minor == -1:
                fits = True
            elif abi_tag == "abi3":
                fits = fits or tag_minor <= minor
            else:
                fits = fits or tag_minor == minor
        if not fits:
            unfit.append(name)
    return unfit
