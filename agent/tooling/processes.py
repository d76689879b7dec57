"""Child processes of the benchmarks: a daemon started for a measurement is stopped as a service
manager would stop it."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable

from agent.errors import AgentError


def stop_process(process: subprocess.Popen[bytes], *, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL once ``timeout_s`` has passed without it ending; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


def wait_ready(process: subprocess.Popen[bytes], base_url: Callable[[], str | None], *,
               timeout_s: float, log_tail: Callable[[], str], poll_s: float = 0.1) -> str:
    """Wait until the daemon at ``base_url()`` (None while it is not known yet, such as before
    the daemon wrote its port) answers ready; returns that URL.

    Raises:
        AgentError: the process ended first, or ``timeout_s`` passed (with its log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AgentError("the daemon exited during its start", status=process.returncode,
                             log=log_tail())
        url = base_url()
        if url is not None:
            try:
                with urllib.request.urlopen(url + "/v2/health/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return url
            except OSError:
                pass
        time.sleep(poll_s)
    raise AgentError("the daemon did not become ready", timeout_s=timeout_s, log=log_tail())
