"""Context parallel: a 2,048- and an 8,192-token sequence split across gloo ranks (real processes)
with ring attention score and train exactly like one process holding them whole."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from postrain.actors.learner.context_parallel import (
    ContextParallelError, Ring, shard_sequence, zigzag_positions,
)
from postrain.actors.models.llama import ModelConfig, build_model

CONFIGS = {
    "full": dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_position_embeddings=8192),
    # a sliding window that crosses slice boundaries (zig-zag chunks are 256 tokens at 4 ranks)
    "window": dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=8192, sliding_window=300),
}
# (name, ring size, sequences) per sequence length: 4 ranks in one ring, and 2 rings of 2
SCENARIOS = {2048: (("cp4", 4, 1), ("cp4_window", 4, 1), ("cp2_dp2", 2, 2)),
             8192: (("cp4", 4, 1), ("cp2_dp2", 2, 2))}

RANK = textwrap.dedent("""
    import sys, datetime, torch, torch.distributed as dist
    rank, world, init_file, out, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    sys.path.insert(0, {test_dir!r})
    from test_context_parallel import model_and_batch
    from postrain.actors.learner.context_parallel import (
        RingBroken, all_reduce_gradients, context_parallel_groups, shard_sequence, shard_token_losses)
    results = {{}}
    if scenario == "broken":
        ring, _ = context_parallel_groups(2, timeout_s=5)
        model, ids = model_and_batch("full", 1)
        dist.barrier()
        if rank == 1:
            import os; os._exit(0)                  # gone before the first key/value block
        try:
            shard_token_losses(model, shard_sequence(ids, ring), ring)
        except RingBroken as exc:
            print("RINGBROKEN", exc, flush=True)
        import os; os._exit(0)
    from test_context_parallel import SCENARIOS
    seq_len = int(scenario.removeprefix("train-"))
    for name, cp, rows in SCENARIOS[seq_len]:
        ring, dp = context_parallel_groups(cp)
        model, ids = model_and_batch("window" if name.endswith("window") else "full", rows, seq_len)
        mine = ids[rank // cp:rank // cp + 1] if rows > 1 else ids   # data parallel: one sequence a ring
        shard = shard_sequence(mine, ring)
        losses = shard_token_losses(model, shard, ring)
        (losses.sum() / shard.num_labels).backward()
        all_reduce_gradients(model, ring, dp)
        results[name] = dict(losses=losses.detach(), positions=shard.positions,
                             grads={{k: p.grad for k, p in model.named_parameters()}})
    torch.save(results, out)
    dist.destroy_process_group()
""")


def model_and_batch(name: str, rows: int, seq_len: int = 2048):
    """The same model (seeded) and `rows` random sequences of `seq_len` tokens on every rank."""
    model = build_model(ModelConfig(**CONFIGS[name])).init_weights(seed=3, std=0.2)
    ids = torch.randint(1, 264, (rows, seq_len), generator=torch.Generator().manual_seed(7))
    return model, ids


def reference(name: str, rows: int, seq_len: int):
    """One process, the whole sequences: per-token losses (rows, L - 1) and the gradients of
    their mean."""
    model, ids = model_and_batch(name, rows, seq_len)
    logits = model(ids).float()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    losses.mean().backward()
    return losses.view(rows, -1).detach(), {k: p.grad for k, p in model.named_parameters()}


def launch(tmp_path, world: int, scenario: str) -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(test_dir=os.path.dirname(os.path.abspath(__file__))))
    init = tmp_path / f"init-{scenario}"
    return [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(init),
                              str(tmp_path / f"{scenario}-{r}.pt"), scenario],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]


def test_zigzag_split_covers_every_position_once_and_balances_causal_work():
    positions = [zigzag_positions(64, 4, r) for r in range(4)]
    assert sorted(torch.cat(positions).tolist()) == list(range(64))
    work = [int((p + 1).sum()) for p in positions]        # keys each rank's queries see, causally
    assert len(set(work)) == 1
    with pytest.raises(ContextParallelError, match="pad it to a multiple of 8"):
        zigzag_positions(60, 4, 0)
    ids = torch.arange(1, 62)[None]                        # 61 tokens: padded to 64 at the end
    shards = [shard_sequence(ids, Ring(None, 4, r)) for r in range(4)]
    assert sum(int((s.labels != -100).sum()) for s in shards) == 60 == shards[0].num_labels


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [n if n == min(SCENARIOS) else pytest.param(n, marks=pytest.mark.variants)
                                     for n in sorted(SCENARIOS)])   # the longer rings: pytest -m variants
def test_two_and_four_gloo_ranks_equal_one_process(tmp_path, seq_len):
    procs = launch(tmp_path, 4, f"train-{seq_len}")
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    ranks = [torch.load(tmp_path / f"train-{seq_len}-{r}.pt") for r in range(4)]
    for name, cp, rows in SCENARIOS[seq_len]:
        want_losses, want_grads = reference("window" if name.endswith("window") else "full", rows, seq_len)
        got = torch.zeros(rows, seq_len)
        for r, result in enumerate(ranks):
            got[r // cp if rows > 1 else 0, result[name]["positions"]] = result[name]["losses"][0]
        # every token's loss, the first and last of each slice included: causal at every boundary
        torch.testing.assert_close(got[:, :-1], want_losses, atol=2e-5, rtol=1e-5)
        assert float(got[:, -1].abs().max()) == 0.0        # the last token has no label
        for result in ranks:
            for key, grad in want_grads.items():
                torch.testing.assert_close(result[name]["grads"][key], grad, atol=2e-6, rtol=1e-4,
                                           msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.slow
def test_a_broken_ring_fails_naming_the_ranks(tmp_path):
    procs = launch(tmp_path, 2, "broken")
    out = procs[0].communicate(timeout=300)[0]
    procs[1].communicate(timeout=60)
    line = next((ln for ln in out.splitlines() if ln.startswith("RINGBROKEN")), None)
    assert line is not None, out
    assert "ring rank 0" in line and "ring rank 1" in line and "key/value blocks" in line
