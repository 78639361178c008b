"""Mixture-of-experts figures for `postrain bench learner` and `postrain bench generate`.

    results, peer = moe_learner_rows(quick)        # moe_train_speedup, routing mismatch with/without R3
    results = moe_generate_rows(quick)             # the expert path's share of the engine's step time

All on a random tiny Qwen3-MoE policy built here (MOE_POLICY: the built-in "tiny" shape, 8
experts of width 128, top-2, every layer MoE); nothing is downloaded.

- `moe_train_speedup`: seconds of one GRPO train step with the per-token reference expert path
  (`moe.naive_expert_mlp`: a Python loop over tokens and their k experts) over the same step with
  the grouped path (tokens sorted by expert, one batched matmul per projection), same learner,
  same batch, interleaved repeats. Peer: the reference's step seconds (`moe_train_step_s`).
- routing: an engine on float16 weight copies (`weight_precision="float16"`, the generator's
  opt-in) samples rollouts of the initial weights (router weights scaled to std 0.5: a peaked
  router, as trained ones are); a learner (float32, lr 1e-5) trains on them with routing replay
  on or off. `routing_mismatch_frac_fp16_engine`: the first step's share of recorded tokens whose
  learner top-k differs from the rollout's in some MoE layer (same weights: the rounding of the
  engine's weights alone flips them); `logprob_gap_fp16_engine_replay` / `_no_replay`: that
  step's mean |learner - generator| logprob of the sampled tokens. `*_stale_*`: the same after
  N steps on the same rollouts (stale by N - 1 versions), the gap from `compute_logprobs`.
- `moe_expert_time_share`: time in the MoE blocks (router + experts) over the engine's
  generate time at batch 32 (4 in quick mode), 64 new tokens (16).
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from postrain.core.record import Vector

MOE_POLICY: dict[str, Any] = dict(
    vocab_size=264, hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6,
    num_kv_heads=2, head_dim=32, max_position_embeddings=1024, qk_norm=True,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
    architecture="qwen3_moe")
ROUTER_SCALE = 25.0        # router weights x this after init (std 0.5): peaked routing, as in trained MoEs


def _timed_step(learner, batch, naive: bool) -> float:
    from postrain.actors.models.moe import SparseMoeBlock

    SparseMoeBlock.naive = naive
    try:
        start = time.perf_counter()
        learner.train_step(batch)
        return time.perf_counter() - start
    finally:
        SparseMoeBlock.naive = False


def moe_train_speedup(quick: bool) -> tuple[float, float, float]:
    """(speedup, grouped step s, reference step s), medians over interleaved repeats."""
    from postrain.actors.learner.learner import Learner
    from postrain.actors.records import TrainBatch

    learner = Learner({"model": MOE_POLICY, "lr": 1e-5, "micro_batch_size": 8})
    num, length, gen = 4 if quick else 8, 32, torch.Generator().manual_seed(0)
    vocab = MOE_POLICY["vocab_size"]
    batch = TrainBatch(token_ids=[torch.randint(vocab, (length,), generator=gen) for _ in range(num)],
                       loss_mask=[[0] * 4 + [1] * (length - 4)] * num,
                       behavior_logprobs=[torch.full((length,), -5.0) for _ in range(num)],
                       advantages=[1.0 if i % 2 else -1.0 for i in range(num)])
    _timed_step(learner, batch, naive=False)                                   # warm-up
    grouped, naive = [], []
    for _ in range(1 if quick else 2):
        grouped.append(_timed_step(learner, batch, naive=False))
        naive.append(_timed_step(learner, batch, naive=True))
    ours, peer = statistics.median(grouped), statistics.median(naive)
    return peer / ours, ours, peer


def _rollouts(learner, num_prompts: int, samples: int, new_tokens: int, weight_precision: str):
    """A TrainBatch sampled by an engine holding the learner's current weights, with routing records."""
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models import model_class
    from postrain.actors.models.config import ModelConfig
    from postrain.actors.records import TrainBatch
    from postrain.bench.prompts import chat_prompts

    model = model_class("qwen3_moe").empty(ModelConfig(**MOE_POLICY))
    model.load_state_dict(learner.model.state_dict())
    engine = Engine(model.eval(), learner.tokenizer, enable_prefix_caching=False,
                    weight_precision=weight_precision)
    params = SamplingParams(n=samples, temperature=1.0, seed=0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = engine.generate(chat_prompts(learner.tokenizer, num_prompts), params)
    ids: list[Vector] = []
    masks: list[Vector] = []
    logps: list[Vector] = []
    versions: list[Vector | int] = []
    routed: list[bytes | None] = []
    rewards: list[float] = []
    for out in outs:
        prompt = out.prompt_token_ids
        for s in out.outputs:
            ids.append(prompt + s.token_ids)
            masks.append([0] * len(prompt) + [1] * len(s.token_ids))
            logps.append([0.0] * len(prompt) + s.logprobs)
            versions.append([-1] * len(prompt) + s.policy_versions)
            routed.append(s.routed_experts)
            rewards.append(float(len(rewards) % 2))
    return TrainBatch(token_ids=ids, loss_mask=masks, behavior_logprobs=logps, policy_versions=versions,
                      rewards=rewards, group_ids=[i // samples for i in range(len(ids))],
                      routed_experts=routed)


def routing_figures(num_steps: int, quick: bool) -> dict[str, float]:
    """Routing mismatch and train-rollout logprob gaps with and without replay: at the rollout's
    own weights (engine on float16 weight copies, the learner on float32: the first step's
    metrics), and after `num_steps` steps on the same rollouts (stale by then)."""
    from postrain.actors.learner.learner import Learner
    from postrain.actors.models.moe import moe_blocks

    out = {}
    for replay in (True, False):
        suffix = "replay" if replay else "no_replay"
        learner = Learner({"model": MOE_POLICY, "lr": 1e-5, "routing_replay": replay, "seed": 1})
        with torch.no_grad():          # a peaked router, as trained ones are (init's would be near uniform)
            for block in moe_blocks(learner.model):
                block.gate.weight.mul_(ROUTER_SCALE)
        batch = _rollouts(learner, 2 if quick else 4, 4, 16 if quick else 32, "float16")
        first = learner.train_step(batch)
        out["routing_mismatch_frac_fp16_engine"] = round(first["routing_mismatch_frac"], 4)
        out[f"logprob_gap_fp16_engine_{suffix}"] = round(first["logprob_gap_mean"], 6)
        for _ in range(num_steps - 1):
            metrics = learner.train_step(batch)
        scored = learner.compute_logprobs(batch)
        gaps = torch.cat([(row - torch.tensor(lp))[torch.tensor(mask).bool()].abs()
                          for row, lp, mask in zip(scored, batch.behavior_logprobs, batch.loss_mask)])
        out[f"routing_mismatch_frac_stale_{suffix}"] = round(metrics["routing_mismatch_frac"], 4)
        out[f"logprob_gap_stale_{suffix}"] = round(float(gaps.mean()), 6)
    return out


def moe_learner_rows(quick: bool) -> tuple[dict, dict, dict]:
    """(results, peer, config) of the MoE rows of `postrain bench learner`."""
    speedup, ours_s, peer_s = moe_train_speedup(quick)
    num_steps = 2 if quick else 8
    results = {"moe_train_speedup": round(speedup, 2), "moe_train_step_s": round(ours_s, 3),
               **routing_figures(num_steps, quick)}
    config = {"moe_policy": "qwen3_moe, hidden 192, 4 layers, 8 experts x 128, top-2",
              "moe_routing_steps": num_steps}
    return results, {"moe_train_step_s": round(peer_s, 3)}, config


def moe_generate_rows(quick: bool) -> dict[str, float]:
    """The MoE blocks' share of the engine's generate time (router + grouped experts)."""
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models import model_class
    from postrain.actors.models.config import ModelConfig
    from postrain.actors.models.moe import SparseMoeBlock
    from postrain.actors.models.tokenizer import byte_tokenizer
    from postrain.bench.prompts import chat_prompts

    tokenizer = byte_tokenizer()
    model = model_class("qwen3_moe")(ModelConfig(**MOE_POLICY)).init_weights(0).eval()
    batch, new_tokens = (4, 16) if quick else (32, 64)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    spent = [0.0]
    original = SparseMoeBlock.forward

    def timed(self, x, weights=None):
        start = time.perf_counter()
        try:
            return original(self, x, weights)
        finally:
            spent[0] += time.perf_counter() - start

    Engine(model, tokenizer).generate(chat_prompts(tokenizer, 2), params)     # warm-up
    SparseMoeBlock.forward = timed  # type: ignore[method-assign]  # timed for this measurement only
    try:
        start = time.perf_counter()
        Engine(model, tokenizer, max_num_seqs=max(64, batch)).generate(chat_prompts(tokenizer, batch), params)
        total = time.perf_counter() - start
    finally:
        SparseMoeBlock.forward = original  # type: ignore[method-assign]  # the timing patch undone
    return {f"moe_expert_time_share_b{batch}": round(spent[0] / total, 3),
            f"tok_per_s_qwen3_moe_engine_b{batch}": round(batch * new_tokens / total, 1)}
