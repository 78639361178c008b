"""A small RL batch for the tiny model, on the wire (tests that train a learner actor a step)."""
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
