"""The RL loop end to end: `postrain up` with every role a real process, on a tiny budget.

Checks what a user relies on after a run: a summary with the evaluations and the ledger, a
balanced ledger, per-step metrics, a checkpoint, that an environment that raises costs
only its samples (dropped with the reason) while training goes on, and that a bug in the
user's environment stops the run in one line naming the error, the user's line and the count.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from postrain.actors.orchestrator import chat_to_tokens
from postrain.actors.tasks.demonstrations import DemonstrationError
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.actors.orchestrator.ledger import STATES, read_events
from postrain.core.metrics import read_metrics

FLAKY_TASK = '''
from postrain.actors.tasks import get_task
from postrain.actors.tasks.arithmetic import ArithmeticEnv
from postrain.actors import TaskSpec

class FlakyEnv(ArithmeticEnv):
    async def reset(self, task):
        if "7" in task["question"]:
            raise ValueError("this environment dislikes sevens")
        return await super().reset(task)

_base = get_task("arithmetic")
TASK = TaskSpec("flaky", FlakyEnv, train=_base.train_tasks, eval=_base.eval_tasks,
                demos=_base.demonstrations)
'''

CONFIG = """
[run]
name = "e2e"
run_dir = "{run_dir}"
driver = "orchestrator"
[shared]
model = "tiny"
task = "{task}"
task_options = {{ include_instructions = false, max_digits = 1 }}
[head]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120
[[actors]]
name = "sandbox"
cls = "postrain.actors.sandbox:SandboxActor"
cpus = 0.2
memory_mb = 0
options = {{ mode = "warm", num_workers = 1 }}
[[actors]]
name = "generator"
cls = "postrain.actors.generator:GeneratorActor"
cpus = 0.5
memory_mb = 0
options = {{ kv_cache_mb = 16 }}
[[actors]]
name = "learner"
cls = "postrain.actors.learner:LearnerActor"
cpus = 0.5
memory_mb = 0
options = {{ learner = {{ lr = 1e-3 }} }}
[[actors]]
name = "env"
cls = "postrain.actors.env:EnvironmentActor"
cpus = 0.1
memory_mb = 0
options = {{ }}
[[actors]]
name = "orchestrator"
cls = "postrain.actors.orchestrator:OrchestratorActor"
cpus = 0.1
memory_mb = 0
options = {{ num_steps = 2, prompts_per_step = 3, samples_per_prompt = 2, max_staleness = 1, sft_steps = 2, sft_batch_size = 4, num_eval_tasks = 4, eval_samples_per_task = 2, sampling = {{ max_new_tokens = 24 }} }}
"""


def run_up(tmp_path, task, orchestrator_options=""):
    """`postrain up` on CONFIG; `orchestrator_options` ("eval_every = 1, ") go before its others."""
    (tmp_path / "flaky_task.py").write_text(FLAKY_TASK)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "runs", task=task)
                      .replace("options = { num_steps", f"options = {{ {orchestrator_options}num_steps"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", str(config)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path / "runs" / "e2e", result.stdout


@pytest.fixture(scope="module")
def arithmetic_run(tmp_path_factory):
    """(run folder, stdout) of one run on CONFIG with an evaluation after each RL step, which the
    tests below read (and the checkpoint test starts a second run from)."""
    return run_up(tmp_path_factory.mktemp("arithmetic"), "arithmetic", "eval_every = 1, ")


def test_up_runs_eval_warm_start_and_grpo_steps_and_accounts_for_every_sample(arithmetic_run):
    folder, stdout = arithmetic_run
    assert "held-out accuracy before" in stdout and "step 2/2" in stdout
    summary = json.loads((folder / "summary.json").read_text())
    assert {"eval_before", "eval_after", "steps", "samples", "ledger"} <= set(summary)
    # each evaluation is greedy and sampled (eval_samples_per_task = 2), one during RL (eval_every = 1)
    phases = ("before", "after_sft", "step_1", "after")
    assert all(0.0 <= summary[f"eval_sampled_{phase}"] <= 1.0 for phase in phases)
    evals = read_metrics(folder, "eval")
    assert [row["phase"] for row in evals] == list(phases)
    assert all("accuracy_sampled" in row for row in evals)
    assert [row.get("step") for row in evals] == [None, None, 1, 2] and "held-out accuracy after RL step 1" in stdout
    assert 0 <= evals[2]["rl_wall_s"] <= evals[3]["rl_wall_s"] and summary["rl_eval_s"] > 0
    assert not summary["rl_budget_spent"]
    ledger = summary["ledger"]
    assert summary["steps"] == 2 and summary["complete"] and ledger["created"] == 2 * 3 * 2
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and summary["samples"] == ledger["trained"]
    train_rows = read_metrics(folder, "train")
    assert [row["step"] for row in train_rows] == [1, 2]
    assert all("loss" in row and "reward_mean" in row for row in train_rows)
    assert len(read_metrics(folder, "sft")) == 2
    assert (folder / "checkpoint").is_dir()
    first = read_events(folder / "ledger.jsonl", "b0-g0-s0")
    assert [e["event"] for e in first if e["event"] in STATES] == ["created", "generated", "rewarded", "trained"]
    # the rollout's hops are in the ledger, and `postrain trace` and `postrain plot` read the run
    hops = {e["event"]: e for e in first if e["event"] not in STATES}
    assert hops["episode"]["actor"] == "env" and hops["generate"]["actor"] == "generator"
    assert hops["generate"]["num_tokens"] > 0 and hops["generate"]["policy_versions"]
    assert first[-1]["event"] == "trained" and first[-1]["staleness"] in (0, 1)
    assert all("staleness_mean" in row for row in train_rows)
    traced = subprocess.run([sys.executable, "-m", "postrain.cli", "trace", str(folder), "b0-g0-s0"],
                            capture_output=True, text=True, timeout=120)
    assert traced.returncode == 0, traced.stderr
    assert "env -> generator" in traced.stdout and "outcome: trained in step 1\n\nsample b0-g0-s0" in traced.stdout
    assert "  prompt:\n" in traced.stdout and "  completion" in traced.stdout   # what the model said
    # samples.jsonl: every trained sample's text, reward and advantage; `postrain samples` prints them
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert sorted(row["sample_id"] for row in samples) == sorted(
        e["sample_id"] for e in read_events(folder / "ledger.jsonl") if e["event"] == "trained")
    assert all(row["prompt"] and row["turns"] and isinstance(row["advantage"], float) for row in samples)
    assert {row["step"] for row in samples} == {1, 2} and all(row["task"] == "arithmetic" for row in samples)
    printed = subprocess.run([sys.executable, "-m", "postrain.cli", "samples", str(folder), "--step", "1",
                              "--worst", "--limit", "2"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and printed.stdout.count("\nsample b0-") == 1, printed.stderr
    # progress: real counts, elapsed and ETA on every phase's lines, and the same lines in the run folder
    assert "evaluating the initial policy on 4 held-out tasks" in stdout
    assert re.search(r"sft step 2/2: loss \S+ \(\d+:\d\d elapsed, ETA 0:00\)", stdout), stdout
    assert re.search(r"step 2/2: reward .* \(\d+:\d\d elapsed, ETA 0:00\)", stdout), stdout
    assert re.search(r"held-out accuracy before: .* \(12 episodes, [\d.]+ s\)", stdout), stdout
    orchestrator_log = (folder / "logs" / "orchestrator.log").read_text()
    assert "held-out accuracy before" in orchestrator_log and "step 2/2: reward" in orchestrator_log
    assert "cores lend" not in orchestrator_log and "cores return" not in orchestrator_log
    assert all(row["num_groups"] == 3 and 0 <= row["num_zero_variance_groups"] <= 3 for row in train_rows)
    plotted = subprocess.run([sys.executable, "-m", "postrain.cli", "plot", str(folder)],
                             capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0 and "reward.png" in plotted.stdout, plotted.stderr
    assert (folder / "plots" / "reward.png").exists() and (folder / "plots" / "accuracy.png").exists()
    # the exported policy is a model folder that `postrain eval` scores in the real sandbox
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "eval", "--model", str(folder / "policy"),
                             "--task", "arithmetic", "--num-tasks", "3", "--max-tokens", "24", "--json",
                             "--task-options", '{"include_instructions": false, "max_digits": 1}'],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["num_tasks"] == 3 and 0.0 <= scored["accuracy"] <= 1.0


def test_a_learner_that_starts_from_a_checkpoint_is_what_generators_sample_and_eval_scores(arithmetic_run,
                                                                                           tmp_path):
    first_folder, _ = arithmetic_run
    first = json.loads((first_folder / "summary.json").read_text())
    checkpoint = first_folder / "checkpoint"
    version = 2 + 2   # the first run's supervised steps + RL steps
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "runs", task="arithmetic")
                      .replace("lr = 1e-3 } }", f'lr = 1e-3 }}, resume_from = "{checkpoint}" }}')
                      .replace("num_steps = 2", "num_steps = 3, max_rl_wall_s = 0.001")
                      .replace("sft_steps = 2", "sft_steps = 0")
                      .replace("options = { kv_cache_mb = 16 }", "options = { kv_cache_mb = 16, speculative = "
                               '{ method = "rollouts", min_ngram = 1 } }'))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", str(config)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    second = json.loads((tmp_path / "runs" / "e2e" / "summary.json").read_text())
    # the RL time budget ends RL after its first step, then the final evaluation runs
    assert second["steps"] == 1 and second["rl_budget_spent"] and "RL time budget spent" in result.stdout
    assert [row["phase"] for row in read_metrics(tmp_path / "runs" / "e2e", "eval")][-1] == "after"
    ledger = second["ledger"]
    assert ledger["trained"] == 6 and ledger["created"] == ledger["trained"] + ledger["dropped"]
    assert all("max_rl_wall_s" in reason for reason in ledger["drop_reasons"])
    # greedy evaluation of the same weights on the same held-out tasks (the second run speculates)
    assert second["eval_before"] == first["eval_after"]
    # the speculating generator's figures are in each step's sync row
    assert not any("acceptance_rate_generator" in row for row in read_metrics(first_folder, "sync"))
    sync = read_metrics(tmp_path / "runs" / "e2e", "sync")
    assert sync and all(0 < row["acceptance_rate_generator"] <= 1
                        and row["tokens_per_verify_step_generator"] > 1
                        and 0 < row["draft_time_share_generator"] < 1 for row in sync)
    events = read_events(tmp_path / "runs" / "e2e" / "ledger.jsonl", "b0-g0-s0")
    generate = next(e for e in events if e["event"] == "generate")
    assert min(generate["policy_versions"]) == version
    assert events[-1]["event"] == "trained" and events[-1]["staleness"] == 0


def test_an_environment_that_raises_loses_only_its_samples(tmp_path):
    # every sample of step 2 fails; 1.0: no step stops the run for it (a bug would: the next test)
    folder, _ = run_up(tmp_path, "flaky_task:TASK", "max_environment_error_fraction = 1.0, ")
    summary = json.loads((folder / "summary.json").read_text())
    ledger = summary["ledger"]
    assert ledger["created"] == ledger["trained"] + ledger["dropped"]
    reasons = " ".join(ledger["drop_reasons"])
    # seed 0: the first step's prompts hold no 7, all of the second step's do
    assert ledger["trained"] == 6 and ledger["dropped"] == 6 and "dislikes sevens" in reasons
    events = [e for e in read_events(folder / "ledger.jsonl") if e["event"] == "dropped"]
    assert all(e["reason"] for e in events)


TYPO_ENV = """\
import itertools

from postrain.actors import Environment, Reward, StepResult


class MyEnv(Environment):
    @classmethod
    def train_tasks(cls, seed, options):
        return ({"question": f"Say hi ({i})."} for i in itertools.count())

    @classmethod
    def eval_tasks(cls, options):
        return [{"question": "Say hi."}]

    async def reset(self, task):
        return task["question"]

    async def step(self, action):
        self.targte()
        return StepResult(None, True, Reward({"correct": 1.0}))
"""


def test_a_typo_in_the_users_environment_stops_the_run_naming_the_error_its_line_and_the_count(tmp_path):
    """The cheapest real run (tests/actors/task_runs.py: one step of 3 prompts x 2 samples), its
    held-out evaluation left out so that the failures meet the first RL step."""
    from task_runs import run_config   # tests/actors/task_runs.py
    from postrain.core.testing import to_toml

    (tmp_path / "my_env.py").write_text(TYPO_ENV)   # beside the config: on the run's import path
    config = run_config(tmp_path, "my_env:MyEnv", {})
    config["actors"][-1]["options"]["num_eval_tasks"] = 0
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", str(path), "--quiet"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    line = 1 + TYPO_ENV.splitlines().index("        self.targte()")
    error = "AttributeError: 'MyEnv' object has no attribute 'targte'"
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f"RunStoppedError: environment raised {error} at my_env.py:{line} in 6 of 6 samples of step 1; "
            "fix your environment (docs/environments.md)") in result.stderr.splitlines()[0], result.stderr
    # the first failure was shown at once, once, its traceback trimmed to the user's frame
    shown = result.stdout.split("Traceback (most recent call last; postrain's frames left out):\n")
    assert len(shown) == 2, result.stdout
    assert shown[1].splitlines()[:3] == [f'  File "{tmp_path / "my_env.py"}", line {line}, in step',
                                         "    self.targte()", error]
    assert not (tmp_path / "runs" / "task" / "summary.json").exists()


def test_chat_to_tokens_masks_exactly_the_assistant_turns():
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "<python>\nprint(2 + 3)\n</python>"},
                {"role": "user", "content": "<output>\n5\n</output>"},
                {"role": "assistant", "content": "<answer>5</answer>"}]
    ids, mask = chat_to_tokens(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, add_generation_prompt=False)
    taught = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "<python>\nprint(2 + 3)\n</python>" in taught and "<answer>5</answer>" in taught
    assert "What is" not in taught and "<output>" not in taught


def test_no_loss_spans_keep_exactly_those_characters_out_of_the_loss():
    """A teacher's answer from memory teaches answering without the tool, not its digits."""
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "What is 37 * 58?"},
                {"role": "assistant", "content": "<answer>2146</answer>", "no_loss_spans": [[8, 12]]}]
    ids, mask = chat_to_tokens(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, add_generation_prompt=False)
    taught = [tok.decode([i]) if m else "_" for i, m in zip(ids, mask)]
    assert "".join(taught).endswith("<answer>____</answer><|im_end|>\n")
    # an assistant turn the template does not write verbatim cannot be masked by position
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DemonstrationError, match="verbatim"):
        chat_to_tokens(tok, messages)
