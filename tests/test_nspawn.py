"""The service under a real systemd: a Debian root file system (mmdebstrap) with the agent
installed by tools/install_rootfs.py, booted with systemd-nspawn (slow; root only).

What is checked: the Python environment is built at first boot from the wheelhouse with no
network (the container has none), the daemon comes up at boot and is active only once it
serves, the hardening holds in the running process (its uid, no new privileges, the seccomp
filter, no capabilities, the video group), the power helper's socket serves the daemon's user
only, a hung daemon is killed by the watchdog and restarted, ``systemctl stop`` under load
drops no request, ``systemctl reload`` applies a changed setting, and the .deb installs,
upgrades (a reinstall: stop, which drains, switch, start) and purges cleanly.

Needs: root, ``systemd-nspawn`` and ``nsenter`` (package systemd-container), ``mmdebstrap``
(or a cached root file system), a Python 3.11 to match bookworm's for the wheelhouse, and
network for the first run's mmdebstrap and wheel downloads. Both are cached in
``$EDGE_AGENT_NSPAWN_CACHE`` (default /var/tmp/edge-agent-nspawn). The reference for how
nspawn is driven here: docs/reference/systemd_container.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGE_AGENT_NSPAWN_CACHE", "/var/tmp/edge-agent-nspawn"))
SUITE = "bookworm"
CONTAINER_PYTHON = (3, 11)  # bookworm's python3
BOOT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 240.0  # the first boot pip-installs numpy, onnxruntime and the rest


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn)"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container)"
    if not (CACHE / f"base-{SUITE}").is_dir() and shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed and no cached root file system"
    if sys.version_info[:2] != CONTAINER_PYTHON:
        return "the wheelhouse is built with this Python: it must be the container's 3.11"
    return None


if (_reason := _missing()) is not None:
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason=_reason)]


def run(argv: list[str], *, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                            **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise AssertionError(f"{argv[:4]} failed ({result.returncode}): "
                             f"{result.stderr[-2000:]}{result.stdout[-1000:]}")
    return result


def base_rootfs() -> Path:
    base = CACHE / f"base-{SUITE}"
    if not base.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = CACHE / f"base-{SUITE}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        run(["mmdebstrap", "--variant=minbase",
             "--include=systemd,systemd-sysv,dbus,python3,python3-venv", SUITE, str(partial)])
        partial.rename(base)
    return base


def wheelhouse() -> Path:
    """The device extra's wheels for the container's Python (downloaded once), and this
    checkout's own wheel, rebuilt every run."""
    wheels = CACHE / "wheels-py311"
    if not (wheels / ".complete").exists():
        run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels),
             f"{REPO}[device]"])
        (wheels / ".complete").touch()
    for old in wheels.glob("jetson_edge_agent-*.whl"):
        old.unlink()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(wheels), str(REPO)], cwd=str(CACHE))
    return wheels


class Container:
    """One booted container: ``systemd-nspawn -b`` in the background, commands run in it with
    ``nsenter`` once its leader is systemd."""

    def __init__(self, root: Path, name: str, log_path: Path) -> None:
        self.root = root
        self.name = name
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.bundle_key: Path | None = None  # the key the booted model's bundles are signed with

    def boot(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            ["systemd-nspawn", "-D", str(self.root), "-b", "-M", self.name, "--register=no",
             "--keep-unit", "--private-network",
             # BPF for the device policy (DevicePolicy=, BPF_CGROUP_DEVICE on cgroup v2).
             "--system-call-filter=bpf", "--capability=CAP_BPF"],
            env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            for child in self._children(self.process.pid):
                try:
                    comm = Path(f"/proc/{child}/comm").read_text().strip()
                except OSError:
                    continue
                if comm == "systemd":
                    self.leader = child
                    break
            if self.leader:
                break
            time.sleep(0.05)
        assert self.leader, "the container's systemd did not start"
        # Its bus comes up a moment after the process: wait until systemctl reaches it, then
        # until the boot is done.
        while time.monotonic() < deadline:
            result = self.exec("systemctl", "is-system-running", "--wait", check=False,
                               timeout=120)
            if "Failed to connect" not in result.stderr:
                return
            time.sleep(0.1)
        raise AssertionError(f"the container's systemd does not answer: {result.stderr}")

    @staticmethod
    def _children(pid: int) -> list[int]:
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return []
        return [int(word) for word in text.split()]

    def exec(self, *argv: str, check: bool = True, timeout: float = 120,
             input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *argv],
                                capture_output=True, text=True, timeout=timeout, check=False,
                                input=input_text, env=CONTAINER_ENV)
        if check and result.returncode != 0:
            raise AssertionError(f"{argv} failed ({result.returncode}): {result.stderr[-2000:]}"
                                 f"{result.stdout[-2000:]}\n{self.journal()}")
        return result

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.exec("systemctl", "show", unit, "-p", ",".join(properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str = "edge-agent.service", lines: int = 60) -> str:
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "journalctl",
                                 "--no-pager", "-u", unit, "-n", str(lines)],
                                capture_output=True, text=True, timeout=60, check=False,
                                env=CONTAINER_ENV)
        return result.stdout

    def python(self, code: str, *, timeout: float = 60, check: bool = True,
               user: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = ["/opt/edge-agent/venv/bin/python", "-c", code]
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *argv]
        return self.exec(*argv, timeout=timeout, check=check)

    def wait_active(self, unit: str = "edge-agent.service",
                    timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.show(unit, "ActiveState")["ActiveState"]
            if state == "active":
                return
            if state == "failed":
                break
            time.sleep(0.5)
        raise AssertionError(f"{unit} is not active: {self.show(unit, 'ActiveState', 'Result')}"
                             f"\n{self.journal('edge-agent-setup.service')}\n{self.journal()}")

    def poweroff(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # nspawn: a clean poweroff of the container
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.process = None
        self.leader = 0


# Commands in the container get a clean environment, not the host's (pip settings, a venv).
CONTAINER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "LANG": "C.UTF-8"}

READY_PROBE = textwrap.dedent("""
    import urllib.request, urllib.error, sys
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/v2/health/ready", timeout=2) as r:
            print(r.status)
    except urllib.error.HTTPError as exc:
        print(exc.code)
    except OSError as exc:
        print("down")
""")


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    from agent.fleet.ops.provision import add_device, init_workspace
    from agent.tooling.packaging import layout, rootfs
    from models.signing import public_key_path, write_keypair
    from tests.tiny_models import make_bundle

    work = tmp_path_factory.mktemp("nspawn")
    root = work / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(base_rootfs()), str(root)])
    write_keypair(work / "bundle")
    bundle, _ = make_bundle(work, key=_private_key(work / "bundle"))
    # A provisioned device, as flashing gives it: its broker is out of reach (the container
    # has no network), which the daemon must take in its stride.
    workspace = init_workspace(work / "fleet", fleet="plant", broker_host="broker.invalid")
    device = add_device(workspace, "nspawn-1").directory
    entries = layout.service_entries(REPO, wheelhouse=wheelhouse(), device_files=device,
                                     bundle_keys=[public_key_path(work / "bundle")])
    rootfs.install(root, entries)
    # The first model, installed into the tree's store as root (the daemon does not start
    # without one); StateDirectory= gives it to the daemon's user at the first start.
    rootfs.install_first_model(root, bundle, [public_key_path(work / "bundle")])
    (root / "etc/edge-agent/test").mkdir(mode=0o755)
    dropin = root / "etc/systemd/system/edge-agent.service.d"
    dropin.mkdir(parents=True)
    # A probe run in the daemon's own sandbox (ExecStartPost= gets the unit's settings): what
    # it may and may not do, written to its state directory.
    (root / "etc/edge-agent/test/sandbox_probe.py").write_text(SANDBOX_PROBE)
    (dropin / "60-sandbox-probe.conf").write_text(
        "[Service]\nExecStartPost=-/opt/edge-agent/venv/bin/python "
        "/etc/edge-agent/test/sandbox_probe.py\n")
    container = Container(root, "edge-agent-test", work / "nspawn.log")
    container.bundle_key = work / "bundle"
    container.boot()
    try:
        container.wait_active("edge-agent.service")
        yield container
    finally:
        container.poweroff()


SANDBOX_PROBE = textwrap.dedent("""
    import ctypes, errno, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    found = {}
    def call(name, function):
        try:
            result = function()
        except OSError as exc:
            found[name] = errno.errorcode.get(exc.errno, str(exc.errno))
            return
        if isinstance(result, int) and result == -1:
            found[name] = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
        else:
            found[name] = "allowed"
    call("setuid0", lambda: os.setuid(0))
    call("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
    call("reboot", lambda: libc.reboot(0x4321FEDC))  # RB_POWER_OFF: must never succeed
    call("unshare_user", lambda: libc.unshare(0x10000000))  # CLONE_NEWUSER
    call("packet_socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
    call("netlink_socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
    call("write_etc", lambda: open("/etc/x", "w"))
    call("write_opt", lambda: open("/opt/edge-agent/x", "w"))
    # A tun device node the test makes world-writable: open to anyone but for the device policy.
    call("open_tun", lambda: os.close(os.open("/dev/edge-agent-test-tun", os.O_RDWR)))
    call("tcp_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
    call("write_state", lambda: open("/var/lib/edge-agent/probe.tmp", "w").close())
    found["uid"] = os.getuid()
    with open("/var/lib/edge-agent/sandbox-probe.json", "w") as out:
        json.dump(found, out)
""")


def _private_key(path: Path):  # type: ignore[no-untyped-def]
    from models.signing import load_private_key

    return load_private_key(path)


def test_the_service_comes_up_at_boot_from_the_offline_wheelhouse(booted: Container) -> None:
    setup = booted.show("edge-agent-setup.service", "ActiveState", "Result")
    assert setup == {"ActiveState": "active", "Result": "success"}
    assert booted.exec("readlink", "/opt/edge-agent/venv").stdout.strip() == "venv-0.1.0"
    assert booted.exec("systemctl", "is-enabled", "edge-agent.service").stdout.strip() == \
        "enabled"
    main = booted.show("edge-agent.service", "ActiveState", "SubState", "StatusText", "Type")
    assert main["ActiveState"] == "active" and main["Type"] == "notify"
    assert "tiny v1" in main["StatusText"]
    assert booted.python(READY_PROBE).stdout.strip() == "200"
    # The owners and modes systemd gave at boot to what the installer wrote as root.
    owners = {path: booted.exec("stat", "-c", "%a %U %G", path).stdout.split() for path in (
        "/etc/edge-agent/agent.toml", "/etc/edge-agent/fleet", "/etc/edge-agent/fleet/mqtt-password",
        "/etc/edge-agent/fleet/fleet-ca.crt", "/var/lib/edge-agent", "/var/cache/edge-agent",
        "/usr/lib/systemd/system/edge-agent.service")}
    assert owners == {
        "/etc/edge-agent/agent.toml": ["640", "root", "edge-agent"],
        "/etc/edge-agent/fleet": ["750", "root", "edge-agent"],
        "/etc/edge-agent/fleet/mqtt-password": ["640", "root", "edge-agent"],
        "/etc/edge-agent/fleet/fleet-ca.crt": ["644", "root", "root"],
        "/var/lib/edge-agent": ["750", "edge-agent", "edge-agent"],
        "/var/cache/edge-agent": ["750", "edge-agent", "edge-agent"],
        "/usr/lib/systemd/system/edge-agent.service": ["644", "root", "root"],
    }


def test_active_only_once_it_serves(booted: Container) -> None:
    booted.exec("systemctl", "restart", "--no-block", "edge-agent.service")
    samples: list[tuple[str, str]] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        # systemd's state first, then the probe: "active" read before the probe must already
        # answer 200.
        state = booted.show("edge-agent.service", "ActiveState")["ActiveState"]
        ready = booted.python(READY_PROBE).stdout.strip()
        samples.append((state, ready))
        if state == "active" and len(samples) > 1:
            break
        time.sleep(0.05)
    # It was seen starting (activating, not yet serving), and never active without serving.
    assert any(state == "activating" for state, _ in samples), samples
    assert all(ready == "200" for state, ready in samples if state == "active"), samples


def test_the_hardening_holds_in_the_running_daemon(booted: Container) -> None:
    pid = booted.show("edge-agent.service", "MainPID")["MainPID"]
    status = dict(line.split(":\t", 1) for line in
                  booted.exec("cat", f"/proc/{pid}/status").stdout.splitlines() if ":\t" in line)
    uid = booted.exec("id", "-u", "edge-agent").stdout.strip()
    video = booted.exec("getent", "group", "video").stdout.split(":")[2]
    assert status["Uid"].split()[:2] == [uid, uid]
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # a filter is installed
    assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
    assert video in status["Groups"].split()
    # ProtectSystem=strict: the file system is read-only to it but for its state directory.
    probe = ("import os\nfor p in ('/etc/x', '/opt/edge-agent/x', '/var/lib/edge-agent/x'):\n"
             "    try:\n        open(p, 'w').close(); os.unlink(p); print(p, 'writable')\n"
             "    except OSError as e:\n        print(p, e.errno)\n")
    # Entering its mount namespace as its user: the file system as it sees it.
    seen = booted.exec("nsenter", "-t", pid, "-m", "-S", uid, "-G", uid,
                       "/opt/edge-agent/venv/bin/python", "-c", probe).stdout
    assert "/etc/x 30" in seen and "/opt/edge-agent/x 30" in seen, seen  # EROFS
    assert "/var/lib/edge-agent/x writable" in seen, seen
    # What a process in its sandbox may and may not do (the probe runs as ExecStartPost=).
    booted.exec("mknod", "-m", "666", "/dev/edge-agent-test-tun", "c", "10", "200")
    outside = booted.exec("/opt/edge-agent/venv/bin/python", "-c",
                          "import os; os.open('/dev/edge-agent-test-tun', os.O_RDWR); print('opened')",
                          check=False)
    booted.exec("systemctl", "restart", "edge-agent.service", timeout=READY_TIMEOUT_S)
    pid = booted.show("edge-agent.service", "MainPID")["MainPID"]
    probe = json.loads(booted.exec("cat", "/var/lib/edge-agent/sandbox-probe.json").stdout)
    assert probe.pop("uid") == int(uid)
    assert probe == {
        "setuid0": "EPERM",            # no capabilities, no new privileges
        "mount": "EPERM",              # the system call filter (@mount is not in @system-service)
        "reboot": "EPERM",             # the filter (@reboot), refused with EPERM not a kill
        "unshare_user": "EPERM",       # RestrictNamespaces=
        "packet_socket": "EAFNOSUPPORT",   # RestrictAddressFamilies=
        "netlink_socket": "EAFNOSUPPORT",
        "write_etc": "EROFS",          # ProtectSystem=strict
        "write_opt": "EROFS",
        "open_tun": "EPERM",           # DevicePolicy=closed
        "tcp_socket": "allowed",
        "write_state": "allowed",      # StateDirectory=
    }, probe
    assert outside.stdout.strip() == "opened", outside.stderr  # the node itself can be opened
    security = booted.exec("systemd-analyze", "security", "edge-agent.service", "--no-pager",
                           check=False).stdout
    level = float(security.rsplit("Overall exposure level for edge-agent.service: ", 1)[1]
                  .split()[0])
    assert level <= 2.0


def test_the_power_helper_serves_the_daemons_user_only(booted: Container) -> None:
    socket_stat = booted.exec("stat", "-c", "%a %U %G", "/run/edge-agent-power.sock").stdout
    assert socket_stat.split() == ["660", "root", "edge-agent"]
    hello = ("import json\nfrom power.helper_client import HelperWriter\n"
             "from agent.errors import PowerError\n"
             "w = HelperWriter()\ntry:\n    print(json.dumps(w.hello()))\n"
             "except (PowerError, OSError) as e:\n    print(json.dumps({'refused': str(e)}))\n")
    as_daemon = json.loads(booted.python(hello, user="edge-agent").stdout)
    assert as_daemon["ok"] is True and as_daemon["paths"] == []  # no Jetson files in here
    as_root = json.loads(booted.python(hello).stdout)
    assert "refused" in as_root
    helper = booted.show("edge-agent-power.service", "ActiveState", "MainPID")
    assert helper["ActiveState"] == "active"  # started by its socket


def test_a_hung_daemon_is_killed_by_the_watchdog_and_restarted(booted: Container) -> None:
    dropin = booted.root / "etc/systemd/system/edge-agent.service.d/60-watchdog.conf"
    dropin.write_text("[Service]\nWatchdogSec=3\n")
    try:
        booted.exec("systemctl", "daemon-reload")
        booted.exec("systemctl", "restart", "edge-agent.service", timeout=READY_TIMEOUT_S)
        before = booted.show("edge-agent.service", "MainPID", "NRestarts")
        booted.exec("sh", "-c", f"kill -STOP {before['MainPID']}")  # hung: no more watchdog pings
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = booted.show("edge-agent.service", "MainPID", "NRestarts", "ActiveState")
            if int(now["NRestarts"]) > int(before["NRestarts"]) and now["ActiveState"] == \
                    "active":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"not restarted: {now}\n{booted.journal()}")
        assert now["MainPID"] != before["MainPID"]
        assert "Watchdog timeout" in booted.journal(lines=200)
    finally:
        dropin.unlink()
        booted.exec("systemctl", "daemon-reload")
        booted.exec("systemctl", "restart", "edge-agent.service", timeout=READY_TIMEOUT_S)


LOAD_CLIENT = textwrap.dedent("""
    import http.client, json, sys, threading, time
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 16, 16],
                                   "datatype": "FP32", "data": [0.5] * 768}]}).encode()
    counts = {"ok": 0, "busy": 0, "refused": 0, "dropped": 0, "other": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + float(sys.argv[1])
    def worker():
        while time.monotonic() < stop_at:
            connection = http.client.HTTPConnection("127.0.0.1", 8000, timeout=30)
            try:
                connection.connect()
            except OSError:
                with lock:
                    counts["refused"] += 1
                time.sleep(0.01)
                continue
            try:
                connection.request("POST", "/v2/models/tiny/infer", body,
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                kind = {200: "ok", 503: "busy"}.get(response.status, "other")
            except (http.client.RemoteDisconnected, ConnectionResetError,
                    http.client.IncompleteRead, BrokenPipeError):
                kind = "dropped"
            finally:
                connection.close()
            with lock:
                counts[kind] += 1
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    print("started", flush=True)
    for thread in threads:
        thread.join()
    print(json.dumps(counts), flush=True)
""")


def test_stop_under_load_drops_no_accepted_request(booted: Container) -> None:
    client = subprocess.Popen(["nsenter", "-t", str(booted.leader), "-a",
                               "/opt/edge-agent/venv/bin/python", "-c", LOAD_CLIENT, "8"],
                              stdout=subprocess.PIPE, text=True, env=CONTAINER_ENV)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "started"
        time.sleep(2)
        booted.exec("systemctl", "stop", "edge-agent.service", timeout=120)
        counts = json.loads(client.stdout.readline())
        client.wait(timeout=60)
    finally:
        client.kill()
        booted.exec("systemctl", "start", "edge-agent.service", timeout=READY_TIMEOUT_S)
    print(f"stop under load: {counts}")
    assert counts["ok"] > 0
    # Every request the daemon accepted is answered (drained); only a connection caught in the
    # listen backlog as the listener closes may be reset by the kernel (see the .deb test).
    assert counts["dropped"] <= max(5, counts["ok"] // 1000), counts
    assert counts["other"] == 0, counts
    assert "Stopped" in booted.journal(lines=200) or counts["refused"] > 0


def test_reload_applies_a_changed_setting(booted: Container) -> None:
    config = booted.root / "etc/edge-agent/agent.toml"
    original = config.read_text()
    config.write_text(original.replace("max_queue_delay_us = 5000", "max_queue_delay_us = 1234"))
    try:
        pid = booted.show("edge-agent.service", "MainPID")["MainPID"]
        booted.exec("systemctl", "reload", "edge-agent.service", timeout=60)
        # RELOADING=1 from the daemon, then READY=1 once applied: "reloading" until then.
        booted.wait_active(timeout_s=30)
        after = booted.show("edge-agent.service", "MainPID", "ActiveState")
        assert after == {"MainPID": pid, "ActiveState": "active"}  # the same process
        journal = booted.journal(lines=100)
        assert "configuration reloaded" in journal and "max_queue_delay_us" in journal, journal
    finally:
        config.write_text(original)
        booted.exec("systemctl", "reload", "edge-agent.service", timeout=60)


def _process_status(container: Container, pid: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in
                container.exec("cat", f"/proc/{pid}/status").stdout.splitlines() if ":\t" in line)


FILE_WORKERS = textwrap.dedent("""
    import os, sys
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
            command = open(f"/proc/{pid}/cmdline", "rb").read()
        except (OSError, IndexError):
            continue
        if parent == sys.argv[1] and b"agent.update.fileworker" in command:
            print(pid)
""")


def _file_workers(container: Container, parent: str) -> list[str]:
    """The update file workers (agent/update/fileworker.py) whose parent is ``parent``."""
    return container.exec("/opt/edge-agent/venv/bin/python", "-c", FILE_WORKERS,
                          parent).stdout.split()


def test_an_update_runs_its_file_work_in_the_worker_under_the_unit(booted: Container,
                                                                    tmp_path: Path) -> None:
    """The unit's sandbox (ProtectSystem=strict, NoNewPrivileges=, the system call filter, the
    private /tmp) lets the daemon start its update file worker: it runs beside the daemon, as
    its user, below its priority, under the same filter, and a second version applied with
    ``edge-agent update apply`` is verified and staged by it (never by the daemon's fallback)
    and serves."""
    from tests.tiny_models import make_bundle

    assert booted.bundle_key is not None
    bundle, _ = make_bundle(tmp_path, version=2, key=_private_key(booted.bundle_key))
    inside = booted.root / "srv/edge-agent-test"
    inside.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle, inside / "tiny-2.bundle")
    (inside / "tiny-2.bundle").chmod(0o644)
    booted.exec("systemctl", "restart", "edge-agent.service", timeout=READY_TIMEOUT_S)
    main = booted.show("edge-agent.service", "MainPID")["MainPID"]
    deadline = time.monotonic() + 60
    while not (workers := _file_workers(booted, main)):  # started with the updater
        assert time.monotonic() < deadline, booted.journal(lines=200)
        time.sleep(0.2)
    assert len(workers) == 1, workers
    daemon, worker = _process_status(booted, main), _process_status(booted, workers[0])
    assert worker["Uid"] == daemon["Uid"] and worker["NoNewPrivs"].strip() == "1"
    assert worker["Seccomp"].strip() == "2" and int(worker["CapEff"], 16) == 0
    nice = int(booted.exec("cut", "-d", " ", "-f19", f"/proc/{workers[0]}/stat").stdout)
    assert nice >= 10, nice
    cgroup = booted.exec("cat", f"/proc/{workers[0]}/cgroup").stdout
    assert cgroup == booted.exec("cat", f"/proc/{main}/cgroup").stdout, cgroup
    applied = booted.exec("setpriv", "--reuid=edge-agent", "--regid=edge-agent",
                          "--init-groups", "/opt/edge-agent/venv/bin/edge-agent", "update",
                          "apply", "/srv/edge-agent-test/tiny-2.bundle", "--no-wait", "--json")
    assert applied.returncode == 0, applied.stderr
    deadline = time.monotonic() + 180  # the canary: canary_s of the configuration (30 s)
    status: dict[str, object] = {}
    while time.monotonic() < deadline:
        status = json.loads(booted.exec("/opt/edge-agent/venv/bin/edge-agent", "update",
                                        "status", "--json").stdout)
        serving = status.get("serving") or {}
        if isinstance(serving, dict) and serving.get("version") == 2:
            break
        assert status.get("state") != "failed", status
        time.sleep(1)
    else:
        raise AssertionError(f"v2 never served: {status}\n{booted.journal(lines=200)}")
    journal = booted.journal(lines=400)
    assert "the update's file work runs in the daemon" not in journal, journal
    assert f"update file worker pid {workers[0]} started" in journal, journal
    assert f"update file worker pid {workers[0]} ended" not in journal, journal
    assert _file_workers(booted, main) == workers  # the same worker, alive, for the next one
    assert booted.exec("test", "-f", "/var/lib/edge-agent/models/tiny/2/model.onnx").returncode \
        == 0
    leftovers = booted.exec("sh", "-c", "ls -a /var/lib/edge-agent/models/tiny "
                            "/var/lib/edge-agent/downloads 2>/dev/null").stdout
    assert ".extract-" not in leftovers and ".bundle" not in leftovers, leftovers
    booted.exec("systemctl", "stop", "edge-agent.service", timeout=120)
    try:
        assert booted.exec("test", "-d", f"/proc/{workers[0]}", check=False).returncode != 0
    finally:
        booted.exec("systemctl", "start", "edge-agent.service", timeout=READY_TIMEOUT_S)


def serving_model(container: Container, work: Path) -> None:
    """Give the installed package a model to serve: a bundle key trusted in agent.toml and a
    first model in the store, owned by the daemon's user."""
    from agent.tooling.packaging import rootfs
    from agent.tooling.packaging.layout import configured_toml
    from models.signing import load_private_key, public_key_path, write_keypair
    from tests.tiny_models import make_bundle

    write_keypair(work / "bundle")
    bundle, _ = make_bundle(work, key=load_private_key(work / "bundle"))
    shutil.copyfile(public_key_path(work / "bundle"),
                    container.root / "etc/edge-agent/keys/bundle.pub")
    config = container.root / "etc/edge-agent/agent.toml"
    config.write_text(configured_toml(config.read_text(), {
        "trust.public_keys": ["/etc/edge-agent/keys/bundle.pub"]}))
    rootfs.install_first_model(container.root, bundle, [public_key_path(work / "bundle")])
    container.exec("chown", "-R", "edge-agent:edge-agent", "/var/lib/edge-agent")


def test_the_deb_installs_upgrades_and_purges(tmp_path: Path) -> None:
    from agent.tooling.packaging.deb import build_deb

    deb = build_deb(REPO, tmp_path / "dist", wheelhouse=wheelhouse())
    root = tmp_path / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(base_rootfs()), str(root)])
    shutil.copyfile(deb, root / "root" / deb.name)
    container = Container(root, "edge-agent-deb", tmp_path / "nspawn.log")
    container.boot()
    try:
        container.exec("dpkg", "-i", f"/root/{deb.name}", timeout=READY_TIMEOUT_S)
        # No model is installed by the package: the daemon fails its start until one is given,
        # so the check here is that the units are in place, enabled, and the environment built.
        assert container.exec("systemctl", "is-enabled", "edge-agent.service").stdout.strip() \
            == "enabled"
        assert container.exec("readlink", "/opt/edge-agent/venv").stdout.strip() == \
            "venv-0.1.0"
        assert container.exec("id", "-nG", "edge-agent").stdout.split().count("video") == 1
        assert container.exec("stat", "-c", "%a %U %G", "/etc/edge-agent/agent.toml"
                              ).stdout.split() == ["640", "root", "edge-agent"]
        assert container.exec("systemctl", "is-active", "edge-agent-power.socket"
                              ).stdout.strip() == "active"
        # A model, as an operator gives a board in the field one: the bundle key trusted in
        # agent.toml (a changed conffile, which dpkg then keeps), the store given to the user.
        serving_model(container, tmp_path)
        container.exec("systemctl", "restart", "edge-agent.service", timeout=READY_TIMEOUT_S)
        container.wait_active()
        before = container.show("edge-agent.service", "MainPID")["MainPID"]
        # An upgrade under load (the same package again: dpkg runs the upgrade path, postinst
        # configure with the old version): the daemon drains, switches and starts again.
        client = subprocess.Popen(["nsenter", "-t", str(container.leader), "-a",
                                   "/opt/edge-agent/venv/bin/python", "-c", LOAD_CLIENT, "12"],
                                  stdout=subprocess.PIPE, text=True, env=CONTAINER_ENV)
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "started"
            time.sleep(2)
            container.exec("dpkg", "-i", f"/root/{deb.name}", timeout=READY_TIMEOUT_S)
            counts = json.loads(client.stdout.readline())
            client.wait(timeout=60)
        finally:
            client.kill()
        print(f"upgrade under load: {counts}")
        # The old daemon drains what it accepted; but a connection the kernel completed into
        # its listen backlog in the instant its listener closes is reset by the kernel, and the
        # client (which had sent its request) cannot tell that reset from a dropped request.
        # With 4 clients reconnecting in a tight loop this was 0-3 in 6000. Socket activation
        # (systemd holding the listener across the restart) would carry them over: not done.
        assert counts["ok"] > 0 and counts["other"] == 0, counts
        assert counts["dropped"] <= max(5, counts["ok"] // 1000), counts
        container.wait_active()
        assert container.show("edge-agent.service", "MainPID")["MainPID"] != before
        assert "trust" in container.exec("cat", "/etc/edge-agent/agent.toml").stdout
        container.exec("systemctl", "disable", "edge-agent.service")
        container.exec("dpkg", "-i", f"/root/{deb.name}", timeout=READY_TIMEOUT_S)  # again
        assert container.exec("systemctl", "is-enabled", "edge-agent.service",
                              check=False).stdout.strip() == "disabled"
        container.exec("dpkg", "--purge", "edge-agent", timeout=120)
        for path in ("/opt/edge-agent", "/etc/edge-agent", "/var/lib/edge-agent",
                     "/usr/lib/systemd/system/edge-agent.service"):
            assert container.exec("test", "-e", path, check=False).returncode == 1, path
        status = container.exec("dpkg-query", "-W", "-f=${Status}", "edge-agent",
                                check=False).stdout
        assert "installed" not in status.replace("not-installed", "")
    finally:
        container.poweroff()
