"""A LoRA adapter on the unembedding (lm_head): what `lora_config.train_unembed` trains.

    head = HeadAdapter(model.lm_head.weight, rank=8, alpha=32.0, seed=0)
    weight = head.weight(model.lm_head.weight)        # W + scale * B @ A, differentiable in A and B
    head.named_parameters()                           # {"lm_head.weight.lora_A": (r, H), ".lora_B": (V, r)}

Design note. The tenants' logprob head reads the head's weight directly (rl_ops' chunked
log-softmax over the vocabulary, never a (tokens x V) block), so a forward hook cannot adapt
it, as it adapts the attention and MLP projections (actors/learner/lora.py). The adapter
instead gives the head's effective weight, W + scale * B @ A (V x H), which the tenant's head
reads in W's place; autograd carries the head's gradient to A and B. The init is LoRA's (A
kaiming-uniform from the seed, B zero: the adapter starts as the identity), the merge
`merge_lora`'s, so a sampler holds the very weight trained. A base whose head is tied to its
embedding (SmolLM2) keeps its input embedding: only the unembedding is adapted, and the
sampler's model unties the two (`untied_config`).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..models.config import ModelConfig
from ..weights.patch import merge_lora
from .errors import TinkerAPIError

HEAD = "lm_head"
KEY_A, KEY_B = f"{HEAD}.weight.lora_A", f"{HEAD}.weight.lora_B"


class HeadAdapter:
    """A (rank, H) and B (V, rank), float32 parameters on the head's device (module docstring)."""

    def __init__(self, head_weight: torch.Tensor, rank: int, alpha: float, seed: int):
        vocab, hidden = head_weight.shape
        self.scale = alpha / rank
        generator = torch.Generator().manual_seed(seed + 1)      # the body's adapter draws from `seed`
        a = torch.empty(rank, hidden)
        bound = 1 / math.sqrt(hidden)                             # kaiming_uniform(a=sqrt(5)), as LoRA's
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(head_weight.device))
        self.lora_B = nn.Parameter(torch.zeros(vocab, rank, device=head_weight.device))

    def parameters(self) -> list[nn.Parameter]:
        return [self.lora_A, self.lora_B]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {KEY_A: self.lora_A, KEY_B: self.lora_B}

    def weight(self, base: torch.Tensor) -> torch.Tensor:
        """The head's effective weight (V, H) in base's dtype, differentiable in A and B."""
        return (base.detach().float() + (self.lora_B @ self.lora_A) * self.scale).to(base.dtype)

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """The same weight as a new tensor without gradient, merged as every LoRA weight is."""
        return merge_lora(base, self.lora_A, self.lora_B, self.scale)

    def load_adapters(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy A and B in (by `named_parameters` keys); TinkerAPIError 400 naming a missing or
        misshapen one."""
        for key, p in self.named_parameters().items():
            if key not in tensors or tuple(tensors[key].shape) != tuple(p.shape):
                raise TinkerAPIError(400, f"{source}: adapter {key} is missing or misshapen (want {tuple(p.shape)})")
        with torch.no_grad():
            for key, p in self.named_parameters().items():
                p.copy_(tensors[key].to(p.device))


def untied_config(config: ModelConfig) -> ModelConfig:
    """`config` with its own head weight (a tied base whose unembedding is adapted)."""
    return dataclasses.replace(config, tie_word_embeddings=False) if config.tie_word_embeddings else config
