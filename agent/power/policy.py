"""The power policy as the daemon holds it: ``[power]`` in the configuration, changed at run
time by ``desired.power`` (fleet), ``edge-agent power set`` (the control channel) and a reload.

:func:`policy_from_config` turns the ``[power]`` section into the governor's
:class:`~power.types.PowerPolicy` (the configuration writes 0 and -1 where the policy has
``None``). :func:`with_changes` applies a JSON object of policy keys (``{"profile": "max"}``) to a
section and validates the result as the configuration file would be, so a bad value from the
fleet or the command line is refused with the same error, naming ``power.<key>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agent.config import PowerConfig
from agent.config.kinds import invalid, kind_of
from agent.config.schema import type_hints
from agent.errors import ConfigError
from power.types import PowerPolicy

__all__ = ["POLICY_KEYS", "parse_assignment", "policy_from_config", "policy_to_json",
           "with_changes"]

POLICY_KEYS: tuple[str, ...] = tuple(spec.name for spec in dataclasses.fields(PowerPolicy))
"""The ``[power]`` keys that are the policy's (the others say where the board is and how often
to step: they need a restart)."""


def policy_from_config(config: PowerConfig) -> PowerPolicy:
    """The governor's policy of a ``[power]`` section."""
    return PowerPolicy(
        profile=config.profile, latency_target_s=config.latency_target_s,
        percentile=config.percentile,
        power_cap_mw=config.power_cap_mw or None,
        idle_after_s=config.idle_after_s, sleep_after_s=config.sleep_after_s,
        sleep_nvpmodel_mode=(config.sleep_nvpmodel_mode if config.sleep_nvpmodel_mode >= 0
                             else None),
        release_engine_in_sleep=config.release_engine_in_sleep,
        thermal_margin_c=config.thermal_margin_c, max_changes_per_s=config.max_changes_per_s,
        allow_nvpmodel=config.allow_nvpmodel)


def policy_to_json(policy: PowerPolicy) -> dict[str, Any]:
    """``policy`` as the status, ``reported.power`` and ``power set`` show it."""
    return dataclasses.asdict(policy)


def with_changes(config: PowerConfig, changes: Mapping[str, Any]) -> PowerConfig:
    """``config`` with the policy keys of ``changes`` (JSON values: ``null`` for no power cap or
    no sleep mode), validated as the configuration file is.

    Raises:
        ConfigError: a key that is not a policy key, a value of the wrong type, or one out of
            bounds; ``key`` names it as ``power.<key>``.
    """
    if not isinstance(changes, Mapping):
        raise ConfigError("the power policy changes must be an object of policy keys",
                          key="power", found=type(changes).__name__)
    hints = type_hints(PowerConfig)
    values: dict[str, Any] = {}
    for name, value in changes.items():
        key = f"power.{name}"
        if name not in POLICY_KEYS:
            raise ConfigError("not a power policy key", key=key,
                              expected="one of " + ", ".join(POLICY_KEYS))
        if value is None and name == "power_cap_mw":
            value = 0
        elif value is None and name == "sleep_nvpmodel_mode":
            value = -1
        kind = kind_of(hints[name])
        try:
            values[name] = kind.from_toml(value)
        except (TypeError, ValueError):
            raise invalid(key, kind.expected, value) from None
        except ConfigError as exc:
            raise invalid(key, kind.expected, value) from exc
    return dataclasses.replace(config, **values)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line (``latency_target_s=0.03``, ``power_cap_mw=none``)
    as a policy key and its JSON value.

    Raises:
        ConfigError: not ``KEY=VALUE``, not a policy key, or a value that does not parse.
    """
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals or not name:
        raise ConfigError("expected KEY=VALUE", key="power", found=text)
    key = f"power.{name}"
    if name not in POLICY_KEYS:
        raise ConfigError("not a power policy key", key=key,
                          expected="one of " + ", ".join(POLICY_KEYS))
    if name in ("power_cap_mw", "sleep_nvpmodel_mode") and value.strip().lower() in ("none",
                                                                                     ""):
        return name, None
    kind = kind_of(type_hints(PowerConfig)[name])
    try:
        return name, kind.from_text(value)
    except (ValueError, LookupError):
        raise ConfigError(f"invalid value for '{key}'", key=key, expected=kind.expected_text,
                          found=value) from None
