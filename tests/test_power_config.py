"""``[power]`` in the configuration and the policy the daemon derives from it
(agent/config/schema.py's PowerConfig, agent/power/policy.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import agent.config.load as config_load
from agent.config import AgentConfig, PowerConfig, load_config
from agent.errors import ConfigError
from agent.power.policy import (
    POLICY_KEYS,
    parse_assignment,
    policy_from_config,
    policy_to_json,
    with_changes,
)
from power.types import PowerPolicy


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "agent.toml")


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> AgentConfig:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return load_config(path, env=env or {})


def test_power_is_off_by_default_and_its_defaults_are_the_policys() -> None:
    config = AgentConfig()
    assert config.power.enabled is False
    assert config.power.root == Path("/")
    # The configuration's defaults are the governor's: nothing differs until a key is set.
    assert policy_from_config(config.power) == PowerPolicy()
    assert set(POLICY_KEYS) <= {spec.name for spec in dataclasses.fields(PowerConfig)}


def test_power_section_from_file_and_environment(tmp_path: Path) -> None:
    config = load_text(tmp_path, '[power]\nenabled = true\nroot = "board"\nprofile = "max"\n'
                       "power_cap_mw = 7000\nlatency_target_s = 0.02\n",
                       env={"EDGE_AGENT_POWER_CONTROL_PERIOD_S": "0.1"})
    power = config.power
    assert power.enabled and power.profile == "max"
    assert power.root == tmp_path / "board"  # relative to the file, as every path
    assert power.control_period_s == 0.1
    policy = policy_from_config(power)
    assert policy.power_cap_mw == 7000 and policy.latency_target_s == 0.02
    assert policy.sleep_nvpmodel_mode is None


@pytest.mark.parametrize(("text", "key"), [
    ('profile = "turbo"', "power.profile"),
    ("latency_target_s = 0", "power.latency_target_s"),
    ("percentile = 1.5", "power.percentile"),
    ("power_cap_mw = -1", "power.power_cap_mw"),
    ("idle_after_s = 5.0\nsleep_after_s = 2.0", "power.sleep_after_s"),
    ("sleep_nvpmodel_mode = 1", "power.sleep_nvpmodel_mode"),  # needs allow_nvpmodel
    ("control_period_s = 0.001", "power.control_period_s"),
    ("telemetry_period_s = 0.06\ncontrol_period_s = 0.5", "power.telemetry_period_s"),
    ('wake_timeout_s = "1s"', "power.wake_timeout_s"),
    ("bogus = 1", "power.bogus"),
    ('board = "orin-nano-9000"', "power.board"),  # was only found when the board opened
])
def test_bad_power_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_text(tmp_path, f"[power]\n{text}\n")
    assert excinfo.value.fields.get("key") == key, excinfo.value


def test_a_board_profile_or_its_alias_is_accepted(tmp_path: Path) -> None:
    for name in ("orin-nano", "agx-orin-64gb", "xavier-nx"):
        assert load_text(tmp_path, f'[power]\nboard = "{name}"\n').power.board == name


def test_sleep_mode_with_nvpmodel_allowed() -> None:
    power = PowerConfig(allow_nvpmodel=True, sleep_nvpmodel_mode=1)
    assert policy_from_config(power).sleep_nvpmodel_mode == 1


def test_with_changes_validates_as_the_file_does() -> None:
    base = PowerConfig(enabled=True)
    changed = with_changes(base, {"profile": "min", "power_cap_mw": 5000,
                                  "latency_target_s": 1})
    assert (changed.profile, changed.power_cap_mw, changed.latency_target_s) == ("min", 5000,
                                                                               1.0)
    assert changed.enabled and changed.root == base.root  # only policy keys change
    assert with_changes(changed, {"power_cap_mw": None}).power_cap_mw == 0
    for changes, key in (({"profile": "fast"}, "power.profile"),
                         ({"latency_target_s": "fast"}, "power.latency_target_s"),
                         ({"percentile": True}, "power.percentile"),
                         ({"root": "/tmp"}, "power.root"),  # not a policy key
                         ({"idle_after_s": 20.0}, "power.sleep_after_s")):
        with pytest.raises(ConfigError) as excinfo:
            with_changes(base, changes)
        assert excinfo.value.fields.get("key") == key, (changes, excinfo.value)


def test_policy_json_round_trips_through_with_changes() -> None:
    policy = policy_from_config(PowerConfig(power_cap_mw=9000, profile="max"))
    shown = policy_to_json(policy)
    assert shown["power_cap_mw"] == 9000 and shown["profile"] == "max"
    assert policy_from_config(with_changes(PowerConfig(), shown)) == policy


def test_parse_assignment() -> None:
    assert parse_assignment("latency_target_s=0.03") == ("latency_target_s", 0.03)
    assert parse_assignment("allow_nvpmodel=yes") == ("allow_nvpmodel", True)
    assert parse_assignment("power_cap_mw=none") == ("power_cap_mw", None)
    for text, key in (("latency_target_s", "power"), ("speed=3", "power.speed"),
                      ("power_cap_mw=lots", "power.power_cap_mw")):
        with pytest.raises(ConfigError) as excinfo:
            parse_assignment(text)
        assert excinfo.value.fields.get("key") == key
