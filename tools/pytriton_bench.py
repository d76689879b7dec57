"""Serve an ONNX model with PyTriton (Triton's dynamic batcher) and load it with agent.tooling.loadgen.

The Triton side of ``edge-agent bench serve``: the ONNX Runtime session our daemon's backend
creates (``models.ort.create_session``, which keeps INT8 QDQ convolutions fused), bound as a
PyTriton model behind Triton's dynamic batcher, measured by the same closed-loop load generator
with binary tensors. Run it in the PyTriton venv (Python 3.12) that ``tools/pytriton_setup.sh``
creates:

    tools/pytriton_setup.sh && source .venv-pytriton/env.sh
    .venv-pytriton/bin/python tools/pytriton_bench.py MODEL.onnx --max-batch 32 --delay-us 5000 \\
        --threads 2 --port 8010 --concurrency 1,4,16,64 --duration-s 10 --out result.json

The script starts itself again with ``--serve-only`` as the server process, waits until the model is
ready, then drives the load from this process. The load generator needs only numpy and httptools, so
it runs in the same venv, but in its own process: in the server's process it would compete with
PyTriton's proxy threads for the GIL. Memory is read from /proc for the server process and its
children (tritonserver and the Python backend stub). ``--serve-only`` alone serves until Ctrl-C.
The server it starts gets this Python's lib folder on LD_LIBRARY_PATH even without env.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from agent.tooling.loadgen import (  # noqa: E402
    LoadResult,
    Target,
    cpu_seconds,
    expect_argmax,
    run_closed_loop,
)
from models.ort import create_session  # noqa: E402

ONNX_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
PAGE_KB = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="the ONNX model")
    parser.add_argument("--model-name", default="model", help="name under /v2/models/")
    parser.add_argument("--max-batch", type=int, default=32, help="Triton max_batch_size")
    parser.add_argument("--delay-us", type=int, default=5000, help="max_queue_delay_microseconds")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--port", type=int, default=8010, help="HTTP port (gRPC +1, metrics +2)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="closed-loop levels (a,b,...)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="measured window per level")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="unrecorded load before each")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-request limit")
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--samples", type=int, default=4, help="distinct random inputs to cycle")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument(
        "--server-log", type=Path, help="Triton's output (default: OUT.server.log, else ours)"
    )
    parser.add_argument("--serve-only", action="store_true", help="serve until interrupted")
    return parser.parse_args(argv)


def tensor_specs(session: Any, nodes: list[Any]) -> list[Any]:
    """PyTriton tensor definitions from ONNX Runtime node args, batch dimension left out."""
    from pytriton.model_config import Tensor

    specs = []
    for node in nodes:
        if node.type not in ONNX_TO_NUMPY:
            raise SystemExit(f"{node.name}: ONNX type {node.type} has no mapping here")
        shape = tuple(dim if isinstance(dim, int) else -1 for dim in node.shape[1:])
        specs.append(Tensor(name=node.name, dtype=ONNX_TO_NUMPY[node.type], shape=shape))
    return specs


def serve(args: argparse.Namespace) -> None:
    """Bind the ONNX Runtime session as a PyTriton model and serve it over HTTP on loopback."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import (
        DEFAULT_PROTECTED_ENDPOINTS,
        Triton,
        TritonConfig,
        TritonSecurityConfig,
    )

    session = create_session(args.model, threads=args.threads)
    output_names = [node.name for node in session.get_outputs()]

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(output_names, session.run(output_names, inputs)))

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.port + 1,
        metrics_port=args.port + 2,
    )
    # PyTriton puts /stats behind a generated token by default; the load generator reads it
    # without one (loopback only), so statistics alone is left open.
    security = TritonSecurityConfig(
        restricted_endpoints=[name for name in DEFAULT_PROTECTED_ENDPOINTS if name != "statistics"]
    )
    model_config = ModelConfig(
        max_batch_size=args.max_batch,
        batcher=DynamicBatcher(max_queue_delay_microseconds=args.delay_us),
    )
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name=args.model_name,
            infer_func=infer,
            inputs=tensor_specs(session, session.get_inputs()),
            outputs=tensor_specs(session, session.get_outputs()),
            config=model_config,
            strict=False,
        )
        triton.serve()


def server_environment() -> dict[str, str]:
    """This environment with the Python's lib folder on LD_LIBRARY_PATH (see pytriton_setup.sh)."""
    environment = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR")
    current = environment.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        environment["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir
    return environment


def wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the PyTriton server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"the PyTriton server was not ready after {READY_TIMEOUT_S:.0f} s ({url})")


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces; the parent pid follows it.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def memory_of(pids: list[int]) -> dict[str, Any]:
    """RSS, peak RSS and PSS (shared pages split between their users) of each process and in all.

    PyTriton passes tensors through shared memory between its proxy and the backend stub, so the
    RSS sum counts those pages twice; the PSS sum does not.
    """
    processes: list[dict[str, Any]] = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        fields = _kb_fields(status) | _kb_fields(rollup)
        name = next(line.split()[1] for line in status.splitlines() if line.startswith("Name:"))
        processes.append(
            {
                "pid": pid,
                "name": name,
                "rss_mb": fields.get("VmRSS", 0) / 1024,
                "hwm_mb": fields.get("VmHWM", 0) / 1024,
                "pss_mb": fields.get("Pss", 0) / 1024,
            }
        )
    totals = {key: sum(item[key] for item in processes) for key in ("rss_mb", "hwm_mb", "pss_mb")}
    return {**totals, "processes": processes}


def _kb_fields(text: str) -> dict[str, int]:
    fields = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def make_target(args: argparse.Namespace, base_url: str) -> Target:
    """Random inputs, and what the same session predicts for them here, to verify the answers."""
    session = create_session(args.model, threads=1)
    node = session.get_inputs()[0]
    generator = np.random.default_rng(0)
    shape = (1, 3, args.size, args.size)
    samples = tuple(generator.standard_normal(shape, dtype=np.float32) for _ in range(args.samples))
    output = session.get_outputs()[0].name
    labels = [int(np.argmax(session.run([output], {node.name: sample})[0])) for sample in samples]
    return Target(
        base_url=base_url,
        model=args.model_name,
        input_name=node.name,
        samples=samples,
        datatype="FP32",
        outputs=(output,),
        verify=expect_argmax(labels, output=output),
    )


def bench(args: argparse.Namespace) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{args.port}"
    target = make_target(args, base_url)
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--serve-only"]
    log_path = args.server_log or (args.out.with_suffix(".server.log") if args.out else None)
    log = log_path.open("wb") if log_path is not None else None
    server = subprocess.Popen(
        command,
        env=server_environment(),
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        start_new_session=True,
    )
    results = []
    try:
        wait_ready(f"{base_url}/v2/models/{args.model_name}/ready", server)
        with urllib.request.urlopen(f"{base_url}/v2", timeout=5) as response:
            triton_version = json.load(response).get("version")
        for concurrency in [int(level) for level in args.concurrency.split(",")]:
            pids = process_tree(server.pid)
            server_cpu, client_cpu = cpu_seconds(pids), time.process_time()
            started = time.perf_counter()
            result: LoadResult = asyncio.run(
                run_closed_loop(
                    target,
                    concurrency=concurrency,
                    duration_s=args.duration_s,
                    warmup_s=args.warmup_s,
                    timeout_s=args.timeout_s,
                )
            )
            elapsed = time.perf_counter() - started
            pids = process_tree(server.pid)
            row = result.to_dict()
            row["server_cpu_percent"] = 100 * (cpu_seconds(pids) - server_cpu) / elapsed
            row["client_cpu_percent"] = 100 * (time.process_time() - client_cpu) / elapsed
            row["server_memory"] = memory_of(pids)
            results.append(row)
            print_row(row, flush=True)
    finally:
        stop(server)
        if log is not None:
            log.close()
    return {
        "server": "pytriton",
        "pytriton_version": _version("nvidia-pytriton"),
        "triton_version": triton_version,
        "onnxruntime_version": _version("onnxruntime"),
        "python": sys.version.split()[0],
        "model": str(args.model),
        "input_shape": [1, 3, args.size, args.size],
        "max_batch": args.max_batch,
        "delay_us": args.delay_us,
        "threads": args.threads,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "cpu_count": os.cpu_count(),
        "command": " ".join([sys.executable, *sys.argv]),
        "server_log": str(log_path) if log_path is not None else None,
        "results": results,
        "server_rss_mb": max(row["server_memory"]["rss_mb"] for row in results),
        "server_pss_mb": max(row["server_memory"]["pss_mb"] for row in results),
    }


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def print_row(row: dict[str, Any], *, flush: bool = False) -> None:
    server = row.get("server") or {}
    batch = server.get("mean_batch_size")
    print(
        f"c={row['concurrency']:>3}  qps={row['qps']:7.1f}  p50={_ms(row['p50_ms'])}  "
        f"p90={_ms(row['p90_ms'])}  p99={_ms(row['p99_ms'])}  errors={row['errors']}  "
        f"batch={batch if batch is None else round(batch, 1)}  "
        f"queue={_ms(server.get('queue_ms'))}  compute={_ms(server.get('compute_ms'))}  "
        f"cpu={row['server_cpu_percent']:.0f}%+{row['client_cpu_percent']:.0f}%  "
        f"rss={row['server_memory']['rss_mb']:.0f}MB pss={row['server_memory']['pss_mb']:.0f}MB",
        flush=flush,
    )


def _ms(value: float | None) -> str:
    return "    -   " if value is None else f"{value:7.1f}ms"


def stop(server: subprocess.Popen[bytes]) -> None:
    """Interrupt the server (PyTriton stops Triton on KeyboardInterrupt), then kill what is left."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    # tritonserver and the stub run in the server's own session; nothing of it may outlive us.
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve_only:
        serve(args)
        return
    document = bench(args)
    text = json.dumps(document, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
