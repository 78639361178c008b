"""Routed mixture of experts: the router, the grouped expert computation, routing traces for
routing replay (R3), and the load-balancing loss.

    block = SparseMoeBlock(config, moe_index=0)             # router `gate` + `experts`
    y = block(x)                                            # x (..., hidden) -> (..., hidden)
    with routing_trace(model, record=True) as trace:        # the engine: keep the chosen experts
        model(input_ids, paged=...)
    trace.chosen_experts()                                  # (N, moe_layers, top_k) int64
    with routing_trace(model, replay=experts):              # the learner: route as the rollout did
        model.hidden_states(input_ids)

Design note. A token's router logits (one linear map, float32) give softmax probabilities
over E experts; it goes to its top-k and the expert outputs are summed with those
probabilities (renormalised to sum 1 when `norm_topk_prob`), as in Hugging Face's Qwen3-MoE.
The experts run grouped: the (token, slot) assignments are sorted by expert, so every
expert's tokens are one contiguous block, and the expert MLPs run as ONE batched matmul per
projection over the experts padded to the busiest one's count (`torch.bmm`), or, when that
padding would more than double the work (decoding a few tokens), one matmul per expert that
has tokens. No Python loop over tokens; `naive_expert_mlp` is the per-token reference the
tests and the bench compare against.

Replay: a trace may carry, for each of the forward's N token rows, the experts to use in each
MoE layer (-1: let the router choose). The replayed experts' gate weights are recomputed from
the model's own router probabilities (so the router still learns), only the choice is
imposed. A trace also keeps the router's own top-k (mismatch metrics) and its logits (aux loss).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import exact as exact_ops
from .config import ModelConfig

NOT_RECORDED = -1       # an expert index in a replay tensor: route this row by the router itself


@dataclass
class RoutingTrace:
    """One forward's routing, shared by the model's MoE blocks (`routing_trace`).

    Invariants: replay is None or (N, num_moe_layers, top_k) int64 for the forward's N token
    rows (the flattened leading dims of the blocks' input), NOT_RECORDED in a row's first slot
    meaning "route by the router"; the lists hold one (N, ...) tensor per MoE layer in layer order."""

    replay: torch.Tensor | None = None
    record: bool = False                 # keep `experts` (what was used) and `own_experts`
    keep_logits: bool = False            # keep `router_logits` (the load-balancing loss)
    experts: list[torch.Tensor] = field(default_factory=list)       # (N, k) used
    own_experts: list[torch.Tensor] = field(default_factory=list)   # (N, k) the router's own top-k
    router_logits: list[torch.Tensor] = field(default_factory=list)  # (N, E) float32

    def chosen_experts(self) -> torch.Tensor:
        """(N, num_moe_layers, top_k) int64: the experts each token row used in each MoE layer."""
        return torch.stack(self.experts, dim=1)

    def router_experts(self) -> torch.Tensor:
        """(N, num_moe_layers, top_k) int64: the router's own top-k (differs from
        `chosen_experts` only where a replay imposed other experts)."""
        return torch.stack(self.own_experts, dim=1)


def moe_blocks(model: nn.Module) -> list["SparseMoeBlock"]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@contextlib.contextmanager
def routing_trace(model: nn.Module, replay: torch.Tensor | None = None, record: bool = False,
                  keep_logits: bool = False):
    """Attach a RoutingTrace to every MoE block of `model` for the forwards inside the block;
    yields it. Not re-entrant per model (one trace at a time)."""
    trace = RoutingTrace(replay=replay, record=record, keep_logits=keep_logits)
    blocks = moe_blocks(model)
    for block in blocks:
        block.trace = trace
    try:
        yield trace
    finally:
        for block in blocks:
            block.trace = None


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, replay: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts (N, k) int64, gate weights (N, k) float32, the router's own top-k (N, k)) from
    router logits (N, E). With `replay` (N, k), rows whose first entry is >= 0 use its experts,
    weighted by their probabilities under these logits."""
    probs = torch.softmax(logits.float(), dim=-1)                                  # (N, E)
    _, own = torch.topk(probs, top_k, dim=-1)                                      # (N, k)
    experts = own
    if replay is not None:
        experts = torch.where((replay[:, :1] >= 0), replay, own)
    weights = probs.gather(1, experts)                                             # (N, k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights, own


def _expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """x (..., H) through SwiGLU experts: gate_up (..., 2I, H), down (..., H, I) (batched over ...).
    exact: batch-invariant (models/exact.py): a 2-D x of fewer than exact.MIN_ROWS rows is padded."""
    if exact and x.dim() == 2:
        gate, up = exact_ops.exact_linear(x, gate_up).chunk(2, dim=-1)
        return exact_ops.exact_linear(exact_ops.silu(gate) * up, down)
    gate, up = torch.matmul(x, gate_up.transpose(-1, -2)).chunk(2, dim=-1)
    return torch.matmul((exact_ops.silu if exact else F.silu)(gate) * up, down.transpose(-1, -2))


def grouped_expert_mlp(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) for every row n, grouped by expert.
    x (N, H); experts, weights (N, k); gate_up (E, 2I, H); down (E, H, I). Returns (N, H).
    exact (models/exact.py): every expert's matmul has at least exact.MIN_ROWS rows, in either
    branch, so a token's output does not depend on which other tokens share its experts (a row
    of such a batched matmul has the bits of the same row multiplied alone)."""
    num, top_k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)                                                     # (N*k,)
    order = torch.argsort(flat, stable=True)
    token = order // top_k                                                         # row of each assignment
    counts = torch.bincount(flat, minlength=num_experts)                           # (E,)
    rows = x.index_select(0, token)                                      # (N*k, H) grouped by expert
    busiest = int(counts.max())
    if num_experts * busiest <= 2 * num * top_k:     # one batched op over experts padded to `busiest`
        busiest = max(busiest, exact_ops.MIN_ROWS) if exact else busiest
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = flat.index_select(0, order)
        slot = torch.arange(num * top_k, device=x.device) - starts.index_select(0, sorted_experts)
        padded = x.new_zeros(num_experts, busiest, x.shape[-1])
        padded[sorted_experts, slot] = rows
        out_rows = _expert_swiglu(padded, gate_up, down, exact)[sorted_experts, slot]  # (N*k, H)
    else:                                            # few tokens: one matmul per expert that has any
        pieces = []
        for e, chunk in enumerate(rows.split(counts.tolist())):
            if chunk.shape[0]:
                pieces.append(_expert_swiglu(chunk, gate_up[e], down[e], exact))
        out_rows = torch.cat(pieces)
    out_rows = out_rows * weights.reshape(-1).index_select(0, order).to(out_rows.dtype)[:, None]
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(num * top_k, device=x.device)       # assignment i sits at unsort[i]
    # gather back to (token, slot) order and add the k slots: no scatter-add (deterministic, and
    # CPU index_add stalls under thread contention)
    return out_rows.index_select(0, unsort).view(num, top_k, -1).sum(dim=1)


def naive_expert_mlp(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The per-token reference of `grouped_expert_mlp` (a Python loop over tokens and slots)."""
    out = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            acc = acc + weights[n, j].to(x.dtype) * _expert_swiglu(x[n], gate_up[e], down[e])
        out.append(acc)
    return torch.stack(out) if out else x.new_zeros(x.shape)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights (Hugging Face's in-memory layout):
    gate_up_proj (E, 2I, H) = [gate; up] rows, down_proj (E, H, I)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: router `gate` (E, H) and `experts`. `moe_index` is its
    ordinal among the model's MoE layers (its column in a routing trace)."""

    naive: bool = False      # class switch for the bench's reference: per-token loops
    exact: bool = False      # batch-invariant router and experts (models/exact.py `make_exact` sets it)

    def __init__(self, config: ModelConfig, moe_index: int):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.moe_index = moe_index
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.trace: RoutingTrace | None = None

    def forward(self, x: torch.Tensor, weights=None) -> torch.Tensor:
        """x (..., H) -> (..., H). `weights` (float16 copies) are not used: the router and the
        experts multiply by the model's own weights, so the engine routes as the learner does."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])                                            # (N, H)
        logits = (exact_ops.exact_linear if self.exact else F.linear)(rows, self.gate.weight)   # (N, E)
        trace = self.trace
        replay = None if trace is None or trace.replay is None else trace.replay[:, self.moe_index]
        experts, gate_weights, own = route(logits, self.top_k, self.norm_topk_prob, replay)
        if trace is not None:
            if trace.record:
                trace.experts.append(experts)
                trace.own_experts.append(own)
            if trace.keep_logits:
                trace.router_logits.append(logits.float())
        parts = (rows, experts, gate_weights, self.experts.gate_up_proj, self.experts.down_proj)
        out = naive_expert_mlp(*parts) if self.naive else grouped_expert_mlp(*parts, exact=self.exact)
        return out.reshape(shape)


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int,
                        row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, Hugging Face's `load_balancing_loss_func`:
    E * sum_e f_e * P_e, with f_e the share of top-k assignments that went to expert e and P_e
    the mean router probability of e, both over every real row of every MoE layer.
    router_logits: one (N, E) per MoE layer; row_mask (N,) 1 = real token (None: all)."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, device=device)
    prob_sum = torch.zeros(num_experts, device=device)
    total = torch.zeros((), device=device)
    mask = (torch.ones(router_logits[0].shape[0], device=device) if row_mask is None
            else row_mask.reshape(-1).to(device=device, dtype=torch.float32))
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * mask[:, None]).sum(0)
        total = total + mask.sum()
    return num_experts * torch.sum((counts / total) * (prob_sum / total))


# ----------------------------------------------------------------------------- wire form (R3)


def routing_dtype(num_experts: int):
    """The unsigned dtype of a routing record: uint8 below 255 experts, else uint16; its
    largest value marks a position the engine did not compute (prefix-cache hit, last token)."""
    import numpy as np

    return np.uint8 if num_experts < 255 else np.uint16


def encode_routing(table, num_tokens: int, num_experts: int) -> bytes:
    """The compact record of a sample's routing: `table` (>= num_tokens - 1 rows or None, L, k)
    int with -1 where unknown, cut or padded to num_tokens rows, as raw uint8/uint16 bytes
    (row-major (num_tokens, L, k)). Row t holds the experts token t was routed to as an input."""
    import numpy as np

    dtype = routing_dtype(num_experts)
    sentinel = np.iinfo(dtype).max
    rows = np.full((num_tokens,) + tuple(table.shape[1:]), sentinel, dtype=dtype)
    known = min(num_tokens, table.shape[0])
    part = table[:known]
    rows[:known] = np.where(part < 0, sentinel, part).astype(dtype)
    return rows.tobytes()


def decode_routing(data: bytes, num_tokens: int, num_moe_layers: int, top_k: int, num_experts: int
                   ) -> torch.Tensor:
    """(num_tokens, L, k) int64 with NOT_RECORDED where the record has none; ValueError naming
    the sizes when `data` does not hold num_tokens rows of this model's routing."""
    import numpy as np

    dtype = routing_dtype(num_experts)
    expected = num_tokens * num_moe_layers * top_k * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise ValueError(f"a routing record of {len(data)} bytes does not fit {num_tokens} tokens x "
                         f"{num_moe_layers} MoE layers x top-{top_k} ({expected} bytes); record it with "
                         "this model's engine")
    rows = np.frombuffer(data, dtype=dtype).reshape(num_tokens, num_moe_layers, top_k).astype(np.int64)
    rows[rows == np.iinfo(dtype).max] = NOT_RECORDED
    return torch.from_numpy(rows)
