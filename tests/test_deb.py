"""tools/build_deb.py: the package's contents, control data and maintainer scripts.

The scripts run here for real against a package unpacked into a temporary root, the way
``dpkg --root`` runs them (``$DPKG_ROOT``): systemd-sysusers, systemd-tmpfiles and systemctl
work on that root offline; only build-venv is replaced by a recorder (building the environment
needs the board's wheels; tests/test_nspawn.py installs, upgrades and purges the package on a
booted Debian). Needs dpkg-deb and systemd's tools; skipped where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.errors import ConfigError
from agent.tooling.packaging.deb import build_deb, deb_architecture
from agent.tooling.packaging.layout import service_entries

REPO = Path(__file__).resolve().parents[1]
WHEEL = f"jetson_edge_agent-{__version__}-py3-none-any.whl"

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("dpkg-deb", "systemd-sysusers",
                                                "systemd-tmpfiles", "systemctl")),
    reason="needs dpkg-deb and systemd's tools")


@pytest.fixture
def deb(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / WHEEL).write_bytes(b"wheel bytes")  # copied, never opened, by the packaging
    return build_deb(REPO, tmp_path / "dist", wheelhouse=wheels)


def dpkg_deb(*args: str) -> str:
    result = subprocess.run(["dpkg-deb", *args], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_package_holds_the_layout_owned_by_root(deb: Path, tmp_path: Path) -> None:
    assert deb.name == f"edge-agent_{__version__}_all.deb"
    listing = {}
    for line in dpkg_deb("--contents", str(deb)).splitlines():
        mode, owner, _size, _date, _time, name = line.split(None, 5)
        listing[name.removeprefix("./").rstrip("/")] = (mode, owner)
    listing.pop("")
    wheels = tmp_path / "wheels"
    expected = {str(entry.path): entry for entry in service_entries(
        REPO, wheelhouse=wheels, enable_links=False)}
    top_level = {name for name in listing if "/" not in name}
    assert set(listing) - top_level == set(expected)
    assert {owner for _, owner in listing.values()} == {"root/root"}
    for name, entry in expected.items():
        mode, _ = listing[name]
        assert mode[0] == ("d" if entry.kind == "dir" else "-"), name
        assert _mode_bits(mode) == entry.mode, name
    assert not any(name.startswith("etc/systemd") for name in listing)  # postinst enables


def _mode_bits(text: str) -> int:
    bits = 0
    for char, bit in zip(text[1:], (0o400, 0o200, 0o100, 0o40, 0o20, 0o10, 4, 2, 1)):
        bits |= bit if char != "-" else 0
    return bits


def test_control_conffiles_and_scripts(deb: Path, tmp_path: Path) -> None:
    fields = dict(line.split(": ", 1) for line in dpkg_deb("--field", str(deb)).splitlines()
                  if ": " in line and not line.startswith(" "))
    assert fields["Package"] == "edge-agent"
    assert fields["Version"] == __version__
    assert fields["Architecture"] == "all"
    assert "python3-venv" in fields["Depends"]
    control = tmp_path / "control"
    dpkg_deb("--control", str(deb), str(control))
    assert (control / "conffiles").read_text() == "/etc/edge-agent/agent.toml\n"
    for name in ("postinst", "prerm", "postrm"):
        assert (control / name).stat().st_mode & 0o777 == 0o755
        assert (control / name).read_bytes() == (REPO / "systemd/deb" / name).read_bytes()
        assert subprocess.run(["sh", "-n", str(control / name)], timeout=30).returncode == 0


def unpack(deb: Path, root: Path) -> Path:
    for folder in ("etc", "var/lib", "var/cache", "opt", "usr/lib"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    dpkg_deb("-x", str(deb), str(root))
    recorder = root / "usr/lib/edge-agent/build-venv"
    recorder.write_text('#!/bin/sh\necho "$EDGE_AGENT_PREFIX $*" >> "$RECORD"\n')
    recorder.chmod(0o755)
    return root


def run_script(deb: Path, root: Path, record: Path, script: str, *args: str) -> None:
    result = subprocess.run(["sh", str(REPO / "systemd/deb" / script), *args],
                            env={**os.environ, "DPKG_ROOT": str(root), "RECORD": str(record)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def group_id(root: Path, name: str) -> int:
    for line in (root / "etc/group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2])
    raise AssertionError(f"no group {name}")


def links(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in (root / "etc/systemd").rglob("*")
            if path.is_symlink()} if (root / "etc/systemd").exists() else set()


def test_install_makes_the_user_the_owners_the_environment_and_enables(deb: Path,
                                                                       tmp_path: Path) -> None:
    root = unpack(deb, tmp_path / "root")
    record = tmp_path / "record"
    run_script(deb, root, record, "postinst", "configure")
    passwd = (root / "etc/passwd").read_text()
    assert "edge-agent:x:" in passwd and "/usr/sbin/nologin" in passwd
    members = {line.split(":")[0]: line.split(":")[3]
               for line in (root / "etc/group").read_text().splitlines()}
    assert "edge-agent" in members["video"].split(",")
    assert "edge-agent" in members["render"].split(",")
    gid = group_id(root, "edge-agent")
    config = (root / "etc/edge-agent/agent.toml").stat()
    assert (config.st_uid, config.st_gid, config.st_mode & 0o777) == (0, gid, 0o640)
    # The state directory is the unit's StateDirectory=: made at the daemon's first start.
    assert not (root / "var/lib/edge-agent").exists()
    prefix = f"{root}/opt/edge-agent"
    assert record.read_text().splitlines() == [f"{prefix} --prepare", f"{prefix} --switch"]
    assert links(root) == {
        "etc/systemd/system/multi-user.target.wants/edge-agent.service",
        "etc/systemd/system/multi-user.target.wants/edge-agent-setup.service",
        "etc/systemd/system/sockets.target.wants/edge-agent-power.socket"}


def test_an_upgrade_keeps_an_operators_disable(deb: Path, tmp_path: Path) -> None:
    root = unpack(deb, tmp_path / "root")
    record = tmp_path / "record"
    run_script(deb, root, record, "postinst", "configure")
    subprocess.run(["systemctl", f"--root={root}", "disable", "edge-agent.service"],
                   capture_output=True, timeout=60, check=True)
    run_script(deb, root, record, "postinst", "configure", "0.0.9")
    assert "etc/systemd/system/multi-user.target.wants/edge-agent.service" not in links(root)
    assert record.read_text().splitlines()[-2:] == [f"{root}/opt/edge-agent --prepare",
                                                    f"{root}/opt/edge-agent --switch"]


def test_remove_disables_and_deletes_the_environments_and_purge_the_data(
        deb: Path, tmp_path: Path) -> None:
    root = unpack(deb, tmp_path / "root")
    record = tmp_path / "record"
    run_script(deb, root, record, "postinst", "configure")
    (root / "opt/edge-agent/venv-0.1.0/bin").mkdir(parents=True)
    (root / "opt/edge-agent/venv").symlink_to("venv-0.1.0")
    (root / "var/lib/edge-agent/models").mkdir(parents=True)  # as the daemon leaves it
    (root / "etc/edge-agent/fleet/mqtt-password").write_text("secret\n")
    run_script(deb, root, record, "prerm", "remove")
    run_script(deb, root, record, "postrm", "remove")
    assert links(root) == set()
    assert not (root / "opt/edge-agent/venv").exists()
    assert not (root / "opt/edge-agent/venv-0.1.0").exists()
    assert (root / "var/lib/edge-agent/models").is_dir()  # remove keeps the models
    run_script(deb, root, record, "postrm", "purge")
    for path in ("var/lib/edge-agent", "var/cache/edge-agent", "etc/edge-agent"):
        assert not (root / path).exists(), path
    assert "edge-agent:x:" in (root / "etc/passwd").read_text()  # the user stays


def test_the_architecture_comes_from_the_wheels() -> None:
    assert deb_architecture([WHEEL]) == "all"
    assert deb_architecture([WHEEL, "numpy-2.2.6-cp310-cp310-manylinux_2_17_aarch64."
                                    "manylinux2014_aarch64.whl"]) == "arm64"
    assert deb_architecture(["numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.whl"]) == "amd64"
    with pytest.raises(ConfigError, match="mixes"):
        deb_architecture(["a-1-cp310-cp310-linux_aarch64.whl",
                          "b-1-cp310-cp310-linux_x86_64.whl"])
    with pytest.raises(ConfigError, match="cannot name"):
        deb_architecture(["a-1-cp310-cp310-macosx_11_0_arm64.whl"])


def test_the_command_line_builds_the_package(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / WHEEL).write_bytes(b"wheel")
    result = subprocess.run([sys.executable, str(REPO / "tools/build_deb.py"), "--out",
                             str(tmp_path / "out"), "--wheelhouse", str(wheels), "--arch",
                             "arm64"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).name == f"edge-agent_{__version__}_arm64.deb"
    refused = subprocess.run([sys.executable, str(REPO / "tools/build_deb.py"), "--out",
                              str(tmp_path / "out"), "--wheelhouse", str(tmp_path)],
                             capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode == 1 and "no wheel of this agent" in refused.stderr
