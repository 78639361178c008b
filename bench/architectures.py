"""Random tiny models of each registered architecture, built by `transformers` itself and saved as
Hugging Face folders: the peers of the per-architecture rows of `postrain bench generate` and of
the architecture tests (tests/actors/models/).

    folder = build_hf_folder("gemma3_text", tmp / "gemma3", TEST_SHAPE, window=8)
    model, tokenizer = load_model(folder)          # postrain's own implementation of it

Nothing is downloaded: the configs are written here, the weights drawn from a seed. The byte
tokenizer's vocabulary (264) and its ids (bos 1, eos 2, pad 0) are used, so a folder needs no
tokenizer.json. Weights are normal(0, std) (norm weights around their identity value), large
enough that greedy decoding varies from token to token.

Adding an architecture: one entry in HF_CONFIGS (its transformers config class over the shape).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# Shapes shared by every architecture (Hugging Face config names). TEST_SHAPE: what the tests
# build (fast); BENCH_SHAPE: the generate bench's, the built-in "tiny" shape with grouped KV heads
# (tiny itself has had 6 KV heads since 2026-12-04; this stays, so the bench's history compares).
TEST_SHAPE = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
BENCH_SHAPE = dict(vocab_size=264, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
BYTE_IDS: dict[str, Any] = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Each config's own keywords go in a dict (`extra`): some transformers releases type their configs'
# __init__ without them (they are read from **kwargs), and mypy would refuse them by name there.


def _mistral(shape: dict, window: int):
    from transformers import MistralConfig
    extra: dict[str, Any] = dict(sliding_window=window, tie_word_embeddings=False)
    return MistralConfig(**shape, **BYTE_IDS, **extra)


def _gemma3(shape: dict, window: int):
    """Local and global layers alternating, each with its own rope (linear scaling on the global
    ones), a query scale other than head_dim, and a final logit soft cap."""
    from transformers import Gemma3TextConfig
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])]
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}
    extra: dict[str, Any] = dict(sliding_window=window, layer_types=kinds, rope_parameters=rope,
                                 query_pre_attn_scalar=shape["head_dim"] * 2, final_logit_softcapping=5.0)
    return Gemma3TextConfig(**shape, **BYTE_IDS, **extra)


def _qwen3(shape: dict, window: int):
    from transformers import Qwen3Config
    extra: dict[str, Any] = dict(tie_word_embeddings=False)
    return Qwen3Config(**shape, **BYTE_IDS, **extra)


def _qwen3_moe(shape: dict, window: int):
    """8 routed experts a quarter of the dense width, top-2, in every layer."""
    from transformers import Qwen3MoeConfig
    extra: dict[str, Any] = dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=shape["intermediate_size"] // 4, norm_topk_prob=True)
    return Qwen3MoeConfig(**shape, **BYTE_IDS, **extra)


# Hugging Face model_type -> its config over (shape, sliding window). One line per architecture.
HF_CONFIGS: dict[str, Callable] = {
    "mistral": _mistral,
    "gemma3_text": _gemma3,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
}


def build_hf_folder(arch: str, folder: str | Path, shape: dict = TEST_SHAPE, window: int = 8,
                    seed: int = 0, std: float = 0.1) -> Path:
    """A random `arch` model made by transformers, saved to `folder` (config.json + safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in HF_CONFIGS:
        raise KeyError(f"no tiny config for architecture {arch!r}; known: {sorted(HF_CONFIGS)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(HF_CONFIGS[arch](shape, window))
    gemma_norm = arch.startswith("gemma")             # Gemma norms scale by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * std + (0.0 if gemma_norm else 1.0))
            else:
                param.copy_(torch.randn_like(param) * std)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- bench rows

BENCH_WINDOW = 64          # tokens: shorter than a chat prompt plus its new tokens, so windows bite


def architecture_rows(quick: bool, ours: Callable, theirs: Callable) -> tuple[dict, dict]:
    """`postrain bench generate`'s rows per architecture of HF_CONFIGS: ours (the engine on
    postrain's implementation) and theirs (transformers' generate on the same folder), tokens/s at
    batch 1 and 32 (4 in quick mode), medians over interleaved repeats. `ours(engine, prompts,
    params)` and `theirs(hf, prompts, new_tokens, pad_id)` are the generate bench's timers;
    each returns (wall tokens/s, CPU tokens/s, ...). Keys: tok_per_s_<arch>_b<batch> (wall time) and
    cpu_tok_per_s_<arch>_b<batch> (this process's CPU time: steadier on a shared machine)."""
    import statistics
    import sys
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models.loading import load_model
    from postrain.bench.prompts import chat_prompts

    new_tokens, batches, repeats = (16, (1, 4), 1) if quick else (64, (1, 32), 3)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    results, peer = {}, {}
    for arch in HF_CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_hf_folder(arch, tmp, BENCH_SHAPE, window=BENCH_WINDOW, std=0.02)
            model, tokenizer = load_model(folder)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for batch in batches:
            prompts = chat_prompts(tokenizer, batch)
            runs: dict[str, list] = {"ours": [], "theirs": []}
            for _ in range(repeats):                 # interleaved: load falls on both
                runs["ours"].append(ours(Engine(model, tokenizer, max_num_seqs=max(64, batch)), prompts, params)[:2])
                runs["theirs"].append(theirs(hf, prompts, new_tokens, tokenizer.pad_token_id)[:2])
            print(f"generate: {arch} batch {batch}: {runs}", file=sys.stderr, flush=True)
            for prefix, col in (("", 0), ("cpu_", 1)):
                key = f"{prefix}tok_per_s_{arch}_b{batch}"
                results[key] = round(statistics.median(r[col] for r in runs["ours"]), 1)
                peer[key] = round(statistics.median(r[col] for r in runs["theirs"]), 1)
    return results, peer
