"""DAPO's batch rules (actors/orchestrator/dynamic_sampling.py): dynamic sampling keeps the batch at
prompts_per_step groups and the ledger balanced, every dropped group with its reason; overlong
shaping adds DAPO's length penalty to the trained reward only."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from postrain.actors.env.api import Reward
from postrain.actors.orchestrator.ledger import SampleLedger
from postrain.actors.orchestrator.dynamic_sampling import BATCH_FULL, ZERO_VARIANCE, BatchRules
from postrain.actors.orchestrator.options import OrchestratorOptions
from postrain.actors.orchestrator.scored_sample import ScoredSample
from postrain.actors.orchestrator.train_step import surviving_groups, train_batch
from postrain.actors.records import Rollout


def sample(sample_id: str, reward: float, num_tokens: int = 6) -> ScoredSample:
    mask = [0] * 4 + [1] * num_tokens
    return ScoredSample(sample_id, Rollout(token_ids=list(range(10, 10 + len(mask))), loss_mask=mask,
                                           behavior_logprobs=[-1.0] * len(mask), policy_versions=[0] * len(mask),
                                           reward=Reward({"correct": reward}), num_turns=1,
                                           num_policy_tokens=num_tokens))


def generated(ledger: SampleLedger, rewards: list[list[float]]) -> list[list[ScoredSample]]:
    groups = []
    for g, group in enumerate(rewards):
        groups.append([])
        for s, reward in enumerate(group):
            ledger.create(f"g{g}-s{s}")
            groups[-1].append(sample(f"g{g}-s{s}", reward))
    return groups


def test_dynamic_sampling_drops_equal_groups_and_fills_the_batch_from_the_extra_prompts():
    options = OrchestratorOptions(prompts_per_step=2, samples_per_prompt=3, dynamic_sampling=True,
                                  dynamic_sampling_extra_prompts=2)
    assert options.prompts_generated_per_step == 4
    rules = BatchRules.from_options(options)
    ledger = SampleLedger()
    groups = generated(ledger, [[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 1, 1]])
    kept, num_zero = rules.select(surviving_groups(groups, ledger), ledger)
    assert [[s.sample_id for s in g] for g in kept] == [["g1-s0", "g1-s1", "g1-s2"], ["g3-s0", "g3-s1", "g3-s2"]]
    assert num_zero == 2 and ledger.drop_reasons == {ZERO_VARIANCE: 6}
    assert train_batch(kept, rules).num_samples == options.batch_size          # the batch stays full
    for group in kept:
        for s in group:
            ledger.advance(s.sample_id, "trained")
    ledger.check()


def test_groups_beyond_the_batch_are_dropped_as_batch_full_and_off_keeps_everything():
    ledger = SampleLedger()
    groups = generated(ledger, [[1, 0], [0, 1], [1, 0]])
    kept, num_zero = BatchRules(dynamic_sampling=True, max_groups=2).select(groups, ledger)
    assert len(kept) == 2 and num_zero == 0 and ledger.drop_reasons == {BATCH_FULL: 2}
    assert BatchRules().select(groups, ledger) == (groups, 0)


def test_overlong_shaping_adds_dapos_penalty_to_the_trained_reward():
    rules = BatchRules(overlong_max_tokens=20, overlong_buffer_tokens=8)
    samples = [sample("a", 1.0, 12), sample("b", 1.0, 16), sample("c", 1.0, 20), sample("d", 1.0, 21)]
    assert [rules.penalty(s) for s in samples] == [0.0, -0.5, -1.0, -1.0]
    assert train_batch([samples], rules).rewards == [1.0, 0.5, 0.0, 0.0]
    assert samples[1].rollout.reward.total == 1.0                             # the environment's reward stays
    with pytest.raises(ValidationError, match="overlong_buffer_tokens = 32 exceeds overlong_max_tokens = 20"):
        OrchestratorOptions(overlong_max_tokens=20, overlong_buffer_tokens=32)
