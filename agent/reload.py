"""Reloading the configuration in a running daemon (SIGHUP, ``systemctl reload``).

What can change without a restart is applied at once: the log level, the batching settings that do
not size anything (the queue delay, adaptive delay, queue limit, default timeout and priority,
preferred batch sizes within the batch size in force), the trusted bundle keys, and the power
policy's keys when the daemon governs power (not where the board is, nor the periods). Everything else that differs from the configuration in force
(the listen address, the backend, instances, the state directory, the fleet connection...) is
named as needing a restart and left as it is: the daemon keeps running on a consistent
configuration, the one it started with plus what was applied.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.config import AgentConfig

if TYPE_CHECKING:
    from agent.daemon import Daemon

log = logging.getLogger(__name__)

BATCHING_KEYS = ("max_queue_delay_us", "adaptive_delay", "max_queue_size", "default_timeout_us",
                 "default_priority_level", "preferred_batch_sizes")
"""``[serving]`` keys a running batcher takes (see :func:`_batching`)."""


@dataclass(frozen=True)
class ReloadResult:
    applied: tuple[str, ...]  # dotted keys now in force
    needs_restart: tuple[str, ...]  # dotted keys that differ but wait for a restart

    def summary(self) -> str:
        parts = [("applied " + ", ".join(self.applied)) if self.applied else "nothing changed"]
        if self.needs_restart:
            parts.append("needs a restart: " + ", ".join(self.needs_restart))
        return "; ".join(parts)


def flatten(document: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"http": {"port": 1}}`` as ``{"http.port": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def changed_keys(old: AgentConfig, new: AgentConfig) -> list[str]:
    """The dotted keys whose values differ (the trusted keys by their contents, too)."""
    before, after = flatten(old.to_dict()), flatten(new.to_dict())
    keys = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    if "trust.public_keys" not in keys and _key_bytes(old) != _key_bytes(new):
        keys.append("trust.public_keys")  # the same files, rewritten with other keys
    return keys


def _key_bytes(config: AgentConfig) -> set[bytes]:
    from cryptography.hazmat.primitives import serialization

    return {key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            for key in config.trust.keys}


def _reloadable(key: str, power_reloads: bool) -> bool:
    section, _, name = key.partition(".")
    if key == "log.level" or key == "trust.public_keys":
        return True
    if section == "serving":
        return name in BATCHING_KEYS
    if section == "power" and power_reloads:
        from agent.power.policy import POLICY_KEYS

        return name in POLICY_KEYS  # the board's root, the periods, enabled: at the start only
    return False


def reload(daemon: Daemon, new: AgentConfig) -> ReloadResult:
    """Apply what can change of ``new`` to the running ``daemon`` (call on its event loop) and
    make the daemon's configuration the old one with those changes."""
    from agent.log import apply_level

    old = daemon.config
    power = getattr(daemon, "power", None)
    power_reloads = power is not None and callable(getattr(power, "reload", None))
    changed = changed_keys(old, new)
    applied = [key for key in changed if _reloadable(key, power_reloads)]
    waiting = [key for key in changed if key not in applied]
    config = old
    if "log.level" in applied:
        apply_level(new.log.level)
        config = dataclasses.replace(config, log=new.log)
    if "trust.public_keys" in applied:
        daemon.store.set_trusted_keys(new.trust.keys)
        config = dataclasses.replace(config, trust=new.trust)
    if any(key.startswith("serving.") for key in applied):
        serving = dataclasses.replace(config.serving, **{
            name: getattr(new.serving, name) for name in BATCHING_KEYS})
        config = dataclasses.replace(config, serving=serving)
        _batching(daemon, serving)
    if power_reloads and any(key.startswith("power.") for key in applied):
        from agent.power.policy import POLICY_KEYS

        power.reload(new.power)  # type: ignore[union-attr]
        config = dataclasses.replace(config, power=dataclasses.replace(config.power, **{
            name: getattr(new.power, name) for name in POLICY_KEYS}))
    daemon.config = config
    result = ReloadResult(tuple(applied), tuple(waiting))
    log.info("configuration reloaded: %s", result.summary())
    return result


def _batching(daemon: Daemon, serving: Any) -> None:
    """Hand every running batcher the new settings, within the batch size and priority levels
    its buffers and queues were made for."""
    for service in daemon.services.values():
        policy = service.batcher.policy
        preferred = tuple(size for size in serving.preferred_batch_sizes
                          if size <= policy.max_batch_size)
        service.batcher.policy = dataclasses.replace(
            policy, max_queue_delay_us=serving.max_queue_delay_us,
            adaptive_delay=serving.adaptive_delay, max_queue_size=serving.max_queue_size,
            default_timeout_us=serving.default_timeout_us,
            default_priority_level=min(serving.resolved_default_priority_level,
                                       policy.priority_levels),
            preferred_batch_sizes=preferred or policy.preferred_batch_sizes)


__all__ = ["BATCHING_KEYS", "ReloadResult", "changed_keys", "flatten", "reload"]
