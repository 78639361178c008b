"""PolicyForward: the policy's per-token logprobs and entropies, as the step loop trains on them.

    forward = PolicyForward(config, device, routing, comm)
    order, micro = forward.micro_batches(packed)      # on the device, grouped by shared prefix
    logp, entropy = forward.logprobs(model, mb)       # (B, T - 1); 0 where not trained
    ref_logp = forward.recompute(micro, reference)    # no gradient (the KL reference, a judge)
    logp, entropy, kl = forward.distill_logprobs(model, mb, teacher)   # and the distillation KL (B, T - 1)

Design note. Logprobs come from `rl_ops.token_logprobs_from_hidden` on the hidden states of
the trained tokens only, so neither the prompt's nor any (tokens x vocab) logits are
materialised. Under context parallel each rank scores its zig-zag slice and the ring gathers
the rows (context_parallel_step.py); a Gemma softcap or `logprob_path = "naive"` takes the
full-logits path. The same forward serves the policy, the frozen reference and any other
model of the policy's architecture: it holds no model of its own.

Distillation (`distill_logprobs`) takes the same hidden rows through one chunked pass of the
LM head (`rl_ops.distill_head_from_hidden`) that yields the logprobs, the entropies and, at
temperature 1, either the student's log-probs at the teacher's top-k ids and its tail mass
(the batch's teacher rows) or the full-vocabulary KL to a teacher model, whose own hidden rows
come from a no-gradient pass over the same micro-batch (shared prefixes included).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from postrain.ext import rl_ops

from ..models.exact import exact_token_logprobs
from ..models.gemma3 import softcap_logits
from ..models.llama import LlamaModel
from . import fsdp
from .collectives import Collectives
from .config import DTYPES, LearnerConfig
from .context_parallel import RingAttention, zigzag_positions
from .context_parallel_step import GatherRing
from .batch import LearnerError
from .images import batch_image_rows, shared_image_rows
from .packed import PackedBatch
from .routing import LearnerRouting
from .shared_prefix import plan_micro_batches


class PolicyForward:
    """Logprobs (LM head, autocast, shared prefixes, rings) of any model of the policy's shape."""

    def __init__(self, config: LearnerConfig, device: torch.device, routing: LearnerRouting, comm: Collectives,
                 images_share_prefixes: bool = True):
        self.config = config
        self.device = device
        self.routing = routing
        self.comm = comm
        self.images_share_prefixes = images_share_prefixes   # the policy's tower allows it (images.py)

    def micro_batches(self, packed: PackedBatch) -> tuple[torch.Tensor, list[PackedBatch]]:
        """(order, micro-batches of `micro_batch_size` samples) on the device: the samples in
        `order` (B,), grouped by shared prefix where that saves compute, else sorted by length
        so that short samples pad to short ones (shared_prefix.py). The gradient is the same in
        any order, since every micro-batch's loss uses the whole batch's normalisers."""
        cfg = self.config
        if packed.images and cfg.context_parallel > 1:
            raise LearnerError("images do not run on context-parallel rings; set context_parallel = 1")
        order, micro = plan_micro_batches(packed, cfg.micro_batch_size,   # MoE, rings: plain rows
                                          cfg.shared_prefix and not self.routing.active and cfg.context_parallel == 1
                                          and not (packed.images and not self.images_share_prefixes))
        return order, [mb.to(self.device) for mb in micro]

    def logprobs(self, model: LlamaModel, mb: PackedBatch,
                 replay: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logp, entropy (B, T - 1) of the targets input_ids[:, 1:] (float32, or the model's dtype
        if wider); 0 where not trained. Only the loss_mask positions reach the LM head."""
        if self.config.context_parallel > 1:
            return self._ring_logprobs(model, mb)   # each rank its slice (context_parallel_step.py)
        sel = mb.loss_mask                                                                # (B, T-1)
        with self.autocast(), self.routing.trace(model, mb, replay):
            h = trained_hidden(model, mb, self.config.train_vision)                       # (N, H)
        logp, entropy = self.head(model, h, mb.input_ids[:, 1:][sel])
        zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=sel.device)
        return zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, entropy)

    def distill_logprobs(self, model: LlamaModel, mb: PackedBatch, teacher: LlamaModel | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logp, entropy (as `logprobs`) and the per-token distillation KL(student || teacher) (or,
        with distill_divergence "forward", KL(teacher || student)) at temperature 1, all (B, T - 1)
        and 0 where not trained: over the micro-batch's teacher
        top-k rows and tail (`teacher` None) or over the full vocabulary of `teacher`."""
        if self.config.context_parallel > 1:   # the config refuses it; a guard for a direct caller
            raise LearnerError("distillation does not run on context-parallel rings; set context_parallel = 1")
        if teacher is None and mb.teacher_ids is None:
            raise LearnerError("a distillation step needs the teacher's rows in the batch or a teacher model")
        sel = mb.loss_mask                                                                # (B, T-1)
        with self.autocast(), self.routing.trace(model, mb, None):
            h = trained_hidden(model, mb, self.config.train_vision)                       # (N, H)
        targets = mb.input_ids[:, 1:][sel]
        if teacher is not None:
            with torch.no_grad(), self.autocast():
                teacher_h = trained_hidden(teacher, mb, False)                            # (N, H_t)
            logp, entropy, kl = self._distill_head(model, h, targets, teacher=teacher, teacher_h=teacher_h)
        else:
            assert mb.teacher_ids is not None and mb.teacher_logp is not None and mb.teacher_tail is not None
            logp, entropy, part = self._distill_head(model, h, targets, topk_ids=mb.teacher_ids[sel])
            kl = rl_ops.topk_kl_per_token(part[:, :-1], mb.teacher_logp[sel], mb.teacher_tail[sel],
                                          student_tail_logmass=part[:, -1],
                                          divergence=self.config.distill_divergence)
        zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=sel.device)
        return (zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, entropy),
                zeros.masked_scatter(sel, kl.to(logp.dtype)))

    def _distill_head(self, model: LlamaModel, h: torch.Tensor, targets: torch.Tensor, *,
                      topk_ids: torch.Tensor | None = None, teacher: LlamaModel | None = None,
                      teacher_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`head` with the distillation output (rl_ops.distill_head_from_hidden): the full logits
        for a softcapped student or `logprob_path = "naive"`, else chunked."""
        cfg = self.config
        weight = model.lm_head.weight
        h = h.to(weight.dtype)
        cap = model.config.final_logit_softcapping
        teacher_weight = None if teacher is None else teacher.lm_head.weight
        teacher_cap = None if teacher is None else teacher.config.final_logit_softcapping
        if cfg.logprob_path == "naive" or cap is not None:
            logits = h @ weight.t() if cap is None else torch.tanh(h @ weight.t() / cap) * cap
            teacher_logits = None
            if teacher_h is not None and teacher_weight is not None:
                with torch.no_grad():
                    teacher_logits = teacher_h.to(teacher_weight.dtype) @ teacher_weight.t()
                    if teacher_cap is not None:
                        teacher_logits = torch.tanh(teacher_logits / teacher_cap) * teacher_cap
            return rl_ops.distill_head_naive(logits, targets, topk_ids=topk_ids, teacher_logits=teacher_logits,
                                             divergence=cfg.distill_divergence, temperature=cfg.temperature)
        return rl_ops.distill_head_from_hidden(
            h, weight, targets, topk_ids=topk_ids, teacher_hidden=teacher_h, teacher_weight=teacher_weight,
            teacher_softcap=teacher_cap, divergence=cfg.distill_divergence, temperature=cfg.temperature,
            chunk_size_tokens=cfg.chunk_size_tokens)

    def _ring_logprobs(self, model: LlamaModel, mb: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logp, entropy (B, T - 1) of the micro-batch's whole sequences (0 where not trained), as
        `logprobs` gives them, each rank having scored its zig-zag slice; the same on
        every rank of the ring, with gradients to this rank's own positions."""
        rings = self.comm.rings
        if rings is None:
            raise LearnerError(f"learner.context_parallel = {self.config.context_parallel} needs a learner "
                               "group of a multiple of that many ranks (ranks = N on the learner's entry); this "
                               "learner runs alone: set context_parallel = 1")
        ring = rings.ring
        ids, sel_all = mb.input_ids, mb.loss_mask                        # (B, T), (B, T - 1)
        batch, length = ids.shape
        padded = -(-length // (2 * ring.size)) * 2 * ring.size
        positions = zigzag_positions(padded, ring.size, ring.rank).to(ids.device)       # (Tl,)
        ids = F.pad(ids, (0, padded - length))
        targets = F.pad(ids[:, 1:length], (0, padded - length + 1))[:, positions]        # (B, Tl)
        sel = F.pad(sel_all, (0, padded - length + 1), value=False)[:, positions]        # (B, Tl)
        with self.autocast():
            hidden = model.hidden_states(ids[:, positions], paged=RingAttention(ring, positions.expand(batch, -1)))
        logp, entropy = self.head(model, hidden[sel], targets[sel])
        zeros = torch.zeros(sel.shape, dtype=logp.dtype, device=sel.device)
        local = torch.stack([zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, entropy)])
        full = GatherRing.apply(local, ring, positions, padded)[..., :length - 1]       # (2, B, T - 1)
        return full[0], full[1]

    @torch.no_grad()
    def recompute(self, micro: list[PackedBatch], model: LlamaModel) -> list[torch.Tensor]:
        """logp (B, T - 1) of each micro-batch under `model`, without a gradient."""
        out = [self.logprobs(model, mb)[0] for mb in micro]
        fsdp.reshard(model)               # no backward frees the root's gathered weights
        return out

    def autocast(self):
        """The forward's autocast context: `autocast_dtype` where set, else off."""
        cfg = self.config
        return torch.autocast(self.device.type, dtype=DTYPES[cfg.autocast_dtype or cfg.dtype],
                              enabled=cfg.autocast_dtype is not None)

    def head(self, model: LlamaModel, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logp, entropy (N,) of `targets` (N,) from final hidden rows `h` (N, H)."""
        cfg = self.config
        weight = model.lm_head.weight
        h = h.to(weight.dtype)
        cap = model.config.final_logit_softcapping                # Gemma: the full logits, capped
        if cfg.exact:                       # the generator's exact logprobs, bit for bit (models/exact.py)
            logits = softcap_logits(model.lm_head(h), cap)
            _, entropy = rl_ops.naive_token_logprobs(logits, targets, cfg.temperature, return_entropy=True)
            return exact_token_logprobs(logits, targets, cfg.temperature), entropy
        if cfg.logprob_path == "naive" or cap is not None:
            logits = h @ weight.t() if cap is None else torch.tanh(h @ weight.t() / cap) * cap
            return rl_ops.naive_token_logprobs(logits, targets, cfg.temperature, return_entropy=True)
        return rl_ops.token_logprobs_from_hidden(
            h, weight, targets, temperature=cfg.temperature, chunk_size_tokens=cfg.chunk_size_tokens,
            return_entropy=True, backend=cfg.rl_ops_backend)


def trained_hidden(model: LlamaModel, mb: PackedBatch, train_vision: bool = False) -> torch.Tensor:
    """(N, H) final hidden states at the loss_mask positions: from one padded pass over the
    whole samples (with their images: images.py), or from the shared-prefix pass (each shared
    prefix computed once; text batches)."""
    sel = mb.loss_mask                                                                    # (B, T-1)
    if mb.shared is None:
        full = bool(mb.attention_mask.all())
        images = batch_image_rows(model, mb, train_vision)
        hidden = model.hidden_states(mb.input_ids, None if full else mb.attention_mask,  # (B, T, H)
                                     images=images)
        return hidden[:, :-1][sel]
    batch = mb.shared.batch
    if mb.images:
        batch = dataclasses.replace(batch, images=shared_image_rows(model, mb, train_vision))
    rows = model.shared_prefix_hidden_states(batch)                                       # (G*P + B*S, H)
    return rows[mb.shared.hidden_rows[:, :-1][sel]]
