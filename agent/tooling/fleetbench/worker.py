"""One process of lightweight agents for ``edge-agent bench fleet``.

paho-mqtt's network loop uses ``select()``, which cannot watch a descriptor numbered 1024 or
above; each agent holds about four (its socket, paho's wake-up pair, its store's lock), so a few
hundred agents are spread over processes of :data:`AGENTS_PER_PROCESS` (which also lets them use
more than one core). The benchmark talks to each process over its stdin and stdout, one JSON
object a line:

- the process writes ``{"ready": true}`` once its agents started;
- ``status`` -> ``{"agents": {device: {"serving": version, "attempted": [sha256...]}}}``;
- ``stop`` -> its agents stopped, ``{"stopped": true}``, and the process exits.

Run as ``python -m agent.tooling.fleetbench.worker SPEC`` where SPEC is a JSON file (0600, it
holds the devices' passwords) written by agent/tooling/fleetbench/bench.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.fleet.mqtt import BrokerOptions
from agent.tooling.fleetbench.agents import LightAgent
from agent.update.states import UpdatePolicy
from models.signing import load_public_key

AGENTS_PER_PROCESS = 100


def _agents(spec: dict[str, Any], executor: ThreadPoolExecutor) -> list[LightAgent]:
    fleet_keys = [load_public_key(Path(path)) for path in spec["fleet_keys"]]
    bundle_keys = [load_public_key(Path(path)) for path in spec["bundle_keys"]]
    agents = []
    for device, password in spec["devices"].items():
        options = BrokerOptions(host=spec["host"], port=spec["port"], client_id=device,
                                username=device, password=password, tls=True,
                                ca_file=Path(spec["ca_file"]))
        agents.append(LightAgent(Path(spec["work"]) / device, fleet=spec["fleet"],
                                 device=device, options=options, fleet_keys=fleet_keys,
                                 bundle_keys=bundle_keys,
                                 policy=UpdatePolicy(watch_window_s=spec["watch_window_s"]),
                                 executor=executor))
    return agents


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def serve(spec: dict[str, Any]) -> None:
    executor = ThreadPoolExecutor(max_workers=int(spec.get("threads", 4)),
                                  thread_name_prefix="fleetbench")
    loop = asyncio.get_running_loop()
    loop.set_default_executor(executor)
    agents = _agents(spec, executor)
    first = Path(spec["first_bundle"])
    await asyncio.gather(*(loop.run_in_executor(None, agent.install, first)
                           for agent in agents))
    await asyncio.gather(*(agent.start() for agent in agents))
    _say({"ready": True})
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            command = line.strip()
            if command == "status":
                _say({"agents": {agent.device: {"serving": agent.serving_version,
                                                "attempted": agent.steps.attempted}
                                 for agent in agents}})
            elif command in ("stop", ""):  # "" is the parent gone (end of stdin)
                break
    finally:
        await asyncio.gather(*(agent.stop() for agent in agents), return_exceptions=True)
        executor.shutdown(wait=False)
    _say({"stopped": True})


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    asyncio.run(serve(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
