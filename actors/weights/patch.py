"""Weight syncs that are not the whole weights: LoRA adapters and element deltas, both ends.

    merged = merge_lora(base, lora_A, lora_B, scale)             # the one merge both ends run
    encoded, num_changed = encode_delta(old, new)                # learner: what changed since `old`
    weights = WeightPatcher().resolve(sync, held_version, current)   # receiver: the whole weights

A patch (`WeightSync.patch`, records/weights.py) is one of two kinds:

- "lora": `weights` holds the adapters, "<hf name>.lora_A" (rank, in) and "<hf name>.lora_B"
  (out, rank) of each adapted weight "<hf name>" (e.g. "model.layers.0.self_attn.q_proj.weight"
  has "model.layers.0.self_attn.q_proj.weight.lora_A"). With `base_version` None it also holds
  every base tensor (the first, full LoRA sync): the receiver keeps a copy of the adapted base
  tensors and from then on merges each sync's adapters into them. Adapters are absolute (not
  increments), so any later adapter sync applies, whatever version the receiver missed.
- "delta": the elements whose value changed since `base_version`, per tensor as
  "<name>#idx" (int32 or int64 flat indices) + "<name>#val", or "<name>#mask" (a packed
  bitmask, uint8) + "<name>#val", whichever is smaller, or "<name>" whole when that is smaller
  still; unchanged tensors are absent. It applies only to the weights of `base_version`.

Invariant (tests/actors/learner/test_delta_sync.py, test_lora.py): a receiver loads a patch
only when `weights_digest` of the whole result equals `patch.digest`, the learner's digest of
the weights it published; otherwise `resolve` raises PatchRefused, the receiver keeps what it
held, and the learner sends the whole weights instead. "Changed" is bitwise, in the dtype the
weights travel in, so -0.0 vs 0.0 and NaN payloads count.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .messages import weights_digest
from ..records import WeightSync

LORA_SUFFIXES = (".lora_A", ".lora_B")


class PatchRefused(ValueError):
    """A patch this receiver cannot apply (it lacks the base, or the result's digest differs);
    the message names why. The learner answers with a full sync."""


def merge_lora(base: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """base + scale * (B @ A), in float32, rounded to base's dtype: a new tensor (PEFT's merge).
    base (out, in); lora_A (rank, in); lora_B (out, rank). The learner and every receiver merge
    with this one function, so their weights agree bit for bit on one kind of device."""
    delta = (lora_B.detach().float() @ lora_A.detach().float()) * scale          # (out, in)
    return (base.detach().float() + delta.to(base.device)).to(base.dtype)


def split_lora(weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the plain tensors, {adapted name: (lora_A, lora_B)}) of a "lora" sync's weights."""
    plain = {k: v for k, v in weights.items() if not k.endswith(LORA_SUFFIXES)}
    adapters = {k[:-len(".lora_A")]: (v, weights[k[:-len(".lora_A")] + ".lora_B"])
                for k, v in weights.items() if k.endswith(".lora_A")}
    return plain, adapters


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as same-width integers (bitwise comparison), flat."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(-1).view(ints)


def encode_delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[dict, int]:
    """(the "delta" patch weights from `old` to `new`, number of changed elements). Both hold the
    same names, shapes and dtypes (else ValueError); per tensor the smallest encoding wins."""
    if old.keys() != new.keys():
        raise ValueError(f"a delta needs the same tensors on both sides; differ: "
                         f"{sorted(old.keys() ^ new.keys())[:5]}")
    out, num_changed = {}, 0
    for name, t in new.items():
        before = old[name]
        if before.shape != t.shape or before.dtype != t.dtype:
            raise ValueError(f"tensor {name} changed shape or dtype ({before.dtype}{tuple(before.shape)} -> "
                             f"{t.dtype}{tuple(t.shape)}); send a full sync")
        changed = _bits(before) != _bits(t)                                          # (N,)
        count = int(changed.sum())
        if count == 0:
            continue
        num_changed += count
        numel, esize = t.numel(), t.element_size()
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        index_bytes = count * (index_dtype.itemsize + esize)
        mask_bytes = (numel + 7) // 8 + count * esize
        if min(index_bytes, mask_bytes) >= numel * esize:
            out[name] = t.detach().clone()
            continue
        flat = t.detach().contiguous().view(-1)
        out[f"{name}#val"] = flat[changed].clone()
        if index_bytes <= mask_bytes:
            out[f"{name}#idx"] = changed.nonzero().view(-1).to(index_dtype)
        else:
            out[f"{name}#mask"] = torch.from_numpy(np.packbits(changed.numpy()))
    return out, num_changed


def apply_delta(current: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`current` with a "delta" patch applied: changed tensors are new tensors, the others are
    `current`'s own. PatchRefused for a name, size or dtype that does not fit."""
    out = dict(current)
    for key, value in delta.items():
        name, _, part = key.partition("#")
        if name not in current:
            raise PatchRefused(f"the delta names tensor {name!r}, which this receiver does not hold")
        held = current[name]
        if part == "":
            if value.shape != held.shape:
                raise PatchRefused(f"the delta's whole {name} has shape {tuple(value.shape)}, held "
                                   f"{tuple(held.shape)}")
            out[name] = value.to(held.device)
            continue
        if part == "val":
            continue
        values = delta.get(f"{name}#val")
        if values is None or values.dtype != held.dtype:
            raise PatchRefused(f"the delta of {name} has no values in {held.dtype} (got "
                               f"{None if values is None else values.dtype}); the receiver's weights "
                               "must be in the dtype the learner publishes")
        if part == "idx":
            index = value.to(torch.int64)
        elif part == "mask":
            bits = np.unpackbits(value.numpy(), count=held.numel()).astype(bool)
            index = torch.from_numpy(np.flatnonzero(bits))
        else:
            raise PatchRefused(f"the delta has tensor {key!r} of unknown part {part!r}")
        if index.numel() != values.numel() or (index.numel() and int(index.max()) >= held.numel()):
            raise PatchRefused(f"the delta of {name} has {index.numel()} positions for {values.numel()} "
                               f"values in {held.numel()} elements")
        patched = held.detach().clone()
        patched.view(-1)[index.to(held.device)] = values.to(held.device)
        out[name] = patched
    return out


class WeightPatcher:
    """The receiving side of patches: turns a sync into the whole weights to load.

    Invariant: `lora_base` is None, or the base tensors of the adapted weights of the last full
    "lora" sync (copies, in the dtype they came in); a plain full sync forgets it."""

    def __init__(self):
        self.lora_base: dict[str, torch.Tensor] | None = None

    def resolve(self, sync: WeightSync, weights: dict, held_version: int,
                current: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The whole weights `sync` (already assembled into `weights`) stands for. `current()`:
        the weights held now ({name: tensor}, no tied duplicate). Raises PatchRefused (nothing
        changes) when the patch cannot apply or its result's digest differs."""
        patch = sync.patch
        if patch is None:
            self.lora_base = None
            return weights
        if patch.dtype is not None:       # the receiver's weights in the travel dtype (exact when they came in it)
            dtype, held = getattr(torch, patch.dtype), current
            current = lambda: {k: v.to(dtype) for k, v in held().items()}  # noqa: E731
        if patch.kind == "lora":
            plain, adapters = split_lora(weights)
            if patch.base_version is None:
                base = {name: plain[name].detach().clone() for name in adapters if name in plain}
                full = plain
            elif self.lora_base is None:
                raise PatchRefused(f"adapters of version {sync.version} came, but this receiver holds no "
                                   "LoRA base (it missed the first full sync): publish a full sync")
            else:
                base, full = self.lora_base, dict(current())
            missing = sorted(set(adapters) - set(base))
            if missing:
                raise PatchRefused(f"adapters for {missing[:3]}, which the LoRA base lacks: publish a full sync")
            assert patch.lora_scale is not None, "a 'lora' patch has its lora_scale (WeightPatch._check)"
            full.update({name: merge_lora(base[name], a, b, patch.lora_scale) for name, (a, b) in adapters.items()})
        else:
            if patch.base_version != held_version:
                raise PatchRefused(f"a delta from version {patch.base_version} to {sync.version} came, but this "
                                   f"receiver holds version {held_version}: publish a full sync")
            base, full = None, apply_delta(current(), weights)
        digest = weights_digest(full)
        if digest != patch.digest:
            raise PatchRefused(f"the {patch.kind} patch to version {sync.version} gives weights of digest "
                               f"{digest[:12]}, the learner's are {patch.digest[:12]}: refused, publish a full sync")
        if patch.kind == "lora" and patch.base_version is None:
            self.lora_base = base
        return full
