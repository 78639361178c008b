"""The model runner: executes a `StepPlan` and returns the logits to sample or verify.

    runner = ModelRunner(model, kv_manager)                 # backend=default_backend()
    out = runner.run(plan, weights=None)                    # StepLogits(decodes=..., prefills=...)

For each part of the plan (decodes, then prefills: see `scheduler`) it right-pads the rows'
new tokens into one (B, T) batch, builds the `PagedMetadata` (positions, slot per new token,
block tables, context lengths) from the rows' block tables, binds the attention backend to
it and the KV manager's cache, and calls the model once per shape bucket: rows of very different
widths (a mixture of tasks: 600-token prompts beside 60-token ones) run as separate forwards
(`shape_buckets`), since one forward pads every row to the widest in its new tokens and in the
keys it gathers (a batch of 56 short and 8 long decodes took 6.5x the time of 64 short ones in
one forward). A prompt that hit the prefix cache on blocks another prompt of the same step fills
runs in a later forward than that prompt (`forward_waves`), never before its KV is written.
Rows with drafts and scoring prefills run as one forward. Which logits come back:
decode-only rows -> (B, V) at each row's one token; rows with drafts -> (B, T, V), column i
scoring the position after the row's i-th input; prefills -> (B, V) at each prompt's last token,
and, when a prefill row is a scoring request's (`StepPlan.has_scoring`), that row's logits at
every new position from its `logits_from` on too (`StepLogits.scored`): the forward projects only
the positions a (B, T) mask keeps (the model's `logits_to_keep`), never the padding's, so a step
holds at most (its new tokens, V) logits however unequal its rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, cast

import numpy as np
import torch

from ..models.blocks import ProjectionPath
from ..models.moe import routing_trace
from ..models.protocol import CausalLM
from .attention import AttentionBackend, PagedMetadata, default_backend
from .images import step_image_horizons, step_image_rows
from .kv_manager import KVManager
from .scheduler import ScheduledSequence, StepPlan


@dataclass(frozen=True)
class StepLogits:
    """The logits of one plan; None where the plan had no such rows."""

    decodes: torch.Tensor | None    # (B, V), or (B, 1 + max drafts, V) when the plan has drafts
    prefills: torch.Tensor | None   # (B, V): each prompt's last token
    scored: tuple[tuple[int, int, torch.Tensor], ...] = ()
    # per prefill row of a scoring request: (its index in plan.prefills, the first position kept,
    # logits (n, V) of positions first .. its last new token); scoring.py reduces them


SHAPE_FLOOR = 64   # tokens: narrower rows count as this wide (a forward's fixed cost outweighs their padding)


def shape_buckets(widths: list[int]) -> list[list[int]]:
    """Row indices grouped into forwards: sorted by width (a decode's context length, a prefill's
    new tokens), a new group where a row is over twice as wide as its group's first (widths under
    SHAPE_FLOOR counting as it). So one task's rows, within a factor of 2, stay one forward, and
    no forward pads a row to more than twice its width."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and max(widths[i], SHAPE_FLOOR) <= 2 * max(widths[groups[-1][0]], SHAPE_FLOOR):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def forward_waves(rows: tuple[ScheduledSequence, ...], block_size_tokens: int) -> list[list[int]]:
    """Row indices in waves whose forwards must run one after another: a row that reads a block
    another row of this step writes (a prompt that hit the prefix cache on blocks a prompt
    admitted before it in the same step fills) is in a later wave than that row. One forward
    writes every row's KV before any row attends, so a wave may be one forward; separate
    forwards (shape buckets) run only after the waves before theirs.
    Invariant (the scheduler's): a row reads only blocks that rows before it write."""
    B = block_size_tokens
    writer: dict[int, int] = {}
    for i, row in enumerate(rows):
        first, last = row.start_position // B, (row.start_position + row.num_new_tokens - 1) // B
        writer.update((block, i) for block in row.block_table[first:last + 1])
    waves: list[int] = []
    for i, row in enumerate(rows):
        writers = {writer[b] for b in row.block_table[:-(-row.start_position // B)] if writer.get(b, i) != i}
        assert all(j < i for j in writers), "a row reads a block that a later row of the step writes"
        waves.append(max((waves[j] + 1 for j in writers), default=0))
    return [[i for i, w in enumerate(waves) if w == wave] for wave in range(max(waves, default=-1) + 1)]


def paged_inputs(rows: tuple[ScheduledSequence, ...], block_size_tokens: int
                 ) -> tuple[torch.Tensor, PagedMetadata]:
    """(input_ids (B, T), metadata) of rows right-padded to the longest (CPU tensors)."""
    lengths = np.fromiter((r.num_new_tokens for r in rows), dtype=np.int64, count=len(rows))
    starts = np.fromiter((r.start_position for r in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    valid = np.arange(width)[None, :] < lengths[:, None]                      # (B, T)
    input_ids = np.zeros((len(rows), width), dtype=np.int64)
    input_ids[valid] = [t for r in rows for t in r.input_ids]
    positions = np.where(valid, starts[:, None] + np.arange(width)[None, :], 0)
    tables = np.zeros((len(rows), max(len(r.block_table) for r in rows)), dtype=np.int64)
    for row, r in enumerate(rows):
        tables[row, :len(r.block_table)] = r.block_table
    blocks = np.take_along_axis(tables, positions // block_size_tokens, axis=1)
    slots = np.where(valid, blocks * block_size_tokens + positions % block_size_tokens, -1)
    metadata = PagedMetadata(torch.from_numpy(positions), torch.from_numpy(slots), torch.from_numpy(tables),
                             torch.from_numpy(starts + lengths), num_padding=int((~valid).sum()))
    return torch.from_numpy(input_ids), metadata


class ModelRunner:
    """Runs plans through `model` with `backend` over `kv`'s cache (see module docstring)."""

    def __init__(self, model: CausalLM, kv: KVManager, backend: AttentionBackend | None = None):
        self.model = model
        self.kv = kv
        self.backend = backend or default_backend()
        self.device = next(model.parameters()).device
        # MoE routing replay (R3): called with (row, experts (num_new_tokens, L, k) int64 numpy)
        # after each forward when set (the engine sets it for models with MoE layers)
        self.routing_sink: Callable[[ScheduledSequence, Any], None] | None = None

    def run(self, plan: StepPlan, weights: ProjectionPath | None = None) -> StepLogits:
        """The decode forward first, then the prefill forward (under the caller's inference mode)."""
        decodes = None
        if plan.has_drafts:
            decodes = self.forward(plan.decodes, "all", weights)
        elif plan.decodes:
            # a decode writes only its own last slot, in a block no other row reads (copy-on-write)
            decodes = self._bucketed(plan.decodes, [r.start_position + 1 for r in plan.decodes], weights,
                                     [list(range(len(plan.decodes)))])
        if plan.prefills and plan.has_scoring:
            return self._scoring_prefills(decodes, plan.prefills, weights)
        prefills = None
        if plan.prefills:
            prefills = self._bucketed(plan.prefills, [r.num_new_tokens for r in plan.prefills], weights,
                                      forward_waves(plan.prefills, self.kv.block_size_tokens))
        return StepLogits(decodes, prefills)

    def _bucketed(self, rows: tuple[ScheduledSequence, ...], widths: list[int],
                  weights: ProjectionPath | None, waves: list[list[int]]) -> torch.Tensor:
        """Logits (B, V) at each row's last new token, one forward per shape bucket of each wave,
        the waves in order (`forward_waves`)."""
        buckets = [[wave[i] for i in bucket] for wave in waves
                   for bucket in shape_buckets([widths[i] for i in wave])]
        if len(buckets) == 1:
            return self.forward(rows, "last", weights)
        out: torch.Tensor | None = None
        for bucket in buckets:
            logits = self.forward(tuple(rows[i] for i in bucket), "last", weights)
            if out is None:
                out = logits.new_empty((len(rows), logits.shape[-1]))
            out[torch.tensor(bucket, device=logits.device)] = logits
        assert out is not None
        return out

    def _scoring_prefills(self, decodes: torch.Tensor | None, rows: tuple[ScheduledSequence, ...],
                          weights: ProjectionPath | None) -> StepLogits:
        """The prefill forward of a plan with scoring rows: each row keeps its last new token's
        logits, and a scoring row every new position's from its logits_from on."""
        firsts = [r.start_position + r.num_new_tokens - 1 if r.logits_from is None
                  else min(max(r.start_position, r.logits_from), r.start_position + r.num_new_tokens - 1)
                  for r in rows]
        counts = [r.start_position + r.num_new_tokens - first for r, first in zip(rows, firsts)]
        columns = torch.arange(max(r.num_new_tokens for r in rows))
        low = torch.tensor([first - r.start_position for r, first in zip(rows, firsts)])
        high = torch.tensor([r.num_new_tokens for r in rows])
        keep = (columns[None, :] >= low[:, None]) & (columns[None, :] < high[:, None])        # (B, T)
        logits = self.forward(rows, keep, weights)                                           # (N, V)
        ends = list(itertools.accumulate(counts))
        last = logits[torch.tensor(ends, device=logits.device) - 1]                         # (B, V)
        scored = tuple((i, first, logits[end - count:end])
                       for i, (r, first, count, end) in enumerate(zip(rows, firsts, counts, ends))
                       if r.logits_from is not None)
        return StepLogits(decodes, last, scored)

    def forward(self, rows: tuple[ScheduledSequence, ...], keep: str | torch.Tensor,
                weights: ProjectionPath | None = None) -> torch.Tensor:
        """One forward of rows; keep="last": logits (B, V) at each row's last new token,
        keep="all": (B, T, V); a (B, T) bool mask: (N, V) at the positions it marks, row by row."""
        input_ids, metadata = paged_inputs(rows, self.kv.block_size_tokens)
        horizons = step_image_horizons(rows, metadata.positions)     # image runs read both ways (Gemma 3)
        if horizons is not None or self.device.type != "cpu":
            metadata = PagedMetadata(
                metadata.positions.to(self.device), metadata.slot_mapping.to(self.device),
                metadata.block_tables.to(self.device), metadata.context_lens.to(self.device),
                num_padding=metadata.num_padding, horizons=None if horizons is None else horizons.to(self.device))
        step = self.backend.bind(metadata, self.kv.kv_caches)
        keep_index = None
        if isinstance(keep, torch.Tensor):
            keep_index = keep.to(self.device)
        elif keep == "last":
            keep_index = torch.tensor([r.num_new_tokens - 1 for r in rows], device=self.device)
        images = step_image_rows(rows, input_ids)
        if self.routing_sink is None:
            return self.model(input_ids.to(self.device), paged=step, logits_to_keep=keep_index, weights=weights,
                              images=images)
        with routing_trace(cast(torch.nn.Module, self.model), record=True) as trace:   # a CausalLM is a Module
            logits = self.model(input_ids.to(self.device), paged=step, logits_to_keep=keep_index, weights=weights,
                                images=images)
        experts = trace.chosen_experts()                                       # (B*T, L, k)
        chosen = experts.view(len(rows), input_ids.shape[1], *experts.shape[1:]).cpu().numpy()
        for row, experts in zip(rows, chosen):
            self.routing_sink(row, experts[:row.num_new_tokens])
        return logits
