"""The Debian package for boards already in the field: ``edge-agent_VERSION_ARCH.deb``, built
with ``dpkg-deb`` from the same entries as the root file system install
(:func:`agent.tooling.packaging.layout.service_entries`, without the enable links, which the
postinst makes, and without device credentials, which are per device).

Maintainer scripts are ``systemd/deb/{postinst,prerm,postrm}`` (what each does is written at
its top): the user and owners at install, the offline environment build, enabling on the first
install only, an upgrade that builds the new environment beside the running daemon and then
stops it (it drains), switches and starts it, and a purge of the model store and credentials.
``/etc/edge-agent/agent.toml`` is a conffile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agent import __version__
from agent.errors import ConfigError
from agent.tooling.packaging.layout import service_entries

__all__ = ["PACKAGE", "build_deb", "deb_architecture"]

PACKAGE = "edge-agent"
SCRIPTS = ("postinst", "prerm", "postrm")
# Python 3.10 or newer (JetPack 6's); venv for the environment; systemd for sysusers/tmpfiles.
DEPENDS = "python3 (>= 3.10), python3-venv, systemd (>= 245)"
ARCHITECTURES = {"aarch64": "arm64", "x86_64": "amd64"}


def deb_architecture(wheel_names: Sequence[str]) -> str:
    """The package's architecture from its wheels' platform tags: ``arm64`` for aarch64
    wheels, ``amd64`` for x86_64 ones, ``all`` when every wheel is pure Python.

    Raises:
        ConfigError: wheels of two architectures, or of one Debian has no name for here.
    """
    found: set[str] = set()
    for name in wheel_names:
        platform = name[:-4].split("-")[-1]
        if platform == "any":
            continue
        for machine, arch in ARCHITECTURES.items():
            if machine in platform:
                found.add(arch)
                break
        else:
            raise ConfigError("a wheel for a platform the package cannot name", wheel=name)
    if len(found) > 1:
        raise ConfigError("the wheelhouse mixes architectures", found=",".join(sorted(found)))
    return found.pop() if found else "all"


def _control(arch: str, installed_kib: int) -> str:
    return (f"Package: {PACKAGE}\n"
            f"Version: {__version__}\n"
            f"Architecture: {arch}\n"
            "Maintainer: Jetson edge agent maintainers <edge-agent@localhost>\n"
            f"Installed-Size: {installed_kib}\n"
            f"Depends: {DEPENDS}\n"
            "Section: net\n"
            "Priority: optional\n"
            "Description: Jetson edge deployment agent (model serving, power, fleet updates)\n"
            " Serves signed INT8 model bundles over HTTP (KServe v2) with dynamic batching,\n"
            " governs the board's clocks for a latency target, and takes model updates\n"
            " from its fleet over MQTT, as the systemd service edge-agent.service with an\n"
            " unprivileged daemon and a socket-activated privileged power helper.\n")


def build_deb(source: Path, out_dir: Path, *, wheelhouse: Path,
              extras: Sequence[str] = ("device",), arch: str | None = None) -> Path:
    """Build the package into ``out_dir``; returns its path.

    Raises:
        ConfigError: ``dpkg-deb`` is missing or fails, or an input is (layout's errors).
    """
    if shutil.which("dpkg-deb") is None:
        raise ConfigError("dpkg-deb is not installed (Debian's dpkg package)")
    entries = service_entries(Path(source), wheelhouse=Path(wheelhouse), extras=extras,
                              enable_links=False)
    wheels = [entry.path.name for entry in entries if entry.path.suffix == ".whl"]
    arch = arch or deb_architecture(wheels)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{PACKAGE}_{__version__}_{arch}.deb"
    with tempfile.TemporaryDirectory(prefix="edge-agent-deb.") as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir(mode=0o755)
        size_bytes = 0
        conffiles = []
        for entry in entries:
            path = tree / entry.path
            if entry.kind == "dir":
                path.mkdir(mode=entry.mode, parents=True, exist_ok=True)
                os.chmod(path, entry.mode)
            elif entry.kind == "file":
                assert entry.data is not None  # the layout's files carry their content
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(entry.data)
                os.chmod(path, entry.mode)
                size_bytes += len(entry.data)
                if entry.config:
                    conffiles.append(f"/{entry.path}")
        control = tree / "DEBIAN"
        control.mkdir(mode=0o755)
        (control / "control").write_text(_control(arch, (size_bytes + 1023) // 1024))
        (control / "conffiles").write_text("".join(f"{path}\n" for path in conffiles))
        for name in SCRIPTS:
            shutil.copyfile(Path(source) / "systemd" / "deb" / name, control / name)
            os.chmod(control / name, 0o755)
        for path in (control / "control", control / "conffiles"):
            os.chmod(path, 0o644)
        # --root-owner-group: every file root:root in the archive whoever builds it; the
        # daemon's group is given at install by systemd-tmpfiles (the postinst).
        result = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build",
                                 str(tree), str(target)], capture_output=True, text=True,
                                timeout=600, check=False)
        if result.returncode != 0:
            raise ConfigError("dpkg-deb failed", status=result.returncode,
                              stderr=result.stderr.strip()[-500:])
    return target
