"""Thermal zones: each zone's name and trip points (read once), and its temperature (m°C in the
files, °C here). A zone whose temperature cannot be read (the cv zones of an Orin Nano fail with
EAGAIN) reads as ``None``, never as a number that looks real (-256 °C is what jtop shows).

Only the trips where the board throttles or shuts down (``passive``, ``hot``, ``critical``) are
kept: ``active`` trips switch fan levels (Xavier's ``thermal-fan-est`` has them from about 50 °C)
and would make the thermal guard cap clocks on a cool board. A trip whose temperature cannot be
read, or reads as a sentinel, is left out without hiding the trips after it."""

from __future__ import annotations

from pathlib import Path

from power.io import read_int, read_text
from power.types import ThermalZone


def zone_name(zone_type: str) -> str:
    """``cpu-thermal``, ``CPU-therm`` -> ``cpu``; ``tj-therm`` -> ``tj``; ``PMIC-Die`` stays."""
    for suffix in ("-thermal", "-therm"):
        if zone_type.endswith(suffix):
            return zone_type[: -len(suffix)].lower()
    return zone_type


LIMIT_TRIPS = frozenset({"passive", "hot", "critical"})
# A sentinel such as -256000 m°C, far below any reading: industrial modules (AGX Orin Industrial)
# are rated down to -40 °C ambient, so a cold start can read -40 °C and a little below.
OFFLINE_BELOW_C = -100.0


class ThermalZones:
    def __init__(self, root: Path, zone_dirs: tuple[str, ...]) -> None:
        self.root = root
        self.zones: list[tuple[str, str, tuple[tuple[str, float], ...]]] = []
        for zone in zone_dirs:
            try:
                name = zone_name(read_text(root, f"{zone}/type"))
            except OSError:
                continue
            self.zones.append((name, f"{zone}/temp", self._trips(zone)))

    def _trips(self, zone: str) -> tuple[tuple[str, float], ...]:
        trips = []
        index = 0
        while True:
            try:
                trip_type = read_text(self.root, f"{zone}/trip_point_{index}_type")
            except OSError:
                break  # no more trips
            index += 1
            if trip_type not in LIMIT_TRIPS:
                continue
            try:
                trip_c = read_int(self.root, f"{zone}/trip_point_{index - 1}_temp") / 1000.0
            except (OSError, ValueError):
                continue
            if trip_c > OFFLINE_BELOW_C:
                trips.append((trip_type, trip_c))
        return tuple(trips)

    def read(self) -> tuple[ThermalZone, ...]:
        zones = []
        for name, temp_path, trips in self.zones:
            try:
                temp_c: float | None = read_int(self.root, temp_path) / 1000.0
            except (OSError, ValueError):
                temp_c = None
            if temp_c is not None and temp_c <= OFFLINE_BELOW_C:
                temp_c = None  # -256 °C: the driver's "no reading", not a temperature
            zones.append(ThermalZone(name=name, temp_c=temp_c, trips_c=trips))
        return tuple(zones)
