"""Board profiles: what each supported Jetson module is, offers and is called.

A :class:`BoardProfile` holds the facts the board layer cannot read reliably from the board itself
(the device-tree strings that identify it, the nvpmodel modes and their caps, the INA3221 rail
wiring) and the frequency tables the fake board tree (``power/sim/tree.py``) is written from. On a
real board the tables in the kernel's files win: :class:`~power.board.Board` reads them, and a
profile's tables are only the expectation a test or the simulator starts from.

Sources: ``docs/reference/jetson_power.md`` and ``jetson_sysfs_layout.md`` (tags there); values
marked [I] or [U] in those documents are illustrative, and so are the ones here that come from them.
Units as in the kernel's files: GPU and EMC in Hz, CPU in kHz, shunts in micro-ohms.

:func:`profile` looks a profile up by name or alias; ``orin-nano`` (the name the power benchmark
uses) is the Orin Nano 8GB with its super modes (JetPack 6.2+, MAXN_SUPER), see :data:`ALIASES`.
:func:`identify` picks the profile whose device-tree ``compatible`` matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.errors import PowerError


@dataclass(frozen=True, kw_only=True)
class NvpmodelMode:
    """One ``< POWER_MODEL ID=n NAME=s >`` block: its caps (``None``: uncapped) and cores online."""

    mode_id: int
    name: str
    cpu_max_khz: int | None = None
    gpu_max_hz: int | None = None
    emc_max_hz: int | None = None
    cpus_online: int | None = None  # None: every core


@dataclass(frozen=True, kw_only=True)
class Rail:
    """An INA3221 channel: ``label`` on channel ``channel`` (1..3) of the monitor at ``i2c``."""

    i2c: str  # the I2C device's name under /sys/bus/i2c/devices, "1-0040"
    channel: int
    label: str
    shunt_uohm: int


@dataclass(frozen=True, kw_only=True)
class BoardProfile:
    name: str
    description: str
    soc: str  # "tegra234" (Orin) or "tegra194" (Xavier)
    model: str  # /proc/device-tree/model as a devkit shows it
    compatible: tuple[str, ...]  # /proc/device-tree/compatible, most specific first
    gpu_hz: tuple[int, ...]
    cpu_khz: tuple[int, ...]
    cpu_policies: tuple[tuple[int, ...], ...]  # the CPUs of each cpufreq policy; policyN, N = first
    emc_hz: tuple[int, ...]  # rates BPMP accepts (debugfs possible_rates, which is in kHz)
    cpu_floor_khz: int  # nvpmodel's MIN_FREQ for the CPU clusters
    nvpmodel_conf: str  # /etc/nvpmodel/<this>
    modes: tuple[NvpmodelMode, ...]
    default_mode: int
    rails: tuple[Rail, ...]
    total_rail: str | None  # the rail that measures the module's input; None: sum the rails
    jetpacks: tuple[int, ...]  # the JetPack major versions this module runs
    super_modes: bool = False
    fan: bool = True
    aliases: tuple[str, ...] = field(default=())

    @property
    def cpus(self) -> int:
        return sum(len(cpus) for cpus in self.cpu_policies)

    def mode(self, mode_id: int) -> NvpmodelMode:
        for mode in self.modes:
            if mode.mode_id == mode_id:
                return mode
        raise PowerError("no such nvpmodel mode on this board", board=self.name, mode=mode_id,
                         modes=", ".join(f"{m.mode_id}={m.name}" for m in self.modes))


def _ladder(first_khz: int, step_khz: int, last_khz: int) -> tuple[int, ...]:
    return tuple(range(first_khz, last_khz + 1, step_khz))


# Orin's CPU ladder is 115.2 MHz then 76.8 MHz steps [FX]; each module ends on its own top entry.
_ORIN_CPU_STEPS = _ladder(115200, 76800, 2188800)


def _orin_cpu(top_khz: int) -> tuple[int, ...]:
    steps = tuple(khz for khz in _ORIN_CPU_STEPS if khz < top_khz)
    return steps + (top_khz,)


_NANO_NX_RAILS = tuple(Rail(i2c="1-0040", channel=channel, label=label, shunt_uohm=5000)
                       for channel, label in ((1, "VDD_IN"), (2, "VDD_CPU_GPU_CV"), (3, "VDD_SOC")))
_AGX_ORIN_RAILS = (
    Rail(i2c="1-0040", channel=1, label="VDD_GPU_SOC", shunt_uohm=2000),
    Rail(i2c="1-0040", channel=2, label="VDD_CPU_CV", shunt_uohm=2000),
    Rail(i2c="1-0040", channel=3, label="VIN_SYS_5V0", shunt_uohm=2000),
    Rail(i2c="1-0041", channel=1, label="NC", shunt_uohm=2000),
    Rail(i2c="1-0041", channel=2, label="VDDQ_VDD2_1V8AO", shunt_uohm=2000),
    Rail(i2c="1-0041", channel=3, label="NC", shunt_uohm=2000),
)
# Xavier's monitors sit on bus 7 (r32 device trees) [I].
_XAVIER_NX_RAILS = tuple(Rail(i2c="7-0040", channel=channel, label=label, shunt_uohm=5000)
                         for channel, label in ((1, "VDD_IN"), (2, "VDD_CPU_GPU_CV"),
                                                (3, "VDD_SOC")))
_AGX_XAVIER_RAILS = (
    Rail(i2c="1-0040", channel=1, label="GPU", shunt_uohm=5000),
    Rail(i2c="1-0040", channel=2, label="CPU", shunt_uohm=5000),
    Rail(i2c="1-0040", channel=3, label="SOC", shunt_uohm=5000),
    Rail(i2c="1-0041", channel=1, label="CV", shunt_uohm=5000),
    Rail(i2c="1-0041", channel=2, label="VDDRQ", shunt_uohm=5000),
    Rail(i2c="1-0041", channel=3, label="SYS5V", shunt_uohm=5000),
)

ORIN_NANO_8GB = BoardProfile(
    name="orin-nano-8gb",
    description="Jetson Orin Nano 8GB, original (non-super) configuration",
    soc="tegra234",
    model="NVIDIA Jetson Orin Nano Developer Kit",
    compatible=("nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"),
    gpu_hz=(306000000, 408000000, 510000000, 612000000, 624750000),
    cpu_khz=_orin_cpu(1510400),
    cpu_policies=((0, 1, 2, 3), (4, 5)),
    emc_hz=(204000000, 665600000, 2133000000),
    cpu_floor_khz=729600,
    nvpmodel_conf="nvpmodel_p3767_0003.conf",
    modes=(
        NvpmodelMode(mode_id=0, name="15W", cpu_max_khz=1510400, gpu_max_hz=624750000,
                     emc_max_hz=2133000000),
        # The non-super 7W keeps 4 cores [jetson_power.md]; its caps are [U].
        NvpmodelMode(mode_id=1, name="7W", cpu_max_khz=1113600, gpu_max_hz=408000000,
                     emc_max_hz=2133000000, cpus_online=4),
    ),
    default_mode=0,
    rails=_NANO_NX_RAILS,
    total_rail="VDD_IN",
    jetpacks=(5, 6, 7),
)

ORIN_NANO_SUPER = BoardProfile(
    name="orin-nano-super",
    description="Jetson Orin Nano 8GB with the super modes (JetPack 6.2+, MAXN_SUPER)",
    soc="tegra234",
    model="NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super",
    compatible=("nvidia,p3768-0000+p3767-0005-super", "nvidia,p3767-0005", "nvidia,tegra234"),
    gpu_hz=(306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000,
            1020000000),
    cpu_khz=_orin_cpu(1728000),
    cpu_policies=((0, 1, 2, 3), (4, 5)),
    emc_hz=(204000000, 665600000, 2133000000, 3199000000),
    cpu_floor_khz=729600,
    nvpmodel_conf="nvpmodel_p3767_0003_super.conf",
    modes=(
        NvpmodelMode(mode_id=0, name="15W", cpu_max_khz=1497600, gpu_max_hz=612000000,
                     emc_max_hz=2133000000),
        NvpmodelMode(mode_id=1, name="25W", cpu_max_khz=1344000, gpu_max_hz=918000000,
                     emc_max_hz=3199000000),
        NvpmodelMode(mode_id=2, name="MAXN_SUPER"),
        # 7W caps are UNCONFIRMED for the super configuration [jetson_sysfs_layout.md].
        NvpmodelMode(mode_id=3, name="7W", cpu_max_khz=960000, gpu_max_hz=408000000,
                     emc_max_hz=2133000000, cpus_online=4),
    ),
    default_mode=1,  # the devkit boots in 25W [power_anchors.md, ARK]
    rails=_NANO_NX_RAILS,
    total_rail="VDD_IN",
    jetpacks=(6, 7),
    super_modes=True,
    aliases=("orin-nano",),
)

ORIN_NX_16GB = BoardProfile(
    name="orin-nx-16gb",
    description="Jetson Orin NX 16GB",
    soc="tegra234",
    model="NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
    compatible=("nvidia,p3768-0000+p3767-0000", "nvidia,p3767-0000", "nvidia,tegra234"),
    gpu_hz=(306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000),
    cpu_khz=_orin_cpu(1984000),
    cpu_policies=((0, 1, 2, 3), (4, 5, 6, 7)),
    emc_hz=(204000000, 665600000, 2133000000, 3199000000),
    cpu_floor_khz=729600,
    nvpmodel_conf="nvpmodel_p3767_0000.conf",
    # IDs and names [FX, Seeed doc]; the caps are illustrative [I] (not in the references).
    modes=(
        NvpmodelMode(mode_id=0, name="MAXN"),
        NvpmodelMode(mode_id=1, name="10W", cpu_max_khz=1190400, gpu_max_hz=612000000,
                     emc_max_hz=2133000000, cpus_online=4),
        NvpmodelMode(mode_id=2, name="15W", cpu_max_khz=1497600, gpu_max_hz=612000000,
                     emc_max_hz=3199000000),
        NvpmodelMode(mode_id=3, name="25W", cpu_max_khz=1651200, gpu_max_hz=918000000),
    ),
    default_mode=2,
    rails=_NANO_NX_RAILS,
    total_rail="VDD_IN",
    jetpacks=(5, 6, 7),
)

AGX_ORIN_64GB = BoardProfile(
    name="agx-orin-64gb",
    description="Jetson AGX Orin 64GB",
    soc="tegra234",
    model="NVIDIA Jetson AGX Orin Developer Kit",
    compatible=("nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"),
    gpu_hz=(306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000,
            1020000000, 1122000000, 1224000000, 1300500000),
    cpu_khz=_orin_cpu(2201600),
    cpu_policies=((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)),
    emc_hz=(204000000, 665600000, 2133000000, 3199000000),
    cpu_floor_khz=729600,
    nvpmodel_conf="nvpmodel_p3701_0000.conf",
    modes=(
        # Caps from jtop's JetPack 5 emulator for the CPU; the GPU caps quoted for r35/r36 (the
        # emulator's are 420.75/624.75/828.75 MHz) are UNCONFIRMED [jetson_power.md].
        NvpmodelMode(mode_id=0, name="MAXN"),
        NvpmodelMode(mode_id=1, name="MODE_15W", cpu_max_khz=1113600, gpu_max_hz=408000000,
                     cpus_online=4),
        NvpmodelMode(mode_id=2, name="MODE_30W", cpu_max_khz=1728000, gpu_max_hz=612000000,
                     cpus_online=8),
        NvpmodelMode(mode_id=3, name="MODE_50W", cpu_max_khz=1497600, gpu_max_hz=816000000),
    ),
    default_mode=2,
    rails=_AGX_ORIN_RAILS,
    total_rail=None,  # no VDD_IN channel: the total is the sum (it misses carrier losses)
    jetpacks=(5, 6, 7),
)

XAVIER_NX = BoardProfile(
    name="xavier-nx",
    description="Jetson Xavier NX",
    soc="tegra194",
    model="NVIDIA Jetson Xavier NX Developer Kit",
    compatible=("nvidia,p3509-0000+p3668-0001", "nvidia,p3668-0001", "nvidia,tegra194"),
    gpu_hz=(114750000, 204000000, 306000000, 408000000, 510000000, 599250000, 701250000,
            752250000, 803250000, 854250000, 905250000, 956250000, 1007250000, 1058250000,
            1109250000),
    cpu_khz=_ladder(115200, 76800, 1881600) + (1907200,),
    cpu_policies=((0, 1), (2, 3), (4, 5)),
    emc_hz=(204000000, 665600000, 1065600000, 1331200000, 1600000000, 1866000000),
    cpu_floor_khz=1190400,
    nvpmodel_conf="nvpmodel_t194_p3668.conf",
    # Xavier NX's modes, tables and EMC rates are illustrative [I]: the references list only the
    # GPU table's span (114.75-1109.25 MHz, 15 steps) [FX].
    modes=(
        NvpmodelMode(mode_id=0, name="MODE_15W_2CORE", cpu_max_khz=1907200,
                     gpu_max_hz=1109250000, emc_max_hz=1600000000, cpus_online=2),
        NvpmodelMode(mode_id=1, name="MODE_15W_4CORE", cpu_max_khz=1420800,
                     gpu_max_hz=1109250000, emc_max_hz=1600000000, cpus_online=4),
        NvpmodelMode(mode_id=2, name="MODE_15W_6CORE", cpu_max_khz=1420800,
                     gpu_max_hz=1109250000, emc_max_hz=1600000000),
        NvpmodelMode(mode_id=3, name="MODE_10W_2CORE", cpu_max_khz=1497600,
                     gpu_max_hz=803250000, emc_max_hz=1600000000, cpus_online=2),
        NvpmodelMode(mode_id=4, name="MODE_10W_4CORE", cpu_max_khz=1190400,
                     gpu_max_hz=803250000, emc_max_hz=1600000000, cpus_online=4),
    ),
    default_mode=2,
    rails=_XAVIER_NX_RAILS,
    total_rail="VDD_IN",
    jetpacks=(4, 5),
)

AGX_XAVIER = BoardProfile(
    name="agx-xavier",
    description="Jetson AGX Xavier",
    soc="tegra194",
    model="Jetson-AGX",
    compatible=("nvidia,p2972-0000", "nvidia,p2888-0001", "nvidia,tegra194"),
    # 14 steps from 114.75 to 1377 MHz [XAV-TEST]; the steps between are [I].
    gpu_hz=(114750000, 216750000, 318750000, 420750000, 522750000, 624750000, 675750000,
            828750000, 905250000, 1032750000, 1198500000, 1236750000, 1338750000, 1377000000),
    cpu_khz=_ladder(115200, 76800, 2188800) + (2265600,),
    cpu_policies=((0, 1), (2, 3), (4, 5), (6, 7)),
    emc_hz=(204000000, 665600000, 1065600000, 1331200000, 1600000000, 2133000000),
    cpu_floor_khz=1200000,
    nvpmodel_conf="nvpmodel_t194.conf",
    # IDs, names and GPU/EMC caps [JS-nvp-emu]; the CPU caps and core counts are [I].
    modes=(
        NvpmodelMode(mode_id=0, name="MAXN"),
        NvpmodelMode(mode_id=1, name="MODE_10W", cpu_max_khz=1190400, gpu_max_hz=522750000,
                     emc_max_hz=1065600000, cpus_online=2),
        NvpmodelMode(mode_id=2, name="MODE_15W", cpu_max_khz=1190400, gpu_max_hz=675750000,
                     emc_max_hz=1331200000, cpus_online=4),
        NvpmodelMode(mode_id=3, name="MODE_30W_ALL", cpu_max_khz=1190400, gpu_max_hz=905250000,
                     emc_max_hz=1600000000),
    ),
    default_mode=2,
    rails=_AGX_XAVIER_RAILS,
    total_rail=None,
    jetpacks=(4, 5),
)

PROFILES: dict[str, BoardProfile] = {board.name: board for board in (
    ORIN_NANO_8GB, ORIN_NANO_SUPER, ORIN_NX_16GB, AGX_ORIN_64GB, XAVIER_NX, AGX_XAVIER)}

ALIASES: dict[str, str] = {alias: board.name for board in PROFILES.values()
                           for alias in board.aliases}
"""Short names to profiles. ``orin-nano`` is the Orin Nano 8GB *with* its super modes: the power
benchmark's ``--board orin-nano`` models the board as JetPack 6.2+ ships it."""


def profile(name: str) -> BoardProfile:
    """The profile called ``name`` (or an alias of it)."""
    found = PROFILES.get(ALIASES.get(name, name))
    if found is None:
        raise PowerError("unknown board profile", board=name,
                         known=", ".join(sorted([*PROFILES, *ALIASES])))
    return found


def identify(compatible: tuple[str, ...]) -> BoardProfile | None:
    """The profile whose most specific ``compatible`` entry is the board's first entry, else one
    sharing the module's entry (a carrier board other than the devkit's); ``None`` if none does.

    The super configuration is told apart by the ``-super`` suffix the super device tree adds to
    the first entry (JetPack 6.2+); a non-super device tree on the same module is ``orin-nano-8gb``.
    """
    if not compatible:
        return None
    first = compatible[0]
    for board in PROFILES.values():
        if board.compatible[0] == first:
            return board
    is_super = first.endswith("-super")
    for board in PROFILES.values():
        module = board.compatible[1]
        if module in compatible and board.super_modes == is_super:
            return board
    return None


__all__ = ["ALIASES", "PROFILES", "BoardProfile", "NvpmodelMode", "Rail", "identify", "profile"]
