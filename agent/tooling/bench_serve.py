"""``edge-agent bench serve``: the serving path against its own backend, in one run.

1. **Raw backend**: the configured backend alone, no HTTP, at several batch sizes; the best
   throughput is the baseline (``raw_backend_img_s``) and the time of a full batch bounds latency.
2. **Through the HTTP API**: the daemon runs as its own process (as on a board: the load generator
   must not share its interpreter) and ``agent.tooling.loadgen`` drives it with binary KServe
   v2 requests, closed loop at each concurrency, then an open-loop Poisson rate. The daemon's RSS is read from
   ``/proc`` after each level.

Targets (issue 3): ``efficiency`` = QPS at concurrency 64 / ``raw_backend_img_s`` >= 0.85, and the
P99 at concurrency 16 <= ``max_queue_delay`` + 2 x the compute time of a full batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import AgentError, ConfigError
from agent.tooling import loadgen
from agent.tooling.processes import stop_process, wait_ready

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeBenchOptions:
    bundle: Path
    public_keys: tuple[Path, ...]
    config: Path | None = None
    # Height and width of the frames; None: 224 for models that take any size, the model's own
    # size for fixed-size models (a size given for those must be theirs).
    input_size: int | None = None
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    duration_s: float = 10.0
    warmup_s: float = 2.0
    raw_min_time_s: float = 1.5
    rounds: int = 3  # interleaved (raw backend, HTTP at the top concurrency) pairs
    open_loop_fraction: float = 0.7  # Poisson rate as a fraction of the best closed-loop QPS
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_size is not None and self.input_size < 8:
            raise ConfigError("input size too small", key="--input-size", found=self.input_size)
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency levels must be >= 1", key="--concurrency",
                              found=list(self.concurrency))
        if len(set(self.concurrency)) != len(self.concurrency):
            # A repeated level would be measured twice and printed as two rows of one level.
            raise ConfigError("concurrency levels must differ", key="--concurrency",
                              found=list(self.concurrency))
        if self.rounds < 1:
            raise ConfigError("need at least one round", key="--rounds", found=self.rounds)
        if not self.duration_s >= MIN_WINDOW_S:  # also refuses NaN
            raise ConfigError(f"--duration must be at least {MIN_WINDOW_S} s (a shorter window "
                              "measures no request)", key="--duration", found=self.duration_s)
        for key, value, minimum in (("--duration", self.duration_s, 0.0),
                                    ("--warmup", self.warmup_s, None),
                                    ("raw_min_time_s", self.raw_min_time_s, 0.0)):
            # ``not <=`` also refuses NaN; a day is more than any benchmark window needs.
            low_ok = value > minimum if minimum is not None else value >= 0
            if not low_ok or not value <= 86_400:
                raise ConfigError("durations must be finite and positive (at most a day)",
                                  key=key, found=value)


MIN_WINDOW_S = 0.5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB, from /proc."""
    values = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


class CpuMeter:
    """CPU used by the daemon and by this process (the load generator; the raw backend idles
    meanwhile) between two readings, in percent of one core, as tools/pytriton_bench.py reports
    it for Triton: on a board the client and the server share the CPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.mark()

    def mark(self) -> None:
        self._at = (time.perf_counter(), loadgen.cpu_seconds([self.pid]), time.process_time())

    def since_mark(self) -> dict[str, float]:
        """Percentages since the last mark, then marks again."""
        started, server, client = self._at
        self.mark()
        elapsed = max(1e-9, self._at[0] - started)
        return {"server_cpu_percent": 100 * (self._at[1] - server) / elapsed,
                "client_cpu_percent": 100 * (self._at[2] - client) / elapsed}


DEFAULT_INPUT_SIZE = 224


def _sample_shape(manifest: dict[str, Any], size: int | None, *,
                  explicit: bool = True) -> tuple[int, ...]:
    """One frame's shape: the model's input with its dynamic height and width at ``size``
    (``explicit``: the operator asked for it, so a fixed-size model must have that size)."""
    from agent.backends.base import frame_shape

    inputs = manifest["inputs"]
    if len(inputs) != 1:
        raise ConfigError("bench serve sends one image per request; this model has several "
                          "inputs", inputs=[entry.get("name") for entry in inputs])
    declared = inputs[0]["shape"]
    shape = frame_shape(tuple(declared[1:]), size or DEFAULT_INPUT_SIZE,
                        size or DEFAULT_INPUT_SIZE)
    if shape is None:
        raise ConfigError("the model's input has dynamic axes other than height and width",
                          shape=declared)
    if explicit and size is not None and -1 not in declared[1:]:
        fixed = tuple(declared[1:])
        spatial = fixed[:2] if inputs[0].get("layout") == "NHWC" else fixed[-2:]
        if spatial != (size, size):
            raise ConfigError("the model takes frames of one size only; --input-size does not "
                              "match it", key="--input-size", found=size, shape=list(fixed))
    return shape


def _default_size(manifest: dict[str, Any]) -> int:
    """224, the typical deployed frame, unless the bundle's engine profile does not reach it:
    then the profile's optimum height."""
    profile = manifest.get("engine_profile") or {}
    spans: list[list[int]] = [span for span in (profile.get(axis) for axis in ("height", "width"))
                              if isinstance(span, list) and len(span) == 3]
    if all(span[0] <= DEFAULT_INPUT_SIZE <= span[2] for span in spans):
        return DEFAULT_INPUT_SIZE
    return int(spans[0][1])


def _check_profile(manifest: dict[str, Any], size: int) -> None:
    """The daemon refuses frames outside the bundle's engine profile: so does the benchmark."""
    profile = manifest.get("engine_profile") or {}
    for axis in ("height", "width"):
        span = profile.get(axis)
        if isinstance(span, list) and len(span) == 3 and not span[0] <= size <= span[2]:
            raise ConfigError(f"the bundle's engine profile does not cover this {axis}",
                              key="--input-size", found=size, smallest=span[0], largest=span[2])


class RawBackend:
    """The configured backend instances in this process, timed without HTTP."""

    def __init__(self, config: Any, artifacts: Any, sample_shape: tuple[int, ...]) -> None:
        from agent.runtime import batch_policy, start_backends

        self.policy = batch_policy(config, artifacts)
        self.sizes = sorted({size for size in (1, 4, artifacts.opt_batch, 16,
                                               self.policy.max_batch_size)
                             if 1 <= size <= self.policy.max_batch_size})
        self.backends = start_backends(config, artifacts, self.policy)
        info = self.backends[0].inputs[0]
        rng = np.random.default_rng(0)
        self.inputs = {size: {info.name: rng.normal(size=(size, *sample_shape)).astype(info.dtype)}
                       for size in self.sizes}

    def measure(self, min_time_s: float) -> dict[str, Any]:
        """Throughput at each batch size with every instance running batches at once (one
        thread each), as the daemon runs them; the best is the baseline."""
        from models.timing import time_call

        per_batch: dict[str, dict[str, float]] = {}
        for size in self.sizes:
            inputs = self.inputs[size]
            with ThreadPoolExecutor(len(self.backends)) as pool:
                runs = list(pool.map(
                    lambda backend, inputs=inputs: time_call(lambda: backend.infer(inputs),
                                                             min_time_s, 3),
                    self.backends))
            median_s = statistics.median(latency for run in runs for latency in run)
            per_batch[str(size)] = {"batch_ms": median_s * 1e3,
                                    "img_s": size * len(self.backends) / median_s}
        best = max(per_batch.values(), key=lambda entry: entry["img_s"])
        return {"per_batch": per_batch, "img_s": best["img_s"],
                "full_batch_ms": per_batch[str(self.policy.max_batch_size)]["batch_ms"]}

    def close(self) -> None:
        for backend in self.backends:
            backend.deactivate()


class DaemonProcess:
    """``edge-agent serve`` in a child process on an installed store."""

    def __init__(self, options: ServeBenchOptions, state_dir: Path, port: int) -> None:
        # On loopback whatever the configuration says (a board's LAN address, or "::"): the load
        # generator runs here. Logged at INFO, so that a failure can quote the daemon's log.
        command = [sys.executable, "-m", "agent", "serve", "--state-dir", str(state_dir),
                   "--http-host", "127.0.0.1", "--http-port", str(port)]
        if options.config is not None:
            command += ["--config", str(options.config)]
        for key in options.public_keys:
            command += ["--pubkey", str(key)]
        self.log_path = state_dir / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_ready(self.process, lambda: self.url, timeout_s=timeout_s, poll_s=0.2,
                   log_tail=lambda: self.log_path.read_text(errors="replace")[-600:])

    def stop(self) -> int:
        status = stop_process(self.process, timeout_s=30)
        self._log.close()
        return status


def run_bench(options: ServeBenchOptions) -> dict[str, Any]:
    """Install the bundle, start the daemon, then: the concurrency sweep, ``rounds`` interleaved
    pairs of (raw backend, HTTP at the top concurrency) for the efficiency, and the open loop."""
    with tempfile.TemporaryDirectory(prefix="edge-agent-bench-") as temp:
        state_dir = Path(temp) / "state"
        port = _free_port()
        config, artifacts = _install(options, state_dir, port)
        sample_shape = _frame_shape(options, config, dict(artifacts.manifest))
        print(f"model {artifacts.name} v{artifacts.version}, frames "
              f"1x{'x'.join(map(str, sample_shape))}", flush=True)
        target = _target(config, artifacts, port, sample_shape)
        raw = RawBackend(config, artifacts, sample_shape)
        daemon = DaemonProcess(options, state_dir, port)
        try:
            daemon.wait_ready()
            windows = _Windows(options, target, daemon)
            windows.sweep()
            windows.interleaved_rounds(raw)
            windows.open_loop()
        finally:
            status = daemon.stop()
            raw.close()
        if status != 0:
            raise AgentError("the daemon exited with an error", status=status,
                             log=daemon.log_path.read_text(errors="replace")[-600:])
        policy = raw.policy
        setup = {"input_shape": [1, *sample_shape],
                 "backend": raw.backends[0].kind, "instances": len(raw.backends),
                 "max_batch_size": policy.max_batch_size,
                 "max_queue_delay_ms": policy.max_queue_delay_us / 1e3,
                 "preferred_batch_sizes": list(policy.preferred_batch_sizes)}
    return summarize(setup, windows.levels, windows.rounds, windows.open_entry, options)


def _install(options: ServeBenchOptions, state_dir: Path, port: int) -> tuple[Any, Any]:
    """The benchmark's configuration, and the bundle installed and current in a fresh store."""
    from agent.config import load_config
    from agent.daemon import Daemon

    overrides = {**options.overrides, "state_dir": state_dir, "http.port": port,
                 "trust.public_keys": list(options.public_keys)}
    config = load_config(options.config, overrides=overrides)
    installer = Daemon(config)
    try:
        artifacts = installer.install(options.bundle)
        installer.make_current(artifacts)
    finally:
        installer.close()  # the daemon process takes the state directory
    return config, artifacts


def _frame_shape(options: ServeBenchOptions, config: Any,
                 manifest: dict[str, Any]) -> tuple[int, ...]:
    """One frame's shape, checked against what the daemon accepts."""
    size = options.input_size or _default_size(manifest)
    sample_shape = _sample_shape(manifest, size, explicit=options.input_size is not None)
    frame_bytes = 4 * math.prod(sample_shape)  # one FP32 frame per request
    if frame_bytes > config.http.max_body_bytes:
        raise ConfigError("one frame of this input size is larger than the daemon accepts "
                          "(http.max_body_bytes)", key="--input-size",
                          found=size, frame_bytes=frame_bytes,
                          limit=config.http.max_body_bytes)
    _check_profile(manifest, size)
    return sample_shape


def _target(config: Any, artifacts: Any, port: int,
            sample_shape: tuple[int, ...]) -> loadgen.Target:
    """What the load generator sends: a few random frames to the model, with the bearer token."""
    manifest = artifacts.manifest
    rng = np.random.default_rng(1)
    samples = tuple(rng.normal(size=(1, *sample_shape)).astype(np.float32) for _ in range(4))
    token = config.http.token.reveal() if config.http.token is not None else None
    return loadgen.Target(base_url=f"http://127.0.0.1:{port}", model=artifacts.name,
                          input_name=manifest["inputs"][0]["name"], samples=samples,
                          datatype="FP32",
                          headers={"Authorization": f"Bearer {token}"} if token else {})


class _Windows:
    """The measured windows against the daemon process, each with its memory and CPU."""

    def __init__(self, options: ServeBenchOptions, target: loadgen.Target,
                 daemon: DaemonProcess) -> None:
        self.options = options
        self.target = target
        self.daemon = daemon
        self.cpu = CpuMeter(daemon.process.pid)
        self.levels: dict[str, dict[str, Any]] = {}
        self.rounds: list[dict[str, Any]] = []
        self.open_entry: dict[str, Any] = {}

    def sweep(self) -> None:
        """Closed loop at each concurrency."""
        options = self.options
        loadgen.sweep_closed_loop(self.target, options.concurrency, duration_s=options.duration_s,
                                  warmup_s=options.warmup_s, on_result=self._record)

    def interleaved_rounds(self, raw: RawBackend) -> None:
        """Pairs of (raw backend, HTTP at the top concurrency): the efficiency."""
        options = self.options
        top = max(options.concurrency)
        for index in range(options.rounds):
            # The daemon idles (no spinning threads) while the raw backend is timed, and the
            # raw backend idles during the HTTP window; pairing them round by round keeps the
            # ratio honest on a machine whose speed drifts.
            raw_round = raw.measure(options.raw_min_time_s)
            self.cpu.mark()
            result = asyncio.run(loadgen.run_closed_loop(
                self.target, concurrency=top, duration_s=options.duration_s,
                warmup_s=options.warmup_s))
            entry = self._measured(result)
            self.rounds.append({"raw": raw_round, "http": entry,
                                "efficiency": entry["qps"] / raw_round["img_s"]})
            print(f"round {index + 1}: raw {raw_round['img_s']:.1f} img/s, HTTP c={top} "
                  f"{entry['qps']:.1f} req/s, efficiency {self.rounds[-1]['efficiency']:.3f}",
                  flush=True)

    def open_loop(self) -> None:
        """Poisson load below saturation: a fraction of the best closed-loop throughput."""
        options = self.options
        rate = options.open_loop_fraction * max(entry["qps"] for entry in self.levels.values())
        self.cpu.mark()
        self.open_entry = self._measured(asyncio.run(loadgen.run_open_loop(
            self.target, rate_per_s=rate, duration_s=options.duration_s,
            warmup_s=options.warmup_s)))
        print(_format_level(f"poisson {rate:.0f}/s", self.open_entry), flush=True)

    def _measured(self, result: Any) -> dict[str, Any]:
        entry = result.to_dict()
        entry["rss_mb"], entry["rss_peak_mb"] = _rss_mb(self.daemon.process.pid)
        # Over the whole window with its warm-up; per request: CPU-ms each answer cost.
        entry.update(self.cpu.since_mark())
        entry["server_cpu_ms_per_request"] = (
            10 * entry["server_cpu_percent"] / entry["qps"] if entry["qps"] else None)
        return entry

    def _record(self, result: Any) -> None:
        if result.completed == 0 and result.errors:
            # Nothing to measure, and every later level would fail alike.
            raise AgentError("every request failed at this concurrency; see the daemon's "
                             "log", concurrency=result.concurrency, errors=result.errors,
                             log=self.daemon.log_path.read_text(errors="replace")[-400:])
        self.levels[str(result.concurrency)] = self._measured(result)
        print(_format_level(f"c={result.concurrency}", self.levels[str(result.concurrency)]),
              flush=True)


def summarize(setup: dict[str, Any], levels: dict[str, dict[str, Any]],
              rounds: list[dict[str, Any]], open_entry: dict[str, Any],
              options: ServeBenchOptions) -> dict[str, Any]:
    raw_img_s = statistics.median(entry["raw"]["img_s"] for entry in rounds)
    full_batch_ms = statistics.median(entry["raw"]["full_batch_ms"] for entry in rounds)
    bound = setup["max_queue_delay_ms"] + 2 * full_batch_ms
    summary: dict[str, Any] = {
        "input_shape": setup["input_shape"],
        "setup": setup,
        "raw_backend_img_s": raw_img_s,
        "full_batch_compute_ms": full_batch_ms,
        "concurrency": levels,
        "rounds": rounds,
        "efficiency": statistics.median(entry["efficiency"] for entry in rounds),
        "open_loop": open_entry,
        "p99_c16_bound_ms": bound,
        "rss_peak_mb": max([entry["rss_peak_mb"] for entry in levels.values()]
                           + [open_entry["rss_peak_mb"]]),
    }
    top = str(max(int(level) for level in levels))
    summary["server_cpu_ms_per_request"] = levels[top].get("server_cpu_ms_per_request")
    if "16" in levels and levels["16"]["p99_ms"] is not None:
        summary["p99_c16_ms"] = levels["16"]["p99_ms"]
        summary["p99_c16_ok"] = levels["16"]["p99_ms"] <= bound
    summary["targets"] = {"efficiency_ok": summary["efficiency"] >= 0.85,
                          "p99_c16_ok": summary.get("p99_c16_ok")}
    return summary


def _format_level(label: str, entry: dict[str, Any]) -> str:
    server = entry.get("server") or {}
    def ms(value: Any) -> str:
        return f"{value:7.1f}" if isinstance(value, (int, float)) else "      -"
    errors = sum(entry["errors"].values())
    return (f"{label:>16}  {entry['qps']:7.1f} req/s  p50{ms(entry['p50_ms'])}  "
            f"p90{ms(entry['p90_ms'])}  p99{ms(entry['p99_ms'])} ms  "
            f"queue{ms(server.get('queue_ms'))}  compute{ms(server.get('compute_ms'))} ms  "
            f"batch {server.get('mean_batch_size') or 0:5.1f}  rss {entry['rss_mb']:6.0f} MiB  "
            f"cpu {entry.get('server_cpu_percent', 0):3.0f}%+{entry.get('client_cpu_percent', 0):.0f}%"
            + (f"  errors {errors}" if errors else ""))


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"raw backend best           {summary['raw_backend_img_s']:.1f} img/s (median of rounds)",
        (f"efficiency (top c / raw)   {summary['efficiency']:.3f}  (median of rounds; target "
         f">= 0.85: {'met' if summary['targets']['efficiency_ok'] else 'NOT met'})"),
    ]
    if "p99_c16_ms" in summary:
        lines.append(f"P99 at c=16                {summary['p99_c16_ms']:.1f} ms  (bound "
                     f"{summary['p99_c16_bound_ms']:.1f} ms: "
                     f"{'met' if summary['p99_c16_ok'] else 'NOT met'})")
    lines.append(f"daemon peak RSS            {summary['rss_peak_mb']:.0f} MiB")
    if summary.get("server_cpu_ms_per_request") is not None:
        lines.append(f"daemon CPU per request     {summary['server_cpu_ms_per_request']:.2f} ms "
                     f"(at the highest concurrency, all threads)")
    return "\n".join(lines)


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError("concurrency must be comma-separated integers", key="--concurrency",
                          found=text) from None
    return levels
