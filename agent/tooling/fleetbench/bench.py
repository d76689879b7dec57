"""``edge-agent bench fleet``: N lightweight agents (agent/tooling/fleetbench/agents.py) on one
Mosquitto with the production configuration of agent/fleet/ops (TLS listeners, a password per
device, the per-device ACL, persistence), bundles served over HTTP by ``edge-agent fleet serve``
in a process of its own, and the operator's rollout driver (agent/fleet/ops/deploy.py).

Phases, each from the moment the driver starts:

1. ``converge_s``: a healthy version to every agent in one stage, until every agent reports it
   applied and its desired document converged.
2. ``converge_s_with_broker_restart``: the next healthy version, with the broker SIGKILLed
   mid-rollout (once every desired document of the rollout is out, or ``restart_after_s`` into
   it, whichever comes first) and started again at once (its store is saved every 30 s, so what
   came since the last save is lost: the driver republishes, the agents keep their copies).
3. A misbehaving version (NaN on negative inputs) in stages ``3,10%,50%,100%`` with the default
   abort rule (more than 20% failed once 3 finished): ``bad_bundle_reached`` counts the agents
   whose updater downloaded it, ``bad_bundle_reverted_s`` runs from the abort to every one of
   them reporting the rollback's desired document converged on the version before.

``lost``: agents that had not converged when a phase's timeout ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import FleetError
from agent.fleet.documents import ModelSpec
from agent.tooling.fleetbench.worker import AGENTS_PER_PROCESS

log = logging.getLogger(__name__)

FLEET = "bench"
MOSQUITTO = "mosquitto"
TARGETS = {"converge_s": 60.0, "converge_s_with_broker_restart": 90.0, "lost": 0,
           "bad_bundle_reached": 3, "bad_bundle_reverted_s": 120.0}


@dataclass(frozen=True, kw_only=True)
class FleetBenchOptions:
    agents: int = 300
    timeout_s: float = 180.0  # per phase
    restart_after_s: float = 5.0
    stages: tuple[str, ...] = ("3", "10%", "50%", "100%")
    watch_window_s: float = 1.0  # the agents' watch window after a commit
    work_dir: Path | None = None  # default: a temporary directory, removed afterwards
    threads: int = 4  # each agent process's executor for blocking work
    agents_per_process: int = AGENTS_PER_PROCESS


@dataclass
class _Phase:
    name: str
    started: float = 0.0
    converged: dict[str, float] = field(default_factory=dict)

    def summary(self, total: int) -> dict[str, Any]:
        times = sorted(at - self.started for at in self.converged.values())
        def quantile(share: float) -> float | None:
            return round(times[min(len(times) - 1, int(share * len(times)))], 3) if times else None
        return {"converged": len(times), "of": total, "p50_s": quantile(0.5),
                "p95_s": quantile(0.95), "max_s": round(times[-1], 3) if times else None}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class _Process:
    """A child process that must accept connections on ``ports`` to count as started."""

    def __init__(self, argv: list[str], ports: list[int], log_file: Path) -> None:
        self.argv = argv
        self.ports = ports
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.log_file.open("ab") as output:
                self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                                stdout=output, stderr=subprocess.STDOUT)
            while time.monotonic() < deadline and self.process.poll() is None:
                if all(_accepts(port) for port in self.ports):
                    return
                time.sleep(0.02)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if time.monotonic() >= deadline:
                tail = self.log_file.read_text(errors="replace")[-2000:]
                raise FleetError(f"{self.argv[0]} did not start:\n{tail}", reason="bench_setup")
            time.sleep(0.2)  # a port still held right after a kill

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def _spec(bundle: Path, url: str) -> ModelSpec:
    from models.bundle import open_bundle  # noqa: F401 - the bundle is ours: its name is enough

    name, version = bundle.name.split("-")[:2]
    return ModelSpec(name=name, version=int(version.split(".")[0]), url=url,
                     sha256=hashlib.sha256(bundle.read_bytes()).hexdigest())


class FleetBench:
    """One run of the benchmark (see the module's docstring)."""

    def __init__(self, options: FleetBenchOptions, *,
                 progress: Callable[[str], None] = print) -> None:
        self.options = options
        self.say = progress
        self.workers: list[asyncio.subprocess.Process] = []
        self.lost: set[str] = set()

    # -- setup ----------------------------------------------------------------------------------

    def _setup(self, work: Path) -> None:
        from agent.fleet.ops.provision import add_device, init_workspace, write_broker_config
        from agent.tooling.swapbench.bundles import BundleMaker

        started = time.monotonic()
        maker = BundleMaker(work / "bundles")
        self.bundles = {1: maker.bundle(1), 2: maker.bundle(2), 3: maker.bundle(3),
                        4: maker.bundle(4, fault="nan_on_negative")}
        device_port, operator_port = _free_port(), _free_port()
        self.workspace = init_workspace(
            work / "fleet", fleet=FLEET, broker_host="127.0.0.1", device_port=device_port,
            operator_port=operator_port, bundle_keys=[maker.public_key_path])
        self.devices = [f"agent-{index:04d}" for index in range(self.options.agents)]
        self.passwords: dict[str, str] = {}
        for device in self.devices:
            files = add_device(self.workspace, device)
            self.passwords[device] = (files.directory / "mqtt-password").read_text().strip()
        store = work / "broker-store"
        store.mkdir()
        config, _ = write_broker_config(
            self.workspace, persistence_dir=store, bind_address="127.0.0.1",
            run_as_user=pwd.getpwuid(os.getuid()).pw_name,
            log_dest=f"file {work / 'mosquitto.log'}")
        mosquitto = shutil.which(MOSQUITTO) or "/usr/sbin/mosquitto"
        self.broker = _Process([mosquitto, "-c", str(config)], [device_port, operator_port],
                               work / "mosquitto.out")
        http_port = _free_port()
        self.files = _Process([sys.executable, "-m", "agent", "fleet", "serve",
                               str(work / "bundles"), "--host", "127.0.0.1", "--port",
                               str(http_port)], [http_port], work / "fileserver.log")
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.setup_s = time.monotonic() - started

    async def _start_workers(self, work: Path) -> None:
        """The agents, :attr:`FleetBenchOptions.agents_per_process` to a process."""
        from agent.fsutil import atomic_write_text

        workspace = self.workspace
        size = max(1, self.options.agents_per_process)
        (work / "workers").mkdir(exist_ok=True)
        for index in range(0, len(self.devices), size):
            chunk = self.devices[index:index + size]
            spec = {"work": str(work / "agents"), "fleet": FLEET, "host": "127.0.0.1",
                    "port": workspace.device_port, "ca_file": str(workspace.fleet_ca[0]),
                    "fleet_keys": [str(workspace.public_key_path)],
                    "bundle_keys": [str(path) for path in workspace.bundle_keys],
                    "watch_window_s": self.options.watch_window_s,
                    "threads": self.options.threads, "first_bundle": str(self.bundles[1]),
                    "devices": {device: self.passwords[device] for device in chunk}}
            path = work / "workers" / f"worker-{index // size}.json"
            atomic_write_text(path, json.dumps(spec), mode=0o600)
            log_file = (work / "workers" / f"worker-{index // size}.log").open("ab")
            self.workers.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent.tooling.fleetbench.worker", str(path),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log_file, limit=16 * 1024 * 1024))
            log_file.close()
        for worker in self.workers:
            answer = await self._read(worker)
            if not answer.get("ready"):
                raise FleetError("an agent process did not start", reason="bench_setup",
                                 answer=str(answer)[:300])

    async def _read(self, worker: asyncio.subprocess.Process) -> dict[str, Any]:
        assert worker.stdout is not None
        line = await asyncio.wait_for(worker.stdout.readline(), self.options.timeout_s)
        if not line:
            raise FleetError("an agent process ended", reason="bench_setup",
                             returncode=worker.returncode)
        return json.loads(line)  # type: ignore[no-any-return]

    async def _status(self) -> dict[str, dict[str, Any]]:
        """Each agent's serving version and the bundles its updater downloaded."""
        agents: dict[str, dict[str, Any]] = {}
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.write(b"status\n")
            await worker.stdin.drain()
            agents.update((await self._read(worker))["agents"])
        return agents

    async def _stop_workers(self) -> None:
        for worker in self.workers:
            if worker.returncode is None and worker.stdin is not None:
                with contextlib.suppress(Exception):
                    worker.stdin.write(b"stop\n")
                    await worker.stdin.drain()
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.wait(), 30)
            except asyncio.TimeoutError:
                worker.kill()
                await worker.wait()

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        options = self.options
        work = options.work_dir or Path(tempfile.mkdtemp(prefix="fleetbench-"))
        work.mkdir(parents=True, exist_ok=True)
        executor = ThreadPoolExecutor(max_workers=options.threads,
                                      thread_name_prefix="fleetbench")
        loop = asyncio.get_running_loop()
        loop.set_default_executor(executor)
        try:
            await loop.run_in_executor(None, self._setup, work)
            self.say(f"set up {options.agents} devices in {self.setup_s:.1f} s")
            await loop.run_in_executor(None, self.broker.start)
            await loop.run_in_executor(None, self.files.start)
            return await self._measure(work)
        finally:
            await self._stop_workers()
            for process in ("files", "broker"):
                if hasattr(self, process):
                    getattr(self, process).stop()
            executor.shutdown(wait=False)
            if options.work_dir is None:
                shutil.rmtree(work, ignore_errors=True)

    async def _measure(self, work: Path) -> dict[str, Any]:
        from agent.fleet.ops.operator import OperatorLink

        self.driver: Any = None

        async def on_change(about: str) -> None:
            if self.driver is not None:
                self.driver.notify()

        workspace = self.workspace
        self.link = OperatorLink(workspace.operator_options("bench-operator"), fleet=FLEET,
                                 signing_key=workspace.signing_key(),
                                 trusted_keys=[workspace.public_key()], on_change=on_change)
        await self.link.start()
        try:
            started = time.monotonic()
            await self._start_workers(work)
            await self._until(lambda: all(self._reports(device, 1) for device in self.devices),
                              "every agent's first report")
            self.say(f"{len(self.devices)} agents in {len(self.workers)} process(es) connected "
                     f"and reporting in {time.monotonic() - started:.1f} s")
            first = await self._rollout(2, "converge")
            second = await self._rollout(3, "converge_with_broker_restart", restart=True)
            bad = await self._bad_rollout(4)
        finally:
            await self.link.stop()
        return {
            "agents": len(self.devices),
            "converge_s": first["converge_s"],
            "converge_s_with_broker_restart": second["converge_s"],
            "lost": len(self.lost),
            "bad_bundle_reached": bad["reached"],
            "bad_bundle_reverted_s": bad["reverted_s"],
            "targets": TARGETS,
            "phases": {"converge": first, "converge_with_broker_restart": second,
                       "bad_bundle": bad},
            "setup_s": round(self.setup_s, 3),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "options": {"stages": list(self.options.stages),
                        "restart_after_s": self.options.restart_after_s,
                        "agents_per_process": self.options.agents_per_process,
                        "watch_window_s": self.options.watch_window_s},
        }

    def _reports(self, device: str, version: int, *, min_desired: int = 0) -> bool:
        reported = self.link.view.reported.get(device)
        return bool(reported is not None and reported.applied is not None
                    and reported.applied.version == version
                    and (min_desired == 0 or (reported.desired is not None
                                              and reported.desired.status == "converged"
                                              and reported.desired.version >= min_desired)))

    async def _until(self, condition: Callable[[], bool], what: str) -> bool:
        deadline = time.monotonic() + self.options.timeout_s
        while not condition():
            if time.monotonic() > deadline:
                self.say(f"timed out waiting for {what}")
                return False
            await asyncio.sleep(0.05)
        return True

    async def _drive(self, version: int, policy: Any) -> Any:
        from agent.fleet.ops.deploy import DriveOptions, RolloutDriver, make_rollout_id
        from agent.fleet.ops.rollout import new_rollout
        from agent.fleet.documents import utc_now

        bundle = self.bundles[version]
        model = _spec(bundle, f"{self.base_url}/{bundle.name}")
        now = utc_now()
        rollout = new_rollout(fleet=FLEET, rollout_id=make_rollout_id(model, now), model=model,
                              devices=self.devices, policy=policy, now=now,
                              views=self.link.view.views(self.devices))
        self.driver = RolloutDriver(self.link, rollout, options=DriveOptions(tick_s=0.5))
        return self.driver

    async def _rollout(self, version: int, name: str, *, restart: bool = False
                       ) -> dict[str, Any]:
        from agent.fleet.ops.rollout import Policy

        phase = _Phase(name)
        driver = await self._drive(version, Policy(stages=("100%",),
                                                   stage_timeout_s=self.options.timeout_s))
        desired_floor = {device: self.link.view.device(device).next_version()
                         for device in self.devices}
        phase.started = time.monotonic()
        drive = asyncio.ensure_future(driver.run())
        restart_task = (asyncio.ensure_future(self._restart_broker(phase, version,
                                                                   desired_floor))
                        if restart else None)

        def done() -> bool:
            now = time.monotonic()
            for device in self.devices:
                if device not in phase.converged and self._reports(
                        device, version, min_desired=desired_floor[device]):
                    phase.converged[device] = now
            return len(phase.converged) == len(self.devices)

        converged = await self._until(done, f"every agent on v{version}")
        converge_s = time.monotonic() - phase.started if converged else None
        if restart_task is not None:
            broker = await restart_task
        try:
            await asyncio.wait_for(drive, self.options.timeout_s)
        except (asyncio.TimeoutError, FleetError) as exc:
            self.say(f"the driver did not finish: {exc!r}")
        self.lost.update(set(self.devices) - set(phase.converged))
        result = {"converge_s": None if converge_s is None else round(converge_s, 3),
                  "rollout_state": driver.rollout.state, **phase.summary(len(self.devices))}
        if restart_task is not None:
            result["broker"] = broker
        self.say(f"{name}: {result}")
        return result

    async def _restart_broker(self, phase: _Phase, version: int,
                              floors: dict[str, int]) -> dict[str, Any]:
        deadline = phase.started + self.options.restart_after_s

        def out() -> bool:  # the broker holds the rollout's desired document for every agent
            return all(self.link.view.device(device).desired_floor >= floors[device]
                       for device in self.devices)

        while not out() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        killed = time.monotonic()
        converged_before = sum(1 for device in self.devices if self._reports(
            device, version, min_desired=floors[device]))
        await asyncio.get_running_loop().run_in_executor(None, self.broker.kill)
        await asyncio.get_running_loop().run_in_executor(None, self.broker.start)
        return {"killed_after_s": round(killed - phase.started, 3),
                "converged_before_kill": converged_before,
                "down_s": round(time.monotonic() - killed, 3)}

    async def _bad_rollout(self, version: int) -> dict[str, Any]:
        from agent.fleet.ops.rollout import Policy

        bad_sha = hashlib.sha256(self.bundles[version].read_bytes()).hexdigest()
        previous = version - 1
        driver = await self._drive(version, Policy(stages=self.options.stages,
                                                   stage_timeout_s=self.options.timeout_s,
                                                   rollback_timeout_s=self.options.timeout_s))
        started = time.monotonic()
        drive = asyncio.ensure_future(driver.run())
        aborted_at = None
        deadline = started + self.options.timeout_s
        while time.monotonic() < deadline and not drive.done():
            if driver.rollout.state != "running":
                aborted_at = time.monotonic()
                break
            await asyncio.sleep(0.02)
        reverted_at = None
        if aborted_at is not None:
            def back() -> bool:
                # Every device the rollout gave the bad version: the version before applied,
                # and the rollback's desired document converged.
                for device, entry in driver.rollout.devices.items():
                    if entry.desired is None:
                        continue
                    rollback = entry.rollback
                    floor = (rollback.desired.version if rollback is not None
                             else entry.desired.version + 1)
                    if not self._reports(device, previous, min_desired=floor):
                        return False
                return True
            if await self._until(back, "the reached agents back on the version before"):
                reverted_at = time.monotonic()
        try:
            await asyncio.wait_for(drive, self.options.timeout_s)
        except (asyncio.TimeoutError, FleetError) as exc:
            self.say(f"the driver did not finish: {exc!r}")
        agents = await self._status()
        given = sum(1 for entry in driver.rollout.devices.values() if entry.desired is not None)
        result = {"reached": sum(1 for agent in agents.values()
                                 if bad_sha in agent["attempted"]),
                  "given": given,
                  "reverted_s": None if reverted_at is None or aborted_at is None
                  else round(reverted_at - aborted_at, 3),
                  "abort_after_s": None if aborted_at is None else round(aborted_at - started, 3),
                  "rollout_state": driver.rollout.state,
                  "abort": None if driver.rollout.abort is None
                  else driver.rollout.abort.to_json(),
                  "serving_bad": sum(1 for agent in agents.values()
                                     if agent["serving"] == version)}
        self.say(f"bad bundle: {result}")
        return result


def format_table(summary: dict[str, Any]) -> str:
    rows = [("agents", summary["agents"], "")]
    for key in ("converge_s", "converge_s_with_broker_restart", "lost", "bad_bundle_reached",
                "bad_bundle_reverted_s"):
        target = TARGETS[key]
        comparison = "<=" if key != "lost" else "=="
        rows.append((key, summary[key], f"{comparison} {target:g}"))
    width = max(len(str(row[0])) for row in rows)
    lines = [f"{'metric'.ljust(width)}  {'measured':>10}  target"]
    lines += [f"{str(name).ljust(width)}  {str(value):>10}  {target}" for name, value, target
              in rows]
    return "\n".join(lines)


def run(options: FleetBenchOptions, *, progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """Run the benchmark; its summary (JSON-able)."""
    return asyncio.run(FleetBench(options, progress=progress).run())


__all__ = ["FleetBench", "FleetBenchOptions", "TARGETS", "format_table", "run"]


if __name__ == "__main__":  # python -m agent.tooling.fleetbench.bench N
    logging.basicConfig(level=logging.WARNING)
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print(json.dumps(run(FleetBenchOptions(agents=count)), indent=2))
