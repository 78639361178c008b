"""RL batches for tests: a small one for the tiny model, on the wire (tests that train a learner
actor a step), and one from an engine's samples (tests of train-inference logprobs), with the check
that a learner's logprobs of it equal the engine's."""
from __future__ import annotations

import torch

from postrain.actors.records import TrainBatch


def small_batch(seed: int = 0) -> dict:
    """Two groups of two 12-token samples (4 prompt tokens, 8 sampled), rewards 1, 0 / 0, 1."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (12,), generator=g) for _ in range(4)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 4 + [1] * 8] * 4,
                      behavior_logprobs=[torch.full((12,), -5.5) for _ in range(4)], policy_versions=[0] * 4,
                      rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1]).to_wire()


def sampled_batch(prompts: list[list[int]], outs, reward=lambda i: float(i % 2)) -> TrainBatch:
    """A TrainBatch of every sample of `outs` (the engine's outputs for `prompts`, one group each):
    the recorded logprobs as behaviour logprobs, reward(i) for sample i of a group, and each
    token's experts where the model routes (MoE)."""
    fields: dict = {"token_ids": [], "loss_mask": [], "behavior_logprobs": [], "policy_versions": [],
                    "rewards": [], "group_ids": [], "routed_experts": []}
    for group, (prompt, out) in enumerate(zip(prompts, outs)):
        for i, sample in enumerate(out.outputs):
            fields["token_ids"].append(prompt + sample.token_ids)
            fields["loss_mask"].append([0] * len(prompt) + [1] * len(sample.token_ids))
            fields["behavior_logprobs"].append([0.0] * len(prompt) + sample.logprobs)
            fields["policy_versions"].append([0] * len(prompt) + sample.policy_versions)
            fields["rewards"].append(reward(i))
            fields["group_ids"].append(group)
            fields["routed_experts"].append(sample.routed_experts)
    if fields["routed_experts"][0] is None:
        del fields["routed_experts"]
    return TrainBatch(**fields)


def assert_logprobs_equal(mine, batch: TrainBatch, atol: float = 1e-4) -> None:
    """The learner's logprobs (`mine`, a tensor a sample) equal the batch's behaviour logprobs on its
    loss mask, within `atol`."""
    for lp_mine, lp_gen, mask in zip(mine, batch.behavior_logprobs, batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        assert (lp_mine[m] - torch.tensor(lp_gen)[m]).abs().max() < atol
