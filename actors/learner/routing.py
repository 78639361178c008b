"""The learner's side of MoE routing: routing replay (R3), the router's load-balancing loss and
the per-step routing metrics.

    routing = LearnerRouting(model, replay=True, aux_loss_coef=0.0)
    packed = routing.pack(batch, pack_batch(batch))          # decodes TrainBatch.routed_experts
    with routing.trace(model, mb) as trace:                  # around one micro-batch's forward
        hidden = model.hidden_states(...)
    loss = loss + routing.aux_loss(mb, share)                # 0 unless router_aux_loss_coef > 0
    routing.step_metrics()                                   # routing_mismatch_frac, ... (then reset)

Design note. The generator records, per token of prompt + sample, the experts every MoE layer
routed it to (`GeneratedSample.routed_experts`; models/moe.py has the wire form). With
`routing_replay` the learner's forward routes each recorded token to those experts, with gate
weights recomputed from its OWN router probabilities (so the router still gets gradients);
tokens without a record (a prefix-cache hit in the engine, the last sampled token, tool
output after the last action) are routed by the learner's router. Train and rollout then run
the same experts, and the logprobs agree to float rounding as long as the weights agree.
Whatever the mode, a step with records reports how often the learner's own router picks a
different top-k than the rollout did, and the train-rollout logprob gap in the other mode too
(one extra no-grad forward per micro-batch).
"""
from __future__ import annotations

import contextlib

import torch

from ..models.moe import decode_routing, load_balancing_loss, routing_trace
from .batch import LearnerError
from .packed import PackedBatch


def logprob_gap(recomputed: torch.Tensor, mb: PackedBatch, policy_version: int) -> tuple[float, float, float]:
    """(sum, count, max) of |recomputed - behaviour| over trained tokens sampled by the weights of
    `policy_version` (the train-inference gap of the learner's metrics)."""
    same = mb.loss_mask & (mb.policy_versions == policy_version)
    if not bool(same.any()):
        return 0.0, 0.0, 0.0
    diff = (recomputed.float() - mb.behavior_logp)[same].abs().double()
    return float(diff.sum()), float(same.sum()), float(diff.max())


class LearnerRouting:
    """Routing replay, aux loss and routing metrics of one learner (see the module's note).
    Invariant: inactive (every method a no-op) when the model has no MoE layer."""

    def __init__(self, model, replay: bool, aux_loss_coef: float):
        config = model.config
        self.moe_layers = tuple(getattr(config, "moe_layers", ()))
        self.active = bool(self.moe_layers)
        if (replay or aux_loss_coef) and not self.active:
            raise LearnerError(f"routing_replay / router_aux_loss_coef need a mixture-of-experts policy "
                               f"(e.g. model_type 'qwen3_moe'); this {config.architecture} model has no MoE "
                               "layer: leave them unset")
        self.replay, self.aux_loss_coef = replay, aux_loss_coef
        self.config = config
        self.last = None                      # the trace of the latest forward
        self._sums = torch.zeros(6, dtype=torch.float64)   # differing, recorded rows; gap sums per mode

    def pack(self, batch, packed: PackedBatch) -> PackedBatch:
        """`packed` with the batch's routing records as (B, T, L, k) int64 (-1: none), when it has any."""
        records = getattr(batch, "routed_experts", None)
        if not self.active or records is None or all(r is None for r in records):
            return packed
        cfg, (num, width) = self.config, packed.input_ids.shape
        table = torch.full((num, width, len(self.moe_layers), cfg.num_experts_per_tok), -1, dtype=torch.int64)
        lengths = packed.attention_mask.sum(-1).tolist()
        for i, (data, n) in enumerate(zip(records, lengths)):
            if data is None:
                continue
            try:
                table[i, :n] = decode_routing(bytes(data), n, len(self.moe_layers), cfg.num_experts_per_tok,
                                              cfg.num_experts)
            except ValueError as exc:
                raise LearnerError(f"routed_experts[{i}]: {exc}") from None
        packed.routed_experts = table
        return packed

    def trace(self, model, mb: PackedBatch, replay: bool | None = None):
        """The routing context of one forward over `mb` (plain path: rows = B*T)."""
        if not self.active:
            return contextlib.nullcontext()
        replay = self.replay if replay is None else replay
        records = mb.routed_experts
        rows = None
        if replay and records is not None:
            rows = records.reshape(-1, *records.shape[2:])
        return _Traced(self, routing_trace(model, replay=rows, record=records is not None,
                                           keep_logits=bool(self.aux_loss_coef)))

    def aux_loss(self, mb: PackedBatch, share: float) -> torch.Tensor | float:
        """coef * load-balancing loss of the latest forward, times `share` (this micro-batch's part
        of the batch's real tokens, so the micro-batches' terms add up to one batch mean)."""
        if not (self.active and self.aux_loss_coef) or self.last is None:
            return 0.0
        loss = load_balancing_loss(self.last.router_logits, self.config.num_experts,
                                   self.config.num_experts_per_tok, mb.attention_mask)
        return self.aux_loss_coef * share * loss

    def account(self, logp: torch.Tensor, mb: PackedBatch, policy_version: int, other_logp) -> None:
        """Add the latest forward's routing mismatch and the train-rollout gaps (this mode's from
        `logp`, the other mode's from `other_logp()`, a no-grad forward with replay flipped)."""
        if not self.active or mb.routed_experts is None or self.last is None or not self.last.own_experts:
            return
        recorded = mb.routed_experts.reshape(-1, *mb.routed_experts.shape[2:]).to(logp.device)  # (N, L, k)
        own = self.last.router_experts()                                                        # (N, L, k)
        known = (recorded[:, :, 0] >= 0).all(-1) & mb.attention_mask.reshape(-1).bool()
        differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1).any(-1) & known
        with torch.no_grad():
            other = other_logp()
        (this_gap, count, _), (other_gap, _, _) = (logprob_gap(lp, mb, policy_version)
                                                   for lp in (logp, other))
        replay_gap, plain_gap = (this_gap, other_gap) if self.replay else (other_gap, this_gap)
        self._sums += torch.tensor([float(differs.sum()), float(known.sum()), replay_gap, plain_gap, count,
                                    1.0], dtype=torch.float64)

    def step_metrics(self) -> dict[str, float]:
        """routing_mismatch_frac (recorded tokens whose learner top-k differs from the rollout's in
        some MoE layer), logprob_gap_mean_replay / _no_replay; {} for a step without records."""
        differing, recorded, replay_gap, plain_gap, gap_tokens, seen = self._sums.tolist()
        self._sums.zero_()
        self.last = None
        if not seen:
            return {}
        return {"routing_mismatch_frac": differing / max(recorded, 1.0),
                "routing_recorded_tokens": recorded,
                "logprob_gap_mean_replay": replay_gap / max(gap_tokens, 1.0),
                "logprob_gap_mean_no_replay": plain_gap / max(gap_tokens, 1.0)}


class _Traced:
    """routing_trace that leaves its trace on the LearnerRouting when the forward is done."""

    def __init__(self, owner: LearnerRouting, inner):
        self.owner, self.inner = owner, inner

    def __enter__(self):
        trace = self.inner.__enter__()
        self.owner.last = trace
        return trace

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)
