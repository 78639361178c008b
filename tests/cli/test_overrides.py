"""`--set KEY=VALUE` (cli/overrides.py), the rule `postrain up` and `postrain sweep` share."""
import pytest

from postrain.cli.overrides import OverrideError, parse_override, set_path, toml_value


def doc() -> dict:
    return {"run": {"name": "r"}, "shared": {"model": "tiny"},
            "actors": [{"name": "learner", "cls": "m:L", "options": {"learner": {"lr": 1.0}}},
                       {"name": "orchestrator", "cls": "m:O", "options": {"sampling": {"temperature": 1.0}}}]}


def test_values_are_toml_and_other_text_a_string():
    assert [toml_value(text) for text in ("3", "1e-4", '"gspo"', "true", "[1, 2]", "{ rank = 8 }")] == [
        3, 1e-4, "gspo", True, [1, 2], {"rank": 8}]
    assert toml_value("models/Qwen3-0.6B") == "models/Qwen3-0.6B" and toml_value(" auto ") == "auto"
    assert parse_override("orchestrator.num_steps=3") == ("orchestrator.num_steps", 3)
    for bad in ("orchestrator.num_steps", "=3", "x="):
        with pytest.raises(OverrideError, match="write KEY=VALUE"):
            parse_override(bad)


def test_a_key_names_a_section_an_entrys_field_or_an_option():
    config = doc()
    assert set_path(config, "run.name", "smoke") == "section" and config["run"]["name"] == "smoke"
    assert set_path(config, "head.heartbeat_timeout_s", 60) == "section"
    assert config["head"] == {"heartbeat_timeout_s": 60}
    assert set_path(config, "learner.memory_mb", 4096) == "actor" and config["actors"][0]["memory_mb"] == 4096
    assert set_path(config, "learner.rl_lr", 1e-4) == "option"          # the learner's own table, skipped
    assert config["actors"][0]["options"]["learner"] == {"lr": 1.0, "rl_lr": 1e-4}
    assert set_path(config, "orchestrator.sampling.max_new_tokens", 8) == "option"
    assert config["actors"][1]["options"]["sampling"] == {"temperature": 1.0, "max_new_tokens": 8}
    with pytest.raises(OverrideError, match=r"--set actors.x: 'actors' is neither a section .* nor an actor's name"):
        set_path(config, "actors.x", 1)
    with pytest.raises(OverrideError, match="write SECTION.KEY, ACTOR.FIELD or ACTOR.OPTION"):
        set_path(config, "learner", 1)
