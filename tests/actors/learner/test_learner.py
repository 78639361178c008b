"""The learner without actors: train-inference logprob gap against the engine, learning on a tiny
batch, bit-identical resume, Hugging Face export parity, schedules, KL and its warm-start
reference, and named errors.

A real tiny Llama (random weights, the byte tokenizer's vocabulary) and the real generator engine.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.loading import build_policy
from postrain.actors.learner.batch import LearnerError, pack_batch
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.records import SftBatch, TrainBatch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/actors
from train_batches import sampled_batch  # noqa: E402

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def learner(**kw) -> Learner:
    kw.setdefault("model", TINY)
    kw.setdefault("micro_batch_size", 2)
    return Learner(LearnerConfig(**kw))


def random_batch(seed: int, num: int = 4, prompt_len: int = 6, advantages=None) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (prompt_len + 5 + 3 * i,), generator=g) for i in range(num)]
    mask = [[0] * prompt_len + [1] * (len(x) - prompt_len) for x in ids]
    behavior = [torch.randn(len(x), generator=g) * 0.1 - 5.5 for x in ids]
    adv = advantages if advantages is not None else [1.0 if i % 2 == 0 else -1.0 for i in range(num)]
    return TrainBatch(token_ids=ids, loss_mask=mask, behavior_logprobs=behavior, policy_versions=[0] * num,
                      advantages=adv)


def sft(batch: TrainBatch) -> SftBatch:
    """The same samples as a supervised batch."""
    return SftBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_recomputed_logprobs_match_the_generator_engine(temperature):
    lrn = learner(temperature=temperature, lr=1e-4)
    gen_model, tokenizer = build_policy(TINY, 0, torch.float32, "cpu")     # same seed: same weights
    gen_model.load_state_dict(lrn.model.state_dict())
    engine = Engine(gen_model, tokenizer, num_blocks=64, block_size_tokens=4)
    prompts = [tokenizer.encode("def f(x):"), tokenizer.encode("2+3=")]
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=10,
                                                   seed=7, ignore_eos=True))
    batch = sampled_batch(prompts, outs, reward=lambda i: float(i == 0))
    mine = lrn.compute_logprobs(batch)
    for ids, lp_mine, lp_gen, mask in zip(batch.token_ids, mine, batch.behavior_logprobs, batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        gap = (lp_mine[m] - torch.tensor(lp_gen)[m]).abs().max()
        assert gap < 1e-4, f"train-inference logprob gap {gap:.2e} for {len(ids)} tokens"
    metrics = lrn.train_step(batch)
    assert metrics["logprob_gap_max"] < 1e-4
    assert metrics["logprob_gap_tokens"] == metrics["num_tokens"] == 6 * 10
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0   # ratio 1 at the first step
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["reward_mean"] == pytest.approx(1 / 3) and metrics["num_zero_variance_groups"] == 0
    assert metrics["policy_version"] == 1 and lrn.policy_version == 1
    assert metrics["tokens_per_s"] > 0 and metrics["grad_norm"] > 0


def test_decoupled_weighs_stale_tokens_by_the_current_weights_over_the_behaviour_policy():
    """The proximal logprobs are those of the weights the step starts from (one optimizer step
    per train step), so each token's behaviour weight is min(exp(current - behaviour), cap)."""
    lrn = learner(lr=1e-3, objective="decoupled", behavior_weight_cap=1.0)
    batch = random_batch(4)     # behaviour logprobs from some older policy
    current = lrn.compute_logprobs(batch)
    weights = [torch.clamp(torch.exp(cur - beh), max=1.0)[torch.tensor(mask, dtype=torch.bool)]
               for cur, beh, mask in zip(current, batch.behavior_logprobs, batch.loss_mask)]
    expected = float(torch.cat(weights).mean())
    assert 0.2 < expected < 0.99, "some tokens are capped, some are not"
    metrics = lrn.train_step(batch)
    assert metrics["behavior_weight_mean"] == pytest.approx(expected, rel=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_sft_overfits_a_tiny_batch_and_the_rl_step_moves_logprobs_by_advantage():
    lrn = learner(lr=3e-3, max_grad_norm=1.0)
    batch = random_batch(0)
    losses = [lrn.sft_step(sft(batch))["loss"] for _ in range(25)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(math.isfinite(x) for x in losses)

    rl = learner(lr=1e-3)
    rl_batch = random_batch(1)
    rl_batch = dataclasses.replace(rl_batch, behavior_logprobs=rl.compute_logprobs(rl_batch))   # on-policy
    before = rl.compute_logprobs(rl_batch)
    for _ in range(4):
        metrics = rl.train_step(rl_batch)
    after = rl.compute_logprobs(rl_batch)
    for i, mask in enumerate(rl_batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        moved = float((after[i][m] - before[i][m]).mean())
        assert moved > 0 if rl_batch.advantages[i] > 0 else moved < 0, (i, moved)
    assert metrics["clip_frac_high"] + metrics["clip_frac_low"] > 0   # the clip engaged
    assert metrics["staleness_max"] == 3


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_equals_one_full_batch(agg_mode):
    # adam_eps = lr = 1: AdamW's first step moves each weight by ~g / (|g| + 1), so the weights
    # expose gradient differences (with a tiny eps, rounding noise in near-zero gradients flips signs).
    batch = random_batch(7, num=6)
    one = learner(micro_batch_size=6, lr=1.0, adam_eps=1.0, agg_mode=agg_mode)
    many = learner(micro_batch_size=1, lr=1.0, adam_eps=1.0, agg_mode=agg_mode)
    m_one, m_many = one.train_step(batch), many.train_step(batch)
    assert m_one["loss"] == pytest.approx(m_many["loss"], abs=1e-6)
    assert m_one["grad_norm"] == pytest.approx(m_many["grad_norm"], rel=1e-5)
    for name, tensor in one.model.state_dict().items():
        torch.testing.assert_close(many.model.state_dict()[name], tensor, atol=1e-6, rtol=0)


def test_micro_batches_sort_by_length_and_the_step_stays_the_same():
    batch = random_batch(5, num=6)
    batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[::-1]       # longest first, lengths differ
                                          for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None})
    many = learner(micro_batch_size=2, lr=1.0, adam_eps=1.0, agg_mode="seq-mean-token-mean")
    packed = pack_batch(batch)
    order, micro = many.forward.micro_batches(packed)                        # the samples share no prefix
    widths = [mb.input_ids.shape[1] for mb in micro]
    assert widths == sorted(widths) and widths[0] < widths[-1]       # short samples pad to short ones
    assert order.tolist() == [5, 4, 3, 2, 1, 0] and all(mb.shared is None for mb in micro)
    one = learner(micro_batch_size=6, lr=1.0, adam_eps=1.0, agg_mode="seq-mean-token-mean")
    for step, records in (("train_step", batch), ("sft_step", sft(batch))):
        m_one, m_many = getattr(one, step)(records), getattr(many, step)(records)
        assert m_one["loss"] == pytest.approx(m_many["loss"], abs=1e-6)
        for name, tensor in one.model.state_dict().items():
            torch.testing.assert_close(many.model.state_dict()[name], tensor, atol=1e-6, rtol=0)


def test_checkpoint_resume_is_bit_identical_for_the_next_step(tmp_path):
    a = learner(lr=1e-3, warmup_steps=2, lr_schedule="cosine", total_steps=10, reference_model="initial",
                kl_coef=0.05, kl_target=0.01, kl_horizon=10, objective="decoupled")
    b1, b2 = random_batch(2), random_batch(3)
    a.train_step(b1)
    extra = {"ledger": {"created": 8, "trained": 4}, "cursor": [3, "x"]}
    folder = a.save_checkpoint(tmp_path / "ckpt", extra=extra)
    a.save_checkpoint(tmp_path / "ckpt", extra=extra)     # overwriting is atomic too
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary folders are left behind"
    rng_after_save, coef_at_save = torch.rand(3), a.kl.coef
    metrics_a = a.train_step(b2)

    b = learner(lr=1e-3, warmup_steps=2, lr_schedule="cosine", total_steps=10, reference_model="initial",
                kl_coef=0.05, kl_target=0.01, kl_horizon=10, objective="decoupled", seed=99)
    assert b.load_checkpoint(folder) == extra
    assert (b.step, b.policy_version, b.kl.coef) == (1, 1, coef_at_save)
    assert torch.equal(torch.rand(3), rng_after_save), "the torch RNG is restored"
    metrics_b = b.train_step(b2)
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name]), name
    for key in ("loss", "kl", "grad_norm", "lr", "kl_coef"):
        assert metrics_a[key] == metrics_b[key], key
    assert metrics_b["kl"] > 0 and metrics_b["behavior_weight_mean"] > 0


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_weights_equal(model, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_a_warm_start_reference_is_the_policy_where_rl_begins_and_a_resume_keeps_it(tmp_path, lora):
    options = dict(lr=1e-2, reference_model="warm_start", kl_coef=0.1, lora=lora)
    a = learner(**options)
    initial = weights(a.reference)
    a.sft_step(sft(random_batch(1)))
    a.save_checkpoint(tmp_path / "in_warm_start")
    warm = a.lora.merged(weights(a.model))          # LoRA: the adapters merged into the base
    assert any(not torch.equal(initial[name], warm[name]) for name in warm), "the warm start moved the policy"

    first = a.train_step(random_batch(2))
    assert_weights_equal(a.reference, warm)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6), "RL's first step starts at its reference"
    second = a.train_step(random_batch(3))
    assert_weights_equal(a.reference, warm)          # frozen: the policy moves, the reference does not
    assert second["kl"] > 1e-6
    a.save_checkpoint(tmp_path / "in_rl")

    resumed_in_rl = learner(**options, seed=9)
    resumed_in_rl.load_checkpoint(tmp_path / "in_rl")
    resumed_in_rl.train_step(random_batch(4))
    assert_weights_equal(resumed_in_rl.reference, warm)
    resumed_in_warm_start = learner(**options, seed=9)
    resumed_in_warm_start.load_checkpoint(tmp_path / "in_warm_start")
    resumed_in_warm_start.train_step(random_batch(2))    # its first RL step takes the resumed policy
    assert_weights_equal(resumed_in_warm_start.reference, warm)


def test_hf_export_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    lrn = learner(lr=1e-2)
    lrn.train_step(random_batch(4))
    folder = lrn.export_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(8, 264, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, lrn.model(ids), atol=1e-4, rtol=1e-4)


def test_lr_schedule_warmup_then_cosine():
    lrn = learner(lr=1.0, warmup_steps=4, lr_schedule="cosine", total_steps=14, min_lr_ratio=0.1)
    assert [lrn.config.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lrn.config.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lrn.config.lr_at(14) == pytest.approx(0.1) and lrn.config.lr_at(100) == pytest.approx(0.1)
    assert learner(lr=0.5).config.lr_at(1000) == 0.5


def test_bad_batches_and_options_are_named():
    lrn = learner()
    batch = random_batch(6)
    batch.loss_mask[1] = batch.loss_mask[1][:-1]
    with pytest.raises(LearnerError, match=r"loss_mask\[1\] has 13 entries but token_ids\[1\] has 14"):
        lrn.train_step(batch)
    batch = dataclasses.replace(random_batch(6), advantages=None, rewards=[1.0, 0.0, 1.0, 0.0],
                                group_ids=[0, 1, 0, 1])
    with pytest.raises(LearnerError, match="group 0 is not contiguous"):
        lrn.train_step(batch)
    with pytest.raises(LearnerError, match="unknown learner option"):
        LearnerConfig.from_dict({"learning_rate": 1e-5})
    with pytest.raises(LearnerError, match="need reference_model"):
        LearnerConfig(kl_coef=0.1)
    batch = random_batch(6)
    batch = dataclasses.replace(batch, loss_mask=[[0] * len(m) for m in batch.loss_mask])
    with pytest.raises(LearnerError, match="no trained tokens"):
        lrn.train_step(batch)
