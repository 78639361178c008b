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


def test_a_learner_fields_type_error_names_its_path_value_and_rule(tmp_path, capsys):
    learner = {**DEFAULT["actors"][2]["options"]["learner"], "lr": "big", "betas": [0.9, "x"], "lrr": 1}
    path = write_default(tmp_path, options_of={"learner": {"learner": learner}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "actors.2(learner).options.learner.lr = 'big': Input should be a valid number" in err
    assert "actors.2(learner).options.learner.betas.1 = 'x': Input should be a valid number" in err
    assert "actors.2(learner).options.learner.lrr = 1: unknown field" in err
    assert "not supported between" not in err and "options.:" not in err
    learner.pop("lrr")
    path = write_default(tmp_path, options_of={"learner": {"learner": {**learner, "lr": -1.0, "betas": [0.9, 0.9]}}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    assert "actors.2(learner).options.learner: lr must be > 0, got -1.0" in capsys.readouterr().err


def test_an_unknown_model_fails_the_dry_run_listing_the_built_in_names_and_the_rule(tmp_path, capsys):
    path = write_default(tmp_path, shared={**DEFAULT["shared"], "model": "tinny"})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    err = capsys.readouterr().err
    assert ("actors.1(generator).options.model = 'tinny': unknown model 'tinny' (no built-in name and no such "
            "file or folder); a model is a built-in name (small, tiny, tiny-vl)") in err
    assert "a Hugging Face folder (config.json + *.safetensors) or a .gguf file" in err
    (tmp_path / "folder").mkdir()
    path = write_default(tmp_path, shared={**DEFAULT["shared"], "model": str(tmp_path / "folder")})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_warm_start_for_a_task_without_demonstrations_fails_the_dry_run_naming_both_fixes(tmp_path, capsys):
    """The docs' complete environment (tests/actors/env/test_api.py runs it) has no demonstrations;
    the built-in config's warm start needs some: refused here, not after the first evaluation."""
    (tmp_path / "my_reverse.py").write_text(
        "from postrain.actors import TaskSpec\nfrom postrain.actors.tasks.arithmetic import ArithmeticEnv\n"
        "TASK = TaskSpec('reverse', ArithmeticEnv, train=lambda s, o: iter([]), eval=lambda o: [])\n")
    path = write_default(tmp_path, shared={**DEFAULT["shared"], "task": "my_reverse:TASK", "task_options": {}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 2
    err = capsys.readouterr().err
    assert ("actors.4(orchestrator).options.sft_steps = 250: a warm start of 250 steps needs demonstrations, "
            "and task 'my_reverse:TASK' has none; fix: set sft_steps = 0") in err
    assert 'sft_demonstrations = "FILE.jsonl"' in err and "Traceback" not in err
    path = write_default(tmp_path, shared={**DEFAULT["shared"], "task": "my_reverse:TASK", "task_options": {}},
                         options_of={"orchestrator": {"sft_steps": 0}})
    assert cli.main(["up", "--dry-run", "--config", path]) == 0
