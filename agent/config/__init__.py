"""The daemon's configuration (design §5.6): one TOML file, ``EDGE_AGENT_*`` variables and flags.

- ``schema``: the sections as frozen dataclasses, validated on construction, and the key table.
- ``kinds``: how each value type is read from TOML or text and shown.
- ``load``: :func:`load_config`, layering defaults, the file, the environment and the command line,
  with errors that say where a bad value came from.
- ``secrets``: the bearer token (a :class:`Secret`) and the trusted public keys, read at start.
"""

from agent.config.load import DEFAULT_CONFIG_PATH, load_config
from agent.config.schema import (
    CONFIG_PATH_ENV_VAR,
    DEFAULT_STATE_DIR,
    ENV_PREFIX,
    AgentConfig,
    FleetConfig,
    HttpConfig,
    LogConfig,
    PowerConfig,
    ServingConfig,
    StoreConfig,
    UpdateConfig,
    TensorRTConfig,
    TrustConfig,
    config_keys,
    env_var_name,
)
from agent.config.secrets import REDACTED, Secret

__all__ = [
    "CONFIG_PATH_ENV_VAR",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_STATE_DIR",
    "ENV_PREFIX",
    "REDACTED",
    "AgentConfig",
    "FleetConfig",
    "HttpConfig",
    "LogConfig",
    "PowerConfig",
    "Secret",
    "ServingConfig",
    "StoreConfig",
    "UpdateConfig",
    "TensorRTConfig",
    "TrustConfig",
    "config_keys",
    "env_var_name",
    "load_config",
]
