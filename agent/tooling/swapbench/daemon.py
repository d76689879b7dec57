"""The daemon under test, as its own process: ``python -m agent.tooling.swapbench.daemon SPEC``.

The benchmark runs the daemon apart from its load generator (as on a board, where they would not
share an interpreter) and reads the daemon's memory and open files from ``/proc/<pid>``. The
process is ``edge-agent serve`` with the benchmark's short canary and watch window, which the
configuration file does not carry: the policies come from the spec (:class:`DaemonSpec`), a JSON
file the benchmark writes. It installs the first version, serves until SIGTERM, and writes the
port it listens on to ``port_file`` once it serves (it binds port 0, so two runs never collide).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class DaemonSpec:
    """What the daemon process is started with.

    Args:
        state_dir: The daemon's store and control socket.
        config: The configuration file (an empty one: the embedded defaults).
        public_key: The benchmark's trusted public key.
        first_bundle: Installed and made current before serving.
        port_file: Written with the HTTP port once the daemon serves.
        backend: ``serving.backend``.
        canary: :class:`~agent.update.canary.CanaryPolicy` fields.
        update: :class:`~agent.update.states.UpdatePolicy` fields.
    """

    state_dir: Path
    config: Path
    public_key: Path
    first_bundle: Path
    port_file: Path
    backend: str = "onnxruntime"
    canary: dict[str, Any] = field(default_factory=dict)
    update: dict[str, Any] = field(default_factory=dict)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), default=str, indent=2))
        return path

    @classmethod
    def read(cls, path: Path) -> DaemonSpec:
        document = json.loads(path.read_text())
        for name in ("state_dir", "config", "public_key", "first_bundle", "port_file"):
            document[name] = Path(document[name])
        return cls(**document)


def serve(spec: DaemonSpec) -> int:
    """Install the first bundle, then serve until SIGTERM (agent/run.py's lifecycle)."""
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.run import run_foreground
    from agent.update.canary import CanaryPolicy
    from agent.update.states import UpdatePolicy

    config = load_config(spec.config, env={}, overrides={
        "state_dir": spec.state_dir, "http.host": "127.0.0.1", "http.port": 0,
        "serving.backend": spec.backend, "trust.public_keys": [spec.public_key]})
    daemon = Daemon(config, canary_policy=CanaryPolicy(**spec.canary),
                    update_policy=UpdatePolicy(**spec.update))
    try:
        daemon.make_current(daemon.install(spec.first_bundle))
    except BaseException:
        daemon.close()
        raise

    def ready(port: int) -> None:
        temporary = spec.port_file.with_suffix(".tmp")
        temporary.write_text(str(port))
        os.replace(temporary, spec.port_file)

    run_foreground(daemon, on_ready=ready)
    return 0


def main(argv: list[str]) -> int:
    from agent.log import configure_logging

    if len(argv) != 1:
        print("usage: python -m agent.tooling.swapbench.daemon SPEC.json", file=sys.stderr)
        return 2
    configure_logging(0)
    return serve(DaemonSpec.read(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
