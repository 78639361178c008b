"""Scoring requests (actors/generator/scoring.py): the engine's teacher rows equal a plain full
forward of the same model (torch log_softmax, no cache), however the engine reads them: several
sequences in one batch, a group sharing its prompt through the prefix cache, a cache that holds
positions past `score_from`, chunked prefill, beside sampled requests; and, for each registry
architecture (random tiny Hugging Face folders), transformers' own logits.

The rows' convention (postrain.actors.records.scorer): row t is the distribution of token t
given the tokens before it; rows before score_from are zeros.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.scoring import TAIL_LOGMASS_FLOOR, score_logits
from postrain.actors.models.llama import ModelConfig, build_model
from postrain.actors.records import TAIL_LOGMASS_FLOOR as RECORDS_FLOOR

CONFIG = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=256)
K = 8
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(19)]          # 4 full blocks of 4 and 3 tokens
COMPLETIONS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [(11 * i) % 200 + 2 for i in range(13)]]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG).init_weights(seed=1, std=0.1).eval()


def full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward of the whole sequence (T, V), float32, no cache."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def assert_rows_equal(scores, logprobs: torch.Tensor, ids: list[int], score_from: int, k: int = K,
                      atol: float = 1e-5) -> None:
    """scores' rows against logprobs (T, V) of the same sequence (row t from position t - 1).
    Ids are checked by the reference's logprob of each (so near-ties may swap), values exactly."""
    T = len(ids)
    assert scores.topk_ids.shape == (T, k) and scores.topk_ids.dtype == np.int32
    assert scores.topk_logprobs.shape == (T, k) and scores.topk_logprobs.dtype == np.float32
    assert scores.tail_logmass.shape == (T,) and scores.token_logprobs.shape == (T,)
    for name in ("topk_ids", "topk_logprobs", "tail_logmass", "token_logprobs"):
        assert not np.any(getattr(scores, name)[:score_from]), f"{name}: rows before score_from are not zero"
    if score_from == T:
        return
    want = logprobs[score_from - 1:T - 1].double()                              # (n, V)
    top = want.topk(k, dim=-1).values
    got_ids = torch.from_numpy(scores.topk_ids[score_from:]).long()
    got_top = torch.from_numpy(scores.topk_logprobs[score_from:]).double()
    torch.testing.assert_close(got_top, top, rtol=0, atol=atol)
    torch.testing.assert_close(want.gather(1, got_ids), got_top, rtol=0, atol=atol)   # each id's own logprob
    assert all(len(set(row.tolist())) == k for row in got_ids), "an id twice in a row's top k"
    targets = torch.tensor(ids[score_from:])
    torch.testing.assert_close(torch.from_numpy(scores.token_logprobs[score_from:]).double(),
                               want.gather(1, targets[:, None])[:, 0], rtol=0, atol=atol)
    tail = torch.log1p(-top.exp().sum(-1)).clamp(min=TAIL_LOGMASS_FLOOR)
    torch.testing.assert_close(torch.from_numpy(scores.tail_logmass[score_from:]).double(), tail,
                               rtol=0, atol=max(atol, 1e-5))


def run(engine: Engine, sequences, score_from, k: int = K, stagger: bool = False) -> list:
    """Score through add_score_request + step (one request joining per step with stagger);
    the finished RequestOutputs in order."""
    ids, done, pending = [], {}, list(range(len(sequences)))
    while pending or engine.has_unfinished():
        while pending:
            i = pending.pop(0)
            ids.append(engine.add_score_request(sequences[i], score_from[i], k))
            if stagger:
                break
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


def test_score_logits_is_log_softmax_top_k_tail_and_token():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 0.0, 50.0]])
    ids, top, tail, token = score_logits(logits, torch.tensor([3, 0]), 2)
    lp = torch.log_softmax(logits, -1)
    assert ids[0].tolist() == [0, 2] and int(ids[1, 0]) == 3
    torch.testing.assert_close(top, lp.topk(2).values)
    torch.testing.assert_close(token, torch.stack([lp[0, 3], lp[1, 0]]))
    torch.testing.assert_close(tail[0], torch.log(lp[0, [1, 3]].exp().sum()))
    # the second row's top 2 hold all the mass in float32: the tail is floored, never -inf
    assert float(tail[1]) >= TAIL_LOGMASS_FLOOR and TAIL_LOGMASS_FLOOR == RECORDS_FLOOR == math.log(1e-20)


def test_a_batch_of_sequences_sharing_a_prompt_equals_a_full_forward(model):
    engine = Engine(model, num_blocks=64, block_size_tokens=4)
    sequences = [PROMPT + c for c in COMPLETIONS] + [[9, 8, 7, 6, 5]]
    score_from = [len(PROMPT)] * 3 + [1]
    outs = run(engine, sequences, score_from)
    for out, ids, start in zip(outs, sequences, score_from):
        assert out.finished and out.outputs == [] and out.prompt_token_ids == ids
        assert_rows_equal(out.scores, full_forward_logprobs(model, ids), ids, start)
    # the first sample of the group wrote the prompt; the others found its 4 full blocks (18 tokens
    # before the first scored row's position: 4 blocks of 4)
    assert [o.num_cached_prompt_tokens for o in outs] == [0, 16, 16, 0]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.has_unfinished()
    engine.pool.check_invariants()
    # Engine.score: the same rows (another batch: equal up to float rounding)
    again = engine.score(sequences[:2], score_from[:2], K)
    for scores, out in zip(again, outs):
        np.testing.assert_allclose(scores.topk_logprobs, out.scores.topk_logprobs, rtol=0, atol=1e-5)


def test_a_prefix_cache_holding_scored_positions_does_not_skip_them(model):
    engine = Engine(model, num_blocks=64, block_size_tokens=4)
    ids = PROMPT + COMPLETIONS[2]                                   # 32 tokens: 8 full blocks
    engine.generate([ids], SamplingParams(max_new_tokens=2, **GREEDY))   # every block of ids is cached
    assert engine.kv.match_prefix(ids) == 28
    for start in (3, 9, len(PROMPT), len(ids) - 1, len(ids)):
        (out,) = run(engine, [ids], [start])
        # at most score_from - 1 tokens came from the cache: the position predicting row
        # score_from is computed, whatever the cache holds
        assert out.num_cached_prompt_tokens == min(4 * ((start - 1) // 4), 28)
        assert_rows_equal(out.scores, full_forward_logprobs(model, ids), ids, start)


@pytest.mark.parametrize("chunk", [3, 8, 1000])
def test_chunked_prefill_scores_equal_a_full_forward_beside_sampled_requests(model, chunk):
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    reference = Engine(model, num_blocks=128, block_size_tokens=4).generate([PROMPT, [5, 6, 7]], params)
    engine = Engine(model, num_blocks=128, block_size_tokens=4, prefill_chunk_tokens=chunk)
    sequences = [PROMPT + c for c in COMPLETIONS]
    score_from = [len(PROMPT), len(PROMPT) - 5, 2]
    work = [PROMPT, 0, 1, 2, [5, 6, 7]]           # a list: a prompt to sample; an int: a sequence to score
    ids, done = [], {}
    while work or engine.has_unfinished():
        if work:                                  # one request joins a step: earlier ones are read or decode
            item = work.pop(0)
            ids.append(engine.add_request(item, params) if isinstance(item, list)
                       else engine.add_score_request(sequences[item], score_from[item], K))
        for out in engine.step():
            done[out.request_id] = out
    for i, (ids_i, start) in enumerate(zip(sequences, score_from)):
        assert_rows_equal(done[ids[1 + i]].scores, full_forward_logprobs(model, ids_i), ids_i, start)
    # the sampled requests' tokens are those of an engine that scores nothing
    assert [done[ids[0]].outputs[0].token_ids, done[ids[4]].outputs[0].token_ids] == \
        [r.outputs[0].token_ids for r in reference]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_invariants()


def test_scoring_under_block_pressure_preempts_and_keeps_rows_exact(model):
    engine = Engine(model, num_blocks=12, block_size_tokens=4, prefill_chunk_tokens=6)
    sequences = [[10 + i] + PROMPT[1:] + COMPLETIONS[0] for i in range(3)]      # 7 blocks each, 12 held
    outs = run(engine, sequences, [len(PROMPT)] * 3)
    for out, ids in zip(outs, sequences):
        assert_rows_equal(out.scores, full_forward_logprobs(model, ids), ids, len(PROMPT))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_scoring_step_projects_only_the_kept_positions(model):
    """One long scoring row beside short prompts: the step's logits are the scored positions and
    one last token per row, never the (rows x widest row) the padding would give."""
    engine = Engine(model, num_blocks=64, block_size_tokens=4)
    long_ids = PROMPT + COMPLETIONS[2]                                        # 32 tokens
    engine.add_score_request(long_ids, 20, K)
    for i in range(3):
        engine.add_request([5 + i, 6, 7], SamplingParams(max_new_tokens=1, **GREEDY))
    plan = engine.scheduler.schedule()
    with torch.inference_mode():
        logits = engine.runner.run(plan)
    assert logits.prefills.shape == (4, CONFIG.vocab_size)
    ((row, first, scored),) = logits.scored
    assert (row, first, scored.shape[0]) == (0, 19, len(long_ids) - 19)       # positions 19 .. 31
    torch.testing.assert_close(logits.prefills[0], scored[-1])


def test_bad_scoring_requests_are_refused_by_name(model):
    engine = Engine(model, num_blocks=16, block_size_tokens=4)
    with pytest.raises(EngineError, match=r"score_from must be in \[1, 3\].*got 0"):
        engine.add_score_request([1, 2, 3], 0, K)
    with pytest.raises(EngineError, match=r"score_from must be in \[1, 3\].*got 4"):
        engine.add_score_request([1, 2, 3], 4, K)
    with pytest.raises(EngineError, match=r"top_k must be in \[1, 264\]"):
        engine.add_score_request([1, 2, 3], 1, 265)
    with pytest.raises(EngineError, match="at least 2 tokens"):
        engine.add_score_request([1], 1, K)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_score_request([1, 999], 1, K)
    with pytest.raises(EngineError, match=r"model's context is 256.*score at most 256"):
        engine.add_score_request([1] * 257, 1, K)
    assert not engine.has_unfinished()


def test_an_aborted_scoring_request_frees_its_blocks(model):
    engine = Engine(model, num_blocks=32, block_size_tokens=4, prefill_chunk_tokens=4)
    request_id = engine.add_score_request(PROMPT + COMPLETIONS[2], 2, K)
    engine.step()                                          # its first chunk: it holds blocks now
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    out = engine.abort(request_id)
    assert out is not None and out.scores is None and not engine.has_unfinished()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# ----------------------------------------------------------------------------- each architecture

def _llama_like(arch: str):
    """Llama and Qwen2 (both served by postrain's llama module) over the test shape."""
    import transformers

    from postrain.bench.architectures import BYTE_IDS, TEST_SHAPE

    config = (transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config)(
        **TEST_SHAPE, **BYTE_IDS, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3_text"])
def test_teacher_rows_equal_transformers_for_each_registry_architecture(arch, tmp_path):
    import transformers

    from postrain.actors.models import ARCHITECTURES
    from postrain.actors.models.loading import load_model
    from postrain.bench.architectures import HF_CONFIGS, build_hf_folder

    assert arch in ARCHITECTURES
    if arch in HF_CONFIGS:
        folder = build_hf_folder(arch, tmp_path / arch)           # sliding window 8 where it has one
    else:
        torch.manual_seed(0)
        hf_model = _llama_like(arch)
        with torch.no_grad():
            for name, param in hf_model.named_parameters():
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
        hf_model.save_pretrained(tmp_path / arch)
        folder = tmp_path / arch
    model, tokenizer = load_model(folder)
    ids = [1] + [(13 * i + 5) % 250 + 3 for i in range(22)]      # past the window, 6 blocks of 4
    score_from = 9
    engine = Engine(model, tokenizer, num_blocks=32, block_size_tokens=4)
    (scores,) = engine.score([ids], [score_from], K)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert_rows_equal(scores, logprobs, ids, score_from, atol=1e-4)
