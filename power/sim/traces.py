"""SIMULATION: request arrival traces for the power benchmark (deterministic for a seed).

* ``periodic``: a camera-like 5 Hz stream with a little jitter.
* ``bursty``: on/off, Poisson bursts at a high rate separated by silent gaps.
* ``saturated``: Poisson arrivals near the board's capacity at its top clocks.
* ``daily``: a compressed day: busy and quiet periods with idle gaps long enough (>= 10 s) for
  the governor to put the board to sleep, each gap ending with a first request that measures wake.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agent.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str
    description: str
    arrivals_s: tuple[float, ...]  # ascending
    duration_s: float
    wake_probes_s: tuple[float, ...] = ()  # arrivals that come after >= 10 s without one


def periodic(*, duration_s: float, rate_hz: float = 5.0, jitter_s: float = 0.002,
             seed: int = 1) -> Trace:
    rng = random.Random(seed)
    period = 1.0 / rate_hz
    count = int(duration_s * rate_hz)
    arrivals = tuple(sorted(max(0.0, (i + 0.5) * period + rng.uniform(-jitter_s, jitter_s))
                            for i in range(count)))
    return Trace(name="periodic", description=f"{rate_hz:g} Hz periodic", arrivals_s=arrivals,
                 duration_s=duration_s)


def _poisson(rng: random.Random, start_s: float, end_s: float, rate_hz: float) -> list[float]:
    times: list[float] = []
    now = start_s
    while True:
        now += rng.expovariate(rate_hz)
        if now >= end_s:
            return times
        times.append(now)


def bursty(*, duration_s: float, on_s: float = 2.0, off_s: float = 6.0, rate_hz: float = 40.0,
           seed: int = 1) -> Trace:
    rng = random.Random(seed)
    arrivals: list[float] = []
    start = 1.0
    while start < duration_s:
        length = on_s * rng.uniform(0.5, 1.5)
        arrivals += _poisson(rng, start, min(duration_s, start + length), rate_hz)
        start += length + off_s * rng.uniform(0.5, 1.5)
    return Trace(name="bursty", description=f"on/off: {rate_hz:g} req/s bursts of ~{on_s:g} s, "
                 f"~{off_s:g} s gaps", arrivals_s=tuple(arrivals), duration_s=duration_s)


def saturated(*, duration_s: float, rate_hz: float, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    arrivals = _poisson(rng, 0.5, duration_s, rate_hz)
    return Trace(name="saturated", description=f"Poisson {rate_hz:.0f} req/s (near capacity)",
                 arrivals_s=tuple(arrivals), duration_s=duration_s)


def daily(*, duration_s: float, seed: int = 1, idle_gap_s: float = 14.0) -> Trace:
    """Alternating activity and idle gaps: a busy spell (Poisson 20 req/s), a quiet spell
    (1 req/s), then an idle gap of ``idle_gap_s`` (>= 10 s) whose first arrival probes wake."""
    if idle_gap_s < 10.0:
        raise ConfigError("the daily trace's idle gaps must be at least 10 s", key="idle_gap_s",
                          found=idle_gap_s)
    rng = random.Random(seed)
    arrivals: list[float] = []
    probes: list[float] = []
    now = 0.5
    while now < duration_s:
        busy = _poisson(rng, now, min(duration_s, now + rng.uniform(4.0, 8.0)), 20.0)
        if busy:
            if arrivals and busy[0] - arrivals[-1] >= 10.0:
                probes.append(busy[0])
            arrivals += busy
            now = busy[-1]
        quiet = _poisson(rng, now, min(duration_s, now + rng.uniform(4.0, 8.0)), 1.0)
        arrivals += quiet
        now = (arrivals[-1] if arrivals else now) + idle_gap_s * rng.uniform(1.0, 1.5)
    return Trace(name="daily", description=f"busy/quiet spells with >= {idle_gap_s:g} s idle gaps",
                 arrivals_s=tuple(arrivals), duration_s=duration_s, wake_probes_s=tuple(probes))


__all__ = ["Trace", "bursty", "daily", "periodic", "saturated"]
