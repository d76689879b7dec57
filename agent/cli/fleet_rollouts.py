"""``edge-agent fleet status | deploy | watch | rollback``: the commands that talk to the broker
with the operator identity (registered by agent/cli/fleet.py).

Exit status: 0 done (deployed, rolled back, shown), 1 an error, 3 the rollout aborted and rolled
back, 4 ``watch`` or ``rollback`` stopped waiting (``--timeout-s``) while the work goes on, 130 or
143 interrupted (the rollout stays as it is; ``deploy --resume ID`` or ``watch ID`` goes on with
it, from this machine or any other holding the workspace).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agent.errors import ConfigError, FleetError, Terminated, printable
from agent.cli.update import format_duration, seconds_argument

EXIT_ABORTED = 3
EXIT_WAITING = 4


def register(actions: Any, common: argparse.ArgumentParser) -> None:
    link = argparse.ArgumentParser(add_help=False)
    link.add_argument("--connect-timeout-s", type=seconds_argument, default=30.0, metavar="S",
                      help="how long to wait for the broker")

    status = actions.add_parser("status", parents=[common, link],
                                help="every device's state, from the broker",
                                description="A table of every device (from its retained "
                                "reported, online and desired documents) and the rollouts.")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=run_status)

    deploy = actions.add_parser(
        "deploy", parents=[common, link], help="roll a model version out in stages",
        description="Give the chosen devices MODEL VERSION in stages, aborting and rolling "
        "every reached device back when the abort rule fires (docs/fleet.md). The rollout's "
        "state is kept on the broker: if this command dies, 'deploy --resume ID' or "
        "'watch ID' goes on from any machine with the workspace.")
    deploy.add_argument("model", nargs="?", help="the model name")
    deploy.add_argument("version", nargs="?", type=int, help="the model version")
    deploy.add_argument("--devices", action="append", default=[], metavar="ID,...",
                        help="devices by id (comma-separated; repeatable)")
    deploy.add_argument("--group", action="append", default=[], metavar="GROUP",
                        help="the devices of a group (repeatable)")
    deploy.add_argument("--all", action="store_true", help="every device of the fleet")
    deploy.add_argument("--canary", metavar="N|P%",
                        help="a first stage of N devices or P%% of them")
    deploy.add_argument("--stages", metavar="LIST",
                        help="growing cumulative stages, e.g. 3,10%%,50%%,100%% (default: one "
                             "stage, or the canary then 100%%)")
    deploy.add_argument("--abort-failure-share", type=float, default=0.2, metavar="F",
                        help="abort when more than this share of a stage's finished devices "
                             "failed")
    deploy.add_argument("--abort-min-finished", type=int, default=3, metavar="N",
                        help="...once at least this many of the stage finished (or all of a "
                             "smaller stage)")
    deploy.add_argument("--stage-timeout-s", type=seconds_argument, default=1800.0, metavar="S",
                        help="a device that has not finished by then counts as timed out "
                             "(a failure)")
    deploy.add_argument("--rollback-timeout-s", type=seconds_argument, default=1800.0, metavar="S",
                        help="how long an abort waits for devices to be back")
    deploy.add_argument("--url", help="the bundle's URL, for a bundle not in the artifact index")
    deploy.add_argument("--sha256", help="the bundle's sha256, with --url")
    deploy.add_argument("--id", dest="rollout_id", help="the rollout id (default: made up)")
    deploy.add_argument("--resume", metavar="ROLLOUT_ID", help="go on with a rollout")
    deploy.add_argument("--take-over", action="store_true",
                        help="with --resume: drive it even though another process's "
                             "heartbeat is fresh")
    deploy.add_argument("--json", action="store_true",
                        help="print the final rollout document as JSON")
    deploy.set_defaults(handler=run_deploy)

    watch = actions.add_parser(
        "watch", parents=[common, link], help="follow a rollout (and drive one left alone)",
        description="Print a rollout's progress until it ends. A rollout whose driver went "
        "quiet (a deploy that died) is taken over and driven from here, unless "
        "--observe-only.")
    watch.add_argument("rollout_id", nargs="?", metavar="ROLLOUT_ID",
                       help="default: the newest rollout that has not ended")
    watch.add_argument("--observe-only", action="store_true")
    watch.add_argument("--stale-after-s", type=seconds_argument, default=60.0, metavar="S",
                       help="take the rollout over once its driver's last heartbeat is this "
                            "old (drivers beat every 15 s)")
    watch.add_argument("--timeout-s", type=seconds_argument, metavar="S",
                       help="stop watching after this long (exit 4)")
    watch.set_defaults(handler=run_watch)

    rollback = actions.add_parser(
        "rollback", parents=[common, link], help="roll a rollout or devices back",
        description="ROLLOUT_ID: every device the rollout reached goes back to the model it "
        "ran before. --devices: those devices go back to --to MODEL VERSION, or to the model "
        "they ran before the rollout that wrote their desired document.")
    rollback.add_argument("rollout_id", nargs="?", metavar="ROLLOUT_ID")
    rollback.add_argument("--devices", action="append", default=[], metavar="ID,...")
    rollback.add_argument("--to", nargs=2, metavar=("MODEL", "VERSION"))
    rollback.add_argument("--no-wait", action="store_true")
    rollback.add_argument("--timeout-s", type=seconds_argument, default=1800.0, metavar="S")
    rollback.set_defaults(handler=run_rollback)


def _ids(values: Sequence[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _say(line: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} {printable(line, 1000)}", flush=True)


# -- running a coroutine with the link ----------------------------------------------------------

def _run(args: argparse.Namespace, body: Callable[[Any, Any, list[Any]], Awaitable[int]],
         purpose: str) -> int:
    """Connect as the operator, run ``body(workspace, link, listeners)`` (``listeners``: add a
    callable to have it called with what changed in the view); SIGINT and SIGTERM stop it (the
    rollout stays where it is)."""
    from agent.fleet.ops.operator import OperatorLink, operator_client_id
    from agent.fleet.ops.workspace import load_workspace

    workspace = load_workspace(args.fleet_dir)
    notify: list[Callable[[str], None]] = []

    async def on_change(about: str) -> None:
        for callback in notify:
            callback(about)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        stopped: list[int] = []

        def stop(signum: int) -> None:
            stopped.append(signum)
            if task is not None:
                task.cancel()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop, signum)
        link = OperatorLink(workspace.operator_options(operator_client_id(purpose)),
                            fleet=workspace.fleet, signing_key=workspace.signing_key(),
                            trusted_keys=[workspace.public_key()], on_change=on_change)
        try:
            await link.start(timeout_s=args.connect_timeout_s)
            return await body(workspace, link, notify)
        except asyncio.CancelledError:
            if stopped and stopped[0] == signal.SIGTERM:
                raise Terminated() from None
            raise KeyboardInterrupt() from None
        finally:
            await link.stop()

    return asyncio.run(main())


# -- status ------------------------------------------------------------------------------------

def run_status(args: argparse.Namespace) -> int:
    async def body(workspace: Any, link: Any, listeners: list[Any]) -> int:
        from agent.fleet.ops.workspace import load_inventory

        inventory = load_inventory(workspace)
        table = status_table(link.view, inventory)
        if args.json:
            print(json.dumps(table, indent=2, sort_keys=True))
        else:
            print(format_status(table))
        return 0

    return _run(args, body, "status")


def status_table(view: Any, inventory: Any) -> dict[str, Any]:
    """Every device of the inventory or the broker, as ``status --json`` shows it."""
    from agent.fleet.documents import format_time

    devices: dict[str, Any] = {}
    for device in sorted({*view.devices(), *inventory.devices}):
        seen = view.device(device)
        reported, desired = seen.reported, seen.desired
        record = inventory.devices.get(device)
        devices[device] = {
            "provisioned": record is not None,
            "groups": list(record.groups) if record is not None else [],
            "online": seen.online,
            "applied": reported.applied.to_json() if reported and reported.applied else None,
            "desired": None if desired is None else {
                "version": desired.version,
                "model": None if desired.model is None else {"name": desired.model.name,
                                                             "version": desired.model.version},
                "rollout": desired.rollout, "allow_downgrade": desired.allow_downgrade},
            "desired_status": (reported.desired.to_json() if reported and reported.desired
                               else None),
            "updater": reported.updater.to_json() if reported else None,
            "reported_at": format_time(reported.reported_at) if reported else None,
            "agent_version": reported.agent_version if reported else None,
        }
    rollouts = [{"rollout_id": rollout.rollout_id, "state": rollout.state,
                 "model": rollout.model.to_json(), "stage": rollout.stage + 1,
                 "stages": len(rollout.stages), "counts": rollout.counts(),
                 "created_at": format_time(rollout.created_at),
                 "driver": rollout.driver.to_json() if rollout.driver else None}
                for rollout in sorted(view.rollouts.values(), key=lambda item: item.created_at)]
    return {"fleet": view.fleet, "devices": devices, "rollouts": rollouts}


def format_status(table: dict[str, Any]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [("DEVICE", "ONLINE", "APPLIED", "DESIRED", "STATUS", "UPDATER", "REPORTED")]
    for device, row in table["devices"].items():
        applied = row["applied"]
        desired = row["desired"]
        status = row["desired_status"]
        updater = row["updater"]
        model = desired["model"] if desired else None
        reported = "never"
        if row["reported_at"]:
            moment = datetime.datetime.strptime(row["reported_at"][:19], "%Y-%m-%dT%H:%M:%S")
            age = (now - moment.replace(tzinfo=datetime.timezone.utc)).total_seconds()
            reported = f"{format_duration(max(0.0, age))} ago"
        status_text = "-"
        if status:
            status_text = f"v{status['version']} {status['status']}"
            if status.get("reason"):
                status_text += f" ({status['reason']})"
        rows.append((
            device,
            {True: "yes", False: "no", None: "?"}[row["online"]],
            f"{applied['name']} {applied['version']}" if applied else "-",
            (f"v{desired['version']} " + (f"{model['name']} {model['version']}" if model
                                          else "(no model)")) if desired else "-",
            status_text,
            updater["state"] if updater else "-",
            reported))
    widths = [max(len(str(row[column])) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(printable(str(value), 200).ljust(width)
                       for value, width in zip(row, widths)).rstrip() for row in rows]
    for rollout in table["rollouts"]:
        counts = rollout["counts"]
        lines.append(f"rollout {rollout['rollout_id']}: {rollout['state']}, "
                     f"{rollout['model']['name']} {rollout['model']['version']}, stage "
                     f"{rollout['stage']}/{rollout['stages']}, {counts['succeeded']} succeeded, "
                     f"{counts['failed']} failed, {counts['timed_out']} timed out, "
                     f"{counts['waiting'] + counts['applying']} in progress")
    return "\n".join(lines)


# -- deploy ------------------------------------------------------------------------------------

def _policy(args: argparse.Namespace) -> Any:
    from agent.fleet.ops.rollout import Policy

    stages: list[str] = []
    if args.canary:
        stages.append(args.canary.strip())
    if args.stages:
        stages += [item.strip() for item in args.stages.split(",") if item.strip()]
    return Policy(stages=tuple(stages or ["100%"]),
                  abort_failure_share=args.abort_failure_share,
                  abort_min_finished=args.abort_min_finished,
                  stage_timeout_s=args.stage_timeout_s,
                  rollback_timeout_s=args.rollback_timeout_s)


def _model(args: argparse.Namespace, workspace: Any) -> Any:
    from agent.fleet.documents import ModelSpec
    from agent.fleet.ops.artifacts import bundle_url, load_index

    if args.url:
        if not args.sha256:
            raise ConfigError("--url needs --sha256 (the bundle file's sha256)")
        return ModelSpec(name=args.model, version=args.version, url=args.url,
                         sha256=args.sha256.lower())
    entry = load_index(workspace.artifact_directory()).get(args.model, args.version)
    return ModelSpec(name=entry.name, version=entry.version,
                     url=bundle_url(workspace.artifacts_base_url, entry), sha256=entry.sha256)


def _targets(args: argparse.Namespace, workspace: Any, view: Any) -> list[str]:
    from agent.fleet.ops.workspace import load_inventory

    inventory = load_inventory(workspace)
    named = _ids(args.devices)
    known = set(inventory.devices) | set(view.devices())
    unknown = [device for device in named if device not in known]
    if unknown:
        raise FleetError("no such device (not in the devices file, never seen on the broker)",
                         reason="unknown", devices=",".join(unknown))
    chosen = set(named) | set(inventory.select(groups=args.group, everything=args.all))
    if not chosen:
        raise ConfigError("name the devices: --devices, --group or --all")
    return sorted(chosen)


def _resolver(workspace: Any) -> Any:
    from agent.fleet.ops.artifacts import load_index
    from agent.fleet.ops.deploy import index_resolver

    try:
        index = load_index(workspace.artifact_directory())
    except (ConfigError, FleetError):
        index = None
    return index_resolver(index, workspace.artifacts_base_url)


def run_deploy(args: argparse.Namespace) -> int:
    from agent.fleet.documents import ModelSpec, utc_now
    from agent.fleet.ops.deploy import (
        RolloutDriver,
        busy_devices,
        driver_is_fresh,
        make_rollout_id,
        pick_for_resume,
    )
    from agent.fleet.ops.rollout import new_rollout

    if args.resume and (args.model or args.devices or args.group or args.all):
        raise ConfigError("--resume goes on with a rollout as it was planned; give no model or "
                          "devices with it")
    if not args.resume and (args.model is None or args.version is None):
        raise ConfigError("deploy needs MODEL VERSION (or --resume ROLLOUT_ID)")
    planned: ModelSpec | None = None
    if not args.resume:
        from agent.fleet.ops.workspace import load_workspace

        # Before connecting: a model that is not published is the operator's mistake to hear
        # at once, not after a wait for the broker.
        planned = _model(args, load_workspace(args.fleet_dir))

    async def body(workspace: Any, link: Any, listeners: list[Any]) -> int:
        now = utc_now()
        if args.resume:
            rollout = pick_for_resume(link, args.resume, workspace.rollouts_dir)
            if rollout.final:
                _say(f"rollout {rollout.rollout_id} has ended: {rollout.state}")
                return _exit_for(rollout)
            if driver_is_fresh(rollout, now, 60.0) and not args.take_over:
                assert rollout.driver is not None
                raise FleetError("another process is driving this rollout (its heartbeat is "
                                 "fresh); 'watch' follows it, --take-over drives it from here",
                                 reason="driven", rollout=rollout.rollout_id,
                                 driver=rollout.driver.id)
        else:
            assert planned is not None
            model: ModelSpec = planned
            devices = _targets(args, workspace, link.view)
            busy = busy_devices(link, devices)
            if busy:
                raise FleetError("devices are in a rollout that has not ended (watch it to its "
                                 "end, or roll it back, first)", reason="busy",
                                 devices=",".join(sorted(busy)),
                                 rollouts=",".join(sorted(set(busy.values()))))
            rollout_id = args.rollout_id or make_rollout_id(model, now)
            if rollout_id in link.view.rollouts:
                raise FleetError("a rollout with this id exists already ('deploy --resume' "
                                 "goes on with it)", reason="exists", rollout=rollout_id)
            rollout = new_rollout(fleet=workspace.fleet, rollout_id=rollout_id, model=model,
                                  devices=devices, policy=_policy(args), now=now,
                                  views=link.view.views(devices))
            sizes = [len(stage.devices) for stage in rollout.stages]
            _say(f"rollout {rollout.rollout_id}: stages of {', '.join(map(str, sizes))} devices")
        driver = RolloutDriver(link, rollout, resolve=_resolver(workspace), on_progress=_say,
                               local_dir=workspace.rollouts_dir)
        listeners.append(lambda about: driver.notify())
        try:
            final = await driver.run()
        except (asyncio.CancelledError, KeyboardInterrupt):
            print(f"edge-agent: the rollout stays as it is; 'edge-agent fleet deploy --resume "
                  f"{rollout.rollout_id}' or 'edge-agent fleet watch {rollout.rollout_id}' goes "
                  "on with it", file=sys.stderr)
            raise
        if args.json:
            print(json.dumps(final.to_json(), indent=2, sort_keys=True))
        return _exit_for(final)

    return _run(args, body, "deploy")


def _exit_for(rollout: Any) -> int:
    """0 for a completed rollout, 3 for one that turned back (aborted or rolled back)."""
    return 0 if rollout.state == "completed" else EXIT_ABORTED


# -- watch -------------------------------------------------------------------------------------

def run_watch(args: argparse.Namespace) -> int:
    from agent.fleet.documents import utc_now
    from agent.fleet.ops.deploy import RolloutDriver, driver_is_fresh, pick_for_resume
    from agent.fleet.ops.operator import latest
    from agent.fleet.ops.rollout import changes, snapshot

    async def body(workspace: Any, link: Any, listeners: list[Any]) -> int:
        if args.rollout_id:
            rollout = pick_for_resume(link, args.rollout_id, workspace.rollouts_dir)
        else:
            newest = latest(link.view.rollouts, unfinished_only=True) or latest(
                link.view.rollouts)
            if newest is None:
                raise FleetError("there are no rollouts on the broker", reason="unknown")
            rollout = newest
        rollout_id = rollout.rollout_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.timeout_s if args.timeout_s else None
        changed = asyncio.Event()
        listeners.append(lambda about: changed.set())
        shown = None
        while True:
            rollout = link.view.rollouts.get(rollout_id, rollout)
            for line in changes(shown, rollout):
                _say(line)
            shown = snapshot(rollout)
            if rollout.final:
                return _exit_for(rollout)
            if not args.observe_only and not driver_is_fresh(rollout, utc_now(),
                                                             args.stale_after_s):
                _say(f"the rollout's driver went quiet"
                     f"{f' ({rollout.driver.id})' if rollout.driver else ''}; driving it "
                     "from here")
                driver = RolloutDriver(link, rollout, resolve=_resolver(workspace),
                                       on_progress=_say, local_dir=workspace.rollouts_dir)
                listeners.append(lambda about: driver.notify())
                driving = asyncio.ensure_future(driver.run())
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait([driving], timeout=remaining)
                if not done:
                    driving.cancel()
                    await asyncio.gather(driving, return_exceptions=True)
                    return EXIT_WAITING
                return _exit_for(driving.result())
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return EXIT_WAITING
            changed.clear()
            try:
                pause = min(5.0, args.stale_after_s / 2)
                await asyncio.wait_for(changed.wait(),
                                       pause if remaining is None else min(pause, remaining))
            except asyncio.TimeoutError:
                pass

    return _run(args, body, "watch")


# -- rollback ----------------------------------------------------------------------------------

def run_rollback(args: argparse.Namespace) -> int:
    if bool(args.rollout_id) == bool(args.devices):
        raise ConfigError("rollback takes a ROLLOUT_ID or --devices, one of them")
    if args.to and not args.devices:
        raise ConfigError("--to goes with --devices")
    if args.rollout_id:
        return _rollback_rollout(args)
    return _rollback_devices(args)


def _rollback_rollout(args: argparse.Namespace) -> int:
    from agent.fleet.documents import utc_now
    from agent.fleet.ops.deploy import RolloutDriver, pick_for_resume, turn_back

    async def body(workspace: Any, link: Any, listeners: list[Any]) -> int:
        rollout = pick_for_resume(link, args.rollout_id, workspace.rollouts_dir)
        turn_back(rollout, link, utc_now())
        driver = RolloutDriver(link, rollout, resolve=_resolver(workspace), on_progress=_say,
                               local_dir=workspace.rollouts_dir)
        listeners.append(lambda about: driver.notify())
        if args.no_wait:
            await driver._repair()  # the rollback's documents out; 'watch' follows them
            _say(f"rollback of {rollout.rollout_id} started; 'edge-agent fleet watch "
                 f"{rollout.rollout_id}' follows it")
            return 0
        try:
            final = await asyncio.wait_for(driver.run(), args.timeout_s)
        except asyncio.TimeoutError:
            _say(f"still rolling back after {args.timeout_s:g} s; 'edge-agent fleet watch "
                 f"{rollout.rollout_id}' follows it")
            return EXIT_WAITING
        backs = [entry.rollback for entry in final.devices.values() if entry.rollback]
        return 0 if all(back.status in ("done", "superseded") for back in backs) else 1

    return _run(args, body, "rollback")


def _rollback_devices(args: argparse.Namespace) -> int:
    from agent.fleet.documents import Desired, ModelSpec, utc_now
    from agent.fleet.ops.artifacts import bundle_url, load_index

    devices = _ids(args.devices)

    async def body(workspace: Any, link: Any, listeners: list[Any]) -> int:
        view = link.view
        targets: dict[str, ModelSpec] = {}
        for device in devices:
            seen = view.device(device)
            if args.to:
                name, version_text = args.to
                try:
                    version = int(version_text)
                except ValueError:
                    raise ConfigError("--to takes MODEL VERSION", found=version_text) from None
                entry = load_index(workspace.artifact_directory()).get(name, version)
                targets[device] = ModelSpec(name=name, version=version, sha256=entry.sha256,
                                            url=bundle_url(workspace.artifacts_base_url, entry))
                continue
            desired = seen.desired
            rollout = view.rollouts.get(desired.rollout) if desired and desired.rollout else None
            entry_of = rollout.devices.get(device) if rollout is not None else None
            if entry_of is None or entry_of.previous is None:
                raise FleetError("cannot tell what this device ran before; give --to MODEL "
                                 "VERSION", reason="unknown_previous", device=device)
            targets[device] = entry_of.previous
        now = utc_now()
        versions: dict[str, int] = {}
        for device, model in targets.items():
            seen = view.device(device)
            current = seen.desired
            document = Desired(fleet=workspace.fleet, device=device,
                               version=seen.next_version(), issued_at=now, model=model,
                               allow_downgrade=True, rollout=None,
                               power=current.power if current else None,
                               settings=current.settings if current else {})
            await link.publish_desired(document)
            versions[device] = document.version
            _say(f"{device}: desired v{document.version} -> {model.name} {model.version}")
        if args.no_wait:
            return 0
        return await _wait_converged(link, listeners, versions, targets, args.timeout_s)

    return _run(args, body, "rollback")


async def _wait_converged(link: Any, listeners: list[Any], versions: dict[str, int],
                          targets: dict[str, Any], timeout_s: float) -> int:
    changed = asyncio.Event()
    listeners.append(lambda about: changed.set())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    left = dict(versions)
    failed = 0
    while left:
        for device, version in list(left.items()):
            reported = link.view.reported.get(device)
            status = reported.desired if reported is not None else None
            if status is None or status.version < version or status.status == "applying":
                continue
            applied = reported.applied if reported is not None else None
            model = targets[device]
            ok = status.status == "converged" and applied is not None and (
                applied.name, applied.version) == (model.name, model.version)
            _say(f"{device}: {'back on' if ok else 'did not go back to'} {model.name} "
                 f"{model.version}" + ("" if ok else f" ({status.status}: {status.reason})"))
            failed += 0 if ok else 1
            del left[device]
        if not left:
            break
        remaining = deadline - loop.time()
        if remaining <= 0:
            _say(f"still waiting for {', '.join(sorted(left))}")
            return EXIT_WAITING
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), min(remaining, 5.0))
        except asyncio.TimeoutError:
            pass
    return 1 if failed else 0
