"""Qwen3-MoE (HF `model_type` "qwen3_moe"): Qwen3's attention (q/k norm, explicit head_dim)
with a routed mixture of experts (`moe.SparseMoeBlock`) as the MLP of every layer i with
(i + 1) % decoder_sparse_step == 0 that is not in `mlp_only_layers`; the others keep a dense
SwiGLU of `intermediate_size`.

Weights. In memory the experts are stacked (`mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I), transformers 5's layout); on disk they are Hugging Face's
per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...), what the Hub's Qwen3-MoE
checkpoints hold and what `transformers` writes: `state_from_hf` / `state_to_hf` convert.
Both layouts load. The router is `mlp.gate.weight` (E, H).

Supported config.json fields beyond Qwen3's: num_experts (or num_local_experts),
num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
mlp_only_layers, router_aux_loss_coef (kept; the learner's own `router_aux_loss_coef` turns
the loss on). Refused: use_sliding_window = true.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from .config import ModelConfig, ModelConfigError
from .moe import SparseMoeBlock
from .qwen3 import Qwen3Model

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeModel(Qwen3Model):
    """A Qwen3-MoE causal LM. Invariant: `model.layers[i].mlp` is a SparseMoeBlock exactly for
    i in config.moe_layers, whose moe_index is its position in that tuple."""

    def __init__(self, config: ModelConfig):
        if config.num_experts <= 0:
            raise ModelConfigError("a qwen3_moe model needs num_experts > 0 (and num_experts_per_tok, "
                                   "moe_intermediate_size); for a dense model use model_type 'qwen3'")
        super().__init__(config)
        for moe_index, layer_idx in enumerate(config.moe_layers):
            self.model.layers[layer_idx].mlp = SparseMoeBlock(config, moe_index)

    @staticmethod
    def config_fields_from_hf(hf: dict) -> dict:
        fields = Qwen3Model.config_fields_from_hf(hf)
        num_experts: Any = hf.get("num_experts", hf.get("num_local_experts"))   # None: int() raises below
        try:
            fields.update(
                num_experts=int(num_experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
        except (KeyError, TypeError) as exc:
            raise ModelConfigError(f"a qwen3_moe config.json needs num_experts, num_experts_per_tok and "
                                   f"moe_intermediate_size; missing or bad: {exc}") from None
        return fields

    @staticmethod
    def hf_config_fields(config: ModelConfig) -> dict:
        return {**Qwen3Model.hf_config_fields(config), "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
                "moe_intermediate_size": config.moe_intermediate_size,
                "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": config.decoder_sparse_step,
                "mlp_only_layers": list(config.mlp_only_layers),
                "router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False}

    @staticmethod
    def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Per-expert tensors stacked into gate_up_proj / down_proj (stacked ones pass as they are)."""
        experts: dict[str, dict[tuple[int, str], torch.Tensor]]   # prefix -> (expert, projection) -> tensor
        out, experts = {}, {}
        for name, tensor in state.items():
            match = _PER_EXPERT.match(name)
            if match is None:
                out[name] = tensor
            else:
                experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
        for prefix, parts in experts.items():
            try:
                gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                           for e in range(config.num_experts)]
                down = [parts[(e, "down_proj")] for e in range(config.num_experts)]
            except KeyError as exc:
                raise ModelConfigError(f"{prefix}: expert tensor {exc.args[0]} is missing for "
                                       f"num_experts={config.num_experts}") from None
            out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{prefix}.down_proj"] = torch.stack(down)
        return out

    @staticmethod
    def state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked experts written as Hugging Face's per-expert tensors (contiguous copies)."""
        out = {}
        for name, tensor in state.items():
            if name.endswith(".mlp.experts.gate_up_proj"):
                prefix = name[:-len(".gate_up_proj")]
                for e, weight in enumerate(tensor):
                    gate, up = weight.chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            elif name.endswith(".mlp.experts.down_proj"):
                prefix = name[:-len(".down_proj")]
                for e, weight in enumerate(tensor):
                    out[f"{prefix}.{e}.down_proj.weight"] = weight.contiguous()
            else:
                out[name] = tensor
        return out


MODEL_CLASS = Qwen3MoeModel
