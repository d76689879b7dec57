"""``edge-agent serve`` as a real process: install, serve, drain on SIGTERM, restart on the store's
current model, refuse a corrupted install; and ``edge-agent bench serve`` end to end on a tiny
model (short windows: this checks the command, not the numbers)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
http = pytest.importorskip("tritonclient.http")

from models.signing import (
    generate_private_key,
    write_keypair,
)
from tests.tiny_models import make_bundle, reference_logits


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture()
def signed(tmp_path: Path) -> tuple[Path, Path, Any]:
    key_path = tmp_path / "keys" / "fleet.key"
    key_path.parent.mkdir()
    write_keypair(key_path)
    from models.signing import load_private_key

    key = load_private_key(key_path)
    bundle, _ = make_bundle(tmp_path, key=key)
    return bundle, Path(str(key_path) + ".pub"), key


def clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if not name.startswith("EDGE_AGENT_") or name == "EDGE_AGENT_CACHE"}


def serve(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "agent", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=clean_env())


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read().decode() if process.stdout else "exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("daemon not ready")


def infer(port: int, bundle_dir: Path) -> None:
    client = http.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.random.default_rng(5).normal(size=(2, 3, 16, 16)).astype(np.float32)
    tensor = http.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("tiny", [tensor])
    np.testing.assert_allclose(result.as_numpy("logits"),
                               reference_logits(bundle_dir / "src-tiny-1" / "model.onnx", data),
                               rtol=1e-4, atol=1e-5)


def test_serve_installs_serves_drains_and_restarts_on_current(
        tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    bundle, public_key, _ = signed
    state = tmp_path / "state"
    port = free_port()
    process = serve("--bundle", str(bundle), "--pubkey", str(public_key), "--state-dir",
                    str(state), "--http-port", str(port), "--backend", "onnxruntime")
    try:
        wait_ready(port, process)
        infer(port, tmp_path)
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    assert process.returncode == 0, output
    assert "draining" in output

    # The store keeps the model: a plain restart serves it without --bundle.
    port = free_port()
    process = serve("--pubkey", str(public_key), "--state-dir", str(state), "--http-port",
                    str(port))
    try:
        wait_ready(port, process)
        infer(port, tmp_path)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert process.returncode == 0


def test_serve_refuses_a_model_corrupted_on_disk(tmp_path: Path,
                                                 signed: tuple[Path, Path, Any]) -> None:
    bundle, public_key, _ = signed
    state = tmp_path / "state"
    from agent.config import load_config
    from agent.daemon import Daemon

    config = load_config(None, env={}, overrides={"state_dir": state,
                                                  "trust.public_keys": [public_key]})
    installer = Daemon(config)
    artifacts = installer.install(bundle)
    installer.store.activate(artifacts.name, artifacts.version)
    installer.close()
    model = artifacts.directory / "model.onnx"
    model.chmod(0o644)
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--pubkey", str(public_key), "--state-dir",
         str(state), "--http-port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("edge-agent: error:")
    assert "model.onnx" in result.stderr
    # Installing the same signed bundle again repairs the damaged copy.
    daemon = Daemon(config)
    try:
        repaired = daemon.install(bundle)
        assert daemon.store.load(repaired.name, repaired.version).version == repaired.version
        assert (repaired.directory / "model.onnx").read_bytes() != bytes(data)
    finally:
        daemon.close()


def test_serve_with_an_empty_store_says_how_to_install(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--state-dir", str(tmp_path / "state"),
         "--http-port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1
    assert "no model installed" in result.stderr
    assert "--bundle" in result.stderr


def test_serve_rejects_an_untrusted_bundle(tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    _, public_key, _ = signed
    other, _ = make_bundle(tmp_path / "other", key=generate_private_key())
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--bundle", str(other), "--pubkey",
         str(public_key), "--state-dir", str(tmp_path / "state"), "--http-port",
         str(free_port())],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1
    assert "edge-agent: error:" in result.stderr
    assert not list((tmp_path / "state").glob("models/*/*"))


def test_print_config_names_every_section_and_hides_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("very-secret\n")
    config = tmp_path / "agent.toml"
    config.write_text(f'[http]\ntoken_file = "{token}"\nport = 9001\n')
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--config", str(config), "--print-config"],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["http"]["port"] == 9001
    assert printed["http"]["token"] == "<redacted>"
    assert "very-secret" not in result.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[serving]\nmax_batch_size = 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--config", str(bad), "--print-config"],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1
    assert "serving.max_batch_size" in result.stderr


def test_bench_serve_runs_end_to_end(tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    from agent.tooling.bench_serve import ServeBenchOptions, run_bench

    bundle, public_key, _ = signed
    summary = run_bench(ServeBenchOptions(
        bundle=bundle, public_keys=(public_key,), input_size=16, concurrency=(1, 4),
        duration_s=0.5, warmup_s=0.2, raw_min_time_s=0.1, rounds=1,
        overrides={"serving.backend": "onnxruntime"}))
    assert summary["raw_backend_img_s"] > 0
    assert summary["input_shape"] == [1, 3, 16, 16]
    for level in ("1", "4"):
        entry = summary["concurrency"][level]
        assert entry["completed"] > 0 and entry["errors"] == {}
        assert entry["p50_ms"] <= entry["p90_ms"] <= entry["p99_ms"]
        assert entry["rss_mb"] > 0
        assert entry["server_cpu_percent"] > 0 and entry["client_cpu_percent"] > 0
        assert entry["server_cpu_ms_per_request"] == pytest.approx(
            10 * entry["server_cpu_percent"] / entry["qps"])
    assert summary["efficiency"] > 0
    assert summary["open_loop"]["completed"] > 0
    assert summary["p99_c16_bound_ms"] > summary["full_batch_compute_ms"]
    assert summary["server_cpu_ms_per_request"] == summary["concurrency"]["4"][
        "server_cpu_ms_per_request"]


def test_bench_serve_refuses_frames_larger_than_the_daemon_accepts(
        tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    from agent.tooling.bench_serve import ServeBenchOptions, run_bench
    from agent.errors import ConfigError

    bundle, public_key, _ = signed
    with pytest.raises(ConfigError, match="larger than the daemon accepts") as caught:
        run_bench(ServeBenchOptions(bundle=bundle, public_keys=(public_key,), input_size=100_000,
                                    overrides={"serving.backend": "onnxruntime"}))
    assert caught.value.fields["limit"] == 64 << 20
    with pytest.raises(ConfigError, match="engine profile does not cover") as caught:
        run_bench(ServeBenchOptions(bundle=bundle, public_keys=(public_key,), input_size=72,
                                    overrides={"serving.backend": "onnxruntime"}))
    assert caught.value.fields["largest"] == 64


@pytest.mark.parametrize(("field", "value"), [("duration_s", float("nan")),
                                              ("duration_s", float("inf")),
                                              ("warmup_s", float("nan"))])
def test_bench_serve_refuses_durations_that_never_end(tmp_path: Path, field: str,
                                                      value: float) -> None:
    from agent.tooling.bench_serve import ServeBenchOptions
    from agent.errors import ConfigError

    with pytest.raises(ConfigError, match="finite|at least"):
        ServeBenchOptions(bundle=tmp_path / "b", public_keys=(), **{field: value})


def test_bench_serve_refuses_a_window_too_short_to_measure(tmp_path: Path) -> None:
    from agent.tooling.bench_serve import ServeBenchOptions
    from agent.errors import ConfigError

    with pytest.raises(ConfigError, match="--duration must be at least 0.5 s"):
        ServeBenchOptions(bundle=tmp_path / "b", public_keys=(), duration_s=0.1)


def test_bench_refuses_a_json_path_it_could_not_write_before_measuring(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    status = main(["bench", "serve", "--bundle", str(tmp_path / "absent.bundle"), "--pubkey",
                   str(tmp_path / "k.pub"), "--json", str(tmp_path)])
    assert status == 1 and "--json is a directory" in capsys.readouterr().err
    status = main(["bench", "serve", "--bundle", str(tmp_path / "absent.bundle"), "--pubkey",
                   str(tmp_path / "k.pub"), "--json", str(tmp_path / "no" / "out.json")])
    assert status == 1 and "does not exist" in capsys.readouterr().err


def test_serve_bundle_on_a_busy_port_installs_nothing(tmp_path: Path,
                                                      signed: tuple[Path, Path, Any]) -> None:
    bundle, public_key, _ = signed
    state = tmp_path / "state"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "agent", "serve", "--bundle", str(bundle), "--pubkey",
             str(public_key), "--state-dir", str(state), "--http-port", str(port)],
            capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1, result.stderr
    assert "cannot listen for HTTP" in result.stderr, result.stderr
    models = state / "models"
    assert not models.exists() or not any(models.iterdir())  # nothing installed or made current  # the bundle did not become current


def test_installing_keeps_only_keep_versions_on_disk(tmp_path: Path,
                                                     signed: tuple[Path, Path, Any]) -> None:
    from agent.config import load_config
    from agent.daemon import Daemon

    _, public_key, key = signed
    config = load_config(None, env={}, overrides={
        "state_dir": tmp_path / "state", "trust.public_keys": [public_key],
        "store.keep_versions": 2})
    daemon = Daemon(config)
    try:
        for version in (1, 2, 3, 4):
            bundle, _ = make_bundle(tmp_path, version=version, key=key)
            daemon.make_current(daemon.install(bundle))
        assert daemon.store.versions("tiny") == [3, 4]  # current and previous
    finally:
        daemon.close()


def test_sigterm_while_starting_ends_the_start_and_frees_the_store(
        tmp_path: Path, signed: tuple[Path, Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during a start (on a board: a TensorRT engine build of minutes) reaches the work
    in progress: the start gives up, the daemon exits cleanly and lets go of its state
    directory. The first start here sends itself SIGTERM and waits until the daemon's stop
    request is visible to it, as an engine build polls it between steps."""
    from agent import runtime
    from agent.config import load_config
    from agent.run import run_daemon
    from agent.store import ModelStore

    bundle, pubkey, _ = signed
    real_start = runtime.start_backends
    seen: list[bool] = []

    def start_that_is_interrupted(config: Any, artifacts: Any, policy: Any,
                                  stop_requested: Any = None) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not stop_requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(stop_requested())
        return real_start(config, artifacts, policy, stop_requested)

    monkeypatch.setattr(runtime, "start_backends", start_that_is_interrupted)
    state_dir = tmp_path / "state"
    config = load_config(None, env={}, overrides={"state_dir": state_dir, "http.port": 0,
                                                  "trust.public_keys": [pubkey]})
    ready: list[int] = []
    assert run_daemon(config, bundle=bundle, on_ready=ready.append) == 0
    assert seen == [True] and ready == []  # it never served
    # The state directory is free again, and the installed model is intact, but not current:
    # a version becomes current once it serves.
    store = ModelStore(state_dir, trusted_keys=config.trust.keys).open()
    try:
        assert store.current() is None
        assert store.versions("tiny") == [1] and store.load("tiny", 1)
    finally:
        store.close()


@pytest.mark.parametrize("inputs, size, expected", [
    ([{"name": "x", "shape": [-1, 3, -1, -1], "layout": "NCHW"}], None, (3, 224, 224)),
    ([{"name": "x", "shape": [-1, 3, -1, -1], "layout": "NCHW"}], 64, (3, 64, 64)),
    ([{"name": "x", "shape": [-1, -1, -1, 3], "layout": "NHWC"}], 64, (64, 64, 3)),
    ([{"name": "x", "shape": [-1, 1, -1, -1], "layout": "NCHW"}], None, (1, 224, 224)),
    ([{"name": "x", "shape": [-1, 3, 32, 32], "layout": "NCHW"}], None, (3, 32, 32)),
    ([{"name": "x", "shape": [-1, 3, 32, 32], "layout": "NCHW"}], 32, (3, 32, 32)),
    ([{"name": "x", "shape": [-1, 32, 32, 3], "layout": "NHWC"}], 32, (32, 32, 3)),
])
def test_bench_serve_frames_follow_the_models_input(inputs, size, expected) -> None:
    from agent.tooling.bench_serve import _sample_shape

    assert _sample_shape({"inputs": inputs}, size) == expected


@pytest.mark.parametrize("inputs, size, message", [
    ([{"name": "x", "shape": [-1, 3, 32, 32], "layout": "NCHW"}], 64,
     "takes frames of one size only"),
    ([{"name": "x", "shape": [-1, 16, 64, 64], "layout": "NCHW"}], 16,
     "takes frames of one size only"),
    ([{"name": "image", "shape": [-1, 3, 32, 32]}, {"name": "extra", "shape": [-1, 4]}], None,
     "several inputs"),
])
def test_bench_serve_refuses_frames_it_cannot_send(inputs, size, message) -> None:
    from agent.tooling.bench_serve import _sample_shape
    from agent.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _sample_shape({"inputs": inputs}, size)


def test_bench_serve_stops_when_every_request_fails(tmp_path: Path,
                                                    signed: tuple[Path, Path, Any]) -> None:
    """A daemon that answers every request with an error (here: every request's deadline of 1 us
    passes in the queue) stops the benchmark at the first level, with the error counts and the
    daemon's log."""
    from agent.tooling.bench_serve import ServeBenchOptions, run_bench
    from agent.errors import AgentError

    bundle, public_key, _ = signed
    config = tmp_path / "agent.toml"
    config.write_text('[serving]\nbackend = "onnxruntime"\ndefault_timeout_us = 1\n')
    with pytest.raises(AgentError, match="every request failed") as caught:
        run_bench(ServeBenchOptions(
            bundle=bundle, public_keys=(public_key,), config=config, concurrency=(1, 4),
            duration_s=0.5, warmup_s=0.2, raw_min_time_s=0.1, rounds=1))
    assert caught.value.fields["concurrency"] == 1  # the first level: the second never ran
    assert caught.value.fields["errors"] and "http_200" not in caught.value.fields["errors"]


def test_bench_serve_sends_the_configured_token(tmp_path: Path,
                                                signed: tuple[Path, Path, Any]) -> None:
    # A production configuration has a bearer token: the load generator sends it (every
    # request was a 401 before), and the daemon listens on loopback whatever http.host says.
    from agent.tooling.bench_serve import ServeBenchOptions, run_bench

    bundle, public_key, _ = signed
    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")
    token.chmod(0o600)
    config = tmp_path / "agent.toml"
    config.write_text(f'[http]\ntoken_file = "{token}"\nhost = "::1"\n'
                      '[serving]\nbackend = "onnxruntime"\n')
    summary = run_bench(ServeBenchOptions(
        bundle=bundle, public_keys=(public_key,), config=config, concurrency=(1,),
        duration_s=0.5, warmup_s=0.2, raw_min_time_s=0.1, rounds=1, input_size=16))
    assert summary["concurrency"]["1"]["qps"] > 0 and summary["concurrency"]["1"]["errors"] == {}


@pytest.mark.parametrize("profile, expected", [
    ({"batch": [1, 8, 32], "height": [32, 224, 448], "width": [32, 224, 448]}, 224),
    ({"batch": [1, 8, 32], "height": [8, 16, 64], "width": [8, 16, 64]}, 16),
    ({"batch": [1, 8, 32]}, 224),
    ({}, 224),
])
def test_bench_serve_frames_default_to_224_or_the_profiles_optimum(profile, expected) -> None:
    from agent.tooling.bench_serve import _default_size

    assert _default_size({"engine_profile": profile}) == expected


# -- found by probing the daemon's lifecycle -------------------------------------------------


def _config(tmp_path: Path, public_key: Path, **overrides: Any) -> Any:
    from agent.config import load_config

    return load_config(None, env={}, overrides={"state_dir": tmp_path / "state", "http.port": 0,
                                                "trust.public_keys": [public_key], **overrides})


def _junk_model_bundle(directory: Path, key: Any, version: int) -> Path:
    """A correctly signed bundle whose model.onnx ONNX Runtime cannot load."""
    from models.bundle import pack_bundle
    from tests.tiny_models import tiny_manifest

    junk = directory / f"junk-{version}.onnx"
    junk.write_bytes(b"not an onnx model" * 64)
    bundle = directory / f"tiny-{version}.bundle"
    pack_bundle(bundle, tiny_manifest("tiny", version), {"model.onnx": junk}, key)
    return bundle


def test_a_bundle_whose_model_does_not_load_does_not_become_current(
        tmp_path: Path, signed: tuple[Path, Path, Any], caplog: pytest.LogCaptureFixture) -> None:
    from agent.daemon import Daemon
    from agent.run import run_daemon
    from agent.errors import AgentError

    bundle, public_key, key = signed
    config = _config(tmp_path, public_key)
    first = Daemon(config)
    first.make_current(first.install(bundle))
    first.close()
    broken = _junk_model_bundle(tmp_path, key, version=5)
    with pytest.raises(AgentError):
        run_daemon(config, bundle=broken)
    assert "tiny v5 is installed but was not made current" in caplog.text
    assert "current is still tiny v1" in caplog.text
    # A plain restart still serves the version that worked.
    ready: list[int] = []

    def stop_once_ready(port: int) -> None:
        ready.append(port)
        os.kill(os.getpid(), signal.SIGTERM)

    assert run_daemon(config, on_ready=stop_once_ready) == 0 and ready


def test_a_failed_start_says_why_even_when_the_pointer_is_damaged(
        tmp_path: Path, signed: tuple[Path, Path, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Naming the candidate that did not become current reads the pointer; a damaged one must
    not replace the start's own error (the model does not load) with its own."""
    from agent.errors import AgentError
    from agent.run import run_daemon

    _, public_key, key = signed
    config = _config(tmp_path, public_key)
    broken = _junk_model_bundle(tmp_path, key, version=5)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "models").mkdir()
    (tmp_path / "state" / "current").write_bytes(b"garbage")
    with pytest.raises(AgentError) as caught:
        run_daemon(config, bundle=broken)
    assert "pointer" not in str(caught.value) and "model.onnx" in str(caught.value)
    assert "tiny v5 is installed but was not made current" in caplog.text
    assert "the current version cannot be read" in caplog.text


def test_sighup_reloads_and_neither_kills_nor_stops_the_daemon(
        tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    bundle, public_key, _ = signed
    port = free_port()
    process = serve("--bundle", str(bundle), "--pubkey", str(public_key), "--state-dir",
                    str(tmp_path / "state"), "--http-port", str(port))
    try:
        wait_ready(port, process)
        process.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert process.poll() is None
        infer(port, tmp_path)
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    assert process.returncode == 0, output
    assert "SIGHUP: reloading the configuration" in output
    assert "configuration reloaded: nothing changed" in output


def test_a_busy_port_is_found_before_the_model_loads(
        tmp_path: Path, signed: tuple[Path, Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from agent import runtime
    from agent.daemon import Daemon
    from agent.errors import AgentError
    from agent.run import run_daemon

    bundle, public_key, _ = signed
    config = _config(tmp_path, public_key)
    first = Daemon(config)
    first.make_current(first.install(bundle))
    first.close()
    started: list[bool] = []
    monkeypatch.setattr(runtime, "start_backends",
                        lambda *args, **kwargs: started.append(True))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = _config(tmp_path, public_key, **{"http.port": taken.getsockname()[1]})
        with pytest.raises(AgentError, match="cannot listen for HTTP"):
            run_daemon(busy)  # no --bundle: the plain restart case
    assert not started


def test_a_stop_during_warm_up_ends_it_between_batches(tmp_path: Path,
                                                       signed: tuple[Path, Path, Any]) -> None:
    from agent.runtime import start_backends
    from agent.errors import StopRequested

    bundle, public_key, _ = signed
    config = _config(tmp_path, public_key, **{"serving.warmup_batches": 100000})
    from agent.daemon import Daemon
    from agent.runtime import batch_policy

    daemon = Daemon(config)
    try:
        artifacts = daemon.install(bundle)
        calls = []

        def stop_after_a_few() -> bool:
            calls.append(1)
            return len(calls) > 5

        with pytest.raises(StopRequested, match="stopped while warming up") as caught:
            start_backends(config, artifacts, batch_policy(config, artifacts), stop_after_a_few)
        # Asked once before the instance, then before each batch: it ended at the first "yes".
        assert len(calls) == 6 and caught.value.fields["batches_done"] == 4
    finally:
        daemon.close()


def test_preferred_batch_sizes_beyond_the_bundle_are_named_and_the_optimum_kept(
        tmp_path: Path, signed: tuple[Path, Path, Any], caplog: pytest.LogCaptureFixture) -> None:
    from agent.daemon import Daemon
    from agent.runtime import batch_policy

    bundle, public_key, _ = signed
    config = _config(tmp_path, public_key, **{"serving.max_batch_size": 64,
                                              "serving.preferred_batch_sizes": [48, 64]})
    daemon = Daemon(config)
    try:
        artifacts = daemon.install(bundle)
        policy = batch_policy(config, artifacts)
    finally:
        daemon.close()
    assert policy.max_batch_size == artifacts.max_batch
    expected = (artifacts.opt_batch,) if 1 < artifacts.opt_batch < artifacts.max_batch else ()
    assert policy.preferred_batch_sizes == expected
    assert "serving.preferred_batch_sizes [48, 64] exceed the largest batch" in caplog.text


def test_the_command_line_log_flags_beat_the_environment() -> None:
    env = {**clean_env(), "EDGE_AGENT_LOG_LEVEL": "debug"}
    quiet = subprocess.run([sys.executable, "-c", (
        "import logging; from agent.log import configure_logging; configure_logging(-1); "
        "print(logging.getLogger('agent').level)")], capture_output=True, text=True, env=env,
        timeout=60, check=True)
    assert quiet.stdout.strip() == str(logging_level("ERROR"))
    plain = subprocess.run([sys.executable, "-c", (
        "import logging; from agent.log import configure_logging; configure_logging(0); "
        "print(logging.getLogger('agent').level)")], capture_output=True, text=True, env=env,
        timeout=60, check=True)
    assert plain.stdout.strip() == str(logging_level("DEBUG"))


def logging_level(name: str) -> int:
    import logging

    return int(logging.getLevelName(name))


def test_a_state_directory_that_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    from agent.errors import StoreError
    from agent.store import ModelStore

    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("")
    with pytest.raises(StoreError, match="the state directory is not a directory"):
        ModelStore(not_a_dir, trusted_keys=[]).open()


def test_sigterm_while_serve_installs_a_bundle_unwinds_it(tmp_path: Path,
                                                          signed: tuple[Path, Path, Any]) -> None:
    # systemctl stop during `serve --bundle`'s install: the install's staging directory goes,
    # and the exit says so (it was killed outright, leaving the extraction behind).
    bundle, public_key, _ = signed
    state = tmp_path / "state"
    script = (
        "import os, signal, sys, time\n"
        "import models.bundle as bundle\n"
        "real = bundle.VerifiedBundle._write_members\n"
        "def slow(self, staging):\n"
        "    real(self, staging)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "bundle.VerifiedBundle._write_members = slow\n"
        "from agent.cli import main\n"
        f"sys.exit(main(['serve', '--bundle', {str(bundle)!r}, '--pubkey', {str(public_key)!r},"
        f" '--state-dir', {str(state)!r}, '--http-port', '0']))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, env=clean_env(), check=False)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "edge-agent: terminated" in result.stderr
    leftovers = [path.name for path in (state / "models").rglob("*") if "extract" in path.name]
    assert leftovers == []


def test_an_installed_but_never_current_version_is_named_at_start(
        tmp_path: Path, signed: tuple[Path, Path, Any]) -> None:
    bundle, public_key, _ = signed
    config = _config(tmp_path, public_key)
    from agent.daemon import Daemon

    installer = Daemon(config)
    installer.install(bundle)  # as a start stopped before it served leaves it
    installer.close()
    result = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--pubkey", str(public_key), "--state-dir",
         str(tmp_path / "state"), "--http-port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert result.returncode == 1
    assert "no current model" in result.stderr and "installed=tiny v[1]" in result.stderr


def test_bench_serve_refuses_a_concurrency_level_given_twice(tmp_path: Path) -> None:
    from agent.errors import ConfigError
    from agent.tooling.bench_serve import ServeBenchOptions, parse_levels

    with pytest.raises(ConfigError, match="concurrency levels must differ"):
        ServeBenchOptions(bundle=tmp_path / "b.bundle", public_keys=(),
                          concurrency=parse_levels("4,4"))
