"""Context-parallel training's memory per rank (`postrain bench long`'s cp rows).

One SFT step of the learner (`postrain.actors.learner.Learner.sft_step`: the chunked LM head,
activation checkpointing per decoder layer, AdamW) on one sequence of 8,192 and one of 32,768
tokens (2,048 and 8,192 in quick mode), all but a 16-token prompt trained, for a small random
model (2 layers, hidden 64, 4 query / 2 KV heads): `context_parallel` 1 (one process, SDPA over
the whole sequence) against 2 and 4 (one ring of that many gloo ranks, ring attention;
actors/learner/context_parallel_step.py). Each rank is its own process with one torch thread;
after a 256-token warm-up step, its step memory is the growth of its peak resident set over
the step (VmHWM, reset to the current size just before it through /proc/self/clear_refs;
Linux), the largest over the ranks.

Figures, for each length L in thousands of tokens (8k, 32k): cp{N}_peak_mem_mb_{L}k
(N = 1, 2, 4), cp{N}_peak_mem_ratio_{L}k (against 1; target for 4 <= 0.35), cp{N}_step_s_{L}k
(the slowest rank's step time; the ranks share this machine's cores). cp4_peak_mem_ratio is
that of the longest length.
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
              num_kv_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)
PROMPT = 16


def _status_kb(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    assert match is not None, field  # Linux's /proc/self/status has every field read here
    return int(match[1])


def _reset_peak_kb() -> int:
    """Reset this process's peak resident set (VmHWM) to its current size; return that size."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def _rank(rank: int, world: int, init_file: str, seq_len: int) -> dict:
    """One rank's learner step: {"peak_mb", "step_s"}."""
    import torch
    import torch.distributed as dist

    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.records import SftBatch

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    learner = Learner(LearnerConfig(model=CONFIG, seed=3, lr=1e-3, micro_batch_size=1, context_parallel=world,
                                    activation_checkpointing=True))

    def step(length: int) -> float:
        ids = torch.randint(1, CONFIG["vocab_size"], (length,), generator=torch.Generator().manual_seed(7))
        batch = SftBatch(token_ids=[ids], loss_mask=[[0] * PROMPT + [1] * (length - PROMPT)])
        start = time.perf_counter()
        learner.sft_step(batch)        # every rank of the ring holds the whole (tiny) batch record
        return time.perf_counter() - start

    step(256)            # warm-up: the kernels' code pages and the optimizer's state are resident
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
        outs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a context-parallel bench rank failed (world {world}): {outs}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "step_s": max(r["step_s"] for r in ranks)}


def context_parallel_rows(quick: bool) -> tuple[dict, dict]:
    """(results, config) of the cp figures."""
    lengths = (2048, 8192) if quick else (8192, 32768)
    results: dict = {}
    for seq_len in lengths:
        tag = f"{seq_len // 1024}k"
        base = None
        for world in (1, 2, 4):
            measured = _measure(world, seq_len)
            base = base or measured["peak_mb"]
            results[f"cp{world}_peak_mem_mb_{tag}"] = round(measured["peak_mb"], 1)
            results[f"cp{world}_step_s_{tag}"] = round(measured["step_s"], 2)
            if world > 1:
                results[f"cp{world}_peak_mem_ratio_{tag}"] = round(measured["peak_mb"] / base, 3)
    results["cp4_peak_mem_ratio"] = results[f"cp4_peak_mem_ratio_{lengths[-1] // 1024}k"]
    return results, {"cp_model": "llama 2 layers, hidden 64, 4/2 heads; learner sft_step, activation "
                     "checkpointing, chunked LM head", "cp_seq_tokens": list(lengths)}


if __name__ == "__main__":
    print(json.dumps(_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
