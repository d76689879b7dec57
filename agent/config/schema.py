"""The configuration's schema: one frozen dataclass per TOML section, and the table of keys.

Each TOML section is one dataclass below; a new section (``[mqtt]``, ``[power]``) is one more
dataclass and one more field on :class:`AgentConfig`, and the file, environment and override
parsing (agent/config/load.py) pick it up from there. Settings carry their bounds in field
metadata; rules across keys live in the section's ``_check``. Constructing a section validates it,
so a configuration object that exists is a valid one.

Every key has a default, so ``AgentConfig()`` is a complete configuration. Keys are dotted
(``serving.max_batch_size``); each has one environment variable, ``EDGE_AGENT_<SECTION>_<KEY>``
(``EDGE_AGENT_HTTP_PORT``), or ``EDGE_AGENT_<KEY>`` for top-level keys (``EDGE_AGENT_STATE_DIR``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.backends import BACKEND_CHOICES
from agent.config.kinds import Kind, invalid, kind_of, show
from agent.config.secrets import REDACTED, Secret
from agent.errors import ConfigError, InternalError

DEFAULT_STATE_DIR = Path("/var/lib/edge-agent")
CONFIG_PATH_ENV_VAR = "EDGE_AGENT_CONFIG"
ENV_PREFIX = "EDGE_AGENT_"
# EDGE_AGENT_* variables that are not configuration keys. Every other EDGE_AGENT_* variable must
# name a key: a mistyped override must not be ignored.
NON_CONFIG_ENV_VARS = frozenset(
    {
        CONFIG_PATH_ENV_VAR,
        "EDGE_AGENT_CACHE",  # the host-side checkpoint cache (models/zoo)
        "EDGE_AGENT_REQUIRE_HOST",  # the test suite's guard against a broken host install
        "EDGE_AGENT_TEST_CACHE",  # the test suite's shared checkpoint cache
    }
)

MEBIBYTE = 1024 * 1024
LOG_LEVELS = ("debug", "info", "warning", "error")
# A device id becomes an MQTT topic level and client id: no '/', '+', '#' or spaces.
_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEVICE_CLASS = re.compile(r"[a-z0-9][a-z0-9._-]*")
# A fleet id, and a device id in a fleet: one MQTT topic level (agent/fleet/topics.py).
_FLEET_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


# --------------------------------------------------------------------------------------------------
# Sections

LOADED = "loaded_at_start"  # field metadata: filled in by load_config, not a configuration key


def bounds(
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Field metadata that ``Section`` checks: integer bounds or the allowed strings."""
    return {"minimum": minimum, "maximum": maximum, "choices": choices}


class Section:
    """Validation shared by every section: types, bounds and choices from the field metadata."""

    section: ClassVar[str]  # the TOML table name; "" for the top level

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):  # type: ignore[arg-type]
            if spec.metadata.get(LOADED):
                continue
            hint = type_hints(type(self))[spec.name]
            value = getattr(self, spec.name)
            if isinstance(hint, type) and issubclass(hint, Section):
                if not isinstance(value, hint):
                    raise InternalError(f"{spec.name} must be a {hint.__name__}, got {value!r}")
                continue
            key = join(self.section, spec.name)
            kind = kind_of(hint)
            if not kind.accepts(value):
                raise invalid(key, kind.expected, value)
            _check_bounds(key, value, spec.metadata)
        self._check()

    def _check(self) -> None:
        """Rules that involve more than one key (none by default)."""


def _check_bounds(key: str, value: Any, metadata: Mapping[str, Any]) -> None:
    minimum = metadata.get("minimum")
    maximum = metadata.get("maximum")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise invalid(key, "one of " + ", ".join(f'"{choice}"' for choice in choices), value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        noun = "a number" if isinstance(value, float) else "an integer"
        raise invalid(key, _range_text(noun, minimum, maximum), value)


def _range_text(noun: str, minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{noun} in {minimum:g}..{maximum:g}"
    if minimum is not None:
        return f"{noun} >= {minimum:g}"
    return f"{noun} <= {maximum:g}"


@dataclass(frozen=True, kw_only=True)
class HttpConfig(Section):
    """``[http]``: the inference API's listener (design §5.4)."""

    section: ClassVar[str] = "http"

    host: str = "127.0.0.1"
    # 0 asks the OS for a free port (tests).
    port: int = field(default=8000, metadata=bounds(minimum=0, maximum=65535))
    max_body_bytes: int = field(default=64 * MEBIBYTE, metadata=bounds(minimum=1024))
    # A file holding the bearer token clients must send; None: no token is required.
    token_file: Path | None = None
    access_log: bool = False
    # Read from token_file by load_config; never shown in repr, to_dict or errors.
    token: Secret | None = field(default=None, repr=False, compare=False, metadata={LOADED: True})

    def _check(self) -> None:
        if not self.host or any(character.isspace() for character in self.host):
            raise invalid("http.host", "a host name or IP address", self.host)


@dataclass(frozen=True, kw_only=True)
class ServingConfig(Section):
    """``[serving]``: the backend, the execution instances and the dynamic batcher.

    Priorities follow Triton: level 1 is the highest. ``default_priority_level`` is the level of a
    request that names none; 0 (the default) means the lowest level, ``priority_levels``, so that
    requests marked urgent always go first and changing ``priority_levels`` alone keeps unmarked
    requests at the bottom.
    """

    section: ClassVar[str] = "serving"

    backend: str = field(default="auto", metadata=bounds(choices=BACKEND_CHOICES))
    # Execution instances. One instance using every core measured best on a 2-core CPU: two
    # single-threaded instances have more raw throughput, but over HTTP they matched one at a
    # higher P99 and twice the memory (docs in README, "bench serve").
    instances: int = field(default=1, metadata=bounds(minimum=1, maximum=64))
    # Intra-op CPU threads per instance; 0 divides the CPU cores among the instances.
    threads: int = field(default=0, metadata=bounds(minimum=0, maximum=256))
    max_batch_size: int = field(default=32, metadata=bounds(minimum=1))
    max_queue_delay_us: int = field(default=5000, metadata=bounds(minimum=0))
    # Skip the wait when requests arrive too rarely to fill a batch within it (see BatchPolicy).
    adaptive_delay: bool = True
    # Empty: the bundle's opt_batch is the preferred size.
    preferred_batch_sizes: tuple[int, ...] = ()
    # 0: unlimited.
    max_queue_size: int = field(default=256, metadata=bounds(minimum=0))
    # 0: requests wait without a deadline unless they carry one.
    default_timeout_us: int = field(default=0, metadata=bounds(minimum=0))
    # One queue per level, each scanned at every dispatch.
    priority_levels: int = field(default=2, metadata=bounds(minimum=1, maximum=100))
    default_priority_level: int = field(default=0, metadata=bounds(minimum=0))
    warmup_batches: int = field(default=2, metadata=bounds(minimum=0))
    # ONNX Runtime's idle threads busy-wait when true: faster alone, slower beside the HTTP loop
    # on a board with few cores.
    cpu_spin: bool = False
    # Instance autoscaling, between `instances` and `max_instances` (0: off, `instances` only):
    # one more when the instances stay busier than `scale_up_utilization` over
    # `scale_window_s`, one fewer when requests stay under `scale_down_rate` a second; none is
    # added that would leave less than `scale_min_free_mib` of memory available.
    max_instances: int = field(default=0, metadata=bounds(minimum=0, maximum=64))
    scale_up_utilization: float = field(default=0.7, metadata=bounds(minimum=0.05, maximum=1))
    scale_down_rate: float = field(default=5.0, metadata=bounds(minimum=0))
    scale_window_s: float = field(default=30.0, metadata=bounds(minimum=0.1))
    scale_min_free_mib: int = field(default=256, metadata=bounds(minimum=0))

    def _check(self) -> None:
        if self.max_instances and self.max_instances < self.instances:
            raise invalid("serving.max_instances",
                          f"0 (no autoscaling) or at least serving.instances ({self.instances})",
                          self.max_instances)
        seen: set[int] = set()
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise invalid(
                    "serving.preferred_batch_sizes",
                    f"batch sizes in 1..max_batch_size ({self.max_batch_size})",
                    list(self.preferred_batch_sizes),
                )
            if size in seen:
                raise invalid(
                    "serving.preferred_batch_sizes",
                    "distinct batch sizes",
                    list(self.preferred_batch_sizes),
                )
            seen.add(size)
        if self.default_priority_level > self.priority_levels:
            raise invalid(
                "serving.default_priority_level",
                f"0 (the lowest level) or a level in 1..priority_levels ({self.priority_levels})",
                self.default_priority_level,
            )

    @property
    def resolved_default_priority_level(self) -> int:
        """The level (1 = highest) given to a request that names none."""
        return self.default_priority_level or self.priority_levels

    def threads_per_instance(self, cpu_count: int) -> int:
        """Intra-op threads for each instance on a machine with ``cpu_count`` cores."""
        if self.threads:
            return self.threads
        return max(1, cpu_count // self.instances)


@dataclass(frozen=True, kw_only=True)
class TensorRTConfig(Section):
    """``[tensorrt]``: how the device builds engines from ``model.onnx`` (design §5.1)."""

    section: ClassVar[str] = "tensorrt"

    workspace_mib: int = field(default=1024, metadata=bounds(minimum=1))
    # -1: the GPU only. Jetson AGX Orin, Orin NX and Xavier have two DLA cores (0 and 1); the Orin
    # Nano has none, which the backend reports when the engine is built. DLA runs static shapes:
    # the engine takes the bundle's optimum batch and frame size only (smaller batches padded).
    dla_core: int = field(default=-1, metadata=bounds(minimum=-1, maximum=1))
    optimization_level: int = field(default=3, metadata=bounds(minimum=0, maximum=5))
    fp16: bool = True


@dataclass(frozen=True, kw_only=True)
class TrustConfig(Section):
    """``[trust]``: the Ed25519 public keys whose bundles this device installs."""

    section: ClassVar[str] = "trust"

    public_keys: tuple[Path, ...] = ()
    # Loaded from public_keys by load_config, in the same order.
    keys: tuple[Ed25519PublicKey, ...] = field(
        default=(), repr=False, compare=False, metadata={LOADED: True}
    )


@dataclass(frozen=True, kw_only=True)
class StoreConfig(Section):
    """``[store]``: the on-device model store (design §5.2)."""

    section: ClassVar[str] = "store"

    # At least the current version and the previous one, kept for rollback.
    keep_versions: int = field(default=2, metadata=bounds(minimum=2))


@dataclass(frozen=True, kw_only=True)
class UpdateConfig(Section):
    """``[update]``: how the daemon applies a new model version (design section 6): downloads,
    the canary before commit, the watch window after it, and each state's deadline."""

    section: ClassVar[str] = "update"

    # Downloads: the whole fetch, retries included, and a server that sends nothing this long.
    download_deadline_s: float = field(default=3600.0, metadata=bounds(minimum=1))
    download_stall_timeout_s: float = field(default=30.0, metadata=bounds(minimum=1))
    max_bundle_mib: int = field(default=4096, metadata=bounds(minimum=1))
    # The canary shadows live requests on the new version for at most canary_s, or until it has
    # compared canary_min_samples samples.
    canary_s: float = field(default=30.0, metadata=bounds(minimum=0.1))
    canary_min_samples: int = field(default=64, metadata=bounds(minimum=1))
    # Share of shadowed samples whose decisions must agree with the serving version's.
    canary_min_agreement: float = field(default=0.9, metadata=bounds(minimum=0, maximum=1))
    # The new version's compute time over the old one's, at most.
    canary_max_latency_ratio: float = field(default=3.0, metadata=bounds(minimum=1))
    # Fail an update that saw no traffic to compare (otherwise it commits, and the watch checks).
    canary_require_traffic: bool = False
    # After commit: how long the health watch runs, and the failed-request share it tolerates.
    watch_window_s: float = field(default=600.0, metadata=bounds(minimum=0.1))
    watch_max_failure_rate: float = field(default=0.05, metadata=bounds(minimum=0, maximum=1))
    # How long the old instances may take to finish their batches at a swap.
    drain_timeout_s: float = field(default=30.0, metadata=bounds(minimum=0.1))
    # A bundle failing this many times (from staging on) is refused until a newer one comes.
    max_failures: int = field(default=3, metadata=bounds(minimum=1))
    # Deadline of the engine build (a TensorRT build on a board takes minutes).
    building_engine_s: float = field(default=1800.0, metadata=bounds(minimum=1))


@dataclass(frozen=True, kw_only=True)
class FleetConfig(Section):
    """``[fleet]``: fleet control over MQTT (design §5.3, agent/fleet/). The device's topics are
    ``edge/<fleet>/<device_id>/...``, its MQTT client id is ``device_id`` (which must be set),
    and it acts only on documents signed by one of ``public_keys`` (the fleet's keys, apart
    from ``[trust]``'s bundle keys)."""

    section: ClassVar[str] = "fleet"

    enabled: bool = False
    broker: str = ""  # the broker's host name or address
    # 8883 is MQTT over TLS; 1883 the plain port.
    port: int = field(default=8883, metadata=bounds(minimum=1, maximum=65535))
    protocol: str = field(default="5", metadata=bounds(choices=("5", "3.1.1")))
    fleet: str = ""
    username: str = ""  # empty: no username (a client certificate identifies the device)
    password_file: Path | None = None
    tls: bool = True
    ca_file: Path | None = None  # empty: the system's CAs
    cert_file: Path | None = None  # a client certificate (and key_file), instead of a password
    key_file: Path | None = None
    keepalive_s: int = field(default=30, metadata=bounds(minimum=5, maximum=65535))
    # How long the broker keeps the session (subscriptions, queued commands) while the device
    # is away; MQTT 5's Session Expiry Interval.
    session_expiry_s: int = field(default=86400, metadata=bounds(minimum=0, maximum=2**32 - 1))
    # Reconnection backoff (full jitter) between these bounds.
    reconnect_min_s: float = field(default=1.0, metadata=bounds(minimum=0.01))
    reconnect_max_s: float = field(default=60.0, metadata=bounds(minimum=0.01))
    public_keys: tuple[Path, ...] = ()
    # Loaded by load_config when enabled: the keys of public_keys, and password_file's password.
    keys: tuple[Ed25519PublicKey, ...] = field(
        default=(), repr=False, compare=False, metadata={LOADED: True})
    password: Secret | None = field(default=None, repr=False, compare=False,
                                    metadata={LOADED: True})

    def _check(self) -> None:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise invalid("fleet.reconnect_max_s",
                          f"at least fleet.reconnect_min_s ({self.reconnect_min_s:g})",
                          self.reconnect_max_s)
        if not self.enabled:
            return
        if not self.broker or any(character.isspace() for character in self.broker):
            raise invalid("fleet.broker", "a host name or IP address (fleet.enabled is true)",
                          self.broker)
        if not self.fleet or _FLEET_ID.fullmatch(self.fleet) is None:
            raise invalid("fleet.fleet", "a fleet id: 1-64 characters of [A-Za-z0-9_.-], "
                                         "starting with a letter or digit", self.fleet)
        if not self.public_keys:
            raise invalid("fleet.public_keys", "at least one fleet public key (without one no "
                                               "signed document can be accepted)",
                          list(self.public_keys))
        if self.password_file is not None and not self.username:
            raise invalid("fleet.username", "a username (fleet.password_file is set)",
                          self.username)
        if not self.tls:
            for name in ("ca_file", "cert_file", "key_file"):
                if getattr(self, name) is not None:
                    raise invalid(f"fleet.{name}", "empty (fleet.tls is false)",
                                  getattr(self, name))
        if (self.cert_file is None) != (self.key_file is None):
            raise invalid("fleet.key_file" if self.key_file is None else "fleet.cert_file",
                          "set together with fleet.cert_file/fleet.key_file",
                          self.key_file or self.cert_file or "")


POWER_PROFILES = ("governed", "max", "min", "stock")


@dataclass(frozen=True, kw_only=True)
class PowerConfig(Section):
    """``[power]``: power governance of the board (design section 6, power/, agent/power/).
    Off by default: with ``enabled`` false the daemon never reads or writes the board's clock
    files. The policy keys are :class:`power.types.PowerPolicy`'s (``desired.power`` and
    ``edge-agent power set`` change them at run time); 0 and -1 stand for its ``None``."""

    section: ClassVar[str] = "power"

    enabled: bool = False
    # The board's files are read and written under this root ("/" on a board; a fake board's
    # directory in tests and the simulator).
    root: Path = Path("/")
    # A board profile name (orin-nano, agx-orin-64gb...); empty: identified from the device tree.
    board: str = ""
    # The privileged power helper's socket (/run/edge-agent-power.sock on a service install,
    # where the daemon runs unprivileged); empty: the daemon writes the board's files itself.
    helper_socket: Path | None = None
    profile: str = field(default="governed", metadata=bounds(choices=POWER_PROFILES))
    latency_target_s: float = field(default=0.050, metadata=bounds(minimum=0.0001,
                                                                   maximum=60.0))
    percentile: float = field(default=0.99, metadata=bounds(minimum=0.5, maximum=0.9999))
    # 0: no power cap.
    power_cap_mw: int = field(default=0, metadata=bounds(minimum=0, maximum=1_000_000))
    idle_after_s: float = field(default=1.0, metadata=bounds(minimum=0.01, maximum=3600.0))
    sleep_after_s: float = field(default=10.0, metadata=bounds(minimum=0.01, maximum=86400.0))
    # -1: keep the nvpmodel mode while sleeping.
    sleep_nvpmodel_mode: int = field(default=-1, metadata=bounds(minimum=-1, maximum=255))
    release_engine_in_sleep: bool = False
    thermal_margin_c: float = field(default=5.0, metadata=bounds(minimum=0.0, maximum=50.0))
    max_changes_per_s: float = field(default=5.0, metadata=bounds(minimum=0.1, maximum=1000.0))
    allow_nvpmodel: bool = False
    # How often the governor steps, and how often telemetry is read for metrics and reported.
    control_period_s: float = field(default=0.05, metadata=bounds(minimum=0.005, maximum=10.0))
    telemetry_period_s: float = field(default=1.0, metadata=bounds(minimum=0.05,
                                                                   maximum=3600.0))
    # The longest a request waits for the board to wake before it is dispatched anyway.
    wake_timeout_s: float = field(default=1.0, metadata=bounds(minimum=0.01, maximum=10.0))

    def _check(self) -> None:
        if self.board:
            # Named here, at start, rather than when the power thread opens the board.
            from power.profiles import ALIASES, PROFILES

            if self.board not in PROFILES and self.board not in ALIASES:
                raise invalid("power.board", "empty (identify the board) or one of "
                              + ", ".join(sorted([*PROFILES, *ALIASES])), self.board)
        if self.sleep_after_s < self.idle_after_s:
            raise invalid("power.sleep_after_s",
                          f"at least power.idle_after_s ({self.idle_after_s:g})",
                          self.sleep_after_s)
        if self.sleep_nvpmodel_mode >= 0 and not self.allow_nvpmodel:
            raise invalid("power.sleep_nvpmodel_mode",
                          "-1 (none) unless power.allow_nvpmodel is true",
                          self.sleep_nvpmodel_mode)
        if self.telemetry_period_s < self.control_period_s:
            raise invalid("power.telemetry_period_s",
                          f"at least power.control_period_s ({self.control_period_s:g})",
                          self.telemetry_period_s)


@dataclass(frozen=True, kw_only=True)
class LogConfig(Section):
    """``[log]``."""

    section: ClassVar[str] = "log"

    level: str = field(default="info", metadata=bounds(choices=LOG_LEVELS))

    def __post_init__(self) -> None:
        # agent/log.py has always read EDGE_AGENT_LOG_LEVEL case-insensitively (DEBUG, debug).
        if isinstance(self.level, str):
            object.__setattr__(self, "level", self.level.lower())
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class AgentConfig(Section):
    """The whole configuration: top-level keys and one field per section."""

    section: ClassVar[str] = ""

    state_dir: Path = DEFAULT_STATE_DIR
    # Empty: the host name is used (see resolved_device_id).
    device_id: str = ""
    # What kind of device this is (a slug such as orin-nano-8gb): a bundle whose manifest lists
    # `targets` is applied only on a device of a class it names. Empty: undeclared.
    device_class: str = ""
    http: HttpConfig = field(default_factory=HttpConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    power: PowerConfig = field(default_factory=PowerConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def _check(self) -> None:
        if self.device_class and _DEVICE_CLASS.fullmatch(self.device_class) is None:
            raise invalid("device_class", "empty or a slug [a-z0-9][a-z0-9._-]*",
                          self.device_class)
        if self.device_id and _DEVICE_ID.fullmatch(self.device_id) is None:
            raise invalid("device_id", "empty or [A-Za-z0-9][A-Za-z0-9._-]*", self.device_id)
        if self.fleet.enabled and (_FLEET_ID.fullmatch(self.device_id) is None
                                   or self.device_id == "rollouts"):
            # The host name is no fallback here: it is the device's MQTT identity, which the
            # broker's credentials and ACL are made for, so it is written down.
            raise invalid("device_id", "a device id of 1-64 characters of [A-Za-z0-9_.-], not "
                                       "'rollouts' (fleet.enabled is true)", self.device_id)

    @property
    def resolved_device_id(self) -> str:
        """``device_id``, or this machine's host name when it is empty.

        Raises:
            ConfigError: the host name cannot be used as a device id.
        """
        if self.device_id:
            return self.device_id
        host_name = socket.gethostname()
        if _DEVICE_ID.fullmatch(host_name) is None:
            raise ConfigError(
                "the host name cannot serve as the device id; set device_id",
                key="device_id",
                expected="[A-Za-z0-9][A-Za-z0-9._-]*",
                found=show(host_name),
            )
        return host_name

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, in the forms the TOML file uses (for ``--print-config``).

        ``http.token`` is not a key: it reports whether a token was loaded, as ``"<redacted>"``,
        or ``""`` when none was.
        """
        result: dict[str, Any] = {}
        for setting in settings().values():
            owner = self if not setting.section else getattr(self, setting.section)
            value = setting.kind.plain(getattr(owner, setting.name))
            if setting.section:
                result.setdefault(setting.section, {})[setting.name] = value
            else:
                result[setting.name] = value
        result["http"]["token"] = REDACTED if self.http.token is not None else ""
        return result


def config_keys() -> list[str]:
    """Every configuration key, dotted (``serving.max_batch_size``), in declaration order."""
    return list(settings())


def env_var_name(key: str) -> str:
    """The environment variable that overrides ``key`` (``http.port`` -> ``EDGE_AGENT_HTTP_PORT``)."""
    return ENV_PREFIX + key.replace(".", "_").upper()


# --------------------------------------------------------------------------------------------------
# The table of keys


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    # The annotations are strings (``from __future__ import annotations``); evaluate them once.
    hints = _TYPE_HINTS.get(cls)
    if hints is None:
        hints = _TYPE_HINTS[cls] = get_type_hints(cls)
    return hints


@dataclass(frozen=True)
class Setting:
    """One configuration key: where it lives and how its values are read."""

    key: str
    section: str  # "" for top-level keys
    name: str
    kind: Kind
    env_var: str


def sections() -> dict[str, type[Section]]:
    """The TOML tables: field name on :class:`AgentConfig` to the section's class."""
    hints = type_hints(AgentConfig)
    return {
        spec.name: hints[spec.name]
        for spec in dataclasses.fields(AgentConfig)
        if isinstance(hints[spec.name], type) and issubclass(hints[spec.name], Section)
    }


@functools.cache
def settings() -> dict[str, Setting]:
    """Every key's setting, dotted key to setting, in declaration order."""
    table: dict[str, Setting] = {}
    owners: list[tuple[str, type[Section]]] = [("", AgentConfig), *sections().items()]
    for section, cls in owners:
        hints = type_hints(cls)
        for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
            if spec.metadata.get(LOADED) or (not section and spec.name in sections()):
                continue
            key = join(section, spec.name)
            table[key] = Setting(key, section, spec.name, kind_of(hints[spec.name]),
                                 env_var_name(key))
    env_vars = [setting.env_var for setting in table.values()]
    if len(set(env_vars)) != len(env_vars) or NON_CONFIG_ENV_VARS & set(env_vars):
        raise InternalError(f"two configuration keys share an environment variable: {env_vars}")
    return table


def join(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name

