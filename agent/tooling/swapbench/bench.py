"""``edge-agent bench swap``: hot swaps under load, a misbehaving version, and a soak, in one run.

Everything is made here: a signing key, signed bundles of a tiny classifier (versions 1, 2, ...),
and a daemon in its own process (agent/tooling/swapbench/daemon.py) serving version 1 with the
ONNX Runtime backend. Updates go through the control channel (``update.apply`` of a ``file://``
URL, waiting for the outcome), exactly as ``edge-agent update apply`` sends them. The phases:

1. **Capacity**: closed loop, unpaced, at ``capacity_concurrency`` for ``capacity_s``: the
   daemon's throughput. The load of every later phase is ``load_fraction`` of it
   (agent/tooling/swapbench/load.py: a closed loop paced to that rate).
2. **Steady**: ``steady_s`` of that load with no update: the same-run baseline.
3. **Swaps**: ``swaps`` consecutive healthy updates. A swap lasts from the ``update.apply`` call
   to its answer that the new version is committed (download, verification, install, loading at
   low priority, warm-up, canary, commit and drain included). The updater then rests (its watch
   window passes); the next bundle is made and ``gap_s`` more of load runs before it is applied
   (the bundles are made by the process that runs the load: made during a swap, they would slow
   its clients and be counted against the daemon).
   ``p99_swap_over_steady`` = P99 latency of the requests that overlapped a swap (sent before
   it ended and answered after it began) / P99 of the steady phase. ``p99_swap_over_quiet``
   (not a target) divides by the P99 of the ``gap_s`` windows before each swap instead (the
   ``quiet_gaps`` phase: load alone, like the steady phase, but in the swaps' own minutes, so
   a shared machine's drifting speed weighs on both sides alike). ``swap_states`` splits
   those requests by the updater state they overlapped (from the journal's history): where in
   a swap the excess comes from. ``tail_by_swap`` (not a target) names the swaps that hold the
   slowest 1 % of the overlapping requests, each with its own gap's P99 over all the gaps': a
   tail from a few swaps whose gaps were slow too is the machine's, not the swap's.
   ``sent_after_apply`` (not a target) sorts the requests by when they were sent after each
   apply, in 50 ms bins, each bin's P50 over the gaps': unlike ``swap_states`` it does not
   favour slow requests in short states.
4. **Misbehaving versions**: first one that disagrees with the serving version (its classifier
   negated), which the canary must refuse before it answers anyone (``canary_reject``). Then the
   stricter case: a version that answers like the serving one on the positive frames the load
   sends, so it passes the canary and is committed, and answers NaN once the load switches to
   negative frames (right after the commit); the watch window must catch it and roll back.
   ``rollback_s`` = from the first answer by that version to the first answer by the previous
   version after the bad version's last answer (from then on the old version answers alone).
5. **Soak**: ``soak_swaps`` healthy updates back to back under the same load (each newer request
   ends the watch window of the one before, as a fleet pushing updates quickly would). The
   daemon's RSS, open file descriptors and threads are read from ``/proc`` after
   ``soak_warmup_swaps`` and after the last one: ``soak_rss_growth_mib``.

``failed_requests`` counts every request of phases 2-5 that got no answer (an HTTP error, a
timeout, a dropped connection); a NaN answer from the misbehaving version is not a failure of the
swap path but what the watch window is for, and is counted apart (``watch_rollback.nan_answers``).

Targets (issue 16): ``failed_requests`` 0, ``p99_swap_over_steady`` <= 1.5 (2 shared cores),
``rollback_s`` <= 30, ``soak_swaps`` >= 500, ``soak_rss_growth_mib`` <= 20 with the open file
descriptors flat.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import datetime
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import AgentError, ConfigError
from agent.tooling.processes import stop_process, wait_ready
from agent.tooling import loadgen
from agent.tooling.swapbench.bundles import FRAME_SHAPE, MODEL_NAME, BundleMaker
from agent.tooling.swapbench.daemon import DaemonSpec
from agent.tooling.swapbench.load import PacedLoad, Record, frames

TARGETS = {"failed_requests": 0, "p99_swap_over_steady": 1.5, "rollback_s": 30.0,
           "soak_swaps": 500, "soak_rss_growth_mib": 20.0}


@dataclass(frozen=True, kw_only=True)
class SwapBenchOptions:
    """The benchmark's sizes and the daemon's update settings (module docstring).

    Args:
        swaps: Measured consecutive swaps.
        soak_swaps: Swaps of the soak.
        soak_warmup_swaps: Soak swaps before the first memory reading (allocator pools,
            ONNX Runtime's caches and the journal's history fill up first).
        capacity_s: The capacity window.
        capacity_concurrency: Requests in flight while measuring capacity.
        load_fraction: The load's rate as a share of the capacity.
        workers: The load's clients (requests in flight at most).
        steady_s: The baseline window.
        gap_s: Load between a swap's watch window and the next swap.
        watch_window_s: The daemon's watch window after each commit.
        canary_min_samples: Shadowed samples that decide a canary.
        canary_duration_s: The longest a canary shadows.
        config: A configuration file for the daemon (batching, threads); None: the embedded
            defaults, whatever ``/etc/edge-agent`` holds.
        backend: The daemon's backend.
    """

    swaps: int = 20
    soak_swaps: int = 500
    soak_warmup_swaps: int = 20
    capacity_s: float = 3.0
    capacity_concurrency: int = 8
    load_fraction: float = 0.5
    workers: int = 4
    steady_s: float = 5.0
    gap_s: float = 0.5
    watch_window_s: float = 2.0
    canary_min_samples: int = 64  # the daemon's default: fewer batches make the slow gate noisy
    canary_duration_s: float = 10.0
    config: Path | None = None
    backend: str = "onnxruntime"

    def __post_init__(self) -> None:
        for key, value in (("--swaps", self.swaps), ("--soak", self.soak_swaps),
                           ("--workers", self.workers),
                           ("--capacity-concurrency", self.capacity_concurrency),
                           ("--canary-min-samples", self.canary_min_samples)):
            if value < 1:
                raise ConfigError("must be at least 1", key=key, found=value)
        if self.soak_warmup_swaps < 0:
            raise ConfigError("must not be negative", key="--soak-warmup",
                              found=self.soak_warmup_swaps)
        if not 0 < self.load_fraction <= 1:
            raise ConfigError("must be in (0, 1]", key="--load-fraction", found=self.load_fraction)
        for key, seconds in (("--capacity-time", self.capacity_s),
                             ("--steady-time", self.steady_s),
                             ("--watch-window", self.watch_window_s),
                             ("--canary-duration", self.canary_duration_s)):
            if not (math.isfinite(seconds) and 0 < seconds <= 3600):  # also refuses NaN
                raise ConfigError("must be a positive number of seconds (at most an hour)",
                                  key=key, found=seconds)
        if not (math.isfinite(self.gap_s) and 0 <= self.gap_s <= 3600):
            raise ConfigError("must be a number of seconds, 0 to an hour", key="--gap",
                              found=self.gap_s)


# -- the daemon process ----------------------------------------------------------------------

class DaemonProcess:
    """The daemon under test in its own process (agent/tooling/swapbench/daemon.py)."""

    def __init__(self, spec: DaemonSpec, work: Path) -> None:
        self.spec = spec
        self.log_path = work / "daemon.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "agent.tooling.swapbench.daemon",
                   str(spec.write(work / "daemon-spec.json"))]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, size: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-size:]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        def url() -> str | None:
            port_file = self.spec.port_file
            return (f"http://127.0.0.1:{int(port_file.read_text())}" if port_file.is_file()
                    else None)

        self.url = wait_ready(self.process, url, timeout_s=timeout_s, log_tail=self.log_tail)

    def resources(self) -> dict[str, float]:
        """The daemon's RSS (MiB), open file descriptors and threads, from /proc."""
        values: dict[str, float] = {}
        with open(f"/proc/{self.pid}/status", encoding="ascii") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key == "VmRSS":
                    values["rss_mib"] = int(rest.split()[0]) / 1024
                elif key == "Threads":
                    values["threads"] = int(rest)
        values["fds"] = len(os.listdir(f"/proc/{self.pid}/fd"))
        return values

    def stop(self) -> int:
        status = stop_process(self.process, timeout_s=60)
        self._log.close()
        return status


# -- updates over the control channel --------------------------------------------------------

class Updates:
    """``update.apply`` and ``update.status`` over the daemon's control socket."""

    def __init__(self, state_dir: Path) -> None:
        from agent.control.client import ControlClient
        from agent.control.protocol import SOCKET_NAME

        self.client = ControlClient(state_dir / SOCKET_NAME)
        self.state_dir = state_dir

    def history(self) -> list[dict[str, Any]]:
        """The update journal's history, read from the file as any reader may (without
        disturbing the daemon's writes)."""
        from agent.update.journal import Journal

        return [event.to_json() for event in Journal(self.state_dir).load().doc.history]

    def apply(self, bundle: Path) -> dict[str, Any]:
        """Apply and wait: the status once the update is committed, or has ended."""
        from agent.control.protocol import UPDATE_APPLY

        result: dict[str, Any] = self.client.call(
            UPDATE_APPLY, {"source": bundle.resolve().as_uri(), "wait": True}, timeout_s=600)
        return result

    def status(self) -> dict[str, Any]:
        from agent.control.protocol import UPDATE_STATUS

        result: dict[str, Any] = self.client.call(UPDATE_STATUS, {}, timeout_s=30)
        return result

    def until_resting(self, timeout_s: float) -> dict[str, Any]:
        """The status once the updater rests (idle or failed: the watch window is over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status["state"] in ("idle", "failed"):
                return status
            if time.monotonic() > deadline:
                raise AgentError("the updater did not come to rest", state=status["state"],
                                 timeout_s=timeout_s)
            time.sleep(0.05)


def _serving_version(status: dict[str, Any]) -> int | None:
    serving = status.get("serving") or {}
    return serving.get("version")


def _reason(status: dict[str, Any]) -> str | None:
    error = status.get("error") or {}
    return error.get("reason")


# -- the run ---------------------------------------------------------------------------------

@dataclass
class _Timeline:
    """When each phase ran (``perf_counter`` seconds), for sorting the requests afterwards."""

    steady: tuple[float, float] = (0.0, 0.0)
    swaps: list[tuple[float, float]] | None = None
    # Each swap's updater states, as (state, start, end): from the journal's history, whose
    # wall-clock times are put on this clock by ``wall_minus_perf``.
    states: list[tuple[str, float, float]] = field(default_factory=list)
    # The ``gap_s`` before each swap, once its bundle is made: load alone, like the steady
    # phase, but interleaved with the swaps.
    quiet: list[tuple[float, float]] = field(default_factory=list)
    canary: tuple[float, float] = (0.0, 0.0)
    watch: tuple[float, float] = (0.0, 0.0)
    soak: tuple[float, float] = (0.0, 0.0)


class _Run:
    """One benchmark run on a started daemon (phases 1-5 of the module docstring)."""

    def __init__(self, options: SwapBenchOptions, daemon: DaemonProcess, maker: BundleMaker,
                 updates: Updates) -> None:
        self.options = options
        self.daemon = daemon
        self.maker = maker
        self.updates = updates
        self.version = 1
        self.timeline = _Timeline(swaps=[])
        self.found: dict[str, Any] = {"swap_durations_s": [], "swap_failures": []}
        self.load: PacedLoad | None = None

    def _next(self, fault: str | None = None) -> tuple[int, Path]:
        version = self.version + 1
        return version, self.maker.bundle(version, fault=fault)

    def capacity(self) -> None:
        options = self.options
        target = loadgen.Target(base_url=self.daemon.url, model=MODEL_NAME, input_name="input",
                                samples=tuple(frames(4, FRAME_SHAPE)))
        result = asyncio.run(loadgen.run_closed_loop(
            target, concurrency=options.capacity_concurrency, duration_s=options.capacity_s,
            warmup_s=min(1.0, options.capacity_s)))
        if result.completed == 0:
            raise AgentError("the daemon answered nothing while its capacity was measured",
                             errors=result.errors, log=self.daemon.log_tail())
        self.found["capacity"] = {"rps": result.qps, "p99_ms": result.p99_ms,
                                  "concurrency": options.capacity_concurrency,
                                  "errors": result.errors}
        rate = options.load_fraction * result.qps
        self.found["load_rps"] = rate
        print(f"capacity {result.qps:.0f} req/s at c={options.capacity_concurrency}; load "
              f"{rate:.0f} req/s over {options.workers} paced clients", flush=True)
        self.load = PacedLoad(base_url=self.daemon.url, model=MODEL_NAME, input_name="input",
                              samples=frames(8, FRAME_SHAPE), rate_per_s=rate,
                              workers=options.workers)

    def steady(self) -> None:
        assert self.load is not None
        self.load.start()
        time.sleep(min(1.0, self.options.steady_s))  # connections open, the batcher settles
        started = time.perf_counter()
        time.sleep(self.options.steady_s)
        self.timeline.steady = (started, time.perf_counter())

    def swaps(self) -> None:
        options = self.options
        assert self.timeline.swaps is not None
        for index in range(options.swaps):
            # The bundle is made (signed, packed) by this process, which also runs the load:
            # made first, the load's clients are not slowed by it while the swap is measured.
            version, bundle = self._next()
            quiet = time.perf_counter()
            time.sleep(options.gap_s)
            started = time.perf_counter()
            result = self.updates.apply(bundle)
            ended = time.perf_counter()
            self.timeline.quiet.append((quiet, started))
            self.timeline.swaps.append((started, ended))
            if self._check_committed(result, version, "swaps"):
                self.found["swap_durations_s"].append(ended - started)
            self.updates.until_resting(options.watch_window_s + 30)
            self.timeline.states += _swap_states(self.updates.history(), started, ended)
            print(f"swap {index + 1}/{options.swaps}: v{version} in {ended - started:.2f} s",
                  flush=True)

    def _check_committed(self, result: dict[str, Any], version: int, phase: str) -> bool:
        """Whether a healthy update was committed; one that was not is a finding, kept and
        reported (``swap_failures``), and the run goes on with the next version."""
        self.version = version  # refused or not, its version number is used up
        if result.get("state") == "committed" and _serving_version(result) == version:
            return True
        failure = {"phase": phase, "version": version, "state": result.get("state"),
                   "reason": _reason(result)}
        self.found["swap_failures"].append(failure)
        print(f"healthy v{version} was NOT committed: {failure}", flush=True)
        return False

    def misbehaving(self) -> None:
        """The canary's refusal, then the watch window's rollback (module docstring)."""
        assert self.load is not None
        serving = self.version
        version, bundle = self._next("disagree")
        started = time.perf_counter()
        result = self.updates.apply(bundle)
        ended = time.perf_counter()
        self.timeline.canary = (started, ended)
        self.found["canary_reject"] = {"version": version, "state": result.get("state"),
                                       "reason": _reason(result), "seconds": ended - started,
                                       "serving_after": _serving_version(result)}
        self.version = version  # refused, but its version number is used up
        print(f"disagreeing v{version}: {result.get('state')} ({_reason(result)}) in "
              f"{ended - started:.2f} s", flush=True)

        version, bundle = self._next("nan_on_negative")
        started = time.perf_counter()
        result = self.updates.apply(bundle)
        self.load.negative.set()  # from now on the committed version answers NaN
        committed = result.get("state") == "committed"
        final = self.updates.until_resting(self.options.watch_window_s + 60)
        time.sleep(0.5)  # the restored version answers a while before the frames change back
        self.load.negative.clear()
        self.timeline.watch = (started, time.perf_counter())
        self.found["watch_rollback"] = {
            "version": version, "previous_version": serving, "committed": committed,
            "state_after": final["state"],
            "reason": ((final.get("updater") or {}).get("last_outcome") or {}).get("reason"),
            "serving_after": _serving_version(final)}
        self.version = version
        print(f"NaN-after-commit v{version}: committed={committed}, then {final['state']} "
              f"({self.found['watch_rollback']['reason']}), v{_serving_version(final)} serves",
              flush=True)

    def _settled_resources(self) -> dict[str, float]:
        """The daemon's resources once the updater rests and the control connection that
        asked has closed: both readings of the soak are taken alike."""
        self.updates.until_resting(self.options.watch_window_s + 30)
        time.sleep(0.5)
        return self.daemon.resources()

    def soak(self) -> None:
        options = self.options
        started = time.perf_counter()
        # The first reading after the warm-up swaps, or half-way through a short soak.
        warmup = min(options.soak_warmup_swaps, options.soak_swaps // 2)
        first: dict[str, float] | None = None
        if warmup == 0:
            first = self._settled_resources()
        files_before = _tree_files(self.daemon.spec.state_dir)
        readings = []
        for index in range(options.soak_swaps):
            version, bundle = self._next()
            result = self.updates.apply(bundle)
            if not self._check_committed(result, version, "soak"):
                self.found["soak_failed_swaps"] = self.found.get("soak_failed_swaps", 0) + 1
            bundle.unlink()
            if index + 1 == warmup:
                first = self._settled_resources()
            if (index + 1) % 50 == 0 or index + 1 == options.soak_swaps:
                reading = self.daemon.resources()
                readings.append({"swaps": index + 1, **reading})
                print(f"soak {index + 1}/{options.soak_swaps}: rss {reading['rss_mib']:.1f} MiB, "
                      f"{reading['fds']:.0f} fds, {reading['threads']:.0f} threads", flush=True)
        last = self._settled_resources()
        self.timeline.soak = (started, time.perf_counter())
        assert first is not None
        self.found["soak"] = {"swaps": options.soak_swaps, "warmup_swaps": warmup, "start": first, "end": last,
                              "readings": readings,
                              "seconds": self.timeline.soak[1] - started,
                              "state_dir_mib": _tree_mib(self.daemon.spec.state_dir),
                              "state_dir_files_before": files_before,
                              "state_dir_files": _tree_files(self.daemon.spec.state_dir)}


def run_bench(options: SwapBenchOptions) -> dict[str, Any]:
    """Run every phase against a fresh daemon; returns the summary (:func:`summarize`)."""
    with tempfile.TemporaryDirectory(prefix="edge-agent-swap-") as temp:
        work = Path(temp)
        maker = BundleMaker(work / "bundles")
        config = options.config
        if config is None:
            config = work / "agent.toml"  # the embedded defaults, not the board's file
            config.write_text("")
        spec = DaemonSpec(
            state_dir=work / "state", config=config, public_key=maker.public_key_path,
            first_bundle=maker.bundle(1), port_file=work / "daemon.port",
            backend=options.backend,
            canary={"duration_s": options.canary_duration_s,
                    "min_samples": options.canary_min_samples},
            update={"watch_window_s": options.watch_window_s})
        daemon = DaemonProcess(spec, work)
        run: _Run | None = None
        try:
            daemon.wait_ready()
            run = _Run(options, daemon, maker, Updates(spec.state_dir))
            run.capacity()
            run.steady()
            run.swaps()
            run.misbehaving()
            run.soak()
        finally:
            try:
                records = run.load.stop() if run is not None and run.load is not None else []
            finally:
                status = daemon.stop()
        if status != 0:
            raise AgentError("the daemon exited with an error", status=status,
                             log=daemon.log_tail())
        assert run is not None  # every phase ran
        return summarize(options, run.found, run.timeline, records)


# -- the figures -----------------------------------------------------------------------------

def _tree_mib(root: Path) -> float:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) / 2**20


def _tree_files(root: Path) -> int:
    return sum(1 for path in root.rglob("*") if path.is_file())


def _latency_figures(records: Sequence[Record]) -> dict[str, Any]:
    answered = [record.latency_s for record in records if not record.failed]
    figures: dict[str, Any] = {"requests": len(records),
                               "failed": sum(record.failed for record in records)}
    if answered:
        p50, p99 = loadgen.percentiles(answered, (50, 99))
        figures.update(p50_ms=p50 * 1e3, p99_ms=p99 * 1e3, max_ms=max(answered) * 1e3)
    return figures


_WALL_MINUS_PERF = time.time() - time.perf_counter()  # one machine, one clock: good to ~1 ms


def _parse_at(text: str) -> float:
    """A journal time (ISO-8601 UTC with milliseconds) on the ``perf_counter`` clock."""
    moment = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc)
    return moment.timestamp() - _WALL_MINUS_PERF


def _swap_states(history: Sequence[dict[str, Any]], started: float, ended: float,
                 ) -> list[tuple[str, float, float]]:
    """The updater states one swap went through, from the journal's history: each state from
    its transition in to the next transition (the last one, ``committed``, ends with the swap's
    answer)."""
    events = [(event["to"], _parse_at(event["at"])) for event in history
              if event.get("from") != event.get("to")]
    events = [(state, at) for state, at in events if started - 0.05 <= at <= ended + 0.05]
    spans = []
    for index, (state, at) in enumerate(events):
        if state == "committed":
            spans.append((state, at, ended))
            break
        end = events[index + 1][1] if index + 1 < len(events) else ended
        spans.append((state, at, end))
    return spans


def _by_state(records: Sequence[Record], spans: Sequence[tuple[str, float, float]],
              steady_p99_ms: float | None) -> dict[str, Any]:
    """Latency of the requests that overlapped each updater state (over all swaps): where in a
    swap the excess over steady comes from. A request overlapping two states counts in both."""
    grouped: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for state, start, end in spans:
        grouped[state].append((start, end))
    found = {}
    for state, intervals in grouped.items():
        figures = _latency_figures([record for record in records
                                    if _overlaps(record, intervals)])
        figures["seconds"] = sum(end - start for start, end in intervals)
        figures["p99_over_steady"] = (figures["p99_ms"] / steady_p99_ms
                                      if steady_p99_ms and figures.get("p99_ms") else None)
        found[state] = figures
    return found


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def _overlaps(record: Record, intervals: Sequence[tuple[float, float]]) -> bool:
    return any(record.started_s < end and record.finished_s > start for start, end in intervals)


def _within(record: Record, interval: tuple[float, float]) -> bool:
    return interval[0] <= record.started_s and record.finished_s <= interval[1]


def _rollback(records: Sequence[Record], found: dict[str, Any]) -> dict[str, Any]:
    """The watch window's rollback, as the clients saw it (``rollback_s``: module docstring)."""
    watch = dict(found["watch_rollback"])
    bad, old = watch["version"], watch["previous_version"]
    by_bad = [record for record in records if record.version == bad]
    watch["answers"] = len(by_bad)
    watch["nan_answers"] = sum(record.outcome == "non_finite" for record in by_bad)
    if not by_bad:
        watch["rollback_s"] = None
        return watch
    first_bad = min(record.finished_s for record in by_bad)
    last_bad = max(record.finished_s for record in by_bad)
    restored = [record.finished_s for record in records
                if record.version == old and record.finished_s > last_bad]
    nan = [record.finished_s for record in by_bad if record.outcome == "non_finite"]
    watch["rollback_s"] = min(restored) - first_bad if restored else None
    # The watch window's own part: from the first NaN answer to the old version alone.
    watch["from_first_nan_s"] = min(restored) - min(nan) if restored and nan else None
    return watch


SENT_BIN_S = 0.05
SENT_BINS = 4


def _sent_after_apply(records: Sequence[Record], swaps: Sequence[tuple[float, float]],
                      quiet_p50_ms: float | None) -> list[dict[str, Any]]:
    """Latency of the requests by when they were *sent* after each swap's ``update.apply``, in
    :data:`SENT_BIN_S` bins (the first :data:`SENT_BINS`), each bin's P50 over the quiet gaps'.
    Not a target. Unlike ``swap_states``, which takes the requests that overlapped a state and
    so favours slow requests in a short state, the time a request is sent does not depend on
    its latency: this shows when in a swap the daemon is slower, whatever state runs then."""
    starts = sorted(started for started, _ in swaps)
    sent: list[list[Record]] = [[] for _ in range(SENT_BINS)]
    for record in records:
        latest = bisect.bisect_right(starts, record.started_s) - 1
        if latest >= 0:
            index = int((record.started_s - starts[latest]) // SENT_BIN_S)
            if index < SENT_BINS:
                sent[index].append(record)
    found = []
    for index, requests in enumerate(sent):
        figures = _latency_figures(requests)
        found.append({"from_ms": round(index * SENT_BIN_S * 1000),
                      "to_ms": round((index + 1) * SENT_BIN_S * 1000),
                      "requests": figures["requests"], "p50_ms": figures.get("p50_ms"),
                      "p50_over_quiet": _ratio(figures.get("p50_ms"), quiet_p50_ms)})
    return found


def _sent_line(bins: Sequence[dict[str, Any]]) -> str:
    """One line for ``sent_after_apply``."""
    parts = [f"{entry['from_ms']}-{entry['to_ms']} ms {entry['p50_over_quiet']:.2f}x"
             for entry in bins if entry.get("p50_over_quiet") is not None]
    return ("sent after update.apply, P50 over the quiet gaps' (not a target): "
            + (", ".join(parts) if parts else "none"))


def _tail_by_swap(during: Sequence[Record], quiet: Sequence[Record],
                  swaps: Sequence[tuple[float, float]], gaps: Sequence[tuple[float, float]],
                  quiet_p99_ms: float | None) -> dict[str, Any]:
    """Which swaps the slowest 1 % of the requests that overlapped a swap came from, and how
    slow each one's own gap (the load alone just before it) was against all the gaps: where the
    tail comes from a few swaps whose gaps were slow as well, the machine was slow then, not the
    swap. Not a target. ``during``: the requests that overlapped a swap; ``quiet``: those
    within a gap."""
    overlapping = [(record.latency_s, index) for index, interval in enumerate(swaps)
                   for record in during
                   if not record.failed and _overlaps(record, (interval,))]
    if not overlapping:
        return {"requests": 0, "swaps": []}
    (p99_s,) = loadgen.percentiles([latency for latency, _ in overlapping], (99,))
    held = collections.Counter(index for latency, index in overlapping if latency >= p99_s)
    found = []
    for index, count in held.most_common():
        gap = (_latency_figures([record for record in quiet
                                 if _within(record, gaps[index])]).get("p99_ms")
               if index < len(gaps) else None)
        found.append({"swap": index + 1, "requests": count, "gap_p99_ms": gap,
                      "gap_p99_over_quiet": _ratio(gap, quiet_p99_ms)})
    return {"requests": sum(held.values()), "swaps": found}


def summarize(options: SwapBenchOptions, found: dict[str, Any], timeline: _Timeline,
              records: Sequence[Record]) -> dict[str, Any]:
    swaps = timeline.swaps or []
    steady = [record for record in records if _within(record, timeline.steady)]
    during = [record for record in records if _overlaps(record, swaps)]
    span = (swaps[0][0], swaps[-1][1]) if swaps else (0.0, 0.0)
    between = [record for record in records
               if _within(record, span) and not _overlaps(record, swaps)]
    quiet = [record for record in records
             if any(_within(record, interval) for interval in timeline.quiet)]
    canary_window = [record for record in records if _within(record, timeline.canary)]
    soak = [record for record in records if _within(record, timeline.soak)]
    phases = {"steady": _latency_figures(steady), "during_swaps": _latency_figures(during),
              "between_swaps": _latency_figures(between), "quiet_gaps": _latency_figures(quiet),
              "canary_reject": _latency_figures(canary_window),
              "soak": _latency_figures(soak)}
    steady_p99 = phases["steady"].get("p99_ms")
    for entry in phases.values():
        entry["p99_over_steady"] = (entry["p99_ms"] / steady_p99
                                    if steady_p99 and entry.get("p99_ms") else None)
    by_state = _by_state(during, timeline.states, steady_p99)
    failures = collections.Counter(record.outcome for record in records if record.failed)
    canary = dict(found["canary_reject"])
    canary["answers_by_refused_version"] = sum(record.version == canary["version"]
                                               for record in records)
    watch = _rollback(records, found)
    soak_found = found["soak"]
    durations = found["swap_durations_s"]
    summary: dict[str, Any] = {
        "swaps": len(durations),
        "failed_requests": sum(failures.values()),
        "failures_by_kind": dict(sorted(failures.items())),
        "requests": len(records),
        "p99_swap_over_steady": phases["during_swaps"]["p99_over_steady"],
        # Not a target: the same P99 over that of the quiet gaps, a baseline taken in the
        # swaps' own minutes (the steady phase runs before them, and a shared machine's speed
        # drifts between the two).
        "p99_swap_over_quiet": _ratio(phases["during_swaps"].get("p99_ms"),
                                      phases["quiet_gaps"].get("p99_ms")),
        "rollback_s": watch["rollback_s"],
        "soak_swaps": soak_found["swaps"] - found.get("soak_failed_swaps", 0),
        "swap_failures": found["swap_failures"],
        "soak_rss_growth_mib": soak_found["end"]["rss_mib"] - soak_found["start"]["rss_mib"],
        "soak_fd_growth": soak_found["end"]["fds"] - soak_found["start"]["fds"],
        "soak_thread_growth": soak_found["end"]["threads"] - soak_found["start"]["threads"],
        "capacity": found["capacity"],
        "load_rps": found["load_rps"],
        "phases": phases,
        "swap_states": by_state,
        "tail_by_swap": _tail_by_swap(during, quiet, swaps, timeline.quiet,
                                      phases["quiet_gaps"].get("p99_ms")),
        "sent_after_apply": _sent_after_apply(records, swaps,
                                              phases["quiet_gaps"].get("p50_ms")),
        "swap_seconds": {"median": statistics.median(durations) if durations else None,
                         "max": max(durations, default=None), "all": durations},
        "canary_reject": canary,
        "watch_rollback": watch,
        "soak": soak_found,
        "options": {key: str(value) if isinstance(value, Path) else value
                    for key, value in asdict(options).items()},
    }
    summary["targets"] = _targets(summary)
    return summary


def _targets(summary: dict[str, Any]) -> dict[str, bool | None]:
    def at_most(value: Any, bound: float) -> bool | None:
        return None if value is None else value <= bound

    canary = summary["canary_reject"]
    watch = summary["watch_rollback"]
    return {
        "failed_requests": summary["failed_requests"] == 0,
        "healthy_swaps_committed": not summary["swap_failures"],
        "p99_swap_over_steady": at_most(summary["p99_swap_over_steady"],
                                        TARGETS["p99_swap_over_steady"]),
        "rollback_s": at_most(summary["rollback_s"], TARGETS["rollback_s"]),
        "soak_swaps": summary["soak_swaps"] >= TARGETS["soak_swaps"],
        "soak_rss_growth_mib": at_most(summary["soak_rss_growth_mib"],
                                       TARGETS["soak_rss_growth_mib"]),
        "soak_fds_flat": summary["soak_fd_growth"] <= 0,
        "canary_refused": canary["state"] == "failed"
        and canary["answers_by_refused_version"] == 0,
        "watch_rolled_back": watch["serving_after"] == watch["previous_version"],
    }


def _tail_line(tail: dict[str, Any]) -> str:
    """One line for ``tail_by_swap``: the swaps holding the slowest 1 % of the overlapping
    requests, each with its gap's P99 over that of all the gaps."""
    if not tail.get("swaps"):
        return "slowest 1 % during swaps: none"
    parts = []
    for entry in tail["swaps"][:5]:
        gap = entry.get("gap_p99_over_quiet")
        parts.append(f"swap {entry['swap']}: {entry['requests']}"
                     + (f" (its gap {gap:.2f}x the gaps' P99)" if gap is not None else ""))
    more = len(tail["swaps"]) - 5
    return (f"slowest 1 % during swaps ({tail['requests']} requests) from "
            f"{len(tail['swaps'])} swap(s): " + ", ".join(parts)
            + (f", {more} more" if more > 0 else ""))


def format_summary(summary: dict[str, Any]) -> str:
    def ms(value: Any) -> str:
        return f"{value:8.1f}" if isinstance(value, (int, float)) else "       -"

    def ratio(value: Any) -> str:
        return f"{value:6.2f}x" if isinstance(value, (int, float)) else "      -"

    capacity = summary["capacity"]
    lines = [f"capacity {capacity['rps']:.0f} req/s (closed loop, c={capacity['concurrency']}); "
             f"load {summary['load_rps']:.0f} req/s",
             f"{'phase':<15}{'requests':>9}{'failed':>7}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'max ms':>9}{'p99/steady':>11}"]
    for name, entry in summary["phases"].items():
        lines.append(f"{name:<15}{entry['requests']:>9}{entry['failed']:>7}"
                     f"{ms(entry.get('p50_ms'))}{ms(entry.get('p99_ms'))}"
                     f"{ms(entry.get('max_ms'))}{ratio(entry['p99_over_steady']):>11}")
    states = summary.get("swap_states") or {}
    if states:
        lines.append(f"{'swap state':<15}{'requests':>9}{'seconds':>8}{'p50 ms':>9}"
                     f"{'p99 ms':>9}{'max ms':>9}{'p99/steady':>11}")
    for name, entry in states.items():
        lines.append(f"{name:<15}{entry['requests']:>9}{entry['seconds']:>8.2f}"
                     f"{ms(entry.get('p50_ms'))}{ms(entry.get('p99_ms'))}"
                     f"{ms(entry.get('max_ms'))}{ratio(entry['p99_over_steady']):>11}")
    swap_s = summary["swap_seconds"]
    canary = summary["canary_reject"]
    watch = summary["watch_rollback"]
    soak = summary["soak"]
    targets = summary["targets"]

    def verdict(key: str) -> str:
        value = targets.get(key)
        return "n/a" if value is None else ("met" if value else "NOT met")

    def seconds(value: Any) -> str:
        return f"{value:.2f} s" if isinstance(value, (int, float)) else "-"

    lines += [
        f"swaps {summary['swaps']}: median {seconds(swap_s['median'])}, max "
        f"{seconds(swap_s['max'])} (apply to committed); healthy updates not committed: "
        f"{len(summary['swap_failures'])}",
        f"failed requests {summary['failed_requests']} of {summary['requests']} "
        f"(target 0: {verdict('failed_requests')})",
        f"P99 during swaps / steady {ratio(summary['p99_swap_over_steady']).strip()} "
        f"(target <= 1.5: {verdict('p99_swap_over_steady')}); over the quiet gaps between "
        f"them {ratio(summary['p99_swap_over_quiet']).strip()} (not a target)",
        _tail_line(summary.get("tail_by_swap") or {}),
        _sent_line(summary.get("sent_after_apply") or []),
        f"canary: disagreeing v{canary['version']} {canary['state']} ({canary['reason']}) in "
        f"{canary['seconds']:.2f} s, {canary['answers_by_refused_version']} answers by it",
        f"watch: NaN-after-commit v{watch['version']} rolled back to v{watch['serving_after']} "
        f"({watch['reason']}); rollback {seconds(watch['rollback_s'])} (target <= 30 s: "
        f"{verdict('rollback_s')}), {seconds(watch.get('from_first_nan_s'))} after the first "
        f"NaN answer, {watch['nan_answers']} NaN answers",
        f"soak {summary['soak_swaps']} swaps in {soak['seconds']:.0f} s: RSS "
        f"{soak['start']['rss_mib']:.1f} -> {soak['end']['rss_mib']:.1f} MiB "
        f"({summary['soak_rss_growth_mib']:+.1f}; target <= 20: "
        f"{verdict('soak_rss_growth_mib')}), fds {soak['start']['fds']:.0f} -> "
        f"{soak['end']['fds']:.0f}, threads {soak['start']['threads']:.0f} -> "
        f"{soak['end']['threads']:.0f}, state dir {soak['state_dir_mib']:.1f} MiB in "
        f"{soak['state_dir_files']} files",
    ]
    return "\n".join(lines)


__all__ = ["TARGETS", "SwapBenchOptions", "format_summary", "run_bench", "summarize"]
