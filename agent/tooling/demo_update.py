"""The demo's second act: a new version of the model arrives while clients are being served.

The example bundle is published again as the next version (the same model, signed with the
build's key), and ``update.apply`` is sent over the daemon's control socket as
``edge-agent update apply`` would, while concurrent clients keep sending images. Printed: each
state of the update as the daemon reports it, how many requests each version answered, and that
none failed.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.deps import require
from agent.errors import AgentError


def publish_next_version(bundle: Path, public_key: Path, out_dir: Path) -> Path | None:
    """``bundle`` again as its version + 1, signed with the key beside ``public_key``; None when
    that private key is not there (a bundle built elsewhere)."""
    from models.bundle import open_bundle, pack_bundle
    from models.signing import load_private_key, load_public_key

    private_key = public_key.with_suffix("")  # signing.key.pub -> signing.key
    if not private_key.is_file():
        return None
    verified = open_bundle(bundle, [load_public_key(public_key)])
    manifest = {key: value for key, value in verified.manifest.items()
                if key not in ("artifacts", "created_at")}
    manifest["version"] = int(manifest["version"]) + 1
    # Beside the example bundle, not with it: the next demo starts from the example again.
    updates = out_dir / "updates"
    updates.mkdir(exist_ok=True)
    target = updates / f"{manifest['name']}-{manifest['version']}.bundle"
    with tempfile.TemporaryDirectory(dir=updates) as work:
        members = Path(work) / "members"
        verified.extract(members)
        files = {path.relative_to(members).as_posix(): path
                 for path in sorted(members.rglob("*")) if path.is_file()
                 and path.name not in ("manifest.json", "manifest.sig")}
        pack_bundle(target, manifest, files, load_private_key(private_key))
    return target


async def update_while_serving(base: str, model: str, input_name: str, images: np.ndarray,
                               control_socket: Path, bundle: Path, *,
                               concurrency: int) -> dict[str, Any]:
    """Clients send ``images`` round and round while the daemon applies ``bundle``; returns
    what they saw and how the update went."""
    aiohttp = require("aiohttp", extra="device", purpose="the demo's client")
    from agent.control.client import ControlClient
    from agent.control.protocol import UPDATE_APPLY
    from agent.tooling.loadgen import encode_request

    url = f"{base}/v2/models/{model}/infer"
    versions: list[str] = []
    failures: list[str] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_event(event: dict[str, Any]) -> None:
        if event.get("kind") == "state":
            loop.call_soon_threadsafe(
                print, f"  update: {event['state']}"
                + (f" ({event['message']})" if event.get("message") else ""))

    async def client(session: Any, offset: int) -> None:
        index = offset
        while not done.is_set():
            body, header_length = encode_request(input_name, images[index % len(images)][None],
                                                 datatype="FP32")
            index += concurrency
            try:
                async with session.post(url, data=body, headers={
                        "Inference-Header-Content-Length": str(header_length),
                        "Content-Type": "application/octet-stream"}) as response:
                    payload = await response.read()
                    if response.status != 200:
                        failures.append(f"HTTP {response.status}")
                        continue
                    length = int(response.headers.get("Inference-Header-Content-Length",
                                                      len(payload)))
                    versions.append(json.loads(payload[:length])["model_version"])
            except aiohttp.ClientError as exc:
                failures.append(repr(exc))

    def apply() -> dict[str, Any]:
        return ControlClient(control_socket).call(  # type: ignore[no-any-return]
            UPDATE_APPLY, {"source": bundle.resolve().as_uri()}, on_event=on_event,
            timeout_s=600)

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(client(session, offset)) for offset in range(concurrency)]
        try:
            await asyncio.sleep(1.0)  # steady traffic on the old version first
            started = time.perf_counter()
            try:
                status = await loop.run_in_executor(None, apply)
            except AgentError as exc:
                status = {"state": "failed", "error": {"reason": "refused",
                                                       "message": str(exc)}}
            update_s = time.perf_counter() - started
            await asyncio.sleep(1.0)  # and on the new one after
        finally:
            done.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"status": status, "versions": versions, "failures": failures, "update_s": update_s}


def report_update(result: dict[str, Any]) -> bool:
    """Print the second act's outcome; True when the new version serves and nothing failed."""
    status = result["status"]
    counts: dict[str, int] = {}
    for version in result["versions"]:
        counts[version] = counts.get(version, 0) + 1
    served = ", ".join(f"v{version}: {count}" for version, count in sorted(counts.items()))
    print(f"update        {status['state']} in {result['update_s']:.1f} s; answered by {served}; "
          f"{len(result['failures'])} failed requests")
    if status.get("error"):
        print(f"              {status['error']['reason']}: {status['error']['message']}")
    serving = status.get("serving") or {}
    return status["state"] == "committed" and not result["failures"] and bool(serving)
