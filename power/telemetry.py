"""Board telemetry from jetson-stats' jtop service when it runs, from sysfs otherwise.

jtop's service runs as root, so it can read what a user cannot (the EMC rate in debugfs) and
averages the power rails; but it is known to crash on some JetPack 6 releases (NVPModel init on
R36.4.4, JetPack 6.0 on NX) and misreports jetson_clocks' state, so nothing depends on it:
:func:`open_telemetry` with ``prefer="auto"`` uses it only when it is installed and its service
answers, and :class:`JtopTelemetry` falls back to the sysfs reader for good the first time a read
fails. The clocks and the GPU load always come from sysfs (cheap, readable by anyone); jtop
supplies the rails, the temperatures and the EMC rate.

jtop is imported through ``agent.deps.require(..., extra="jetson")``: ``pip install
'jetson-edge-agent[jetson]'`` installs jetson-stats, whose service needs ``sudo jtop
--install-service`` on the board.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

from agent.deps import require
from agent.errors import AgentError, PowerError
from power.types import Telemetry, ThermalZone

log = logging.getLogger(__name__)

PREFERENCES = ("auto", "sysfs", "jtop")


class SysfsReadings(Protocol):
    """What the sysfs reader is: :class:`~power.board.Board` (its ``telemetry``)."""

    def telemetry(self) -> Telemetry: ...


class TelemetrySource(Protocol):
    def read(self) -> Telemetry: ...

    def close(self) -> None: ...


class SysfsTelemetry:
    def __init__(self, board: SysfsReadings) -> None:
        self.board = board

    def read(self) -> Telemetry:
        return self.board.telemetry()

    def close(self) -> None:
        pass


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


class JtopTelemetry:
    """Rails, temperatures and the EMC rate from a running jtop service; the rest from sysfs.

    ``jetson``: an object with jtop's interface (``start``, ``ok``, ``close``, ``power``,
    ``temperature``, ``memory``); by default ``jtop.jtop()``, started here (which raises when the
    service does not answer)."""

    def __init__(self, board: SysfsReadings, jetson: Any = None) -> None:
        self.board = board
        if jetson is None:
            module = require("jtop", extra="jetson", purpose="telemetry from jetson-stats")
            jetson = module.jtop()
            jetson.start()
        self.jetson = jetson
        self.failed: str | None = None  # why jtop was given up, once it was

    def read(self) -> Telemetry:
        base = self.board.telemetry()
        if self.failed is not None:
            return base
        try:
            if not self.jetson.ok():
                raise PowerError("the jtop service stopped answering")
            return self._merge(base)
        except Exception as exc:  # jtop raises its own types, and crashes in odd ways
            self.failed = str(exc) or type(exc).__name__
            log.warning("jtop telemetry failed (%s): using sysfs from now on", self.failed)
            self.close()
            return base

    def _merge(self, base: Telemetry) -> Telemetry:
        power = self.jetson.power or {}
        rails = {name: int(values["power"]) for name, values in power.get("rail", {}).items()
                 if values.get("online", True) and _number(values.get("power")) is not None}
        total = _number(power.get("tot", {}).get("power"))
        trips = {zone.name: zone.trips_c for zone in base.thermal}
        zones = []
        for name, values in (self.jetson.temperature or {}).items():
            temp = _number(values.get("temp"))
            if not values.get("online", True) or temp is None or temp <= -256:
                temp = None  # jtop shows -256 for a zone it cannot read
            zones.append(ThermalZone(name=name.lower(), temp_c=temp,
                                     trips_c=trips.get(name.lower(), ())))
        emc = (self.jetson.memory or {}).get("EMC", {})
        emc_khz = _number(emc.get("cur")) if emc.get("online", True) else None
        return dataclasses.replace(
            base, rails_mw=rails or base.rails_mw,
            total_power_mw=int(total) if total is not None else base.total_power_mw,
            thermal=tuple(zones) or base.thermal,
            emc_hz=int(emc_khz * 1000) if emc_khz is not None else base.emc_hz, source="jtop")

    def close(self) -> None:
        try:
            self.jetson.close()
        except Exception as exc:  # closing a crashed client must not take the caller down
            log.debug("closing jtop: %s", exc)


def open_telemetry(board: SysfsReadings, prefer: str = "auto") -> TelemetrySource:
    """The telemetry source ``prefer`` names: ``sysfs``; ``jtop`` (errors if it cannot be used);
    ``auto``: jtop when installed and its service answers, else sysfs."""
    if prefer not in PREFERENCES:
        raise PowerError("unknown telemetry source", found=prefer,
                         expected=", ".join(PREFERENCES))
    if prefer == "sysfs":
        return SysfsTelemetry(board)
    try:
        return JtopTelemetry(board)
    except AgentError as exc:
        if prefer == "jtop":
            raise
        log.info("telemetry from sysfs: %s", exc)
    except Exception as exc:  # jtop.JtopException: the service is not running or not reachable
        if prefer == "jtop":
            raise PowerError("the jtop service cannot be used", reason=str(exc)[:300]) from exc
        log.info("telemetry from sysfs: the jtop service cannot be used (%s)", exc)
    return SysfsTelemetry(board)


__all__ = ["JtopTelemetry", "SysfsTelemetry", "TelemetrySource", "open_telemetry"]
