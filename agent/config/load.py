"""Loading the configuration (design §5.6): the TOML file, the environment and command-line flags.

Values are layered, each layer overriding the one before::

    defaults  <  the TOML file  <  EDGE_AGENT_* environment variables  <  command-line overrides

and the result is validated once, at start. An error names the key (``serving.max_batch_size``),
the expected form and what was found, plus where the value came from: the file and line, the
environment variable, or the command line. Unknown sections, keys and ``EDGE_AGENT_*`` variables
are errors too, because a typo that passes silently leaves a setting at a default nobody chose.

Environment text is parsed by the key's type (agent/config/kinds.py): integers,
``true/false/1/0/yes/no``, comma-separated lists, paths. Relative paths in the file are taken
relative to the file's directory, so a configuration and its key files can travel together;
relative paths from the environment or the command line are taken as given (relative to the
working directory, ``/`` under systemd).

Only :func:`load_config` does I/O: it reads the file, the bearer-token file and the trusted public
keys (agent/config/secrets.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.config.kinds import show, show_toml
from agent.config.schema import (
    CONFIG_PATH_ENV_VAR,
    ENV_PREFIX,
    NON_CONFIG_ENV_VARS,
    AgentConfig,
    join,
    sections,
    settings,
)
from agent.config.secrets import load_trusted_keys, read_token_file
from agent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6 ships Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = Path("/etc/edge-agent/agent.toml")


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
    http, trust = config.http, config.trust
    if http.token_file is not None:
        http = dataclasses.replace(http, token=read_token_file(
            http.token_file, origins.get("http.token_file")))
    keys = load_trusted_keys(trust.public_keys, origins.get("trust.public_keys"))
    extra_paths = tuple(map(Path, extra_public_keys))
    extra_keys = load_trusted_keys(extra_paths, {"source": "--pubkey"})
    fleet = config.fleet
    if fleet.enabled:  # a disabled fleet's files need not exist
        fleet = dataclasses.replace(
            fleet, keys=load_trusted_keys(fleet.public_keys, origins.get("fleet.public_keys"),
                                          key="fleet.public_keys"),
            password=None if fleet.password_file is None else read_token_file(
                fleet.password_file, origins.get("fleet.password_file"),
                key="fleet.password_file", what="password"))
    config = dataclasses.replace(config, http=http, fleet=fleet, trust=dataclasses.replace(
        trust, public_keys=(*trust.public_keys, *extra_paths), keys=(*keys, *extra_keys)))
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
    known = settings()
    tables = sections()
    base = path.absolute().parent

    def where(key: str) -> dict[str, Any]:
        return {"path": path, "line": _line_of(text, key)}

    entries: list[tuple[str, Any]] = []
    for top_key, top_value in document.items():
        if top_key in tables:
            if not isinstance(top_value, dict):
                raise ConfigError(
                    f"'{top_key}' must be a table", key=top_key, expected=f"a table [{top_key}]",
                    found=show_toml(top_value), **where(top_key),
                )
            entries.extend((f"{top_key}.{name}", value) for name, value in top_value.items())
        elif top_key in known:
            entries.append((top_key, top_value))
        elif isinstance(top_value, dict):
            raise ConfigError(
                "unknown configuration section", key=top_key,
                expected="one of " + ", ".join(f"[{name}]" for name in tables),
                **where(top_key),
            )
        else:
            raise _unknown_key(top_key, where(top_key))
    for key, raw in entries:
        setting = known.get(key)
        if setting is None:
            raise _unknown_key(key, where(key))
        try:
            value = setting.kind.rebase(setting.kind.from_toml(raw), base)
        except (ValueError, TypeError):
            raise ConfigError(
                f"invalid value for '{key}'", key=key, expected=setting.kind.expected,
                found=show_toml(raw), **where(key),
            ) from None
        values[key] = value
        origins[key] = where(key)


def _collect_env(
    environ: Mapping[str, str], values: dict[str, Any], origins: dict[str, dict[str, Any]]
) -> None:
    by_variable = {setting.env_var: setting for setting in settings().values()}
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
                expected=setting.kind.expected_text, found=show(text), variable=variable,
            ) from None
        origins[setting.key] = {"variable": variable}


def _collect_overrides(
    overrides: Mapping[str, object], values: dict[str, Any], origins: dict[str, dict[str, Any]]
) -> None:
    known = settings()
    origin = {"source": "command line"}
    for key, raw in overrides.items():
        setting = known.get(key)
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
                f"invalid value for '{key}'", key=key, expected=expected, found=show(raw),
                **origin,
            ) from None
        values[key] = value
        origins[key] = origin


def _build(values: Mapping[str, Any], origins: Mapping[str, dict[str, Any]]) -> AgentConfig:
    """Construct every section and the whole; a validation error gains the value's origin."""
    known = settings()

    def arguments(section: str) -> dict[str, Any]:
        return {
            setting.name: values[key]
            for key, setting in known.items()
            if setting.section == section and key in values
        }

    try:
        top_level: dict[str, Any] = arguments("")
        for section, cls in sections().items():
            top_level[section] = cls(**arguments(section))
        return AgentConfig(**top_level)
    except ConfigError as exc:
        raise _with_origin(exc, origins.get(exc.fields.get("key", ""))) from None


def _unknown_key(key: str, origin: Mapping[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(key, list(settings()), n=1)
    return ConfigError(
        "unknown configuration key", key=key,
        hint=f"did you mean '{close[0]}'?" if close else None, **origin,
    )


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
        if assignment and join(table, _normal_key(assignment.group(1))) == key:
            return number
    return None


def _normal_key(text: str) -> str:
    return re.sub(r"\s*\.\s*", ".", text.strip()).replace('"', "").replace("'", "")


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _with_origin(exc: ConfigError, origin: Mapping[str, Any] | None) -> ConfigError:
    """``exc`` with the fields that say where its value came from."""
    located = ConfigError(exc.message, **{**exc.fields, **(origin or {})})
    located.__cause__ = exc.__cause__
    return located

