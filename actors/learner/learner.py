"""The learner: GRPO-family policy updates (and SFT) on rollout batches, without any actor.

    learner = Learner(LearnerConfig(model="tiny", lr=1e-5, micro_batch_size=4))
    metrics = learner.train_step(batch)       # a TrainBatch (postrain.actors.records; batch.py)
    metrics = learner.sft_step(batch)         # an SftBatch: cross-entropy on loss_mask tokens (warm start)
    learner.save_checkpoint("runs/x/ckpt/step10", extra={"ledger": ...}); learner.load_checkpoint(...)
    learner.export_hf("runs/x/hf")            # a Hugging Face folder transformers loads

Design note. One optimizer step per call. The batch is cut into micro-batches of
`micro_batch_size` samples; every micro-batch's loss is divided by the WHOLE batch's token
(or sequence) count (`global_num_tokens` / `global_num_seqs` of `rl_ops.policy_loss`), so
the summed micro-batch gradients equal the full-batch gradient exactly. Data parallel is
the same rule one level up: under torch.distributed each rank packs its own shard, the
counts and then the gradients are all-reduced with SUM, and every rank takes the same
AdamW step (tests/actors/learner/test_learner_dp.py pins 2 ranks == 1 process). Strategy
"fsdp" shards the model, gradients and AdamW state instead and reduce-scatters the gradients
with the same SUM (fsdp.py; tests/actors/learner/test_learner_fsdp.py).

The Learner is the composition root of its parts, each a class with one job:

    config.py          LearnerConfig              every knob, validated where it is made
    counter.py         StepCounter                `step` and `policy_version` (their one writer)
    collectives.py     Collectives                ranks, rings, all-reduces, broadcasts
    policy_forward.py  PolicyForward              logprobs: LM head, autocast, shared prefixes, rings
    optimizer.py       PolicyOptimizer            AdamW, clipping, the lr schedule
    reference.py       KLReference                the frozen KL reference
    distill.py         LearnerDistill             on-policy distillation: its rules and teacher model
    step.py            StepLoop                   one train or SFT step over the parts above
    checkpoint_io.py   CheckpointIO               whole-model (state.py) or sharded (sharded_state.py)

Logprobs come from `rl_ops.token_logprobs_from_hidden` on the hidden states of the response
tokens only, so neither the prompt's nor any (tokens x vocab) logits are materialised. The same pass
yields the train-inference gap: the recomputed logprobs against the generator's
`behavior_logprobs` for tokens sampled with the current weights (same policy version).

Objectives: "ppo" takes the ratio against the behaviour logprobs (on-policy or nearly);
"decoupled" takes the ratio against the proximal logprobs, those of the current weights,
and weighs each token by min(exp(prox - behaviour), cap) (stale samples from an
asynchronous run). Invariant: a train step is exactly one optimizer step, so the proximal
weights are the ones the gradient pass runs with, and its own logprobs (detached) are the
proximal ones: no separate recompute pass. Policy versions: the learner's
`policy_version` counts optimizer steps; weights published after step k are version k.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from postrain.ext import rl_ops

from ..models.device import resolve_device
from ..models.exact import make_exact
from ..models.loading import build_policy
from ..records import SftBatch, TrainBatch
from . import fsdp
from .batch import pack_batch
from .checkpoint_io import CheckpointIO, is_sharded_checkpoint
from .collectives import Collectives
from .config import DTYPES, LearnerConfig
from .context_parallel_step import join_rings
from .counter import StepCounter
from .distill import LearnerDistill
from .images import shares_prefixes_with_images
from .lora import LearnerLora
from .optimizer import PolicyOptimizer
from .policy_forward import PolicyForward
from .reference import KLReference
from .routing import LearnerRouting
from .sharded_state import ShardedCheckpointIO
from .state import WholeCheckpointIO
from .step import StepLoop, batch_advantages
from .task_kl import TaskKL

if TYPE_CHECKING:
    from ..models.llama import LlamaModel

__all__ = ["Learner", "LearnerConfig"]


class Learner:
    """Owns the policy, its parts (module docstring) and the public API of a training step.

    Invariants: policy_version - step is constant between loads (StepCounter); every rank of a
    data-parallel group holds identical parameters after each step; `sharded` is True once the
    model is FSDP2-sharded over the group, and never goes back.
    """

    def __init__(self, config: LearnerConfig | dict | None = None, *, process_group=None):
        self.config = config if isinstance(config, LearnerConfig) else LearnerConfig.from_dict(config)
        cfg = self.config
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        dtype = DTYPES[cfg.dtype]
        self.model, self.tokenizer = build_policy(cfg.model, cfg.seed, dtype, self.device)
        self.model.train()
        if cfg.exact:
            make_exact(self.model)         # before the reference copies the policy's type
        if cfg.activation_checkpointing:
            fsdp.checkpoint_layers(self.model)
        self.routing = LearnerRouting(self.model, cfg.routing_replay, cfg.router_aux_loss_coef)
        self.kl_reference = KLReference.build(cfg, self.model, self.device, dtype)
        if cfg.exact and self.kl_reference.model is not None:
            make_exact(self.kl_reference.model)
        self.distill = LearnerDistill.build(cfg, self.model, self.tokenizer, self.device, dtype)
        self.lora = LearnerLora(self.model, cfg.lora, cfg.seed)   # inactive without the lora option
        self.optim = PolicyOptimizer(cfg, self.lora.trainable(self.model))   # LoRA: the adapters alone
        self.kl = (rl_ops.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
                   if cfg.kl_target else rl_ops.FixedKLController(cfg.kl_coef))
        self.task_kl = TaskKL(cfg.kl_coef, cfg.kl_horizon)   # a mixture's KL targets per task
        self.counter = StepCounter()
        self.comm = Collectives()
        self.forward = PolicyForward(cfg, self.device, self.routing, self.comm,
                                     images_share_prefixes=shares_prefixes_with_images(self.model))
        self.sharded = False               # strategy "fsdp" in a group: the model is FSDP2-sharded
        self.steps = StepLoop(cfg, self.model, self.forward, self.comm, self.counter, self.optim,
                              self.kl_reference, self.kl, self.routing, self.lora, self.distill, self.task_kl)
        self.checkpoints: CheckpointIO = (ShardedCheckpointIO(self) if cfg.strategy == "fsdp"
                                          else WholeCheckpointIO(self))   # chosen once
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.join_process_group(process_group)

    # ------------------------------------------------------------------ read-only views of the parts

    @property
    def step(self) -> int:
        return self.counter.step

    @property
    def policy_version(self) -> int:
        return self.counter.policy_version

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.optim.optimizer

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trained parameters (LoRA: the adapters alone; sharded: the shards)."""
        return self.optim.params

    @property
    def grad_bytes(self) -> int:
        """This rank's gradient bytes at the last step (a shard under FSDP)."""
        return self.optim.grad_bytes

    @property
    def reference(self) -> LlamaModel | None:
        """The frozen KL reference model, or None."""
        return self.kl_reference.model

    @property
    def group(self):
        return self.comm.group

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    # ------------------------------------------------------------------ the group

    def join_process_group(self, process_group=None) -> None:
        """Become a rank of torch.distributed's initialised group (`process_group`, or the default
        one): rank 0's weights are broadcast, and from now on counts and gradients are summed
        over the ranks. Every rank calls it (a collective); a learner built before its group
        formed calls it once the group exists (group.py)."""
        self.comm.join(process_group)
        self.comm.broadcast_from_rank0(list(self.model.state_dict().values()) + self.lora.parameters())
        if self.config.strategy == "fsdp":
            self._shard()
        if self.config.context_parallel > 1:
            self.comm.rings = join_rings(self.config.context_parallel, self.comm.world_size, self.routing.active)

    def _shard(self) -> None:
        """FSDP2 over the group (fsdp.py): the policy (and the reference) sharded in place; without
        LoRA the optimizer is rebuilt over the shards (PolicyOptimizer.shard)."""
        cfg = self.config
        mesh = fsdp.device_mesh(self.comm.group, self.device)
        mixed = DTYPES[cfg.autocast_dtype] if cfg.autocast_dtype and self.device.type == "cuda" else None
        fsdp.shard_policy(self.model, mesh, mixed)
        for frozen in (self.reference, self.distill.teacher):
            if frozen is not None:
                fsdp.shard_policy(frozen, mesh, mixed)
        self.sharded = True
        if not self.lora.active:           # LoRA: the optimizer holds the adapters, whole on every rank
            self.optim.shard(self.lora.trainable(self.model))

    # ------------------------------------------------------------------ public API

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy-gradient optimizer step on a rollout batch; returns its metrics (floats)."""
        return self.steps.train(batch)

    def sft_step(self, batch: SftBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the loss_mask tokens (SFT warm start)."""
        return self.steps.sft(batch)

    def batch_advantages(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor | None]:
        """(reward metrics, per-sample advantages (B,)) of a batch's rewards (step.batch_advantages);
        LearnerError for a batch the config's distillation cannot use (distill.py)."""
        metrics, advantages = batch_advantages(self.config, batch)
        self.distill.check_batch(batch)
        return metrics, advantages

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch | SftBatch) -> list[torch.Tensor]:
        """The policy's logprob of every token of every sample (index 0 is 0: no prefix), as the
        train step computes it; aligned with batch.token_ids. For consistency checks."""
        packed = self.routing.pack(batch, pack_batch(SftBatch(
            token_ids=batch.token_ids, loss_mask=[[0] + [1] * (len(x) - 1) for x in batch.token_ids],
            images=batch.images)))
        order, micro = self.forward.micro_batches(packed)
        rows = []
        for mb in micro:
            logp, _ = self.forward.logprobs(self.model, mb)
            for row, n in zip(logp, mb.attention_mask.sum(-1).tolist()):
                rows.append(torch.cat([torch.zeros(1), row[:n - 1].float().cpu()]))
        fsdp.reshard(self.model)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for position, index in enumerate(order.tolist()):
            out[index] = rows[position]
        return cast(list[torch.Tensor], out)   # every slot filled: order is a permutation of the rows

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights with Hugging Face names, on the CPU (no tied duplicate). Sharded: a
        collective every rank calls; ranks other than 0 get {} (fsdp.full_weights)."""
        if self.sharded:     # gathered one tensor at a time (a collective: every rank calls it)
            state = fsdp.full_weights(self.model, keep=self.rank == 0)
            if self.rank != 0:
                return {}
        else:
            state = {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return self.lora.merged(state)     # LoRA: base + scale * B @ A (new tensors)

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The model's own weights (the frozen base under LoRA), CPU, HF names, no tied duplicate.
        Sharded: gathered one tensor at a time, a collective every rank calls; ranks other than 0
        get {} (they hold no more than one tensor beyond their shard)."""
        model = self.model
        state = (fsdp.full_weights(model, keep=self.rank == 0) if self.sharded else
                 {k: v.detach().to("cpu") for k, v in model.state_dict().items()})
        return {k: v for k, v in state.items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}

    def held_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters (the model's own, tied counted once, plus LoRA's),
        gradients and optimizer state, measured on the tensors it holds (shards under FSDP)."""
        params = {id(p): p for p in list(self.model.parameters()) + self.lora.parameters()}
        out = {"params": sum(fsdp.local_bytes(p) for p in params.values()),
               "grads": sum(fsdp.local_bytes(p.grad) for p in params.values()),
               "optimizer": sum(fsdp.local_bytes(v) for state in self.optimizer.state.values()
                                for v in state.values() if isinstance(v, torch.Tensor))}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def save_checkpoint(self, folder: str | Path, extra: dict | None = None) -> Path:
        """Weights, optimizer, RNG, counters and `extra` (JSON-able), written atomically. Strategy
        "fsdp": a DCP checkpoint every rank writes its shard of (sharded_state.py)."""
        return self.checkpoints.save(folder, extra)

    def load_checkpoint(self, folder: str | Path) -> dict:
        """Restore everything save_checkpoint wrote (a DCP one at any rank count); returns `extra`."""
        reader = ShardedCheckpointIO(self) if is_sharded_checkpoint(folder) else self.checkpoints
        return reader.load(folder)

    def export_hf(self, folder: str | Path) -> Path:
        """The policy as a Hugging Face folder (config.json, model.safetensors, tokenizer). Sharded:
        every rank calls it; rank 0 writes it one layer at a time (streamed_export.py)."""
        return self.checkpoints.export_hf(folder)
