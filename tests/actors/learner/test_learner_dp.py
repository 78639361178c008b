"""Data parallel: two CPU ranks (real processes, torch.distributed over gloo), each training on
half of the batch, end with the same weights as one process training on the whole batch."""
from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from postrain.actors.learner.group import shard_batch
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.records import TrainBatch

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
# adam_eps = lr = 1: each AdamW step moves a weight by about g / (|g| + 1), so the weights show
# gradient differences directly (with eps = 1e-8, rounding noise in a near-zero gradient entry
# could flip its update by up to 2 * lr, which says nothing about data parallelism).
CONFIG = dict(model=TINY, lr=1.0, adam_eps=1.0, micro_batch_size=2, agg_mode="seq-mean-token-mean",
              max_grad_norm=0.5)

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from safetensors.torch import save_file
    sys.path.insert(0, {test_dir!r})
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from test_learner_dp import CONFIG, batch, shard
    learner = Learner(LearnerConfig(**CONFIG, seed=rank))   # rank 0's weights are broadcast
    metrics = [learner.train_step(shard(batch(step), rank, world)) for step in range(2)]
    if rank == 0:
        save_file({{k: v.contiguous() for k, v in learner.state_dict().items()}}, out)
        print("LOSS", metrics[-1]["loss"], "GRAD_NORM", metrics[-1]["grad_norm"])
    dist.destroy_process_group()
""")


def batch(step: int, num: int = 8) -> TrainBatch:
    """Groups of 4 samples that share a 5-token prompt (so shared-prefix training runs on each rank)."""
    g = torch.Generator().manual_seed(100 + step)
    prompts = [torch.randint(8, 264, (5,), generator=g) for _ in range(num // 4)]
    ids = [torch.cat([prompts[i // 4], torch.randint(8, 264, (3 + 2 * (i % 5),), generator=g)])
           for i in range(num)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 5 + [1] * (len(x) - 5) for x in ids],
                      behavior_logprobs=[torch.randn(len(x), generator=g) * 0.1 - 5.5 for x in ids],
                      policy_versions=[step] * num, advantages=torch.randn(num, generator=g).tolist())


def shard(full: TrainBatch, rank: int, world: int) -> TrainBatch:
    return shard_batch(full, world)[rank]


def test_two_gloo_ranks_match_one_process(tmp_path, rank_processes):
    import os
    test_dir = os.path.dirname(os.path.abspath(__file__))
    script = RANK.format(test_dir=test_dir)
    out = tmp_path / "rank0.safetensors"
    stdouts = rank_processes([["-c", script, r, 2, tmp_path / "init", out] for r in range(2)], 240)

    single = Learner(LearnerConfig(**CONFIG, seed=0))
    metrics = [single.train_step(batch(step)) for step in range(2)]
    got = load_file(str(out))
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
    loss = float(stdouts[0].split("LOSS")[1].split()[0])
    assert loss == pytest.approx(metrics[-1]["loss"], abs=1e-6)
