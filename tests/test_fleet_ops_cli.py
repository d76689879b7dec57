"""``edge-agent fleet`` without a broker: init, broker-config, devices, publish and serve as an
operator types them, their output and exit statuses, and errors that name what is wrong."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.cli import main
from models.signing import load_private_key, write_keypair
from tests.brokers import free_port

pytest.importorskip("onnx")

from tests.tiny_models import make_bundle  # noqa: E402 - needs onnx

ROOT = Path(__file__).resolve().parents[1]


def test_init_devices_broker_config_and_publish(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    write_keypair(tmp_path / "release.key")
    fleet_dir = str(tmp_path / "fleet")
    assert main(["fleet", "init", "--fleet-dir", fleet_dir, "--fleet", "plant-a",
                 "--broker-host", "mqtt.example.com", "--bundle-key",
                 str(tmp_path / "release.key.pub"),
                 "--base-url", "https://files.example/edge"]) == 0
    out = capsys.readouterr().out
    assert "fleet plant-a: workspace in" in out
    assert main(["fleet", "init", "--fleet-dir", fleet_dir, "--fleet", "plant-a",
                 "--broker-host", "x"]) == 1
    assert "holds a fleet workspace already" in capsys.readouterr().err

    assert main(["fleet", "devices", "add", "cam-01", "--group", "line1",
                 "--fleet-dir", fleet_dir]) == 0
    out = capsys.readouterr().out
    assert "device cam-01 (password)" in out and "read  edge/plant-a/cam-01/desired" in out
    assert main(["fleet", "devices", "add", "cam/02", "--fleet-dir", fleet_dir]) == 1
    assert "invalid device id" in capsys.readouterr().err
    assert main(["fleet", "devices", "list", "--json", "--fleet-dir", fleet_dir]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["groups"] == {"line1": ["cam-01"]}

    assert main(["fleet", "broker-config", "--fleet-dir", fleet_dir, "--install-dir",
                 "/etc/mosquitto/edge", "--persistence-dir", "/var/lib/mosquitto"]) == 0
    config = (tmp_path / "fleet/broker/mosquitto.conf").read_text()
    assert "password_file /etc/mosquitto/edge/passwd" in config
    assert "allow_anonymous false" in config and "persistence true" in config
    assert "use_username_as_clientid true" in config
    acl = (tmp_path / "fleet/broker/acl").read_text()
    assert "user operator\ntopic readwrite edge/plant-a/#" in acl
    assert "pattern write edge/plant-a/%u/resp/#" in acl
    capsys.readouterr()

    bundle, _ = make_bundle(tmp_path, version=3, key=load_private_key(tmp_path / "release.key"))
    assert main(["fleet", "publish", str(bundle), "--fleet-dir", fleet_dir, "--json"]) == 0
    published = json.loads(capsys.readouterr().out)
    assert published["new"] and published["url"] == (
        "https://files.example/edge/tiny/3/tiny-3.bundle")
    assert main(["fleet", "publish", str(bundle), "--fleet-dir", fleet_dir]) == 0
    assert "already published" in capsys.readouterr().out
    stranger, _ = make_bundle(tmp_path / "other", version=4)
    assert main(["fleet", "publish", str(stranger), "--fleet-dir", fleet_dir]) == 1
    assert "unknown signing key" in capsys.readouterr().err

    # Commands that need a workspace say so, and name where they looked.
    assert main(["fleet", "status", "--fleet-dir", str(tmp_path / "nowhere")]) == 1
    assert "no fleet workspace here" in capsys.readouterr().err
    assert main(["fleet", "deploy", "--fleet-dir", fleet_dir]) == 1
    assert "deploy needs MODEL VERSION" in capsys.readouterr().err


def test_serve_runs_until_sigterm(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.bundle").write_bytes(b"x" * 1000)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "fleet", "serve", str(tmp_path / "files"), "--host",
         "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        assert f"on http://127.0.0.1:{port}/" in line, line
        request = urllib.request.Request(f"http://127.0.0.1:{port}/a.bundle",
                                         headers={"Range": "bytes=990-"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 206 and response.read() == b"x" * 10
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # A port in use is an error that names it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "agent", "fleet", "serve", str(tmp_path / "files"), "--host",
             "127.0.0.1", "--port", str(taken)], capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        assert done.returncode == 1 and f"port={taken}" in done.stderr, done.stderr


def test_deploy_of_an_unpublished_version_fails_before_any_broker_is_needed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_keypair(tmp_path / "release.key")
    fleet_dir = str(tmp_path / "fleet")
    # The broker named here does not exist: the refusal must come without trying to reach it.
    assert main(["fleet", "init", "--fleet-dir", fleet_dir, "--fleet", "plant-a",
                 "--broker-host", "127.0.0.1", "--operator-port", str(free_port()),
                 "--bundle-key", str(tmp_path / "release.key.pub"),
                 "--base-url", "https://files.example/edge"]) == 0
    capsys.readouterr()
    assert main(["fleet", "deploy", "tiny", "7", "--all", "--connect-timeout-s", "60",
                 "--fleet-dir", fleet_dir]) == 1
    err = capsys.readouterr().err
    assert "not in the artifact index" in err and "MQTT" not in err
