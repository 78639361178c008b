"""Config files: validated on load, every bad field named with its value and rule."""
import pytest

from postrain.core import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_valid_config_loads_with_defaults(tmp_path):
    config = load_config(write(tmp_path, """
[run]
name = "tiny"
[[actors]]
name = "echo"
cls = "postrain.core.testing:EchoActor"
cpus = 0.5
"""))
    assert config.run.name == "tiny" and config.head.heartbeat_interval_s == 1.0
    assert config.actors[0].cpus == 0.5 and config.actors[0].max_restarts == 3


def test_a_section_nobody_declares_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"lerner: unknown field"):
        load_config(write(tmp_path, "[lerner]\nlr = 1e-5\n"))


def test_every_bad_field_is_reported_with_value_and_rule(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, """
[head]
heartbeat_interval_s = -1
[[actors]]
name = "1bad"
cls = "not an import path"
cpus = 0
colour = "blue"
"""))
    message = str(info.value)
    assert "4 bad field(s)" in message or "5 bad field(s)" in message
    assert "head.heartbeat_interval_s = -1: Input should be greater than 0" in message
    assert "actors.0.name = '1bad': must start with a letter" in message
    assert "actors.0.cls = 'not an import path': must be an import path" in message
    assert "actors.0.cpus = 0: Input should be greater than 0" in message
    assert "actors.0.colour = 'blue': unknown field" in message


def test_broken_toml_and_missing_files_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(write(tmp_path, "[run\nname="))
    with pytest.raises(ConfigError, match="cannot read config .*nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_duplicate_actor_names_and_bad_heartbeat_timeouts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="actor name 'a' is used twice"):
        load_config(write(tmp_path, '[[actors]]\nname="a"\ncls="m:C"\n[[actors]]\nname="a"\ncls="m:C"\n'))
    with pytest.raises(ConfigError, match="heartbeat_timeout_s .* must exceed twice"):
        load_config(write(tmp_path, "[head]\nheartbeat_interval_s = 5\nheartbeat_timeout_s = 6\n"))
