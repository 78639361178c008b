"""`exact = true` (actors/models/exact.py): the generator's recorded logprob of every sampled token
equals the learner's recomputation bit for bit, for each architecture of the registry (MoE with
routing replay), with
preemption, a prefix hit, chunked prefill, shared prefixes and a weight swap in the mix; the first
step's ratio is exactly 1. Greedy output is unchanged; what exact cannot run with is refused by name.

Real tiny models: the built-in tiny Llama and random Hugging Face folders (transformers, no download).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.sequence import EngineError
from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models import exact
from postrain.actors.records import TrainBatch
from postrain.bench.architectures import build_hf_folder

sys.path.insert(0, str(Path(__file__).parent))
from train_batches import sampled_batch  # noqa: E402  (tests/actors/train_batches.py)

ARCHITECTURES = ["tiny", "qwen3", "mistral", "gemma3_text", "qwen3_moe"]


@pytest.fixture(scope="module")
def model_specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    specs = {"tiny": "tiny"}
    for arch in ARCHITECTURES[1:]:
        specs[arch] = str(build_hf_folder(arch, root / arch, window=8, seed=1, std=0.2))
    return specs


def rollouts(engine: Engine, tokenizer, seed: int, prompts: list[list[int]] | None = None) -> TrainBatch:
    """8 samples of each prompt; by default 8 prompts of 5-40 tokens (one continues another: a prefix hit)."""
    if prompts is None:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(8, 250, (int(n),), generator=g).tolist() for n in (5, 13, 29, 40, 7, 22, 17)]
        prompts.append(prompts[3][:33] + [9, 10])
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, seed=seed, max_new_tokens=12,
                                                   ignore_eos=True))
    return sampled_batch(prompts, outs)


def assert_bitwise_equal(learner: Learner, batch: TrainBatch) -> int:
    """The learner's logprobs of every sampled token equal the recorded ones exactly; returns the count."""
    count = 0
    for mine, theirs, mask in zip(learner.compute_logprobs(batch), batch.behavior_logprobs, batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        recorded = torch.tensor(theirs, dtype=torch.float64)[m]
        assert torch.equal(mine[m].double(), recorded), \
            f"max gap {float((mine[m].double() - recorded).abs().max()):.3e}"
        count += int(m.sum())
    return count


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_recorded_logprobs_equal_the_learners_bit_for_bit(arch, model_specs):
    learner = Learner(LearnerConfig(model=model_specs[arch], exact=True, temperature=1.0, micro_batch_size=16,
                                    lr=1e-3, routing_replay=arch == "qwen3_moe"))
    model = type(learner.model).empty(learner.model.config)
    model.load_state_dict(learner.model.state_dict())
    # 14 blocks of 4 tokens for 64 samples of up to 47 tokens: sequences are preempted and recomputed
    engine = Engine(model, learner.tokenizer, num_blocks=48, block_size_tokens=4, prefill_chunk_tokens=16,
                    max_num_seqs=32, exact=True)
    batch = rollouts(engine, learner.tokenizer, seed=3)
    assert engine.counters.num_preemptions > 0 and engine.counters.num_cached_prompt_tokens > 0
    for shared in (True, False):
        learner.config.shared_prefix = shared
        assert assert_bitwise_equal(learner, batch) == 64 * 12
    metrics = learner.train_step(batch)
    assert metrics["logprob_gap_max"] == 0.0
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0
    engine.load_weights(learner.state_dict(), version=1)             # a weight swap
    assert_bitwise_equal(learner, rollouts(engine, learner.tokenizer, seed=4))


@pytest.mark.slow
def test_a_weight_swap_with_samples_in_flight_leaves_every_token_exact_under_the_weights_it_names():
    """An asynchronous run swaps weights while samples are half written: the KV they hold was
    computed by the old weights, so exact recomputes it with the new ones, and each token's
    logprob is then its version's, bit for bit: the old weights' before the swap, the new after."""
    learner = Learner(LearnerConfig(model="tiny", exact=True, temperature=1.0, micro_batch_size=16, lr=1e-2))
    first_weights = {name: t.clone() for name, t in learner.state_dict().items()}
    first_model = {name: t.clone() for name, t in learner.model.state_dict().items()}
    engine = Engine(type(learner.model).empty(learner.model.config), learner.tokenizer, num_blocks=256,
                    prefill_chunk_tokens=16, exact=True)
    engine.load_weights(first_weights, version=0)
    learner.train_step(rollouts(engine, learner.tokenizer, seed=6))           # the learner is at version 1
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(8, 250, (int(n),), generator=g).tolist() for n in (6, 21, 35, 12)]
    ids = [engine.add_request(p, SamplingParams(n=4, temperature=1.0, seed=8, max_new_tokens=12, ignore_eos=True))
           for p in prompts]
    done = {}
    for _ in range(4):                                    # some tokens sampled; the longest prompt mid-read
        done.update({out.request_id: out for out in engine.step()})
    engine.load_weights(learner.state_dict(), version=1)
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step()})
    batch = sampled_batch(prompts, [done[i] for i in ids])
    versions = {v for sample in batch.policy_versions for v in sample[-12:]}
    assert versions == {0, 1}, "the swap came with samples in flight"
    old = Learner(LearnerConfig(model="tiny", exact=True, temperature=1.0, micro_batch_size=16))
    old.model.load_state_dict(first_model)
    for version, judge in ((0, old), (1, learner)):
        mask = [[int(m and v == version) for m, v in zip(ms, vs)]
                for ms, vs in zip(batch.loss_mask, batch.policy_versions)]
        assert assert_bitwise_equal(judge, dataclasses.replace(batch, loss_mask=mask)) > 0


@pytest.mark.slow
def test_a_lora_policy_is_exact_against_its_merged_weights():
    """The generator runs base + scale * B @ A (merge_lora); the exact learner multiplies by the same."""
    learner = Learner(LearnerConfig(model="tiny", exact=True, micro_batch_size=16, lr=1e-2,
                                    lora={"rank": 4, "alpha": 8}))
    for _ in range(2):                                     # B leaves zero: the adapters change the policy
        engine = Engine(type(learner.model).empty(learner.model.config), learner.tokenizer, num_blocks=256,
                        exact=True)
        engine.load_weights(learner.state_dict(), version=learner.policy_version)
        batch = rollouts(engine, learner.tokenizer, seed=5)
        assert_bitwise_equal(learner, batch)
        assert learner.train_step(batch)["logprob_gap_max"] == 0.0
    assert float(learner.lora.lora_B["model.layers.0.self_attn.q_proj"].detach().abs().max()) > 0


@pytest.mark.slow
def test_speculative_decoding_keeps_exact_logprobs():
    """Drafts verified in one forward of several positions: each emitted token's logprob is still
    the learner's (a verify step is a short prefill through the same exact ops)."""
    from postrain.actors.generator.speculative import SpeculativeOptions

    class EchoProposer:                  # drafts the sequence's last tokens again: some accepted, most not
        def propose_batch(self, requests):
            return [list(token_ids[-room:]) for token_ids, _, room in requests]

        def record(self, prompt_key, completion_ids):
            pass

    learner = Learner(LearnerConfig(model="tiny", exact=True, micro_batch_size=16))
    engine = Engine(type(learner.model).empty(learner.model.config), learner.tokenizer, num_blocks=256,
                    exact=True, speculative=SpeculativeOptions(method="ngram", num_draft_tokens=4),
                    proposer=EchoProposer())
    engine.load_weights(learner.state_dict(), version=0)
    batch = rollouts(engine, learner.tokenizer, seed=6)
    assert engine.counters.num_verify_steps > 0 and engine.counters.num_accepted_tokens > 0
    assert_bitwise_equal(learner, batch)


def test_greedy_tokens_are_unchanged_by_exact():
    plain = Learner(LearnerConfig(model="tiny")).model
    twin = type(plain).empty(plain.config)
    twin.load_state_dict(plain.state_dict())
    prompts = [[20 + i, 30 + i, 40 + i] * (i + 1) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    outs = [Engine(m, None, num_blocks=64, exact=e).generate(prompts, greedy) for m, e in ((plain, False), (twin, True))]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_exact_ops_round_alike_alone_and_in_a_long_tensor():
    values = torch.randn(600, generator=torch.Generator().manual_seed(0)) * 4
    for op in (exact.silu, exact.gelu_tanh, torch.exp, torch.tanh, torch.cos, torch.sin):
        assert exact.tail_consistent(op, values), op.__name__
    assert torch.allclose(exact.silu(values), F.silu(values), atol=1e-6)
    assert torch.allclose(exact.gelu_tanh(values), F.gelu(values, approximate="tanh"), atol=1e-5)


def test_exact_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=g), torch.randn(50, 64, generator=g)
    whole = exact.exact_linear(x, weight)
    for rows in (1, 2, 3, 7, 16, 31):
        assert torch.equal(exact.exact_linear(x[:rows], weight), whole[:rows])


def test_a_matmul_whose_rows_depend_on_the_batch_is_refused(monkeypatch):
    linear = F.linear
    monkeypatch.setattr(exact.F, "linear", lambda x, w, b=None: linear(x, w, b) * (1 + 1e-6 * (x.shape[0] % 2)))
    with pytest.raises(exact.ExactnessError, match="differently by the batch's size"):
        Learner(LearnerConfig(model="tiny", exact=True))


def test_what_exact_cannot_run_with_is_refused_by_name():
    with pytest.raises(LearnerError, match="float32 weights and no autocast"):
        LearnerConfig(model="tiny", exact=True, autocast_dtype="bfloat16")
    model = Learner(LearnerConfig(model="tiny")).model
    with pytest.raises(EngineError, match="weight_precision"):
        Engine(model, None, num_blocks=16, exact=True, weight_precision="float16")
    with pytest.raises(EngineError, match="float32 KV cache"):
        Engine(model, None, num_blocks=16, exact=True, kv_dtype="int8")


@pytest.mark.slow
def test_a_run_with_exact_trains_on_a_ratio_of_exactly_one(tmp_path):
    """`exact = true` in [shared] reaches the generator and the learner of a real run (every role a
    process): both RL steps' logprob gaps are 0, the second on samples of the weights the learner
    published after the first (a weight sync over the wire)."""
    import json

    from task_runs import run_task

    options = {"answer_format": "plain", "max_digits": 1}
    shared = {"model": "tiny", "task": "arithmetic", "task_options": options, "exact": True}
    summary, folder = run_task(tmp_path, "arithmetic", options, extra={"shared": shared},
                               orchestrator={"num_steps": 2, "max_staleness": 0})
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "logprob_gap_max" in row]
    assert len(steps) == 2 and all(row["logprob_gap_max"] == 0.0 and row["ratio_mean"] == 1.0 for row in steps)
