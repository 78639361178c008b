"""StepLoop: one optimizer step per call, on a rollout batch (RL) or a demonstration batch (SFT).

    loop = StepLoop(config, model, forward, comm, counter, optim, reference, kl, routing, lora, distill)
    metrics = loop.train(batch)       # a TrainBatch: the policy loss (+ distillation), one AdamW step
    metrics = loop.sft(batch)         # an SftBatch: cross-entropy on the loss_mask tokens

Design note. Every micro-batch's loss is divided by the WHOLE batch's token (or sequence)
count over all ranks, so the summed micro-batch gradients equal the full-batch gradient, and
a SUM over ranks (the data-parallel all-reduce, or FSDP's reduce-scatter with divide factor
1: fsdp.py) gives the gradient one process would get on the whole batch. `_finish` sums the
gradients and metric sums, clips, steps AdamW and advances the counter: exactly one
optimizer step per call (the learner's invariant). The loop holds no state of its own
between calls: its parts (the forward, the collectives, the counter, the optimizer, the
reference) are handed to it by the Learner that owns them.

Distillation (distill.py) follows the same rule: the per-token KL is reduced by `agg_mode`
over the whole batch's counts and added, times its weight, to the micro-batch's loss; its
metric `distill_kl` is a token mean over every rank's trained tokens. With loss "opd" the
policy-gradient term gets zero advantages (the loss is the KL, plus a reference KL if set),
and a batch needs no rewards.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from postrain.ext import rl_ops

from ..records import SftBatch, TrainBatch
from .batch import LearnerError, group_sizes_of, pack_batch, reward_components_of
from .collectives import Collectives
from .config import LearnerConfig
from .counter import StepCounter
from .distill import LearnerDistill
from .lora import LearnerLora
from .optimizer import PolicyOptimizer
from .packed import PackedBatch
from .policy_forward import PolicyForward
from .reference import KLReference
from .routing import LearnerRouting, logprob_gap
from .task_kl import TaskKL

if TYPE_CHECKING:
    from ..models.llama import LlamaModel

# Metrics averaged over trained tokens (weighted by each micro-batch's num_tokens).
_TOKEN_MEAN_METRICS = ("pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "clip_frac_dual",
                       "ratio_mean", "behavior_weight_mean", "masked_token_frac", "masked_seq_frac", "distill_kl")
_SFT_METRICS = ("loss", "entropy", "grad_norm", "lr", "num_tokens", "num_real_tokens", "tokens_per_s",
                "step_time_s", "step", "policy_version")


def batch_advantages(config: LearnerConfig, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor | None]:
    """(reward metrics, per-sample advantages (B,)) from a batch's rewards over its groups;
    ({}, None) when the batch carries its advantages. Data parallel: the group's rank 0 calls
    it on the whole batch before cutting it into shards (group.py)."""
    if not isinstance(batch, TrainBatch):
        raise LearnerError(f"a train step takes a TrainBatch (postrain.actors.records), got "
                           f"{type(batch).__name__}; build one, e.g. TrainBatch(token_ids=..., ...)")
    if batch.advantages is not None:
        return {}, None
    num = batch.num_samples
    if config.loss == "opd" and batch.rewards is None and batch.reward_components is None:
        return {}, torch.zeros(num)    # distillation alone: no policy-gradient term to weigh
    components = reward_components_of(batch, num)
    sizes = group_sizes_of(batch.group_ids, num) if batch.group_ids is not None else [num]  # ragged: failures
    res = rl_ops.compute_advantages(components, config.reward_weights, sizes, mode=config.advantage_mode)
    rewards = res.rewards
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "num_zero_variance_groups": float(res.num_zero_variance_groups)}, res.advantages


class StepLoop:
    """The train and SFT steps over the learner's parts (module docstring)."""

    def __init__(self, config: LearnerConfig, model: LlamaModel, forward: PolicyForward, comm: Collectives,
                 counter: StepCounter, optim: PolicyOptimizer, reference: KLReference,
                 kl: rl_ops.FixedKLController | rl_ops.AdaptiveKLController, routing: LearnerRouting,
                 lora: LearnerLora, distill: LearnerDistill, task_kl: TaskKL):
        self.config = config
        self.model = model
        self.forward = forward
        self.comm = comm
        self.counter = counter
        self.optim = optim
        self.reference = reference
        self.kl = kl
        self.routing = routing
        self.lora = lora
        self.distill = distill
        self.task_kl = task_kl

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One policy-gradient optimizer step on a rollout batch; returns its metrics (floats)."""
        start = time.perf_counter()
        cfg, forward = self.config, self.forward
        adv_metrics, advantages = batch_advantages(cfg, batch)
        distill = self.distill
        distill.check_batch(batch)
        packed = self.routing.pack(batch, pack_batch(batch, advantages=advantages))
        order, micro = forward.micro_batches(packed)
        if batch.kl_targets is not None and cfg.context_parallel > 1:
            raise LearnerError("KL targets per task do not run on context-parallel rings; set context_parallel = 1 "
                               "or leave the tasks' kl_target unset")
        task_kl = self.task_kl.start(batch, self.kl.coef, self.reference.model is not None)
        tokens, seqs = self._global_counts(packed)
        decoupled = cfg.objective == "decoupled"
        if not self.reference.frozen:
            self.reference.freeze_from(self.lora.merged(self.model.state_dict()))
        ref = forward.recompute(micro, self.reference.model) if self.reference.model is not None else None
        # with KL targets per task each sample's coefficient weighs the KL term below, not this one
        loss_cfg = cfg.loss_config(kl_coef=0.0 if task_kl is not None else self.kl.coef)
        first = 0   # the micro-batch's first sample in `order`
        sums = torch.zeros(len(_TOKEN_MEAN_METRICS) + 5, dtype=torch.float64)
        gap_max = torch.zeros((), dtype=torch.float64)
        version = self.counter.policy_version
        self.optim.zero_grad()
        for i, mb in enumerate(micro):
            distill_tok = None
            if distill.active:
                logp, entropy, distill_tok = forward.distill_logprobs(self.model, mb, distill.teacher)
            else:
                logp, entropy = forward.logprobs(self.model, mb)
            behavior = mb.behavior_logp
            old = logp.detach() if decoupled else behavior
            loss, m = rl_ops.policy_loss(
                logp, old, torch.zeros_like(mb.advantages) if cfg.loss == "opd" else mb.advantages,
                mb.loss_mask, loss_cfg, behavior_logp=behavior if decoupled else None,
                ref_logp=None if ref is None else ref[i], entropy=entropy,
                global_num_tokens=tokens, global_num_seqs=seqs, backend=cfg.rl_ops_backend)
            m["distill_kl"] = 0.0
            if distill_tok is not None:
                loss = loss + distill.weight * rl_ops.aggregate_loss(
                    distill_tok, mb.loss_mask, cfg.agg_mode, loss_norm_constant=cfg.loss_norm_constant,
                    global_num_tokens=tokens, global_num_seqs=seqs)
                m["distill_kl"] = float((distill_tok.detach() * mb.loss_mask).sum()) / max(m["num_tokens"], 1.0)
            if task_kl is not None:   # each sample's task's coefficient (task_kl.py)
                assert ref is not None, "TaskKL.start refuses a learner without a reference"
                rows = order[first:first + mb.num_samples]
                coefs, tasks = task_kl[0][rows].to(logp.device), task_kl[1][rows]
                kl_tok = rl_ops.kl_estimate(logp, ref[i].to(logp.dtype), loss_cfg.kl_kind) * mb.loss_mask
                loss = loss + rl_ops.aggregate_loss(
                    kl_tok * coefs[:, None], mb.loss_mask, cfg.agg_mode, loss_norm_constant=cfg.loss_norm_constant,
                    global_num_tokens=tokens, global_num_seqs=seqs)
                self.task_kl.measure(kl_tok, mb.loss_mask, tasks)
            first += mb.num_samples
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * rl_ops.aggregate_loss(
                    entropy, mb.loss_mask, cfg.agg_mode, loss_norm_constant=cfg.loss_norm_constant,
                    global_num_tokens=tokens, global_num_seqs=seqs)
            loss = loss + self.routing.aux_loss(mb, float(mb.attention_mask.sum()) / float(packed.num_real_tokens))
            loss.backward()
            distill.release()
            self.routing.account(logp.detach(), mb, version,
                                 lambda: forward.logprobs(self.model, mb, replay=not cfg.routing_replay)[0])
            gap_sum, gap_count, mb_gap_max = logprob_gap(logp.detach(), mb, version)
            sums += torch.tensor([m[k] * m["num_tokens"] for k in _TOKEN_MEAN_METRICS]
                                 + [float(loss.detach()), m["num_tokens"], gap_sum, gap_count,
                                    float(mb.attention_mask.sum())], dtype=torch.float64)
            gap_max = torch.maximum(gap_max, torch.tensor(mb_gap_max, dtype=torch.float64))
        metrics = self._finish(sums, gap_max, start, rl=True)
        if not distill.active:
            del metrics["distill_kl"]
        metrics.update(adv_metrics)
        metrics.update(self._staleness(packed))
        metrics.update(self.routing.step_metrics())
        metrics.update(self.task_kl.finish(self.comm))
        self.kl.update(metrics["kl"], 1)
        return metrics

    def sft(self, batch: SftBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the loss_mask tokens (SFT warm start)."""
        start = time.perf_counter()
        if not isinstance(batch, SftBatch):
            raise LearnerError(f"an sft step takes an SftBatch (postrain.actors.records), got {type(batch).__name__}")
        packed = pack_batch(batch)
        _, micro = self.forward.micro_batches(packed)
        tokens, _ = self._global_counts(packed)
        sums = torch.zeros(len(_TOKEN_MEAN_METRICS) + 5, dtype=torch.float64)
        self.optim.zero_grad()
        ent_idx = _TOKEN_MEAN_METRICS.index("entropy")
        for mb in micro:
            logp, entropy = self.forward.logprobs(self.model, mb)
            mask = mb.loss_mask.to(logp.dtype)
            loss = -(logp * mask).sum() / tokens
            loss.backward()
            sums[ent_idx] += float((entropy.detach() * mask).sum())
            sums[-5:] += torch.tensor([float(loss.detach()), float(mask.sum()), 0.0, 0.0,
                                       float(mb.attention_mask.sum())], dtype=torch.float64)
        metrics = self._finish(sums, torch.zeros((), dtype=torch.float64), start, rl=False)
        return {k: metrics[k] for k in _SFT_METRICS}

    def _global_counts(self, packed: PackedBatch) -> tuple[float, float]:
        """Trained tokens and non-empty sequences over the whole batch (all ranks)."""
        counts = torch.tensor([float(packed.loss_mask.sum()), float((packed.loss_mask.sum(-1) > 0).sum())],
                              dtype=torch.float64)
        self.comm.all_reduce(counts)
        if counts[0] == 0:
            raise LearnerError("the batch has no trained tokens (loss_mask is 0 everywhere); mark the "
                               "response tokens with 1")
        return float(counts[0]), float(counts[1])

    def _staleness(self, packed: PackedBatch) -> dict[str, float]:
        known = packed.loss_mask & (packed.policy_versions >= 0)
        if not bool(known.any()):
            return {}
        lag = (self.counter.policy_version - 1 - packed.policy_versions[known]).float()   # the version before
        return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}

    def _finish(self, sums: torch.Tensor, gap_max: torch.Tensor, start: float, rl: bool) -> dict[str, float]:
        """Sum gradients and metric sums over the ranks, clip, step AdamW, advance the counter."""
        reduce_start = time.perf_counter()
        if not self.optim.grads_sharded:   # FSDP has reduce-scattered them already (a SUM)
            self.comm.sum_gradients(self.optim.params)
        grad_all_reduce_s = time.perf_counter() - reduce_start
        self.comm.all_reduce(sums)
        self.comm.all_reduce_max(gap_max)
        grad_norm, lr = self.optim.apply(self.counter.step, rl)
        self.counter.advance()
        elapsed = time.perf_counter() - start
        n = max(float(sums[-4]), 1.0)
        metrics = {k: float(sums[i]) / n for i, k in enumerate(_TOKEN_MEAN_METRICS)}
        loss, num_tokens, gap_sum, gap_count, real = (float(x) for x in sums[-5:])
        metrics.update({
            "loss": loss, "grad_norm": grad_norm, "lr": lr, "num_tokens": num_tokens,
            "num_real_tokens": real, "logprob_gap_mean": gap_sum / gap_count if gap_count else 0.0,
            "logprob_gap_max": float(gap_max), "logprob_gap_tokens": gap_count,
            "tokens_per_s": real / elapsed, "step_time_s": elapsed, "step": float(self.counter.step),
            "policy_version": float(self.counter.policy_version), "kl_coef": float(self.kl.coef)})
        if self.comm.world_size > 1:
            metrics["grad_all_reduce_s"] = grad_all_reduce_s   # the wait for the slowest rank included
        return metrics
