"""Attention backends: how a step's new keys and values reach the paged KV cache and how its
queries attend over it.

    metadata = PagedMetadata(positions, slot_mapping, block_tables, context_lens)
    step = GatherSdpaBackend().bind(metadata, kv_manager.kv_caches)
    logits = model(input_ids, paged=step, ...)      # each layer calls step.attend(layer, q, k, v)

The seam. The model (`postrain.actors.models.blocks.PagedAttention`) only hands each layer's
rotated q, k, v for the step's new tokens to the bound step; a backend decides how keys and
values are stored and read. `GatherSdpaBackend` is the CPU one: scatter the new k/v into
their slots, gather every sequence's blocks back into a dense (B, L) view, and run SDPA
with a causal mask on absolute positions (each image run of a model whose images attend both ways
seeing all of itself: `PagedMetadata.horizons`), narrowed to the layer's sliding window where the
model passes one (`attend(..., window=)`: Mistral, Gemma 3's local layers; such a layer
gathers only the blocks its window reaches). The model may also pass a logits `scale` and a
`softcap`. The cache may be quantized (`kv_dtype`: int8 or float8 codes with a scale per token
and KV head): the backend quantizes what it writes and dequantizes what it gathers, so a
query reads its own step's keys as stored, as later steps will; quantized keys are stored
rotated and the queries are rotated to meet them (`kv_dtype.rotate_queries`). A fused
paged-attention kernel is a second `AttentionBackend` whose `bind` returns an object
reading the cache through `block_tables`/`context_lens` directly (no gather): on the CPU,
`PagedDecodeBackend` (the default, `default_backend()`) does so for decode steps with the
compiled kernel of `postrain.ext._paged_decode` and leaves every other step to the gather; the
runner takes another as `backend=`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..models.blocks import PagedAttention, group_mask, grouped_attention
from ..models.config import ModelConfigError
from ..models.exact import exact_attention
from .kv_dtype import KVCache, gather_blocks, rotate_queries, write_slots

try:
    from postrain.ext._paged_decode import paged_decode_attention
except ImportError:          # a source tree whose extensions were not built: the gather only
    paged_decode_attention = None

KVCaches = list[tuple[KVCache, KVCache]]
# one (key, value) per layer, each (num_blocks, block_size_tokens, num_kv_heads, head_dim): a
# tensor, or 8-bit codes with per-token scales (`kv_dtype.QuantizedKVCache`)


@dataclass(frozen=True)
class PagedMetadata:
    """Where one forward's new tokens go in the paged cache, and what each sequence sees.

    Shapes: B sequences, T = the most new tokens any of them has (1 for pure decode).
    Invariants: positions[b, :n_b] == context_lens[b] - n_b + arange(n_b) for the n_b real
    tokens of row b; padding columns carry slot -1 (never written) and position 0; every
    slot of row b lies in a block of block_tables[b] (tests/actors/generator/test_attention.py).
    """

    positions: torch.Tensor        # (B, T) int64 absolute positions of the new tokens
    slot_mapping: torch.Tensor     # (B, T) int64 block_id * block_size_tokens + offset; -1 = padding
    block_tables: torch.Tensor     # (B, max_blocks) int64 block ids, padded with 0
    context_lens: torch.Tensor     # (B,) int64 tokens in the cache after this step's writes
    num_padding: int = -1          # slots equal to -1; -1 = count them
    horizons: torch.Tensor | None = None   # (B, T) int64 the last key position each new token sees: its own,
                                   # or its run's last for an image run read both ways (Gemma 3:
                                   # images.py `step_image_horizons`); None = positions (causal)

    def __post_init__(self):
        if self.num_padding < 0:
            object.__setattr__(self, "num_padding", int((self.slot_mapping < 0).sum()))


class AttentionBackend(ABC):
    """One way to store and attend over the paged KV cache. Stateless across steps: all of a
    step's state lives in the object `bind` returns."""

    @abstractmethod
    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> PagedAttention:
        """The step's attention: `attend(layer_idx, q, k, v, window=, scale=, softcap=)` writes
        k, v (B, T, Hkv, D) at `metadata.slot_mapping` in `kv_caches[layer_idx]` and returns q's
        attention output (B, T, H, D) over each sequence's cached keys (query at position p sees
        positions j <= p, or j <= its horizon where `metadata.horizons` is set, and p - j < window
        when the layer has a window)."""


class GatherSdpaBackend(AttentionBackend):
    """The CPU backend: index_copy the new k/v into their slots, index_select each sequence's
    blocks, grouped-query SDPA with an additive causal bias built once per step."""

    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> "GatherSdpaStep":
        return GatherSdpaStep(metadata, kv_caches)


class GatherSdpaStep:
    """`GatherSdpaBackend` bound to one forward. Invariant: `_views` maps each window (None =
    full attention) a layer of this step attended with to the blocks its rows gather, (B * W,)
    block ids, and its (B, 1, G*T, W * block_size) bias; built by the first such layer and
    reused by every later one. A full layer gathers every block of the tables; a sliding layer
    only the blocks from the one holding its earliest visible key (`_window_blocks`)."""

    def __init__(self, metadata: PagedMetadata, kv_caches: KVCaches):
        self.metadata = metadata
        self.positions = metadata.positions
        self.kv_caches = kv_caches
        self._views: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        # Where every layer writes, found once per step: the real new tokens' rows of the
        # flattened (B * T) batch (None: all of them, as in a pure decode) and their slots.
        slots = metadata.slot_mapping.reshape(-1)                                          # (B * T,)
        self._real_rows: torch.Tensor | None = None
        if metadata.num_padding:
            self._real_rows = (slots >= 0).nonzero().squeeze(1)                            # (N,)
            slots = slots.index_select(0, self._real_rows)
        self._slots = slots                                                                # (N,)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        view = self._views.get(window)
        if view is None:
            view = self._views[window] = self._view(q.shape[2] // k.shape[2], q.dtype, window)
        tables, bias = view
        cache = self.kv_caches[layer_idx]
        keys, values = self._write_and_gather(k, v, cache, tables)             # (B, L, Hkv, D)
        q = rotate_queries(cache[0], q)          # quantized keys are stored rotated (kv_dtype.py)
        out = grouped_attention(q, keys, values, bias, scale, softcap)         # (B, T, Hkv, G, D)
        return out.reshape(q.shape)                                            # (B, T, H, D)

    def _write_and_gather(self, k, v, cache: tuple[KVCache, KVCache], flat_tables: torch.Tensor):
        key_cache, value_cache = cache
        _, _, heads, dim = key_cache.shape
        new_k, new_v = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)                # (B * T, Hkv, D)
        if self._real_rows is not None:                                                    # padding: dropped
            new_k, new_v = new_k.index_select(0, self._real_rows), new_v.index_select(0, self._real_rows)
        write_slots(key_cache, self._slots, new_k)      # quantized here for an int8 / float8 cache
        write_slots(value_cache, self._slots, new_v)
        shape = (self.metadata.block_tables.shape[0], -1, heads, dim)                        # (B, L, Hkv, D)
        gathered_k = gather_blocks(key_cache, flat_tables, k.dtype).view(shape)
        gathered_v = gather_blocks(value_cache, flat_tables, v.dtype).view(shape)
        return gathered_k, gathered_v

    def _window_blocks(self, window: int | None) -> torch.Tensor:
        """(B, W) indices into each row's block table: all of them for full attention; for a
        window, W consecutive ones from the block holding the row's earliest visible key (its
        first new token's position - window + 1). Indices past a row's table are left past
        it: their keys' positions exceed every query's, so the bias hides them."""
        tables = self.metadata.block_tables
        num_blocks = tables.shape[1]
        every = torch.arange(num_blocks, device=tables.device)
        if window is None:
            return every.expand(tables.shape[0], -1)
        block_size = self.kv_caches[0][0].shape[1]
        first = (self.positions[:, 0] - window + 1).clamp(min=0) // block_size             # (B,)
        last = (self.metadata.context_lens - 1).clamp(min=0) // block_size
        width = int((last - first).max()) + 1
        if width >= num_blocks:
            return every.expand(tables.shape[0], -1)
        return first[:, None] + every[None, :width]                                        # (B, W)

    def _view(self, groups: int, dtype: torch.dtype, window: int | None):
        """(flat block ids (B * W,), (B, 1, groups * T, W * block_size) additive bias (0 or -inf)):
        query t sees cached key j iff j <= its position (and position - j < window)."""
        block_size = self.kv_caches[0][0].shape[1]
        positions, tables = self.positions, self.metadata.block_tables
        index = self._window_blocks(window)                                                # (B, W)
        flat = tables.gather(1, index.clamp(max=tables.shape[1] - 1)).reshape(-1)
        offsets = torch.arange(block_size, device=positions.device)
        keys = (index[:, :, None] * block_size + offsets).reshape(index.shape[0], 1, -1)  # (B, 1, L)
        horizons = positions if self.metadata.horizons is None else self.metadata.horizons
        visible = keys <= horizons[:, :, None]                                 # (B, T, L)
        if window is not None:
            visible = visible & (positions[:, :, None] - keys < window)
        visible[:, :, 0] |= self.metadata.slot_mapping < 0                     # padding: never an empty row
        return flat, self._bias(group_mask(visible[:, None], groups), dtype)

    @staticmethod
    def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))


class PagedDecodeBackend(AttentionBackend):
    """The CPU default: a decode step (one new token a row, none of them padding, causal) over
    plain float32 caches on the CPU attends with the compiled kernel, which reads each row's
    blocks where they lie (no gather, no bias; `postrain.ext._paged_decode`); every other step
    (prefill, a quantized cache, an image run read both ways, another dtype or device) binds
    `GatherSdpaStep`. The kernel's outputs differ from SDPA's in the last bits only (its sums
    run in another order; tests/actors/generator/test_paged_decode.py)."""

    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> "GatherSdpaStep | PagedDecodeStep":
        # Every layer's caches are made alike (kv_manager.new_kv_caches): the first key cache speaks for all.
        key_cache = kv_caches[0][0]
        if (metadata.positions.shape[1] == 1 and metadata.num_padding == 0 and metadata.horizons is None
                and isinstance(key_cache, torch.Tensor) and key_cache.dtype == torch.float32
                and key_cache.device.type == "cpu" and key_cache.is_contiguous() and key_cache.shape[3] % 8 == 0):
            return PagedDecodeStep(metadata, kv_caches)
        return GatherSdpaStep(metadata, kv_caches)


def default_backend() -> AttentionBackend:
    """`PagedDecodeBackend` where the compiled kernel is built, else `GatherSdpaBackend`."""
    return GatherSdpaBackend() if paged_decode_attention is None else PagedDecodeBackend()


class PagedDecodeStep:
    """`PagedDecodeBackend` bound to one decode step: each layer writes its new keys and values
    at their slots, then the kernel attends (a layer whose q is not float32 takes the gather)."""

    def __init__(self, metadata: PagedMetadata, kv_caches: KVCaches):
        self.metadata = metadata
        self.kv_caches = kv_caches
        self.positions = metadata.positions                                                # (B, 1)
        self._slots = metadata.slot_mapping.reshape(-1)                                    # (B,)
        self._tables = metadata.block_tables.contiguous().numpy()
        self._lens = metadata.context_lens.contiguous().numpy()
        self._fallback: GatherSdpaStep | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if q.dtype != torch.float32:
            self._fallback = self._fallback or GatherSdpaStep(self.metadata, self.kv_caches)
            return self._fallback.attend(layer_idx, q, k, v, window=window, scale=scale, softcap=softcap)
        key_cache, value_cache = self.kv_caches[layer_idx]
        assert isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)   # bind checked
        batch, _, heads, dim = q.shape
        write_slots(key_cache, self._slots, k.reshape(batch, *k.shape[2:]))
        write_slots(value_cache, self._slots, v.reshape(batch, *v.shape[2:]))
        out = torch.empty(batch, 1, heads, dim)
        paged_decode_attention(q.reshape(batch, heads, dim).contiguous().numpy(), key_cache.numpy(),
                               value_cache.numpy(), self._tables, self._lens, out.view(batch, heads, dim).numpy(),
                               dim ** -0.5 if scale is None else scale, window or 0, softcap or 0.0)
        return out


class ExactGatherBackend(AttentionBackend):
    """The backend of `exact = true`: the same cache writes and gathers as `GatherSdpaBackend`,
    then `models.exact.exact_attention` over every cached key by absolute position, so each
    query's output has the bits the learner's `ExactSelfAttention` gives it."""

    def bind(self, metadata: PagedMetadata, kv_caches: KVCaches) -> "ExactGatherStep":
        return ExactGatherStep(metadata, kv_caches)


class ExactGatherStep(GatherSdpaStep):
    """`ExactGatherBackend` bound to one forward. Every layer gathers all of its rows' blocks
    (a gathered key's index is its position); keys at or past a row's context length are not real."""

    def __init__(self, metadata: PagedMetadata, kv_caches: KVCaches):
        if metadata.horizons is not None:
            raise ModelConfigError("exact = true does not cover image runs that attend both ways (Gemma 3); "
                                   "set exact = false for this policy")
        super().__init__(metadata, kv_caches)
        self._all_blocks = metadata.block_tables.reshape(-1)                      # (B * max_blocks,)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        keys, values = self._write_and_gather(k, v, self.kv_caches[layer_idx], self._all_blocks)  # (B, L, Hkv, D)
        real = torch.arange(keys.shape[1], device=keys.device)[None] < self.metadata.context_lens[:, None]
        return exact_attention(q, keys, values, self.positions, None, real,   # key j is at position j
                               window=window, scale=scale, softcap=softcap)
