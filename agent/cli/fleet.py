"""``edge-agent fleet``: the operator's side of fleet control over MQTT (issue 17).

    edge-agent fleet init --fleet plant-a --broker-host mqtt.example.com --bundle-key release.pub
    edge-agent fleet broker-config --install-dir /etc/mosquitto/edge
    edge-agent fleet devices add cam-01 --group line1
    edge-agent fleet devices list
    edge-agent fleet publish resnet8-v4.bundle
    edge-agent fleet serve artifacts/ --port 8080
    edge-agent fleet status [--json]
    edge-agent fleet deploy resnet8 4 --group line1 --stages 3,10%,50%,100%
    edge-agent fleet deploy --resume ROLLOUT_ID
    edge-agent fleet watch [ROLLOUT_ID]
    edge-agent fleet rollback ROLLOUT_ID | --devices cam-01,cam-02 --to resnet8 3

Every command but ``serve`` (and ``publish`` given ``--dir`` and ``--pubkey``) works in a fleet
workspace, the current directory or ``--fleet-dir`` (agent/fleet/ops/workspace.py). docs/fleet.md
is the operator's guide.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path
from typing import Any

from agent.errors import ConfigError, printable


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fleet", help="drive a fleet over MQTT: provision, publish, deploy in stages, roll back",
        description="The operator's side of fleet control (docs/fleet.md). Commands work in "
                    "the fleet workspace that 'fleet init' made: the current directory, or "
                    "--fleet-dir.")
    actions = parser.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--fleet-dir", type=Path, default=Path("."), metavar="DIR",
                        help="the fleet workspace")

    init = actions.add_parser("init", parents=[common], help="make a fleet workspace",
                              description="Make the fleet's signing key, its CAs, the broker's "
                              "server certificate, the operator certificate, the broker "
                              "configuration and fleet.toml in the workspace directory.")
    init.add_argument("--fleet", required=True, help="the fleet id (a topic level)")
    init.add_argument("--broker-host", required=True,
                      help="the broker's host name or address, as devices reach it")
    init.add_argument("--broker-name", action="append", default=[], metavar="NAME",
                      help="another name or address in the broker's certificate; repeatable")
    init.add_argument("--device-port", type=_port, default=8883)
    init.add_argument("--operator-port", type=_port, default=8884)
    init.add_argument("--protocol", choices=("5", "3.1.1"), default="5")
    init.add_argument("--device-auth", choices=("password", "certificate"), default="password",
                      help="how devices authenticate to the broker")
    init.add_argument("--operator-name", default="operator",
                      help="the operator identity (its certificate's common name)")
    init.add_argument("--artifacts-dir", type=Path, metavar="DIR",
                      help="where 'fleet publish' puts bundles (default: DIR/artifacts)")
    init.add_argument("--base-url", default="",
                      help="the URL devices fetch the artifact directory from")
    init.add_argument("--bundle-key", type=Path, action="append", default=[], metavar="PUB",
                      help="a public key bundles are signed with; repeatable")
    init.set_defaults(handler=run_init)

    broker = actions.add_parser("broker-config", parents=[common],
                                help="write the Mosquitto configuration and ACL",
                                description="Write broker/mosquitto.conf and broker/acl for "
                                "where the broker's files will be on the broker host.")
    broker.add_argument("--install-dir", type=Path, metavar="DIR",
                        help="where broker/ is copied to on the broker host "
                             "(default: the workspace's broker/, for a broker on this machine)")
    broker.add_argument("--persistence-dir", type=Path, metavar="DIR",
                        help="Mosquitto's store (default: /var/lib/mosquitto)")
    broker.add_argument("--bind", metavar="ADDRESS", help="listen on this address only")
    broker.add_argument("--user", metavar="USER",
                        help="the user Mosquitto runs as (default: its own, 'mosquitto')")
    broker.add_argument("--log-dest", default="syslog", help="Mosquitto's log_dest")
    broker.add_argument("--autosave-interval-s", type=int, default=30, metavar="S",
                        help="seconds between saves of the broker's store")
    broker.set_defaults(handler=run_broker_config)

    devices = actions.add_parser("devices", help="provision and list devices")
    device_actions = devices.add_subparsers(dest="devices_command", metavar="ACTION",
                                            required=True)
    add = device_actions.add_parser("add", parents=[common], help="provision a device",
                                    description="Give a device its broker credentials, record "
                                    "it and its groups, and write the files to install on it.")
    add.add_argument("device", help="the device id (its MQTT user name and client id)")
    add.add_argument("--group", action="append", default=[], metavar="GROUP",
                     help="a group the device belongs to; repeatable")
    add.add_argument("--out", type=Path, metavar="DIR",
                     help="where to write its files (default: DIR/devices/DEVICE)")
    add.add_argument("--install-dir", type=Path, default=Path("/etc/edge-agent/fleet"),
                     help="where the files go on the device")
    add.add_argument("--rotate", action="store_true",
                     help="new credentials for a device that is provisioned already")
    add.set_defaults(handler=run_devices_add)
    remove = device_actions.add_parser("remove", parents=[common], help="forget a device",
                                       description="Remove the device from the devices file "
                                       "and its password from the broker's password file.")
    remove.add_argument("device")
    remove.set_defaults(handler=run_devices_remove)
    groups = device_actions.add_parser("groups", parents=[common],
                                       help="set a device's groups")
    groups.add_argument("device")
    groups.add_argument("--group", action="append", default=[], metavar="GROUP")
    groups.set_defaults(handler=run_devices_groups)
    listing = device_actions.add_parser("list", parents=[common], help="list devices")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=run_devices_list)

    publish = actions.add_parser("publish", parents=[common],
                                 help="add a verified bundle to the artifact directory",
                                 description="Verify the bundle's signature and hashes, copy "
                                 "it to DIR/<name>/<version>/ atomically and add it to "
                                 "DIR/index.json. A published version never changes.")
    publish.add_argument("bundle", type=Path)
    publish.add_argument("--dir", type=Path, metavar="DIR",
                         help="the artifact directory (default: from fleet.toml)")
    publish.add_argument("--pubkey", type=Path, action="append", default=[], metavar="PUB",
                         help="a trusted bundle key; repeatable (default: from fleet.toml)")
    publish.add_argument("--json", action="store_true")
    publish.set_defaults(handler=run_publish)

    serve = actions.add_parser("serve", help="serve an artifact directory over HTTP",
                               description="A static file server with Range, ETag and "
                               "If-Range, for small setups and tests (docs/fleet.md: nginx, an "
                               "object store or a CDN for the rest).")
    serve.add_argument("directory", type=Path)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=_port_or_zero, default=8080)
    serve.set_defaults(handler=run_serve)

    _register_rollouts(actions, common)


def _register_rollouts(actions: Any, common: argparse.ArgumentParser) -> None:
    """status, deploy, watch and rollback: the commands that talk to the broker."""
    from agent.cli import fleet_rollouts

    fleet_rollouts.register(actions, common)


def _port(text: str) -> int:
    port = _port_or_zero(text)
    if port == 0:
        raise argparse.ArgumentTypeError("a port from 1 to 65535")
    return port


def _port_or_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port from 1 to 65535, not {text!r}")
    return value


def _workspace(args: argparse.Namespace) -> Any:
    from agent.fleet.ops.workspace import load_workspace

    return load_workspace(args.fleet_dir)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


# -- handlers ------------------------------------------------------------------------------------

def run_init(args: argparse.Namespace) -> int:
    from agent.fleet.ops.provision import init_workspace

    workspace = init_workspace(args.fleet_dir, fleet=args.fleet, broker_host=args.broker_host,
                               broker_names=args.broker_name, device_port=args.device_port,
                               operator_port=args.operator_port, protocol=args.protocol,
                               device_auth=args.device_auth, operator_name=args.operator_name,
                               artifacts_dir=args.artifacts_dir,
                               artifacts_base_url=args.base_url, bundle_keys=args.bundle_key)
    print(f"fleet {workspace.fleet}: workspace in {workspace.root}")
    print(f"  broker files: {workspace.broker_dir}/ (mosquitto.conf, acl, passwd, certificates)")
    print(f"  fleet signing key: {workspace.signing_key_path} (keep it private)")
    print(f"  operator certificate: {workspace.operator_cert[0]}")
    if not workspace.bundle_keys:
        print("  no bundle keys given: 'fleet publish' will need --pubkey")
    if not workspace.artifacts_base_url:
        print("  no --base-url given: set [artifacts] base_url in fleet.toml before deploying")
    print("next: 'edge-agent fleet broker-config --install-dir ...' for the broker host, then "
          "'edge-agent fleet devices add DEVICE'")
    return 0


def run_broker_config(args: argparse.Namespace) -> int:
    from agent.fleet.ops.provision import write_broker_config

    workspace = _workspace(args)
    config, acl = write_broker_config(workspace, install_dir=args.install_dir,
                                      persistence_dir=args.persistence_dir,
                                      bind_address=args.bind, run_as_user=args.user,
                                      log_dest=args.log_dest,
                                      autosave_interval_s=args.autosave_interval_s)
    target = args.install_dir or workspace.broker_dir
    print(f"wrote {config} and {acl}")
    print(f"copy {workspace.broker_dir}/ to {target}/ on the broker host (the server key and "
          "passwd readable by the broker's user only), then start Mosquitto with "
          f"-c {target}/mosquitto.conf")
    return 0


def run_devices_add(args: argparse.Namespace) -> int:
    from agent.fleet.ops.provision import add_device

    workspace = _workspace(args)
    made = add_device(workspace, args.device, groups=args.group, out_dir=args.out,
                      install_dir=args.install_dir, rotate=args.rotate)
    print(f"device {made.device} ({made.auth}): files to install in {args.install_dir}/ on it:")
    for path in made.files:
        print(f"  {path}")
    print("its topics (the ACL's patterns):")
    for access, topic in made.acl:
        print(f"  {access:5} {topic}")
    if made.auth == "password":
        print(f"the broker takes the new password on SIGHUP (copy "
              f"{workspace.broker_dir}/passwd to the broker host first)")
    return 0


def run_devices_remove(args: argparse.Namespace) -> int:
    from agent.fleet.ops.provision import remove_device

    workspace = _workspace(args)
    if not remove_device(workspace, args.device):
        raise ConfigError("no such device", device=args.device)
    print(f"removed {args.device}; the broker forgets its password on SIGHUP")
    return 0


def run_devices_groups(args: argparse.Namespace) -> int:
    from agent.fleet.ops.provision import set_groups

    record = set_groups(_workspace(args), args.device, args.group)
    print(f"{record.device}: groups {', '.join(record.groups) or '(none)'}")
    return 0


def run_devices_list(args: argparse.Namespace) -> int:
    from agent.fleet.ops.workspace import load_inventory

    inventory = load_inventory(_workspace(args))
    if args.json:
        _print_json({"devices": {device: record.to_json()
                                 for device, record in sorted(inventory.devices.items())},
                     "groups": inventory.groups})
        return 0
    for device, record in sorted(inventory.devices.items()):
        print(f"{device}\t{record.auth}\t{','.join(record.groups) or '-'}")
    return 0


def run_publish(args: argparse.Namespace) -> int:
    from agent.fleet.ops.artifacts import bundle_url, publish_bundle
    from models.signing import load_public_key

    directory, keys, base_url = args.dir, [load_public_key(path) for path in args.pubkey], ""
    if directory is None or not keys:
        workspace = _workspace(args)
        directory = directory or workspace.artifact_directory()
        keys = keys or workspace.trusted_bundle_keys()
        base_url = workspace.artifacts_base_url
    entry, new = publish_bundle(args.bundle, directory, keys)
    if args.json:
        _print_json({**entry.to_json(), "new": new,
                     "url": bundle_url(base_url, entry) if base_url else None})
        return 0
    state = "published" if new else "already published"
    print(f"{state}: {entry.name} version {entry.version} -> {directory / entry.path}")
    print(f"  sha256 {entry.sha256}, {entry.size} bytes, signed by {entry.key_id}")
    if base_url:
        print(f"  url {bundle_url(base_url, entry)}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from agent.fleet.ops.fileserver import serve_directory

    directory = Path(args.directory)
    if not directory.is_dir():
        raise ConfigError("not a directory", path=directory)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        started: asyncio.Future[int] = loop.create_future()
        task = asyncio.create_task(serve_directory(directory, host=args.host, port=args.port,
                                                   stop=stop, started=started))
        first: list[asyncio.Future[Any]] = [task, started]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if started.done():
            print(f"serving {directory.resolve()} on http://{args.host}:{started.result()}/",
                  flush=True)
        await task

    try:
        asyncio.run(main())
    except OSError as exc:
        raise ConfigError(f"cannot serve: {printable(str(exc), 300)}", host=args.host,
                          port=args.port) from None
    return 0

