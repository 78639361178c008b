"""Sharded-learner figures for `postrain bench learner` (actors/learner/fsdp.py).

    results, peer, config = fsdp_learner_rows(quick)

- `fsdp_state_bytes_per_rank_ratio`: the bytes of parameters + gradients + AdamW state a rank
  holds with 4 FSDP ranks over what one process holds (the largest rank's), measured on the
  tensors after a train step (`Learner.held_bytes`; gradients just before they are freed);
  target <= 0.30 (1/4 plus the rounding of uneven shards).
- `fsdp2_step_s`, `fsdp4_step_s`: wall seconds of one train step (median after a warm-up)
  with 2 and 4 FSDP ranks; peer: the same with "ddp" at the same rank count, and
  `fsdp2_step_time_ratio` / `fsdp4_step_time_ratio` (FSDP over DDP). Every rank is a real
  process over gloo with one torch thread; on a 2-core machine 4 ranks share 2 cores, so the
  figure says what sharding costs in communication and gathers, not a speedup.
- `fsdp_publish_peak_extra_bytes_rank0` / `_other`: with 2 FSDP ranks, how far a rank's peak
  resident memory (VmHWM, reset through /proc/self/clear_refs after a malloc_trim) rose above
  its resident memory before gathering the whole weights for a publish (`learner.state_dict()`,
  fsdp.full_weights): rank 0 keeps the whole weights on the host (the sync message), the other
  rank drops each gathered tensor at once; `fsdp_publish_peak_extra_other_over_largest_tensor`
  is the other rank's figure over the largest single tensor (the bound: one gathered tensor).
- `fsdp_export_peak_extra_bytes_rank0` / `_other`: the same rise while the 2 FSDP ranks write a
  Hugging Face folder (`export_hf`, streamed one decoder layer at a time); rank 0 over the
  largest unit (one layer, or the embeddings and the rest) is
  `fsdp_export_peak_extra_rank0_over_largest_unit` (the bound: about 1). Peer: DDP's rank 0,
  which writes the whole weights at once.
Model: the built-in "tiny" (4 layers, hidden 192) in --quick, else a 6-layer, hidden-384
llama (random weights); batch: 16 samples of 64 tokens, micro-batches of 4.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6,
             num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def _rank_main(rank: int, world: int, init_file: str, strategy: str, out: str, steps: int, quick: bool) -> None:
    """One rank: a learner over the group, `steps` timed train steps on its shard of one batch."""
    import torch
    import torch.distributed as dist

    from postrain.actors.learner.group import shard_batch
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.records import TrainBatch

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    model = "tiny" if quick else MODEL
    learner = Learner(LearnerConfig(model=model, strategy=strategy, micro_batch_size=4, lr=1e-5))
    vocab = learner.model.config.vocab_size
    batch = shard_batch(_batch(16, 64, vocab), world)[rank]
    assert isinstance(batch, TrainBatch)  # shard_batch keeps the record's type
    times = []
    for _ in range(steps + 1):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        learner.train_step(batch)
        times.append(time.perf_counter() - start)
    held = learner.held_bytes()
    held["grads"] = learner.grad_bytes
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    held.update(_publish_peak_extra(learner, Path(out).with_suffix(".hf")))
    Path(out).write_text(json.dumps({"step_s": statistics.median(times[1:]), **held}))
    if world > 1:
        dist.destroy_process_group()


def _rss_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def _peak_extra_bytes(run) -> int | None:
    """Bytes this process's peak resident memory rose by while `run()` ran, above its resident
    memory before (freed heap returned to the OS first). Linux only: None elsewhere."""
    import ctypes
    import gc

    try:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)       # freed heap back to the OS: growth is real
        before = _rss_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    except OSError:
        return None
    run()
    return (_rss_kb("VmHWM") - before) * 1024


def _publish_peak_extra(learner, export_folder: Path) -> dict:
    """How far the rank's peak resident memory rose while it gathered the whole weights for a
    publish (`learner.state_dict()`, a collective every rank runs) and while it took part in a
    streamed Hugging Face export (`learner.export_hf`), and the sizes to judge them by: the whole
    weights, their largest tensor and their largest unit (a decoder layer, or the embeddings and
    the rest; global shapes). Linux only: {} elsewhere."""
    from postrain.actors.learner.streamed_export import units

    tied = learner.model.config.tie_word_embeddings
    sizes = {k: v.numel() * v.element_size() for k, v in learner.model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    publish = _peak_extra_bytes(lambda: learner.state_dict())
    if publish is None:
        return {}
    export = _peak_extra_bytes(lambda: learner.export_hf(export_folder))
    return {"publish_peak_extra_bytes": publish, "export_peak_extra_bytes": export,
            "weights_bytes": sum(sizes.values()), "largest_tensor_bytes": max(sizes.values()),
            "largest_unit_bytes": max(sum(sizes[n] for n in unit) for unit in units(list(sizes)))}


def _batch(num: int, length: int, vocab: int):
    """`num` random samples of `length` tokens, the last 7/8 trained (bench/learner.py's rollout_batch)."""
    import torch

    from postrain.actors.records import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompt = length // 8
    return TrainBatch(token_ids=[torch.randint(vocab, (length,), generator=g) for _ in range(num)],
                      loss_mask=[[0] * prompt + [1] * (length - prompt)] * num,
                      behavior_logprobs=[torch.full((length,), -8.0) for _ in range(num)],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(num)])


def _group(world: int, strategy: str, steps: int, quick: bool, folder: Path) -> list[dict]:
    """Run `world` ranks; each rank's report."""
    tag = f"{strategy}{world}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}   # freed buffers leave
    procs = [subprocess.Popen([sys.executable, "-m", "postrain.bench.fsdp", str(r), str(world),
                               str(folder / f"{tag}.init"), strategy, str(folder / f"{tag}.{r}.json"),
                               str(steps), "1" if quick else "0"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errors = [p.communicate(timeout=1200)[1] for p in procs]
    for rank, (p, err) in enumerate(zip(procs, errors)):
        if p.returncode != 0:
            raise RuntimeError(f"bench fsdp: {tag} rank {rank} failed: {err[-2000:]}")
    return [json.loads((folder / f"{tag}.{r}.json").read_text()) for r in range(world)]


def fsdp_learner_rows(quick: bool) -> tuple[dict, dict, dict]:
    steps = 2 if quick else 3
    results, peer = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        one = _group(1, "fsdp", steps, quick, folder)[0]
        runs = {(s, w): _group(w, s, steps, quick, folder) for w in (2, 4) for s in ("fsdp", "ddp")}
    four = runs[("fsdp", 4)]
    results["fsdp_state_bytes_per_rank_ratio"] = round(max(r["total"] for r in four) / one["total"], 4)
    peer["fsdp_state_bytes_per_rank_ratio"] = round(max(r["total"] for r in runs[("ddp", 4)]) / one["total"], 4)
    for world in (2, 4):
        fsdp_s = max(r["step_s"] for r in runs[("fsdp", world)])
        ddp_s = max(r["step_s"] for r in runs[("ddp", world)])
        results[f"fsdp{world}_step_s"], peer[f"fsdp{world}_step_s"] = round(fsdp_s, 4), round(ddp_s, 4)
        results[f"fsdp{world}_step_time_ratio"] = round(fsdp_s / ddp_s, 3)
    two = runs[("fsdp", 2)]
    if "publish_peak_extra_bytes" in two[0]:
        other = max(r["publish_peak_extra_bytes"] for r in two[1:])
        results["fsdp_publish_peak_extra_bytes_rank0"] = two[0]["publish_peak_extra_bytes"]
        results["fsdp_publish_peak_extra_bytes_other"] = other
        results["fsdp_publish_peak_extra_other_over_largest_tensor"] = round(other / two[0]["largest_tensor_bytes"], 3)
        peer["fsdp_publish_peak_extra_bytes_rank0"] = runs[("ddp", 2)][0]["publish_peak_extra_bytes"]
        peer["fsdp_publish_peak_extra_bytes_other"] = max(r["publish_peak_extra_bytes"] for r in runs[("ddp", 2)][1:])
        results["fsdp_export_peak_extra_bytes_rank0"] = two[0]["export_peak_extra_bytes"]
        results["fsdp_export_peak_extra_rank0_over_largest_unit"] = round(
            two[0]["export_peak_extra_bytes"] / two[0]["largest_unit_bytes"], 3)
        results["fsdp_export_peak_extra_bytes_other"] = max(r["export_peak_extra_bytes"] for r in two[1:])
        peer["fsdp_export_peak_extra_bytes_rank0"] = runs[("ddp", 2)][0]["export_peak_extra_bytes"]
    config = {"fsdp_model": "tiny" if quick else "llama 6 x 384, vocab 4096", "fsdp_batch": "16 x 64 tokens",
              "fsdp_state_bytes_one_rank": one["total"],
              "fsdp_state_bytes_four_ranks": [r["total"] for r in four], "fsdp_steps": steps,
              "fsdp_publish_weights_bytes": one.get("weights_bytes"),
              "fsdp_publish_largest_tensor_bytes": one.get("largest_tensor_bytes"),
              "fsdp_export_largest_unit_bytes": one.get("largest_unit_bytes")}
    return results, peer, config


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]),
               sys.argv[7] == "1")
