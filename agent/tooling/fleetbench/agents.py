"""A process of benchmark agents: ``python -m agent.tooling.fleetbench.agents SPEC.json``.

Each agent is what a device's daemon runs for fleet control, minus serving: its own state
directory with a model store (the first version installed and current, as ``serve --bundle``
leaves it), an :class:`~agent.update.updater.Updater` with its journal there and the benchmark's
steps (agent/tooling/fleetbench/steps.py), and a :class:`~agent.fleet.device.FleetDevice` with
its own :class:`~agent.fleet.mqtt.MqttLink` (its own paho thread and TLS connection, its
device's user name and password from ``devices add``). The agents share the process's event loop
and two thread pools: the loop's default executor (journal and state writes) and the steps' pool
(hashing, installs, ONNX Runtime sessions).

The process talks to the benchmark over its standard streams, one JSON object a line. It writes
``{"event": "ready", ...}`` once every agent is connected, and then answers ``{"cmd": "report"}``
with ``{"event": "report", "agents": [...], ...}`` and ``{"cmd": "stop"}`` with
``{"event": "stopped"}`` before it exits. Its log goes to the file the spec names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.config.schema import FleetConfig
from agent.errors import FleetError
from agent.fleet.mqtt import BrokerOptions
from agent.store import ModelStore
from agent.tooling.fleetbench.steps import BenchSteps, load_version
from agent.update.states import UpdatePolicy
from agent.update.updater import Updater

__all__ = ["AgentEntry", "ProcessSpec", "main"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class AgentEntry:
    """One device, as ``devices add`` provisioned it."""

    device: str
    password_file: Path
    ca_file: Path
    fleet_key: Path


@dataclass(frozen=True, kw_only=True)
class ProcessSpec:
    """What the process runs.

    Args:
        index: The process's number (for names and logs).
        fleet: The fleet id.
        host, port: The broker's device listener.
        bundle_keys: The trusted bundle keys.
        first_bundle: The version every agent starts with.
        state_root: The agents' state directories go under it, one per device.
        log_file: The process's log.
        agents: The devices.
        pool_threads: The steps' shared pool.
        executor_threads: The loop's default executor.
    """

    index: int
    fleet: str
    host: str
    port: int
    bundle_keys: list[Path]
    first_bundle: Path
    state_root: Path
    log_file: Path
    agents: list[AgentEntry] = field(default_factory=list)
    pool_threads: int = 4
    executor_threads: int = 16

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), default=str, indent=1))
        return path

    @classmethod
    def read(cls, path: Path) -> ProcessSpec:
        data = json.loads(path.read_text())
        data["agents"] = [AgentEntry(**{key: Path(value) if key != "device" else value
                                        for key, value in entry.items()})
                          for entry in data["agents"]]
        for name in ("first_bundle", "state_root", "log_file"):
            data[name] = Path(data[name])
        data["bundle_keys"] = [Path(path) for path in data["bundle_keys"]]
        return cls(**data)


class BenchAgent:
    """One agent (the module's docstring). Cheap to construct; :meth:`prepare` (blocking) and
    :meth:`start` do the work."""

    def __init__(self, spec: ProcessSpec, entry: AgentEntry, *,
                 bundle_keys: list[Ed25519PublicKey], fleet_keys: list[Ed25519PublicKey],
                 pool: ThreadPoolExecutor) -> None:
        from agent.fleet.device import FleetDevice

        self.device = entry.device
        self.spec = spec
        self.state_dir = spec.state_root / entry.device
        self.store = ModelStore(self.state_dir, trusted_keys=bundle_keys)
        self.steps = BenchSteps(store=self.store, state_dir=self.state_dir, keys=bundle_keys,
                                pool=pool)
        self.updater = Updater(state_dir=self.state_dir, steps=self.steps,
                               policy=UpdatePolicy())
        defaults = FleetConfig()
        options = BrokerOptions(
            host=spec.host, port=spec.port, client_id=entry.device, username=entry.device,
            password=entry.password_file.read_text().strip(), tls=True, ca_file=entry.ca_file,
            keepalive_s=defaults.keepalive_s, session_expiry_s=defaults.session_expiry_s,
            reconnect_min_s=defaults.reconnect_min_s, reconnect_max_s=defaults.reconnect_max_s)
        self.plane = FleetDevice(
            fleet=spec.fleet, device=entry.device, updater=self.updater,
            state_dir=self.state_dir, keys=fleet_keys, options=options,
            fingerprint={"device_class": None, "bench": "fleet", "process": spec.index},
            health=lambda: {"daemon": "bench-agent"})

    def prepare(self) -> None:
        """Install the first version and make it current, and load it (blocking)."""
        self.store.open()
        installed = self.store.install(self.spec.first_bundle)
        self.store.activate(installed.name, installed.version)
        artifacts = self.store.load(installed.name, installed.version)
        self.steps.start_serving(artifacts, load_version(artifacts))

    async def start(self) -> None:
        await self.updater.recover()
        await self.plane.start()

    @property
    def connected(self) -> bool:
        link = self.plane.link
        return bool(link is not None and link.connected)

    async def stop(self) -> None:
        try:
            await self.plane.close()
            await self.updater.close()
            await self.steps.shutdown()
        finally:
            self.store.close()

    def summary(self) -> dict[str, Any]:
        link = self.plane.link
        status = self.updater.status()
        return {"device": self.device, "connected": self.connected,
                "connects": link.connect_count if link is not None else 0,
                "updater": status["state"], "counters": status["counters"],
                "record": self.steps.record.to_json(), "plane": self.plane.status()}


def _emit(event: str, **facts: Any) -> None:
    # One short line to a pipe the benchmark reads at once.
    sys.stdout.write(json.dumps({"event": event, **facts}, default=str) + "\n")
    sys.stdout.flush()


def _process_figures() -> dict[str, Any]:
    from agent.tooling.fleetbench.broker import process_memory

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {**process_memory(os.getpid()), "cpu_s": usage.ru_utime + usage.ru_stime}


async def _commands() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def run(spec: ProcessSpec) -> int:
    from models.signing import load_public_key

    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(spec.executor_threads,
                                                 thread_name_prefix="fleetbench-io"))
    pool = ThreadPoolExecutor(spec.pool_threads, thread_name_prefix="fleetbench-files")
    bundle_keys = [load_public_key(path) for path in spec.bundle_keys]
    fleet_keys = {path: load_public_key(path) for path in {a.fleet_key for a in spec.agents}}
    base = _process_figures()  # imports done, no agent yet
    started = time.monotonic()
    agents = [BenchAgent(spec, entry, bundle_keys=bundle_keys, fleet_keys=[fleet_keys[
        entry.fleet_key]], pool=pool) for entry in spec.agents]
    await asyncio.gather(*(loop.run_in_executor(pool, agent.prepare) for agent in agents))
    prepared = time.monotonic()
    await asyncio.gather(*(agent.start() for agent in agents))
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while not all(agent.connected for agent in agents):
        if time.monotonic() > deadline:
            missing = [agent.device for agent in agents if not agent.connected]
            raise FleetError("agents did not connect to the broker in time", reason="timeout",
                             missing=len(missing), first=",".join(missing[:5]))
        await asyncio.sleep(0.1)
    _emit("ready", process=spec.index, agents=len(agents),
          prepare_s=round(prepared - started, 3),
          connect_s=round(time.monotonic() - prepared, 3), base_rss_mib=base.get("rss_mib"),
          **_process_figures())
    reader = await _commands()
    try:
        while True:
            line = await reader.readline()
            if not line:
                break  # the benchmark went away
            command = json.loads(line).get("cmd")
            if command == "report":
                _emit("report", process=spec.index,
                      agents=[agent.summary() for agent in agents], **_process_figures())
            elif command == "stop":
                break
    finally:
        await asyncio.gather(*(agent.stop() for agent in agents), return_exceptions=True)
        pool.shutdown(wait=False)
    _emit("stopped", process=spec.index)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m agent.tooling.fleetbench.agents SPEC.json", file=sys.stderr)
        return 2
    spec = ProcessSpec.read(Path(argv[0]))
    handler = logging.FileHandler(spec.log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    # A few hundred TLS sockets, store locks and downloads at once.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    return asyncio.run(run(spec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
