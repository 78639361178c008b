"""The supervised warm start: `sft_steps` steps on the task's demonstrations before RL.

Demonstrations are conversations; `chat_to_tokens` renders one with the policy's chat
template and marks exactly the assistant turns' tokens for the loss, so the model learns
to answer (and to call tools) in the format the environments parse.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from ..records import SftBatch
from .options import OrchestratorOptions


async def warm_start(task, tokenizer, options: OrchestratorOptions, keeper, metrics,
                     emit: Callable[[str], None], publish: Callable[[], Awaitable]) -> None:
    """`sft_steps` supervised steps through the keeper, then publish the weights.

    Cancelled: the steps taken so far stay applied (each exactly once, see LearnerKeeper.step);
    the generators may still hold the weights from before the warm start."""
    num_steps, batch_size = options.sft_steps, options.sft_batch_size
    demos = task.demonstrations(num_steps * batch_size, seed=options.seed, options=options.task_options)
    for step in range(num_steps):
        chunk = demos[step * batch_size:(step + 1) * batch_size]
        rendered = [chat_to_tokens(tokenizer, d["messages"]) for d in chunk]
        batch = SftBatch(token_ids=[ids for ids, _ in rendered], loss_mask=[mask for _, mask in rendered])
        step_metrics = await keeper.step(batch)
        metrics.log("sft", **step_metrics)
        if step % 10 == 0 or step == num_steps - 1:
            emit(f"sft step {step + 1}/{num_steps}: loss {step_metrics['loss']:.3f}")
    await publish()


def chat_to_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a mask that is 1 on assistant turns' tokens
    (their content and the template's end-of-turn), for supervised training."""
    ids, mask = [], []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            segment = prompt[len(rendered):]
            ids += tokenizer.encode(segment, add_bos=not rendered and None)
            mask += [0] * (len(ids) - len(mask))
            through = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
            answer = tokenizer.encode(through[len(prompt):], add_bos=False)
            ids += answer
            mask += [1] * len(answer)
            rendered = through
    tail = tokenizer.apply_chat_template(messages, add_generation_prompt=False)[len(rendered):]
    if tail:
        tail_ids = tokenizer.encode(tail, add_bos=False)
        ids += tail_ids
        mask += [0] * len(tail_ids)
    mask[0] = 0
    return ids, mask
