"""The optimizer step's loop: micro-batches, the policy loss, gradient accumulation, one AdamW step.

    metrics = train_step(learner, batch)    # Learner.train_step calls it (learner.py)
    metrics = sft_step(learner, batch)

Design note. Every micro-batch's loss is divided by the WHOLE batch's token (or sequence)
count over all ranks, so the summed micro-batch gradients equal the full-batch gradient, and
a SUM over ranks (the data-parallel all-reduce, or FSDP's reduce-scatter with divide factor
1: actors/learner/fsdp.py) gives the gradient one process would get on the whole batch.
`finish_step` reduces the gradients and metric sums, clips, steps AdamW and advances the
counters: exactly one optimizer step per call (the learner's invariant).
"""
from __future__ import annotations

import time

import torch

from postrain.ext import rl_ops

from ..records import SftBatch, TrainBatch
from . import fsdp
from .batch import LearnerError, pack_batch
from .routing import logprob_gap

# Metrics averaged over trained tokens (weighted by each micro-batch's num_tokens).
_TOKEN_MEAN_METRICS = ("pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "clip_frac_dual",
                       "ratio_mean", "behavior_weight_mean", "masked_token_frac", "masked_seq_frac")


def train_step(learner, batch: TrainBatch) -> dict[str, float]:
    """One policy-gradient optimizer step on a rollout batch; returns its metrics (floats)."""
    start = time.perf_counter()
    cfg = learner.config
    adv_metrics, advantages = learner.batch_advantages(batch)
    packed = learner.routing.pack(batch, pack_batch(batch, advantages=advantages))
    _, micro = learner._micro_batches(packed)
    tokens, seqs = learner._global_counts(packed)
    decoupled = cfg.objective == "decoupled"
    if not learner.reference_frozen:
        learner.freeze_reference()
    ref = learner._recompute(micro, learner.reference) if learner.reference is not None else None
    loss_cfg = cfg.loss_config(kl_coef=learner.kl.coef)
    sums = torch.zeros(len(_TOKEN_MEAN_METRICS) + 5, dtype=torch.float64)
    gap_max = torch.zeros((), dtype=torch.float64)
    learner.optimizer.zero_grad(set_to_none=True)
    for i, mb in enumerate(micro):
        logp, entropy = learner._logprobs(learner.model, mb)
        behavior = mb.behavior_logp
        old = logp.detach() if decoupled else behavior
        loss, m = rl_ops.policy_loss(
            logp, old, mb.advantages, mb.loss_mask, loss_cfg,
            behavior_logp=behavior if decoupled else None,
            ref_logp=None if ref is None else ref[i], entropy=entropy,
            global_num_tokens=tokens, global_num_seqs=seqs, backend=cfg.rl_ops_backend)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * rl_ops.aggregate_loss(
                entropy, mb.loss_mask, cfg.agg_mode, loss_norm_constant=cfg.loss_norm_constant,
                global_num_tokens=tokens, global_num_seqs=seqs)
        loss = loss + learner.routing.aux_loss(mb, float(mb.attention_mask.sum()) / float(packed.num_real_tokens))
        loss.backward()
        learner.routing.account(logp.detach(), mb, learner.policy_version,
                             lambda: learner._logprobs(learner.model, mb, replay=not cfg.routing_replay)[0])
        gap_sum, gap_count, mb_gap_max = logprob_gap(logp.detach(), mb, learner.policy_version)
        sums += torch.tensor([m[k] * m["num_tokens"] for k in _TOKEN_MEAN_METRICS]
                             + [float(loss.detach()), m["num_tokens"], gap_sum, gap_count,
                                float(mb.attention_mask.sum())], dtype=torch.float64)
        gap_max = torch.maximum(gap_max, torch.tensor(mb_gap_max, dtype=torch.float64))
    metrics = finish_step(learner, sums, gap_max, start, rl=True)
    metrics.update(adv_metrics)
    metrics.update(learner._staleness(packed))
    metrics.update(learner.routing.step_metrics())
    learner.kl.update(metrics["kl"], 1)
    return metrics

def sft_step(learner, batch: SftBatch) -> dict[str, float]:
    """One supervised step: token-mean cross-entropy on the loss_mask tokens (SFT warm start)."""
    start = time.perf_counter()
    if not isinstance(batch, SftBatch):
        raise LearnerError(f"an sft step takes an SftBatch (postrain.actors.records), got {type(batch).__name__}")
    packed = pack_batch(batch)
    _, micro = learner._micro_batches(packed)
    tokens, _ = learner._global_counts(packed)
    sums = torch.zeros(len(_TOKEN_MEAN_METRICS) + 5, dtype=torch.float64)
    learner.optimizer.zero_grad(set_to_none=True)
    ent_idx = _TOKEN_MEAN_METRICS.index("entropy")
    for mb in micro:
        logp, entropy = learner._logprobs(learner.model, mb)
        mask = mb.loss_mask.to(logp.dtype)
        loss = -(logp * mask).sum() / tokens
        loss.backward()
        sums[ent_idx] += float((entropy.detach() * mask).sum())
        sums[-5:] += torch.tensor([float(loss.detach()), float(mask.sum()), 0.0, 0.0,
                                   float(mb.attention_mask.sum())], dtype=torch.float64)
    metrics = finish_step(learner, sums, torch.zeros((), dtype=torch.float64), start, rl=False)
    keep = ("loss", "entropy", "grad_norm", "lr", "num_tokens", "num_real_tokens", "tokens_per_s",
            "step_time_s", "step", "policy_version")
    return {k: metrics[k] for k in keep}


def finish_step(learner, sums: torch.Tensor, gap_max: torch.Tensor, start: float,
                 rl: bool) -> dict[str, float]:
    """All-reduce gradients and metric sums, clip, step AdamW, advance the counters."""
    reduce_start = time.perf_counter()
    learner._all_reduce_grads()
    grad_all_reduce_s = time.perf_counter() - reduce_start
    learner._all_reduce(sums)
    learner._all_reduce(gap_max, op=torch.distributed.ReduceOp.MAX if learner.world_size > 1 else None)
    learner.grad_bytes = sum(fsdp.local_bytes(p.grad) for p in learner.params)   # this rank's (fsdp: a shard)
    if learner.sharded and not learner.lora.active:   # DTensor gradients: the norm over every rank's shard
        grad_norm = fsdp.grad_norm(learner.params, learner.config.max_grad_norm)
    elif learner.config.max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(learner.params, learner.config.max_grad_norm))
    else:
        grad_norm = rl_ops.global_grad_norm(learner.params)
    lr = learner.config.rl_lr if rl and learner.config.rl_lr is not None else learner.lr_at(learner.step)
    for group in learner.optimizer.param_groups:
        group["lr"] = lr
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.step += 1
    learner.policy_version += 1
    elapsed = time.perf_counter() - start
    n = max(float(sums[-4]), 1.0)
    metrics = {k: float(sums[i]) / n for i, k in enumerate(_TOKEN_MEAN_METRICS)}
    loss, num_tokens, gap_sum, gap_count, real = (float(x) for x in sums[-5:])
    metrics.update({
        "loss": loss, "grad_norm": grad_norm, "lr": lr, "num_tokens": num_tokens,
        "num_real_tokens": real, "logprob_gap_mean": gap_sum / gap_count if gap_count else 0.0,
        "logprob_gap_max": float(gap_max), "logprob_gap_tokens": gap_count,
        "tokens_per_s": real / elapsed, "step_time_s": elapsed, "step": float(learner.step),
        "policy_version": float(learner.policy_version), "kl_coef": float(learner.kl.coef)})
    if learner.world_size > 1:
        metrics["grad_all_reduce_s"] = grad_all_reduce_s   # the wait for the slowest rank included
    return metrics
