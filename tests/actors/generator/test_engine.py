"""The generator engine: continuous batching, paged KV sharing, prefix caching, sampling, weight swaps.

A real tiny model (built-in "tiny" config, random weights large enough to make
greedy decoding vary) and the real KV allocator from postrain.ext.
"""
from __future__ import annotations

import pytest
import torch

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.runner import shape_buckets
from postrain.actors.models.llama import build_model
from postrain.actors.models.blocks import Float16Weights
from postrain.actors.generator.sampling import SamplingParams, SamplingParamsError
from postrain.actors.models.tokenizer import byte_tokenizer

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny").init_weights(seed=1, std=0.1).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def reference_greedy(model, prompt_ids, num_tokens):
    """Step-by-step full-sequence forward, no cache: the definition of greedy decoding."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_continuous_batching_greedy_equals_full_forward(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=128, block_size_tokens=4)
    prompts = ["hello there", "ab", "def add(x, y):\n    return", "2+3=", "z" * 23]
    lengths = [12, 7, 15, 3, 9]
    ids = {}
    results = {}
    # Requests join while others are mid-decode: two now, one per step after.
    for i in range(2):
        ids[engine.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i], **GREEDY))] = i
    pending = list(range(2, len(prompts)))
    while engine.has_unfinished() or pending:
        if pending:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i], **GREEDY))] = i
        for out in engine.step():
            results[ids[out.request_id]] = out
    for i, prompt in enumerate(prompts):
        out = results[i]
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == reference_greedy(model, tokenizer.encode(prompt), lengths[i])
    assert engine.pool.num_free_blocks == engine.pool.num_blocks     # everything freed


def test_preemption_under_block_pressure_keeps_outputs_exact(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=14, block_size_tokens=4)
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=14, **GREEDY))
    assert engine.counters.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(model, prompt, 14)


def test_n_samples_share_prompt_blocks_and_copy_on_write(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4, enable_prefix_caching=False)
    prompt = list(range(40, 50))                     # 10 tokens: 2 full blocks + a partial one
    engine.add_request(prompt, SamplingParams(n=5, temperature=1.0, seed=7, max_new_tokens=6,
                                              ignore_eos=True))
    engine.step()                                    # the prefill, then the fork
    seqs = [s.seq_id for s in engine.scheduler.running]
    tables = [engine.pool.block_table(s) for s in seqs]
    assert len(seqs) == 5 and all(t == tables[0] for t in tables)
    assert engine.pool.stats()["num_used_blocks"] == 3          # the prompt's KV, stored once
    assert all(engine.pool.ref_count(b) == 5 for b in tables[0])
    engine.step()                                    # first decode: appends into the shared partial block
    assert engine.pool.stats()["num_cow_copies"] == 4
    assert engine.pool.stats()["num_used_blocks"] == 3 + 4
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == 64


def test_seeded_samples_are_reproducible_and_logprobs_match_learner(model, tokenizer):
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, seed=123, max_new_tokens=10, ignore_eos=True)
    prompt = tokenizer.encode("print(")
    first = Engine(model, tokenizer, num_blocks=64).generate([prompt], params)[0]
    # Same seed, different batch company: the same samples.
    other = Engine(model, tokenizer, num_blocks=64)
    other.add_request("something else entirely", SamplingParams(max_new_tokens=5, **GREEDY))
    second = other.generate([prompt], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3       # samples differ
    # logprob == log_softmax(full-forward logits / T)[token], the learner's definition.
    with torch.no_grad():
        for sample in first.outputs:
            ids = torch.tensor([prompt + sample.token_ids])
            logp = torch.log_softmax(model(ids)[0, len(prompt) - 1:-1] / 0.7, dim=-1)
            expected = logp.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_top_k_one_is_greedy(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64)
    out = engine.generate([[5, 6, 7]], SamplingParams(top_k=1, seed=3, max_new_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference_greedy(model, [5, 6, 7], 8)


def test_prefix_cache_reuses_prompt_kv(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4)
    prompt = list(range(60, 78))                     # 18 tokens: 4 full blocks + 2
    first = engine.generate([prompt], SamplingParams(max_new_tokens=5, **GREEDY))[0]
    second = engine.generate([prompt], SamplingParams(max_new_tokens=5, **GREEDY))[0]
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == reference_greedy(model, prompt, 5)
    # Same step: the second request hits blocks the first one's prefill writes in the same
    # forward (each layer writes every row's keys before any row gathers).
    fresh = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4)
    both = fresh.generate([prompt, prompt + [90]], SamplingParams(max_new_tokens=5, **GREEDY))
    assert both[1].num_cached_prompt_tokens == 16
    assert both[1].outputs[0].token_ids == reference_greedy(model, prompt + [90], 5)


def test_weight_swap_mid_generation_tags_later_tokens(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64)
    request_id = engine.add_request([1, 2, 3], SamplingParams(n=2, temperature=1.0, seed=0,
                                                              max_new_tokens=10, ignore_eos=True))
    for _ in range(4):
        engine.step()
    new_weights = build_model("tiny").init_weights(seed=2, std=0.1).state_dict()
    engine.load_weights(new_weights, version=1)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [out.request_id for out in done] == [request_id]
    for sample in done[0].outputs:                   # in-flight samples were not dropped
        assert sample.policy_versions == [0] * 4 + [1] * 6
        assert len(sample.token_ids) == 10
    assert torch.equal(engine.model.lm_head.weight, new_weights["lm_head.weight"])
    with pytest.raises(EngineError, match="must not go back"):
        engine.load_weights(new_weights, version=0)


def test_blocks_a_sample_fills_after_a_weight_swap_never_serve_a_later_prompt(tokenizer):
    """A sample in flight at a swap goes on over KV the old weights wrote. The blocks it fills after
    the swap must not enter the prefix cache: a later prompt that repeats its text (an agent's next
    turn) would otherwise read old-weight KV while its tokens carry the new version."""
    engine = Engine(build_model("tiny").init_weights(seed=1, std=0.1).eval(), tokenizer, num_blocks=64,
                    block_size_tokens=4)
    new_model = build_model("tiny").init_weights(seed=2, std=0.1).eval()
    prompt = list(range(60, 68))                             # 2 full blocks
    engine.add_request(prompt, SamplingParams(max_new_tokens=12, **GREEDY))
    engine.step()
    engine.step()                                            # 2 tokens sampled by the old weights
    engine.load_weights(new_model.state_dict(), version=1)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    next_turn = prompt + done[0].outputs[0].token_ids[:8] + [90, 91]   # blocks 3-4: the sample's, filled after the swap
    reference = reference_greedy(new_model, next_turn, 4)
    replies = [engine.generate([next_turn], SamplingParams(max_new_tokens=4, **GREEDY))[0] for _ in range(2)]
    assert replies[1].num_cached_prompt_tokens == 16, "the second reads the first's blocks"
    assert [reply.outputs[0].token_ids for reply in replies] == [reference, reference]
    assert max(abs(a - b) for a, b in zip(replies[0].outputs[0].logprobs, replies[1].outputs[0].logprobs)) < 1e-5


def test_a_prompt_that_hits_blocks_filled_in_the_same_step_reads_them_after_they_are_written(model, tokenizer):
    """Two prompts admitted in one step, the second the first's text plus two tokens: it hits the
    prefix cache on the first's 200 tokens, whose KV the first's prefill writes in this step. Its 2
    new tokens and the first's 200 fall in different shape buckets (separate forwards); the
    second's must run after the first's, or it attends to whatever the blocks held before."""
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=8)
    engine.generate([[(7 * i) % 250 + 8 for i in range(200)]], SamplingParams(max_new_tokens=4, **GREEDY))
    engine.kv.reset_prefix_cache()                            # the blocks now hold another prompt's KV
    first = list(range(20, 220))
    second = first + [5, 6]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
           for p in (first, second)]
    assert len(shape_buckets([len(first), 2])) == 2
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step()})
    assert done[ids[1]].num_cached_prompt_tokens == 200
    for prompt, request_id in zip((first, second), ids):
        sample = done[request_id].outputs[0]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + sample.token_ids]))[0].double(), dim=-1)
        gaps = [abs(float(logp[len(prompt) + i - 1, token]) - recorded)
                for i, (token, recorded) in enumerate(zip(sample.token_ids, sample.logprobs))]
        assert max(gaps) < 1e-4, f"largest gap {max(gaps):.2e}"


def test_stop_strings_and_stop_ids(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64)
    free = engine.generate(["abc"], SamplingParams(max_new_tokens=12, **GREEDY))[0].outputs[0]
    text = tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop_token = free.token_ids[4]
    by_id = engine.generate(["abc"], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_token],
                                                    **GREEDY))[0].outputs[0]
    first = free.token_ids.index(stop_token)
    assert by_id.token_ids == free.token_ids[:first + 1] and by_id.finish_reason == "stop"
    stop_str = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop_str) == 2
    by_str = engine.generate(["abc"], SamplingParams(max_new_tokens=12, stop=[stop_str],
                                                     **GREEDY))[0].outputs[0]
    assert by_str.finish_reason == "stop"
    assert by_str.text == text[:text.find(stop_str)]
    assert stop_str not in by_str.text


def test_bad_requests_name_the_problem(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=8, block_size_tokens=4)
    limit = model.config.max_position_embeddings
    with pytest.raises(EngineError, match=f"context is {limit}"):
        engine.add_request([1] * limit)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request([100000])
    with pytest.raises(SamplingParamsError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    engine.add_request(list(range(100)), SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineError, match="needs 25 KV blocks"):
        engine.step()


def test_generate_command_prints_json(capsys):
    from postrain.cli import main

    argv = ["generate", "--model", "tiny", "--prompt", "2+3=", "--max-tokens", "5", "--n", "2",
            "--temperature", "0.8", "--seed", "1", "--json"]
    assert main(argv) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_token_ids"] == byte_tokenizer().encode("2+3=")
    assert len(report["samples"]) == 2
    for sample in report["samples"]:
        assert 1 <= len(sample["token_ids"]) == len(sample["logprobs"]) <= 5
        assert all(lp <= 0 for lp in sample["logprobs"])
    assert main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 2
    assert "no model at" in capsys.readouterr().err


def test_bfloat16_engine_runs_with_bf16_kv(tokenizer):
    model16 = build_model("tiny").init_weights(seed=1, std=0.1).to(torch.bfloat16).eval()
    engine = Engine(model16, tokenizer, num_blocks=32)
    assert engine.kv_caches[0][0].dtype == torch.bfloat16
    out = engine.generate(["abc"], SamplingParams(n=2, max_new_tokens=6, seed=0, ignore_eos=True))[0]
    for sample in out.outputs:
        assert len(sample.token_ids) == 6
        assert all(lp <= 0 and lp == lp for lp in sample.logprobs)


def test_abort_frees_blocks_and_marks_samples(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=32, block_size_tokens=4)
    request_id = engine.add_request([1, 2, 3, 4, 5], SamplingParams(n=3, max_new_tokens=20, seed=0))
    engine.add_request([9, 9, 9], SamplingParams(max_new_tokens=20, seed=0))
    engine.step()
    engine.step()
    out = engine.abort(request_id)
    assert out.finished and all(o.finish_reason == "abort" for o in out.outputs)
    assert engine.abort(request_id) is None
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == 32


def test_float16_weights_follow_weight_swaps(tokenizer):
    model = build_model("tiny").init_weights(seed=1, std=0.1).eval()   # its own: weights get swapped
    engine = Engine(model, tokenizer, num_blocks=64, weight_precision="float16")
    engine.add_request([5, 6, 7], SamplingParams(n=2, seed=3, max_new_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    first_copies = engine._projection
    engine.load_weights(build_model("tiny").init_weights(seed=2, std=0.1).state_dict(), version=1)
    prompt = [9, 8, 7, 6]
    request_id = engine.add_request(prompt, SamplingParams(seed=4, max_new_tokens=8, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    copies = engine._projection
    assert isinstance(copies, Float16Weights) and copies is not first_copies and not copies.is_stale()
    sample = done[request_id].outputs[0]                # all of its KV comes from the new weights
    assert sample.policy_versions == [1] * 8
    with torch.no_grad():                               # `model` now holds the new float32 weights
        logp = torch.log_softmax(model(torch.tensor([prompt + sample.token_ids]))[0, 3:-1], -1)
    expected = logp.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-2, rtol=0)
    with pytest.raises(EngineError, match="weight_precision must be"):
        Engine(model, tokenizer, num_blocks=8, weight_precision="int8")


def test_float16_weights_logprobs_match_the_float32_model_closely(model, tokenizer):
    engine = Engine(model, tokenizer, num_blocks=64, weight_precision="float16")
    prompt = tokenizer.encode("print(")
    out = engine.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_new_tokens=10,
                                                   ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1:-1], -1)
    expected = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    gap = (torch.tensor(out.logprobs) - expected).abs()
    assert 0 < float(gap.max()) < 1e-2       # rounded weights: close, and not the float32 numbers


def test_rows_of_very_different_widths_run_as_separate_forwards(model, tokenizer):
    """A mixture's long prompt beside short ones: the short rows are not padded to the long one
    (a forward per width class, prefill and decode) and every output is still exact."""
    engine = Engine(model, tokenizer, num_blocks=256, block_size_tokens=4)
    prompts = ["2+3=", "ab", "hello", "q" * 400, "def f(x):"]
    batch_sizes: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args: batch_sizes.append(args[0].shape[0]))
    try:
        ids = {engine.add_request(p, SamplingParams(max_new_tokens=6, **GREEDY)): p for p in prompts}
        results = {}
        while engine.has_unfinished():
            for out in engine.step():
                results[ids[out.request_id]] = out.outputs[0].token_ids
    finally:
        hook.remove()
    assert sorted(set(batch_sizes)) == [1, 4]        # never the five rows in one forward
    for p in prompts:
        assert results[p] == reference_greedy(model, tokenizer.encode(p), 6)


def test_shape_buckets_split_only_past_a_factor_of_two():
    assert shape_buckets([60, 70, 100, 119]) == [[0, 1, 2, 3]]
    assert shape_buckets([650, 60, 70, 600]) == [[1, 2], [3, 0]]
    assert shape_buckets([3, 40, 64, 128]) == [[0, 1, 2, 3]]         # under the floor: one forward
    assert shape_buckets([10, 129]) == [[0], [1]]
