"""config.json <-> ModelConfig: the Hugging Face config of every registered architecture.

    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    hf = config_to_hf(config)                        # what save_checkpoint writes

Both checkpoint formats meet here: a Hugging Face folder's config.json, and a GGUF file's
metadata once gguf.py has read it as a config.json dict. The architecture's own fields come from
its MODEL_CLASS (`config_fields_from_hf`, `hf_config_fields`; a composite config.json such as a
vision-language model's: `text_config_from_hf` gives the decoder's fields, `hf_config_from_text`
nests them back). Invariant: a field the implementation does not honour is refused
(CheckpointError naming it), never ignored.
"""
from __future__ import annotations

import dataclasses

from postrain.core.errors import PostrainError

from . import ARCHITECTURES, model_class
from .config import ModelConfig, ModelConfigError

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


class CheckpointError(PostrainError, ValueError):
    """A checkpoint that cannot be loaded: bad path, unknown architecture, missing or misshapen tensor."""


HOW_TO_ADD = ("to add one, write postrain/actors/models/<name>.py (a MODEL_CLASS over the shared blocks) "
              "and add one line to ARCHITECTURES in postrain/actors/models/__init__.py; see docs/models.md")
# the MLP activation each model_type honours (else silu)
ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}; {HOW_TO_ADD}")
    try:
        return _config_from_hf(hf, model_type)
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks the field {exc.args[0]!r}") from None
    except ModelConfigError as exc:                   # a field the implementation does not honour
        raise CheckpointError(f"config.json ({model_type}): {exc}") from None


def _config_from_hf(hf: dict, model_type: str) -> ModelConfig:
    text_config_of = getattr(model_class(model_type), "text_config_from_hf", None)
    if text_config_of is not None:       # a composite config.json (vision-language): the decoder's fields
        hf = text_config_of(hf)
    activation = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if activation != ACTIVATIONS.get(model_type, "silu"):
        raise CheckpointError(f"config.json field hidden_act={activation!r} is not supported for "
                              f"{model_type}; supported: {ACTIVATIONS.get(model_type, 'silu')!r}")
    if model_type == "qwen2" and hf.get("use_sliding_window"):   # its window on the upper layers
        raise CheckpointError(f"config.json field use_sliding_window=true is not supported for {model_type}; "
                              "set it to false (the released checkpoints do)")
    rope: dict | None   # None: the default rope
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    is_qwen = model_type == "qwen2"
    attention_bias = bool(hf.get("attention_bias", False))
    config = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=rope,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        qkv_bias=is_qwen or attention_bias, o_bias=attention_bias and not is_qwen,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        architecture=model_type, bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), vision=hf.get("postrain_vision"))
    extra = getattr(model_class(model_type), "config_fields_from_hf", None)   # the architecture's own fields
    return config if extra is None else dataclasses.replace(config, **extra(hf))


def config_to_hf(config: ModelConfig) -> dict:
    """The Hugging Face config.json dict for a ModelConfig (loads in transformers)."""
    rope = {"rope_type": "default"} if config.rope_scaling is None else dict(config.rope_scaling)
    arch = config.architecture
    hf = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        hf["rope_scaling"] = dict(config.rope_scaling)
    if config.vision is not None:        # the built-in tower (models/vision.py): postrain's own field
        hf["postrain_vision"] = dict(config.vision)
    if arch == "llama":
        hf["attention_bias"] = config.o_bias
        hf["mlp_bias"] = config.mlp_bias
    extra = getattr(model_class(arch), "hf_config_fields", None)   # the architecture's own fields
    hf = hf if extra is None else {**hf, **extra(config)}
    around = getattr(model_class(arch), "hf_config_from_text", None)   # a composite config.json
    return hf if around is None else around(hf, config)
