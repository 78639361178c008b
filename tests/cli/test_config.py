"""`postrain up --dry-run` checks every actor's options before any process starts."""
import tomllib

import pytest

from postrain import cli
from postrain.cli.up import default_config_path
from postrain.core.testing import to_toml

DEFAULT = tomllib.loads(default_config_path().read_text())


def write_default(tmp_path, *, shared=None, options_of=None) -> str:
    """The built-in config with [shared] replaced and one actor's options changed, as a file."""
    actors = [{"name": spec["name"], "cls": spec["cls"], "cpus": spec["cpus"], "memory_mb": 0,
               "options": {**spec["options"], **(options_of or {}).get(spec["name"], {})}}
              for spec in DEFAULT["actors"]]
    doc = {"run": {"name": "t", "run_dir": str(tmp_path), "driver": DEFAULT["run"]["driver"]},
           "shared": shared or DEFAULT["shared"], "actors": actors}
    path = tmp_path / "run.toml"
    path.write_text(to_toml(doc))
    return str(path)


def test_the_built_in_config_passes_the_dry_run(tmp_path, capsys):
    assert cli.main(["up", "--dry-run", "--config", write_default(tmp_path)]) == 0
    assert "orchestrator: cores" in capsys.readouterr().out


@pytest.mark.parametrize("index", range(len(DEFAULT["actors"])))
def test_a_misspelt_option_of_any_actor_fails_the_dry_run_naming_it(tmp_path, capsys, index):
    name = DEFAULT["actors"][index]["name"]
    path = write_default(tmp_path, options_of={name: {"num_stepz": 3}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    err = capsys.readouterr().err
    assert f"actors.{index}({name}).options.num_stepz = 3: unknown field (check the spelling" in err


def test_a_misspelt_shared_setting_fails_naming_it_and_the_model_is_not_silently_replaced(tmp_path, capsys):
    shared = {**DEFAULT["shared"], "modle": "smollm2"}
    assert cli.main(["up", "--dry-run", "--config", write_default(tmp_path, shared=shared)]) == 2
    assert "shared.modle = 'smollm2': no actor declares an option of that name" in capsys.readouterr().err


def test_a_bad_value_names_the_field_the_value_and_the_rule(tmp_path, capsys):
    path = write_default(tmp_path, options_of={"generator": {"kv_cache_mb": -1}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    assert "actors.1(generator).options.kv_cache_mb = -1: Input should be greater than 0" in capsys.readouterr().err
