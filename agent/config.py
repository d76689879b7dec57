"""The daemon's configuration (design §5.5): one TOML file, the environment and command-line flags.

Every key has a default, so an absent file at the default path is a complete configuration. Values
are layered, each layer overriding the one before::

    defaults  <  the TOML file  <  EDGE_AGENT_* environment variables  <  command-line overrides

and the result is validated once, at start. An error names the key (``serving.max_batch_size``),
the expected form and what was found, plus where the value came from: the file and line, the
environment variable, or the command line. Unknown sections, keys and ``EDGE_AGENT_*`` variables
are errors too, because a typo that passes silently leaves a setting at a default nobody chose.

Each TOML section is one frozen dataclass below; a new section (``[mqtt]``, ``[power]``) is one more
dataclass and one more field on :class:`AgentConfig`, and the file, environment and override parsing
pick it up from there. Settings carry their bounds in field metadata; rules across keys live in the
section's ``_check``.

Environment variables are named ``EDGE_AGENT_<SECTION>_<KEY>`` (``EDGE_AGENT_HTTP_PORT``), or
``EDGE_AGENT_<KEY>`` for top-level keys (``EDGE_AGENT_STATE_DIR``). Their text is parsed by the key's
type: integers, ``true/false/1/0/yes/no``, comma-separated lists, paths.

Relative paths in the file are taken relative to the file's directory, so a configuration and its
key files can travel together; relative paths from the environment or the command line are taken as
given (relative to the working directory, ``/`` under systemd).

Only :func:`load_config` does I/O: it reads the file, the bearer-token file and the trusted public
keys, so that a missing key file stops the daemon at start rather than at the first update.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hmac
import json
import logging
import os
import re
import socket
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.backends import BACKEND_CHOICES
from agent.errors import ConfigError, InternalError, KeyFileError
from models.signing import load_public_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = Path("/etc/edge-agent/agent.toml")
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
REDACTED = "<redacted>"
MAX_TOKEN_FILE_BYTES = 4096
# A device id becomes an MQTT topic level and client id: no '/', '+', '#' or spaces.
_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# --------------------------------------------------------------------------------------------------
# Values that must not be shown


class Secret:
    """A string that never shows itself in ``repr``, ``str``, f-strings or logs.

    ``reveal()`` returns it; ``matches()`` compares a candidate in constant time (for the bearer
    token check in the HTTP API).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, candidate: str | bytes) -> bool:
        data = candidate.encode("utf-8") if isinstance(candidate, str) else candidate
        return hmac.compare_digest(self._value.encode("utf-8"), data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return self.matches(other._value)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Secret({REDACTED!r})"

    def __str__(self) -> str:
        return REDACTED


# --------------------------------------------------------------------------------------------------
# Sections

_LOADED = "loaded_at_start"  # field metadata: filled in by load_config, not a configuration key


def _bounds(
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    choices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Field metadata that ``_Section`` checks: integer bounds or the allowed strings."""
    return {"minimum": minimum, "maximum": maximum, "choices": choices}


class _Section:
    """Validation shared by every section: types, bounds and choices from the field metadata."""

    section: ClassVar[str]  # the TOML table name; "" for the top level

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):  # type: ignore[arg-type]
            if spec.metadata.get(_LOADED):
                continue
            hint = _type_hints(type(self))[spec.name]
            value = getattr(self, spec.name)
            if isinstance(hint, type) and issubclass(hint, _Section):
                if not isinstance(value, hint):
                    raise InternalError(f"{spec.name} must be a {hint.__name__}, got {value!r}")
                continue
            key = _join(self.section, spec.name)
            kind = _kind(hint)
            if not kind.accepts(value):
                raise _invalid(key, kind.expected, value)
            _check_bounds(key, value, spec.metadata)
        self._check()

    def _check(self) -> None:
        """Rules that involve more than one key (none by default)."""


def _check_bounds(key: str, value: Any, metadata: Mapping[str, Any]) -> None:
    minimum = metadata.get("minimum")
    maximum = metadata.get("maximum")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise _invalid(key, "one of " + ", ".join(f'"{choice}"' for choice in choices), value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _invalid(key, _integer_range(minimum, maximum), value)


def _integer_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in {minimum}..{maximum}"
    if minimum is not None:
        return f"an integer >= {minimum}"
    return f"an integer <= {maximum}"


@dataclass(frozen=True, kw_only=True)
class HttpConfig(_Section):
    """``[http]``: the inference API's listener (design §5.4)."""

    section: ClassVar[str] = "http"

    host: str = "127.0.0.1"
    # 0 asks the OS for a free port (tests).
    port: int = field(default=8000, metadata=_bounds(minimum=0, maximum=65535))
    max_body_bytes: int = field(default=64 * MEBIBYTE, metadata=_bounds(minimum=1024))
    # A file holding the bearer token clients must send; None: no token is required.
    token_file: Path | None = None
    access_log: bool = False
    # Read from token_file by load_config; never shown in repr, to_dict or errors.
    token: Secret | None = field(default=None, repr=False, compare=False, metadata={_LOADED: True})

    def _check(self) -> None:
        if not self.host or any(character.isspace() for character in self.host):
            raise _invalid("http.host", "a host name or IP address", self.host)


@dataclass(frozen=True, kw_only=True)
class ServingConfig(_Section):
    """``[serving]``: the backend, the execution instances and the dynamic batcher.

    Priorities follow Triton: level 1 is the highest. ``default_priority_level`` is the level of a
    request that names none; 0 (the default) means the lowest level, ``priority_levels``, so that
    requests marked urgent always go first and changing ``priority_levels`` alone keeps unmarked
    requests at the bottom.
    """

    section: ClassVar[str] = "serving"

    backend: str = field(default="auto", metadata=_bounds(choices=BACKEND_CHOICES))
    # Execution instances. One instance using every core measured best on a 2-core CPU: two
    # single-threaded instances have more raw throughput, but over HTTP they matched one at a
    # higher P99 and twice the memory (docs in README, "bench serve").
    instances: int = field(default=1, metadata=_bounds(minimum=1, maximum=64))
    # Intra-op CPU threads per instance; 0 divides the CPU cores among the instances.
    threads: int = field(default=0, metadata=_bounds(minimum=0, maximum=256))
    max_batch_size: int = field(default=32, metadata=_bounds(minimum=1))
    max_queue_delay_us: int = field(default=5000, metadata=_bounds(minimum=0))
    # Skip the wait when requests arrive too rarely to fill a batch within it (see BatchPolicy).
    adaptive_delay: bool = True
    # Empty: the bundle's opt_batch is the preferred size.
    preferred_batch_sizes: tuple[int, ...] = ()
    # 0: unlimited.
    max_queue_size: int = field(default=256, metadata=_bounds(minimum=0))
    # 0: requests wait without a deadline unless they carry one.
    default_timeout_us: int = field(default=0, metadata=_bounds(minimum=0))
    # One queue per level, each scanned at every dispatch.
    priority_levels: int = field(default=2, metadata=_bounds(minimum=1, maximum=100))
    default_priority_level: int = field(default=0, metadata=_bounds(minimum=0))
    warmup_batches: int = field(default=2, metadata=_bounds(minimum=0))
    # ONNX Runtime's idle threads busy-wait when true: faster alone, slower beside the HTTP loop
    # on a board with few cores.
    cpu_spin: bool = False

    def _check(self) -> None:
        seen: set[int] = set()
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise _invalid(
                    "serving.preferred_batch_sizes",
                    f"batch sizes in 1..max_batch_size ({self.max_batch_size})",
                    list(self.preferred_batch_sizes),
                )
            if size in seen:
                raise _invalid(
                    "serving.preferred_batch_sizes",
                    "distinct batch sizes",
                    list(self.preferred_batch_sizes),
                )
            seen.add(size)
        if self.default_priority_level > self.priority_levels:
            raise _invalid(
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
class TensorRTConfig(_Section):
    """``[tensorrt]``: how the device builds engines from ``model.onnx`` (design §5.1)."""

    section: ClassVar[str] = "tensorrt"

    workspace_mib: int = field(default=1024, metadata=_bounds(minimum=1))
    # -1: the GPU only. Jetson AGX Orin, Orin NX and Xavier have two DLA cores (0 and 1); the Orin
    # Nano has none, which the backend reports when the engine is built. DLA runs static shapes:
    # the engine takes the bundle's optimum batch and frame size only (smaller batches padded).
    dla_core: int = field(default=-1, metadata=_bounds(minimum=-1, maximum=1))
    optimization_level: int = field(default=3, metadata=_bounds(minimum=0, maximum=5))
    fp16: bool = True


@dataclass(frozen=True, kw_only=True)
class TrustConfig(_Section):
    """``[trust]``: the Ed25519 public keys whose bundles this device installs."""

    section: ClassVar[str] = "trust"

    public_keys: tuple[Path, ...] = ()
    # Loaded from public_keys by load_config, in the same order.
    keys: tuple[Ed25519PublicKey, ...] = field(
        default=(), repr=False, compare=False, metadata={_LOADED: True}
    )


@dataclass(frozen=True, kw_only=True)
class StoreConfig(_Section):
    """``[store]``: the on-device model store (design §5.2)."""

    section: ClassVar[str] = "store"

    # At least the current version and the previous one, kept for rollback.
    keep_versions: int = field(default=2, metadata=_bounds(minimum=2))


@dataclass(frozen=True, kw_only=True)
class LogConfig(_Section):
    """``[log]``."""

    section: ClassVar[str] = "log"

    level: str = field(default="info", metadata=_bounds(choices=LOG_LEVELS))

    def __post_init__(self) -> None:
        # agent/log.py has always read EDGE_AGENT_LOG_LEVEL case-insensitively (DEBUG, debug).
        if isinstance(self.level, str):
            object.__setattr__(self, "level", self.level.lower())
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class AgentConfig(_Section):
    """The whole configuration: top-level keys and one field per section."""

    section: ClassVar[str] = ""

    state_dir: Path = DEFAULT_STATE_DIR
    # Empty: the host name is used (see resolved_device_id).
    device_id: str = ""
    http: HttpConfig = field(default_factory=HttpConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def _check(self) -> None:
        if self.device_id and _DEVICE_ID.fullmatch(self.device_id) is None:
            raise _invalid("device_id", "empty or [A-Za-z0-9][A-Za-z0-9._-]*", self.device_id)

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
                found=_show(host_name),
            )
        return host_name

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, in the forms the TOML file uses (for ``--print-config``).

        ``http.token`` is not a key: it reports whether a token was loaded, as ``"<redacted>"``,
        or ``""`` when none was.
        """
        result: dict[str, Any] = {}
        for setting in _settings().values():
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
    return list(_settings())


def env_var_name(key: str) -> str:
    """The environment variable that overrides ``key`` (``http.port`` -> ``EDGE_AGENT_HTTP_PORT``)."""
    return ENV_PREFIX + key.replace(".", "_").upper()


# --------------------------------------------------------------------------------------------------
# Value kinds: how each field type is read from TOML, from text, and shown


@dataclass(frozen=True)
class _Kind:
    expected: str  # as a TOML value
    expected_text: str  # as environment or command-line text
    accepts: Callable[[Any], bool]  # is this already a valid field value?
    from_toml: Callable[[Any], Any]  # raises ValueError
    from_text: Callable[[str], Any]  # raises ValueError
    plain: Callable[[Any], Any]  # the TOML form, for to_dict
    rebase: Callable[[Any, Path], Any] = lambda value, base: value  # relative paths in the file


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(check: Callable[[Any], bool]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if not check(value):
            raise ValueError
        return value

    return convert


_BOOL_TEXT = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool_from_text(text: str) -> bool:
    return _BOOL_TEXT[text.strip().lower()]  # KeyError is a LookupError, caught as bad text


def _int_from_text(text: str) -> int:
    return int(text.strip(), 10)


def _path_from_any(value: Any) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError
    return Path(value)


def _optional_path_from_any(value: Any) -> Path | None:
    return None if value is None or value == "" else _path_from_any(value)


def _rebase_path(value: Path | None, base: Path) -> Path | None:
    return value if value is None else base / value  # an absolute value stays as it is


def _text_items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",")] if text.strip() else []


def _int_tuple(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(item) for item in value):
        raise ValueError
    return tuple(value)


def _path_tuple(value: Any) -> tuple[Path, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError
    return tuple(_path_from_any(item) for item in value)


_KINDS: dict[Any, _Kind] = {
    int: _Kind(
        expected="an integer",
        expected_text="an integer",
        accepts=_is_int,
        from_toml=_require(_is_int),
        from_text=_int_from_text,
        plain=lambda value: value,
    ),
    bool: _Kind(
        expected="true or false",
        expected_text="one of true, false, 1, 0, yes, no",
        accepts=lambda value: isinstance(value, bool),
        from_toml=_require(lambda value: isinstance(value, bool)),
        from_text=_bool_from_text,
        plain=lambda value: value,
    ),
    str: _Kind(
        expected="a string",
        expected_text="a string",
        accepts=lambda value: isinstance(value, str),
        from_toml=_require(lambda value: isinstance(value, str)),
        from_text=lambda text: text,
        plain=lambda value: value,
    ),
    Path: _Kind(
        expected="a path (a non-empty string)",
        expected_text="a path",
        accepts=lambda value: isinstance(value, Path),
        from_toml=_path_from_any,
        from_text=_path_from_any,
        plain=str,
        rebase=_rebase_path,
    ),
    Path | None: _Kind(
        expected='a path, or "" for none',
        expected_text="a path, or empty for none",
        accepts=lambda value: value is None or isinstance(value, Path),
        from_toml=_optional_path_from_any,
        from_text=_optional_path_from_any,
        plain=lambda value: "" if value is None else str(value),
        rebase=_rebase_path,
    ),
    tuple[int, ...]: _Kind(
        expected="a list of integers",
        expected_text="comma-separated integers",
        accepts=lambda value: isinstance(value, tuple) and all(_is_int(item) for item in value),
        from_toml=_int_tuple,
        from_text=lambda text: tuple(_int_from_text(item) for item in _text_items(text)),
        plain=list,
    ),
    tuple[Path, ...]: _Kind(
        expected="a list of paths",
        expected_text="comma-separated paths",
        accepts=lambda value: isinstance(value, tuple)
        and all(isinstance(item, Path) for item in value),
        from_toml=_path_tuple,
        from_text=lambda text: _path_tuple(_text_items(text)),
        plain=lambda value: [str(item) for item in value],
        rebase=lambda value, base: tuple(base / item for item in value),
    ),
}


def _kind(hint: Any) -> _Kind:
    try:
        return _KINDS[hint]
    except (KeyError, TypeError):
        raise InternalError(f"configuration field type {hint!r} has no parser") from None


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    # The annotations are strings (``from __future__ import annotations``); evaluate them once.
    hints = _TYPE_HINTS.get(cls)
    if hints is None:
        hints = _TYPE_HINTS[cls] = get_type_hints(cls)
    return hints


@dataclass(frozen=True)
class _Setting:
    key: str
    section: str  # "" for top-level keys
    name: str
    kind: _Kind
    env_var: str


def _sections() -> dict[str, type[_Section]]:
    hints = _type_hints(AgentConfig)
    return {
        spec.name: hints[spec.name]
        for spec in dataclasses.fields(AgentConfig)
        if isinstance(hints[spec.name], type) and issubclass(hints[spec.name], _Section)
    }


@functools.cache
def _settings() -> dict[str, _Setting]:
    settings: dict[str, _Setting] = {}
    owners: list[tuple[str, type[_Section]]] = [("", AgentConfig), *_sections().items()]
    for section, cls in owners:
        hints = _type_hints(cls)
        for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
            if spec.metadata.get(_LOADED) or (not section and spec.name in _sections()):
                continue
            key = _join(section, spec.name)
            settings[key] = _Setting(key, section, spec.name, _kind(hints[spec.name]),
                                     env_var_name(key))
    env_vars = [setting.env_var for setting in settings.values()]
    if len(set(env_vars)) != len(env_vars) or NON_CONFIG_ENV_VARS & set(env_vars):
        raise InternalError(f"two configuration keys share an environment variable: {env_vars}")
    return settings


def _join(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


# --------------------------------------------------------------------------------------------------
# Errors


def _show(value: object) -> str:
    """A value in one short line, TOML-like (strings quoted, booleans lower case)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (str, Path)):
        text = json.dumps(str(value))
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_show(item) for item in value) + "]"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _invalid(key: str, expected: str, found: object) -> ConfigError:
    return ConfigError(f"invalid value for '{key}'", key=key, expected=expected, found=_show(found))


def _with_origin(exc: ConfigError, origin: Mapping[str, Any] | None) -> ConfigError:
    located = ConfigError(exc.message, **{**exc.fields, **(origin or {})})
    located.__cause__ = exc.__cause__
    return located


# --------------------------------------------------------------------------------------------------
# Loading


def load_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    extra_public_keys: Sequence[Path] = (),
) -> AgentConfig:
    """Read, layer and validate the configuration; read the token file and the trusted keys.

    Args:
        path: The TOML file. None: ``$EDGE_AGENT_CONFIG``, else :data:`DEFAULT_CONFIG_PATH`, which
            may be absent (then the defaults apply). A file given here or by the variable must
            exist.
        env: The environment (default ``os.environ``); ``EDGE_AGENT_*`` variables override keys.
        overrides: Dotted keys to values, from command-line flags; they win over everything. A
            string is parsed as environment text is; other values must have the key's type.
        extra_public_keys: Trusted keys added to ``trust.public_keys`` (``--pubkey``).

    Returns:
        The validated configuration, with ``http.token`` and ``trust.keys`` loaded.

    Raises:
        ConfigError: an unreadable or invalid file, an unknown key, section or ``EDGE_AGENT_*``
            variable, a value of the wrong type or out of range, an unreadable token or key file.
            It names the key and, where known, the file and line or the variable.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, dict[str, Any]] = {}

    config_path, explicit = _choose_path(path, environ)
    text = _read_text(config_path, explicit)
    if text is not None:
        _collect_file(config_path, text, values, origins)
    _collect_env(environ, values, origins)
    _collect_overrides(overrides or {}, values, origins)

    config = _build(values, origins)
    config = dataclasses.replace(
        config,
        http=_load_token(config.http, origins.get("http.token_file")),
        trust=_load_keys(config.trust, origins.get("trust.public_keys")),
    )
    if extra_public_keys:
        extra = _load_keys(dataclasses.replace(config.trust, public_keys=tuple(
            map(Path, extra_public_keys))), {"source": "--pubkey"})
        config = dataclasses.replace(config, trust=dataclasses.replace(
            config.trust, public_keys=(*config.trust.public_keys, *extra.public_keys),
            keys=(*config.trust.keys, *extra.keys)))
    if config.http.token is None and not _is_loopback(config.http.host):
        log.warning(
            "the inference API listens on %s without a bearer token (http.token_file)",
            config.http.host,
        )
    return config


def _choose_path(path: Path | None, environ: Mapping[str, str]) -> tuple[Path, bool]:
    if path is not None:
        return Path(path), True
    from_env = environ.get(CONFIG_PATH_ENV_VAR)
    if from_env:
        return Path(from_env), True
    return DEFAULT_CONFIG_PATH, False


def _read_text(path: Path, explicit: bool) -> str | None:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        if not explicit:
            log.debug("no configuration file at %s: using the defaults", path)
            return None
        raise ConfigError("configuration file not found", path=path) from None
    except OSError as exc:
        raise ConfigError("cannot read the configuration file", path=path,
                          reason=exc.strerror) from exc
    try:
        return data.decode("utf-8-sig")  # an editor's byte order mark is not an error
    except UnicodeDecodeError as exc:
        raise ConfigError("configuration file is not UTF-8", path=path, reason=str(exc)) from exc


def _collect_file(
    path: Path, text: str, values: dict[str, Any], origins: dict[str, dict[str, Any]]
) -> None:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("invalid TOML", path=path, reason=str(exc)) from exc
    settings = _settings()
    sections = _sections()
    base = path.absolute().parent

    def where(key: str) -> dict[str, Any]:
        return {"path": path, "line": _line_of(text, key)}

    entries: list[tuple[str, Any]] = []
    for top_key, top_value in document.items():
        if top_key in sections:
            if not isinstance(top_value, dict):
                raise ConfigError(
                    f"'{top_key}' must be a table", key=top_key, expected=f"a table [{top_key}]",
                    found=_show_toml(top_value), **where(top_key),
                )
            entries.extend((f"{top_key}.{name}", value) for name, value in top_value.items())
        elif top_key in settings:
            entries.append((top_key, top_value))
        elif isinstance(top_value, dict):
            raise ConfigError(
                "unknown configuration section", key=top_key,
                expected="one of " + ", ".join(f"[{name}]" for name in sections),
                **where(top_key),
            )
        else:
            raise _unknown_key(top_key, where(top_key))
    for key, raw in entries:
        setting = settings.get(key)
        if setting is None:
            raise _unknown_key(key, where(key))
        try:
            value = setting.kind.rebase(setting.kind.from_toml(raw), base)
        except (ValueError, TypeError):
            raise ConfigError(
                f"invalid value for '{key}'", key=key, expected=setting.kind.expected,
                found=_show_toml(raw), **where(key),
            ) from None
        values[key] = value
        origins[key] = where(key)


def _collect_env(
    environ: Mapping[str, str], values: dict[str, Any], origins: dict[str, dict[str, Any]]
) -> None:
    by_variable = {setting.env_var: setting for setting in _settings().values()}
    for variable in sorted(environ):
        if not variable.startswith(ENV_PREFIX) or variable in NON_CONFIG_ENV_VARS:
            continue
        setting = by_variable.get(variable)
        if setting is None:
            close = difflib.get_close_matches(variable, list(by_variable), n=1)
            raise ConfigError(
                "unknown EDGE_AGENT_* environment variable", variable=variable,
                hint=f"did you mean {close[0]}?" if close else None,
            )
        text = environ[variable]
        try:
            values[setting.key] = setting.kind.from_text(text)
        except (ValueError, LookupError):
            raise ConfigError(
                f"invalid value for '{setting.key}'", key=setting.key,
                expected=setting.kind.expected_text, found=_show(text), variable=variable,
            ) from None
        origins[setting.key] = {"variable": variable}


def _collect_overrides(
    overrides: Mapping[str, object], values: dict[str, Any], origins: dict[str, dict[str, Any]]
) -> None:
    settings = _settings()
    origin = {"source": "command line"}
    for key, raw in overrides.items():
        setting = settings.get(key)
        if setting is None:
            raise _unknown_key(key, origin)
        try:
            if isinstance(raw, str):
                value = setting.kind.from_text(raw)
            else:
                value = setting.kind.from_toml(raw)
        except (ValueError, LookupError, TypeError):
            expected = setting.kind.expected_text if isinstance(raw, str) else setting.kind.expected
            raise ConfigError(
                f"invalid value for '{key}'", key=key, expected=expected, found=_show(raw),
                **origin,
            ) from None
        values[key] = value
        origins[key] = origin


def _build(values: Mapping[str, Any], origins: Mapping[str, dict[str, Any]]) -> AgentConfig:
    """Construct every section and the whole; a validation error gains the value's origin."""
    settings = _settings()

    def arguments(section: str) -> dict[str, Any]:
        return {
            setting.name: values[key]
            for key, setting in settings.items()
            if setting.section == section and key in values
        }

    try:
        top_level: dict[str, Any] = arguments("")
        for section, cls in _sections().items():
            top_level[section] = cls(**arguments(section))
        return AgentConfig(**top_level)
    except ConfigError as exc:
        raise _with_origin(exc, origins.get(exc.fields.get("key", ""))) from None


def _unknown_key(key: str, origin: Mapping[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(key, list(_settings()), n=1)
    return ConfigError(
        "unknown configuration key", key=key,
        hint=f"did you mean '{close[0]}'?" if close else None, **origin,
    )


_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
               dict: "table"}


def _show_toml(value: object) -> str:
    type_name = _TOML_TYPES.get(type(value), type(value).__name__)
    return f"{_show(value)} ({type_name})"


_TABLE_HEADER = re.compile(r"^\s*\[(?!\[)([^\]]*)\]")
_ASSIGNMENT = re.compile(r"""^\s*([A-Za-z0-9_\-."' ]+?)\s*=""")


def _line_of(text: str, key: str) -> int | None:
    """The line that sets ``key`` (or opens table ``key``); best effort, None when not found."""
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = _TABLE_HEADER.match(line)
        if header:
            table = _normal_key(header.group(1))
            if table == key:
                return number
            continue
        assignment = _ASSIGNMENT.match(line)
        if assignment and _join(table, _normal_key(assignment.group(1))) == key:
            return number
    return None


def _normal_key(text: str) -> str:
    return re.sub(r"\s*\.\s*", ".", text.strip()).replace('"', "").replace("'", "")


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


# --------------------------------------------------------------------------------------------------
# Files read at start


def _load_token(http: HttpConfig, origin: Mapping[str, Any] | None) -> HttpConfig:
    if http.token_file is None:
        return http
    path = http.token_file

    def fail(message: str, **fields: Any) -> ConfigError:
        # The origin's ``path`` (the config file) would collide with the token file's.
        located = {("config_" + name if name in ("path", "line") else name): value
                   for name, value in (origin or {}).items()}
        return ConfigError(message, key="http.token_file", path=path, **fields, **located)

    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise fail("token file is not a regular file")
            data = handle.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise fail("cannot read the token file", reason=exc.strerror) from None
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise fail("token file is too large", expected=f"<= {MAX_TOKEN_FILE_BYTES} bytes")
    # Nothing of the content goes into an error: a near-miss token is still mostly a token.
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise fail("token file is not ASCII") from None
    if not token:
        raise fail("token file is empty")
    if any(not 0x21 <= ord(character) <= 0x7E for character in token):
        raise fail("token must be one line of printable ASCII without spaces")
    if mode & stat.S_IROTH:
        log.warning("token file %s is readable by every user on this machine", path)
    return dataclasses.replace(http, token=Secret(token))


def _load_keys(trust: TrustConfig, origin: Mapping[str, Any] | None) -> TrustConfig:
    keys = []
    for path in trust.public_keys:
        try:
            keys.append(load_public_key(path))
        except KeyFileError as exc:
            located = {("config_" + name if name in ("path", "line") else name): value
                       for name, value in (origin or {}).items()}
            raise ConfigError(
                f"cannot load a trusted public key: {exc.message}", key="trust.public_keys",
                path=path, **{name: value for name, value in exc.fields.items() if name != "path"},
                **located,
            ) from exc
    return dataclasses.replace(trust, keys=tuple(keys))
