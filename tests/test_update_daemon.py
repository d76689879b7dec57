"""Updates on a running daemon, end to end: `update.apply` over the control socket while clients
are served, the canary and the watch window catching bundles that misbehave, the refusals of
bundles that must never be applied, and the served version following the swap everywhere."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import load_config
from agent.control.client import CommandError, ControlClient
from agent.control.protocol import SOCKET_NAME, UPDATE_APPLY, UPDATE_ROLLBACK, UPDATE_STATUS
from agent.daemon import Daemon
from agent.run import run_foreground
from agent.update.canary import CanaryPolicy
from agent.update.states import UpdatePolicy
from models.signing import generate_private_key, load_private_key, write_keypair
from tests.tiny_models import make_bundle

pytest.importorskip("onnxruntime")


class Clients:
    """Closed-loop clients sending real requests until stopped; every answer's version and
    every failure are kept."""

    def __init__(self, port: int, *, count: int = 2, negative: Callable[[], bool] = lambda: False
                 ) -> None:
        self.port = port
        self.versions: list[str] = []
        self.failures: list[str] = []
        self.negative = negative
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(seed,), daemon=True)
                         for seed in range(count)]

    def _loop(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            images = np.abs(rng.normal(size=(1, 3, 16, 16))).astype(np.float32)
            if self.negative():
                images = -images
            body = json.dumps({"inputs": [{"name": "input", "shape": list(images.shape),
                                           "datatype": "FP32",
                                           "data": images.ravel().tolist()}]}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/v2/models/tiny/infer", data=body,
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    self.versions.append(json.loads(response.read())["model_version"])
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                self.failures.append(repr(exc))

    async def __aenter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Joined off the loop: the daemon answering their last requests runs on it.
        self._stop.set()
        for thread in self._threads:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Any]:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    key = load_private_key(key_path)
    bundle, _ = make_bundle(tmp_path, key=key)
    config = load_config(None, env={}, overrides={
        "state_dir": tmp_path / "state", "http.port": 0, "serving.backend": "onnxruntime",
        "trust.public_keys": [Path(str(key_path) + ".pub")]})
    installer = Daemon(config)
    installer.make_current(installer.install(bundle))
    installer.close()
    return {"config": config, "key": key, "dir": tmp_path}


def _daemon(setup: dict[str, Any], **canary: Any) -> Daemon:
    policy = {"duration_s": 5.0, "min_samples": 16,
              "watch_min_requests": 20, **canary}
    return Daemon(setup["config"], canary_policy=CanaryPolicy(**policy),
                  update_policy=UpdatePolicy(watch_window_s=1.5))


def _call(daemon: Daemon, command: str, args: dict[str, Any] | None = None,
          events: list[dict[str, Any]] | None = None) -> Any:
    client = ControlClient(daemon.config.state_dir / SOCKET_NAME)
    return client.call(command, args or {}, on_event=events.append if events is not None
                       else None, timeout_s=60)


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()  # type: ignore[no-any-return]


def _url(path: Path) -> str:
    return path.resolve().as_uri()


async def _until_idle(daemon: Daemon, timeout_s: float = 30.0) -> dict[str, Any]:
    """The updater's status once it rests (the watch window over)."""
    assert daemon.updater is not None
    deadline = time.monotonic() + timeout_s
    while daemon.updater.state.value not in ("idle", "failed"):
        assert time.monotonic() < deadline, daemon.updater.status()
        await asyncio.sleep(0.05)
    return daemon.updater.status()


def test_an_update_swaps_while_clients_are_served_and_every_answer_names_its_version(
        setup: dict[str, Any]) -> None:
    bundle, _ = make_bundle(setup["dir"], version=2, key=setup["key"])
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        async with Clients(port) as clients:
            await asyncio.sleep(0.3)
            events: list[dict[str, Any]] = []
            result = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(bundle)},
                                      events)
            await asyncio.sleep(0.3)
            status = await _until_idle(daemon)
        metrics = (await _in_thread(_get, f"http://127.0.0.1:{port}/metrics")).decode()
        model = json.loads(await _in_thread(_get, f"http://127.0.0.1:{port}/v2/models/tiny"))
        return {"result": result, "events": events, "clients": clients, "status": status,
                "metrics": metrics, "model": model}

    out = run_foreground(daemon, session=session)
    clients = out["clients"]
    assert out["result"]["state"] == "committed"
    assert out["result"]["serving"] == {"name": "tiny", "version": 2}
    states = [event["state"] for event in out["events"] if event["kind"] == "state"]
    assert states[:7] == ["downloading", "verifying", "staged", "building-engine", "warming",
                          "canary", "committed"]
    assert clients.failures == []
    assert clients.versions[0] == "1" and clients.versions[-1] == "2"
    # Once an answer came from v2, no later one came from v1: the swap is one switch.
    first_new = clients.versions.index("2")
    assert set(clients.versions[first_new:]) == {"2"}
    assert out["status"]["last_outcome"]["result"] == "committed"
    metrics = out["metrics"]
    assert 'edge_agent_model_version{model="tiny"} 2.0' in metrics
    assert 'edge_agent_update_state{state="idle"} 1.0' in metrics
    assert 'edge_agent_update_state{state="canary"} 0.0' in metrics
    assert "edge_agent_swap_duration_seconds_count 1.0" in metrics
    assert 'edge_agent_canary_verdicts_total{verdict="healthy"} 1.0' in metrics
    assert "edge_agent_update_attempts_total 1.0" in metrics
    assert 'edge_agent_instances{model="tiny"} 1.0' in metrics
    assert out["model"]["versions"] == ["2"]
    canary = out["status"]["counters"]["canary_verdicts"]
    assert canary["healthy"] == 1
    # Nothing of the update is left behind: the store has its copy of the bundle, and the
    # new version's loading thread has ended.
    assert list((setup["config"].state_dir / "downloads").iterdir()) == []
    assert not [thread.name for thread in threading.enumerate()
                if thread.name.startswith("update-v")]
    store = Daemon(setup["config"]).store.open()
    try:
        assert store.current().version == 2 and store.previous().version == 1
    finally:
        store.close()


@pytest.mark.parametrize(("fault", "seed", "reason"), [
    ("nan", 0, "non_finite"),  # NaN on every input: its warm-up finds it before any canary
    (None, 7, "disagreement"),  # other weights: other classes than the serving version's
    # Far slower than the whole cost of a request: the test's clients share the daemon's process,
    # whose CPU time the old version's cost includes.
    ("very_slow", 0, "slow"),
])
def test_a_bundle_that_misbehaves_is_caught_before_commit_and_the_old_version_serves_on(
        setup: dict[str, Any], fault: str | None, seed: int, reason: str) -> None:
    bundle, _ = make_bundle(setup["dir"], version=2, key=setup["key"], fault=fault, seed=seed)
    daemon = _daemon(setup, max_latency_ratio=4.0)

    async def session(port: int) -> dict[str, Any]:
        async with Clients(port) as clients:
            await asyncio.sleep(0.3)
            result = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(bundle)})
            status = await _until_idle(daemon)
        metrics = (await _in_thread(_get, f"http://127.0.0.1:{port}/metrics")).decode()
        return {"result": result, "clients": clients, "status": status, "metrics": metrics}

    out = run_foreground(daemon, session=session)
    assert out["result"]["state"] == "failed"
    assert out["result"]["error"]["reason"] == reason, out["result"]
    assert out["result"]["serving"] == {"name": "tiny", "version": 1}
    assert out["clients"].failures == []
    assert set(out["clients"].versions) == {"1"}
    assert f'edge_agent_update_failures_total{{reason="{reason}"}} 1.0' in out["metrics"]


def test_a_regression_after_commit_is_rolled_back_by_the_watch_window(
        setup: dict[str, Any]) -> None:
    bundle, _ = make_bundle(setup["dir"], version=2, key=setup["key"], fault="nan_on_negative")
    daemon = Daemon(setup["config"],
                    canary_policy=CanaryPolicy(duration_s=5.0, min_samples=16,
                                               watch_min_requests=20),
                    update_policy=UpdatePolicy(watch_window_s=60.0))
    negative = threading.Event()

    async def session(port: int) -> dict[str, Any]:
        async with Clients(port, negative=negative.is_set) as clients:
            await asyncio.sleep(0.3)
            result = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(bundle)})
            negative.set()  # the inputs change after commit: v2 answers NaN
            status = await _until_idle(daemon)
            await asyncio.sleep(0.3)
        return {"result": result, "clients": clients, "status": status,
                "version": daemon.services["tiny"].version}

    out = run_foreground(daemon, session=session)
    assert out["result"]["state"] == "committed"
    assert out["version"] == 1
    outcome = out["status"]["last_outcome"]
    assert outcome["result"] == "failed" and outcome["reason"] == "non_finite", outcome
    assert out["clients"].versions[-1] == "1"


def test_the_first_canary_of_a_daemon_imports_nothing_while_it_shadows(
        setup: dict[str, Any]) -> None:
    # The canary's verdict runs on the event loop: a first-time import there holds every request
    # in flight. numpy 2 imports numpy.ma on a process's first np.percentile (the old version's
    # P95 in the canary's figures): 8 ms on the development VM idle, 19 ms during the swap
    # benchmark, which saw one batch of its first swap held that long. A fresh interpreter, since
    # this one has long imported everything.
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    public_key = setup["dir"] / "keys" / "fleet.key.pub"
    done = subprocess.run(
        [sys.executable, "-m", "tests.canary_first_use", str(setup["dir"] / "state"),
         str(public_key)], capture_output=True, text=True, timeout=120, env=env, cwd=root,
        check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    verdict = found["verdict"]
    assert verdict["passed"] and verdict["reason"] == "ok", verdict
    assert verdict["samples"] >= 24 and verdict["old_p95_ms"] is not None, verdict
    assert found["imported"] == []


def test_bundles_that_must_never_apply_are_refused_with_their_reason(
        setup: dict[str, Any]) -> None:
    directory: Path = setup["dir"]
    stranger, _ = make_bundle(directory / "stranger", version=2, key=generate_private_key())
    other_model, _ = make_bundle(directory, name="other", version=2, key=setup["key"])
    same, _ = make_bundle(directory / "again", version=1, key=setup["key"])
    truncated = directory / "truncated.bundle"
    good, _ = make_bundle(directory, version=3, key=setup["key"])
    truncated.write_bytes(good.read_bytes()[:2000])
    elsewhere, _ = make_bundle(directory / "agx", version=4, key=setup["key"],
                               manifest_extra={"targets": ["orin-agx-64gb"]})
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for label, source in (("stranger", _url(stranger)), ("other", _url(other_model)),
                              ("truncated", _url(truncated)), ("elsewhere", _url(elsewhere)),
                              ("missing", _url(directory / "nowhere.bundle"))):
            result = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": source})
            found[label] = result["error"]["reason"] if result["error"] else result["state"]
        found["same"] = (await _in_thread(_call, daemon, UPDATE_APPLY,
                                          {"source": _url(same)}))["state"]
        found["version"] = daemon.services["tiny"].version
        return found

    found = run_foreground(daemon, session=session)
    assert found == {"stranger": "bad_signature", "other": "wrong_model",
                     "truncated": "bad_bundle", "elsewhere": "wrong_target",
                     "missing": "not_found", "same": "idle",
                     "version": 1}


def test_the_new_versions_batch_limits_take_effect_at_the_swap(setup: dict[str, Any]) -> None:
    bundle, _ = make_bundle(setup["dir"], version=2, key=setup["key"], manifest_extra={
        "max_batch": 4, "opt_batch": 2,
        "engine_profile": {"batch": [1, 2, 4], "height": [8, 16, 64], "width": [8, 16, 64]}})
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        batcher = daemon.services["tiny"].batcher
        before = (batcher.max_batch_size, batcher.policy.preferred_batch_sizes)
        await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(bundle)})
        config = json.loads(await _in_thread(_get, f"http://127.0.0.1:{port}/v2/models/tiny/config"))
        return {"before": before, "after": (batcher.max_batch_size,
                                            batcher.policy.preferred_batch_sizes),
                "config": config}

    out = run_foreground(daemon, session=session)
    assert out["before"] == (32, (8,))
    assert out["after"] == (4, (2,))
    assert out["config"]["max_batch_size"] == 4
    assert out["config"]["dynamic_batching"]["preferred_batch_size"] == [2]


def test_a_downgrade_is_refused_and_a_rollback_returns_to_the_previous_version(
        setup: dict[str, Any]) -> None:
    directory: Path = setup["dir"]
    v2, _ = make_bundle(directory, version=2, key=setup["key"])
    v1_again, _ = make_bundle(directory / "old", version=1, key=setup["key"])
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        async with Clients(port) as clients:
            await asyncio.sleep(0.2)
            applied = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v2)})
            await _until_idle(daemon)
            downgrade = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v1_again)})
            rolled = await _in_thread(_call, daemon, UPDATE_ROLLBACK)
            status = await _in_thread(_call, daemon, UPDATE_STATUS)
            await asyncio.sleep(0.2)
        return {"applied": applied, "downgrade": downgrade, "rolled": rolled,
                "status": status, "clients": clients}

    out = run_foreground(daemon, session=session)
    assert out["applied"]["serving"]["version"] == 2
    assert out["downgrade"]["error"]["reason"] == "downgrade"
    assert out["rolled"]["serving"] == {"name": "tiny", "version": 1}
    assert out["status"]["serving"]["version"] == 1
    assert out["clients"].failures == []
    assert out["clients"].versions[-1] == "1"


def test_a_rollback_with_no_version_before_is_refused_and_nothing_is_counted_failed(
        setup: dict[str, Any]) -> None:
    """Only v1 is installed: 'update rollback' is refused up front with its reason, and the
    updater stays idle (it used to start a rollback that ended failed/rollback_failed, counted
    among the update failures and shown as the last error, for a request that had nothing to
    do)."""
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        try:
            await _in_thread(_call, daemon, UPDATE_ROLLBACK)
        except CommandError as exc:
            refused: Any = exc
        else:
            refused = None
        status = await _in_thread(_call, daemon, UPDATE_STATUS)
        assert daemon.updater is not None
        return {"refused": refused, "status": status, "updater": daemon.updater.status()}

    out = run_foreground(daemon, session=session)
    assert out["refused"] is not None and out["refused"].reason == "nothing_to_roll_back"
    assert out["status"]["state"] == "idle" and out["status"]["error"] is None, out["status"]
    assert out["status"]["serving"]["version"] == 1
    assert out["updater"]["counters"]["failures_by_reason"] == {}


def test_files_that_cannot_be_removed_do_not_turn_a_refusal_into_a_failed_rollback(
        setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A disk gone read-only under the state directory: removing the download's files fails
    (EROFS), and the refused update must still end with its own reason, v1 serving."""
    import errno

    import agent.update.steps

    def read_only(destination: Path) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(destination) + ".part")

    monkeypatch.setattr(agent.update.steps, "discard_partial", read_only)
    stranger, _ = make_bundle(setup["dir"] / "stranger", version=2, key=generate_private_key())
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        refused = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(stranger)})
        status = await _until_idle(daemon)
        return {"refused": refused, "status": status,
                "version": daemon.services["tiny"].version}

    out = run_foreground(daemon, session=session)
    assert out["refused"]["error"]["reason"] == "bad_signature", out["refused"]
    outcome = out["status"]["last_outcome"]
    assert (outcome["result"], outcome["reason"]) == ("failed", "bad_signature"), outcome
    assert out["version"] == 1
    assert "could not remove the download's files" in caplog.text


def test_an_authorised_downgrade_applies_an_older_version_through_the_canary(
        setup: dict[str, Any]) -> None:
    from agent.update.updater import UpdateRequest

    directory: Path = setup["dir"]
    v1 = directory / "tiny-1.bundle"  # the fixture's, installed and then superseded
    v2, _ = make_bundle(directory, version=2, key=setup["key"])
    daemon = _daemon(setup)

    async def session(port: int) -> dict[str, Any]:
        assert daemon.updater is not None
        async with Clients(port) as clients:
            await asyncio.sleep(0.2)
            await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v2)})
            await _until_idle(daemon)
            refused = await daemon.updater.request(UpdateRequest(source=_url(v1)))
            await daemon.updater.wait()
            refusal = daemon.updater.status()["last_outcome"]
            allowed = await daemon.updater.request(UpdateRequest(source=_url(v1),
                                                                 allow_downgrade=True))
            journalled, deadline = None, time.monotonic() + 30
            while journalled is None or journalled.update_id != allowed.update_id:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
                journalled = (await _in_thread(daemon.updater.journal.load)).doc.update
            status = await _until_idle(daemon)
            await asyncio.sleep(0.2)
        return {"refused": refused, "refusal": refusal, "allowed": allowed, "status": status,
                "journalled": journalled, "clients": clients}

    out = run_foreground(daemon, session=session)
    assert out["refused"].result == "started"
    assert (out["refusal"]["result"], out["refusal"]["reason"]) == ("failed", "downgrade")
    assert out["allowed"].result == "started"
    assert out["journalled"] is not None and out["journalled"].allow_downgrade
    outcome = out["status"]["last_outcome"]
    assert (outcome["result"], outcome["bundle"]["version"]) == ("committed", 1)
    assert out["clients"].failures == []
    assert out["clients"].versions[-1] == "1"
    store = Daemon(setup["config"]).store.open()
    try:
        assert store.current().version == 1 and store.previous().version == 2
    finally:
        store.close()


def test_an_apply_needs_a_url_the_updater_can_fetch(setup: dict[str, Any]) -> None:
    daemon = _daemon(setup)

    async def session(port: int) -> str:
        try:
            await _in_thread(_call, daemon, UPDATE_APPLY, {"source": "ftp://host/b.bundle"})
        except CommandError as exc:
            return str(exc)
        return "accepted"

    assert "http, https or file URL" in run_foreground(daemon, session=session)


def test_serve_bundle_refuses_a_bundle_for_other_devices(setup: dict[str, Any]) -> None:
    from agent.errors import BundleError

    bundle, _ = make_bundle(setup["dir"] / "nano", version=5, key=setup["key"],
                            manifest_extra={"targets": ["orin-nano-8gb"]})
    daemon = Daemon(setup["config"])
    try:
        with pytest.raises(BundleError, match="for other devices"):
            daemon.install(bundle)
        assert 5 not in daemon.store.versions("tiny")
    finally:
        daemon.close()
    nano = Daemon(load_config(None, env={}, overrides={
        "state_dir": setup["config"].state_dir, "device_class": "orin-nano-8gb",
        "trust.public_keys": list(setup["config"].trust.public_keys)}))
    try:
        assert nano.install(bundle).version == 5
    finally:
        nano.close()


def test_the_updates_file_work_and_loading_run_below_the_daemons_priority(
        setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import agent.update.download as download_module
    import agent.update.steps as steps_module
    from agent.backends.onnxruntime import OnnxRuntimeBackend
    from agent.store.store import ModelStore

    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, list[int]] = {}

    def recording(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(name, []).append(
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(download_module._Transfer, "run",
                        recording("download_in_daemon", download_module._Transfer.run))
    monkeypatch.setattr(steps_module, "open_bundle",
                        recording("verify_in_daemon", steps_module.open_bundle))
    monkeypatch.setattr(ModelStore, "install", recording("install_in_daemon", ModelStore.install))
    monkeypatch.setattr(ModelStore, "begin_install",
                        recording("begin_install", ModelStore.begin_install))
    monkeypatch.setattr(ModelStore, "finish_install",
                        recording("finish_install", ModelStore.finish_install))
    monkeypatch.setattr(OnnxRuntimeBackend, "activate",
                        recording("activate", OnnxRuntimeBackend.activate))
    v2, _ = make_bundle(setup["dir"], version=2, key=setup["key"])
    daemon = _daemon(setup, require_traffic=False)

    async def session(port: int) -> dict[str, Any]:
        seen.clear()  # the first version's instances were made at the daemon's priority
        applied = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v2)})
        await _until_idle(daemon)
        assert daemon.update_steps is not None
        worker = daemon.update_steps.file_worker
        applied["worker"] = await _in_thread(worker.call, "ping")
        applied["worker_starts"] = worker.starts
        return applied  # type: ignore[no-any-return]

    applied = run_foreground(daemon, session=session)
    assert applied["serving"]["version"] == 2
    # The bundle was downloaded, opened and its members written by the file worker, not in
    # the daemon: the daemon's thread only made the staging directory and renamed it into place.
    assert set(seen) == {"begin_install", "finish_install", "activate"}, seen
    assert all(nice > base for values in seen.values() for nice in values), (base, seen)
    assert applied["worker"]["nice"] >= base + 10, (base, applied["worker"])
    assert applied["worker"]["pid"] != os.getpid()
    assert applied["worker_starts"] == 1
    assert applied["worker"]["heavy_modules"] == []
    # The daemon stopped: so did its worker (no orphan, and the stop did not wait on it).
    assert _gone(applied["worker"]["pid"])


# -- the file worker process (agent/update/fileworker.py) -------------------------------------

async def _until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def _stuck_in_downloading(daemon: Daemon, bundle: Path) -> int:
    """Stop the file worker (SIGSTOP) and apply ``bundle``: its first step's call (the
    download's) then waits on a worker that never answers. Returns the stopped worker's pid."""
    import os
    import signal

    assert daemon.update_steps is not None and daemon.updater is not None
    worker, updater = daemon.update_steps.file_worker, daemon.updater
    await _until(lambda: worker.pid is not None)  # started with the updater
    stuck = worker.pid
    assert stuck is not None
    os.kill(stuck, signal.SIGSTOP)
    await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(bundle), "wait": False})
    await _until(lambda: updater.state.value == "downloading")
    await asyncio.sleep(0.3)  # the call is sent; the worker cannot answer it
    assert updater.state.value == "downloading"
    return stuck


def _gone(pid: int) -> bool:
    from pathlib import Path as _Path

    try:
        return _Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_file_worker_killed_in_a_step_fails_the_update_with_its_reason_and_the_next_commits(
        setup: dict[str, Any]) -> None:
    import os
    import signal

    v2, _ = make_bundle(setup["dir"], version=2, key=setup["key"])
    v3, _ = make_bundle(setup["dir"], version=3, key=setup["key"])
    daemon = _daemon(setup, require_traffic=False, duration_s=0.5)

    async def session(port: int) -> dict[str, Any]:
        stuck = await _stuck_in_downloading(daemon, v2)
        os.kill(stuck, signal.SIGKILL)  # as the OOM killer would
        failed = await _until_idle(daemon)
        applied = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v3)})
        await _until_idle(daemon)
        assert daemon.update_steps is not None
        return {"failed": failed, "applied": applied,
                "starts": daemon.update_steps.file_worker.starts}

    out = run_foreground(daemon, session=session)
    outcome = out["failed"]["last_outcome"]
    assert (outcome["result"], outcome["reason"], outcome["state"]) == (
        "failed", "worker_died", "downloading"), outcome
    assert "killed by SIGKILL" in outcome["detail"], outcome
    assert out["applied"]["serving"]["version"] == 3
    assert out["starts"] == 2


def test_a_step_whose_file_worker_still_starts_ends_at_its_deadline_and_the_start_is_killed(
        setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The download's worker takes longer to start than the step's deadline (an interpreter at
    nice +10 on a loaded board): the step fails ``deadline`` then, the half-started worker is
    killed and reaped, and the next update gets a worker of its own (before, the cancellation
    missed the start: the step was abandoned, and the file thread went on to start the worker
    and download the cancelled bundle, with the next update queued behind it)."""
    import sys

    from tests.test_update_fileworker_faults import slow_python, wait_for_pid

    v2, _ = make_bundle(setup["dir"], version=2, key=setup["key"])
    v3, _ = make_bundle(setup["dir"], version=3, key=setup["key"])
    python, mark = slow_python(setup["dir"], monkeypatch)
    daemon = Daemon(setup["config"], canary_policy=CanaryPolicy(
        duration_s=0.5, min_samples=16, watch_min_requests=20, require_traffic=False),
        update_policy=UpdatePolicy(watch_window_s=1.0, downloading_s=2.0))

    async def session(port: int) -> dict[str, Any]:
        assert daemon.update_steps is not None
        worker = daemon.update_steps.file_worker
        await _until(lambda: worker.pid is not None)  # the one started with the updater
        worker.kill()
        worker.python = python  # the next start is a slow one
        await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v2), "wait": False})
        starting = await _in_thread(wait_for_pid, mark)
        failed = await _until_idle(daemon)
        await _until(lambda: not Path(f"/proc/{starting}").exists(), timeout_s=5)
        worker.python = sys.executable
        applied = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v3)})
        await _until_idle(daemon)
        return {"failed": failed, "applied": applied, "starts": worker.starts}

    out = run_foreground(daemon, session=session)
    outcome = out["failed"]["last_outcome"]
    assert (outcome["reason"], outcome["state"]) == ("deadline", "downloading"), outcome
    assert out["applied"]["serving"]["version"] == 3
    assert out["starts"] == 2  # the updater's, v3's; the slow one never counted


@pytest.mark.parametrize("ending", ["newer_request", "deadline"])
def test_a_step_stuck_in_the_file_worker_ends_at_a_newer_request_or_its_deadline(
        setup: dict[str, Any], ending: str) -> None:
    """A worker that never answers (stopped) must not hold the update: a newer request or the
    state's deadline ends the step at once by killing it, and the next update gets a new one
    (without the kill, the file thread would wait on the stuck call for good and every later
    update would queue behind it)."""
    v2, _ = make_bundle(setup["dir"], version=2, key=setup["key"])
    v3, _ = make_bundle(setup["dir"], version=3, key=setup["key"])
    daemon = Daemon(setup["config"], canary_policy=CanaryPolicy(
        duration_s=0.5, min_samples=16, watch_min_requests=20, require_traffic=False),
        # A newer request must end the stuck step long before a deadline would: its own
        # deadline is then far off, since the newer update's download waits for a new worker
        # to start (at its low priority: seconds on a loaded machine).
        update_policy=UpdatePolicy(watch_window_s=1.0,
                                   downloading_s=2.0 if ending == "deadline" else 30.0))

    async def session(port: int) -> dict[str, Any]:
        stuck = await _stuck_in_downloading(daemon, v2)
        started = time.monotonic()
        if ending == "deadline":
            failed = await _until_idle(daemon)
            # The next worker started before v3 is applied: its start (seconds at its low
            # priority on a loaded machine) is not v3's to fit in the 2 s deadline.
            assert daemon.update_steps is not None
            await _in_thread(daemon.update_steps.file_worker.start)
        else:
            failed = None
        applied = await _in_thread(_call, daemon, UPDATE_APPLY, {"source": _url(v3)})
        status = await _until_idle(daemon)
        assert daemon.update_steps is not None
        return {"failed": failed, "applied": applied, "status": status, "stuck": stuck,
                "seconds": time.monotonic() - started,
                "starts": daemon.update_steps.file_worker.starts}

    out = run_foreground(daemon, session=session)
    assert out["applied"]["serving"]["version"] == 3
    assert out["starts"] == 2 and _gone(out["stuck"])
    assert out["seconds"] < 15, out["seconds"]
    if ending == "deadline":
        outcome = out["failed"]["last_outcome"]
        assert (outcome["reason"], outcome["state"]) == ("deadline", "downloading"), outcome
    else:
        history = out["status"]["history"]
        assert any(event["from"] == "downloading" and event["reason"] == "superseded"
                   for event in history), history
