"""A process of benchmark agents: ``python -m agent.tooling.fleetbench.agents SPEC.json``.

Each agent is what a device's daemon runs for fleet control, minus serving: its own state
directory with a model store (the first version installed and current, as ``serve --bundle``
leaves it), an :class:`~agent.update.updater.Updater` with its journal there and the benchmark's
steps (agent/tooling/fleetbench/steps.py), and a :class:`~agent.fleet.device.FleetDevice` with
its own :class:`~agent.fleet.mqtt.MqttLink` (its own paho thread and TLS connection). Each is
made from the ``agent.toml`` that ``fleet devices add`` wrote for its device, loaded as the
daemon loads its configuration (the broker, the device's user name and password, the fleet's and
the bundles' keys), with the broker options the daemon derives from it
(agent/fleet/service.py). The agents share the process's event loop
and two thread pools: the loop's default executor (journal and state writes) and the steps' pool
(hashing, installs, ONNX Runtime sessions).

The process talks to the benchmark over its standard streams, one JSON object a line. It writes
``{"event": "ready", ...}`` once every agent is connected, and then answers ``{"cmd": "report"}``
with ``{"event": "report", "agents": [...], ...}`` and ``{"cmd": "stop"}`` with
``{"event": "stopped"}`` before it exits. Its log goes to the file the spec names.
"""

from __future__ import annotations

import asyncio
import functools
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

from agent.errors import FleetError
from agent.store import ModelStore
from agent.tooling.fleetbench.steps import BenchSteps, load_version
from agent.update.states import UpdatePolicy
from agent.update.updater import Updater

__all__ = ["AgentEntry", "ProcessSpec", "main"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class AgentEntry:
    """One device: its id and the ``agent.toml`` that ``devices add`` wrote for it (the broker,
    its credentials, the fleet's and the bundles' keys, naming the files where they are)."""

    device: str
    config: Path


@dataclass(frozen=True, kw_only=True)
class ProcessSpec:
    """What the process runs.

    Args:
        index: The process's number (for names and logs).
        first_bundle: The version every agent starts with.
        state_root: The agents' state directories go under it, one per device.
        log_file: The process's log.
        agents: The devices.
        pool_threads: The steps' shared pool.
        executor_threads: The loop's default executor.
    """

    index: int
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
        data["agents"] = [AgentEntry(device=entry["device"], config=Path(entry["config"]))
                          for entry in data["agents"]]
        for name in ("first_bundle", "state_root", "log_file"):
            data[name] = Path(data[name])
        return cls(**data)


class BenchAgent:
    """One agent (the module's docstring), made from its device's ``agent.toml`` (blocking:
    the configuration and its key and password files are read here); :meth:`prepare`
    (blocking) and :meth:`start` do the rest."""

    def __init__(self, spec: ProcessSpec, entry: AgentEntry, *, pool: ThreadPoolExecutor) -> None:
        from agent.config import load_config
        from agent.fleet.device import FleetDevice
        from agent.fleet.service import broker_options, fingerprint

        self.spec = spec
        self.state_dir = spec.state_root / entry.device
        config = load_config(entry.config, env={}, overrides={"state_dir": self.state_dir})
        if config.device_id != entry.device or not config.fleet.enabled:
            raise FleetError("the device's agent.toml is not this device's fleet "
                             "configuration", reason="bad_config", device=entry.device,
                             path=entry.config)
        self.device = config.device_id
        self.store = ModelStore(self.state_dir, trusted_keys=config.trust.keys,
                                keep_versions=config.store.keep_versions)
        self.steps = BenchSteps(store=self.store, state_dir=self.state_dir,
                                keys=list(config.trust.keys), pool=pool,
                                device_class=config.device_class)
        self.updater = Updater(state_dir=self.state_dir, steps=self.steps,
                               policy=UpdatePolicy())
        self.plane = FleetDevice(
            fleet=config.fleet.fleet, device=config.device_id, updater=self.updater,
            state_dir=self.state_dir, keys=config.fleet.keys, options=broker_options(config),
            fingerprint={**fingerprint(config), "bench": "fleet", "process": spec.index},
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
    return {**process_memory(os.getpid()), "cpu_s": usage.ru_utime + usage.ru_stime,
            "fds": len(os.listdir("/proc/self/fd"))}


async def _commands() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def run(spec: ProcessSpec) -> int:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(spec.executor_threads,
                                                 thread_name_prefix="fleetbench-io"))
    pool = ThreadPoolExecutor(spec.pool_threads, thread_name_prefix="fleetbench-files")
    # What every process holds before its first agent: the modules, ONNX Runtime's included.
    import onnxruntime  # noqa: F401

    import agent.fleet.device  # noqa: F401
    base = _process_figures()
    started = time.monotonic()
    agents = list(await asyncio.gather(*(loop.run_in_executor(
        pool, functools.partial(BenchAgent, spec, entry, pool=pool)) for entry in spec.agents)))
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
