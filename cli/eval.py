"""`postrain eval [FOLDER] [--model PATH] [--task NAME]`: held-out accuracy of a model on a task.

    postrain eval runs/default                       # the run's policy on the run's own task
    postrain eval runs/default/policy                # an exported model folder (here: a run's policy)
    postrain eval --model runs/default/policy --task arithmetic --task-options '{"max_digits": 2}'

FOLDER is a run folder or an exported model folder, and the first line printed says which it
read. With a run folder (a folder `postrain up` wrote), every default comes from the run: the
model is its exported `policy/`, the task and its options, the number of held-out tasks
(`num_eval_tasks`) and the new tokens per turn (`sampling.max_new_tokens`) are the
orchestrator's in FOLDER/config.toml (the config the run started from; the modules it
names are imported from the folder that config came from, as `postrain up` did). An exported
model folder (a Hugging Face folder: config.json and *.safetensors, as `postrain export` and a
run's `policy/` are) is the model; when it is a run's `policy/`, the task and the rest are that
run's. A flag given overrides its default. Without FOLDER, --model is required; without a run,
the task defaults to arithmetic with its default options. The current folder is on the import
path, so a task `my_env:MyEnv` is found in the folder `postrain eval` runs in.

PATH is a Hugging Face folder (a run's `policy/` export), a .gguf file or a
built-in name; the task is a registered name, 'pkg.mod:TASK' or 'pkg.mod:EnvClass'.
Every held-out task runs as a real episode through the one episode driver that
training uses (`postrain.actors.env.run_episode`, so a reward here is the
reward the environment actor gives in training): greedy decoding with the engine,
tool calls in a warm nsjail sandbox (only for tasks whose environment declares
`uses_sandbox`), the task's own reward. Accuracy is the mean of the `correct`
reward component (or of the total reward for tasks without one, such as `code`:
the fraction of hidden tests passed); `causes` counts the episodes by the cause their
environment named (`Episode.cause`: the CAD task's `ok`, `script_error`, `wrong_shape`,
`no_export`, `invalid_export`), so failures read by kind. While it runs, `EpisodeProgress` says
on stderr how far it is (at most every 10 s). An episode whose environment fails scores
0 and is counted; the first failure is printed at once (stderr) with its traceback trimmed to
the user's frames, and an evaluation whose episodes fail mostly by one error (more than the
run's `max_environment_error_fraction`, 0.5 without a run) ends with that error in one line and
exit status 1, not with an accuracy (actors/env/user_errors.py).

An agent module (a task whose environment is an `AgentEnvironment`, e.g.
`--task examples/agents/arithmetic_agent.py`'s `arithmetic_agent:ArithmeticAgent`) is evaluated
through a gateway, as it trains: a generator and a gateway actor are started for the model
(as `postrain serve` starts them), and each held-out task is one episode of the agent's own
`run(client, task)` with its own sampling settings (cli/eval_agents.py); the result adds
`num_model_calls`. `--max-tokens` does not apply (the agent sets its own).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import trio

from postrain.core.progress import PhaseProgress
from postrain.core.text import counted, tally

HELP = "held-out accuracy of a run's policy (or any model) on a task (greedy, real sandbox)"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a one-line error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", nargs="?", metavar="FOLDER",
                        help="a run folder (run_dir/name): its policy/, task, task options, num_eval_tasks "
                        "and max_new_tokens are the defaults; or an exported model folder (config.json "
                        "and *.safetensors), the model")
    parser.add_argument("--model", help="HF folder (e.g. RUN_FOLDER/policy), .gguf file or built-in name "
                        "(default: FOLDER's; required without FOLDER)")
    parser.add_argument("--task", help="task name, pkg.module:TASK or pkg.module:EnvClass (default: the run's, "
                        "else arithmetic)")
    parser.add_argument("--task-options", help='task knobs as a JSON object, e.g. \'{"max_digits": 2}\' '
                        "(default: the run's for the run's task, else the task's defaults)")
    parser.add_argument("--num-tasks", type=positive_int, default=None,
                        help="evaluate only the first N held-out tasks, N >= 1 (default: the run's "
                        "num_eval_tasks, else all)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="new tokens per turn, >= 1 (default: the run's max_new_tokens, else 128)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args) -> int:
    from postrain.core.errors import ConfigError, PostrainError
    if os.getcwd() not in sys.path:   # a task module in the current folder, as `python -m` finds one
        sys.path.insert(0, os.getcwd())
    try:
        plan = eval_plan(args)
        # the first line: what was read (on stderr with --json, whose stdout is one JSON object)
        print(f"postrain eval: {plan['read']}", file=sys.stderr if args.json else sys.stdout, flush=True)
        result = trio.run(lambda: evaluate(plan["model"], plan["task"], plan["task_options"],
                                           plan["num_tasks"], plan["max_tokens"],
                                           max_error_fraction=plan["max_error_fraction"]))
    except (ConfigError, PostrainError) as exc:  # a bad folder, task, option or model; a broken env: one line
        raise SystemExit(f"postrain eval: {exc}") from None
    if args.json:
        print(json.dumps({**result, "task_options": plan["task_options"], "source": plan["source"]}))
    else:
        print(f"{result['task']}: accuracy {result['accuracy']:.3f} on {counted(result['num_tasks'], 'held-out task')} "
              f"({result['num_failed']} failed episodes) with {result['model']}"
              + (f" (task and options from {plan['source']})" if plan["source"] else "")
              + (f"; causes: {tally(result['causes'])}" if result.get("causes") else ""))
    return 0


def eval_plan(args) -> dict:
    """model, task, task_options, num_tasks, max_tokens, max_error_fraction, source (the run config
    read, or None) and read (what FOLDER was, one line): the flags given, else FOLDER's, else the
    defaults. PostrainError names a bad one."""
    from postrain.actors.env.user_errors import DEFAULT_MAX_ERROR_FRACTION
    from postrain.core.errors import PostrainError
    run = folder_defaults(Path(args.run_folder)) if args.run_folder else {}
    if args.model is None and not run:
        raise PostrainError("give a run folder (`postrain eval runs/default`) or --model PATH")
    task = args.task or run.get("task", "arithmetic")
    if args.task_options is not None:
        try:
            task_options = json.loads(args.task_options)
        except json.JSONDecodeError as exc:
            raise PostrainError(f"--task-options must be a JSON object, got {args.task_options!r} ({exc})") from None
        if not isinstance(task_options, dict):
            raise PostrainError(f"--task-options must be a JSON object, got {args.task_options!r}")
    else:
        task_options = run.get("task_options", {}) if task == run.get("task") else {}
    model = args.model or run["model"]
    read = (f"read {run['read']}: model {model}" if run else f"model {model} (--model)") + f", task {task}"
    return {"model": model, "task": task, "task_options": task_options,
            "num_tasks": args.num_tasks or run.get("num_tasks"),
            "max_tokens": args.max_tokens or run.get("max_tokens", 128),
            "max_error_fraction": run.get("max_error_fraction", DEFAULT_MAX_ERROR_FRACTION),
            "source": run.get("source"), "read": read}


def is_exported_model(folder: Path) -> bool:
    """A Hugging Face model folder: config.json beside *.safetensors weights."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def folder_defaults(folder: Path) -> dict:
    """What FOLDER gives: a run folder's defaults (`run_defaults`), or an exported model folder's
    (the model, and the run's defaults too when it is a run's policy/), with `read`, the line that
    says which it was. PostrainError when it is neither."""
    from postrain.core.errors import PostrainError
    if (folder / "config.toml").is_file():
        return {**run_defaults(folder),
                "read": f"run folder {folder} (config.toml: its policy/, task and options)"}
    if is_exported_model(folder):
        if folder.name == "policy" and (folder.parent / "config.toml").is_file():
            return {**run_defaults(folder.parent), "model": str(folder),
                    "read": f"exported model folder {folder}, the policy of run {folder.parent} "
                            "(its task and options)"}
        return {"model": str(folder), "read": f"exported model folder {folder} (config.json, safetensors)"}
    raise PostrainError(f"{folder} holds no config.toml, so it is not a run folder, nor config.json and "
                        "*.safetensors, so it is not an exported model; give the folder `postrain up` ran in "
                        "(run_dir/name), a model folder (`postrain export`'s, a run's policy/), or --model "
                        "and --task")


def run_defaults(folder: Path) -> dict:
    """What a run folder says about evaluating its policy: model (its policy/), task, task_options,
    num_tasks, max_tokens and max_error_fraction (the orchestrator's options, [shared] filled in),
    source (the config)."""
    from postrain.actors.configs.run_config import load_up_config, run_import_dir
    from postrain.core.actor import import_actor_class
    from postrain.core.errors import PostrainError
    from postrain.core.options import options_class, validate_options
    path = folder / "config.toml"
    config = load_up_config(path, import_dir=run_import_dir(folder))
    specs = sorted(config.actors, key=lambda spec: spec.name != config.run.driver)   # the driver first
    # the options of the actor whose class has a `task` field: read by name, as that class declares them
    options: Any = next((validate_options(cls, spec.options) for spec in specs
                    if "task" in options_class(cls := import_actor_class(spec.cls)).model_fields), None)
    if options is None:
        raise PostrainError(f"{path} names no task (no actor has a `task` option); give --model and --task")
    policy = folder / "policy"
    if not policy.is_dir():
        raise PostrainError(f"{folder} holds no policy/ (a run exports it when it finishes); finish the run "
                            f"(`postrain up --resume {folder}`) or give --model")
    run = {"model": str(policy), "task": options.task, "task_options": dict(options.task_options),
           "source": str(path)}
    if getattr(options, "num_eval_tasks", 0):
        run["num_tasks"] = options.num_eval_tasks
    sampling = getattr(options, "sampling", None)
    if sampling is not None and getattr(sampling, "max_new_tokens", None):
        run["max_tokens"] = sampling.max_new_tokens
    if hasattr(options, "max_environment_error_fraction"):
        run["max_error_fraction"] = options.max_environment_error_fraction
    return run


async def evaluate(model_spec: str, task_name: str, task_options: dict, num_tasks: int | None,
                   max_tokens: int, *, policy=None, max_error_fraction: float | None = None) -> dict:
    """Held-out accuracy of `model_spec` on a task (see the module docstring). `policy` (an
    `EpisodePolicy` or `fn(messages) -> text`) plays instead of the model when given (tests).
    Raises EnvironmentErrorStop when more than `max_error_fraction` (default 0.5) of the episodes
    failed with one error; the first failure is printed on stderr at once. Cancelled: no result;
    the local sandbox is shut (a run in it ends within its limits), and the episode's env.close()
    is awaited in the cancelled scope, so it may not finish."""
    from postrain.actors.env import EnvironmentErrors, run_episode, score_episodes
    from postrain.actors.env.user_errors import DEFAULT_MAX_ERROR_FRACTION

    from .eval_agents import evaluate_agent

    task = load_task(task_name)
    task_options = task.check_options(task_options)
    tasks = task.eval_tasks(task_options)[:num_tasks]
    if not tasks:
        from postrain.core.errors import PostrainError
        raise PostrainError(f"task {task.name!r} has no held-out tasks with these options; fix: check "
                            "--task-options (or the task's eval_tasks)")
    fraction = DEFAULT_MAX_ERROR_FRACTION if max_error_fraction is None else max_error_fraction
    errors = EnvironmentErrors(fraction, show=lambda line: print(line, file=sys.stderr, flush=True))
    from postrain.actors.env import AgentEnvironment
    if isinstance(task.env_class, type) and issubclass(task.env_class, AgentEnvironment):
        return await evaluate_agent(model_spec, task, task_options, tasks, errors)
    if policy is None:
        policy = engine_policy(model_spec, max_tokens)
    causes: collections.Counter[str] = collections.Counter()
    progress = EpisodeProgress(len(tasks), show=lambda line: print(line, file=sys.stderr, flush=True))

    async def play(env, item):
        try:
            episode = await run_episode(env, item, policy)
        finally:
            progress.advance()
        if episode.cause:
            causes[episode.cause] += 1
        return episode
    scores, failed = await score_episodes(task, task_options, tasks, play, errors)
    return {"task": task.name, "model": str(model_spec), "num_tasks": len(tasks), "num_failed": failed,
            "accuracy": statistics.fmean(scores) if scores else 0.0, "causes": dict(causes)}


class EpisodeProgress:
    """`  episodes 5/27 (1:02 elapsed, ETA 4:28)` after an episode, at most every `interval_s`
    seconds and never after the last: a long evaluation (minutes a CAD episode on a small CPU)
    says how far it is, a fast one prints once or not at all."""

    def __init__(self, total: int, show: Callable[[str], None], interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.progress = PhaseProgress("eval", total, clock=clock)
        self.show = show
        self.interval_s = interval_s
        self.clock = clock
        self._last = clock()

    def advance(self) -> None:
        self.progress.advance()
        now = self.clock()
        if self.progress.done < self.progress.total and now - self._last >= self.interval_s:
            self._last = now
            self.show(f"  episodes {self.progress.done}/{self.progress.total} ({self.progress.timing_text()})")


def load_task(name: str):
    """`get_task(name)`; a 'module:Name' task whose module is nowhere on the import path is refused
    with the fix that applies here: the current folder is on it (`main`)."""
    from postrain.actors.tasks import TaskError, get_task
    try:
        return get_task(name)
    except TaskError:
        top = name.partition(":")[0].partition(".")[0]
        if ":" not in name or importlib.util.find_spec(top) is not None:
            raise
        raise TaskError(f"cannot load task {name!r}: there is no module {top!r} in the current folder "
                        f"({os.getcwd()}) or installed; fix: run postrain eval in the folder that holds "
                        f"{top} (the current folder is on its import path), or `pip install -e` its "
                        "project") from None


def engine_policy(model_spec: str, max_tokens: int):
    """Greedy decoding with the local engine, text in and out, stopping at a tool call's end."""
    from postrain.actors.models.loading import load_model
    from postrain.actors.generator.engine import Engine
    from postrain.actors.env import TextPolicy
    from postrain.actors.env import require_text_messages
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.env.tools import STOP_STRINGS

    model, tokenizer = load_model(model_spec)
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop=STOP_STRINGS)

    async def act(messages):
        """The model's greedy reply. Cancelled: the generate call runs on to its end in its thread."""
        require_text_messages(messages, "postrain eval's local engine")   # images need a vision-language policy
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        output = await trio.to_thread.run_sync(lambda: engine.generate([prompt], params)[0])
        return tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    return TextPolicy(act)
