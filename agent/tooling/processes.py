"""Child processes of the benchmarks: a daemon started for a measurement is stopped as a service
manager would stop it."""

from __future__ import annotations

import signal
import subprocess


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
