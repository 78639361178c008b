"""KV cache dtypes: how the paged cache stores keys and values, and what a token costs.

    spec = kv_dtype_spec("int8")                       # KVDtype; a bad name is an EngineError
    spec.bytes_per_token(config)                       # keys + values of every layer, scales included
    cache = spec.empty((num_blocks, block_size_tokens, Hkv, D), device)
    write_slots(cache, slots, values)                  # values (n, Hkv, D) into flat slots (n,)
    keys = gather_blocks(cache, block_ids, torch.float32)   # (len(ids), block_size_tokens, Hkv, D)

"float32" and "bfloat16" store the values as they are (a plain tensor: the cache the engine
always had, in another dtype). "int8" and "float8_e4m3" store 8-bit codes plus float32 scales
(`QuantizedKVCache`): value ~= code * scale, one scale per token, KV head and GROUP_DIMS dims
(one per head up to D = 64), the group's absolute maximum over the code's largest magnitude
(127 for int8, 448 for torch's float8_e4m3fn). Keys are rotated before they are quantized: the
cache stores k @ R for a fixed orthogonal R (Hadamard), and the backend multiplies the queries
by R too (`rotate_queries`), so q . k is unchanged while a few outlier channels (Llama-family
keys have them) are spread over every dim instead of setting the scale of all the others: on
SmolLM2 it cuts int8's logprob drift ~2.5x. The attention backend dequantizes what it gathers,
so the model only ever sees float keys and values.

Design note: per token, not per block. A scale per block written when the block fills would
leave a partial block either in full precision or re-scaled under the tokens already in it,
so what a key reads as would depend on when its block filled: one-step prefill, chunked
prefill, a prefix-cache hit, a preempted sequence recomputed, a draft rolled back and written
again would each see slightly different keys. With scales per (token, head, group) the stored
codes are a function of that token's float key alone, written once by the forward that
computes it (and read back by the same forward's queries, as by later steps'); every path
that computes the same float keys reads the same quantized ones
(tests/actors/generator/test_kv_dtype.py). The price is 4 bytes of scale per 64 code bytes
(6%), and copy-on-write copies codes and scales together. Per-block per-channel key scales
(KIVI) would fit outliers better still, at the cost of that exactness; the rotation gets most
of the way without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import EngineError

KV_DTYPE_NAMES = ("float32", "bfloat16", "int8", "float8_e4m3")
_SCALE_DTYPE = torch.float32
GROUP_DIMS = 64     # dims of a head that share one scale (the whole head when it is narrower)


class QuantizedKVCache:
    """One layer's keys (or values) as 8-bit codes with a scale per token, head and group of dims.

    Invariants: codes.shape == (num_blocks, block_size_tokens, Hkv, D); scales.shape ==
    (*codes.shape[:-1], D // group); the value at a slot is codes.float() * its group's scale,
    times rotation.T for a key cache (rotation: None for values); a slot never written reads 0
    (codes and scales start at zero)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, qmax: float,
                 rotation: torch.Tensor | None = None):
        self.codes = codes
        self.scales = scales
        self.qmax = qmax
        self.group = codes.shape[-1] // scales.shape[-1]
        self.rotation = rotation        # (D, D) orthogonal, keys only: what is stored is k @ rotation

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_cuda(self) -> bool:
        return self.codes.is_cuda

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of values (n, Hkv, D), rotated first for keys: scale = absmax over
        each group of dims / qmax, per (token, head, group)."""
        n, heads, dim = values.shape
        values = values.float()
        if self.rotation is not None:
            values = values @ self.rotation
        values = values.view(n, heads, dim // self.group, self.group)
        scales = values.abs().amax(dim=-1) / self.qmax                        # (n, Hkv, groups)
        scaled = (values / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).view(n, heads, dim)
        if self.codes.dtype == torch.int8:
            codes = scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        else:
            codes = scaled.clamp_(-self.qmax, self.qmax).to(self.codes.dtype)
        return codes, scales.to(_SCALE_DTYPE)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize values (n, Hkv, D) into flat slots (n,) (block_id * block_size + offset)."""
        codes, scales = self.quantize(values)
        heads, dim = self.codes.shape[2:]
        # index_copy_ has no float8 kernel on the CPU: copy the codes' bytes
        self.codes.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slots, codes.view(torch.uint8))
        self.scales.view(-1, heads, dim // self.group).index_copy_(0, slots, scales)

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized blocks block_ids (M,): (M, block_size_tokens, Hkv, D) in dtype (keys:
        still rotated; queries meet them through `rotate_queries`)."""
        codes = self.codes.index_select(0, block_ids)
        scales = self.scales.index_select(0, block_ids)                        # (M, S, Hkv, groups)
        values = decode_codes(codes)
        return values.view(*scales.shape, self.group).mul_(scales[..., None]).view(codes.shape).to(dtype)

    def copy_block(self, src: int, dst: int) -> None:
        self.codes[dst].copy_(self.codes[src])
        self.scales[dst].copy_(self.scales[src])


KVCache = torch.Tensor | QuantizedKVCache
_FLOAT8_VALUES: dict[torch.device, torch.Tensor] = {}   # device -> the 256 float8 codes' values


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 or float8_e4m3fn codes as float32 (a new tensor). On the CPU float8 goes through a
    256-entry table: torch's own float8 -> float32 cast there is ~6x slower than the lookup."""
    if codes.dtype == torch.int8 or codes.device.type != "cpu":
        return codes.to(torch.float32)
    table = _FLOAT8_VALUES.get(codes.device)
    if table is None:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(codes.dtype)
        table = _FLOAT8_VALUES[codes.device] = every.to(torch.float32, copy=True).to(codes.device)
    index = codes.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, index).view(codes.shape)


@dataclass(frozen=True)
class KVDtype:
    """A KV cache dtype: what one element is stored as, and its scale (None: stored as is)."""

    name: str
    storage: torch.dtype
    qmax: float | None = None        # the code's largest magnitude; None = no quantization

    @property
    def is_quantized(self) -> bool:
        return self.qmax is not None

    def bytes_per_token(self, config) -> int:
        """Bytes one token's keys and values take in every layer, scales included."""
        element = torch.empty((), dtype=self.storage).element_size()
        num_scales = num_groups(config.head_dim) if self.is_quantized else 0
        per_head = config.head_dim * element + num_scales * _SCALE_DTYPE.itemsize
        return 2 * config.num_layers * config.num_kv_heads * per_head

    def empty(self, shape: tuple[int, ...], device: torch.device | str = "cpu",
              keys: bool = False) -> KVCache:
        """A zeroed cache of (num_blocks, block_size_tokens, Hkv, D); quantized keys are rotated."""
        codes = torch.zeros(shape, dtype=self.storage, device=device)
        if self.qmax is None:   # not is_quantized
            return codes
        scales = torch.zeros((*shape[:-1], num_groups(shape[-1])), dtype=_SCALE_DTYPE, device=device)
        rotation = orthogonal_rotation(shape[-1]).to(device) if keys else None
        return QuantizedKVCache(codes, scales, self.qmax, rotation)


def orthogonal_rotation(dim: int) -> torch.Tensor:
    """A fixed (dim, dim) orthogonal matrix that spreads each coordinate over all of them: the
    normalised Sylvester Hadamard matrix when dim is a power of 2, else a seeded random one."""
    if dim & (dim - 1) == 0:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < dim:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
        return matrix / dim ** 0.5
    gaussian = torch.randn(dim, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate_queries(key_cache: KVCache, q: torch.Tensor) -> torch.Tensor:
    """q (..., D) in the space the key cache's gathered keys are in (unchanged for a plain cache)."""
    rotation = getattr(key_cache, "rotation", None)
    return q if rotation is None else (q.float() @ rotation).to(q.dtype)


def num_groups(head_dim: int) -> int:
    """Scales per token and head: one per GROUP_DIMS dims, or one for a head that is not a multiple."""
    return head_dim // GROUP_DIMS if head_dim % GROUP_DIMS == 0 else 1


_SPECS = {
    "float32": KVDtype("float32", torch.float32),
    "bfloat16": KVDtype("bfloat16", torch.bfloat16),
    "int8": KVDtype("int8", torch.int8, 127.0),
    "float8_e4m3": KVDtype("float8_e4m3", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
}


def kv_dtype_spec(name: str | None, model_dtype: torch.dtype = torch.float32) -> KVDtype:
    """The KVDtype called `name`; None = the model's own dtype, stored as is."""
    if name is None:
        return KVDtype(str(model_dtype).removeprefix("torch."), model_dtype)
    if name not in _SPECS:
        raise EngineError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {name!r}; "
                          "'float32' keeps the cache exact")
    return _SPECS[name]


def write_slots(cache: KVCache, slots: torch.Tensor, values: torch.Tensor) -> None:
    """values (n, Hkv, D) into the cache's flat slots (n,), quantized where the cache is."""
    if isinstance(cache, QuantizedKVCache):
        cache.write(slots, values)
    else:
        heads, dim = cache.shape[2:]
        cache.view(-1, heads, dim).index_copy_(0, slots, values.to(cache.dtype))


def gather_blocks(cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks block_ids (M,) as (M, block_size_tokens, Hkv, D) in dtype, dequantized."""
    if isinstance(cache, QuantizedKVCache):
        return cache.gather(block_ids, dtype)
    return cache.index_select(0, block_ids).to(dtype)


def copy_block(cache: KVCache, src: int, dst: int) -> None:
    """Block dst holds block src's keys or values (codes and scales) afterwards."""
    if isinstance(cache, QuantizedKVCache):
        cache.copy_block(src, dst)
    else:
        cache[dst].copy_(cache[src])
