"""`postrain bench long`: long context, the engine reading a long prompt while others decode.

Model: the built-in "tiny" shape (random weights: 4 layers, hidden 192, 6 query / 2 KV heads)
with its context raised to 4,096 positions (`max_position_embeddings`), float32, block size
8. Prompt: 4,000 tokens (1,000 in quick mode), read while 4 sequences decode.

Figures (ours = chunked prefill, `prefill_chunk_tokens` = 256; peer = the same engine reading
the prompt in one step; medians over `repeats`):
- decode_step_p99_ms: the p99 step latency the decoding sequences see (every step decodes one
  token for each of them) over a window of steps that starts when the long prompt arrives and
  ends 8 steps after its first token; in one-step mode the step that reads the whole prompt
  is that p99;
- chunked_prefill_decode_p99_ratio (ours only): ours / peer decode_step_p99_ms (target <= 0.5);
- long_prompt_ttft_ms: the long prompt's time to first token (chunking trades some of it);
- decode_tok_per_s: the decoding sequences' tokens over the window's wall time;
- cp{N}_peak_mem_ratio_{L}k, cp{N}_step_s_{L}k (`postrain.bench.long_cp`): the learner's peak
  memory per rank with context_parallel N against 1, at 8k and 32k tokens;
- kv_* (`postrain.bench.long_kv`): each KV cache dtype's bytes per token, blocks in a fixed
  kv_cache_mb, logprob drift against the float32 model and decode tokens/s, on SmolLM2-135M;
- task_* (`postrain.bench.long_task`): SmolLM2's held-out accuracy on the long-context task, the
  repository in the prompt and explored with the shell tool, at about 4k and 7k tokens.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import numpy as np
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.llama import BUILTIN_CONFIGS, build_model

CHUNK = 256
NUM_DECODING = 4


def _window(model, prompt: list[int], chunk: int) -> dict:
    """Decode NUM_DECODING sequences, add the long prompt, step until 8 steps after its first
    token; the step latencies and the prompt's time to first token."""
    engine = Engine(model, kv_cache_mb=256, max_num_batched_tokens=len(prompt) + 64,
                    prefill_chunk_tokens=chunk)
    decode = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=10_000)
    for i in range(NUM_DECODING):
        engine.add_request([1 + i, 2 + i, 3 + i, 4 + i], decode)
    for _ in range(3):
        engine.step()
    long_id = engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=64))
    long_seq = engine.sequences_of(long_id)[0]
    latencies, after, arrived, ttft = [], 0, time.perf_counter(), None
    with torch.inference_mode():
        while after < 8:
            start = time.perf_counter()
            engine.step()
            latencies.append(time.perf_counter() - start)
            if long_seq.output.token_ids:
                ttft = ttft or time.perf_counter() - arrived
                after += 1
    wall = time.perf_counter() - arrived
    assert ttft is not None  # the loop ends 8 steps after the long prompt's first token
    return {"p99_ms": float(np.percentile(latencies, 99)) * 1e3, "ttft_ms": ttft * 1e3,
            "decode_tok_per_s": NUM_DECODING * len(latencies) / wall}


def chunked_prefill_rows(quick: bool) -> tuple[dict, dict, dict]:
    """(results, peer, config) of the chunked-prefill figures."""
    config = dataclasses.replace(BUILTIN_CONFIGS["tiny"], max_position_embeddings=4096)
    model = build_model(config).init_weights(seed=1, std=0.1).eval()
    prompt_len = 1000 if quick else 4000
    repeats = 1 if quick else 3
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, config.vocab_size, prompt_len)]
    ours, theirs = [], []
    for _ in range(repeats):            # alternate, so load from other processes falls on both
        ours.append(_window(model, prompt, CHUNK))
        theirs.append(_window(model, prompt, 0))

    def med(runs, key):
        return round(statistics.median(r[key] for r in runs), 1)

    results, peer = {}, {}
    for key, name in (("p99_ms", "decode_step_p99_ms"), ("ttft_ms", "long_prompt_ttft_ms"),
                      ("decode_tok_per_s", "decode_tok_per_s")):
        results[name], peer[name] = med(ours, key), med(theirs, key)
    results["chunked_prefill_decode_p99_ratio"] = round(results["decode_step_p99_ms"]
                                                        / peer["decode_step_p99_ms"], 3)
    return results, peer, {"model": "tiny, max_position_embeddings=4096", "prompt_tokens": prompt_len,
                           "prefill_chunk_tokens": CHUNK, "num_decoding": NUM_DECODING, "repeats": repeats}


def run(quick: bool) -> dict:
    if os.environ.get("POSTRAIN_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["POSTRAIN_TORCH_THREADS"]))
    load_before = round(os.getloadavg()[0], 1)
    results, peer, config = chunked_prefill_rows(quick)
    from postrain.bench.long_cp import context_parallel_rows
    cp_results, cp_config = context_parallel_rows(quick)
    results.update(cp_results)
    config.update(cp_config)
    from postrain.bench.long_kv import kv_dtype_rows
    from postrain.bench.long_task import long_task_rows
    for rows in (kv_dtype_rows, long_task_rows):
        more_results, more_config = rows(quick)
        results.update(more_results)
        config.update(more_config)
    config.update(torch_threads=torch.get_num_threads(),
                  load_avg_1m=[load_before, round(os.getloadavg()[0], 1)])
    return {"config": config, "results": results, "peer": peer}
