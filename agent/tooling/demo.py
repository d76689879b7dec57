"""``edge-agent demo``: the whole path on one machine, on the embedded defaults.

Builds the example bundle when none is there (ResNet-18 on the digits set, pruned and INT8; needs
the ``host`` extra), installs it into a fresh model store, starts the daemon on a free loopback
port, sends the held-out digit images as binary KServe v2 requests from concurrent clients (and a
few through system shared memory), prints predictions, latency and the server's metrics; then
applies the next version of the model over the control socket while clients are still served
(agent/tooling/demo_update.py), and shuts down by draining.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import AgentError, ConfigError, InputError, StoreError

log = logging.getLogger(__name__)

EXAMPLE_MODEL = "resnet18-digits"


@dataclass(frozen=True)
class DemoOptions:
    out_dir: Path = Path("out/demo")
    requests: int = 360  # the whole held-out split
    concurrency: int = 8
    backend: str = "auto"
    shm_requests: int = 4
    update: bool = True  # the second act: a new version applied while clients are served

    def __post_init__(self) -> None:
        for key, value in (("--requests", self.requests), ("--concurrency", self.concurrency),
                           ("shm_requests", self.shm_requests)):
            if value < 1:
                raise ConfigError(f"{key} must be at least 1", key=key, found=value)


def find_or_build_bundle(out_dir: Path) -> tuple[Path, Path]:
    """The newest example bundle in ``out_dir`` and its public key; built when missing.

    Raises:
        ConfigError: a bundle is there but not the public key to verify it with.
    """
    public_key = out_dir / "signing.key.pub"
    bundles = sorted((path for path in out_dir.glob(f"{EXAMPLE_MODEL}-*.bundle")
                      if path.is_file()), key=lambda path: path.stat().st_mtime)
    if bundles and not public_key.is_file():
        raise ConfigError("the example bundle is there but not the public key that verifies it; "
                          "put the key there, or remove the bundle to build a new one",
                          bundle=bundles[-1], expected=public_key)
    if bundles:
        return bundles[-1], public_key
    require("torch", extra="host", purpose="building the example bundle")
    from models.pipeline import BuildOptions, build, format_summary

    print(f"no example bundle in {out_dir}: building one (a few minutes on 2 cores)", flush=True)
    result = build(BuildOptions(out_dir=out_dir, model=EXAMPLE_MODEL, prune_ratio=0.5,
                                progress=False))
    print(format_summary(result), flush=True)
    return find_or_build_bundle(out_dir)


def held_out_digits(manifest: dict[str, Any], count: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Real images for the demo: the digits set's held-out split at the bundle's input size, and
    whether they are the whole split (what the bundle's accuracy report was measured on)."""
    from models.data import load_digits_splits

    resize = (manifest.get("preprocessing") or {}).get("resize") or [32, 32]
    _, held_out = load_digits_splits(int(resize[0]))
    return held_out.images[:count], held_out.labels[:count], count >= len(held_out.labels)


def expected_accuracy(manifest: dict[str, Any], backend: str) -> str:
    """The bundle report's top-1 for what ``backend`` runs, to print beside the demo's own."""
    accuracy = manifest.get("accuracy") or {}
    if accuracy.get("metric") != "top1":
        return ""
    if backend == "onnxruntime" and "int8_onnxruntime_served" in accuracy:
        return (f"; the bundle's report: {accuracy['int8_onnxruntime_served']:.2f}% as ONNX "
                f"Runtime serves it, {accuracy['int8']:.2f}% for the model TensorRT runs (QDQ, "
                "measured on this host)")
    return f"; the bundle's report: {accuracy['int8']:.2f}%" if "int8" in accuracy else ""


async def _infer(session: Any, url: str, body: bytes, header_length: int) -> tuple[dict, float]:
    from agent.tooling.loadgen import decode_response

    started = time.perf_counter()
    async with session.post(url, data=body,
                            headers={"Inference-Header-Content-Length": str(header_length),
                                     "Content-Type": "application/octet-stream"}) as response:
        payload = await response.read()
        if response.status != 200:
            raise InputError("the daemon refused a request", status=response.status,
                             body=payload[:200].decode(errors="replace"))
        length = response.headers.get("Inference-Header-Content-Length")
        outputs = decode_response(payload, int(length) if length else None)
    return outputs, time.perf_counter() - started


async def _send_all(base: str, model: str, input_name: str, images: np.ndarray,
                    concurrency: int) -> tuple[np.ndarray, list[float]]:
    aiohttp = require("aiohttp", extra="device", purpose="the demo's client")
    from agent.tooling.loadgen import encode_request

    url = f"{base}/v2/models/{model}/infer"
    predictions = np.full(len(images), -1)
    latencies: list[float] = []
    indices = iter(range(len(images)))

    async def worker(session: Any) -> None:
        for index in indices:
            body, header_length = encode_request(input_name, images[index:index + 1],
                                                 datatype="FP32")
            outputs, seconds = await _infer(session, url, body, header_length)
            predictions[index] = int(np.argmax(next(iter(outputs.values()))[0]))
            latencies.append(seconds)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return predictions, latencies


async def _send_through_shared_memory(base: str, model: str, input_name: str,
                                      images: np.ndarray) -> list[int]:
    """Hand frames over in a POSIX shared memory region: only a small JSON body goes over HTTP."""
    aiohttp = require("aiohttp", extra="device", purpose="the demo's client")
    from agent.tooling.loadgen import decode_response

    frame = np.ascontiguousarray(images[:1], dtype=np.float32)
    key = f"edge-agent-demo-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / key
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, frame.nbytes)
        with mmap.mmap(fd, frame.nbytes) as region:
            predictions = await _shm_requests(aiohttp, base, model, input_name, images, frame,
                                              region, key, decode_response)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return predictions


async def _shm_requests(aiohttp: Any, base: str, model: str, input_name: str,
                        images: np.ndarray, frame: np.ndarray, region: mmap.mmap, key: str,
                        decode_response: Any) -> list[int]:
    predictions: list[int] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/systemsharedmemory/region/demo/register",
                                json={"key": "/" + key, "offset": 0,
                                      "byte_size": frame.nbytes}) as response:
            response.raise_for_status()
        view = np.frombuffer(region, dtype=np.float32).reshape(frame.shape)
        for index in range(len(images)):
            view[:] = images[index:index + 1]  # the camera pipeline's one write
            request = {"inputs": [{
                "name": input_name, "datatype": "FP32", "shape": list(frame.shape),
                "parameters": {"shared_memory_region": "demo",
                               "shared_memory_byte_size": frame.nbytes}}],
                "parameters": {"binary_data_output": True}}
            async with session.post(f"{base}/v2/models/{model}/infer",
                                    json=request) as response:
                payload = await response.read()
                if response.status != 200:
                    raise InputError("shared memory request refused", status=response.status,
                                     body=payload[:200].decode(errors="replace"))
                length = response.headers.get("Inference-Header-Content-Length")
                outputs = decode_response(payload, int(length) if length else None)
            predictions.append(int(np.argmax(next(iter(outputs.values()))[0])))
        del view
        async with session.post(
                f"{base}/v2/systemsharedmemory/region/demo/unregister") as response:
            response.raise_for_status()
    return predictions


async def _query(base: str, model: str, input_name: str, images: np.ndarray,
                 options: DemoOptions) -> dict[str, Any]:
    """The demo's clients: every image over HTTP from concurrent clients, a few through shared
    memory, then the server's metrics and statistics."""
    print(f"daemon serving KServe v2 on {base}")
    started = time.perf_counter()
    predictions, latencies = await _send_all(base, model, input_name, images,
                                             options.concurrency)
    wall_s = time.perf_counter() - started
    shm_predictions = await _send_through_shared_memory(base, model, input_name,
                                                        images[:options.shm_requests])
    aiohttp = require("aiohttp", extra="device", purpose="the demo's client")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/metrics") as response:
            metrics_text = await response.text()
        async with session.get(f"{base}/v2/models/{model}/stats") as response:
            stats = json.loads(await response.text())["model_stats"][0]
    return {"predictions": predictions, "latencies": latencies, "wall_s": wall_s,
            "shm": shm_predictions, "metrics": metrics_text, "stats": stats}


def _percentiles_ms(latencies: list[float]) -> list[float]:
    from agent.tooling.loadgen import percentiles

    return percentiles([seconds * 1e3 for seconds in latencies], (50, 90, 99)) if latencies \
        else [0.0, 0.0, 0.0]


def run_demo(options: DemoOptions) -> int:
    out_dir = options.out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--out is not a directory", key="--out", path=out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock_out_dir(out_dir)
    except OSError as exc:
        raise ConfigError("cannot use the demo's directory", key="--out", path=out_dir,
                          reason=exc.strerror or str(exc)) from None
    try:
        return _run_demo(options, out_dir)
    finally:
        os.close(lock)


def _lock_out_dir(out_dir: Path) -> int:
    """Hold ``out_dir/.demo.lock`` for the demo's lifetime: a second demo in the same directory
    would otherwise delete the first one's live model store."""
    import fcntl

    fd = os.open(out_dir / ".demo.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentError("another edge-agent demo is running in this directory",
                         path=out_dir) from None
    return fd


def _clear_state_dir(state_dir: Path) -> None:
    """Remove the last run's model store, unless a process holds its lock (``edge-agent serve
    --state-dir`` on it): the demo's store is its own, but it must not pull one from under a
    daemon."""
    from agent.store import remove_store

    try:
        remove_store(state_dir)
    except StoreError as exc:
        if exc.fields.get("pid") is None:  # not held by another process: the lock failed
            raise
        raise AgentError("the demo's model store is in use by another edge-agent process",
                         path=state_dir, pid=exc.fields["pid"]) from None


def _run_demo(options: DemoOptions, out_dir: Path) -> int:
    from agent.backends import resolve_backend_name
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.control.protocol import SOCKET_NAME
    from agent.run import run_foreground
    from agent.tooling.demo_update import publish_next_version, update_while_serving

    bundle, public_key = find_or_build_bundle(out_dir)
    state_dir = out_dir / "state"
    _clear_state_dir(state_dir)  # a fresh store each run: the demo installs
    config = load_config(None, env={}, overrides={
        "state_dir": state_dir, "http.port": 0, "trust.public_keys": [public_key],
        "serving.backend": options.backend})
    daemon = Daemon(config)
    try:
        artifacts = daemon.install(bundle)
        print(f"installed {artifacts.name} v{artifacts.version} from {bundle} into {state_dir}")
        images, labels, whole_split = held_out_digits(dict(artifacts.manifest), options.requests)
        expected = (expected_accuracy(dict(artifacts.manifest),
                                      resolve_backend_name(options.backend))
                    if whole_split else "")
        input_name = artifacts.manifest["inputs"][0]["name"]

        update_bundle = (publish_next_version(bundle, public_key, out_dir) if options.update
                         else None)

        async def clients(port: int) -> dict[str, Any]:
            base = f"http://127.0.0.1:{port}"
            result = await _query(base, artifacts.name, input_name, images, options)
            if update_bundle is not None:
                print(f"\napplying {update_bundle.name} (v{artifacts.version + 1}) while "
                      f"{options.concurrency} clients keep sending images:")
                result["update"] = await update_while_serving(
                    base, artifacts.name, input_name, images, state_dir / SOCKET_NAME,
                    update_bundle, concurrency=options.concurrency)
            return result

        # The same lifecycle as `edge-agent serve`: SIGTERM or Ctrl-C cancels the clients, and
        # the daemon drains before the command ends.
        result = run_foreground(daemon, candidate=artifacts, session=clients)
    finally:
        daemon.close()
    return _report(result, labels, expected, options)


def _report(result: dict[str, Any], labels: np.ndarray, expected: str,
            options: DemoOptions) -> int:
    """Print what the clients saw; the exit status says whether it was right."""
    predictions, latencies = result["predictions"], result["latencies"]
    correct = int((predictions == labels).sum())
    print("\nfirst predictions (label -> predicted):",
          " ".join(f"{label}->{pred}" for label, pred in zip(labels[:16], predictions[:16])))
    print(f"accuracy      {correct}/{len(labels)} = {100.0 * correct / len(labels):.2f}% "
          f"(held-out digits, {options.concurrency} concurrent clients{expected})")
    print(f"throughput    {len(labels) / result['wall_s']:.1f} requests/s")
    p50, p90, p99 = _percentiles_ms(latencies)
    print(f"latency       p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms")
    stats = result["stats"]
    executions = max(1, stats["execution_count"])
    print(f"batching      {stats['inference_count']} samples in {stats['execution_count']} "
          f"batches (mean {stats['inference_count'] / executions:.1f})")
    shm_ok = result["shm"] == [int(p) for p in predictions[:options.shm_requests]]
    print(f"shared memory {len(result['shm'])} frames via /dev/shm, same predictions: {shm_ok}")
    print("metrics (excerpt):")
    for line in result["metrics"].splitlines():
        if line.startswith(("edge_agent_requests_total", "edge_agent_batch_size_sum",
                            "edge_agent_batch_size_count", "edge_agent_model_version",
                            "edge_agent_request_duration_seconds_count")):
            print("  " + line)
    from agent.tooling.demo_update import report_update

    updated = report_update(result["update"]) if "update" in result else True
    print("daemon stopped cleanly")
    return 0 if shm_ok and updated and correct >= 0.9 * len(labels) else 1
