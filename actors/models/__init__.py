"""postrain.actors.models: the policy's architectures, one module each, and the registry keyed by HF `model_type`.

    config.py      ModelConfig and its rules, the built-in configs (tiny, small)
    blocks.py      the shared blocks: rotary, RMSNorm, Attention, MLP, SharedPrefixBatch, Float16Weights
    llama.py       LlamaModel, build_model: the Llama-family decoder (llama, qwen2, SmolLM)
    mistral.py     MistralModel: Llama with a sliding window on every layer
    gemma3.py      Gemma3Model: local/global layers, sandwich and Gemma norms, soft-capped logits
    qwen3.py       Qwen3Model: Llama with q/k RMSNorm per head and an explicit head_dim
    qwen3_moe.py   Qwen3MoeModel: Qwen3 with routed experts (moe.py) in its MoE layers
    idefics3.py    Idefics3Model: Idefics3 / SmolVLM, a SigLIP tower and pixel-shuffle connector + Llama
    gemma3_vision.py  Gemma3VisionModel: Gemma 3 with images, a SigLIP tower and pooled projector + Gemma 3
    qwen2_5_vl.py  Qwen2_5_VLModel: Qwen2.5-VL, a windowed ViT and patch merger + Qwen2 with multimodal rotary
    moe.py         SparseMoeBlock: router, grouped experts, routing traces (replay), aux loss
    protocol.py    CausalLM: what the generator and learner need of any architecture
    loading.py     load_model / save_checkpoint: Hugging Face folders, GGUF files, built-in configs
    spec.py        what a model spec names, read without weights or torch: its config, tokenizer, image layout
    images.py      image inputs checked, decoded and rendered into prompts (no torch); vision.py: the towers
    tokenizer.py   Tokenizer: Hugging Face `tokenizers` and the built-in byte tokenizer
    reward_model.py  load_reward_model: *ForSequenceClassification folders (registry decoder + score head)

The learner and the generator run the same model; the engine's KV manager owns the cache.
Adding an architecture is one module and one line in `ARCHITECTURES`.
"""

# Hugging Face `model_type` -> the module (under postrain.actors.models) that implements it.
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mistral": "mistral",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3_vision",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "qwen2_5_vl": "qwen2_5_vl",
}


def model_class(model_type: str):
    """The nn.Module class (a CausalLM) that implements Hugging Face `model_type`: the
    `MODEL_CLASS` of its module in ARCHITECTURES."""
    import importlib

    if model_type not in ARCHITECTURES:
        raise KeyError(f"model_type {model_type!r} is not registered; registered: {sorted(ARCHITECTURES)}")
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}").MODEL_CLASS

# Model and loading names import torch, so they load on first use (PEP 562).
_LAZY = {
    "LlamaModel": "llama", "ModelConfig": "config", "ModelConfigError": "config", "build_model": "llama",
    "BUILTIN_CONFIGS": "config", "load_model": "loading", "build_policy": "loading", "save_checkpoint": "loading",
    "CheckpointError": "loading", "Tokenizer": "tokenizer", "byte_tokenizer": "tokenizer",
    "CausalLM": "protocol", "SharedPrefixBatch": "blocks", "Float16Weights": "blocks",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
