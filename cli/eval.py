"""`postrain eval --model PATH --task NAME`: held-out accuracy of a model on a task.

PATH is a Hugging Face folder (a run's `policy/` export), a .gguf file or a
built-in name. Every held-out task runs as a real episode: greedy decoding
with the engine, tool calls in a warm nsjail sandbox, the task's own reward.
Accuracy is the mean of the `correct` reward component (or of the total
reward for tasks without one, such as `code`: the fraction of hidden tests
passed). An episode whose environment fails scores 0 and is counted.
"""
from __future__ import annotations

import json
import statistics

import trio

HELP = "held-out accuracy of a model on a task (greedy, real sandbox)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="HF folder (e.g. RUN_FOLDER/policy), .gguf file or built-in name")
    parser.add_argument("--task", default="arithmetic", help="task name or pkg.module:TASK (default: arithmetic)")
    parser.add_argument("--task-options", default="{}", help='task knobs as JSON, e.g. \'{"max_digits": 2}\'')
    parser.add_argument("--num-tasks", type=int, default=None, help="evaluate only the first N held-out tasks")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args) -> int:
    try:
        task_options = json.loads(args.task_options)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--task-options must be a JSON object: {exc}") from None
    result = trio.run(evaluate, args.model, args.task, task_options, args.num_tasks, args.max_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['task']}: accuracy {result['accuracy']:.3f} on {result['num_tasks']} held-out tasks "
              f"({result['num_failed']} failed episodes) with {result['model']}")
    return 0


async def evaluate(model_spec: str, task_name: str, task_options: dict, num_tasks: int | None,
                   max_tokens: int) -> dict:
    from postrain.sandbox import Sandbox

    from postrain.actors.checkpoint import load_model
    from postrain.actors.engine import Engine
    from postrain.actors.environment import LocalSandbox, run_episode
    from postrain.actors.sampling import SamplingParams
    from postrain.actors.tasks import get_task
    from postrain.actors.tools import STOP_STRINGS

    task = get_task(task_name)
    model, tokenizer = load_model(model_spec)
    engine = Engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop=list(STOP_STRINGS))

    async def policy(messages):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        output = await trio.to_thread.run_sync(lambda: engine.generate([prompt], params)[0])
        return tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)

    tasks = task.eval_tasks(task_options)[:num_tasks]
    scores, failed = [], 0
    with Sandbox(mode="warm", num_workers=1) as sandbox:
        for item in tasks:
            env = task.make_env(sandbox=LocalSandbox(sandbox), options=task_options)
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
