"""The learner's `loss` preset and `loss_options` (actors/learner/loss_preset.py): precedence,
refusals, and one real train step per preset on a tiny Llama with its stabiliser metrics."""
from __future__ import annotations

import math

import pytest
import torch

from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.records import TrainBatch
from postrain.ext import rl_ops

TINY = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
            num_kv_heads=1, max_position_embeddings=64, tie_word_embeddings=True)


def test_a_preset_sets_its_fields_and_explicit_settings_win():
    gspo = LearnerConfig(loss="gspo").loss_config()
    assert (gspo.loss_type, gspo.clip_low, gspo.clip_high, gspo.agg_mode) == ("gspo", 3e-4, 4e-4,
                                                                               "seq-mean-token-mean")
    assert LearnerConfig(loss="gspo", clip_high=1e-3).loss_config().clip_high == 1e-3
    assert LearnerConfig(loss="icepop", loss_options={"is_high": 3.0}).loss_config().is_high == 3.0
    icepop = LearnerConfig(loss="icepop")
    assert icepop.objective == "decoupled" and icepop.loss_config().is_mode == "icepop"
    kl = LearnerConfig(loss="kl")
    assert (kl.kl_coef, kl.reference_model) == (1e-3, "initial")
    assert LearnerConfig(loss="kl", kl_coef=0.05).kl_coef == 0.05
    assert LearnerConfig().loss_config() == rl_ops.PolicyLossConfig()   # "ppo": the classic fields


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(LearnerError, match=r"learner.loss: unknown loss preset 'gpso'; known: \["):
        LearnerConfig(loss="gpso")
    with pytest.raises(LearnerError, match=r"unknown learner.loss_options \['is_hi'\]; known: "):
        LearnerConfig(loss_options={"is_hi": 1.0})
    with pytest.raises(LearnerError, match='needs objective = "decoupled"'):
        LearnerConfig(loss_options={"is_mode": "icepop", "is_low": 0.5, "is_high": 2.0})


def on_policy_batch(learner: Learner, seed: int = 0) -> TrainBatch:
    """Random samples whose behaviour logprobs are the learner's own (an on-policy rollout)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (9 + i,), generator=g) for i in range(4)]
    fields = dict(token_ids=ids, loss_mask=[[0] * 4 + [1] * (len(x) - 4) for x in ids], policy_versions=[0] * 4,
                  rewards=[1.0, 0.0, 0.0, 0.0], group_ids=[0, 0, 1, 1])
    behavior = learner.compute_logprobs(TrainBatch(**fields, behavior_logprobs=[torch.zeros(len(x)) for x in ids]))
    return TrainBatch(**fields, behavior_logprobs=behavior)


@pytest.mark.parametrize("name", sorted(rl_ops.LOSS_PRESETS))
def test_every_preset_takes_a_real_train_step_and_reports_its_metrics(name):
    learner = Learner(LearnerConfig(model=TINY, loss=name, micro_batch_size=2, lr=1e-3))
    before = [p.detach().clone() for p in learner.params]
    metrics = learner.train_step(on_policy_batch(learner))
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "masked_token_frac", "masked_seq_frac",
                                                    "logprob_gap_mean", "logprob_gap_max"))
    assert metrics["num_zero_variance_groups"] == 1.0     # group 1's rewards are equal
    assert metrics["masked_token_frac"] == 0.0 and metrics["logprob_gap_max"] < 1e-4   # on-policy: nothing masked
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
