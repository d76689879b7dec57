"""tools/install_rootfs.py: the service installed into a temporary root file system tree, every
file, link, owner and mode checked, run twice (the same tree), and taken out again (the tree as
it was).

Owners: the tree is written as root (the tests run as whoever runs them; as root the files are
root's, as the flash tools want). The daemon's group is given to its files by
edge-agent.tmpfiles at boot, before which the user does not exist; the tests check that each
entry's recorded owner and mode is exactly what that tmpfiles line gives it, and the nspawn
test (tests/test_nspawn.py) reads them on a booted system.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent import __version__
from agent.errors import ConfigError, KeyFileError
from agent.tooling.packaging import layout, rootfs
from agent.tooling.packaging.layout import Entry, service_entries, tmpfiles_owners

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
OWNER_UID = os.geteuid() if os.geteuid() != 0 else 0
UNIT_DIR = "usr/lib/systemd/system"


def skeleton(root: Path) -> Path:
    """A root file system's bare folders, as an L4T rootfs has them."""
    for folder in ("etc/systemd/system", "usr/lib/systemd/system", "usr/share/doc", "opt",
                   "var/lib", "var/cache"):
        (root / folder).mkdir(parents=True)
    (root / "etc/hostname").write_text("board\n")
    return root


def wheelhouse(root: Path, *others: str) -> Path:
    # The installer copies wheels and checks their names; it never opens them (the board's pip
    # does), so their content here is only bytes to compare.
    root.mkdir(parents=True, exist_ok=True)
    for name in (f"jetson_edge_agent-{__version__}-py3-none-any.whl", *others):
        (root / name).write_bytes(f"wheel {name}".encode())
    return root


def snapshot(root: Path) -> dict[str, tuple[str, int, int, int, str, float]]:
    """Every path under ``root``: kind, mode, uid, gid, content or link target, mtime."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            if path.is_symlink():
                kind, what = "link", os.readlink(path)
            elif path.is_dir():
                kind, what = "dir", ""
            else:
                kind, what = "file", path.read_bytes().hex()[:64] + str(info.st_size)
            found[str(path.relative_to(root))] = (kind, info.st_mode & 0o7777, info.st_uid,
                                                  info.st_gid, what, info.st_mtime)
    return found


def as_it_was(found: dict[str, tuple[str, int, int, int, str, float]]) -> dict[str, tuple]:
    """A snapshot less directories' mtimes (removing what was added inside one changes it)."""
    return {path: item[:5] + ((item[5],) if item[0] != "dir" else ())
            for path, item in found.items()}


def make_device(tmp_path: Path) -> Path:
    from agent.fleet.ops.provision import add_device, init_workspace
    from models.signing import write_keypair

    write_keypair(tmp_path / "bundle")
    workspace = init_workspace(tmp_path / "fleet", fleet="plant", broker_host="broker.lan",
                               bundle_keys=[tmp_path / "bundle.pub"])
    return add_device(workspace, "cam-01").directory


def test_the_tree_holds_every_file_link_owner_and_mode(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    before = set(snapshot(tree))
    device = make_device(tmp_path)
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"), device_files=device)
    rootfs.install(tree, entries)
    after = snapshot(tree)
    files = {path: (mode, uid) for path, (kind, mode, uid, _, _, _) in after.items()
             if kind == "file"}
    expected_files = {
        f"{UNIT_DIR}/edge-agent.service": 0o644,
        f"{UNIT_DIR}/edge-agent-power.socket": 0o644,
        f"{UNIT_DIR}/edge-agent-power.service": 0o644,
        f"{UNIT_DIR}/edge-agent-setup.service": 0o644,
        "usr/lib/sysusers.d/edge-agent.conf": 0o644,
        "usr/lib/tmpfiles.d/edge-agent.conf": 0o644,
        "usr/lib/edge-agent/build-venv": 0o755,
        "usr/share/doc/edge-agent/README.md": 0o644,
        "usr/share/edge-agent/installed.json": 0o644,
        "opt/edge-agent/version": 0o644,
        "opt/edge-agent/requirements.txt": 0o644,
        f"opt/edge-agent/wheelhouse/jetson_edge_agent-{__version__}-py3-none-any.whl": 0o644,
        "etc/edge-agent/agent.toml": 0o640,
        "etc/edge-agent/fleet/mqtt-password": 0o640,
        "etc/edge-agent/fleet/fleet-ca.crt": 0o644,
        "etc/edge-agent/fleet/fleet.pub": 0o644,
        "etc/edge-agent/fleet/bundle-keys/bundle-1.pub": 0o644,
        "etc/hostname": 0o644,
    }
    assert {path: mode for path, (mode, _) in files.items()} == expected_files
    assert {uid for path, (_, uid) in files.items() if path != "etc/hostname"} == {OWNER_UID}
    links = {path: what for path, (kind, _, _, _, what, _) in after.items() if kind == "link"}
    assert links == {
        "etc/systemd/system/multi-user.target.wants/edge-agent.service":
            f"/{UNIT_DIR}/edge-agent.service",
        "etc/systemd/system/multi-user.target.wants/edge-agent-setup.service":
            f"/{UNIT_DIR}/edge-agent-setup.service",
        "etc/systemd/system/sockets.target.wants/edge-agent-power.socket":
            f"/{UNIT_DIR}/edge-agent-power.socket",
    }
    dirs = {path: mode for path, (kind, mode, _, _, _, _) in after.items()
            if kind == "dir" and path not in before}
    assert dirs["etc/edge-agent/fleet"] == 0o750
    assert all(mode == 0o755 for path, mode in dirs.items() if path != "etc/edge-agent/fleet")
    for name in ("usr/lib/systemd/system/edge-agent.service", "etc/edge-agent/agent.toml"):
        assert (tree / name).read_bytes() != b""
    assert (tree / "opt/edge-agent/requirements.txt").read_text() == \
        f"jetson-edge-agent[device]=={__version__}\n"
    assert (tree / "etc/edge-agent/fleet/mqtt-password").read_bytes() == \
        (device / "mqtt-password").read_bytes()


def test_the_enable_links_are_the_ones_systemctl_makes(tmp_path: Path) -> None:
    if shutil.which("systemctl") is None:
        pytest.skip("systemctl is not installed")
    ours = skeleton(tmp_path / "ours")
    theirs = skeleton(tmp_path / "theirs")
    rootfs.install(ours, service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh")))
    rootfs.install(theirs, service_entries(REPO, wheelhouse=tmp_path / "wh", enable_links=False))
    result = subprocess.run(["systemctl", f"--root={theirs}", "enable", *layout.UNIT_NAMES],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr

    def links(root: Path) -> dict[str, str]:
        return {path: what for path, (kind, _, _, _, what, _) in snapshot(root).items()
                if kind == "link"}

    assert links(ours) == links(theirs)
    assert len(links(ours)) == 3


def test_owners_given_at_boot_are_what_tmpfiles_gives(tmp_path: Path) -> None:
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"),
                              device_files=make_device(tmp_path))
    boot = tmpfiles_owners((REPO / "systemd/edge-agent.tmpfiles").read_text())
    for entry in entries:
        if entry.kind == "link":
            continue
        path = f"/{entry.path}"
        if path in boot:
            assert boot[path] == (entry.mode, entry.owner), path
        else:
            # Not named by tmpfiles: it stays as the install wrote it, root's.
            assert entry.owner == "root:root", path
    secrets = [entry for entry in entries if entry.path.name in ("mqtt-password", "agent.toml")]
    assert {(entry.mode, entry.owner) for entry in secrets} == {(0o640, "root:edge-agent")}
    # The state directory is the unit's StateDirectory=, not tmpfiles' (see the first model).
    assert "/var/lib/edge-agent" not in boot


def test_the_configuration_is_the_documented_example_with_the_device_values(
        tmp_path: Path) -> None:
    device = make_device(tmp_path)
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"), device_files=device,
                              bundle_keys=[tmp_path / "bundle.pub"])
    config = next(entry for entry in entries if str(entry.path) == "etc/edge-agent/agent.toml")
    assert config.data is not None and config.config
    text = config.data.decode()
    values = tomllib.loads(text)
    provisioned = tomllib.loads((device / "agent.toml").read_text())
    assert values["device_id"] == "cam-01"
    for key, value in provisioned["fleet"].items():
        assert values["fleet"][key] == value, key
    assert values["trust"]["public_keys"] == [
        "/etc/edge-agent/fleet/bundle-keys/bundle-1.pub", "/etc/edge-agent/keys/bundle.pub"]
    example = tomllib.loads((REPO / "systemd/agent.toml.example").read_text())
    assert values["serving"] == example["serving"]
    # The comments stay: the file still documents every key.
    assert "# Fleet control over MQTT" in text
    assert text.count("\n#") == (REPO / "systemd/agent.toml.example").read_text().count("\n#")
    # Every file the configuration names is installed where it says.
    installed = {f"/{entry.path}" for entry in entries}
    assert values["fleet"]["password_file"] in installed
    assert set(values["fleet"]["public_keys"]) <= installed
    assert set(values["trust"]["public_keys"]) <= installed


def test_the_configuration_loads_as_the_daemon_reads_it(tmp_path: Path) -> None:
    from agent.config.load import load_config

    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"), device_id="cam-07")
    config = next(entry for entry in entries if str(entry.path) == "etc/edge-agent/agent.toml")
    assert config.data is not None
    (tmp_path / "agent.toml").write_bytes(config.data)
    loaded = load_config(tmp_path / "agent.toml", env={})
    assert loaded.device_id == "cam-07"
    assert str(loaded.state_dir) == "/var/lib/edge-agent"


def test_without_device_files_a_placeholder_says_how_to_provision(tmp_path: Path) -> None:
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"))
    readme = next(entry for entry in entries if str(entry.path) == "etc/edge-agent/fleet/README")
    assert readme.data is not None and b"fleet devices add" in readme.data
    config = next(entry for entry in entries if str(entry.path) == "etc/edge-agent/agent.toml")
    assert config.data == (REPO / "systemd/agent.toml.example").read_bytes()


def test_a_second_install_leaves_the_same_tree(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"),
                              device_files=make_device(tmp_path))
    rootfs.install(tree, entries)
    first = snapshot(tree)
    report = rootfs.install(tree, entries)
    assert report.written == []
    assert snapshot(tree) == first  # mtimes included: nothing was rewritten


def test_uninstall_gives_back_the_tree_as_it_was(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    before = snapshot(tree)
    rootfs.install(tree, service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"),
                                         device_files=make_device(tmp_path)))
    # What the board makes at boot goes too: the environments and the link to the current one.
    (tree / "opt/edge-agent/venv-0.1.0/bin").mkdir(parents=True)
    (tree / "opt/edge-agent/venv").symlink_to("venv-0.1.0")
    rootfs.uninstall(tree)
    assert as_it_was(snapshot(tree)) == as_it_was(before)


def test_a_changed_configuration_is_kept_and_the_new_one_written_beside_it(
        tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    entries = service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"))
    rootfs.install(tree, entries)
    config = tree / "etc/edge-agent/agent.toml"
    config.write_text(config.read_text().replace('level = "info"', 'level = "debug"'))
    changed = config.read_text()
    entries = service_entries(REPO, wheelhouse=tmp_path / "wh", device_id="cam-02")
    report = rootfs.install(tree, entries)
    assert report.kept == ["etc/edge-agent/agent.toml"]
    assert config.read_text() == changed
    assert 'device_id = "cam-02"' in (tree / "etc/edge-agent/agent.toml.new").read_text()
    rootfs.uninstall(tree)
    assert config.read_text() == changed  # an operator's file survives an uninstall
    assert not (tree / "etc/edge-agent/agent.toml.new").exists()
    assert not (tree / "usr/lib/systemd/system/edge-agent.service").exists()


def test_purge_removes_the_changed_configuration_and_the_model_store(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    before = snapshot(tree)
    rootfs.install(tree, service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh")))
    (tree / "etc/edge-agent/agent.toml").write_text("# mine\n")
    (tree / "var/lib/edge-agent/models").mkdir(parents=True)
    rootfs.uninstall(tree, purge=True)
    assert snapshot(tree).keys() == before.keys()


def test_a_new_wheelhouse_replaces_the_old_wheels(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    rootfs.install(tree, service_entries(
        REPO, wheelhouse=wheelhouse(tmp_path / "old", "numpy-1.0-cp310-cp310-linux_aarch64.whl")))
    rootfs.install(tree, service_entries(
        REPO, wheelhouse=wheelhouse(tmp_path / "new", "numpy-2.0-cp310-cp310-linux_aarch64.whl")))
    wheels = sorted(path.name for path in (tree / "opt/edge-agent/wheelhouse").iterdir())
    assert wheels == [f"jetson_edge_agent-{__version__}-py3-none-any.whl",
                      "numpy-2.0-cp310-cp310-linux_aarch64.whl"]


def test_a_wheelhouse_without_this_agent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "jetson_edge_agent-0.0.1-py3-none-any.whl").write_bytes(b"old")
    with pytest.raises(ConfigError, match="no wheel of this agent"):
        service_entries(REPO, wheelhouse=tmp_path / "wh")


def test_a_private_key_is_not_taken_as_a_bundle_key(tmp_path: Path) -> None:
    from models.signing import write_keypair

    write_keypair(tmp_path / "bundle")
    with pytest.raises(KeyFileError):
        service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"),
                        bundle_keys=[tmp_path / "bundle"])


def test_a_link_out_of_the_tree_is_refused_and_nothing_is_written_outside(
        tmp_path: Path) -> None:
    tree = tmp_path / "rootfs"
    tree.mkdir()
    outside = tmp_path / "host-etc"
    outside.mkdir()
    (tree / "etc").symlink_to(outside)  # an absolute link, as /etc would be read on the host
    entries = [Entry(path=layout.CONFIG_PATH.parent, kind="dir", mode=0o755)]
    with pytest.raises(ConfigError, match="outside the root file system"):
        rootfs.install(tree, entries)
    assert list(outside.iterdir()) == []


def test_something_foreign_in_the_way_stops_the_install(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    wants = tree / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir()
    (wants / "edge-agent.service").symlink_to("/dev/null")  # masked by someone
    with pytest.raises(ConfigError, match="did not make"):
        rootfs.install(tree, service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh")))


def test_uninstall_of_a_tree_without_an_install_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no edge-agent install"):
        rootfs.uninstall(skeleton(tmp_path / "rootfs"))


def test_the_command_line_installs_and_uninstalls(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    before = snapshot(tree)
    command = [sys.executable, str(REPO / "tools/install_rootfs.py"), "--rootfs", str(tree)]
    done = subprocess.run([*command, "--wheelhouse", str(wheelhouse(tmp_path / "wh")),
                           "--device-id", "cam-09"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert 'device_id = "cam-09"' in (tree / "etc/edge-agent/agent.toml").read_text()
    missing = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "--wheelhouse" in missing.stderr
    undone = subprocess.run([*command, "--uninstall"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert undone.returncode == 0, undone.stderr
    assert as_it_was(snapshot(tree)) == as_it_was(before)


def test_a_first_model_is_installed_into_the_trees_store_and_made_current(
        tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from agent.store.store import ModelStore
    from models.signing import load_private_key, load_public_key, write_keypair
    from tests.tiny_models import make_bundle

    write_keypair(tmp_path / "bundle")
    bundle, _ = make_bundle(tmp_path, key=load_private_key(tmp_path / "bundle"))
    tree = skeleton(tmp_path / "rootfs")
    rootfs.install(tree, service_entries(REPO, wheelhouse=wheelhouse(tmp_path / "wh"),
                                         bundle_keys=[tmp_path / "bundle.pub"]))
    assert rootfs.install_first_model(tree, bundle, [tmp_path / "bundle.pub"]) == "tiny v1"
    first = snapshot(tree / "var/lib/edge-agent")
    assert rootfs.install_first_model(tree, bundle, [tmp_path / "bundle.pub"]) == "tiny v1"
    again = snapshot(tree / "var/lib/edge-agent")
    # The store's lock file holds the pid of its last opener; nothing else is rewritten.
    assert again.keys() == first.keys()
    assert {path: item for path, item in as_it_was(again).items() if path != "lock"} == \
        {path: item for path, item in as_it_was(first).items() if path != "lock"}
    with ModelStore(tree / "var/lib/edge-agent",
                    trusted_keys=[load_public_key(tmp_path / "bundle.pub")]) as store:
        current = store.current()
        assert current is not None and (current.name, current.version) == ("tiny", 1)
    # Root's until the first start: StateDirectory= hands the store to the user then.
    assert (tree / "var/lib/edge-agent").stat().st_mode & 0o777 == 0o750
    write_keypair(tmp_path / "other")
    from agent.errors import SignatureError

    with pytest.raises(SignatureError):
        rootfs.install_first_model(skeleton(tmp_path / "r2"), bundle, [tmp_path / "other.pub"])


def board_with_python(root: Path, version: str, machine: int) -> Path:
    """A tree whose usr/bin/python3 links to an ELF binary header for ``machine`` (the header
    is what is read: e_machine at byte 18)."""
    tree = skeleton(root)
    (tree / "usr/bin").mkdir(parents=True)
    header = b"\x7fELF\x02\x01\x01" + b"\0" * 11 + machine.to_bytes(2, "little") + b"\0" * 44
    (tree / f"usr/bin/python{version}").write_bytes(header)
    (tree / "usr/bin/python3").symlink_to(f"python{version}")
    return tree


def test_wheels_for_another_board_are_found_before_flashing(tmp_path: Path) -> None:
    orin = board_with_python(tmp_path / "jp6", "3.10", 0xB7)  # aarch64, JetPack 6's Python
    assert rootfs.board_python(orin) == ((3, 10), "aarch64")
    wheels = [
        f"jetson_edge_agent-{__version__}-py3-none-any.whl",
        "numpy-2.2.6-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
        "cryptography-46.0.3-cp38-abi3-manylinux_2_28_aarch64.whl",
        "numpy-2.2.6-cp311-cp311-manylinux_2_17_aarch64.whl",   # another Python
        "httptools-0.6.4-cp310-cp310-manylinux_2_17_x86_64.whl",  # another machine
        "cryptography-46.0.3-cp311-abi3-manylinux_2_28_aarch64.whl",  # abi3 newer than 3.10
    ]
    assert rootfs.check_wheels(orin, wheels) == wheels[3:]
    assert rootfs.check_wheels(skeleton(tmp_path / "bare"), wheels) == []  # nothing to check


def test_the_command_line_refuses_a_wheelhouse_for_another_board(tmp_path: Path) -> None:
    orin = board_with_python(tmp_path / "jp6", "3.10", 0xB7)
    house = wheelhouse(tmp_path / "wh", "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.whl")
    result = subprocess.run([sys.executable, str(REPO / "tools/install_rootfs.py"), "--rootfs",
                             str(orin), "--wheelhouse", str(house)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.whl" in result.stderr
    assert not (orin / "etc/edge-agent").exists()  # nothing installed


def test_a_manifest_not_written_by_the_installer_is_refused(tmp_path: Path) -> None:
    tree = skeleton(tmp_path / "rootfs")
    (tree / "usr/share/edge-agent").mkdir(parents=True)
    (tree / rootfs.MANIFEST).write_text('{"entries": "all of /etc"}')
    with pytest.raises(ConfigError, match="not one this installer wrote"):
        rootfs.uninstall(tree)
    assert (tree / "etc/hostname").exists()
