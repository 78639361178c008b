"""`postrain init`, and a new user's path through it, command by command as a user types them:
a fresh folder, `postrain init`, the scaffold's own test, `postrain up --dry-run`, a tiny real run
(every role a real process, a real sandbox), `postrain samples`, `postrain report`, `postrain eval`,
`postrain export`."""
import json
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from postrain.cli.init import InitError, scaffold

SCAFFOLD = ["my_env/__init__.py", "my_env/env.py", "run.toml", "tests/test_env.py", "pyproject.toml", "README.md"]
# The scaffold's run.toml, made tiny the way a user would edit it: (key, value) lines.
TINY = {"sft_steps": 4, "sft_batch_size": 4, "num_steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
        "num_eval_tasks": 2}


def postrain(*args, cwd, timeout=180):
    result = subprocess.run([sys.executable, "-m", "postrain.cli", *args], capture_output=True, text=True,
                            cwd=cwd, timeout=timeout)
    return result


def make_tiny(config_text: str) -> str:
    for key, value in TINY.items():
        config_text, count = re.subn(rf"^{key} = \d+", f"{key} = {value}", config_text, flags=re.MULTILINE)
        assert count == 1, f"the scaffold's run.toml has no line '{key} = N' to make tiny"
    return config_text


def test_init_writes_the_package_its_config_test_and_pyproject(tmp_path):
    written = scaffold(tmp_path / "my-env")
    assert [str(p.relative_to(tmp_path / "my-env")) for p in written] == SCAFFOLD
    config = (tmp_path / "my-env" / "run.toml").read_text()
    assert 'task = "my_env.env:TASK"' in config and 'name = "my_env"' in config
    assert 'packages = ["my_env"]' in (tmp_path / "my-env" / "pyproject.toml").read_text()


def test_init_refuses_to_overwrite_and_bad_names_in_one_line(tmp_path):
    scaffold(tmp_path / "proj", name="words")
    (tmp_path / "proj" / "run.toml").write_text("mine")
    with pytest.raises(InitError, match=r"run.toml.* already exist; nothing was written; fix: give a new folder"):
        scaffold(tmp_path / "proj", name="words")
    assert (tmp_path / "proj" / "run.toml").read_text() == "mine"
    with pytest.raises(InitError, match=r"--name '2x' is not a Python package name"):
        scaffold(tmp_path / "other", name="2x")
    with pytest.raises(InitError, match=r"package name 'json' is already an importable module"):
        scaffold(tmp_path / "json")
    assert not (tmp_path / "other").exists() and not (tmp_path / "json" / "run.toml").exists()
    result = postrain("init", str(tmp_path / "proj"), "--name", "words", cwd=tmp_path)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("postrain init: ") and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def user_project(tmp_path_factory):
    """A new user's project: `postrain init my_env` in a fresh folder, then a tiny real run."""
    home = tmp_path_factory.mktemp("home")
    result = postrain("init", "my_env", cwd=home)
    assert result.returncode == 0, result.stderr
    assert "cd my_env" in result.stdout and "postrain up --config run.toml" in result.stdout
    project = home / "my_env"
    yield project
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def user_run(user_project):
    config = user_project / "run.toml"
    config.write_text(make_tiny(config.read_text()))
    result = postrain("up", "--config", "run.toml", "--quiet", cwd=user_project, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "held-out accuracy after RL" in result.stdout and "step 2/2" in result.stdout
    return user_project / "runs" / "my_env"


def test_the_printed_next_steps_up_to_the_scaffolds_test_work_as_written(tmp_path):
    """`cd`, `pip install -e '.[test]'` (its extra checked: installing needs the network) and
    `python -m pytest tests`, run with this interpreter, in the order `postrain init` prints them."""
    printed = postrain("init", "my project", cwd=tmp_path).stdout
    steps = printed.split("next:\n", 1)[1].splitlines()
    assert [line.strip() for line in steps[:3]] == ["cd 'my project'", "pip install -e '.[test]'",
                                                    "python -m pytest tests"]
    project = tmp_path / "my project"
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["test"] == ["pytest"]
    result = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"],
                            capture_output=True, text=True, cwd=project, timeout=120)
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_dry_run_passes_the_scaffold_as_written(user_project):
    result = postrain("up", "--config", "run.toml", "--dry-run", cwd=user_project)
    assert result.returncode == 0, result.stderr
    for actor in ("sandbox", "generator", "learner", "env", "orchestrator"):
        assert f"  {actor}: cores [" in result.stdout


@pytest.mark.slow
def test_a_new_user_runs_it_then_reads_samples_report_and_eval(user_run):
    summary = json.loads((user_run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sft_steps"] == 4 and summary["task"] == "my_env.env:TASK"
    project = user_run.parents[1]

    samples = postrain("samples", "runs/my_env", "--worst", cwd=project)
    assert samples.returncode == 0, samples.stderr
    rows = [json.loads(line) for line in (user_run / "samples.jsonl").open()]
    worst = samples.stdout.splitlines()[0]     # the worst of the whole run
    assert worst.startswith("sample b") and f"  reward {min(row['reward'] for row in rows):.3f}" in worst
    assert "Reverse '" in samples.stdout   # the prompt the environment wrote

    report = postrain("report", "runs/my_env", cwd=project)
    assert report.returncode == 0 and "wrote runs/my_env/report.html" in report.stdout, report.stderr
    page = (user_run / "report.html").read_text()
    assert "postrain run my_env" in page and '"step": 2' in page and "<svg" in page
    chromium = shutil.which("chromium")
    if chromium:   # as the user opens it: no console errors, the samples listed (tests/cli/test_report.py: more)
        shown = subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                                "--v=0", "--dump-dom", f"file://{user_run / 'report.html'}"],
                               capture_output=True, text=True, timeout=60)
        assert [line for line in shown.stderr.splitlines() if ":CONSOLE" in line] == []
        assert re.search(r'id="sample-count"[^>]*>(\d+) of \1 samples match', shown.stdout)

    evaluated = postrain("eval", "runs/my_env", "--json", cwd=project, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(evaluated.stdout.splitlines()[-1])
    assert result["task_options"] == {"format_weight": 0.1} and result["num_tasks"] == 2


@pytest.mark.slow
def test_a_new_user_exports_the_run_and_its_suggested_eval_works_as_printed(user_run):
    """`postrain export runs/my_env OUT` on a real run folder: its checkpoint exported, and the
    `postrain eval` line it prints scores OUT on the run's own task (cli/export.py)."""
    project = user_run.parents[1]
    exported = postrain("export", "runs/my_env", "my_policy", cwd=project)
    assert exported.returncode == 0, exported.stderr
    assert "wrote my_policy, a Hugging Face folder of runs/my_env/checkpoint" in exported.stdout
    (line,) = [line.split("#")[0].split() for line in exported.stdout.splitlines() if "postrain eval" in line]
    assert line == ["postrain", "eval", "runs/my_env", "--model", "my_policy"]
    evaluated = postrain(*line[1:], cwd=project, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    assert "on 2 held-out tasks" in evaluated.stdout and "with my_policy" in evaluated.stdout
