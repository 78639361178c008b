"""`postrain bench exact`: what `exact = true` costs and what it buys, per architecture, in one run.

For each architecture (the built-in tiny Llama, and random Qwen3, Mistral, Gemma 3 and Qwen3-MoE
folders of the generate bench's shape, made by transformers; MoE with routing replay) the same learner weights are sampled by two
engines, one plain and one exact (16 prompts of 10-40 tokens, 4 samples each, 24 new tokens at
temperature 1, 8-token blocks), and each batch is scored by the learner of its kind. Figures:

- exact_logprob_max_abs_diff: the largest |recorded - recomputed| logprob over every sampled
  token of every architecture with `exact` (0 is the claim); plain_logprob_max_abs_diff the
  same without it (the train-inference mismatch exact removes);
- exact_engine_tok_per_s_ratio_<arch>: sampled tokens per second, exact over plain (prefill
  included, the median of `repeats` interleaved runs);
- exact_learner_step_ratio_<arch>: the seconds of one learner train step on those 64 samples,
  exact over plain (median of `repeats`);
- the raw tokens/s and step seconds behind each ratio.

Run alone: `python -m postrain.bench.exact [--quick]` (quick: the tiny model only, 1 repeat).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.records import TrainBatch

from .architectures import BENCH_SHAPE, build_hf_folder

FOLDER_ARCHITECTURES = ("qwen3", "mistral", "gemma3_text", "qwen3_moe")
SAMPLING = SamplingParams(n=4, temperature=1.0, seed=11, max_new_tokens=24, ignore_eos=True)


def prompts(count: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 250, (10 + (i * 7) % 31,), generator=g).tolist() for i in range(count)]


def sample(engine: Engine) -> tuple[TrainBatch, float]:
    """(the engine's 64 samples as a train batch, sampled tokens per second)."""
    start = time.perf_counter()
    outs = engine.generate(prompts(), SAMPLING)
    elapsed = time.perf_counter() - start
    fields: dict[str, Any] = {"token_ids": [], "loss_mask": [], "behavior_logprobs": [], "policy_versions": [],
                               "rewards": [], "group_ids": [], "routed_experts": []}
    for group, (prompt, out) in enumerate(zip(prompts(), outs)):
        for i, s in enumerate(out.outputs):
            fields["token_ids"].append(prompt + s.token_ids)
            fields["loss_mask"].append([0] * len(prompt) + [1] * len(s.token_ids))
            fields["behavior_logprobs"].append([0.0] * len(prompt) + s.logprobs)
            fields["policy_versions"].append([0] * (len(prompt) + len(s.token_ids)))
            fields["rewards"].append(float(i % 2))
            fields["group_ids"].append(group)
            fields["routed_experts"].append(s.routed_experts)     # MoE: replayed by the learner
    if fields["routed_experts"][0] is None:
        del fields["routed_experts"]
    tokens = sum(sum(mask) for mask in fields["loss_mask"])
    return TrainBatch(**fields), tokens / elapsed


def max_gap(learner: Learner, batch: TrainBatch) -> float:
    gaps = [float((mine[torch.tensor(m, dtype=torch.bool)].double()
                   - torch.tensor(theirs, dtype=torch.float64)[torch.tensor(m, dtype=torch.bool)]).abs().max())
            for mine, theirs, m in zip(learner.compute_logprobs(batch), batch.behavior_logprobs, batch.loss_mask)]
    return max(gaps)


def step_seconds(learner: Learner, batch: TrainBatch) -> float:
    """One train step's seconds, the weights put back after (every repeat steps the same weights)."""
    saved = {k: v.clone() for k, v in learner.model.state_dict().items()}
    start = time.perf_counter()
    learner.train_step(batch)
    elapsed = time.perf_counter() - start
    learner.model.load_state_dict(saved)
    return elapsed


def measure(spec: str, repeats: int) -> dict[str, float]:
    """Both kinds on one architecture: {"<kind>_gap", "<kind>_tok_per_s", "<kind>_step_s"}."""
    out: dict[str, float] = {}
    moe = spec.endswith("moe")
    learners = {kind: Learner(LearnerConfig(model=spec, exact=kind == "exact", micro_batch_size=16, lr=1e-4,
                                            routing_replay=moe))
                for kind in ("plain", "exact")}
    weights = learners["plain"].model.state_dict()
    learners["exact"].model.load_state_dict(weights)
    engines = {}
    for kind, learner in learners.items():
        model = type(learner.model).empty(learner.model.config)
        model.load_state_dict(weights)
        engines[kind] = Engine(model, learner.tokenizer, kv_cache_mb=64, max_num_seqs=64, exact=kind == "exact")
    speeds: dict[str, list[float]] = {kind: [] for kind in learners}
    steps: dict[str, list[float]] = {kind: [] for kind in learners}
    batches = {kind: sample(engine)[0] for kind, engine in engines.items()}      # a warm-up of each
    for _ in range(repeats):
        for kind in learners:                                    # interleaved: the same load on both
            batches[kind], tok_per_s = sample(engines[kind])
            speeds[kind].append(tok_per_s)
            steps[kind].append(step_seconds(learners[kind], batches[kind]))
    for kind, learner in learners.items():
        out[f"{kind}_gap"] = max_gap(learner, batches[kind])
        out[f"{kind}_tok_per_s"] = statistics.median(speeds[kind])
        out[f"{kind}_step_s"] = statistics.median(steps[kind])
    return out


def run(quick: bool = False) -> dict:
    repeats = 1 if quick else 3
    results: dict[str, float] = {}
    peer: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        specs = {"tiny": "tiny"}
        if not quick:
            for arch in FOLDER_ARCHITECTURES:
                specs[arch] = str(build_hf_folder(arch, Path(tmp) / arch, shape=BENCH_SHAPE, window=16, seed=1,
                                                  std=0.2))
        gaps = {"exact": 0.0, "plain": 0.0}
        for name, spec in specs.items():
            figures = measure(spec, repeats)
            for kind in gaps:
                gaps[kind] = max(gaps[kind], figures[f"{kind}_gap"])
            results[f"engine_tok_per_s_{name}"] = round(figures["exact_tok_per_s"], 1)
            peer[f"engine_tok_per_s_{name}"] = round(figures["plain_tok_per_s"], 1)
            results[f"learner_step_s_{name}"] = round(figures["exact_step_s"], 3)
            peer[f"learner_step_s_{name}"] = round(figures["plain_step_s"], 3)
            results[f"exact_engine_tok_per_s_ratio_{name}"] = round(
                figures["exact_tok_per_s"] / figures["plain_tok_per_s"], 3)
            results[f"exact_learner_step_ratio_{name}"] = round(figures["exact_step_s"] / figures["plain_step_s"], 3)
    results["exact_logprob_max_abs_diff"] = gaps["exact"]
    results["plain_logprob_max_abs_diff"] = gaps["plain"]
    return {"config": {"architectures": list(specs), "prompts": 16, "samples_per_prompt": SAMPLING.n,
                       "max_new_tokens": SAMPLING.max_new_tokens, "repeats": repeats,
                       "threads": torch.get_num_threads()},
            "results": results, "peer": peer}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))
