"""`postrain eval` (cli/eval.py): a run folder's defaults (its policy, task, task options, held-out
count and tokens per turn), an exported model folder, flags that override them, arguments checked in
one line, a task module found in the current folder, and an environment with a bug stopped in one
line with its traceback shown."""
import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

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
                    "max_error_fraction": 0.5, "source": str(run_folder / "config.toml"),
                    "read": f"read run folder {run_folder} (config.toml: its policy/, task and options): "
                            f"model {run_folder / 'policy'}, task arithmetic"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Hugging Face folder as `postrain export` writes one: the tiny model's config.json and weights."""
    from postrain.actors.learner.learner import Learner
    folder = tmp_path_factory.mktemp("export") / "tiny-hf"
    Learner({"model": "tiny"}).export_hf(folder)
    return folder


def test_an_exported_model_folder_is_the_model_and_a_runs_policy_brings_its_task(exported, run_folder):
    plan = eval_plan(parse(str(exported)))
    assert (plan["model"], plan["task"], plan["source"]) == (str(exported), "arithmetic", None)
    assert plan["read"] == (f"read exported model folder {exported} (config.json, safetensors): "
                            f"model {exported}, task arithmetic")
    shutil.rmtree(run_folder / "policy")
    shutil.copytree(exported, run_folder / "policy")   # a run's policy/: the run's task and options
    plan = eval_plan(parse(str(run_folder / "policy")))
    assert (plan["model"], plan["task_options"], plan["num_tasks"]) == (
        str(run_folder / "policy"), DEFAULT_TASK_OPTIONS, 100)
    policy = run_folder / "policy"
    assert plan["read"] == (f"read exported model folder {policy}, the policy of run {run_folder} "
                            f"(its task and options): model {policy}, task arithmetic")


def test_flags_override_the_runs_defaults(run_folder):
    plan = eval_plan(parse(str(run_folder), "--task-options", '{"max_digits": 3}', "--num-tasks", "5",
                           "--model", "tiny"))
    assert (plan["model"], plan["task_options"], plan["num_tasks"]) == ("tiny", {"max_digits": 3}, 5)
    assert eval_plan(parse(str(run_folder), "--task", "code"))["task_options"] == {}, \
        "another task does not take the run's task's options"
    assert eval_plan(parse("--model", "tiny"))["task_options"] == {} and \
        eval_plan(parse("--model", "tiny"))["num_tasks"] is None


def test_a_folder_that_is_not_a_finished_run_is_named(run_folder, tmp_path):
    with pytest.raises(PostrainError, match="holds no config.toml, so it is not a run folder, nor "
                                            "config.json and \\*.safetensors, so it is not an exported model"):
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
def test_ranges_are_checked_in_one_line(argv, message, capsys):
    from postrain.cli.main import main
    with pytest.raises(SystemExit) as exited:      # argparse refuses before anything loads
        main(["eval", "--model", "tiny", *argv])
    assert exited.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"postrain eval: {message}; see `postrain eval --help`"]


def test_eval_of_a_run_folder_scores_its_policy_on_its_task(run_folder):
    from postrain.actors.learner.learner import Learner

    shutil.rmtree(run_folder / "policy")
    Learner({"model": "tiny"}).export_hf(run_folder / "policy")
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", str(run_folder), "--num-tasks", "2",
                             "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"postrain eval: read run folder {run_folder} (config.toml")
    out = json.loads(result.stdout)
    assert (out["task"], out["num_tasks"], out["task_options"]) == ("arithmetic", 2, DEFAULT_TASK_OPTIONS)
    assert out["model"] == str(run_folder / "policy") and out["source"] == str(run_folder / "config.toml")


TYPO_ENV = (Path(__file__).parents[1] / "actors" / "user_code_with_a_typo.py").read_text()


def test_eval_finds_the_task_in_the_current_folder_and_stops_on_an_environment_bug_in_one_line(tmp_path):
    """Run as the `postrain` command runs (`-P`: the current folder is not on sys.path by Python's doing)."""
    (tmp_path / "my_env.py").write_text(TYPO_ENV)
    result = subprocess.run([sys.executable, "-P", "-m", "postrain.cli", "eval", "--model", "tiny", "--task",
                             "my_env:MyEnv"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "postrain eval: model tiny (--model), task my_env:MyEnv"
    line = 1 + TYPO_ENV.splitlines().index("        return float(action == self.targte())")
    error = "AttributeError: 'MyEnv' object has no attribute 'targte'"
    assert result.stderr.splitlines()[-1] == (
        f"postrain eval: environment raised {error} at my_env.py:{line} in 4 of 4 held-out episodes; "
        "fix your environment (docs/environments.md)")
    # the first failure, at once: the user's frames (step, then score), none of postrain's
    shown = result.stderr.split("Traceback (most recent call last; postrain's frames left out):\n")
    assert len(shown) == 2, result.stderr
    frames = re.findall(r'^  File "(.*)", line (\d+), in (\w+)$', shown[1], re.MULTILINE)
    assert [(Path(f).name, int(n), fn) for f, n, fn in frames] == [
        ("my_env.py", line - 3, "step"), ("my_env.py", line, "score")]
    assert shown[1].splitlines()[len(frames) * 2] == error


def test_a_task_module_that_is_nowhere_is_refused_with_the_fix_for_eval(tmp_path):
    result = subprocess.run([sys.executable, "-P", "-m", "postrain.cli", "eval", "--model", "tiny", "--task",
                             "my_env:MyEnv"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"postrain eval: cannot load task 'my_env:MyEnv': there is no module 'my_env' in the current folder "
        f"({tmp_path}) or installed; fix: run postrain eval in the folder that holds my_env (the current "
        "folder is on its import path), or `pip install -e` its project"]


def test_a_long_evaluation_says_how_far_it_is_and_a_fast_one_stays_quiet():
    from postrain.cli.eval import EpisodeProgress
    now, lines = [0.0], []
    progress = EpisodeProgress(5, lines.append, interval_s=10.0, clock=lambda: now[0])
    for seconds in (3.0, 9.0, 1.0, 12.0, 30.0):       # the episodes' lengths, on a test clock
        now[0] += seconds
        progress.advance()
    assert lines == ["  episodes 2/5 (0:12 elapsed, ETA 0:18)", "  episodes 4/5 (0:25 elapsed, ETA 0:06)"]
    fast = EpisodeProgress(100, lines.append, interval_s=10.0, clock=lambda: 0.0)
    for _ in range(100):
        fast.advance()
    assert len(lines) == 2                         # nothing past the last line: the result line follows
