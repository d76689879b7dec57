"""Finding a board's control and sensor files under a root, the way jetson-stats does.

Nothing here hard-codes a JetPack release's paths: the GPU is the ``sys/class/devfreq`` entry (a
symlink) whose ``device/of_node/name`` is a Tegra GPU's (``gpu`` on r36+, ``ga10b`` on r35 Orin,
``gv11b`` on Xavier), the CPU clusters are ``cpufreq/policyN``, the power monitors are the I2C
devices named ``ina3221`` (``ina3221x`` on JetPack 4, whose rails are iio channels), the fan the
hwmon named ``pwmfan``. Each group's class
(``power/sysfs/*.py``) is built from what :func:`discover` found; anything missing is ``None``
(or empty) and the board says so in its capabilities.

All paths in :class:`BoardPaths` are relative to the root, with ``/`` separators.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from power.io import read_text

GPU_NODE_NAMES = frozenset({"gpu", "ga10b", "gv11b", "gp10b"})
EMC_DIR = "sys/kernel/debug/bpmp/debug/clk/emc"
EMC_POSSIBLE_RATES = "sys/kernel/debug/bpmp/debug/emc/possible_rates"  # kHz
CPUFREQ_DIR = "sys/devices/system/cpu/cpufreq"
DEVFREQ_CLASS = "sys/class/devfreq"
THERMAL_CLASS = "sys/class/thermal"
HWMON_CLASS = "sys/class/hwmon"
I2C_DEVICES = "sys/bus/i2c/devices"
INA3221X_DRIVER = "sys/bus/i2c/drivers/ina3221x"  # JetPack 4's INA3221 driver
DEVICE_TREE = ("proc/device-tree", "sys/firmware/devicetree/base")
TEGRA_RELEASE = "etc/nv_tegra_release"
# The GPU's rail-gate delay (ms), in its device directory: nvgpu's own file, else runtime PM's.
# Where railgate_delay sits is an ASSUMPTION (power/sysfs/railgate.py says why).
RAILGATE_DELAY_FILES = ("railgate_delay", "power/autosuspend_delay_ms")


@dataclass(frozen=True, kw_only=True)
class GpuPaths:
    freq_dir: str  # devfreq: min_freq, max_freq, cur_freq, available_frequencies (Hz)
    device_dir: str  # load (per-mille), railgate_enable, power/runtime_status
    table_hz: tuple[int, ...]
    railgate_file: str | None  # railgate_enable, else power/control, else None
    # railgate_delay (ms), else power/autosuspend_delay_ms, else None (power/sysfs/railgate.py)
    railgate_delay_file: str | None = None


@dataclass(frozen=True, kw_only=True)
class CpuPolicyPaths:
    path: str  # sys/devices/system/cpu/cpufreq/policyN
    table_khz: tuple[int, ...]
    table_borrowed: bool = False  # unreadable (an inactive policy): another cluster's table


@dataclass(frozen=True, kw_only=True)
class EmcPaths:
    path: str  # debugfs clk/emc: rate, min_rate, max_rate, mrq_rate_locked
    rates_hz: tuple[int, ...]  # from possible_rates (kHz there); empty: unknown, cannot lock


@dataclass(frozen=True, kw_only=True)
class BoardPaths:
    gpu: GpuPaths | None
    cpu: tuple[CpuPolicyPaths, ...]
    emc: EmcPaths | None
    thermal_zones: tuple[str, ...]  # sys/class/thermal/thermal_zoneN, in N order
    power_monitors: tuple[str, ...]  # each INA3221's hwmon (or JetPack 4 iio:device) directory
    fan_pwm: str | None  # the pwmfan hwmon directory (pwm1, pwm1_enable)
    fan_tach: str | None  # the pwm_tach hwmon directory (rpm)


def _rel(root: Path, path: str) -> str | None:
    """``path`` resolved through its symlinks, relative to ``root``; None if it leaves the root."""
    real = os.path.realpath(root / path)
    base = os.path.realpath(root)
    if real != base and not real.startswith(base + os.sep):
        return None
    return os.path.relpath(real, base).replace(os.sep, "/")


def _entries(root: Path, folder: str) -> list[str]:
    try:
        return sorted(os.listdir(root / folder))
    except OSError:
        return []


def _numbered(names: list[str], prefix: str) -> list[str]:
    return sorted((name for name in names if name.startswith(prefix)
                   and name[len(prefix):].isdigit()), key=lambda name: int(name[len(prefix):]))


def _ints(root: Path, relpath: str, scale: int = 1) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(word) * scale for word in read_text(root, relpath).split()}))
    except (OSError, ValueError):
        return ()


def find_gpu(root: Path) -> GpuPaths | None:
    for name in _entries(root, DEVFREQ_CLASS):
        entry = f"{DEVFREQ_CLASS}/{name}"
        # jtop keeps only symlinks here; a plain directory is not a devfreq device [JS-gpu].
        if not os.path.islink(root / entry):
            continue
        try:
            node = read_text(root, f"{entry}/device/of_node/name")
        except OSError:
            continue
        if node not in GPU_NODE_NAMES:
            continue
        freq_dir, device_dir = _rel(root, entry), _rel(root, f"{entry}/device")
        if freq_dir is None or device_dir is None:
            continue
        railgate: str | None = None
        for candidate in ("railgate_enable", "power/control"):
            if os.path.isfile(root / device_dir / candidate):
                railgate = f"{device_dir}/{candidate}"
                break
        delay: str | None = None
        for candidate in RAILGATE_DELAY_FILES:
            if os.path.isfile(root / device_dir / candidate):
                delay = f"{device_dir}/{candidate}"
                break
        return GpuPaths(freq_dir=freq_dir, device_dir=device_dir,
                        table_hz=_ints(root, f"{freq_dir}/available_frequencies"),
                        railgate_file=railgate, railgate_delay_file=delay)
    return None


def find_cpu(root: Path) -> tuple[CpuPolicyPaths, ...]:
    policies = []
    for name in _numbered(_entries(root, CPUFREQ_DIR), "policy"):
        path = f"{CPUFREQ_DIR}/{name}"
        table = _ints(root, f"{path}/scaling_available_frequencies")
        if not table:  # a driver without a table: the cpuinfo range bounds the writes
            table = _ints(root, f"{path}/cpuinfo_min_freq") + _ints(root,
                                                                     f"{path}/cpuinfo_max_freq")
        policies.append(CpuPolicyPaths(path=path, table_khz=tuple(sorted(set(table)))))
    # A policy whose CPUs are all offline (AGX Orin's MODE_15W/30W) answers EBUSY to reads too,
    # so its table is unknown until a mode brings a CPU back. Jetson clusters share one ladder
    # (Orin's A78AE, Xavier's Carmel): it takes the first readable cluster's, so its limits are
    # checked against a table, and a helper's rules cover it, once nvpmodel onlines it.
    known = next((policy.table_khz for policy in policies if policy.table_khz), ())
    return tuple(CpuPolicyPaths(path=policy.path, table_khz=known, table_borrowed=True)
                 if not policy.table_khz and known else policy for policy in policies)


def find_emc(root: Path) -> EmcPaths | None:
    if not os.path.isfile(root / EMC_DIR / "rate"):
        return None  # debugfs is root-only and may not be mounted: EMC cannot be locked
    return EmcPaths(path=EMC_DIR, rates_hz=_ints(root, EMC_POSSIBLE_RATES, scale=1000))


def find_power_monitors(root: Path) -> tuple[str, ...]:
    """Each INA3221's directory: the first child of its ``hwmon/`` (JetPack 5 and later; jtop
    takes the first [JS-pow]), else its ``iio:device<k>`` children (JetPack 4's ``ina3221x``
    driver, whose I2C device is also listed under ``sys/bus/i2c/drivers/ina3221x``)."""
    found: list[str] = []
    devices = [f"{I2C_DEVICES}/{name}" for name in _entries(root, I2C_DEVICES)]
    devices += [f"{INA3221X_DRIVER}/{name}" for name in _entries(root, INA3221X_DRIVER)
                if "-" in name]
    for device in devices:
        try:
            if "ina3221" not in read_text(root, f"{device}/name"):
                continue
        except OSError:
            continue
        children = _entries(root, f"{device}/hwmon")
        candidates = [f"{device}/hwmon/{children[0]}"] if children else [
            f"{device}/{name}" for name in _numbered(_entries(root, device), "iio:device")]
        for candidate in candidates:
            monitor = _rel(root, candidate)
            if monitor is not None and monitor not in found:
                found.append(monitor)
    return tuple(found)


def find_hwmon(root: Path, wanted: str) -> str | None:
    for name in _numbered(_entries(root, HWMON_CLASS), "hwmon"):
        try:
            if read_text(root, f"{HWMON_CLASS}/{name}/name") == wanted:
                return _rel(root, f"{HWMON_CLASS}/{name}")
        except OSError:
            continue
    return None


def discover(root: Path) -> BoardPaths:
    root = Path(root)
    zones = tuple(f"{THERMAL_CLASS}/{name}"
                  for name in _numbered(_entries(root, THERMAL_CLASS), "thermal_zone"))
    return BoardPaths(gpu=find_gpu(root), cpu=find_cpu(root), emc=find_emc(root),
                      thermal_zones=zones, power_monitors=find_power_monitors(root),
                      fan_pwm=find_hwmon(root, "pwmfan"), fan_tach=find_hwmon(root, "pwm_tach"))


def read_device_tree(root: Path, name: str) -> tuple[str, ...]:
    """A device-tree property's NUL-separated strings (``compatible``), or () when absent."""
    for base in DEVICE_TREE:
        try:
            with open(Path(root) / base / name, "rb") as handle:
                data = handle.read(4096)
        except OSError:
            continue
        return tuple(part for part in data.decode("utf-8", "replace").split("\0") if part)
    return ()


__all__ = ["BoardPaths", "CpuPolicyPaths", "EmcPaths", "GpuPaths", "discover",
           "read_device_tree"]
