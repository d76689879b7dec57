"""Prometheus metrics of the inference server, through the ``prometheus-client`` package.

Names follow Prometheus conventions (``edge_agent_`` prefix, base units, ``_total`` counters). Each
server owns its own registry, so several servers (tests, a blue-green pair) never share state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from agent.observers import BatchDone, RequestDone, ServingObserver

__all__ = ["CONTENT_TYPE_LATEST", "PowerMetrics", "ServingMetrics", "TaskMetrics",
           "UpdateMetrics"]

# Request latencies from 0.5 ms (a tiny model on a GPU) to 10 s (a full queue on a slow CPU).
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                      10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServingMetrics(ServingObserver):
    """The metrics of one model's serving path, subscribed to what its batcher reports."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model"]
        self._requests = Counter(
            "edge_agent_requests", "Inference requests by outcome (success, failure, rejected, "
            "timeout, invalid)", [*labels, "outcome"], registry=self.registry)
        self._request_seconds = Histogram(
            "edge_agent_request_duration_seconds", "End-to-end time of a request inside the "
            "server (receive to response)", labels, buckets=_LATENCY_BUCKETS_S,
            registry=self.registry)
        self._queue_seconds = Histogram(
            "edge_agent_queue_duration_seconds", "Time a request waited in the batcher's queue",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._compute_seconds = Histogram(
            "edge_agent_compute_duration_seconds", "Time the backend spent on a request's batch",
            labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self._batch_size = Histogram(
            "edge_agent_batch_size", "Samples per executed batch", labels,
            buckets=_BATCH_BUCKETS, registry=self.registry)
        self._queue_depth = Gauge(
            "edge_agent_queue_depth", "Requests waiting in the batcher's queue", labels,
            registry=self.registry)
        self._model_version = Gauge(
            "edge_agent_model_version", "Version of the model being served", labels,
            registry=self.registry)
        self._inflight = Gauge(
            "edge_agent_requests_in_flight", "Requests received and not yet answered", labels,
            registry=self.registry)
        # labels() costs a lookup and a lock per call; the serving path resolves them once.
        self._outcomes: dict[str, Any] = {}
        self._request_child = self._request_seconds.labels(model)
        self._queue_child = self._queue_seconds.labels(model)
        self._compute_child = self._compute_seconds.labels(model)
        self._batch_child = self._batch_size.labels(model)
        self._depth_child = self._queue_depth.labels(model)
        self._inflight_child = self._inflight.labels(model)

    def _outcome(self, outcome: str) -> Any:
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self._requests.labels(self.model, outcome)
        return child

    # -- what the batcher reports -------------------------------------------------------

    def request_done(self, event: RequestDone) -> None:
        self._outcome(event.outcome).inc()
        if event.outcome == "success":
            self._queue_child.observe(event.queue_s)
            self._compute_child.observe(event.compute_s)

    def batch_done(self, event: BatchDone) -> None:
        self._batch_child.observe(event.batch_size)

    def queue_depth(self, depth: int) -> None:
        self._depth_child.set(depth)

    # -- the HTTP layer -----------------------------------------------------------------

    def request_rejected(self, outcome: str) -> None:
        """A request that never reached the batcher (bad input, full queue, not ready)."""
        self._outcome(outcome).inc()

    def observe_request(self, total_s: float) -> None:
        self._request_child.observe(total_s)

    def set_model_version(self, version: int) -> None:
        self._model_version.labels(self.model).set(version)

    def inflight(self, delta: int) -> None:
        self._inflight_child.inc(delta)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TaskMetrics:
    """The daemon's background tasks (agent/supervisor.py): whether each runs, and how often
    one failed. A fleet's monitoring alerts on ``edge_agent_task_up == 0`` for a task that
    should run."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._up = Gauge("edge_agent_task_up", "1 while the background task runs, else 0",
                         ["task"], registry=self.registry)
        self._failures = Counter("edge_agent_task_failures", "Background task failures (raised, "
                                 "or ended while the daemon still ran)", ["task"],
                                 registry=self.registry)

    def task_changed(self, name: str, *, running: bool, failed: bool) -> None:
        self._up.labels(name).set(1 if running else 0)
        if failed:
            self._failures.labels(name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class UpdateMetrics(Collector):
    """The updater's figures, read from its status at each scrape (so they never disagree with
    ``edge-agent update status``): the state it is in, attempts, failures by reason, swaps and
    their duration, canary and watch verdicts, rollbacks; and the serving instances per model.

    Args:
        status: The updater's ``status()`` (its ``state`` and ``counters``).
        states: Every state the updater has, for the one-hot state gauge.
        instances: Model name to the number of instances serving it.
    """

    def __init__(self, status: Callable[[], dict[str, Any]], states: Sequence[str],
                 instances: Callable[[], dict[str, int]],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._status = status
        self._states = tuple(states)
        self._instances = instances
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        status = self._status()
        counters = status.get("counters", {})
        state = GaugeMetricFamily("edge_agent_update_state", "1 for the state the updater is in",
                                  labels=["state"])
        for name in self._states:
            state.add_metric([name], 1.0 if name == status.get("state") else 0.0)
        yield state
        yield CounterMetricFamily("edge_agent_update_attempts", "Update runs started (resumed "
                                  "ones included)", value=counters.get("attempts", 0))
        failures = CounterMetricFamily("edge_agent_update_failures", "Updates that failed, by "
                                       "reason", labels=["reason"])
        for reason, count in sorted(counters.get("failures_by_reason", {}).items()):
            failures.add_metric([reason], count)
        yield failures
        for name, key, text in (
                ("edge_agent_canary_verdicts", "canary_verdicts", "Canary verdicts"),
                ("edge_agent_watch_verdicts", "watch_verdicts", "Post-commit watch verdicts")):
            family = CounterMetricFamily(name, text, labels=["verdict"])
            for verdict, count in sorted(counters.get(key, {}).items()):
                family.add_metric([verdict], count)
            yield family
        swaps = SummaryMetricFamily("edge_agent_swap_duration_seconds", "Commits of a new "
                                    "version: switch, drain and free of the old instances")
        swaps.add_metric([], count_value=counters.get("swaps", 0),
                         sum_value=counters.get("swap_seconds_total", 0.0))
        yield swaps
        yield CounterMetricFamily("edge_agent_rollbacks", "Reverts to a previous version, "
                                  "automatic or by an operator", value=counters.get("rollbacks", 0))
        instances = GaugeMetricFamily("edge_agent_instances", "Execution instances serving a "
                                      "model", labels=["model"])
        for model, count in sorted(self._instances().items()):
            instances.add_metric([model], count)
        yield instances

    def describe(self) -> Iterator[Any]:
        return iter(())  # collected at scrape time only: nothing to check at registration

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Wake latencies: from a few milliseconds (clocks raised) to the wake bound and past it.
_WAKE_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class PowerMetrics(Collector):
    """The power governor's figures (agent/power/service.py): the board's clocks, power by
    rail and temperatures from its latest telemetry, the power state, the governor's decisions,
    and the wake latency. Read at each scrape from the service's ``metrics_view()``, so they
    never disagree with ``edge-agent power status``; the wake latency is a histogram the
    service observes.

    Args:
        view: The service's latest figures: ``state``, ``states``, ``decisions``, ``wakes``,
            ``wake_timeouts`` and ``telemetry`` (a :class:`power.types.Telemetry` or None).
    """

    def __init__(self, view: Callable[[], dict[str, Any]],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._view = view
        self.registry.register(self)
        self.wake_seconds = Histogram(
            "edge_agent_power_wake_duration_seconds", "From a wake request (the first request "
            "after sleep, or a command) until the board was raised to serve", ["trigger"],
            buckets=_WAKE_BUCKETS_S, registry=self.registry)

    def observe_wake(self, trigger: str, seconds: float) -> None:
        self.wake_seconds.labels(trigger).observe(seconds)

    def collect(self) -> Iterator[Any]:
        view = self._view()
        state = GaugeMetricFamily("edge_agent_power_state", "1 for the power state the board "
                                  "is in (active, idle, sleeping, waking)", labels=["state"])
        for name in view.get("states", ()):
            state.add_metric([name], 1.0 if name == view.get("state") else 0.0)
        yield state
        yield CounterMetricFamily("edge_agent_power_decisions", "Operating point changes the "
                                  "governor made", value=view.get("decisions", 0))
        yield CounterMetricFamily("edge_agent_power_wakes", "Wakes of the board (by what "
                                  "asked: the wake duration histogram's trigger)", value=view.get("wakes", 0))
        yield CounterMetricFamily("edge_agent_power_wake_timeouts", "Requests dispatched "
                                  "without waiting longer for a wake that did not finish",
                                  value=view.get("wake_timeouts", 0))
        telemetry = view.get("telemetry")
        if telemetry is None:
            return
        yield from _telemetry_families(telemetry)

    def describe(self) -> Iterator[Any]:
        return iter(())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _telemetry_families(telemetry: Any) -> Iterator[Any]:
    """One reading of the board (a power.types.Telemetry) as gauges, in base units."""
    freq = GaugeMetricFamily("edge_agent_power_frequency_hertz", "Clock frequencies now",
                             labels=["clock"])
    if telemetry.gpu_freq_hz is not None:
        freq.add_metric(["gpu"], float(telemetry.gpu_freq_hz))
    for index, khz in enumerate(telemetry.cpu_freq_khz):
        if khz is not None:  # an unreadable policy has no sample; the others keep their labels
            freq.add_metric([f"cpu{index}"], khz * 1000.0)  # per cpufreq policy (cluster)
    if telemetry.emc_hz is not None:
        freq.add_metric(["emc"], float(telemetry.emc_hz))
    yield freq
    if telemetry.gpu_load is not None:
        yield GaugeMetricFamily("edge_agent_power_gpu_load_ratio", "GPU load, 0..1",
                                value=telemetry.gpu_load)
    rails = GaugeMetricFamily("edge_agent_power_rail_watts", "Power by rail (INA3221 monitors)",
                              labels=["rail"])
    for rail, milliwatts in sorted(telemetry.rails_mw.items()):
        rails.add_metric([rail], milliwatts / 1000.0)
    yield rails
    if telemetry.total_power_mw is not None:
        yield GaugeMetricFamily("edge_agent_power_total_watts", "The board's input power "
                                "(VDD_IN where present, else the sum of the rails)",
                                value=telemetry.total_power_mw / 1000.0)
    temps = GaugeMetricFamily("edge_agent_power_temperature_celsius", "Thermal zones",
                              labels=["zone"])
    for zone in telemetry.thermal:
        if zone.temp_c is not None:
            temps.add_metric([zone.name], zone.temp_c)
    yield temps
    margin = telemetry.hottest_margin_c()
    if margin is not None:
        yield GaugeMetricFamily("edge_agent_power_thermal_margin_celsius", "Degrees below the "
                                "nearest trip point over every zone", value=margin)
