"""The supervised warm start: `sft_steps` steps on the task's demonstrations before RL.

Demonstrations are conversations (the task's own, or a JSONL file: `sft_demonstrations`); `chat_to_tokens` renders one with the policy's chat
template and marks exactly the assistant turns' tokens for the loss, so the model learns
to answer (and to call tools) in the format the environments parse.

The warm start checkpoints like the RL loop: every `sft_checkpoint_every` steps and after
its last step (run state phase "sft", actors/orchestrator/run_state.py), through the same keeper, so a
learner killed mid-way is restored and only the steps since are replayed, and a resumed
run continues from the step after the checkpoint. Step s always trains on demonstrations
[s * sft_batch_size, (s + 1) * sft_batch_size) of the same seeded list.
"""
from __future__ import annotations

import random
from typing import Awaitable, Callable

from postrain.core.progress import PhaseProgress

from ..models.spec import spec_image_layout
from ..models.images import ImageLayout, content_parts_for_template, image_bytes, load_image
from ..records import SftBatch
from ..tasks import TaskError, TaskMixture
from ..tasks.demonstrations import DemonstrationError, read_jsonl, validate_demonstration
from .options import OrchestratorOptions


async def warm_start(mixture: TaskMixture, tokenizer, options: OrchestratorOptions, keeper, metrics,
                     emit: Callable[[str], None], publish: Callable[[], Awaitable],
                     checkpoint: Callable[[int], Awaitable], start_step: int = 0,
                     stopping: Callable[[], bool] = lambda: False,
                     progress: PhaseProgress | None = None) -> bool:
    """SFT steps `start_step`..`sft_steps`-1 through the keeper, `checkpoint(steps_done)` every
    `sft_checkpoint_every` steps and after the last, then publish the weights; True then. When
    `stopping()` turns true (`postrain down`, Ctrl-C), it checkpoints the steps done after the
    step in progress and returns False: a resume continues from that step. `progress` counts
    the steps (the head's live view) and puts elapsed and ETA in the progress lines.

    Cancelled: the steps taken so far stay applied (each exactly once, see LearnerKeeper.step);
    the last checkpoint is where a resume continues; the generators may still hold the weights
    from before the warm start."""
    num_steps, batch_size = options.sft_steps, options.sft_batch_size
    progress = progress or PhaseProgress("warm start", num_steps, done=start_step)
    demos = demonstrations(mixture, num_steps * batch_size, options)
    layout = spec_image_layout(options.model)   # a vision-language policy's; None: text only
    for step in range(start_step, num_steps):
        if stopping():
            await checkpoint(step)
            emit(f"stopped during the warm start after {step}/{num_steps} steps (checkpointed)")
            return False
        chunk = demos[step * batch_size:(step + 1) * batch_size]
        rendered = [chat_to_sample(tokenizer, layout, d["messages"]) for d in chunk]
        batch = SftBatch(token_ids=[ids for ids, _, _ in rendered], loss_mask=[mask for _, mask, _ in rendered],
                         images=[images for _, _, images in rendered] if any(r[2] for r in rendered) else None)
        step_metrics = await keeper.step(batch)
        metrics.log("sft", **step_metrics.values)
        progress.advance()
        if step % 10 == 0 or step == num_steps - 1:
            emit(f"sft step {step + 1}/{num_steps}: loss {step_metrics['loss']:.3f} "
                 f"({progress.timing_text()})")
        if (step + 1) % options.sft_checkpoint_every == 0 or step + 1 == num_steps:
            await checkpoint(step + 1)
    await publish()
    return True


def demonstrations(mixture: TaskMixture, num: int, options: OrchestratorOptions) -> list[dict]:
    """The warm start's `num` demonstrations: the file `sft_demonstrations` (read whole, shuffled
    with `seed`), else the tasks' own (`mixture_demonstrations`, each checked by
    `validate_demonstration`: a bad one raises DemonstrationError naming it); the first
    `sft_distinct_demonstrations` of them where that is set, then cycled to `num`."""
    distinct = min(num, options.sft_distinct_demonstrations or num)
    if options.sft_demonstrations is None:
        demos = [validate_demonstration(d, where=f"the task's demonstration {i}")
                 for i, d in enumerate(mixture_demonstrations(mixture, distinct, options.seed))]
    else:
        demos = read_jsonl(options.sft_demonstrations)
        random.Random(options.seed).shuffle(demos)
        demos = demos[:distinct]
    return [demos[i % len(demos)] for i in range(num)]


def mixture_demonstrations(mixture: TaskMixture, num: int, seed: int) -> list[dict]:
    """`num` demonstrations of the mixture's tasks that have some, in proportion to their weights
    (largest remainders), shuffled together with `seed`; one task's own, in its order, when the
    mixture is one task. TaskError when no task of it has demonstrations."""
    if mixture.is_single:
        task = mixture.tasks[0]
        return task.spec.demonstrations(num, seed=seed, options=task.options)
    with_demos = [task for task in mixture.tasks if task.spec.demos is not None]
    if not with_demos:
        raise TaskError(f"no task of the mixture {mixture.names} has demonstrations; fix: set the "
                        "orchestrator's sft_steps = 0 or its sft_demonstrations = \"FILE.jsonl\"")
    total = sum(task.weight for task in with_demos)
    exact = [num * task.weight / total for task in with_demos]
    counts = [int(share) for share in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[:num - sum(counts)]:
        counts[i] += 1
    demos = [d for task, count in zip(with_demos, counts) if count
             for d in task.spec.demonstrations(count, seed=seed, options=task.options)]
    random.Random(seed).shuffle(demos)
    return demos


def chat_to_sample(tokenizer, layout: ImageLayout | None, messages: list[dict]
                   ) -> tuple[list[int], list[int], list[bytes]]:
    """`chat_to_tokens` of a conversation whose user messages may show images (content parts):
    (ids with each image's placeholder run, loss mask (0 on the runs), the image files in order).
    DemonstrationError for an image given to a text-only policy."""
    rendered, urls = content_parts_for_template(messages)
    ids, mask = chat_to_tokens(tokenizer, rendered)
    if not urls:
        return ids, mask, []
    if layout is None:
        raise DemonstrationError(f"a demonstration shows {len(urls)} image(s), but the policy reads text only; "
                                 "fix: a vision-language policy, or text demonstrations")
    images = [image_bytes(url) for url in urls]
    marker = tokenizer.hf.token_to_id(layout.marker)
    runs = iter(layout.image_token_run(load_image(image)) for image in images)
    out_ids: list[int] = []
    out_mask: list[int] = []
    for token, weight in zip(ids, mask):
        run = next(runs) if token == marker else [token]
        out_ids += run
        out_mask += [weight] * len(run) if token != marker else [0] * len(run)
    return out_ids, out_mask, images


def chat_to_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a mask that is 1 on assistant turns' tokens
    (their content and the template's end-of-turn), for supervised training; a token that
    touches one of an assistant message's `no_loss_spans` gets 0."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            segment = prompt[len(rendered):]
            ids += tokenizer.encode(segment, add_bos=not rendered and None)
            mask += [0] * (len(ids) - len(mask))
            through = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
            answer = through[len(prompt):]
            answer_ids = tokenizer.encode(answer, add_bos=False)
            ids += answer_ids
            mask += answer_mask(tokenizer, answer, message) if message.get("no_loss_spans") \
                else [1] * len(answer_ids)
            rendered = through
    tail = tokenizer.apply_chat_template(messages, add_generation_prompt=False)[len(rendered):]
    if tail:
        tail_ids = tokenizer.encode(tail, add_bos=False)
        ids += tail_ids
        mask += [0] * len(tail_ids)
    mask[0] = 0
    return ids, mask


def answer_mask(tokenizer, answer: str, message: dict) -> list[int]:
    """The loss mask of one rendered assistant turn with `no_loss_spans` (`answer`: its content
    as the template writes it, then the end-of-turn): 1 on each token, 0 on those that overlap a
    character range [start, end) of `message["no_loss_spans"]` (ranges of `message["content"]`)."""
    at = answer.find(message["content"])
    if at < 0:
        raise DemonstrationError(
            "an assistant message with no_loss_spans must appear verbatim in the rendered "
            f"conversation, but this chat template rewrites it: {message['content'][:60]!r}; "
            "fix: leave out no_loss_spans with this model's template")
    spans = message["no_loss_spans"]
    return [0 if any(start < at + end and at + begin < stop for begin, end in spans) else 1
            for start, stop in tokenizer.token_spans(answer)]
