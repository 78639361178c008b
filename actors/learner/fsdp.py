"""The sharded learner: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the learner's ranks.

    learner = { strategy = "fsdp", activation_checkpointing = true }   # with ranks = N on the spec

    shard_policy(model, mesh)               # one FSDP unit per decoder layer, the rest in the root
    full_weights(model, keep=rank == 0)     # the whole weights, gathered one tensor at a time
    local_bytes(tensor)                     # this rank's bytes of a tensor (its shard of a DTensor)

Design note. Each decoder layer is one FSDP unit and the root (embeddings, final norm, LM
head, tied or not) is another, all over a 1-D device mesh of the learner's ranks: a rank
holds 1/N of every parameter, of its gradient and of its AdamW moments, and gathers one
layer's parameters at a time for that layer's forward and backward. The learner calls
other methods than `forward` (`hidden_states`, `shared_prefix_hidden_states`, each layer's
`forward_shared`): they are registered as FSDP forward methods, so they gather and free
exactly as `forward` does. The root is not resharded after its forward (FSDP2's rule for
the root), so the LM head's weight the learner reads right after `hidden_states` is the
gathered one, and its gradient is reduce-scattered with the root's at the end of backward.
Gradients are reduced with divide factor 1 (a SUM): every micro-batch's loss already uses
the whole batch's normalisers over all ranks, so the result equals data parallel's summed
all-reduce and one process on the whole batch (tests/actors/learner/test_learner_fsdp.py pins it).
With LoRA the frozen base is sharded and the adapters stay whole on every rank (their
gradients are all-reduced as under "ddp"). On a GPU with `autocast_dtype` set, FSDP's mixed
precision gathers parameters in that dtype and reduces gradients in float32.
Invariant: after any public call returns, every unit is resharded (a rank holds its shard).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from ..models.llama import LlamaModel

STRATEGIES = ("ddp", "fsdp")


def layers_of(model: LlamaModel) -> list[nn.Module]:
    """The decoder layers (one FSDP unit each)."""
    return list(model.model.layers)


def checkpoint_layers(model: LlamaModel) -> None:
    """Activation checkpointing per decoder layer: each layer's `forward` and `forward_shared`
    keep only their inputs and recompute the layer in backward (non-reentrant, exact)."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers_of(model):
        for method in ("forward", "forward_shared"):
            inner = getattr(layer, method)
            setattr(layer, method, functools.wraps(inner)(
                functools.partial(checkpoint, inner, use_reentrant=False)))


def device_mesh(process_group, device: torch.device):
    """A 1-D mesh over the ranks of `process_group` (None: the default group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = process_group or dist.group.WORLD
    assert group is not None, "torch.distributed is initialised (the learner's group joined)"
    return DeviceMesh.from_group(group, device.type)


def shard_policy(model: LlamaModel, mesh, mixed_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` in place over `mesh` (module docstring); returns it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs = {"mesh": mesh}
    if mixed_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_dtype, reduce_dtype=torch.float32)
    for layer in layers_of(model):
        fully_shard(layer, **kwargs)
        register_fsdp_forward_method(layer, "forward_shared")
        _sum_gradients(layer)
    fully_shard(model, **kwargs)
    for method in ("hidden_states", "shared_prefix_hidden_states"):
        register_fsdp_forward_method(model, method)
    _sum_gradients(model)
    return model


def _sum_gradients(unit) -> None:
    """Reduce-scatter gradients as a plain SUM: divide factor 1, and no PREMUL_SUM op (which
    gloo lacks: 'Cannot use ReduceOp.PREMUL_SUM with Gloo')."""
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> TypeGuard[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module | None) -> None:
    """Free what a forward without backward left gathered (the root's parameters)."""
    if model is not None and is_sharded(model):
        model.reshard()


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it); a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_weights(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's whole weights by Hugging Face name, on the CPU, gathered one tensor at a time
    (every rank calls it: each gather is a collective). `keep` False (ranks other than 0): the
    gathered tensor is dropped at once and {} is returned, so no rank holds more than one
    tensor beyond its shard on the device, and only the keeping rank holds the whole on the host."""
    reshard(model)
    out = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():
            whole = full_tensor(value.detach())
            if keep:
                out[name] = whole.to("cpu", copy=True) if whole.device.type != "cpu" else whole.clone()
            del whole
    return out


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (whole, the same on every rank) distributed as `param` (a DTensor) is: this rank's
    shard of it, as a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or value.dim() == 0:
        return value
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def grad_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
    """The global gradient norm over all ranks' shards, after clipping to max_norm (None: no clip)."""
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf") if max_norm is None else max_norm)
    return float(full_tensor(norm))


def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes this rank holds of `tensor` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()
