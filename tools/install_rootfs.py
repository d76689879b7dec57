#!/usr/bin/env python3
"""Install the edge agent as a systemd service into a root file system for flashing.

    sudo tools/install_rootfs.py --rootfs Linux_for_Tegra/rootfs --wheelhouse wheels/ \\
        [--device-files fleet/devices/cam-01] [--bundle-key keys/bundle.pub] [--device-id ID]
    sudo tools/install_rootfs.py --rootfs Linux_for_Tegra/rootfs --uninstall [--purge]

The wheelhouse holds wheels for the board's architecture and Python, this agent's among them
(README, "Running it on a board", says how to make one); the board builds its Python
environment from it, offline, at first boot. What goes where:
agent/tooling/packaging/layout.py; how it is installed and removed:
agent/tooling/packaging/rootfs.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.errors import AgentError  # noqa: E402
from agent.tooling.packaging import layout, rootfs  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="install_rootfs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rootfs", type=Path, required=True, metavar="DIR",
                        help="the root file system tree (Linux_for_Tegra/rootfs)")
    parser.add_argument("--wheelhouse", type=Path, metavar="DIR",
                        help="wheels for the board (required to install)")
    parser.add_argument("--extras", default="device",
                        help="the agent's extras to install on the board (default: device)")
    parser.add_argument("--device-files", type=Path, metavar="DIR",
                        help="a device's files from `edge-agent fleet devices add`")
    parser.add_argument("--bundle-key", type=Path, action="append", default=[], metavar="PUB",
                        help="a public key whose bundles the device installs (repeatable)")
    parser.add_argument("--device-id", help="the device's id (device_id in agent.toml)")
    parser.add_argument("--bundle", type=Path, metavar="FILE",
                        help="a first model to serve at first boot (signed by a trusted key)")
    parser.add_argument("--uninstall", action="store_true",
                        help="remove what an earlier install put in the tree")
    parser.add_argument("--purge", action="store_true",
                        help="with --uninstall: also a changed agent.toml and the model store")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if args.uninstall:
            report = rootfs.uninstall(args.rootfs, purge=args.purge)
        else:
            if args.wheelhouse is None:
                print("install_rootfs.py: --wheelhouse is required to install", file=sys.stderr)
                return 2
            entries = layout.service_entries(
                REPO, wheelhouse=args.wheelhouse,
                extras=[extra for extra in args.extras.split(",") if extra],
                device_files=args.device_files, bundle_keys=args.bundle_key,
                device_id=args.device_id)
            unfit = rootfs.check_wheels(args.rootfs, [
                str(entry.path.name) for entry in entries if entry.path.suffix == ".whl"])
            if unfit:
                print("install_rootfs.py: wheels the board's Python cannot install (another "
                      "machine or Python version): " + ", ".join(unfit), file=sys.stderr)
                return 1
            report = rootfs.install(args.rootfs, entries)
            if args.bundle is not None:
                keys = list(args.bundle_key)
                if args.device_files is not None:
                    keys += sorted((args.device_files / "bundle-keys").glob("*.pub"))
                print(f"first model: {rootfs.install_first_model(args.rootfs, args.bundle, keys)}")
    except AgentError as exc:
        print(f"install_rootfs.py: {exc}", file=sys.stderr)
        return 1
    print(f"{len(report.written)} written, {len(report.unchanged)} unchanged, "
          f"{len(report.removed)} removed")
    for path in report.kept:
        print(f"kept {path}: changed since it was installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
