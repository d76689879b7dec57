"""Writes a fake Jetson board's files under a directory, laid out as the real board's are.

``write_tree(tmp_path, profile("orin-nano"), jetpack=6)`` makes the device tree, the
``/etc/nv_tegra_release`` line, the nvpmodel configuration and status, cpufreq policies with their
per-CPU symlinks, the GPU's devfreq directory behind its ``sys/class/devfreq`` symlink, the EMC's
debugfs files, the thermal zones (the Orin Nano's cv zones unreadable), the INA3221 monitors, the
fan and the sleep files: the layout of ``docs/reference/jetson_sysfs_layout.md``, in the variant of
the JetPack release asked for:

- JetPack 4 (r32, kernel 4.9, Xavier only): ``sys/devices/17000000.gv11b``; the kernel refuses a
  minimum above the maximum (``EINVAL``) -- see ``power/sim/kernel.py``; the INA3221 rails are
  the ``ina3221x`` driver's iio channels, not hwmon.
- JetPack 5 (r35, kernel 5.10): ``sys/devices/17000000.ga10b`` (Orin) or ``.gv11b`` (Xavier),
  ``CPU-therm``-style zone names; limits clamp instead of failing.
- JetPack 6 (r36, kernel 5.15): ``sys/devices/platform/bus@0/17000000.gpu``, ``cpu-thermal``-style
  names.
- JetPack 7 (r38+ on Orin): the GPU at ``sys/devices/platform/17000000.gpu``, no
  ``enable_3d_scaling`` (3D scaling is the governor choice there [JS867]) and no
  ``railgate_enable`` or ``railgate_delay`` (rail-gating through ``power/control``, its delay
  in ``power/autosuspend_delay_ms``), the EMC cap at
  ``sys/kernel/nvpmodel_clk_cap/emc``. The JetPack 7 paths are UNCONFIRMED [U]; they exercise a
  layout unlike the others, which is what the board layer's discovery must cope with.

The files hold the state of the board's nvpmodel mode at boot (its caps, its cores online, the
podgov and schedutil governors). The returned :class:`FakeTree` names the paths the simulator
drives (``cur_freq``, ``load``, temperatures, rail readings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import PowerError
from power.profiles import BoardProfile

DEFAULT_TRIPS_C: tuple[tuple[str, float], ...] = (("passive", 99.0), ("critical", 104.5))
"""Trip points written into every zone: clearly fake (the real ones are UNCONFIRMED); tests give
their own."""
RAILGATE_DELAY_MS = 500  # ga10b's default autosuspend delay [NVGPU]


@dataclass(frozen=True, kw_only=True)
class TreeLayout:
    """Where one JetPack release puts the files that differ between releases."""

    jetpack: int
    release: str  # /etc/nv_tegra_release's first line, after "# "
    gpu_device: str
    gpu_node: str  # of_node/name
    gpu_alias: str | None  # the gpu.0 symlink
    thermal_types: tuple[str, ...]
    enable_3d_scaling: bool
    railgate_enable: bool
    emc_cap: str


_ORIN_ZONES_R36 = ("cpu-thermal", "gpu-thermal", "cv0-thermal", "cv1-thermal", "cv2-thermal",
                   "soc0-thermal", "soc1-thermal", "soc2-thermal", "tj-thermal")
_ORIN_ZONES_R35 = ("CPU-therm", "GPU-therm", "CV0-therm", "CV1-therm", "CV2-therm", "SOC0-therm",
                   "SOC1-therm", "SOC2-therm", "tj-therm")
_XAVIER_ZONES = ("CPU-therm", "GPU-therm", "AUX-therm", "AO-therm", "PMIC-Die",
                 "thermal-fan-est")  # [I]


def layout_for(board: BoardProfile, jetpack: int) -> TreeLayout:
    if jetpack not in board.jetpacks:
        raise PowerError("this board does not run that JetPack release", board=board.name,
                         jetpack=jetpack, supported=", ".join(map(str, board.jetpacks)))
    if board.soc == "tegra194":
        release = "R32 (release), REVISION: 7.4" if jetpack == 4 else "R35 (release), REVISION: 5.0"
        return TreeLayout(jetpack=jetpack, release=release, gpu_device="sys/devices/17000000.gv11b",
                          gpu_node="gv11b", gpu_alias="sys/devices/gpu.0",
                          thermal_types=_XAVIER_ZONES, enable_3d_scaling=True,
                          railgate_enable=True, emc_cap="sys/kernel/nvpmodel_emc_cap/emc_iso_cap")
    if jetpack == 5:
        return TreeLayout(jetpack=5, release="R35 (release), REVISION: 4.1",
                          gpu_device="sys/devices/17000000.ga10b", gpu_node="ga10b",
                          gpu_alias="sys/devices/gpu.0", thermal_types=_ORIN_ZONES_R35,
                          enable_3d_scaling=True, railgate_enable=True,
                          emc_cap="sys/kernel/nvpmodel_emc_cap/emc_iso_cap")
    if jetpack == 6:
        return TreeLayout(jetpack=6, release="R36 (release), REVISION: 4.3",
                          gpu_device="sys/devices/platform/bus@0/17000000.gpu", gpu_node="gpu",
                          gpu_alias="sys/devices/platform/gpu.0", thermal_types=_ORIN_ZONES_R36,
                          enable_3d_scaling=True, railgate_enable=True,
                          emc_cap="sys/kernel/nvpmodel_emc_cap/emc_iso_cap")
    return TreeLayout(jetpack=jetpack, release="R38 (release), REVISION: 2.0",
                      gpu_device="sys/devices/platform/17000000.gpu", gpu_node="gpu",
                      gpu_alias=None, thermal_types=_ORIN_ZONES_R36, enable_3d_scaling=False,
                      railgate_enable=False, emc_cap="sys/kernel/nvpmodel_clk_cap/emc")


@dataclass(frozen=True, kw_only=True)
class FakeTree:
    """A written fake board: its root and the paths (relative to it) a simulator drives."""

    root: Path
    board: BoardProfile
    layout: TreeLayout
    gpu_freq_dir: str
    gpu_device_dir: str
    policies: tuple[str, ...]
    emc_dir: str | None
    zones: dict[str, str]  # zone type -> its directory (the real one, not the class link)
    # rail label -> (its monitor's directory, channel): a hwmon directory and its 1-based inN_*
    # channel, or on JetPack 4 an ina3221x iio:device directory and its 0-based rail_name_N.
    rails: dict[str, tuple[str, int]]
    fan_pwm: str | None
    unreadable_zones: tuple[str, ...] = field(default=())

    def set(self, relpath: str, value: int | str) -> None:
        """Change a file as the hardware would (a new cur_freq, a temperature): not a write the
        board layer makes, so it goes around the writer."""
        (self.root / relpath).write_text(f"{value}\n")

    def get(self, relpath: str) -> str:
        return (self.root / relpath).read_text().strip()


def _put(root: Path, relpath: str, value: int | str, *, nul: bool = False) -> None:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\0" if nul else f"{value}\n")


def _link(root: Path, relpath: str, target_relpath: str) -> None:
    """A symlink at ``relpath`` to ``target_relpath`` (both under root), written relative as the
    kernel's are, so the tree can be moved."""
    link = root / relpath
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (root / target_relpath).exists():
        (root / target_relpath).mkdir(parents=True)
    os.symlink(os.path.relpath(root / target_relpath, link.parent), link)


def render_nvpmodel_conf(board: BoardProfile, layout: TreeLayout, gpu_freq_dir: str) -> str:
    """An nvpmodel configuration in the tool's grammar for ``board``'s modes (PARAM sections with
    this layout's paths, one POWER_MODEL block per mode, PM_CONFIG)."""
    cluster = "CPU_A78" if board.soc == "tegra234" else "CPU_DENVER"
    lines = ["< PARAM TYPE=FILE NAME=CPU_ONLINE >"]
    lines += [f"CORE_{cpu} /sys/devices/system/cpu/cpu{cpu}/online" for cpu in range(board.cpus)]
    for index, cpus in enumerate(board.cpu_policies):
        policy = f"/sys/devices/system/cpu/cpu{cpus[0]}/cpufreq"
        lines += [f"< PARAM TYPE=CLOCK NAME={cluster}_{index} >",
                  f"FREQ_TABLE {policy}/scaling_available_frequencies",
                  f"MAX_FREQ {policy}/scaling_max_freq", f"MIN_FREQ {policy}/scaling_min_freq"]
    lines += ["< PARAM TYPE=CLOCK NAME=GPU >",
              f"FREQ_TABLE /{gpu_freq_dir}/available_frequencies",
              f"MAX_FREQ /{gpu_freq_dir}/max_freq", f"MIN_FREQ /{gpu_freq_dir}/min_freq",
              "< PARAM TYPE=CLOCK NAME=EMC >", f"MAX_FREQ /{layout.emc_cap}", ""]
    for mode in board.modes:
        lines.append(f"< POWER_MODEL ID={mode.mode_id} NAME={mode.name} >")
        online = mode.cpus_online or board.cpus
        lines += [f"CPU_ONLINE CORE_{cpu} {1 if cpu < online else 0}" for cpu in range(board.cpus)]
        for index, _ in enumerate(board.cpu_policies):
            lines.append(f"{cluster}_{index} MIN_FREQ {board.cpu_floor_khz}")
            lines.append(f"{cluster}_{index} MAX_FREQ {mode.cpu_max_khz or -1}")
        lines += ["GPU MIN_FREQ 0", f"GPU MAX_FREQ {mode.gpu_max_hz or -1}",
                  f"EMC MAX_FREQ {mode.emc_max_hz or 0}", ""]
    lines.append(f"< PM_CONFIG DEFAULT={board.default_mode} >")
    return "\n".join(lines) + "\n"


def _rail_reading(label: str) -> tuple[int, int]:
    """(mV, mA) an idle board could show on a rail [I]."""
    if label == "NC":
        return 0, 0
    if label in {"VDD_IN", "VIN_SYS_5V0", "SYS5V"}:
        return 4960, 968
    if "1V8" in label:
        return 1800, 341
    return 4960 if label in {"VDD_CPU_GPU_CV", "VDD_SOC"} else 800, 250


def _write_ina3221x(root: Path, board: BoardProfile) -> dict[str, tuple[str, int]]:
    """JetPack 4's INA3221 layout (NVIDIA's ``ina3221x`` iio driver): per monitor an
    ``iio:device<k>`` directory under the I2C device, with ``rail_name_N``,
    ``in_voltageN_input`` (mV), ``in_currentN_input`` (mA), ``in_powerN_input`` (mW) and the
    ``warn_``/``crit_current_limit_N`` (mA) for N = 0..2 (the profile's channel 1..3), the device
    also listed under ``sys/bus/i2c/drivers/ina3221x``. File names and units: jetson-stats'
    JetPack 4 reader and AGX Xavier r32 scripts (power/sysfs/rails.py); the platform path of
    the I2C bus and the limit values are [I]. Returns each rail's (iio directory, N)."""
    rails: dict[str, tuple[str, int]] = {}
    for index, i2c in enumerate(dict.fromkeys(rail.i2c for rail in board.rails)):
        bus = i2c.split("-")[0]
        device_path = f"sys/devices/c240000.i2c/i2c-{bus}/{i2c}"
        iio = f"{device_path}/iio:device{index}"
        _put(root, f"{device_path}/name", "ina3221x")
        _put(root, f"{iio}/name", "ina3221x")
        _link(root, f"sys/bus/i2c/devices/{i2c}", device_path)
        _link(root, f"sys/bus/i2c/drivers/ina3221x/{i2c}", device_path)
        _link(root, f"sys/bus/iio/devices/iio:device{index}", iio)
        for rail in (r for r in board.rails if r.i2c == i2c):
            volt_mv, curr_ma = _rail_reading(rail.label)
            number = rail.channel - 1
            _put(root, f"{iio}/rail_name_{number}", rail.label)
            _put(root, f"{iio}/in_voltage{number}_input", volt_mv)
            _put(root, f"{iio}/in_current{number}_input", curr_ma)
            _put(root, f"{iio}/in_power{number}_input", volt_mv * curr_ma // 1000)
            _put(root, f"{iio}/warn_current_limit_{number}", 4000)
            _put(root, f"{iio}/crit_current_limit_{number}", 5000)
            if rail.label != "NC":
                rails[rail.label] = (iio, number)
    return rails


def write_tree(root: Path, board: BoardProfile, jetpack: int = 6, *, mode_id: int | None = None,
               debugfs: bool = True, trips_c: tuple[tuple[str, float], ...] = DEFAULT_TRIPS_C,
               temp_c: float = 48.0) -> FakeTree:
    """Write ``board``'s files under ``root`` as JetPack ``jetpack`` lays them out, in nvpmodel
    mode ``mode_id`` (default: the board's default). ``debugfs=False``: no EMC control files (a
    board where debugfs is not mounted or not readable)."""
    root = Path(root)
    layout = layout_for(board, jetpack)
    mode = board.mode(board.default_mode if mode_id is None else mode_id)

    # Identity.
    base = "sys/firmware/devicetree/base"
    _put(root, f"{base}/model", board.model, nul=True)
    (root / base / "compatible").write_bytes("".join(f"{c}\0" for c in board.compatible).encode())
    _put(root, f"{base}/serial-number", "1421224012345", nul=True)
    _link(root, "proc/device-tree", base)
    _put(root, "etc/nv_tegra_release",
         f"# {layout.release}, GCID: 38968081, BOARD: generic, EABI: aarch64, "
         "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n"
         "TARGET_USERSPACE_LIB_DIR=nvidia\n"
         "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia")

    # CPU.
    cpu_dir = "sys/devices/system/cpu"
    online = mode.cpus_online or board.cpus
    cpu_max = mode.cpu_max_khz or board.cpu_khz[-1]
    # nvpmodel's floor never above the mode's cap (an inverted pair no kernel shows); 5.10+
    # show it resolved to a table entry (the lowest at or above it: Xavier's 1200000 floor
    # reads 1267200 there), 4.9 as written.
    cpu_min = min(board.cpu_floor_khz, cpu_max)
    if layout.jetpack >= 5:
        cpu_min = min([khz for khz in board.cpu_khz if khz >= cpu_min] + [cpu_max])
    _put(root, f"{cpu_dir}/online", f"0-{online - 1}")
    for name in ("present", "possible"):
        _put(root, f"{cpu_dir}/{name}", f"0-{board.cpus - 1}")
    policies = []
    for cpus in board.cpu_policies:
        policy = f"{cpu_dir}/cpufreq/policy{cpus[0]}"
        policies.append(policy)
        for name, value in (
                ("scaling_governor", "schedutil"),
                ("scaling_available_governors",
                 "conservative ondemand userspace powersave performance schedutil"),
                ("scaling_driver", "tegra194"),
                ("scaling_min_freq", cpu_min),
                ("scaling_max_freq", cpu_max),
                ("scaling_cur_freq", cpu_max),
                ("cpuinfo_cur_freq", cpu_max),
                ("cpuinfo_min_freq", board.cpu_khz[0]),
                ("cpuinfo_max_freq", board.cpu_khz[-1]),
                ("scaling_available_frequencies", " ".join(map(str, board.cpu_khz))),
                ("related_cpus", " ".join(map(str, cpus))),
                ("affected_cpus", " ".join(map(str, cpus))),
                ("scaling_setspeed", "<unsupported>")):
            _put(root, f"{policy}/{name}", value)
        for cpu in cpus:
            _put(root, f"{cpu_dir}/cpu{cpu}/online", 1 if cpu < online else 0)
            _link(root, f"{cpu_dir}/cpu{cpu}/cpufreq", policy)
            for state, idle_name in enumerate(("WFI", "c7")):
                _put(root, f"{cpu_dir}/cpu{cpu}/cpuidle/state{state}/name", idle_name)
                _put(root, f"{cpu_dir}/cpu{cpu}/cpuidle/state{state}/disable", 0)

    # GPU.
    device = layout.gpu_device
    node = device.rsplit("/", 1)[1]
    freq_dir = f"{device}/devfreq/{node}"
    gpu_max = mode.gpu_max_hz or board.gpu_hz[-1]
    for name, value in (
            ("cur_freq", board.gpu_hz[0]), ("target_freq", board.gpu_hz[0]),
            ("min_freq", board.gpu_hz[0]), ("max_freq", gpu_max),
            ("available_frequencies", " ".join(map(str, board.gpu_hz))),
            ("governor", "nvhost_podgov"),
            ("available_governors", "nvhost_podgov userspace performance simple_ondemand"),
            ("polling_interval", 25)):
        _put(root, f"{freq_dir}/{name}", value)
    _link(root, f"{freq_dir}/device", device)
    _link(root, f"sys/class/devfreq/{node}", freq_dir)
    _put(root, f"{device}/of_node/name", layout.gpu_node, nul=True)
    _put(root, f"{device}/load", 0)
    _put(root, f"{device}/tpc_pg_mask", 0)
    _put(root, f"{device}/power/control", "auto")
    _put(root, f"{device}/power/runtime_status", "suspended")
    # Runtime PM's autosuspend delay, and nvgpu's railgate_delay beside railgate_enable: both
    # 500 ms, ga10b's default [NVGPU]. Their place is an ASSUMPTION (power/sysfs/railgate.py).
    _put(root, f"{device}/power/autosuspend_delay_ms", RAILGATE_DELAY_MS)
    if layout.railgate_enable:
        _put(root, f"{device}/railgate_enable", 1)
        _put(root, f"{device}/railgate_delay", RAILGATE_DELAY_MS)
    if layout.enable_3d_scaling:
        _put(root, f"{device}/enable_3d_scaling", 1)
    if layout.gpu_alias is not None:
        _link(root, layout.gpu_alias, device)

    # EMC.
    emc_cap = mode.emc_max_hz or 0
    _put(root, layout.emc_cap, emc_cap)
    emc_dir: str | None = None
    if debugfs:
        emc_dir = "sys/kernel/debug/bpmp/debug/clk/emc"
        for name, value in (("rate", emc_cap or board.emc_hz[-1]), ("min_rate", board.emc_hz[0]),
                            ("max_rate", board.emc_hz[-1]), ("mrq_rate_locked", 0),
                            ("state", 1)):
            _put(root, f"{emc_dir}/{name}", value)
        _put(root, "sys/kernel/debug/bpmp/debug/emc/possible_rates",
             " ".join(str(hz // 1000) for hz in board.emc_hz))
    _put(root, "sys/kernel/actmon_avg_activity/mc_all", 0)

    # Power monitors, then the fan (hwmon0 pwmfan first, as on the Orin Nano devkit).
    hwmon_index = 1 if board.fan else 0
    rails: dict[str, tuple[str, int]] = {}
    if layout.jetpack == 4:
        rails = _write_ina3221x(root, board)
    for i2c in dict.fromkeys(rail.i2c for rail in board.rails) if layout.jetpack > 4 else ():
        bus = i2c.split("-")[0]
        device_path = f"sys/devices/platform/bus@0/c240000.i2c/i2c-{bus}/{i2c}"
        hwmon = f"{device_path}/hwmon/hwmon{hwmon_index}"
        _put(root, f"{device_path}/name", "ina3221")
        _put(root, f"{hwmon}/name", "ina3221")
        _link(root, f"sys/bus/i2c/devices/{i2c}", device_path)
        _link(root, f"sys/class/hwmon/hwmon{hwmon_index}", hwmon)
        for rail in (r for r in board.rails if r.i2c == i2c):
            volt_mv, curr_ma = _rail_reading(rail.label)
            channel = rail.channel
            _put(root, f"{hwmon}/in{channel}_label", rail.label)
            _put(root, f"{hwmon}/in{channel}_input", volt_mv)
            _put(root, f"{hwmon}/curr{channel}_input", curr_ma)
            _put(root, f"{hwmon}/shunt{channel}_resistor", rail.shunt_uohm)
            _put(root, f"{hwmon}/in{channel + 3}_input", curr_ma * rail.shunt_uohm // 1000)
            _put(root, f"{hwmon}/curr{channel}_max", 4000)
            _put(root, f"{hwmon}/curr{channel}_crit", 5000)
            if rail.label != "NC":
                rails[rail.label] = (hwmon, channel)
        _put(root, f"{hwmon}/in7_label", "sum of shunt voltages")
        _put(root, f"{hwmon}/in7_input", 0)
        _put(root, f"{hwmon}/samples", 512)
        hwmon_index += 1
    fan_pwm: str | None = None
    if board.fan:
        fan_pwm = "sys/devices/platform/pwm-fan/hwmon/hwmon0"
        _put(root, f"{fan_pwm}/name", "pwmfan")
        _put(root, f"{fan_pwm}/pwm1", 62)
        _put(root, f"{fan_pwm}/pwm1_enable", 1)
        _link(root, "sys/class/hwmon/hwmon0", fan_pwm)
        tach = f"sys/devices/platform/pwm-tach/hwmon/hwmon{hwmon_index}"
        _put(root, f"{tach}/name", "pwm_tach")
        _put(root, f"{tach}/rpm", 1636)
        _link(root, f"sys/class/hwmon/hwmon{hwmon_index}", tach)

    # Thermal zones; on the Orin Nano and NX the cv zones cannot be read (EAGAIN). A directory in
    # place of the file makes any read fail, even for root (a chmod 000 file would not).
    zones: dict[str, str] = {}
    unreadable = []
    cv_readable = board.name.startswith("agx-")
    for index, zone_type in enumerate(layout.thermal_types):
        zone = f"sys/devices/virtual/thermal/thermal_zone{index}"
        zones[zone_type] = zone
        _put(root, f"{zone}/type", zone_type)
        if zone_type.lower().startswith("cv") and not cv_readable:
            (root / zone / "temp").mkdir(parents=True)
            unreadable.append(zone_type)
        else:
            _put(root, f"{zone}/temp", int(temp_c * 1000))
        _put(root, f"{zone}/mode", "enabled")
        _put(root, f"{zone}/policy", "step_wise")
        for trip, (trip_type, trip_c) in enumerate(trips_c):
            _put(root, f"{zone}/trip_point_{trip}_type", trip_type)
            _put(root, f"{zone}/trip_point_{trip}_temp", int(trip_c * 1000))
        _link(root, f"sys/class/thermal/thermal_zone{index}", zone)

    # nvpmodel's configuration and state; sleep.
    _put(root, f"etc/nvpmodel/{board.nvpmodel_conf}",
         render_nvpmodel_conf(board, layout, freq_dir))
    _link(root, "etc/nvpmodel.conf", f"etc/nvpmodel/{board.nvpmodel_conf}")
    _put(root, "var/lib/nvpmodel/status", f"pmode:{mode.mode_id:04d} fmode:fan_mode_quiet")
    _put(root, "sys/power/mem_sleep", "s2idle [deep]")
    _put(root, "sys/power/state", "freeze mem")

    return FakeTree(root=root, board=board, layout=layout, gpu_freq_dir=freq_dir,
                    gpu_device_dir=device, policies=tuple(policies), emc_dir=emc_dir,
                    zones=zones, rails=rails, fan_pwm=fan_pwm, unreadable_zones=tuple(unreadable))


__all__ = ["DEFAULT_TRIPS_C", "RAILGATE_DELAY_MS", "FakeTree", "TreeLayout", "layout_for", "render_nvpmodel_conf",
           "write_tree"]
