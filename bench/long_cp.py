"""Context-parallel training's memory per rank (`postrain bench long`'s cp rows).

One training step (next-token loss, backward, gradient all-reduce) of a small random model
(2 layers, hidden 64, 4 query / 2 KV heads) on one sequence of 8,192 tokens (2,048 in quick
mode): 1 rank on the ordinary training path (`model(ids)`: SDPA over the whole causal mask)
against 2 and 4 gloo ranks on the zig-zag split with ring attention
(`postrain.actors.learner.context_parallel`). Each rank is its own process with one torch
thread; after a 256-token warm-up step, its step memory is the growth of its peak resident set over the step (VmHWM, reset
to the current size just before it through /proc/self/clear_refs; Linux), the largest over
the ranks.

Figures: cp{N}_peak_mem_mb (N = 1, 2, 4), cp{N}_peak_mem_ratio (against 1; target for 4 <=
0.35), cp{N}_step_s (the slowest rank's step time; the ranks share this machine's cores).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
              num_kv_heads=2, max_position_embeddings=16384)


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())[1])


def _reset_peak_kb() -> int:
    """Reset this process's peak resident set (VmHWM) to its current size; return that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def _rank(rank: int, world: int, init_file: str, seq_len: int) -> dict:
    """One rank's step: {"peak_mb", "step_s"}."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from postrain.actors.learner.context_parallel import (
        all_reduce_gradients, context_parallel_groups, shard_loss, shard_sequence)
    from postrain.actors.models.llama import ModelConfig, build_model

    torch.set_num_threads(1)
    model = build_model(ModelConfig(**CONFIG)).init_weights(seed=3, std=0.2)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        ring, dp = context_parallel_groups(world)

    def step(length: int) -> float:
        ids = torch.randint(1, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(7))
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if world > 1:
            shard_loss(model, shard_sequence(ids, ring), ring).backward()
            all_reduce_gradients(model, ring, dp)
        else:
            logits = model(ids).float()
            F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        return time.perf_counter() - start

    step(256)            # warm-up: the kernels' code pages and the gradients' buffers are resident
    before = _reset_peak_kb()
    step_s = step(seq_len)
    peak_kb = _status_kb("VmHWM") - before
    if world > 1:
        dist.destroy_process_group()
    return {"peak_mb": peak_kb / 1024, "step_s": step_s}


def _measure(world: int, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        init = str(Path(folder) / "init")
        procs = [subprocess.Popen([sys.executable, "-m", "postrain.bench.long_cp", str(r), str(world), init,
                                   str(seq_len)], stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a context-parallel bench rank failed (world {world}): {outs}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "step_s": max(r["step_s"] for r in ranks)}


def context_parallel_rows(quick: bool) -> tuple[dict, dict]:
    """(results, config) of the cp figures."""
    seq_len = 2048 if quick else 8192
    results: dict = {}
    base = None
    for world in (1, 2, 4):
        measured = _measure(world, seq_len)
        base = base or measured["peak_mb"]
        results[f"cp{world}_peak_mem_mb"] = round(measured["peak_mb"], 1)
        results[f"cp{world}_step_s"] = round(measured["step_s"], 2)
        if world > 1:
            results[f"cp{world}_peak_mem_ratio"] = round(measured["peak_mb"] / base, 3)
    return results, {"cp_model": "llama 2 layers, hidden 64, 4/2 heads", "cp_seq_tokens": seq_len}


if __name__ == "__main__":
    print(json.dumps(_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
