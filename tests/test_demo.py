"""``edge-agent demo`` end to end (slow: it builds the example bundle with torch first)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.tooling.demo import expected_accuracy

ACCURACY = {"metric": "top1", "int8": 98.889, "int8_onnxruntime_served": 98.333}


def test_the_demo_compares_with_the_figure_for_the_backend_that_served() -> None:
    assert expected_accuracy({"accuracy": ACCURACY}, "onnxruntime") == (
        "; the bundle's report: 98.33% as ONNX Runtime serves it, 98.89% for the model TensorRT "
        "runs (QDQ, measured on this host)")
    assert expected_accuracy({"accuracy": ACCURACY}, "tensorrt") == "; the bundle's report: 98.89%"
    # Older bundles lack the served figure; ONNX-only builds report agreement, not top-1.
    assert expected_accuracy({"accuracy": {"metric": "top1", "int8": 97.5}},
                             "onnxruntime") == "; the bundle's report: 97.50%"
    assert expected_accuracy({"accuracy": {**ACCURACY, "metric": "agreement"}}, "tensorrt") == ""
    assert expected_accuracy({}, "tensorrt") == ""


@pytest.mark.slow
def test_demo_builds_serves_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, "-m", "agent", "demo", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "accuracy" in out and "latency" in out
    # The daemon's answers score exactly what the bundle's report says ONNX Runtime serves.
    served = re.search(r"= ([0-9.]+)% .*the bundle's report: ([0-9.]+)% as ONNX Runtime", out)
    assert served and served.group(1) == served.group(2), out
    assert "same predictions: True" in out
    assert 'edge_agent_requests_total{model="resnet18-digits",outcome="success"}' in out
    assert "daemon stopped cleanly" in out
    # The second act: the next version applied while the clients go on, none failing.
    assert "update: canary" in out and "update: committed" in out
    update = re.search(r"update +committed in [0-9.]+ s; answered by v1: \d+, v2: \d+; "
                       r"0 failed requests", out)
    assert update, out
    assert list(tmp_path.glob("resnet18-digits-*.bundle"))


# -- found by probing: the demo refuses what it cannot do, before any work ------------------------


def test_a_bundle_without_its_public_key_is_refused_not_rebuilt(tmp_path: Path) -> None:
    from agent.tooling.demo import DemoOptions, run_demo
    from agent.errors import ConfigError

    (tmp_path / "resnet18-digits-1.bundle").write_bytes(b"a bundle whose key went missing")
    with pytest.raises(ConfigError, match="not the public key that verifies it"):
        run_demo(DemoOptions(out_dir=tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        ".demo.lock", "resnet18-digits-1.bundle"]


def test_a_second_demo_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    import fcntl
    import os

    from agent.tooling.demo import DemoOptions, run_demo
    from agent.errors import AgentError

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "live").write_text("the first demo's store")
    fd = os.open(tmp_path / ".demo.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(AgentError, match="another edge-agent demo is running"):
            run_demo(DemoOptions(out_dir=tmp_path))
    finally:
        os.close(fd)
    assert (tmp_path / "state" / "live").exists()


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "expected a whole number of at least 1"),
    (["--concurrency", "-2"], "expected a whole number of at least 1"),
])
def test_bad_demo_options_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "agent", "demo", "--out", str(tmp_path), *args],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and message in result.stderr


def test_an_out_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    result = subprocess.run([sys.executable, "-m", "agent", "demo", "--out", str(afile)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"edge-agent: error: --out is not a directory (key=--out, path={afile})"]


def test_sigterm_unwinds_the_demo(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys, time\n"
        "import agent.tooling.demo as demo\n"
        "def slow(out_dir):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "demo.find_or_build_bundle = slow\n"
        "from agent.cli import main\n"
        f"sys.exit(main(['demo', '--out', {str(tmp_path)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 143 and "edge-agent: terminated" in result.stderr


def test_the_demo_does_not_clear_a_store_that_serve_is_using(tmp_path: Path) -> None:
    import fcntl
    import os

    from agent.tooling.demo import DemoOptions, run_demo
    from agent.errors import AgentError
    from models.signing import write_keypair

    write_keypair(tmp_path / "signing.key")
    (tmp_path / "resnet18-digits-1.bundle").write_bytes(b"never read: the store is busy")
    state = tmp_path / "state"
    state.mkdir()
    (state / "live").write_text("a daemon's store")
    fd = os.open(state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as `edge-agent serve --state-dir OUT/state` holds it
        with pytest.raises(AgentError, match="model store is in use by another"):
            run_demo(DemoOptions(out_dir=tmp_path))
    finally:
        os.close(fd)
    assert (state / "live").exists()


def test_sigterm_while_the_demo_serves_drains_its_daemon(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")  # the demo's images: the digits set (host extra)
    script = (
        "import asyncio, os, signal, sys\n"
        "from pathlib import Path\n"
        "import agent.tooling.demo as demo\n"
        "from models.signing import write_public_key\n"
        "from tests.tiny_models import make_bundle\n"
        f"out = Path({str(tmp_path)!r})\n"
        "bundle, key = make_bundle(out, name='resnet18-digits')\n"
        "write_public_key(out / 'signing.key.pub', key.public_key())\n"
        "demo.find_or_build_bundle = lambda out_dir: (bundle, out / 'signing.key.pub')\n"
        "async def killer():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # lands inside another task of the loop\n"
        "    await asyncio.sleep(1)\n"
        "async def terminated_meanwhile(*args):\n"
        "    asyncio.ensure_future(killer())\n"
        "    await asyncio.sleep(10)\n"
        "demo._send_all = terminated_meanwhile\n"
        "from agent.cli import main\n"
        f"sys.exit(main(['demo', '--out', {str(tmp_path)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=False, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 143, result.stderr
    assert "edge-agent: terminated" in result.stderr and "Traceback" not in result.stderr
    # The daemon was stopped (its store's lock is free) and the model had become current.
    import fcntl
    import os

    fd = os.open(tmp_path / "state" / "lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
