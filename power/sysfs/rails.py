"""INA3221 power monitors: each labelled channel's power in mW.

Two layouts, the same answers (a rail's label to its power in mW):

- **hwmon** (JetPack 5 and later, the upstream ``ina3221`` driver): ``inN_label``, the bus
  voltage ``inN_input`` (mV) and ``currN_input`` (mA) for N = 1..3; the power is
  mV x mA / 1000, as jetson-stats computes it [jetson_power.md §5, K-INA].
- **iio** (JetPack 4, NVIDIA's ``ina3221x`` driver, under ``iio:device<k>/`` of the I2C device,
  also reached as ``/sys/bus/i2c/drivers/ina3221x/<bus-addr>/``): ``rail_name_N``,
  ``in_voltageN_input`` (mV), ``in_currentN_input`` (mA) and ``in_powerN_input`` (mW) for
  N = 0..2. The power is the driver's own ``in_powerN_input``; where that file is absent when the
  channel is found, it is mV x mA / 1000 as for hwmon. These names and units are jetson-stats' JetPack 4 reader
  (``jtop/core/power.py``, the ``rail_name_`` branch) and scripts read on AGX Xavier r32
  (``.../ina3221x/1-0040/iio:device0/in_power1_input``); the shared reference
  (jetson_power.md §5) covers only the hwmon layout, so the iio one is UNCONFIRMED there.

The channels and their labels are read once; channels labelled ``NC`` (not connected) and the
shunt-sum channel 7 are skipped, as jetson-stats does. A labelled channel without the files its
power is read from is left out and named in :attr:`PowerRails.problems`; a channel whose files
cannot be read (or do not read as numbers) at a reading is missing from that reading and named
there too, until it reads again. Nothing here raises on a monitor's files.

The total is the rail that measures the module's input (``VDD_IN``, or ``POM_5V_IN`` on older
boards) where there is one, else the sum of the rails (AGX Orin and AGX Xavier: that sum misses
the carrier board's losses). A total that cannot be read is ``None``: the input rail unreadable
is not replaced by the sum of the rails it feeds, and a sum missing one of its rails is not a
total.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from power.io import read_int, read_text

log = logging.getLogger(__name__)

TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")
IIO_PREFIX = "iio:device"
RAIL_NAME_PREFIX = "rail_name_"


@dataclass(frozen=True, kw_only=True)
class RailChannel:
    """One monitor channel: where its label came from and the files its power is read from."""

    label: str
    volt_path: str  # bus voltage, mV
    curr_path: str  # current, mA
    power_path: str | None = None  # the driver's own power, mW (iio only)


def _not_connected(label: str) -> bool:
    return label == "NC" or "NC" in label.split()


def _hwmon_channels(root: Path, monitor: str) -> list[RailChannel]:
    channels = []
    for channel in (1, 2, 3):
        try:
            label = read_text(root, f"{monitor}/in{channel}_label")
        except OSError:
            continue
        if not _not_connected(label):
            channels.append(RailChannel(label=label, volt_path=f"{monitor}/in{channel}_input",
                                        curr_path=f"{monitor}/curr{channel}_input"))
    return channels


def _iio_channels(root: Path, monitor: str) -> list[RailChannel]:
    try:
        names = os.listdir(root / monitor)
    except OSError:
        return []
    numbers = sorted(int(name[len(RAIL_NAME_PREFIX):]) for name in names
                     if name.startswith(RAIL_NAME_PREFIX)
                     and name[len(RAIL_NAME_PREFIX):].isdigit())
    channels = []
    for number in numbers:
        try:
            label = read_text(root, f"{monitor}/{RAIL_NAME_PREFIX}{number}")
        except OSError:
            continue
        if not label or _not_connected(label):
            continue
        channels.append(RailChannel(label=label, volt_path=f"{monitor}/in_voltage{number}_input",
                                    curr_path=f"{monitor}/in_current{number}_input",
                                    power_path=f"{monitor}/in_power{number}_input"))
    return channels


def is_iio_monitor(monitor: str) -> bool:
    """Whether ``monitor`` (a directory from discovery) is a JetPack 4 ``ina3221x`` iio device."""
    return monitor.rsplit("/", 1)[-1].startswith(IIO_PREFIX)


class PowerRails:
    """The rails of every INA3221 under ``root`` (``monitors``: their hwmon or iio directories,
    relative to the root, from ``power/sysfs/discover.py``)."""

    def __init__(self, root: Path, monitors: tuple[str, ...]) -> None:
        self.root = root
        self.channels: list[RailChannel] = []
        self._missing: dict[str, str] = {}  # a channel left out at discovery: why
        self._unreadable: dict[str, str] = {}  # a channel the last reading could not read: why
        for monitor in monitors:
            found = (_iio_channels(root, monitor) if is_iio_monitor(monitor)
                     else _hwmon_channels(root, monitor))
            for channel in found:
                if channel.power_path is not None and \
                        not os.path.exists(root / channel.power_path):
                    # No power file from the driver (iio): mV x mA, as for hwmon.
                    channel = dataclasses.replace(channel, power_path=None)
                missing = [] if channel.power_path is not None else [
                    path for path in (channel.volt_path, channel.curr_path)
                    if not os.path.exists(root / path)]
                if missing:
                    self._missing[channel.label] = f"no {', '.join(missing)}"
                    log.warning("power rail %s left out: %s", channel.label,
                                self._missing[channel.label])
                else:
                    self.channels.append(channel)

    @property
    def labels(self) -> list[str]:
        return [channel.label for channel in self.channels]

    @property
    def problems(self) -> dict[str, str]:
        """Each rail that cannot be read (left out when found, or unreadable at the last
        reading), with why; empty when every labelled channel reads."""
        return {**self._missing, **self._unreadable}

    def _read_channel_mw(self, channel: RailChannel) -> int:
        # The power file where there was one when found: a read of it that fails is a problem
        # to report, not a reason to switch to another pair of files.
        if channel.power_path is not None:
            return read_int(self.root, channel.power_path)
        return read_int(self.root, channel.volt_path) * read_int(self.root,
                                                                 channel.curr_path) // 1000

    def read_mw(self) -> dict[str, int]:
        rails = {}
        for channel in self.channels:
            try:
                rails[channel.label] = self._read_channel_mw(channel)
            except (OSError, ValueError) as exc:
                files = channel.power_path or f"{channel.volt_path} or {channel.curr_path}"
                reason = (f"cannot read {files}: {exc.strerror or type(exc).__name__}"
                          if isinstance(exc, OSError) else str(exc))
                if self._unreadable.get(channel.label) != reason:
                    log.warning("power rail %s: %s (said once until it changes)", channel.label,
                                reason)
                self._unreadable[channel.label] = reason
                continue
            if self._unreadable.pop(channel.label, None) is not None:
                log.info("power rail %s reads again", channel.label)
        return rails

    def total_mw(self, rails: dict[str, int]) -> int | None:
        """The board's input power from one :meth:`read_mw` answer; ``None`` when unreadable."""
        labels = self.labels
        for label in TOTAL_RAILS:
            if label in labels:
                return rails.get(label)
            if label in self._missing:
                return None  # the input rail is there but cannot be read: no sum stands in
        if not labels or any(label not in rails for label in labels):
            return None
        return sum(rails[label] for label in labels)


__all__ = ["PowerRails", "RailChannel", "is_iio_monitor"]
