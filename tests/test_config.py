"""The daemon's configuration (agent/config/): layering, parsing, validation, secrets."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import agent.config.load as config_load
import agent.config.schema as config_schema
from agent.backends import BACKEND_CHOICES
from agent.config import (
    AgentConfig,
    HttpConfig,
    ServingConfig,
    config_keys,
    env_var_name,
    load_config,
)
from agent.errors import ConfigError
from models.signing import compute_key_id, write_keypair

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_FILE = REPO_ROOT / "systemd" / "agent.toml.example"
TOKEN = "s3cr3t-T0ken_value.42"

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test away from a real /etc/edge-agent/agent.toml."""
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "agent.toml")


def write_config(tmp_path: Path, text: str, name: str = "agent.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str, **kwargs: Any) -> AgentConfig:
    kwargs.setdefault("env", {})
    return load_config(write_config(tmp_path, text), **kwargs)


def config_error(**kwargs: Any) -> ConfigError:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as excinfo:
        load_config(**kwargs)
    return excinfo.value


# --------------------------------------------------------------------------------------------------
# Defaults and the example file


def test_missing_default_file_means_defaults() -> None:
    config = load_config(env={})
    assert config == AgentConfig()
    assert config.state_dir == Path("/var/lib/edge-agent")
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8000)
    assert config.http.max_body_bytes == 64 * 1024 * 1024
    assert config.http.token_file is None and config.http.token is None
    assert config.serving.backend == "auto"
    assert config.serving.max_batch_size == 32
    assert config.serving.preferred_batch_sizes == ()
    assert config.tensorrt.fp16 is True and config.tensorrt.dla_core == -1
    assert config.trust.public_keys == () and config.trust.keys == ()
    assert config.store.keep_versions == 2
    assert config.log.level == "info"


def test_default_file_is_read_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, "[http]\nport = 9100\n")
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", path)
    assert load_config(env={}).http.port == 9100


def test_example_file_loads_to_the_defaults() -> None:
    assert load_config(EXAMPLE_FILE, env={}) == AgentConfig()


def test_example_file_shows_every_key() -> None:
    document = tomllib.loads(EXAMPLE_FILE.read_text())
    shown = [
        f"{section}.{name}" if isinstance(values, dict) else section
        for section, values in document.items()
        for name in (values if isinstance(values, dict) else [None])
    ]
    assert sorted(shown) == sorted(config_keys())


def test_default_priority_is_the_lowest_level() -> None:
    assert ServingConfig().resolved_default_priority_level == 2
    # Changing only the number of levels keeps unmarked requests at the bottom.
    assert ServingConfig(priority_levels=5).resolved_default_priority_level == 5
    assert ServingConfig(default_priority_level=1).resolved_default_priority_level == 1


def test_threads_per_instance() -> None:
    assert ServingConfig().threads_per_instance(6) == 6
    assert ServingConfig(instances=4).threads_per_instance(6) == 1
    assert ServingConfig(instances=8).threads_per_instance(6) == 1  # never 0
    assert ServingConfig(instances=2, threads=3).threads_per_instance(6) == 3
    assert ServingConfig().threads_per_instance(2) == 2


def test_sections_are_frozen_and_keyword_only() -> None:
    config = AgentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        HttpConfig("0.0.0.0")  # type: ignore[misc]


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError) as excinfo:
        ServingConfig(max_batch_size=0)
    assert excinfo.value.fields["key"] == "serving.max_batch_size"
    with pytest.raises(ConfigError, match="serving.instances"):
        ServingConfig(instances="2")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# The file


def test_file_values_are_applied(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        """
        state_dir = "/data/edge"
        device_id = "orin-07"

        [http]
        host = "0.0.0.0"
        port = 8080
        access_log = true

        [serving]
        backend = "onnxruntime"
        max_batch_size = 16
        preferred_batch_sizes = [4, 16]

        [tensorrt]
        dla_core = 1
        fp16 = false

        [log]
        level = "debug"
        """,
    )
    assert config.state_dir == Path("/data/edge")
    assert config.resolved_device_id == "orin-07"
    assert (config.http.host, config.http.port, config.http.access_log) == ("0.0.0.0", 8080, True)
    assert config.serving.backend == "onnxruntime"
    assert config.serving.preferred_batch_sizes == (4, 16)
    assert (config.tensorrt.dla_core, config.tensorrt.fp16) == (1, False)
    assert config.log.level == "debug"
    assert config.serving.instances == 1  # untouched keys keep their defaults


def test_dotted_keys_at_top_level_work(tmp_path: Path) -> None:
    assert load_text(tmp_path, "serving.max_batch_size = 4\n").serving.max_batch_size == 4


def test_relative_paths_in_the_file_are_relative_to_the_file(tmp_path: Path) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    path = write_config(config_dir, 'state_dir = "state"\n[http]\ntoken_file = ""\n')
    config = load_config(path, env={})
    assert config.state_dir == config_dir.absolute() / "state"
    # From the environment a relative path is taken as given.
    config = load_config(path, env={"EDGE_AGENT_STATE_DIR": "state"})
    assert config.state_dir == Path("state")


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    error = config_error(path=tmp_path / "nope.toml")
    assert "not found" in error.message
    assert error.fields["path"] == tmp_path / "nope.toml"


def test_config_path_from_the_environment(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[http]\nport = 9200\n")
    assert load_config(env={"EDGE_AGENT_CONFIG": str(path)}).http.port == 9200
    # An explicit argument beats the variable.
    other = write_config(tmp_path, "[http]\nport = 9300\n", name="other.toml")
    assert load_config(other, env={"EDGE_AGENT_CONFIG": str(path)}).http.port == 9300
    # A file named by the variable must exist.
    error = config_error(env={"EDGE_AGENT_CONFIG": str(tmp_path / "absent.toml")})
    assert "not found" in error.message


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[http]\nport = = 1\n")
    error = config_error(path=path)
    assert error.message == "invalid TOML"
    assert error.fields["path"] == path
    assert "line 2" in error.fields["reason"]


def test_unknown_key_in_the_file_names_it_with_its_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, "# comment\n[serving]\nbackend = \"auto\"\nmax_batch = 8\n")
    error = config_error(path=path)
    assert error.message == "unknown configuration key"
    assert error.fields["key"] == "serving.max_batch"
    assert error.fields["line"] == 4
    assert "serving.max_batch_size" in error.fields["hint"]
    assert "serving.max_batch" in str(error) and str(path) in str(error)


def test_unknown_section_and_top_level_key(tmp_path: Path) -> None:
    error = config_error(path=write_config(tmp_path, "[mqttt]\nhost = \"broker\"\n"))
    assert error.message == "unknown configuration section"
    assert error.fields["key"] == "mqttt" and error.fields["line"] == 1
    assert "[serving]" in error.fields["expected"]

    error = config_error(path=write_config(tmp_path, "statedir = \"/x\"\n"))
    assert error.fields["key"] == "statedir"
    assert "state_dir" in error.fields["hint"]

    error = config_error(path=write_config(tmp_path, "[http.tls]\ncert = \"x\"\n"))
    assert error.fields["key"] == "http.tls"


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    error = config_error(path=write_config(tmp_path, "http = 8000\n"))
    assert error.fields["key"] == "http"
    assert error.fields["found"] == "8000 (integer)"


@pytest.mark.parametrize(
    ("text", "key", "found", "line"),
    [
        ('[http]\nport = "8000"\n', "http.port", '"8000" (string)', 2),
        ("[serving]\ninstances = true\n", "serving.instances", "true (boolean)", 2),
        ("[serving]\n\n\ninstances = 1.5\n", "serving.instances", "1.5 (float)", 4),
        ("[tensorrt]\nfp16 = 1\n", "tensorrt.fp16", "1 (integer)", 2),
        ("[serving]\npreferred_batch_sizes = [1, \"2\"]\n", "serving.preferred_batch_sizes",
         '[1, "2"] (array)', 2),
        ("[trust]\npublic_keys = \"/etc/k.pub\"\n", "trust.public_keys", '"/etc/k.pub" (string)', 2),
        ('state_dir = ""\n', "state_dir", '"" (string)', 1),
    ],
)
def test_wrong_type_in_the_file(tmp_path: Path, text: str, key: str, found: str, line: int) -> None:
    path = write_config(tmp_path, text)
    error = config_error(path=path)
    assert error.fields["key"] == key
    assert error.fields["found"] == found
    assert error.fields["line"] == line and error.fields["path"] == path
    assert error.fields["expected"]


def test_out_of_range_value_in_the_file_has_its_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[http]\nhost = \"127.0.0.1\"\nport = 70000\n")
    error = config_error(path=path)
    assert error.fields["key"] == "http.port"
    assert error.fields["expected"] == "an integer in 0..65535"
    assert error.fields["found"] == "70000"
    assert (error.fields["path"], error.fields["line"]) == (path, 3)


# --------------------------------------------------------------------------------------------------
# Validation rules, one key at a time (through overrides, which use the same checks as the file)

INVALID_VALUES = [
    ("state_dir", "", "a path"),
    ("device_id", "orin/07", "[A-Za-z0-9]"),
    ("device_id", "orin 07", "[A-Za-z0-9]"),
    ("http.host", "", "host name"),
    ("http.host", "127.0.0.1 8000", "host name"),
    ("http.port", -1, "0..65535"),
    ("http.port", 65536, "0..65535"),
    ("http.max_body_bytes", 1023, ">= 1024"),
    ("serving.backend", "tensorflow", '"onnxruntime"'),
    ("serving.instances", 0, "1..64"),
    ("serving.instances", 65, "1..64"),
    ("serving.threads", -1, "0..256"),
    ("serving.threads", 100_000, "0..256"),
    ("serving.max_batch_size", 0, ">= 1"),
    ("serving.max_queue_delay_us", -1, ">= 0"),
    ("serving.preferred_batch_sizes", [0, 8], "1..max_batch_size (32)"),
    ("serving.preferred_batch_sizes", [8, 33], "1..max_batch_size (32)"),
    ("serving.preferred_batch_sizes", [8, 8], "distinct"),
    ("serving.max_queue_size", -1, ">= 0"),
    ("serving.default_timeout_us", -1, ">= 0"),
    ("serving.priority_levels", 0, "1..100"),
    ("serving.priority_levels", 1_000_000_000, "1..100"),
    ("serving.default_priority_level", -1, ">= 0"),
    ("serving.default_priority_level", 3, "1..priority_levels (2)"),
    ("serving.warmup_batches", -1, ">= 0"),
    ("tensorrt.workspace_mib", 0, ">= 1"),
    ("tensorrt.dla_core", -2, "-1..1"),
    ("tensorrt.dla_core", 2, "-1..1"),
    ("tensorrt.optimization_level", -1, "0..5"),
    ("tensorrt.optimization_level", 6, "0..5"),
    ("store.keep_versions", 1, ">= 2"),
    ("log.level", "verbose", '"warning"'),
]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    INVALID_VALUES,
    ids=[f"{key}={value!r}" for key, value, _ in INVALID_VALUES],
)
def test_invalid_values_name_key_expected_and_found(key: str, value: object, expected: str) -> None:
    error = config_error(overrides={key: value})
    assert error.fields["key"] == key
    assert expected in error.fields["expected"]
    assert "found" in error.fields
    assert error.fields["source"] == "command line"
    assert key in str(error)


VALID_EDGES = [
    ("http.port", 0),
    ("http.port", 65535),
    ("http.max_body_bytes", 1024),
    ("serving.threads", 0),
    ("serving.max_queue_delay_us", 0),
    ("serving.preferred_batch_sizes", [1, 32]),
    ("serving.max_queue_size", 0),
    ("serving.default_priority_level", 2),
    ("serving.warmup_batches", 0),
    ("tensorrt.dla_core", 0),
    ("tensorrt.optimization_level", 0),
    ("tensorrt.optimization_level", 5),
    ("device_id", "orin-nx_07.lab"),
    ("http.host", "::1"),
    *[("serving.backend", name) for name in BACKEND_CHOICES],
    *[("log.level", level) for level in ("debug", "info", "warning", "error")],
]


@pytest.mark.parametrize(("key", "value"), VALID_EDGES, ids=[f"{k}={v!r}" for k, v in VALID_EDGES])
def test_edge_values_are_accepted(key: str, value: object) -> None:
    config = load_config(env={}, overrides={key: value})
    section, _, name = key.rpartition(".")
    owner = getattr(config, section) if section else config
    got = getattr(owner, name)
    assert got == (tuple(value) if isinstance(value, list) else value)


def test_cross_key_rules_see_the_final_values(tmp_path: Path) -> None:
    # The file raises the limit, the command line adds sizes that need it.
    config = load_text(
        tmp_path,
        "[serving]\nmax_batch_size = 64\npriority_levels = 4\n",
        overrides={"serving.preferred_batch_sizes": "8,64", "serving.default_priority_level": 4},
    )
    assert config.serving.preferred_batch_sizes == (8, 64)
    assert config.serving.resolved_default_priority_level == 4
    # Lowering the limit in the environment makes the file's sizes invalid, and the error says so.
    path = write_config(tmp_path, "[serving]\npreferred_batch_sizes = [8, 16]\n")
    error = config_error(path=path, env={"EDGE_AGENT_SERVING_MAX_BATCH_SIZE": "8"})
    assert error.fields["key"] == "serving.preferred_batch_sizes"
    assert "max_batch_size (8)" in error.fields["expected"]
    assert error.fields["line"] == 2  # the line of the key that is out of bounds


# --------------------------------------------------------------------------------------------------
# Precedence


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "[serving]\nmax_batch_size = 8\ninstances = 2\nthreads = 3\n",
    )
    env = {"EDGE_AGENT_SERVING_INSTANCES": "4", "EDGE_AGENT_SERVING_THREADS": "5"}
    config = load_config(path, env=env, overrides={"serving.threads": 6})
    assert config.serving.warmup_batches == 2  # default
    assert config.serving.max_batch_size == 8  # file
    assert config.serving.instances == 4  # environment over file
    assert config.serving.threads == 6  # command line over environment
    assert load_config(path, env=env).serving.threads == 5
    assert load_config(path, env={}).serving.threads == 3


def test_errors_name_where_the_value_came_from(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[http]\nport = 8000\n")
    error = config_error(path=path, env={"EDGE_AGENT_HTTP_PORT": "70000"})
    assert error.fields["variable"] == "EDGE_AGENT_HTTP_PORT"
    assert "line" not in error.fields
    error = config_error(path=path, overrides={"http.port": 70000})
    assert error.fields["source"] == "command line"
    error = config_error(path=write_config(tmp_path, "[http]\nport = 70000\n"))
    assert error.fields["line"] == 2


def test_to_dict_round_trips_through_overrides(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        '[serving]\npreferred_batch_sizes = [2, 4]\n[trust]\npublic_keys = []\n[http]\nport = 0\n',
    )
    flat: dict[str, object] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": item for name, item in value.items() if name != "token"})
        else:
            flat[key] = value
    assert sorted(flat) == sorted(config_keys())
    assert load_config(env={}, overrides=flat) == config


# --------------------------------------------------------------------------------------------------
# The environment


def test_every_key_has_its_own_variable() -> None:
    names = [env_var_name(key) for key in config_keys()]
    assert len(set(names)) == len(names)
    assert env_var_name("state_dir") == "EDGE_AGENT_STATE_DIR"
    assert env_var_name("serving.max_batch_size") == "EDGE_AGENT_SERVING_MAX_BATCH_SIZE"


def test_environment_values_are_parsed_by_type(tmp_path: Path) -> None:
    env = {
        "EDGE_AGENT_STATE_DIR": "/srv/edge",
        "EDGE_AGENT_DEVICE_ID": "xavier-3",
        "EDGE_AGENT_HTTP_PORT": " 9000 ",
        "EDGE_AGENT_HTTP_ACCESS_LOG": "yes",
        "EDGE_AGENT_TENSORRT_FP16": "0",
        "EDGE_AGENT_SERVING_PREFERRED_BATCH_SIZES": "4, 8,16",
        "EDGE_AGENT_TRUST_PUBLIC_KEYS": "",
        "EDGE_AGENT_HTTP_TOKEN_FILE": "",
        "EDGE_AGENT_LOG_LEVEL": "DEBUG",  # agent/log.py has always accepted upper case
    }
    config = load_config(env=env)
    assert config.state_dir == Path("/srv/edge")
    assert config.device_id == "xavier-3"
    assert config.http.port == 9000
    assert config.http.access_log is True
    assert config.tensorrt.fp16 is False
    assert config.serving.preferred_batch_sizes == (4, 8, 16)
    assert config.trust.public_keys == ()
    assert config.http.token_file is None
    assert config.log.level == "debug"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("false", False), ("0", False),
     ("No", False)],
)
def test_environment_booleans(text: str, expected: bool) -> None:
    assert load_config(env={"EDGE_AGENT_HTTP_ACCESS_LOG": text}).http.access_log is expected


@pytest.mark.parametrize(
    ("variable", "text", "expected"),
    [
        ("EDGE_AGENT_HTTP_PORT", "eighty", "an integer"),
        ("EDGE_AGENT_HTTP_PORT", "", "an integer"),
        ("EDGE_AGENT_HTTP_PORT", "80.5", "an integer"),
        ("EDGE_AGENT_HTTP_PORT", "8_0", "an integer"),  # Python's int() would read 80
        ("EDGE_AGENT_HTTP_ACCESS_LOG", "on", "one of true, false, 1, 0, yes, no"),
        ("EDGE_AGENT_SERVING_PREFERRED_BATCH_SIZES", "4,,8", "comma-separated integers"),
        ("EDGE_AGENT_STATE_DIR", "", "a path"),
        ("EDGE_AGENT_TRUST_PUBLIC_KEYS", "/a.pub,", "comma-separated paths"),
    ],
)
def test_bad_environment_values_name_the_variable(variable: str, text: str, expected: str) -> None:
    error = config_error(env={variable: text})
    assert error.fields["variable"] == variable
    assert error.fields["expected"] == expected
    assert error.fields["found"] == f'"{text}"'
    assert variable in str(error)


def test_unknown_edge_agent_variable_is_an_error() -> None:
    error = config_error(env={"EDGE_AGENT_HTTP_PROT": "80"})
    assert error.fields["variable"] == "EDGE_AGENT_HTTP_PROT"
    assert "EDGE_AGENT_HTTP_PORT" in error.fields["hint"]


def test_variables_that_are_not_configuration_are_ignored() -> None:
    env = {
        "EDGE_AGENT_CACHE": "/tmp/cache",
        "EDGE_AGENT_REQUIRE_HOST": "1",
        "EDGE_AGENT_TEST_CACHE": "/tmp/x",
        "HOME": "/root",
        "edge_agent_http_port": "1",  # not the prefix: variable names are case-sensitive
    }
    assert load_config(env=env) == AgentConfig()


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_SERVING_MAX_QUEUE_SIZE", "17")
    assert load_config().serving.max_queue_size == 17


# --------------------------------------------------------------------------------------------------
# Command-line overrides


def test_overrides_take_text_or_typed_values(tmp_path: Path) -> None:
    config = load_config(
        env={},
        overrides={
            "http.port": "9001",
            "http.access_log": True,
            "serving.preferred_batch_sizes": [2, 4],
            "state_dir": tmp_path,
            "http.token_file": None,
        },
    )
    assert config.http.port == 9001
    assert config.http.access_log is True
    assert config.serving.preferred_batch_sizes == (2, 4)
    assert config.state_dir == tmp_path


def test_unknown_override_key_is_an_error() -> None:
    error = config_error(overrides={"serving.max_batchsize": 8})
    assert error.message == "unknown configuration key"
    assert error.fields["key"] == "serving.max_batchsize"
    assert "serving.max_batch_size" in error.fields["hint"]


def test_override_of_the_wrong_type() -> None:
    error = config_error(overrides={"http.port": 80.0})
    assert error.fields["key"] == "http.port"
    assert error.fields["expected"] == "an integer"


# --------------------------------------------------------------------------------------------------
# The bearer token


def write_token(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def test_token_is_read_and_never_shown(tmp_path: Path) -> None:
    token_file = write_token(tmp_path, TOKEN.encode() + b"\n")
    config = load_text(tmp_path, f'[http]\ntoken_file = "{token_file}"\n')
    assert config.http.token is not None
    assert config.http.token.reveal() == TOKEN
    assert config.http.token.matches(TOKEN) and config.http.token.matches(TOKEN.encode())
    assert not config.http.token.matches(TOKEN + "x")
    for text in (repr(config), str(config), repr(config.http), str(config.http.token),
                 repr(config.http.token), f"{config.http.token}", str(config.to_dict())):
        assert TOKEN not in text
    assert config.to_dict()["http"]["token"] == "<redacted>"
    assert config.to_dict()["http"]["token_file"] == str(token_file)
    assert AgentConfig().to_dict()["http"]["token"] == ""


def test_token_file_relative_to_the_config_file(tmp_path: Path) -> None:
    write_token(tmp_path, TOKEN.encode())
    config = load_text(tmp_path, '[http]\ntoken_file = "token"\n')
    assert config.http.token_file == tmp_path.absolute() / "token"
    assert config.http.token is not None and config.http.token.matches(TOKEN)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b" \n\n", "empty"),
        (TOKEN.encode() + b" " + TOKEN.encode(), "one line"),
        (TOKEN.encode() + b"\n" + TOKEN.encode(), "one line"),
        ("t\u00f6ken-".encode() + TOKEN.encode(), "ASCII"),
        (TOKEN.encode() * 400, "too large"),
    ],
)
def test_bad_token_files_are_refused_without_showing_them(
    tmp_path: Path, content: bytes, message: str
) -> None:
    token_file = write_token(tmp_path, content)
    error = config_error(overrides={"http.token_file": str(token_file)})
    assert message in error.message
    assert error.fields["key"] == "http.token_file"
    assert error.fields["path"] == token_file
    assert TOKEN not in str(error) and TOKEN not in repr(error.fields)


def test_missing_token_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[http]\ntoken_file = "missing-token"\n')
    error = config_error(path=path)
    assert error.message == "cannot read the token file"
    assert error.fields["path"] == tmp_path.absolute() / "missing-token"
    assert (error.fields["config_path"], error.fields["config_line"]) == (path, 2)


def test_world_readable_token_file_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = write_token(tmp_path, TOKEN.encode(), mode=0o644)
    with caplog.at_level(logging.WARNING, logger="agent.config"):
        load_config(env={}, overrides={"http.token_file": str(token_file)})
    assert "readable by every user" in caplog.text
    assert TOKEN not in caplog.text


def test_open_listener_without_token_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.config"):
        load_config(env={"EDGE_AGENT_HTTP_HOST": "0.0.0.0"})
    assert "without a bearer token" in caplog.text


# --------------------------------------------------------------------------------------------------
# Trusted keys and the device id


def test_trusted_keys_are_loaded_at_start(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    first = write_keypair(keys_dir / "release")
    second = write_keypair(keys_dir / "hotfix")
    config = load_text(
        tmp_path, '[trust]\npublic_keys = ["keys/release.pub", "keys/hotfix.pub"]\n'
    )
    assert config.trust.public_keys == (
        tmp_path.absolute() / "keys" / "release.pub",
        tmp_path.absolute() / "keys" / "hotfix.pub",
    )
    assert [compute_key_id(key) for key in config.trust.keys] == [
        compute_key_id(first.public_key()),
        compute_key_id(second.public_key()),
    ]


def test_a_private_key_as_trusted_key_is_refused(tmp_path: Path) -> None:
    write_keypair(tmp_path / "release")
    error = config_error(overrides={"trust.public_keys": [str(tmp_path / "release")]})
    assert error.fields["key"] == "trust.public_keys"
    assert error.fields["path"] == tmp_path / "release"
    assert "private key" in error.message


def test_pubkey_keys_are_added_to_the_files_in_one_load(tmp_path: Path, caplog) -> None:
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    release = write_keypair(keys_dir / "release")
    extra = write_keypair(keys_dir / "extra")
    path = write_config(tmp_path, '[trust]\npublic_keys = ["keys/release.pub"]\n'
                                  '[http]\nhost = "0.0.0.0"\n')
    with caplog.at_level(logging.WARNING, logger="agent.config"):
        config = load_config(path, env={}, extra_public_keys=[keys_dir / "extra.pub"])
    assert [compute_key_id(key) for key in config.trust.keys] == [
        compute_key_id(release.public_key()), compute_key_id(extra.public_key())]
    assert len([r for r in caplog.records if "without a bearer token" in r.getMessage()]) == 1
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={}, extra_public_keys=[tmp_path / "missing.pub"])
    assert excinfo.value.fields["source"] == "--pubkey"
    assert "config_line" not in excinfo.value.fields


def test_a_missing_trusted_key_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[trust]\npublic_keys = ["/nonexistent/release.pub"]\n')
    error = config_error(path=path)
    assert error.fields["key"] == "trust.public_keys"
    assert error.fields["path"] == Path("/nonexistent/release.pub")
    assert error.fields["config_line"] == 2


def test_device_id_defaults_to_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_schema.socket, "gethostname", lambda: "jetson-orin-12")
    assert AgentConfig().resolved_device_id == "jetson-orin-12"
    assert AgentConfig(device_id="cam-3").resolved_device_id == "cam-3"
    monkeypatch.setattr(config_schema.socket, "gethostname", lambda: "bad host")
    with pytest.raises(ConfigError) as excinfo:
        AgentConfig().resolved_device_id  # noqa: B018
    assert excinfo.value.fields["key"] == "device_id"


def test_toml_parser_matches_the_python_version() -> None:
    # Python 3.10 (JetPack 6) has no tomllib; tomli is its dependency there.
    expected = "tomllib" if sys.version_info >= (3, 11) else "tomli"
    assert config_load.tomllib.__name__ == expected


def test_a_byte_order_mark_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_bytes(b"\xef\xbb\xbf[serving]\nmax_batch_size = 8\n")
    assert load_config(path, env={}).serving.max_batch_size == 8


def test_an_empty_state_dir_flag_is_refused_not_taken_for_the_working_directory(
        capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["serve", "--state-dir", "", "--print-config"]) == 1
    assert "'state_dir'" in capsys.readouterr().err


def test_update_settings_are_numbers_with_bounds(tmp_path: Path) -> None:
    config = load_text(tmp_path, "[update]\ncanary_s = 5\nwatch_window_s = 1.5\n")
    assert config.update.canary_s == 5.0 and isinstance(config.update.canary_s, float)
    assert config.update.watch_window_s == 1.5
    assert load_config(env={"EDGE_AGENT_UPDATE_CANARY_MIN_AGREEMENT": "0.75"}
                       ).update.canary_min_agreement == 0.75
    with pytest.raises(ConfigError, match=r"update\.canary_min_agreement.*a number in 0\.\.1"):
        load_text(tmp_path, "[update]\ncanary_min_agreement = 1.5\n")
    with pytest.raises(ConfigError, match=r"update\.canary_s"):
        load_text(tmp_path, '[update]\ncanary_s = "soon"\n')
    with pytest.raises(ConfigError, match="EDGE_AGENT_UPDATE_WATCH_WINDOW_S"):
        load_config(env={"EDGE_AGENT_UPDATE_WATCH_WINDOW_S": "nan"})
    assert load_config(env={"EDGE_AGENT_UPDATE_CANARY_S": " 2.5e1 "}).update.canary_s == 25.0
    for text in ("1_0", "0x10", "1.5.2", "."):
        with pytest.raises(ConfigError, match="EDGE_AGENT_UPDATE_CANARY_S"):
            load_config(env={"EDGE_AGENT_UPDATE_CANARY_S": text})
