"""``edge-agent bench fleet``: hundreds of lightweight agents driven by ``fleet deploy``'s engine
through one TLS broker (issue 17's benchmark).

What the agents are, exactly: each is the real MQTT link, the real device control plane and the
real updater with its journal in a state directory of its own, and each update really downloads
the bundle over HTTP from the fleet's file server, verifies its signature and hashes, installs it
into the agent's own store, loads it into an ONNX Runtime session (one intra-op thread) and runs
a warm-up batch that refuses NaN or Inf. They skip the HTTP inference server and the shadow
canary and watch window on live traffic (there is none): agent/tooling/fleetbench/steps.py says
it state by state. They run in ``processes`` processes (agent/tooling/fleetbench/agents.py).

Everything else is the production path. A fleet workspace is made (``fleet init``: the fleet
key, the CAs, the broker's certificate), the broker's production configuration written (two TLS
listeners, no anonymous clients, the ``%u`` ACL, persistence with its default autosave interval),
every agent provisioned with ``devices add`` (its own password in the broker's password file),
the bundles published into the artifact directory (``fleet publish``) and served by the fleet's
static file server (``edge-agent fleet serve``, a process of its own). Rollouts are driven by
``fleet deploy``'s engine (agent/fleet/ops/deploy.py: the rollout document, the stages, the
abort rule, the rollback) on an operator connection (the operator certificate); the phases are
timed from a second operator connection that only watches (agent/tooling/fleetbench/observer.py).

The phases, each a rollout to every agent:

1. ``converge_s``: version 2 in one stage, from the deploy's start until every agent reports
   it converged (its newest desired document answered ``converged``, version 2 applied).
2. ``converge_s_with_broker_restart``: version 3 the same way; the moment the watching
   connection sees a quarter of the agents converged the broker is SIGKILLed (what it did not
   autosave is lost: retained documents, sessions) and started again after ``broker_down_s``.
   Afterwards a fresh subscriber counts the retained desired documents the broker holds.
3. The misbehaving version 4 (NaN outputs: the warm-up refuses it) in stages of ``canary`` then
   everyone, with ``fleet deploy``'s default abort rule (failure share above 20 % once 3 devices of
   the stage finished). ``bad_bundle_reached``: the agents that took it (the rollout gave it to
   them, or they downloaded and verified it: the agents' own record); ``bad_bundle_reverted_s``:
   from the rollout's abort until every one of them reports the rollout's way back (a desired
   document naming version 3, ``allow_downgrade``) converged with version 3 applied. The
   warm-up refused version 4 before it served, so they never left version 3: the way back is
   the rollback document's round trip, and ``bad_bundle_served`` (agents that committed it,
   from their own record) says so.

``lost`` counts the agents that did not converge on a phase's version within
``phase_timeout_s``, in any phase.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import getpass
import json
import math
import os
import resource
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import AgentError, ConfigError, FleetError
from agent.tooling.fleetbench.agents import AgentEntry, ProcessSpec
from agent.tooling.fleetbench.broker import (
    FleetBroker,
    free_port,
    process_cpu_s,
    process_memory,
)
from agent.tooling.fleetbench.bundles import MODEL_NAME, FleetBundles
from agent.tooling.fleetbench.observer import FleetObserver
from agent.tooling.processes import stop_process

__all__ = ["TARGETS", "FleetBenchOptions", "format_summary", "run_bench"]

TARGETS = {"converge_s": 60.0, "converge_s_with_broker_restart": 90.0, "lost": 0,
           "bad_bundle_reached": 3, "bad_bundle_reverted_s": 120.0}
FLEET = "bench"
READY_TIMEOUT_S = 600.0  # every agent installed, loaded and connected
REPORT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
# paho's network loop waits with select(), which cannot watch a file descriptor numbered 1024 or
# more (FD_SETSIZE): a link whose socket gets such a number fails every connection attempt, and
# paho reports it as a lost connection. An agent holds about 4 descriptors at rest (its TLS
# socket, paho's wake-up socket pair, its store's lock) and about 3 more while it downloads and
# installs; so at most 200 agents a process, 100 by default.
AGENTS_PER_PROCESS = 100
MAX_AGENTS_PER_PROCESS = 200
LIGHTWEIGHT = ("each agent: the real MQTT link, control plane and updater (journal in its own "
               "state dir); the bundle downloaded over HTTP, verified, installed into its own "
               "store, loaded into an ONNX Runtime session and warmed up (NaN/Inf refused); "
               "skipped: the HTTP inference server and the canary/watch on live traffic "
               "(there is none)")


@dataclass(frozen=True, kw_only=True)
class FleetBenchOptions:
    """The benchmark's sizes (module docstring).

    Args:
        agents: How many agents.
        processes: How many processes they run in (0: one per ``AGENTS_PER_PROCESS``); at most
            ``MAX_AGENTS_PER_PROCESS`` agents go in one.
        canary: The misbehaving version's first stage.
        phase_timeout_s: How long a phase may take before its stragglers count as lost.
        broker_down_s: How long the broker stays down in phase 2.
        kill_at_share: The share of agents converged in phase 2 when the broker is killed.
        pool_threads: Each process's pool for the agents' blocking update work.
        work_dir: Where everything goes (kept); None: a temporary directory, removed after.
    """

    agents: int = 300
    processes: int = 0
    canary: int = 3
    phase_timeout_s: float = 300.0
    broker_down_s: float = 2.0
    kill_at_share: float = 0.25
    pool_threads: int = 4
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ConfigError("--agents must be at least 1", key="--agents", found=self.agents)
        if self.processes < 0:
            raise ConfigError("--processes must be 0 (automatic) or more", key="--processes",
                              found=self.processes)
        if math.ceil(self.agents / self.process_count()) > MAX_AGENTS_PER_PROCESS:
            raise ConfigError(
                f"at most {MAX_AGENTS_PER_PROCESS} agents fit in one process (paho's select() "
                "cannot watch file descriptors from 1024 on); give more --processes",
                key="--processes", found=self.processes, agents=self.agents)
        if not 1 <= self.canary < self.agents:
            raise ConfigError("the canary stage must be 1 to --agents minus 1 devices (a stage "
                              "of everyone follows it)", key="--canary", found=self.canary)
        if not 0.0 < self.kill_at_share < 1.0:
            raise ConfigError("the kill point is a share of the agents, above 0 and below 1",
                              key="--kill-at-share", found=self.kill_at_share)
        for name in ("phase_timeout_s", "broker_down_s"):
            if not getattr(self, name) > 0:
                raise ConfigError("a duration must be above zero", key=name,
                                  found=getattr(self, name))

    def process_count(self) -> int:
        if self.processes:
            return min(self.processes, self.agents)
        return max(1, math.ceil(self.agents / AGENTS_PER_PROCESS))


def _say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


# -- the fleet's files ----------------------------------------------------------------------------

@dataclass
class _Fleet:
    """What the setup made: the workspace, the devices, the bundles and the artifact index."""

    workspace: Any
    devices: list[str]
    entries: list[AgentEntry]
    bundles: FleetBundles
    first_bundle: Path
    file_port: int
    timings: dict[str, float] = field(default_factory=dict)


def _make_fleet(work: Path, options: FleetBenchOptions) -> _Fleet:
    """The workspace, the broker's configuration, the devices and the published bundles
    (blocking)."""
    from agent.fleet.ops.artifacts import publish_bundle
    from agent.fleet.ops.provision import add_device, init_workspace, write_broker_config

    timings: dict[str, float] = {}
    started = time.monotonic()
    bundles = FleetBundles(work / "bundles")
    made = {version: bundles.bundle(version) for version in (1, 2, 3)}
    made[4] = bundles.bundle(4, non_finite=True)
    timings["bundles_s"] = time.monotonic() - started

    started = time.monotonic()
    device_port = free_port()
    operator_port = free_port(frozenset({device_port}))
    file_port = free_port(frozenset({device_port, operator_port}))
    workspace = init_workspace(
        work / "fleet", fleet=FLEET, broker_host="127.0.0.1", broker_names=["localhost"],
        device_port=device_port, operator_port=operator_port, artifacts_dir=work / "artifacts",
        artifacts_base_url=f"http://127.0.0.1:{file_port}",
        bundle_keys=[bundles.public_key_path])
    store = work / "broker-store"
    store.mkdir(parents=True, exist_ok=True)
    # The production configuration; only where it lives and who runs it differ.
    write_broker_config(workspace, persistence_dir=store, bind_address="127.0.0.1",
                        run_as_user=getpass.getuser(), log_dest="stderr")
    workspace.rollouts_dir.mkdir(parents=True, exist_ok=True)
    for path in made.values():
        publish_bundle(path, workspace.artifact_directory(), workspace.trusted_bundle_keys())
    timings["workspace_s"] = time.monotonic() - started

    started = time.monotonic()
    devices = [f"agent-{index:04d}" for index in range(options.agents)]
    entries = []
    for device in devices:
        directory = workspace.devices_dir / device
        # install_dir = where the files are: the agent uses them in place.
        add_device(workspace, device, groups=["bench"], out_dir=directory,
                   install_dir=directory)
        entries.append(AgentEntry(device=device, config=directory / "agent.toml"))
    timings["provision_s"] = time.monotonic() - started
    return _Fleet(workspace=workspace, devices=devices, entries=entries, bundles=bundles,
                  first_bundle=made[1], file_port=file_port, timings=timings)


# -- the agents' processes ------------------------------------------------------------------------

def _child_environment() -> dict[str, str]:
    """The environment of the benchmark's children: this one, with this source tree on the path
    when the package is run from it rather than installed."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[3]))
    return env


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _AgentProcess:
    """One process of agents, over its standard streams (agent/tooling/fleetbench/agents.py)."""

    def __init__(self, spec: ProcessSpec, spec_path: Path, log_path: Path) -> None:
        self.spec = spec
        self.spec_path = spec_path
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] = {}

    async def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent.tooling.fleetbench.agents", str(self.spec_path),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
                env=_child_environment(), limit=64 * 1024 * 1024)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def _event(self, wanted: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                raise AgentError("a process of agents ended early", process=self.spec.index,
                                 status=await self.process.wait(), log=self.log_tail())
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not ours (a library's stray output)
            if isinstance(event, dict) and event.get("event") == wanted:
                return event

    async def wait_ready(self) -> dict[str, Any]:
        self.ready = await self._event("ready")
        return self.ready

    async def request(self, command: str, answer: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": command}).encode() + b"\n")
        await self.process.stdin.drain()
        return await self._event(answer)

    async def stop(self) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.request("stop", "stopped"), STOP_TIMEOUT_S)
        try:
            return await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            process.kill()
            return await process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# -- the run ----------------------------------------------------------------------------------

class _Run:
    """One benchmark run in an event loop (the phases are its methods)."""

    def __init__(self, options: FleetBenchOptions, work: Path, fleet: _Fleet) -> None:
        self.options = options
        self.work = work
        self.fleet = fleet
        self.workspace = fleet.workspace
        self.devices = fleet.devices
        self.broker = FleetBroker(self.workspace, work / "mosquitto.log")
        self.processes: list[_AgentProcess] = []
        self.file_server: subprocess.Popen[bytes] | None = None
        self.observer: FleetObserver | None = None
        self.link: Any = None  # the deploy engine's OperatorLink
        self._notify: list[Any] = []
        self.found: dict[str, Any] = {"setup": dict(fleet.timings), "phases": {}}
        self.broker_peak_mib = 0.0
        self.lost: set[str] = set()
        self.stage_started_s: list[float] = []  # the running rollout's stages, all sent out

    # -- starting and stopping

    async def start(self) -> None:
        await asyncio.to_thread(self._start_file_server)
        await asyncio.to_thread(self.broker.start)
        await self._start_agents()
        await self._connect_operator()

    def _start_file_server(self) -> None:
        """``edge-agent fleet serve`` on the artifact directory, a process of its own (blocking)."""
        port = self.fleet.file_port
        with (self.work / "fileserver.log").open("ab") as log:
            self.file_server = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "serve",
                 str(self.workspace.artifact_directory()), "--host", "127.0.0.1", "--port",
                 str(port)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_child_environment())
        deadline = time.monotonic() + 30
        while not _accepts(port):
            if self.file_server.poll() is not None or time.monotonic() > deadline:
                raise AgentError("the file server did not start", port=port,
                                 status=self.file_server.poll(),
                                 log=_tail(self.work / "fileserver.log"))
            time.sleep(0.05)

    async def _start_agents(self) -> None:
        count = self.options.process_count()
        begun = time.monotonic()
        for index in range(count):
            spec = ProcessSpec(
                index=index, first_bundle=self.fleet.first_bundle, state_root=self.work / "agents",
                log_file=self.work / f"agents-{index}.log",
                agents=self.fleet.entries[index::count], pool_threads=self.options.pool_threads)
            path = spec.write(self.work / f"agents-{index}.json")
            process = _AgentProcess(spec, path, self.work / f"agents-{index}.stderr")
            await process.start()
            self.processes.append(process)
        _say(f"{len(self.devices)} agents starting in {count} process(es): install v1, load it, "
             "connect")
        ready = await asyncio.wait_for(asyncio.gather(*(process.wait_ready()
                                                        for process in self.processes)),
                                       READY_TIMEOUT_S)
        self.found["setup"]["agents_ready_s"] = time.monotonic() - begun
        self.found["setup"]["processes"] = [
            {key: event.get(key) for key in ("agents", "prepare_s", "connect_s", "base_rss_mib",
                                             "rss_mib", "fds")}
            for event in ready]
        _say(f"agents ready in {time.monotonic() - begun:.1f} s")

    async def _connect_operator(self) -> None:
        from agent.fleet.ops.operator import OperatorLink, operator_client_id

        workspace = self.workspace
        self.observer = FleetObserver(workspace.operator_options(f"bench-observer-{os.getpid()}"),
                                      fleet=FLEET, keys=[workspace.public_key()])
        await self.observer.start()

        async def on_change(about: str) -> None:
            for notify in self._notify:
                notify()

        self.link = OperatorLink(workspace.operator_options(operator_client_id("bench")),
                                 fleet=FLEET, signing_key=workspace.signing_key(),
                                 trusted_keys=[workspace.public_key()], on_change=on_change)
        await self.link.start()

    async def close(self) -> list[int | None]:
        statuses: list[int | None] = []
        for closing in (self.link, self.observer):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.stop()
        statuses = list(await asyncio.gather(*(process.stop() for process in self.processes)))
        if self.file_server is not None:
            await asyncio.to_thread(stop_process, self.file_server, timeout_s=10)
        await asyncio.to_thread(self.broker.stop)
        return statuses

    # -- measuring

    def _cpu(self) -> dict[str, float]:
        agents = sum(process_cpu_s(process.pid) or 0.0 for process in self.processes)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        files = process_cpu_s(self.file_server.pid) if self.file_server is not None else None
        return {"agents": agents, "operator": usage.ru_utime + usage.ru_stime,
                "broker": self.broker.cpu_s(), "file_server": files or 0.0,
                "wall": time.monotonic()}

    @staticmethod
    def _cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        wall = after["wall"] - before["wall"]
        used = {key: round(after[key] - before[key], 2)
                for key in ("agents", "operator", "broker", "file_server")}
        used["cores_busy"] = round(sum(used.values()) / wall, 2) if wall > 0 else 0.0
        return used

    def _sample_broker(self) -> None:
        rss = self.broker.rss_mib()
        if rss is not None:
            self.broker_peak_mib = max(self.broker_peak_mib, rss)

    def _progress(self, phase: str, version: int, started: float,
                  devices: Sequence[str] | None = None) -> Any:
        assert self.observer is not None
        observer = self.observer
        chosen = list(devices if devices is not None else self.devices)

        def show() -> None:
            self._sample_broker()
            counts = observer.tally(chosen, version)
            _say(f"  [{phase}] {time.monotonic() - started:6.1f} s: v{version} converged "
                 f"{counts['converged']}/{len(chosen)}, applying {counts['applying']}, "
                 f"waiting {counts['waiting']}, failed {counts['failed']}")
        return show

    def _all_converged(self, version: int, devices: Sequence[str] | None = None) -> Any:
        assert self.observer is not None
        observer = self.observer
        chosen = list(devices if devices is not None else self.devices)
        return lambda: all(observer.standing(device, version).status == "converged"
                           for device in chosen)

    # -- driving

    def _resolver(self) -> Any:
        from agent.fleet.ops.artifacts import load_index
        from agent.fleet.ops.deploy import index_resolver

        return index_resolver(load_index(self.workspace.artifact_directory()),
                              self.workspace.artifacts_base_url)

    def _deploy(self, phase: str, version: int, stages: tuple[str, ...]) -> tuple[Any, Any]:
        """Start ``fleet deploy``'s engine on a rollout of ``version`` to every agent; returns
        the rollout and the task driving it."""
        from agent.fleet.documents import utc_now
        from agent.fleet.ops.deploy import RolloutDriver
        from agent.fleet.ops.rollout import Policy, new_rollout

        model = self._resolver()(MODEL_NAME, version)
        if model is None:
            raise FleetError("a benchmark version is not in the artifact index",
                             reason="unknown", version=version)
        policy = Policy(stages=stages, stage_timeout_s=self.options.phase_timeout_s,
                        rollback_timeout_s=self.options.phase_timeout_s)
        rollout = new_rollout(fleet=FLEET, rollout_id=f"bench-{phase}-{secrets.token_hex(3)}",
                              model=model, devices=self.devices, policy=policy, now=utc_now(),
                              views=self.link.view.views(self.devices))

        started = time.monotonic()
        self.stage_started_s = []

        def progress(line: str) -> None:
            if line.startswith("stage ") and " started: " in line:
                # Said once the stage's desired documents are all out.
                self.stage_started_s.append(round(time.monotonic() - started, 3))
            if not line.startswith(" "):  # the rollout's and stages' lines, not each device's
                _say(f"  [{phase}] {line}")

        driver = RolloutDriver(self.link, rollout, resolve=self._resolver(),
                               on_progress=progress, local_dir=self.workspace.rollouts_dir)
        self._notify[:] = [driver.notify]
        return rollout, asyncio.ensure_future(driver.run())

    async def _finish(self, task: Any, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(task, max(timeout_s, 1.0))
        except asyncio.TimeoutError:
            return None

    async def converge(self, phase: str, version: int, *, kill: bool = False) -> dict[str, Any]:
        """A rollout of ``version`` to every agent in one stage; with ``kill``, the broker
        SIGKILLed once ``kill_at_share`` of the agents converged and started again after
        ``broker_down_s``."""
        assert self.observer is not None
        _say(f"{phase}: deploy v{version} to {len(self.devices)} agents"
             + (" (the broker is killed on the way)" if kill else ""))
        cpu = self._cpu()
        started = time.monotonic()
        rollout, task = self._deploy(phase, version, ("100%",))
        killer = (asyncio.ensure_future(self._kill_broker(version, started, rollout)) if kill
                  else None)
        done = await self.observer.wait_for(self._all_converged(version),
                                            timeout_s=self.options.phase_timeout_s,
                                            progress=self._progress(phase, version, started))
        converge_s = time.monotonic() - started if done else None
        final = await self._finish(task, self.options.phase_timeout_s -
                                   (time.monotonic() - started))
        result: dict[str, Any] = {"version": version, "converge_s": converge_s,
                                  "desired_out_s": list(self.stage_started_s),
                                  "converged_at_s": self._quantiles(version, started)}
        if killer is not None:
            result["broker_restart"] = await killer
        missing = [device for device in self.devices
                   if self.observer.standing(device, version).status != "converged"]
        self.lost.update(missing)
        result.update(not_converged=missing, rollout=rollout.rollout_id,
                      rollout_state=final.state if final is not None else "unfinished",
                      rollout_counts=(final or rollout).counts(), cpu_s=self._cpu_used(
                          cpu, self._cpu()))
        _say(f"{phase}: {len(self.devices) - len(missing)}/{len(self.devices)} agents on "
             f"v{version}" + (f" in {converge_s:.1f} s" if converge_s is not None else
                              f"; {len(missing)} not within {self.options.phase_timeout_s:g} s"))
        return result

    def _quantiles(self, version: int, started: float) -> dict[str, float | None]:
        """When the first, half, nine in ten and all of the agents were seen converged."""
        assert self.observer is not None
        times = sorted(self.observer.converged_at[(device, version)] - started
                       for device in self.devices
                       if (device, version) in self.observer.converged_at)

        def at(share: float) -> float | None:
            needed = max(1, math.ceil(share * len(self.devices)))
            return round(times[needed - 1], 3) if len(times) >= needed else None

        return {"first": at(1 / len(self.devices)), "half": at(0.5), "p90": at(0.9),
                "all": at(1.0)}

    async def _kill_broker(self, version: int, started: float,
                           rollout: Any) -> dict[str, Any]:
        """SIGKILL the broker the moment the observer sees ``kill_at_share`` of the agents
        converged (from its message handler: the others have not been seen yet), and start it
        again ``broker_down_s`` later."""
        assert self.observer is not None
        observer = self.observer
        threshold = max(1, math.ceil(self.options.kill_at_share * len(self.devices)))
        killed = asyncio.Event()
        facts: dict[str, Any] = {}

        def check() -> None:
            if killed.is_set():
                return
            converged = observer.tally(self.devices, version)["converged"]
            if converged < threshold:
                return
            self._sample_broker()
            self.broker.kill_now()
            facts.update(killed_at=time.monotonic(), converged_at_kill=converged,
                         rollout_running_at_kill=not rollout.final)
            killed.set()

        observer.hooks.append(check)
        try:
            check()
            await asyncio.wait_for(killed.wait(), self.options.phase_timeout_s)
        except asyncio.TimeoutError:
            _say(f"  the broker was not killed: {threshold} agents never converged")
            return {"killed": False}
        finally:
            observer.hooks.remove(check)
        killed_at = facts["killed_at"]
        _say(f"  broker SIGKILLed at {killed_at - started:.1f} s "
             f"({facts['converged_at_kill']} agents converged)")
        await asyncio.to_thread(self.broker.kill)  # reaped
        await asyncio.sleep(max(0.0, self.options.broker_down_s - (time.monotonic() - killed_at)))
        await asyncio.to_thread(self.broker.start)
        back = time.monotonic()
        _say(f"  broker started again after {back - killed_at:.1f} s")
        return {"killed": True, "killed_at_s": round(killed_at - started, 3),
                "converged_at_kill": facts["converged_at_kill"],
                "rollout_running_at_kill": facts["rollout_running_at_kill"],
                "down_s": round(back - killed_at, 3)}

    async def retained_desired(self, version: int) -> dict[str, Any]:
        """What the broker holds now: a fresh subscriber counts the devices whose retained
        desired document names ``version`` (the documents a device that comes back finds)."""
        from agent.fleet import topics
        from agent.fleet.mqtt import Message, MqttLink
        from agent.fleet.documents import Desired, open_envelope

        held: dict[str, int] = {}
        unreadable: list[str] = []
        marker = f"{topics.ROOT}/{FLEET}/_bench/sync/{secrets.token_hex(4)}"
        token = secrets.token_hex(8).encode()
        back = asyncio.Event()
        keys = [self.workspace.public_key()]

        async def on_message(message: Message) -> None:
            if message.topic == marker:
                if message.payload == token:
                    back.set()
                return
            if message.payload:
                try:
                    desired: Desired = open_envelope(message.payload, keys,
                                                     expect=Desired).document
                except Exception as exc:  # noqa: BLE001 - counted and named in the summary
                    unreadable.append(f"{message.topic}: {exc}")
                    return
                if desired.model is not None:
                    held[desired.device] = desired.model.version

        link = MqttLink(self.workspace.operator_options(f"bench-check-{os.getpid()}",
                                                        session_expiry_s=0),
                        subscriptions=[(topics.fleet_filter(FLEET, topics.DESIRED), 1),
                                       (marker, 1)], on_message=on_message)
        await link.start()
        try:
            await link.wait_connected(30)
            await link.publish(marker, token, timeout_s=30)
            await asyncio.wait_for(back.wait(), 60)
        finally:
            await link.stop()
        versions: dict[str, int] = {}
        for value in held.values():
            versions[str(value)] = versions.get(str(value), 0) + 1
        return {"devices": len(held), "versions": versions, "unreadable": unreadable[:3],
                "naming_version": sum(1 for value in held.values() if value == version)}

    async def misbehaving(self, bad: int, good: int) -> dict[str, Any]:
        """The NaN version in stages of ``canary`` then everyone; the abort and the way back."""
        from agent.fleet.documents import utc_now

        assert self.observer is not None
        observer = self.observer
        _say(f"misbehaving: deploy v{bad} (NaN outputs) in stages of {self.options.canary}, "
             f"then all")
        cpu = self._cpu()
        started = time.monotonic()
        rollout, task = self._deploy("misbehaving", bad, (str(self.options.canary), "100%"))
        while rollout.abort is None and not task.done() and (
                time.monotonic() - started < self.options.phase_timeout_s):
            await asyncio.sleep(0.05)
        result: dict[str, Any] = {"version": bad, "stages": [self.options.canary, "100%"]}
        if rollout.abort is None:
            final = await self._finish(task, 1.0)
            result.update(aborted=False, rollout_state=final.state if final else "unfinished",
                          reached=rollout.reached())
            return result
        # The abort's own time, from the rollout document's clock.
        age_s = (utc_now() - rollout.abort.at).total_seconds()
        aborted = time.monotonic() - max(0.0, age_s)
        reached = rollout.reached()
        _say(f"  aborted {aborted - started:.1f} s after the deploy began; {len(reached)} "
             f"agents reached; rolling them back")
        back = await observer.wait_for(self._all_converged(good, reached),
                                       timeout_s=self.options.phase_timeout_s,
                                       progress=self._progress("misbehaving", good, started,
                                                               reached))
        reverted_s = time.monotonic() - aborted if back else None
        final = await self._finish(task, self.options.phase_timeout_s)
        others_fine = self._all_converged(good)()
        missing = [device for device in self.devices
                   if observer.standing(device, good).status != "converged"]
        self.lost.update(missing)
        result.update(
            aborted=True, abort_s=round(aborted - started, 3), abort=rollout.abort.to_json(),
            desired_out_s=list(self.stage_started_s),
            reached=reached, reverted_s=reverted_s, everyone_on_good_version=others_fine,
            not_on_good_version=missing,
            rollout_state=final.state if final is not None else "unfinished",
            rollout_counts=(final or rollout).counts(),
            cpu_s=self._cpu_used(cpu, self._cpu()))
        _say(f"misbehaving: {len(reached)} reached, back on v{good} "
             + (f"{reverted_s:.1f} s after the abort" if reverted_s is not None else
                "NOT within the timeout"))
        return result

    async def report(self) -> dict[str, Any]:
        events = await asyncio.wait_for(asyncio.gather(*(process.request("report", "report")
                                                         for process in self.processes)),
                                        REPORT_TIMEOUT_S)
        agents = [agent for event in events for agent in event["agents"]]
        processes = [{key: event.get(key) for key in ("process", "rss_mib", "peak_rss_mib",
                                                      "threads", "fds", "cpu_s")}
                     for event in events]
        return {"agents": agents, "processes": processes}


# -- the figures ------------------------------------------------------------------------------

def _ground_truth(agents: list[dict[str, Any]], bad: int) -> dict[str, Any]:
    took = sorted(agent["device"] for agent in agents if bad in agent["record"]["verified"])
    served = sorted(agent["device"] for agent in agents if bad in agent["record"]["committed"])
    refused = sorted(agent["device"] for agent in agents
                     if any(version == bad for version, _ in agent["record"]["refused"]))
    repeated = sorted(agent["device"] for agent in agents
                      if len(agent["record"]["committed"]) != len(set(
                          agent["record"]["committed"])))
    histories = collections.Counter(",".join(map(str, agent["record"]["committed"]))
                                    for agent in agents)
    return {"verified_bad": took, "served_bad": served, "refused_bad_at_warmup": refused,
            "committed_versions": dict(sorted(histories.items())),
            "committed_a_version_twice": repeated,
            "disconnected_at_end": sorted(agent["device"] for agent in agents
                                          if not agent["connected"]),
            "connects_max": max((agent["connects"] for agent in agents), default=0)}


def summarize(options: FleetBenchOptions, found: dict[str, Any], report: dict[str, Any],
              lost: set[str], memory: dict[str, Any]) -> dict[str, Any]:
    phases = found["phases"]
    bad = phases["misbehaving"]
    truth = _ground_truth(report["agents"], bad["version"])
    reached = sorted(set(bad.get("reached", [])) | set(truth["verified_bad"]))
    summary: dict[str, Any] = {
        "agents": options.agents,
        "processes": options.process_count(),
        "converge_s": phases["converge"]["converge_s"],
        "converge_s_with_broker_restart": phases["broker_restart"]["converge_s"],
        "lost": len(lost),
        "lost_agents": sorted(lost),
        "bad_bundle_reached": len(reached),
        "bad_bundle_served": len(truth["served_bad"]),
        "bad_bundle_reverted_s": bad.get("reverted_s"),
        "agents_truth": truth,
        "setup": found["setup"],
        "phases": phases,
        "retained_desired_after_restart": found.get("retained_desired_after_restart"),
        "memory": memory,
        "lightweight": LIGHTWEIGHT,
        "options": {key: str(value) if isinstance(value, Path) else value
                    for key, value in asdict(options).items()},
    }
    summary["targets"] = _targets(summary)
    return summary


def _targets(summary: dict[str, Any]) -> dict[str, bool | None]:
    def at_most(value: Any, bound: float) -> bool | None:
        return None if value is None else value <= bound

    return {
        "converge_s": at_most(summary["converge_s"], TARGETS["converge_s"]),
        "converge_s_with_broker_restart": at_most(summary["converge_s_with_broker_restart"],
                                                  TARGETS["converge_s_with_broker_restart"]),
        "lost": summary["lost"] <= TARGETS["lost"],
        "bad_bundle_reached": summary["bad_bundle_reached"] <= TARGETS["bad_bundle_reached"],
        "bad_bundle_reverted_s": at_most(summary["bad_bundle_reverted_s"],
                                         TARGETS["bad_bundle_reverted_s"]),
    }


def _memory(run: _Run, report: dict[str, Any]) -> dict[str, Any]:
    processes = report["processes"]
    agents_rss = sum(entry.get("rss_mib") or 0.0 for entry in processes)
    agents_peak = sum(entry.get("peak_rss_mib") or 0.0 for entry in processes)
    # What the agents themselves take: above each process's RSS before its first agent.
    base = sum(entry.get("base_rss_mib") or 0.0 for entry in run.found["setup"]["processes"])
    run._sample_broker()
    own = process_memory(os.getpid())
    files = process_memory(run.file_server.pid) if run.file_server is not None else {}
    return {"agent_processes": processes,
            "agents_rss_mib": round(agents_rss, 1), "agents_peak_rss_mib": round(agents_peak, 1),
            "process_base_rss_mib": round(base, 1),
            "per_agent_peak_mib": round((agents_peak - base) / max(1, run.options.agents), 2),
            "broker_peak_rss_mib": round(run.broker_peak_mib, 1),
            "operator_rss_mib": round(own.get("rss_mib", 0.0), 1),
            "operator_peak_rss_mib": round(own.get("peak_rss_mib", 0.0), 1),
            "file_server_peak_rss_mib": round(files.get("peak_rss_mib", 0.0), 1)}


def format_summary(summary: dict[str, Any]) -> str:
    targets = summary["targets"]

    def verdict(key: str) -> str:
        value = targets.get(key)
        return "n/a" if value is None else ("met" if value else "NOT met")

    def row(key: str, unit: str, bound: str) -> str:
        value = summary[key]
        target = TARGETS[key]
        shown = "-" if value is None else (f"{value:.1f} {unit}".strip()
                                           if isinstance(value, float) else f"{value} {unit}")
        ratio = (f"{value / target:.2f}" if isinstance(value, (int, float)) and target
                 else "-")
        return f"{key:<32}{shown:>12}{bound + ' ' + str(target):>10}{ratio:>8}  {verdict(key)}"

    memory = summary["memory"]
    restart = summary["phases"]["broker_restart"].get("broker_restart") or {}
    bad = summary["phases"]["misbehaving"]
    retained = summary.get("retained_desired_after_restart") or {}
    lines = [
        f"bench fleet: {summary['agents']} agents in {summary['processes']} process(es), one "
        "TLS Mosquitto (the production config, per-device passwords), fleet deploy's engine",
        f"agents are lightweight: {summary['lightweight']}",
        f"{'figure':<32}{'measured':>12}{'target':>10}{'ratio':>8}  verdict",
        row("converge_s", "s", "<="),
        row("converge_s_with_broker_restart", "s", "<="),
        row("lost", "", "="),
        row("bad_bundle_reached", "", "<="),
        row("bad_bundle_reverted_s", "s", "<="),
        (f"broker SIGKILLed {restart.get('killed_at_s')} s into phase 2 with "
         f"{restart.get('converged_at_kill')} agents converged, down {restart.get('down_s')} s; "
         f"afterwards it held {retained.get('naming_version', '-')}/{summary['agents']} "
         "retained desired documents naming v3" if restart.get("killed")
         else "the broker was NOT killed in phase 2"),
        f"misbehaving v{bad['version']}: aborted {bad.get('abort_s', '-')} s after the deploy "
        f"began, served by {summary['bad_bundle_served']} agents (the warm-up refused it on "
        f"{len(summary['agents_truth']['refused_bad_at_warmup'])})",
        f"memory: agents {memory['agents_peak_rss_mib']:.0f} MiB peak RSS in "
        f"{summary['processes']} process(es), {memory['process_base_rss_mib']:.0f} MiB of it "
        f"before the first agent ({memory['per_agent_peak_mib']:.2f} MiB per agent), "
        f"broker {memory['broker_peak_rss_mib']:.0f} MiB, operator "
        f"{memory['operator_peak_rss_mib']:.0f} MiB, file server "
        f"{memory['file_server_peak_rss_mib']:.0f} MiB",
    ]
    for name in ("converge", "broker_restart"):
        phase = summary["phases"][name]
        times = phase.get("converged_at_s") or {}
        out = phase.get("desired_out_s") or ["-"]
        lines.append(f"{name}: every desired document out at {out[0]} s; converged: first "
                     f"{times.get('first', '-')} s, half {times.get('half', '-')} s, 90 % "
                     f"{times.get('p90', '-')} s, all {times.get('all', '-')} s")
    for name in ("converge", "broker_restart", "misbehaving"):
        cpu = summary["phases"][name].get("cpu_s")
        if cpu:
            lines.append(f"cpu in {name}: agents {cpu['agents']:.1f} s, operator "
                         f"{cpu['operator']:.1f} s, broker {cpu['broker']:.1f} s, file server "
                         f"{cpu['file_server']:.1f} s ({cpu['cores_busy']:.2f} cores busy)")
    return "\n".join(lines)


# -- the entry point ------------------------------------------------------------------------------

async def _run_all(options: FleetBenchOptions, work: Path, fleet: _Fleet) -> dict[str, Any]:
    run = _Run(options, work, fleet)
    try:
        await run.start()
        phases = run.found["phases"]
        phases["converge"] = await run.converge("converge", 2)
        phases["broker_restart"] = await run.converge("broker_restart", 3, kill=True)
        run.found["retained_desired_after_restart"] = await run.retained_desired(3)
        phases["misbehaving"] = await run.misbehaving(4, 3)
        report = await run.report()
        memory = _memory(run, report)
    finally:
        statuses = await run.close()
    if any(status not in (0, None) for status in statuses):
        raise AgentError("a process of agents exited with an error", statuses=str(statuses),
                         log=run.processes[0].log_tail() if run.processes else "")
    return summarize(options, run.found, report, run.lost, memory)


def run_bench(options: FleetBenchOptions) -> dict[str, Any]:
    """Set up the fleet, run the three phases, return the summary (module docstring)."""
    with contextlib.ExitStack() as stack:
        if options.work_dir is not None:
            work = Path(options.work_dir).resolve()
            work.mkdir(parents=True, exist_ok=True)
            if any(work.iterdir()):
                raise ConfigError("--work-dir must be empty (or absent)", key="--work-dir",
                                  path=work)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="edge-agent-fleet-")))
        _say(f"setting up a fleet of {options.agents} agents in {work}")
        fleet = _make_fleet(work, options)
        _say(f"provisioned {options.agents} devices in {fleet.timings['provision_s']:.1f} s")
        summary = asyncio.run(_run_all(options, work, fleet))
        summary["work_dir"] = str(work) if options.work_dir is not None else None
        return summary
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow
