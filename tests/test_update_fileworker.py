"""The update's file worker process (agent/update/fileworker.py): errors cross the process
boundary with their reason and facts, a worker that dies fails its call and is replaced, it
never outlives the daemon, it stays small and below the daemon's priority, and a staging
directory it was writing is removed by the store's next start."""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent import __version__, errors
from agent.control import client as _control_client  # noqa: F401 - its CommandError is checked too
from agent.errors import AgentError, BundleError, SignatureError, UpdateError
from agent.store.store import ModelStore
from agent.update.fileworker import FileWorker
from models.bundle import open_bundle
from models.signing import generate_private_key
from tests.tiny_models import make_bundle

ROOT = Path(__file__).resolve().parent.parent


def _all_error_classes() -> list[type[AgentError]]:
    found: list[type[AgentError]] = []
    pending = [AgentError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda cls: cls.__qualname__)


# Values for the arguments some classes require of their own (CommandError's command,
# BudgetUnreachableError's judges...): the pickling must carry them like any other attribute.
_ARGUMENTS: dict[str, Any] = {"reason": "some_reason", "field": "model.sha256",
                              "command": "update.apply", "judges": [{"name": "top1"}],
                              "sensitivity": []}
_FACTS: dict[str, Any] = {"path": Path("/var/lib/x.bundle"), "found": 3, "expected": "<= 2"}


def _takes_facts(cls: type[AgentError]) -> bool:
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD
               for parameter in inspect.signature(cls.__init__).parameters.values())


def _make(cls: type[AgentError]) -> AgentError:
    if cls is errors.MissingDependencyError:  # its facts are attributes of its own
        return cls("onnxruntime", "device", "serving", found="no module")  # type: ignore[call-arg]
    arguments: dict[str, Any] = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        required = (parameter.kind is inspect.Parameter.KEYWORD_ONLY
                    and parameter.default is inspect.Parameter.empty)
        if required or name in ("reason", "field"):
            arguments[name] = _ARGUMENTS.get(name, f"some {name}")
    if _takes_facts(cls):
        arguments.update(_FACTS)
    return cls("it went wrong\nover two lines", **arguments)


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda cls: cls.__name__)
def test_every_agent_error_pickles_with_its_reason_and_facts(cls: type[AgentError]) -> None:
    error = _make(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert copy.message == error.message
    assert copy.fields == error.fields
    if cls is not errors.MissingDependencyError and _takes_facts(cls):
        assert copy.fields["path"] == Path("/var/lib/x.bundle") and copy.fields["found"] == 3
    assert copy.args == error.args
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
    if "reason" in inspect.signature(cls.__init__).parameters:
        assert copy.reason == "some_reason"  # type: ignore[attr-defined]


def test_the_error_classes_the_worker_raises_are_among_those_checked() -> None:
    names = {cls.__name__ for cls in _all_error_classes()}
    assert {"BundleError", "SignatureError", "UpdateError", "StoreError",
            "DownloadError"} <= names
    assert errors.InternalError not in _all_error_classes()


def _raw(key: Any) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)  # type: ignore[no-any-return]


@pytest.fixture
def worker() -> Iterator[FileWorker]:
    worker = FileWorker(nice=os.getpriority(os.PRIO_PROCESS, 0) + 10)
    try:
        yield worker
    finally:
        worker.close()


def _tampered(bundle: Path) -> Path:
    from models.tarscan import DEFAULT_LIMITS, open_bundle_file, scan_members

    with open_bundle_file(bundle) as handle:
        offset = scan_members(handle, bundle, DEFAULT_LIMITS)["model.onnx"].offset_data
    data = bytearray(bundle.read_bytes())
    data[offset + 10] ^= 0xFF
    tampered = bundle.with_name("tampered.bundle")
    tampered.write_bytes(bytes(data))
    return tampered


def test_a_bundle_refused_in_the_worker_raises_the_same_error_as_in_the_daemon(
        tmp_path: Path, worker: FileWorker) -> None:
    bundle, key = make_bundle(tmp_path, version=2)
    tampered = _tampered(bundle)
    stranger = generate_private_key()
    cases = [(tampered, key, BundleError), (bundle, stranger, SignatureError)]
    for path, trusted, expected_type in cases:
        with pytest.raises(expected_type) as in_daemon:
            open_bundle(path, [trusted.public_key()], agent_version=__version__)
        with pytest.raises(expected_type) as in_worker:
            worker.call("open_checked", path=str(path), public_keys=[_raw(trusted)],
                        agent_version=__version__)
        assert type(in_worker.value) is type(in_daemon.value)
        assert in_worker.value.message == in_daemon.value.message
        assert in_worker.value.fields == in_daemon.value.fields
        assert in_worker.value.fields  # the facts: the path, the member or the key id
    opened = worker.call("open_checked", path=str(bundle), public_keys=[_raw(key)],
                         agent_version=__version__)
    assert (opened["manifest"]["name"], opened["manifest"]["version"]) == ("tiny", 2)
    assert opened["sha256"] == __import__("hashlib").sha256(bundle.read_bytes()).hexdigest()
    assert worker.starts == 1  # a refusal is an answer, not a dead worker


def test_the_worker_is_below_the_daemons_priority_and_imports_nothing_heavy(
        worker: FileWorker) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    answer = worker.call("ping")
    assert answer["pid"] != os.getpid() and answer["pid"] == worker.pid
    assert answer["nice"] >= base + 10
    assert answer["heavy_modules"] == []
    assert answer["rss_kib"] is not None and answer["rss_kib"] < 80 * 1024


def _stuck_call(worker: FileWorker) -> tuple[threading.Thread, dict[str, Any]]:
    """A call the worker cannot answer (it is stopped), in a thread."""
    worker.start()
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGSTOP)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = worker.call("ping")
        except AgentError as exc:
            result["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive()
    return thread, result


def test_a_worker_killed_during_a_call_fails_it_with_a_reason_and_is_replaced(
        worker: FileWorker) -> None:
    thread, result = _stuck_call(worker)
    first = worker.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)  # as the OOM killer would
    thread.join(10)
    assert not thread.is_alive()
    error = result["error"]
    assert isinstance(error, UpdateError) and error.reason == "worker_died", error
    assert error.fields["status"] == "killed by SIGKILL" and error.fields["task"] == "ping"
    answer = worker.call("ping")
    assert answer["pid"] != first and worker.starts == 2


def test_kill_ends_a_call_in_flight_at_once(worker: FileWorker) -> None:
    thread, result = _stuck_call(worker)
    started = time.monotonic()
    worker.kill()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert result["error"].reason == "worker_died"


def test_a_stopped_worker_refuses_calls_and_close_does_not_hang_on_a_call_in_flight(
        worker: FileWorker) -> None:
    thread, _ = _stuck_call(worker)
    pid = worker.pid
    started = time.monotonic()
    worker.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert pid is not None and not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    with pytest.raises(UpdateError) as refused:
        worker.call("ping")
    assert refused.value.reason == "worker_unavailable"


def _is_zombie(pid: int | None) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_worker_that_cannot_start_says_so() -> None:
    worker = FileWorker(nice=10, python="/nonexistent/python3")
    with pytest.raises(UpdateError) as refused:
        worker.call("ping")
    assert refused.value.reason == "worker_unavailable" and "cause" in refused.value.fields
    broken = FileWorker(nice=10, python=sys.executable, start_timeout_s=1.0)
    broken.python = "/bin/false"
    with pytest.raises(UpdateError) as died:
        broken.start()
    assert died.value.reason == "worker_unavailable"
    assert died.value.fields["status"] == "exit status 1"


# A daemon with a worker, idle or mid-call: a call on a FIFO nobody writes to, whose open()
# blocks for good (a hung read of a dead mount would look the same).
_PARENT = """
import os, sys, threading, time
from agent.update.fileworker import FileWorker
worker = FileWorker(nice=10)
worker.start()
if sys.argv[1] == "mid-call":
    os.mkfifo(sys.argv[2])
    threading.Thread(target=worker.call, args=("open_checked",), kwargs=dict(
        path=sys.argv[2], public_keys=[], agent_version="0.1.0", sha256=None),
        daemon=True).start()
    time.sleep(0.3)
print(worker.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("when", ["idle", "mid-call"])
def test_the_worker_does_not_outlive_a_daemon_killed_with_sigkill(when: str,
                                                                   tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, when, str(tmp_path / "fifo")],
                              stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert Path(f"/proc/{pid}").exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and not _is_zombie(pid):
            assert time.monotonic() < deadline, f"the worker {pid} outlived its daemon"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def test_a_sigkill_mid_extraction_leaves_nothing_the_next_start_does_not_clean(
        tmp_path: Path, worker: FileWorker) -> None:
    bundle, key = make_bundle(tmp_path, version=2)
    state = tmp_path / "state"
    manifest = open_bundle(bundle, [key.public_key()]).manifest
    # Where in the call a kill lands is up to the scheduler (before the first member, in the
    # middle, after the last): whatever it left, the next start removes it.
    for attempt in range(3):
        worker.start()  # so that the kill below ends a running worker, not a starting one
        store = ModelStore(state, trusted_keys=[key.public_key()]).open()
        staging = store.begin_install(manifest)
        assert staging is not None and staging.parent == state / "models" / "tiny"
        done = threading.Event()

        def write(directory: Path = staging, done: threading.Event = done) -> None:
            try:
                worker.call("write_members", path=str(bundle), public_keys=[_raw(key)],
                            agent_version=__version__, directory=str(directory),
                            name="tiny", version=2)
            except UpdateError:
                pass
            finally:
                done.set()

        threading.Thread(target=write, daemon=True).start()
        if attempt == 0:
            worker.kill()  # likely before the first member
        elif attempt == 1:
            time.sleep(0.002)  # somewhere in the middle, or done
            worker.kill()
        done.wait(10)  # attempt 2: written in full, never renamed (the daemon died first)
        assert staging.exists()
        store.close()  # the daemon is gone; its store's next start:
        reopened = ModelStore(state, trusted_keys=[key.public_key()]).open()
        try:
            assert sorted(path.name for path in (state / "models" / "tiny").iterdir()) == []
            assert reopened.versions("tiny") == []
        finally:
            reopened.close()
    assert worker.starts >= 2


def test_the_store_installs_what_the_worker_wrote_and_refuses_what_it_did_not(
        tmp_path: Path, worker: FileWorker) -> None:
    bundle, key = make_bundle(tmp_path, version=2)
    with ModelStore(tmp_path / "state", trusted_keys=[key.public_key()]) as store:
        manifest = open_bundle(bundle, [key.public_key()]).manifest
        staging = store.begin_install(manifest)
        assert staging is not None
        written = worker.call("write_members", path=str(bundle), public_keys=[_raw(key)],
                              agent_version=__version__, directory=str(staging),
                              name="tiny", version=2)
        (staging / "model.onnx").write_bytes(b"short")  # not what the worker wrote
        with pytest.raises(errors.StoreError, match="not a file of its size"):
            store.finish_install(staging, written["manifest"], written["manifest_bytes"],
                                 written["key_id"])
        assert not staging.exists() and store.versions("tiny") == []
        staging = store.begin_install(manifest)
        assert staging is not None
        written = worker.call("write_members", path=str(bundle), public_keys=[_raw(key)],
                              agent_version=__version__, directory=str(staging),
                              name="tiny", version=2)
        artifacts = store.finish_install(staging, written["manifest"], written["manifest_bytes"],
                                         written["key_id"])
        assert artifacts.version == 2 and store.versions("tiny") == [2]
        assert store.load("tiny", 2).version == 2  # verifies in full, as at a start
        assert store.begin_install(manifest) is None  # installed: the store's own install
        with pytest.raises(BundleError, match="changed since it was verified"):
            worker.call("write_members", path=str(bundle), public_keys=[_raw(key)],
                        agent_version=__version__, directory=str(tmp_path),
                        name="tiny", version=3)


def test_a_download_in_the_worker_reports_its_progress_and_its_refusals(
        tmp_path: Path, worker: FileWorker) -> None:
    from agent.errors import DownloadError
    from agent.update.download import DownloadPolicy

    bundle, _ = make_bundle(tmp_path, version=2)
    reports: list[Any] = []
    result = worker.call("fetch", on_progress=reports.append, source=bundle.as_uri(),
                         destination=str(tmp_path / "got.bundle"), policy=DownloadPolicy(),
                         expected_sha256=None)
    assert result.path == tmp_path / "got.bundle"
    assert result.path.read_bytes() == bundle.read_bytes()
    assert reports and reports[-1].received_bytes == bundle.stat().st_size
    with pytest.raises(DownloadError) as missing:
        worker.call("fetch", source=(tmp_path / "absent.bundle").as_uri(),
                    destination=str(tmp_path / "absent-copy.bundle"),
                    policy=DownloadPolicy(deadline_s=1.0), expected_sha256=None)
    assert missing.value.reason == "not_found", missing.value
    assert "absent.bundle" in str(missing.value)
    assert worker.starts == 1
