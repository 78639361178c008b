"""The files `postrain init` writes: an environment package that `postrain up` runs at once.

Each template is a `string.Template`: `$package` (the import name), `$dist_name` (the
distribution name in pyproject.toml) and `$run_name` (the run folder's name). Invariant:
the written package imports only the public faces (`postrain.actors`, `postrain.core`,
`postrain.actors.env.tools`), so a user's project keeps working across postrain's internal
moves; tests/cli/test_init.py runs what these templates write (its test, `--dry-run`, a run).
"""
from __future__ import annotations

from string import Template

ENV_MODULE = Template('''\
"""$package.env: a word-reversal environment, the starting point of your own.

The model reads "Reverse 'word'." and answers in <answer></answer>; it may first run Python
in the sandbox with <python></python> (the sandbox actor runs it; the output comes back as
the next user turn). The reward has two named components: `correct` (1/0) and `format`
(1 when every turn was well-formed), weighted by the task option `format_weight`.

Change `reset` and `step` for your task, `TRAIN_WORDS`/`EVAL_WORDS` for your data, and
`demonstrations` for the warm start (or set sft_steps = 0 in run.toml). The run config names
this module by import path, `$package.env:TASK`: postrain finds it because run.toml sits
beside the package (the config's folder is on the import path); from elsewhere,
`pip install -e .` this folder.
"""
from __future__ import annotations

import random

from pydantic import Field

from postrain.actors import Environment, Reward, StepResult, TaskSpec
from postrain.actors.env.tools import format_tool_output, parse_action
from postrain.core import Options

TRAIN_WORDS = ["postrain", "sandbox", "reward", "policy", "actor", "token", "sample", "python",
               "answer", "window", "garden", "yellow", "planet", "silver", "orange", "castle"]
EVAL_WORDS = ["learner", "ledger", "kernel", "socket"]   # held out: never in TRAIN_WORDS


class ReverseOptions(Options):
    """The task's options (task_options in run.toml); a misspelt one is an error naming it."""
    format_weight: float = Field(0.1, ge=0, description="weight of the `format` reward component")


class ReverseEnv(Environment):
    max_turns = 3          # assistant turns per episode
    uses_sandbox = True    # it runs the model's Python: the run needs a sandbox actor
    options_model = ReverseOptions

    async def reset(self, task):
        self.word = task["word"]
        return prompt(self.word)

    async def step(self, action):
        act = parse_action(action)
        if act.kind == "tool_call":
            result = await self.sandbox.exec(act.content)
            return StepResult(format_tool_output(result), done=False)
        correct = act.kind == "answer" and act.content.strip() == self.word[::-1]
        return StepResult(None, done=True, reward=Reward(
            {"correct": float(correct), "format": float(act.well_formed)},
            weights={"format": self.options.format_weight}))


def prompt(word: str) -> str:
    return f"Reverse {word!r}. Run Python in <python></python>; answer in <answer></answer>."


def train_tasks(seed, options):
    """Endless, deterministic for a seed: the training stream."""
    rng = random.Random(seed)
    while True:
        yield {"word": rng.choice(TRAIN_WORDS)}


def eval_tasks(options):
    """The held-out set: the same list every time."""
    return [{"word": word} for word in EVAL_WORDS]


def demonstrations(num, seed, options):
    """Chat demonstrations for the supervised warm start (sft_steps): the first message is
    exactly what `reset` returns, the answer in the tool-call format."""
    rng = random.Random(seed)
    demos = []
    for _ in range(num):
        word = rng.choice(TRAIN_WORDS)
        demos.append({"messages": [{"role": "user", "content": prompt(word)},
                                   {"role": "assistant", "content": f"<answer>{word[::-1]}</answer>"}]})
    return demos


TASK = TaskSpec("$package", ReverseEnv, train=train_tasks, eval=eval_tasks, demos=demonstrations)
''')

INIT_MODULE = Template('''\
"""$package: a postrain environment package (made by `postrain init`).

run.toml names its task as `$package.env:TASK`.
"""
from .env import TASK, ReverseEnv

__all__ = ["TASK", "ReverseEnv"]
''')

RUN_CONFIG = Template('''\
# The run of $package's task: `postrain up --config run.toml` (from this folder).
# A tiny model from scratch (no download) gets a short supervised warm start on the task's
# demonstrations, then GRPO; about a minute or two on 2 CPU cores. Every option of every
# actor: docs/config-reference.md; check an edit with `postrain up --config run.toml --dry-run`.

[run]
name = "$run_name"
run_dir = "runs"            # the run folder is runs/$run_name (relative to where you start postrain)
driver = "orchestrator"

[shared]                    # read by every actor that declares the option
model = "tiny"
seed = 0
task = "$package.env:TASK"   # found because this file's folder is on the import path
task_options = { format_weight = 0.1 }

[head]
heartbeat_timeout_s = 120.0

[[actors]]
name = "sandbox"
cls = "postrain.actors.sandbox:SandboxActor"
cpus = 0.2
memory_mb = 1024
options = { mode = "warm", num_workers = 2 }

[[actors]]
name = "generator"
cls = "postrain.actors.generator:GeneratorActor"
cpus = 0.75
memory_mb = 2048
options = { kv_cache_mb = 32, max_num_seqs = 32 }

[[actors]]
name = "learner"
cls = "postrain.actors.learner:LearnerActor"
cpus = 0.75
memory_mb = 2048
options = { learner = { lr = 3e-3, rl_lr = 1e-4, micro_batch_size = 32 } }

[[actors]]
name = "env"
cls = "postrain.actors.env:EnvironmentActor"
cpus = 0.1
memory_mb = 512
options = { generator = "generator", sandbox = "sandbox", max_total_tokens = 512 }

[[actors]]
name = "orchestrator"
cls = "postrain.actors.orchestrator:OrchestratorActor"
cpus = 0.1
memory_mb = 512

[actors.options]            # the orchestrator's: the run's size
sft_steps = 100             # warm start on the task's demonstrations; 0: RL from the model as it is
sft_batch_size = 16
num_steps = 20              # GRPO steps
prompts_per_step = 8
samples_per_prompt = 4      # the group size
num_eval_tasks = 4          # held-out tasks per evaluation (before, after the warm start, after RL)
sampling = { temperature = 1.0, max_new_tokens = 32 }
''')

TEST_MODULE = Template('''\
"""$package's environment, played by a script: `python -m pytest tests` from the project folder."""
import trio

from postrain.actors import TextPolicy, run_episode
from $package.env import TASK


def play(*turns, options=None):
    """One episode of the first held-out task with fixed assistant turns; the episode."""
    queue = list(turns)

    async def act(messages):
        return queue.pop(0)
    env = TASK.make_env(options=options)   # no sandbox: these turns run no code
    return trio.run(run_episode, env, TASK.eval_tasks()[0], TextPolicy(act))


def test_the_right_answer_is_rewarded():
    episode = play("<answer>renrael</answer>")
    assert episode.reward.components == {"correct": 1.0, "format": 1.0}


def test_a_wrong_answer_is_not_and_the_options_weigh_format():
    episode = play("<answer>learner</answer>", options={"format_weight": 0.5})
    assert episode.reward.components["correct"] == 0.0 and episode.reward.weights == {"format": 0.5}


def test_demonstrations_start_with_what_reset_returns():
    demo = TASK.demonstrations(1, seed=0)[0]["messages"]
    word = demo[0]["content"].split("'")[1]
    assert demo[1]["content"] == f"<answer>{word[::-1]}</answer>"
''')

PYPROJECT = Template('''\
# `pip install -e '.[test]'` brings pytest for tests/ and makes $package importable from anywhere
# (not needed to run run.toml here).
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist_name"
version = "0.1.0"
description = "A postrain environment: $package.env:TASK"
requires-python = ">=3.11"
dependencies = ["postrain"]

[project.optional-dependencies]
test = ["pytest"]

[tool.setuptools]
packages = ["$package"]
''')

README = Template('''\
# $package

A postrain environment package, made by `postrain init`. From this folder:

```bash
pip install -e '.[test]'                        # pytest, and $package importable from anywhere
python -m pytest tests                          # the environment, played by a script
postrain up --config run.toml --dry-run         # check the config, print the placement
postrain up --config run.toml                   # the run: runs/$run_name
postrain samples runs/$run_name --worst         # what the model said
postrain report runs/$run_name                  # one HTML page: charts, samples, evaluations
```

Edit `$package/env.py` (the environment and its task) and `run.toml` (the run).
''')

# relative path -> template; the order `postrain init` writes and lists them in.
FILES: dict[str, Template] = {
    "$package/__init__.py": INIT_MODULE,
    "$package/env.py": ENV_MODULE,
    "run.toml": RUN_CONFIG,
    "tests/test_env.py": TEST_MODULE,
    "pyproject.toml": PYPROJECT,
    "README.md": README,
}
