"""The in-process judge handle (actors/scorer/local.py): chat replies as a judge scorer gives
them, concurrent calls batched into shared engine steps, a cancelled call leaving nothing behind."""
from __future__ import annotations

import trio

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.requests import chat_prompt
from postrain.actors.models.loading import load_model
from postrain.actors.records import SamplingParams
from postrain.actors.scorer.local import LocalChatScorer
from postrain.core.testing import async_test


@async_test
async def test_concurrent_chats_share_steps_and_reply_as_the_engine_alone_does():
    model, tokenizer = load_model("tiny", seed=0)
    handle = LocalChatScorer(Engine(model, tokenizer, kv_cache_mb=16))
    conversations = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(6)]
    replies: dict[int, object] = {}

    async def ask(i: int) -> None:
        replies[i] = await handle.chat(conversations[i], temperature=0.0, max_new_tokens=4)

    async with trio.open_nursery() as nursery:
        for i in range(len(conversations)):
            nursery.start_soon(ask, i)
    assert handle.engine.counters.num_steps <= 5          # one prefill and 3 decodes for all six together
    alone = Engine(model, tokenizer, kv_cache_mb=16).generate(
        [chat_prompt(tokenizer, c) for c in conversations], SamplingParams(temperature=0.0, max_new_tokens=4))
    for i, out in enumerate(alone):
        reply = replies[i]
        assert (reply.text, reply.completion_tokens, reply.finish_reason) == (out.outputs[0].text, 4, "length")
        assert reply.prompt_tokens == len(out.prompt_token_ids)

    with trio.move_on_after(0):                             # cancelled before it is answered
        await handle.chat(conversations[0], max_new_tokens=50)
    reply = await handle.chat(conversations[1], temperature=0.0, max_new_tokens=4)
    assert reply.text == replies[1].text and not handle.engine.has_unfinished()


@async_test
async def test_score_continuations_gives_each_continuation_the_logprob_of_a_plain_forward():
    import torch

    model, tokenizer = load_model("tiny", seed=0)
    handle = LocalChatScorer(Engine(model, tokenizer, kv_cache_mb=16))
    messages = [{"role": "system", "content": "Grade it."}, {"role": "user", "content": "2 + 2 = 4"}]
    continuations = ["PASS", "FAIL", "10"]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True) + "VERDICT: "
    for end_of_turn in (False, True):
        reply = await handle.score_continuations(messages, continuations, prefix="VERDICT: ", end_of_turn=end_of_turn)
        sequences = [tokenizer.encode(prompt + c) + ([tokenizer.eos_token_id] if end_of_turn else [])
                     for c in continuations]
        start = reply.prompt_tokens
        assert 1 <= start <= len(tokenizer.encode(prompt))
        assert all(ids[:start] == sequences[0][:start] for ids in sequences)    # one shared context
        assert len({ids[start] for ids in sequences}) > 1                        # ... up to where they differ
        for ids, logprob, n in zip(sequences, reply.logprobs, reply.num_tokens):
            with torch.no_grad():
                rows = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
            want = sum(float(rows[t - 1, ids[t]]) for t in range(start, len(ids)))
            assert n == len(ids) - start and abs(logprob - want) < 1e-4
    assert not handle.engine.has_unfinished()
    assert handle.engine.stats()["prefix_hit_rate"] > 0          # the continuations share the prompt's blocks
