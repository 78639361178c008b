"""Chunked prefill: a long prompt is read over several steps while running sequences decode.

A real small model (random weights, 2 layers: cheap steps, since chunk size 1 takes a step a
prompt token) and the real KV allocator; the reference is the same engine reading every
prompt in one step.
"""
from __future__ import annotations

import pytest

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.llama import ModelConfig, build_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
CONFIG = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=256)
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(41)], [5, 6, 7], list(range(100, 119)),
           [(11 * i) % 200 + 2 for i in range(25)]]
LENGTHS = [6, 9, 5, 7]


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG).init_weights(seed=1, std=0.1).eval()


def run_staggered(engine: Engine, prompts, lengths, params=None) -> list[list[int]]:
    """Requests join one per step (some decode while later ones are read); tokens in prompt order."""
    ids, done, pending = {}, {}, list(range(len(prompts)))
    while engine.has_unfinished() or pending:
        if pending:
            i = pending.pop(0)
            sampling = params or SamplingParams(max_new_tokens=lengths[i], **GREEDY)
            ids[engine.add_request(prompts[i], sampling)] = i
        for out in engine.step():
            done[ids[out.request_id]] = out
    return [[o.token_ids for o in done[i].outputs] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def one_step_reference(model):
    return run_staggered(Engine(model, num_blocks=128, block_size_tokens=4), PROMPTS, LENGTHS)


@pytest.mark.parametrize("chunk", [1, 4, 13, 1000])
def test_greedy_tokens_equal_one_step_prefill_at_every_chunk_size(model, one_step_reference, chunk):
    engine = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=chunk)
    assert run_staggered(engine, PROMPTS, LENGTHS) == one_step_reference
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_invariants()


def test_decoding_sequences_advance_every_step_while_a_long_prompt_is_read(model):
    engine = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=8)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=30, **GREEDY))
    engine.step()                                            # the short prompt, read and sampled once
    short = engine.scheduler.running[0]
    long_id = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2, **GREEDY))
    chunks = []
    while not any(s.output.token_ids for s in engine.sequences_of(long_id)):
        before = len(short.output.token_ids)
        engine.step()
        assert len(short.output.token_ids) == before + 1     # the decode kept its pace
        chunks.append(len(engine.scheduler.prefilling))
    assert len(chunks) == -(-len(PROMPTS[0]) // 8)           # 41 tokens in 8-token chunks: 6 steps
    assert chunks[:-1] == [1] * (len(chunks) - 1) and chunks[-1] == 0
    assert engine.scheduler.prefilling == [] and len(engine.scheduler.running) == 2


def test_each_plan_reads_at_most_the_chunk_budget(model):
    engine = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=10,
                    max_num_batched_tokens=12)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_new_tokens=4, **GREEDY))
    scheduler, seen = engine.scheduler, []
    plan_of = scheduler.schedule

    def recording_schedule():
        plan = plan_of()
        seen.append(plan)
        return plan

    scheduler.schedule = recording_schedule
    while engine.has_unfinished():
        engine.step()
    for plan in seen:
        prefill_tokens = sum(p.num_new_tokens for p in plan.prefills)
        assert prefill_tokens <= 10
        assert prefill_tokens + sum(d.num_new_tokens for d in plan.decodes) <= 12 or not plan.prefills
    assert sum(sum(p.num_new_tokens for p in plan.prefills) for plan in seen) == sum(map(len, PROMPTS))


def test_preemption_mid_prompt_keeps_outputs_exact(model, one_step_reference):
    engine = Engine(model, num_blocks=26, block_size_tokens=4, prefill_chunk_tokens=5)
    prompts = [p[:30] for p in PROMPTS] + [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(3)]
    lengths = [14] * len(prompts)
    reference = run_staggered(Engine(model, num_blocks=128, block_size_tokens=4), prompts, lengths)
    assert run_staggered(engine, prompts, lengths) == reference
    assert engine.counters.num_preemptions > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_invariants()


def test_a_prompt_that_does_not_fit_beside_one_finishing_its_read_waits(model):
    """The first prompt's last chunk is read in the step that would admit the second: the first
    holds its blocks (no longer `prefilling`, not yet running), so the second waits its turn."""
    engine = Engine(model, num_blocks=12, block_size_tokens=4, prefill_chunk_tokens=6)
    prompts = [[10 + i] + PROMPTS[0][:25] for i in range(3)]                 # 7 blocks each, 12 held
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=2, **GREEDY))
    reference = Engine(model, num_blocks=128, block_size_tokens=4).generate(
        prompts, SamplingParams(max_new_tokens=2, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_prompt_being_read_is_preempted_before_a_decoding_sequence(model):
    """10 blocks of 4: the decoding sequence (3 + 24 tokens) and the 30-token prompt cannot both
    fit, so the prompt, part-read, gives its blocks back and is read again later."""
    engine = Engine(model, num_blocks=10, block_size_tokens=4, prefill_chunk_tokens=5)
    decoding = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=24, **GREEDY))
    engine.step()
    short = engine.sequences_of(decoding)[0]
    long_id = engine.add_request(PROMPTS[0][:30], SamplingParams(max_new_tokens=4, **GREEDY))
    preempted_while_reading, outputs = False, {}
    while engine.has_unfinished():
        was_reading = len(engine.scheduler.prefilling) == 1
        preemptions, before = engine.counters.num_preemptions, len(short.output.token_ids)
        outputs.update((o.request_id, o) for o in engine.step())
        preempted_while_reading |= was_reading and engine.counters.num_preemptions > preemptions
        assert short.finished or len(short.output.token_ids) == before + 1
    assert preempted_while_reading
    reference = Engine(model, num_blocks=64, block_size_tokens=4).generate(
        [[5, 6, 7], PROMPTS[0][:30]], [SamplingParams(max_new_tokens=24, **GREEDY),
                                      SamplingParams(max_new_tokens=4, **GREEDY)])
    assert [outputs[i].outputs[0].token_ids for i in (decoding, long_id)] == [r.outputs[0].token_ids for r in reference]
    assert engine.pool.num_free_blocks == 10


def test_prefix_sharing_and_forks_with_chunks(model):
    shared = PROMPTS[0][:32]
    prompts = [shared + [9, 8, 7], shared + [1, 2], shared + [9, 8, 7]]
    reference = run_staggered(Engine(model, num_blocks=128, block_size_tokens=4), prompts, [6, 6, 6])
    engine = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=6)
    # the second and third join while the first is still being read: they may reuse only the
    # blocks its chunks have already written
    assert run_staggered(engine, prompts, [6, 6, 6]) == reference
    assert engine.counters.num_cached_prompt_tokens > 0
    again = engine.generate([prompts[0]], SamplingParams(max_new_tokens=6, **GREEDY))[0]
    assert again.num_cached_prompt_tokens == 32 and again.outputs[0].token_ids == reference[0][0]
    # n samples: the prompt is read once, in chunks, then forked
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_new_tokens=5, ignore_eos=True)
    one_step = Engine(model, num_blocks=128, block_size_tokens=4).generate([PROMPTS[3]], params)[0]
    chunked = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=7
                     ).generate([PROMPTS[3]], params)[0]
    assert [o.token_ids for o in chunked.outputs] == [o.token_ids for o in one_step.outputs]


def test_abort_mid_prompt_frees_its_blocks(model):
    engine = Engine(model, num_blocks=64, block_size_tokens=4, prefill_chunk_tokens=8)
    request_id = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, **GREEDY))
    engine.step()
    assert len(engine.scheduler.prefilling) == 1 and engine.pool.num_free_blocks < 64
    out = engine.abort(request_id)
    assert out.outputs[0].finish_reason == "abort" and not engine.has_unfinished()
    assert engine.pool.num_free_blocks == 64 and len(engine.scheduler.prefilling) == 0


def test_negative_chunk_size_is_a_clear_error(model):
    with pytest.raises(EngineError, match="prefill_chunk_tokens must be >= 0"):
        Engine(model, num_blocks=8, prefill_chunk_tokens=-1)


def test_generator_option_is_checked():
    from pydantic import ValidationError

    from postrain.actors.generator.actor import GeneratorOptions

    assert GeneratorOptions(prefill_chunk_tokens=512).prefill_chunk_tokens == 512
    with pytest.raises(ValidationError, match="prefill_chunk_tokens"):
        GeneratorOptions(prefill_chunk_tokens=-1)
