"""`postrain eval` (cli/eval.py): a run folder's defaults (its policy, task, task options, held-out
count and tokens per turn), flags that override them, and arguments checked in one line."""
import argparse
import json
import shutil
import subprocess
import sys

import pytest

from postrain.actors.configs.run_config import default_config_path
from postrain.cli.eval import add_arguments, eval_plan
from postrain.core.errors import PostrainError

DEFAULT_TASK_OPTIONS = {"include_instructions": False, "max_digits": 2, "max_operands": 2, "mental_products": 0.7}


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def run_folder(tmp_path):
    """A run folder as `postrain up` leaves it: the default run's config.toml and a policy/ export."""
    folder = tmp_path / "runs" / "default"
    folder.mkdir(parents=True)
    shutil.copyfile(default_config_path(), folder / "config.toml")
    (folder / "policy").mkdir()
    return folder


def test_a_run_folder_gives_its_policy_task_options_and_eval_size(run_folder):
    plan = eval_plan(parse(str(run_folder)))
    assert plan == {"model": str(run_folder / "policy"), "task": "arithmetic",
                    "task_options": DEFAULT_TASK_OPTIONS, "num_tasks": 100, "max_tokens": 64,
                    "source": str(run_folder / "config.toml")}


def test_flags_override_the_runs_defaults(run_folder):
    plan = eval_plan(parse(str(run_folder), "--task-options", '{"max_digits": 3}', "--num-tasks", "5",
                           "--model", "tiny"))
    assert (plan["model"], plan["task_options"], plan["num_tasks"]) == ("tiny", {"max_digits": 3}, 5)
    assert eval_plan(parse(str(run_folder), "--task", "code"))["task_options"] == {}, \
        "another task does not take the run's task's options"
    assert eval_plan(parse("--model", "tiny"))["task_options"] == {} and \
        eval_plan(parse("--model", "tiny"))["num_tasks"] is None


def test_a_folder_that_is_not_a_finished_run_is_named(run_folder, tmp_path):
    with pytest.raises(PostrainError, match="holds no config.toml, so it is not a run folder"):
        eval_plan(parse(str(tmp_path)))
    (run_folder / "policy").rmdir()
    with pytest.raises(PostrainError, match=r"holds no policy/ .*--resume .*or give --model"):
        eval_plan(parse(str(run_folder)))
    with pytest.raises(PostrainError, match=r"give a run folder .* or --model PATH"):
        eval_plan(parse())


@pytest.mark.parametrize("argv, message", [
    (["--num-tasks", "0"], "argument --num-tasks: must be >= 1, got 0"),
    (["--num-tasks", "-3"], "argument --num-tasks: must be >= 1, got -3"),
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
])
def test_ranges_are_checked_in_one_line(argv, message):
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", "--model", "tiny", *argv],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"postrain eval: {message}; see `postrain eval --help`"]


def test_eval_of_a_run_folder_scores_its_policy_on_its_task(run_folder):
    from postrain.actors.learner.learner import Learner

    shutil.rmtree(run_folder / "policy")
    Learner({"model": "tiny"}).export_hf(run_folder / "policy")
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", str(run_folder), "--num-tasks", "2",
                             "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["task"], out["num_tasks"], out["task_options"]) == ("arithmetic", 2, DEFAULT_TASK_OPTIONS)
    assert out["model"] == str(run_folder / "policy") and out["source"] == str(run_folder / "config.toml")
