"""`postrain eval --model PATH --task NAME`: held-out accuracy of a model on a task.

PATH is a Hugging Face folder (a run's `policy/` export), a .gguf file or a
built-in name; the task is a registered name, 'pkg.mod:TASK' or 'pkg.mod:EnvClass'.
Every held-out task runs as a real episode through the one episode driver that
training uses (`postrain.actors.env.run_episode`, so a reward here is the
reward the environment actor gives in training): greedy decoding with the engine,
tool calls in a warm nsjail sandbox (only for tasks whose environment declares
`uses_sandbox`), the task's own reward. Accuracy is the mean of the `correct`
reward component (or of the total reward for tasks without one, such as `code`:
the fraction of hidden tests passed). An episode whose environment fails scores
0 and is counted.
"""
from __future__ import annotations

import contextlib
import json
import statistics

import trio

HELP = "held-out accuracy of a model on a task (greedy, real sandbox)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="HF folder (e.g. RUN_FOLDER/policy), .gguf file or built-in name")
    parser.add_argument("--task", default="arithmetic",
                        help="task name, pkg.module:TASK or pkg.module:EnvClass (default: arithmetic)")
    parser.add_argument("--task-options", default="{}", help='task knobs as JSON, e.g. \'{"max_digits": 2}\'')
    parser.add_argument("--num-tasks", type=int, default=None, help="evaluate only the first N held-out tasks")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args) -> int:
    try:
        task_options = json.loads(args.task_options)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--task-options must be a JSON object: {exc}") from None
    from postrain.core.errors import PostrainError
    try:
        result = trio.run(evaluate, args.model, args.task, task_options, args.num_tasks, args.max_tokens)
    except PostrainError as exc:  # a bad task, task option or model: one line, no traceback
        raise SystemExit(f"postrain eval: {exc}") from None
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['task']}: accuracy {result['accuracy']:.3f} on {result['num_tasks']} held-out tasks "
              f"({result['num_failed']} failed episodes) with {result['model']}")
    return 0


async def evaluate(model_spec: str, task_name: str, task_options: dict, num_tasks: int | None,
                   max_tokens: int, *, policy=None) -> dict:
    """Held-out accuracy of `model_spec` on a task (see the module docstring). `policy` (an
    `EpisodePolicy` or `fn(messages) -> text`) plays instead of the model when given (tests).
    Cancelled: no result; the local sandbox is shut (a run in it ends within its limits), and
    the episode's env.close() is awaited in the cancelled scope, so it may not finish."""
    from postrain.actors.env import LocalSandbox, run_episode
    from postrain.actors.tasks import get_task

    task = get_task(task_name)
    task_options = task.check_options(task_options)
    tasks = task.eval_tasks(task_options)[:num_tasks]
    if policy is None:
        policy = engine_policy(model_spec, max_tokens)
    scores, failed = [], 0
    with contextlib.ExitStack() as stack:
        sandbox = None
        if task.needs_sandbox(task_options):
            from postrain.sandbox import Sandbox
            sandbox = LocalSandbox(stack.enter_context(Sandbox(mode="warm", num_workers=1)))
        for item in tasks:
            env = task.make_env(sandbox=sandbox, options=task_options)
            try:
                episode = await run_episode(env, item, policy)
                scores.append(episode.reward.components.get("correct", episode.reward.total))
            except Exception:
                failed += 1
                scores.append(0.0)
            finally:
                await env.close()
    return {"task": task.name, "model": str(model_spec), "num_tasks": len(tasks), "num_failed": failed,
            "accuracy": statistics.fmean(scores) if scores else 0.0}


def engine_policy(model_spec: str, max_tokens: int):
    """Greedy decoding with the local engine, text in and out, stopping at a tool call's end."""
    from postrain.actors.models.loading import load_model
    from postrain.actors.generator.engine import Engine
    from postrain.actors.env import TextPolicy
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.env.tools import STOP_STRINGS

    model, tokenizer = load_model(model_spec)
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop=list(STOP_STRINGS))

    async def act(messages):
        """The model's greedy reply. Cancelled: the generate call runs on to its end in its thread."""
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        output = await trio.to_thread.run_sync(lambda: engine.generate([prompt], params)[0])
        return tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    return TextPolicy(act)
