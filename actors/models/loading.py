"""Loading and saving policy checkpoints: Hugging Face folders, GGUF files, built-in configs.

    model, tokenizer = load_model("tiny")                    # built-in config, random init
    model, tokenizer = load_model("/ckpt/Qwen2.5-0.5B")      # config.json + *.safetensors + tokenizer.json
    model, tokenizer = load_model("/models/smollm2.gguf")    # dequantized to float32
    model, tokenizer = load_model("smollm2")                 # a packaged model, found at load time
    save_checkpoint(model, tokenizer, "/ckpt/step100", policy_version=100)

Our own checkpoints ARE Hugging Face folders (config.json, model.safetensors with
Hugging Face tensor names, tokenizer.json, tokenizer_config.json), so
`transformers` loads them too; the policy version rides in the safetensors
metadata. GGUF files are read by `gguf.py` (metadata -> a config.json dict ->
`hf_config.config_from_hf`, llama.cpp's tensors -> Hugging Face's names and layouts);
both formats then build the model the same way (`model_from_state`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal, overload

import torch
from safetensors.torch import load_file, save_file

from . import model_class
from .gguf import GGUF_ARCHITECTURES, read_gguf
from .hf_config import (
    ACTIVATIONS, HOW_TO_ADD, SUPPORTED_ARCHITECTURES, CheckpointError, config_from_hf, config_to_hf,
)
from .llama import BUILTIN_CONFIGS, LlamaModel, ModelConfig, build_model
from .spec import (
    MODEL_RULE, PACKAGED_MODELS, check_model_spec, folder_byte_tokenizer, folder_tokenizer, model_config,
    packaged_model_path, read_hf_config, resolve_model, spec_image_layout, spec_tokenizer,
)
from .tokenizer import Tokenizer, byte_tokenizer

__all__ = [  # this module's public face, the names of hf_config.py, gguf.py and spec.py it re-exports included
    "load_model", "save_checkpoint", "checkpoint_policy_version", "load_hf_folder", "load_gguf",
    "model_from_state", "load_state_dict_checked", "resolve_model", "packaged_model_path",
    "check_model_spec", "model_config", "read_hf_config", "PACKAGED_MODELS", "MODEL_RULE", "CheckpointError",
    "config_from_hf", "config_to_hf", "SUPPORTED_ARCHITECTURES", "HOW_TO_ADD", "ACTIVATIONS", "GGUF_ARCHITECTURES",
    "build_policy", "spec_image_layout", "spec_tokenizer",
]


def load_model(path_or_name: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0) -> tuple[LlamaModel, Tokenizer]:
    """(model in eval mode, tokenizer) from a built-in name, a Hugging Face folder or a .gguf file."""
    text = resolve_model(path_or_name)
    path = Path(text)
    if text in BUILTIN_CONFIGS and not path.exists():
        model, tokenizer = build_model(text, seed=seed), byte_tokenizer()
    elif path.is_dir():
        model, tokenizer = load_hf_folder(path)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = load_gguf(path)
    elif path.is_file():
        raise CheckpointError(f"{path} is a file but not a .gguf; pass a Hugging Face folder "
                              "(config.json + *.safetensors), a .gguf file or a built-in name")
    else:
        raise CheckpointError(f"no model at {text!r}: not a folder, not a .gguf file and not a built-in "
                              f"name; " + MODEL_RULE.format(names=", ".join(sorted(BUILTIN_CONFIGS)),
                                                           packaged=", ".join(PACKAGED_MODELS)))
    return model.to(device=device, dtype=dtype).eval(), tokenizer


# ----------------------------------------------------------------------------- Hugging Face


@overload
def load_hf_folder(folder: str | Path, require_tokenizer: Literal[True] = True
                   ) -> tuple[LlamaModel, Tokenizer]: ...
@overload
def load_hf_folder(folder: str | Path, require_tokenizer: bool) -> tuple[LlamaModel, Tokenizer | None]: ...
def load_hf_folder(folder: str | Path, require_tokenizer: bool = True
                   ) -> tuple[LlamaModel, Tokenizer | None]:
    """(model, tokenizer) from a Hugging Face folder; tokenizer None only if not required."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json; a Hugging Face model folder needs "
                              "config.json, *.safetensors and tokenizer.json")
    hf_config = read_hf_config(folder)
    config = config_from_hf(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights (pytorch_model.bin is not "
                              "read: convert it with safetensors first)")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    model = model_from_state(config, state, source=str(folder))
    tokenizer: Tokenizer | None
    if (folder / "tokenizer.json").exists():
        tokenizer = folder_tokenizer(folder, hf_config, config)
    else:
        tokenizer = folder_byte_tokenizer(folder, config.vocab_size, require_tokenizer)
    return model, tokenizer


def load_gguf(path: str | Path) -> tuple[LlamaModel, Tokenizer]:
    """(model, tokenizer) from a .gguf file, its tensors dequantized to float32 (gguf.py)."""
    config, state, tokenizer = read_gguf(path)
    return model_from_state(config, state, source=str(path)), tokenizer


def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor], source: str) -> LlamaModel:
    """The registered model of `config` holding `state` (Hugging Face names; the architecture's
    `state_from_hf` applied, e.g. per-expert tensors -> stacked experts). CheckpointError names
    any missing, unexpected or misshapen tensor."""
    cls = model_class(config.architecture)
    if hasattr(cls, "state_from_hf"):
        state = cls.state_from_hf(state, config)
    model = cls.empty(config)
    load_state_dict_checked(model, state, source=source, assign=True)
    return model


def load_state_dict_checked(model: LlamaModel, state: dict[str, torch.Tensor], source: str,
                            assign: bool = False) -> None:
    """Copy `state` into `model` (or, with assign, adopt its tensors), naming any missing,
    unexpected or misshapen tensor. Raises CheckpointError and changes nothing on a mismatch."""
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} for a {model.config.architecture} "
                              f"model with {model.config.num_layers} layers")
    unexpected = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:5]}; the config.json "
                              "does not match these weights")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                                  f"the config implies {tuple(tensor.shape)}")
    if assign:   # take the loaded tensors as the parameters: no copy into fresh memory
        model.load_state_dict({k: state[k].to(expected[k].dtype) for k in expected},
                              strict=False, assign=True)
        if model.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.dtype))


def save_checkpoint(model: LlamaModel, tokenizer: Tokenizer, folder: str | Path,
                    policy_version: int | None = None) -> Path:
    """Write a Hugging Face folder: config.json, model.safetensors, tokenizer files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    if config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if hasattr(model, "state_to_hf"):            # e.g. stacked experts -> Hugging Face's per-expert tensors
        state = model.state_to_hf(state)  # type: ignore[operator]  # torch: an architecture's own method
    metadata = {"format": "pt"}
    if policy_version is not None:
        metadata["policy_version"] = str(policy_version)
    save_file(state, str(folder / "model.safetensors"), metadata=metadata)
    tokenizer.save(folder)
    files = getattr(model, "hf_folder_files", None)   # an architecture's other files (processor_config.json)
    for name, content in (files(config) if files is not None else {}).items():
        if name == "tokenizer_config.json":      # additions to the file tokenizer.save just wrote
            content = {**json.loads((folder / name).read_text()), **content}
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def checkpoint_policy_version(folder: str | Path) -> int | None:
    """The policy version save_checkpoint recorded, or None."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as handle:
        value = (handle.metadata() or {}).get("policy_version")
    return int(value) if value is not None else None


def build_policy(spec: str | dict, seed: int, dtype: torch.dtype, device: str | torch.device):
    """(model, tokenizer) from a load_model spec, or from a dict of ModelConfig fields (random
    weights from `seed`, the byte tokenizer)."""
    if isinstance(spec, dict):
        config = ModelConfig(**spec)
        model = model_class(config.architecture)(config).init_weights(seed)
        return model.to(device=device, dtype=dtype), byte_tokenizer()
    return load_model(spec, dtype=dtype, device=device, seed=seed)
