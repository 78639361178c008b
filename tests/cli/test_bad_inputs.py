"""The CLI's bad-input table: every subcommand, given a bad input, exits non-zero with one line on
stderr (a few for a config check that finds several bad fields) naming what is wrong, where, and
the fix, and never a traceback.

No case starts a run (each is a --dry-run, a bad path or a bad flag). Most run in-process through
`postrain.cli.main` (importing postrain once; a process per case would spend most of a minute
importing it), with SystemExit handled as the interpreter would; a handful run as real processes
(`python -m postrain.cli`), to hold the interpreter's side too.
"""
import contextlib
import io
import subprocess
import sys
import tomllib

import pytest

from postrain import cli
from postrain.actors.configs.run_config import default_config_path
from postrain.core.testing import counting_run_config, to_toml

DEFAULT = tomllib.loads(default_config_path().read_text())


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stderr, stdout) of `postrain ARGV` run in this process, SystemExit handled as
    the interpreter handles it: a str code is printed to stderr and exits 1."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = cli.main(argv)
        except SystemExit as exc:
            if isinstance(exc.code, str):
                print(exc.code, file=err)
                status = 1
            else:
                status = exc.code if exc.code is not None else 0
    return status, err.getvalue(), out.getvalue()


def default_with(tmp, *, shared=None, options_of=None) -> str:
    """The built-in config with [shared] entries and one actor's options changed, written to a file."""
    actors = [{"name": s["name"], "cls": s["cls"], "cpus": s["cpus"], "memory_mb": 0,
               "options": {**s["options"], **(options_of or {}).get(s["name"], {})}} for s in DEFAULT["actors"]]
    doc = {"run": {"name": "t", "run_dir": str(tmp / "runs"), "driver": "orchestrator"},
           "shared": {**DEFAULT["shared"], **(shared or {})}, "actors": actors}
    path = tmp / f"run{len(list(tmp.glob('run*.toml')))}.toml"
    path.write_text(to_toml(doc))
    return str(path)


def counting(tmp, replace=("", ""), extra="") -> str:
    """The small test run (an echo actor and a counting driver), edited, written to a file."""
    path = tmp / f"count{len(list(tmp.glob('count*.toml')))}.toml"
    path.write_text(counting_run_config(tmp / "runs").replace(*replace) + extra)
    return str(path)


def file(tmp, name: str, text: str) -> str:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


# A task module beside the config whose TaskSpec has no demonstrations (the docs' example is such).
NO_DEMOS_TASK = ("from postrain.actors import TaskSpec\nfrom postrain.actors.tasks.arithmetic import ArithmeticEnv\n"
                 "TASK = TaskSpec('rev', ArithmeticEnv, train=lambda s, o: iter([]), eval=lambda o: [])\n")

# (case id, argv made from the case's folder, what stderr must say, most stderr lines allowed)
CASES = [
    # -- postrain ------------------------------------------------------------------------------
    ("no-command", lambda t: [], "the following arguments are required: COMMAND", 1),
    ("unknown-command", lambda t: ["nope"], "invalid choice: 'nope'", 1),
    # -- up: flags and files -------------------------------------------------------------------
    ("up-unknown-flag", lambda t: ["up", "--bogus"], "postrain up: unrecognized arguments: --bogus", 1),
    ("up-missing-config", lambda t: ["up", "--dry-run", "--config", str(t / "nope.toml")],
     "cannot read config", 1),
    ("up-not-toml", lambda t: ["up", "--dry-run", "--config", file(t, "x.toml", "[run\n")],
     "is not valid TOML", 1),
    ("up-unknown-section", lambda t: ["up", "--dry-run", "--config", file(t, "x.toml", "[runn]\nname = 'x'\n")],
     "runn: unknown field (check the spelling", 2),
    ("up-negative-cpus", lambda t: ["up", "--dry-run", "--config",
                                    counting(t, ("cpus = 0.25\nmemory_mb = 0\n[[actors]]", "cpus = -1\nmemory_mb = 0\n[[actors]]"))],
     "actors.0.cpus = -1: Input should be greater than 0", 2),
    ("up-cls-not-a-path", lambda t: ["up", "--dry-run", "--config",
                                     counting(t, ("postrain.core.testing:EchoActor", "EchoActor"))],
     "actors.0.cls = 'EchoActor': must be an import path", 2),
    ("up-cls-no-module", lambda t: ["up", "--dry-run", "--config",
                                    counting(t, ("postrain.core.testing:EchoActor", "nowhere_pkg.mod:Echo"))],
     "No module named 'nowhere_pkg'; fix: put nowhere_pkg beside the run config", 2),
    ("up-cls-no-attribute", lambda t: ["up", "--dry-run", "--config",
                                       counting(t, ("testing:EchoActor", "testing:Missing"))],
     "has no attribute 'Missing'", 2),
    ("up-duplicate-names", lambda t: ["up", "--dry-run", "--config",
                                      counting(t, ('name = "driver"', 'name = "echo"'))],
     "actor name 'echo' is used twice", 2),
    ("up-driver-unknown", lambda t: ["up", "--dry-run", "--config",
                                     counting(t, ('driver = "driver"', 'driver = "drivr"'))],
     "run.driver = 'drivr' names no actor", 2),
    ("up-heartbeat-timeout", lambda t: ["up", "--dry-run", "--config",
                                        counting(t, ("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 0.5\n"
                                                     "heartbeat_timeout_s = 0.6"))],
     "heartbeat_timeout_s (0.6) must exceed twice heartbeat_interval_s", 2),
    ("up-balancer-bounds", lambda t: ["up", "--dry-run", "--config",
                                      counting(t, extra="[balancer]\nmin_workers = 5\nmax_workers = 2\n")],
     "min_workers (5) must be <= max_workers (2)", 2),
    ("up-tracking-backend", lambda t: ["up", "--dry-run", "--config",
                                       counting(t, extra="[tracking]\nbackends = ['tensorbored']\n")],
     "tracking.backends.0 = 'tensorbored'", 2),
    ("up-driver-option", lambda t: ["up", "--dry-run", "--config", counting(t, ("steps = 3", "steps = 'x'"))],
     "actors.1(driver).options.steps = 'x'", 2),
    ("up-set-form", lambda t: ["up", "--dry-run", "--config", counting(t), "--set", "driver.steps"],
     "postrain up: --set 'driver.steps': write KEY=VALUE, e.g. orchestrator.num_steps=3", 1),
    ("up-set-value", lambda t: ["up", "--dry-run", "--config", counting(t), "--set", "driver.steps=x"],
     "actors.1(driver).options.steps = 'x'", 2),
    ("up-set-nothing", lambda t: ["up", "--dry-run", "--config", counting(t), "--set", "actors.echo=1"],
     "--set actors.echo: 'actors' is neither a section of the config", 1),
    # -- up: the built-in run's options --------------------------------------------------------
    ("up-unknown-model", lambda t: ["up", "--dry-run", "--config", default_with(t, shared={"model": "tinny"})],
     "options.model = 'tinny': unknown model 'tinny' (no built-in name and no such file or folder); "
     "a model is a built-in name (small, tiny, tiny-vl)", 3),
    ("up-learner-type", lambda t: ["up", "--dry-run", "--config", default_with(
        t, options_of={"learner": {"learner": {**DEFAULT["actors"][2]["options"]["learner"], "clip_high": "x"}}})],
     "actors.2(learner).options.learner.clip_high = 'x': Input should be a valid number", 2),
    ("up-learner-rule", lambda t: ["up", "--dry-run", "--config", default_with(
        t, options_of={"learner": {"learner": {**DEFAULT["actors"][2]["options"]["learner"], "lr": -1}}})],
     "actors.2(learner).options.learner: lr must be > 0", 2),
    ("up-misspelt-option", lambda t: ["up", "--dry-run", "--config",
                                      default_with(t, options_of={"orchestrator": {"num_stepz": 3}})],
     "actors.4(orchestrator).options.num_stepz = 3: unknown field", 2),
    ("up-misspelt-shared", lambda t: ["up", "--dry-run", "--config", default_with(t, shared={"modle": "tiny"})],
     "shared.modle = 'tiny': no actor declares an option of that name", 2),
    ("up-unknown-task", lambda t: ["up", "--dry-run", "--config", default_with(t, shared={"task": "arithmatic"})],
     "unknown task 'arithmatic'", 3),
    ("up-task-module-missing", lambda t: ["up", "--dry-run", "--config",
                                          default_with(t, shared={"task": "my_pkg.reverse:TASK"})],
     "No module named 'my_pkg'; fix: put my_pkg beside the run config (its folder is on the import path "
     "of the head and every actor) or install it (`pip install -e` its project)", 3),
    ("up-task-option", lambda t: ["up", "--dry-run", "--config",
                                  default_with(t, shared={"task_options": {"max_digitz": 2}})],
     "max_digitz", 3),
    ("up-warm-start-no-demos", lambda t: ["up", "--dry-run", "--config", default_with(
        t, shared={"task": "my_rev:TASK" if file(t, "my_rev.py", NO_DEMOS_TASK) else "", "task_options": {}})],
     "a warm start of 250 steps needs demonstrations", 3),
    ("up-demos-file-missing", lambda t: ["up", "--dry-run", "--config", default_with(
        t, options_of={"orchestrator": {"sft_demonstrations": str(t / "demos.jsonl")}})],
     "options.sft_demonstrations = ", 2),
    ("up-negative-steps", lambda t: ["up", "--dry-run", "--config",
                                     default_with(t, options_of={"orchestrator": {"num_steps": -1}})],
     "actors.4(orchestrator).options.num_steps = -1: Input should be greater than or equal to 0", 2),
    # -- up: run folders -------------------------------------------------------------------------
    ("up-folder-holds-a-run", lambda t: [
        "up", "--dry-run", "--config", counting(t), *([] if file(t, "runs/t/config.toml", "") else [])],
     "already holds a run (config.toml); continue it with `postrain up --resume", 1),
    ("up-run-dir-is-a-file", lambda t: ["up", "--quiet", "--config", counting(t), "--run-dir",
                                        file(t, "blocker", "")],
     "is not writable", 1),
    ("up-resume-nothing", lambda t: ["up", "--resume", str(t / "nope")],
     "holds no config.toml; --resume takes the folder of a run", 1),
    ("up-resume-and-overwrite", lambda t: ["up", "--resume", str(t), "--overwrite"],
     "--resume continues a run and --overwrite deletes one", 1),
    # -- status, down ----------------------------------------------------------------------------
    ("status-no-folder", lambda t: ["status"], "required: run_folder", 1),
    ("status-not-a-run", lambda t: ["status", str(t / "nope")], "holds no run (no head.json", 1),
    ("status-bad-head-json", lambda t: ["status", str(t), *([] if file(t, "head.json", "{") else [])],
     "head.json is missing or unreadable", 1),
    ("down-not-a-run", lambda t: ["down", str(t / "nope")], "postrain down: ", 1),
    ("down-unknown-flag", lambda t: ["down", str(t), "--force"], "postrain down: unrecognized arguments", 1),
    # -- eval ------------------------------------------------------------------------------------
    ("eval-nothing", lambda t: ["eval"], "give a run folder (`postrain eval runs/default`) or --model", 1),
    ("eval-zero-tasks", lambda t: ["eval", "--model", "tiny", "--num-tasks", "0"],
     "argument --num-tasks: must be >= 1, got 0", 1),
    ("eval-negative-tasks", lambda t: ["eval", "--model", "tiny", "--num-tasks", "-3"],
     "must be >= 1, got -3", 1),
    ("eval-tokens-not-a-number", lambda t: ["eval", "--model", "tiny", "--max-tokens", "x"],
     "argument --max-tokens: must be a whole number >= 1, got 'x'", 1),
    ("eval-not-a-run", lambda t: ["eval", str(t)], "holds no config.toml, so it is not a run folder", 1),
    ("eval-options-not-an-object", lambda t: ["eval", "--model", "tiny", "--task-options", "[1]"],
     "--task-options must be a JSON object", 1),
    ("eval-options-not-json", lambda t: ["eval", "--model", "tiny", "--task-options", "{"],
     "--task-options must be a JSON object", 1),
    ("eval-unknown-task", lambda t: ["eval", "--model", "tiny", "--task", "nope"], "unknown task 'nope'", 1),
    ("eval-bad-task-option", lambda t: ["eval", "--model", "tiny", "--task-options", '{"max_digitz": 2}'],
     "max_digitz", 1),
    ("eval-unknown-model", lambda t: ["eval", "--model", "tinny", "--num-tasks", "1"], "tinny", 1),
    # -- plot, trace -----------------------------------------------------------------------------
    ("plot-no-metrics", lambda t: ["plot", str(t / "nope")], "metrics.jsonl does not exist", 1),
    ("trace-no-ledger", lambda t: ["trace", str(t / "nope"), "b0-g0-s0"], "no ledger at", 1),
    ("trace-missing-id", lambda t: ["trace", str(t)], "required: sample_id", 1),
    # -- bench, generate, sandbox ----------------------------------------------------------------
    ("bench-unknown", lambda t: ["bench", "nope"], "unknown benchmark 'nope'; choose from", 1),
    ("generate-no-model", lambda t: ["generate", "--prompt", "hi"], "required: --model", 1),
    ("generate-unknown-model", lambda t: ["generate", "--model", "tinny", "--prompt", "hi"], "tinny", 1),
    ("generate-negative-tokens", lambda t: ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "-1"],
     "max_new_tokens must be >= 1, got -1", 1),
    ("sandbox-no-action", lambda t: ["sandbox"], "required: ACTION", 1),
    ("sandbox-missing-file", lambda t: ["sandbox", "exec", str(t / "nope.py")], "cannot read", 1),
    # -- init, report, samples -------------------------------------------------------------------
    ("init-name-not-identifier", lambda t: ["init", str(t / "p"), "--name", "2x"],
     "--name '2x' is not a Python package name", 1),
    ("init-shadows-a-module", lambda t: ["init", str(t / "json")],
     "package name 'json' is already an importable module", 1),
    ("init-file-exists", lambda t: ["init", str(t), "--name", "p", *([] if file(t, "run.toml", "") else [])],
     "run.toml already exists; nothing was written; fix: give a new folder", 1),
    ("init-into-a-file", lambda t: ["init", file(t, "f", ""), "--name", "p"], "is a file, not a folder", 1),
    ("report-not-a-run", lambda t: ["report", str(t)], "holds no run (no config.toml, metrics.jsonl", 1),
    ("report-negative-samples", lambda t: ["report", str(t), "--max-samples", "-1"],
     "--max-samples must be >= 0 (0: all), got -1", 1),
    ("samples-no-file", lambda t: ["samples", str(t)], "no samples.jsonl in", 1),
]

# Run as real processes too: a flag error, a config error, a run-folder error, a SystemExit text.
SUBPROCESS_CASES = ("unknown-command", "up-unknown-model", "up-folder-holds-a-run", "status-not-a-run",
                    "eval-negative-tasks")


def check(case_id, status, stderr, stdout, expected, max_lines):
    lines = stderr.strip().splitlines()
    assert status != 0, f"{case_id}: exit 0"
    assert "Traceback" not in stderr + stdout, f"{case_id}: a traceback:\n{stderr}{stdout}"
    assert 1 <= len(lines) <= max_lines, f"{case_id}: {len(lines)} lines on stderr:\n{stderr}"
    assert expected in stderr, f"{case_id}: {expected!r} not in:\n{stderr}"


def test_every_bad_input_is_one_line_without_a_traceback(tmp_path):
    """All cases in this process, in turn (no run starts; the whole table takes seconds)."""
    assert len(CASES) >= 40 and len({case[0] for case in CASES}) == len(CASES)
    commands = set()
    for case_id, make, expected, max_lines in CASES:
        folder = tmp_path / case_id
        folder.mkdir()
        argv = make(folder)
        commands.update(argv[:1])
        check(case_id, *run_in_process(argv), expected, max_lines)
    assert {"up", "status", "down", "eval", "plot", "trace", "bench", "generate", "sandbox", "init", "report",
            "samples"} <= commands


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_inputs_as_real_processes(tmp_path, case_id):
    [(make, expected, max_lines)] = [(m, e, n) for i, m, e, n in CASES if i == case_id]
    result = subprocess.run([sys.executable, "-m", "postrain.cli", *make(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    check(case_id, result.returncode, result.stderr, result.stdout, expected, max_lines)
