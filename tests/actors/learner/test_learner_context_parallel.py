"""The learner with `context_parallel = 2` (real processes, gloo over loopback): 2 ranks (one
ring) and 4 ranks (2 rings, data parallel over them) end an SFT step and then an RL step with
the same loss and weights as one process on the whole batch, for an aggregation that needs
whole sequences (seq-mean-token-mean, with a KL reference and an entropy bonus, under "ddp" and
"fsdp"; the fsdp reference is the warm start's, taken from the sharded policy) and for a
sequence-level loss (GSPO); the config rules' errors name the fix."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.context_parallel_step import check_ranks, rank_shards
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.records import SftBatch, TrainBatch

TINY = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
# lr = adam_eps = 1: every weight moves by about g / (|g| + 1), so the weights show gradient
# differences directly (test_learner_dp.py says why)
BASE = dict(model=TINY, lr=1.0, adam_eps=1.0, micro_batch_size=3, max_grad_norm=0.5)
CONFIGS = {
    "seq_mean": dict(BASE, agg_mode="seq-mean-token-mean", reference_model="initial", kl_coef=0.1,
                     entropy_coef=0.01),
    "gspo": dict(BASE, loss="gspo"),
    "seq_mean_fsdp": dict(BASE, agg_mode="seq-mean-token-mean", reference_model="warm_start", kl_coef=0.1,
                          entropy_coef=0.01, strategy="fsdp"),
}

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from safetensors.torch import save_file
    sys.path.insert(0, {test_dir!r})
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    from postrain.actors.learner.context_parallel_step import rank_shards
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from test_learner_context_parallel import CONFIGS, rl_batch, sft_batch
    for name, config in CONFIGS.items():
        learner = Learner(LearnerConfig(**config, context_parallel=2))
        sft = learner.sft_step(rank_shards(sft_batch(), world, 2)[rank])
        rl = learner.train_step(rank_shards(rl_batch(), world, 2)[rank])
        save_file({{k: v.contiguous() for k, v in learner.state_dict().items()}}, f"{{out}}-{{name}}-{{rank}}")
        print("METRICS", name, sft["loss"], rl["loss"], rl["num_tokens"], flush=True)
    dist.destroy_process_group()
""")


def _samples(seed: int, num: int = 8):
    """`num` samples of 40 to 180 tokens (padding in every micro-batch), prompts of 5 to 30."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (int(torch.randint(40, 181, (1,), generator=g)),), generator=g)
           for _ in range(num)]
    prompts = [int(torch.randint(5, 31, (1,), generator=g)) for _ in range(num)]
    return g, ids, [[0] * p + [1] * (len(x) - p) for p, x in zip(prompts, ids)]


def sft_batch() -> SftBatch:
    _, ids, mask = _samples(11)
    return SftBatch(token_ids=ids, loss_mask=mask)


def rl_batch() -> TrainBatch:
    g, ids, mask = _samples(12)
    return TrainBatch(token_ids=ids, loss_mask=mask,
                      behavior_logprobs=[torch.randn(len(x), generator=g) * 0.1 - 5.5 for x in ids],
                      advantages=torch.randn(len(ids), generator=g).tolist())


@pytest.fixture(scope="module")
def one_process():
    """Per config: (weights, sft loss, rl loss) of one process on the whole batches."""
    torch.set_num_threads(1)
    out = {}
    for name, config in CONFIGS.items():
        learner = Learner(LearnerConfig(**{**config, "strategy": "ddp"}))   # one process: nothing to shard
        sft, rl = learner.sft_step(sft_batch()), learner.train_step(rl_batch())
        out[name] = (learner.state_dict(), sft["loss"], rl["loss"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.variants)])   # 4: pytest -m variants
def test_context_parallel_learner_equals_one_process(tmp_path, world, one_process, rank_processes):
    script = RANK.format(test_dir=os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "weights")
    stdouts = rank_processes([["-c", script, r, world, tmp_path / "init", out] for r in range(world)], 240)
    lines = [line.split() for stdout in stdouts for line in stdout.splitlines() if line.startswith("METRICS")]
    for name, (weights, sft_loss, rl_loss) in one_process.items():
        for rank in range(world):   # every rank of every ring ends with one process's weights (fsdp: rank
            got = load_file(f"{out}-{name}-{rank}")          # 0 gathers them, the others hold shards)
            if rank > 0 and CONFIGS[name].get("strategy") == "fsdp":
                assert got == {}
                continue
            for key, tensor in weights.items():
                torch.testing.assert_close(got[key], tensor, atol=1e-5, rtol=0, msg=lambda m: f"{name} {key}: {m}")
        for line in (ln for ln in lines if ln[1] == name):
            assert float(line[2]) == pytest.approx(sft_loss, abs=1e-5)
            assert float(line[3]) == pytest.approx(rl_loss, abs=1e-5)


def test_context_parallel_config_rules_name_the_fix():
    with pytest.raises(LearnerError, match=r"context_parallel = 2 needs the learner's ranks to be a multiple "
                                           r"of 2, got ranks = 3: set ranks = 2"):
        check_ranks(2, 3)
    with pytest.raises(LearnerError, match="context_parallel must be >= 1"):
        LearnerConfig(model=TINY, context_parallel=0)
    alone = Learner(LearnerConfig(**BASE, context_parallel=2))
    with pytest.raises(LearnerError, match="this learner runs alone: set context_parallel = 1"):
        alone.sft_step(sft_batch())


def test_rank_shards_give_every_rank_of_a_ring_the_same_samples():
    shards = rank_shards(rl_batch(), 4, 2)
    assert [len(s.token_ids) for s in shards] == [4, 4, 4, 4]
    assert shards[0] is shards[1] and shards[2] is shards[3]
    assert [x.tolist() for x in shards[0].token_ids + shards[2].token_ids] == \
        [x.tolist() for x in rl_batch().token_ids]
