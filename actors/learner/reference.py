"""KLReference: the frozen model the KL term is taken against.

    ref = KLReference.build(config, policy, device, dtype)   # None, "initial", "warm_start" or a spec
    ref.model                                                # the frozen module, or None
    ref.freeze_from(policy_weights)                          # "warm_start": once, at the first RL step

Invariant: `model` never has a gradient; `frozen` is False only for a "warm_start" reference
that has not yet been taken (checkpoints keep the flag and the weights).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models.loading import build_policy
from .config import LearnerConfig

if TYPE_CHECKING:
    from ..models.llama import LlamaModel


class KLReference:
    """The frozen KL reference and whether it has been taken."""

    def __init__(self, model: LlamaModel | None, frozen: bool):
        self.model = model
        self.frozen = frozen

    @classmethod
    def build(cls, config: LearnerConfig, policy: LlamaModel, device: torch.device,
              dtype: torch.dtype) -> "KLReference":
        spec = config.reference_model
        if spec is None:
            return cls(None, frozen=True)
        if spec in ("initial", "warm_start"):     # "warm_start": overwritten by freeze_from
            model = type(policy).empty(policy.config).to(device=device, dtype=dtype)
            model.load_state_dict(policy.state_dict())
        else:
            model, _ = build_policy(spec, config.seed, dtype, str(device))
        for p in model.parameters():
            p.requires_grad_(False)
        return cls(model.eval(), frozen=spec != "warm_start")

    def freeze_from(self, policy_weights: dict[str, torch.Tensor]) -> None:
        """The reference becomes `policy_weights` (the policy as it is now, LoRA merged), once."""
        assert self.model is not None, "freeze_from takes a warm_start reference, which has its model (build)"
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(policy_weights[name])
        self.frozen = True
