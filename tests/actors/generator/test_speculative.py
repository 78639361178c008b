"""Speculative decoding in the engine: exact (greedy tokens, sampled distribution, logprobs),
rollback of rejected drafts' KV slots, the proposers, adaptive k and the options.

A real tiny model and the real allocator, checked after every mutation (CheckedKVBlockPool).
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from pydantic import ValidationError

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.actor import GeneratorActor
from postrain.actors.models.config import BUILTIN_CONFIGS
from postrain.actors.models.llama import LlamaModel, ModelConfig, build_model
from postrain.actors.generator.sampling import SamplingParams, verify_rows
from postrain.actors.generator.speculative import (
    DraftModelProposer, NgramProposer, RolloutProposer, SpeculativeOptions, next_num_draft_tokens,
)
from postrain.actors.tasks import arithmetic, code
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.core import ActorSpec, Supervisor
from postrain.core.errors import ConfigError
from postrain.core.options import validate_options
from postrain.core.testing import async_test
from postrain.bench.speculative import distribution_pvalue
from postrain.ext import CheckedKVBlockPool

GREEDY = dict(temperature=0.0, ignore_eos=True)
# min_ngram=1: the random tiny model rarely repeats itself, so single-token matches keep most
# sequences drafting (mixed draft lengths in every batch) and most drafts rejected.
NGRAM = SpeculativeOptions(method="ngram", num_draft_tokens=4, min_ngram=1)
ROLLOUTS = SpeculativeOptions(method="rollouts", num_draft_tokens=4, min_ngram=1)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


# The tiny shape these tests were written with (GQA, rotary base 10000): a random model of it
# repeats the prompts' n-grams often enough for the n-gram drafter to propose tokens.
DRAFTABLE = dataclasses.replace(BUILTIN_CONFIGS["tiny"], num_kv_heads=2, rope_theta=10000.0)


def tiny_model(seed=1):
    return build_model(DRAFTABLE).init_weights(seed=seed, std=0.1).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def checked_engine(model, tokenizer, *, num_blocks=256, enable_prefix_caching=True, **kwargs):
    engine = Engine(model, tokenizer, num_blocks=num_blocks, block_size_tokens=4,
                    enable_prefix_caching=enable_prefix_caching, **kwargs)
    engine.pool = CheckedKVBlockPool(num_blocks, 4, enable_prefix_caching)
    return engine


def task_prompts(tokenizer) -> list[str]:
    """Built-in tasks' first turns (arithmetic, code) and a copy-heavy revise turn."""
    arith = [tokenizer.apply_chat_template(arithmetic.prompt_messages(t["question"]))[-160:]
             for t in arithmetic.eval_tasks({"num_eval": 2})]
    task = code.eval_tasks()[0]
    revise = (code.prompt_text(task)[-120:] + "\n<python>\ndef f(x):\n    return x + 1\n</python>\n"
              "1 of 2 visible tests passed.\nFAIL test_1: assert f(2) == 4\n<python>\ndef f(x):\n")
    return arith + [revise, "hello there hello there hello", "abababababab"]


def random_prompts(num, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(num)]


def run(engine, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].policy_versions) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("options, caching", [
    pytest.param(NGRAM, True, id="ngram-prefix-cache"),
    pytest.param(NGRAM, False, id="ngram-no-cache", marks=pytest.mark.variants),        # pytest -m variants
    pytest.param(ROLLOUTS, True, id="rollouts-prefix-cache", marks=pytest.mark.variants)])
def test_greedy_is_token_identical_to_the_plain_engine(model, tokenizer, options, caching):
    prompts = task_prompts(tokenizer) + random_prompts(2)
    params = SamplingParams(max_new_tokens=20, **GREEDY)
    plain = run(checked_engine(model, tokenizer, enable_prefix_caching=caching), prompts, params)
    engine = checked_engine(model, tokenizer, enable_prefix_caching=caching, speculative=options)
    assert run(engine, prompts, params) == plain
    assert run(engine, prompts, params) == plain          # again: prefix hits, stored rollouts
    stats = engine.stats()
    assert stats["num_drafted_tokens"] > 0 and 0 < stats["acceptance_rate"] <= 1
    assert stats["tokens_per_verify_step"] > 1
    assert engine.pool.num_free_blocks == engine.pool.num_blocks    # no slot leaked


@pytest.mark.variants     # the draft model's distribution and preemption tests below run by default
def test_greedy_with_a_draft_model_is_token_identical_to_the_plain_engine(model, tokenizer):
    """A draft model with other weights (the built-in tiny: mostly rejected), then the policy
    drafting for itself (every greedy draft accepted)."""
    prompts = task_prompts(tokenizer)[3:] + random_prompts(1)
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    plain = run(checked_engine(model, tokenizer), prompts, params)
    options = SpeculativeOptions(method="draft_model", draft_model="tiny", num_draft_tokens=3)
    other = checked_engine(model, tokenizer, speculative=options)
    assert run(other, prompts, params) == plain
    assert other.counters.num_drafted_tokens > 0 and other.stats()["acceptance_rate"] < 0.5
    itself = checked_engine(model, tokenizer, speculative=options,
                            proposer=DraftModelProposer(Engine(model, num_blocks=64)))
    assert run(itself, prompts, params) == plain
    assert itself.stats()["acceptance_rate"] > 0.95 and itself.stats()["tokens_per_verify_step"] > 3
    assert itself.pool.num_free_blocks == itself.pool.num_blocks


def test_a_draft_model_with_another_vocabulary_is_refused(tokenizer):
    small_vocab = LlamaModel(ModelConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=1,
                                         num_heads=2, num_kv_heads=1, max_position_embeddings=64))
    options = SpeculativeOptions(method="draft_model", draft_model="tiny")
    with pytest.raises(EngineError, match="draft model 'tiny' has a vocabulary of 264 tokens, the policy 6"):
        Engine(small_vocab.init_weights(), None, num_blocks=8, speculative=options)


def test_greedy_identical_under_preemption_with_drafts(model, tokenizer):
    """Blocks run short: drafts are given up first, then sequences are preempted and recomputed.
    The second pass drafts from the first pass's rollouts, so most drafts are accepted."""
    prompts = random_prompts(5, seed=0)
    params = SamplingParams(max_new_tokens=20, **GREEDY)
    plain = run(checked_engine(model, tokenizer), prompts, params)
    engine = checked_engine(model, tokenizer, num_blocks=30, speculative=ROLLOUTS)
    assert run(engine, prompts, params) == plain
    assert run(engine, prompts, params) == plain
    assert engine.counters.num_preemptions > 0 and engine.counters.num_accepted_tokens > 20
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_weight_swap_mid_generation_matches_the_plain_engine(tokenizer):
    prompts = task_prompts(tokenizer)[3:]
    params = SamplingParams(max_new_tokens=20, **GREEDY)
    new_weights = tiny_model(seed=2).state_dict()
    results = []
    for options in (None, NGRAM):
        engine = checked_engine(tiny_model(), tokenizer, speculative=options)
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(3):
            engine.step()
        engine.load_weights(new_weights, version=1)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.outputs[0] for o in engine.step()})
        results.append([(done[i].token_ids, done[i].policy_versions) for i in ids])
    assert results[0] == results[1]
    assert all(len(set(versions)) == 2 for _, versions in results[1])   # both versions appear


def test_logprobs_are_the_targets_and_match_the_learner(tokenizer):
    """Sampled with drafts from the first pass's samples (a peaked model at a low temperature:
    many are accepted)."""
    from postrain.ext import token_logprobs
    model = build_model("tiny").init_weights(seed=1, std=0.3).eval()
    engine = checked_engine(model, tokenizer, speculative=ROLLOUTS)
    prompt = tokenizer.encode("hello there")
    params = SamplingParams(n=3, temperature=0.3, top_k=50, max_new_tokens=16, ignore_eos=True)
    samples = [s for _ in range(2) for s in engine.generate([prompt], params)[0].outputs]
    assert engine.counters.num_accepted_tokens > 0
    for sample in samples:
        ids = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            logits = model(ids)[0, len(prompt) - 1:-1]
        learner = token_logprobs(logits, torch.tensor(sample.token_ids), temperature=0.3)
        # The engine's decode attention (a compiled kernel) sums in another order than the
        # learner's SDPA: ~1e-7 a layer, which this peaked model at T = 0.3 makes up to 2e-4.
        assert torch.allclose(torch.tensor(sample.logprobs, dtype=torch.float64), learner.double(), atol=3e-4)
        assert sample.policy_versions == [0] * 16


@pytest.mark.parametrize("top_p, drafts", [(1.0, "unlikely"), (0.8, "unlikely"), (1.0, "draft_model")],
                         ids=["temperature-1", "top-p", "draft-model"])
def test_sampled_distribution_equals_the_targets(top_p, drafts):
    """Three tokens per sample over a 6-token vocabulary, the second and third from verify
    steps with unlikely drafts or another model's greedy ones: their joint distribution is
    the model's (chi-square)."""
    pvalue, acceptance = distribution_pvalue(top_p, num_seeds=2, samples_per_seed=600, drafts=drafts)
    assert 0.02 < acceptance < 0.3                         # drafts both accepted and rejected
    assert pvalue > 1e-3


def test_verify_drafts_accepts_the_argmax_run_when_greedy():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]] * 2)     # (2, 3, V)
    greedy = SamplingParams(temperature=0.0)
    (tokens, logprobs), (rejected, _) = verify_rows(logits, [[1, 0], [2, 0]], [greedy] * 2,
                                                    [torch.Generator()] * 2)
    assert tokens == [1, 0, 2]
    assert logprobs == pytest.approx(torch.log_softmax(logits[0].double(), -1)[[0, 1, 2], [1, 0, 2]].tolist())
    assert rejected == [1]                                 # first draft rejected: the argmax instead


class _DraftsFor:
    """Drafts (always the token 7) only for sequences whose prompt starts with `first`."""

    def __init__(self, first):
        self.first = first

    def propose_batch(self, requests):
        return [[7] * k if prompt_key[0] == self.first else [] for _, prompt_key, k in requests]

    def record(self, prompt_key, completion_ids):
        pass


@pytest.mark.parametrize("num_drafting, verifies", [(1, False), (2, True)])
def test_a_step_verifies_drafts_only_when_half_the_batch_drafts(model, tokenizer, num_drafting, verifies):
    """A few drafting sequences must not widen a batch that drafts nothing: every row of the
    verify forward is as wide as the widest."""
    prompts = [[1, 2, 3], [1, 5, 6], [9, 2, 3], [8, 5, 6]][:2 + num_drafting] if verifies else \
        [[1, 2, 3], [9, 2, 3], [8, 5, 6]]
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    plain = run(checked_engine(model, tokenizer), prompts, params)
    engine = checked_engine(model, tokenizer, speculative=NGRAM, proposer=_DraftsFor(1))
    assert run(engine, prompts, params) == plain
    assert (engine.counters.num_verify_steps > 0) == verifies


def test_ngram_proposer_continues_the_latest_earlier_occurrence():
    proposer = NgramProposer(SpeculativeOptions(method="ngram", min_ngram=2, max_ngram=3))
    assert proposer.propose([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], (), 3) == [9, 5, 6]
    assert proposer.propose([1, 2, 3, 4], (), 3) == []     # no earlier occurrence
    assert proposer.propose([1, 2, 9, 9, 1, 2], (), 8) == [9, 9, 1, 2]


def test_rollout_proposer_drafts_from_earlier_samples_of_the_prompt():
    proposer = RolloutProposer(SpeculativeOptions(method="rollouts", max_prompts=1,
                                                  max_rollouts_per_prompt=2))
    prompt = (10, 11, 12)
    proposer.record(prompt, [20, 21, 22, 23])
    assert proposer.propose(list(prompt), prompt, 3) == [20, 21, 22]      # at the first position
    assert proposer.propose(list(prompt) + [20, 21], prompt, 5) == [22, 23]
    proposer.record((1, 2), [3])                                          # evicts the older prompt
    assert proposer.propose(list(prompt), prompt, 3) == []


def test_adaptive_k_grows_on_full_acceptance_and_backs_off():
    assert next_num_draft_tokens(2, 2, 2, k_max=4) == 4
    assert next_num_draft_tokens(4, 4, 4, k_max=4) == 4
    assert next_num_draft_tokens(3, 3, 1, k_max=4) == 2
    assert next_num_draft_tokens(1, 1, 0, k_max=4) == 1
    assert next_num_draft_tokens(3, 0, 0, k_max=4) == 3                   # nothing drafted: unchanged


def test_options_refuse_bad_values():
    with pytest.raises(ValidationError, match="method"):
        SpeculativeOptions(method="medusa")
    with pytest.raises(ValidationError, match="num_draft_tokens"):
        SpeculativeOptions(method="ngram", num_draft_tokens=0)
    with pytest.raises(ValidationError, match=r"min_ngram \(5\) must be <= max_ngram \(4\)"):
        SpeculativeOptions(method="ngram", min_ngram=5)
    with pytest.raises(ValidationError, match="method 'draft_model' needs draft_model"):
        SpeculativeOptions(method="draft_model")
    with pytest.raises(ValidationError, match="only used by method 'draft_model', not 'ngram'"):
        SpeculativeOptions(method="ngram", draft_model="tiny")


@async_test
async def test_generator_actor_speculates_and_reports_acceptance_in_its_load():
    """A real generator process with `speculative` set: exact greedy tokens over ZeroMQ, and
    the acceptance figures in its heartbeat load."""
    import anyio

    spec = ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor", cpus=0.5,
                     memory_mb=0, options={"model": "tiny", "kv_cache_mb": 16,
                                           "speculative": {"method": "rollouts", "num_draft_tokens": 3}})
    request = {"prompt_ids": [5, 6, 7, 5, 6, 7], "sampling": {"max_new_tokens": 12, "temperature": 0.0}}
    async with Supervisor.open(heartbeat_interval_s=0.1) as sup:
        ref = await sup.start(spec)
        first = await ref.ask("generate", request, timeout_s=60)
        second = await ref.ask("generate", request, timeout_s=60)     # drafts from the first
        stats = await ref.ask("stats", {}, timeout_s=10)
        with anyio.fail_after(10):
            while "acceptance_rate" not in (sup.records["generator"].load.figures
                                            if sup.records["generator"].load else {}):
                await anyio.sleep(0.05)
    assert first["samples"][0]["token_ids"] == second["samples"][0]["token_ids"]
    assert stats["num_accepted_tokens"] > 0 and stats["acceptance_rate"] > 0
    with pytest.raises(ConfigError, match="speculative.num_draft_tokens"):
        validate_options(GeneratorActor, {"speculative": {"method": "ngram", "num_draft_tokens": 99}})


def test_generate_command_takes_speculative(capsys):
    import json

    from postrain.cli import main
    argv = ["generate", "--model", "tiny", "--prompt", "abcabcabcabc", "--max-tokens", "12",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--speculative", "ngram"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert report["stats"]["num_drafted_tokens"] > 0 and "acceptance_rate" in report["stats"]
    assert main(argv + ["--speculative", "ngram", "--num-draft-tokens", "0"]) == 2
    assert "--num-draft-tokens: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(argv + ["--speculative", "draft_model", "--draft-model", "tiny"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert report["stats"]["num_drafted_tokens"] > 0
    assert main(argv + ["--speculative", "draft_model"]) == 2
    assert "method 'draft_model' needs draft_model" in capsys.readouterr().err
