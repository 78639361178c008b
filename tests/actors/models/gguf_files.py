"""A small GGUF writer for the tests: a transformers model in memory -> a .gguf file laid out as
llama.cpp's convert_hf_to_gguf.py lays it out (no download, no llama.cpp checkout).

    path = write_gguf(hf_model, "gemma3_text", tmp / "g.gguf")
    path = write_gguf(hf_model, "qwen3", tmp / "q.gguf", qtype=GGMLQuantizationType.Q8_0,
                      drop={"qwen3.block_count"}, extra={"qwen3.rope.scaling.type": "yarn"})

Written independently of postrain's reader: tensor names come from the `gguf` package's own
table (`gguf.get_tensor_name_map`, what llama.cpp's converter uses), and the converter's
changes are applied here: Llama/Mistral q and k rows permuted for llama.cpp's rotary layout,
Gemma norms stored as 1 + weight, MoE experts stacked as `ffn_{gate,up,down}_exps`, a tied LM
head not written. The tokenizer is postrain's byte tokenizer as GGUF `gpt2` metadata (264
tokens, no merges; bos 1, eos 2, pad 0), the ids bench/architectures.py's models use;
`sentencepiece_metadata(style)` gives a SentencePiece (`llama`) vocabulary shaped like Mistral 7B's
or Gemma 3's instead (pass it as `extra`).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, MODEL_ARCH

# Hugging Face model_type -> llama.cpp's architecture (Mistral is converted as Llama).
GGUF_ARCH = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "qwen3": MODEL_ARCH.QWEN3,
             "qwen3_moe": MODEL_ARCH.QWEN3MOE, "gemma3_text": MODEL_ARCH.GEMMA3}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(hf_model, model_type: str):
    """(llama.cpp name, float32 array in torch's shape) for every tensor of `hf_model`."""
    config, arch = hf_model.config, GGUF_ARCH[model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        weight = tensor.detach().float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):          # (E, 2I, H) -> gate and up (E, I, H)
            gate_name = names.get_name(name.replace("gate_up_proj", "gate_proj"))
            gate, up = np.split(weight, 2, axis=1)
            yield gate_name + ".weight", gate
            yield gate_name.replace("gate_exps", "up_exps") + ".weight", up
            continue
        if name.endswith("mlp.experts.down_proj"):             # (E, H, I)
            yield names.get_name(name) + ".weight", weight
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no llama.cpp name for {name}"
        if gguf_name == "output" and config.tie_word_embeddings:
            continue
        if arch == MODEL_ARCH.LLAMA and gguf_name.endswith(".attn_q"):
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == MODEL_ARCH.LLAMA and gguf_name.endswith(".attn_k"):
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        if arch == MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            weight = weight + 1.0
        yield f"{gguf_name}.{suffix}", weight


def gguf_metadata(hf_model, model_type: str, name: str) -> dict:
    """`{arch}.*` and `tokenizer.ggml.*` keys as llama.cpp's converter writes them for the config."""
    config = hf_model.config
    arch = gguf.MODEL_ARCH_NAMES[GGUF_ARCH[model_type]]
    rope = config.rope_parameters
    full = rope["full_attention"] if model_type == "gemma3_text" else rope
    meta = {"general.name": name, "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size, "block_count": config.num_hidden_layers,
            "feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": config.rms_norm_eps, "rope.freq_base": full["rope_theta"]}
    if getattr(config, "head_dim", None):
        meta["attention.key_length"] = meta["attention.value_length"] = config.head_dim
    if arch == "llama":
        meta["rope.dimension_count"] = config.head_dim
        meta["vocab_size"] = config.vocab_size
    if full.get("rope_type", "default") == "linear":
        meta["rope.scaling.type"], meta["rope.scaling.factor"] = "linear", full["factor"]
    if model_type == "qwen3_moe":
        meta.update({"expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
                     "expert_feed_forward_length": config.moe_intermediate_size})
    if model_type == "gemma3_text":
        meta["attention.sliding_window"] = config.sliding_window
    return {(k if k.startswith("general.") else f"{arch}.{k}"): v for k, v in meta.items()}


def byte_tokenizer_metadata() -> dict:
    from postrain.actors.models.tokenizer import BYTE_SPECIALS, byte_tokenizer

    vocab = byte_tokenizer().hf.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in BYTE_SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0}


def write_gguf(hf_model, model_type: str, path: str | Path, name: str = "tiny",
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32, extra: dict | None = None,
               drop: set[str] = frozenset(), extra_tensors: dict | None = None,
               architecture: str | None = None) -> Path:
    """Write `hf_model` as a GGUF file; `extra` keys added (or replaced), `drop` keys left out,
    `extra_tensors` appended, `architecture` replacing general.architecture. Matrices are stored
    as `qtype` (norms and vectors stay float32, as llama.cpp keeps them)."""
    arch = architecture or gguf.MODEL_ARCH_NAMES[GGUF_ARCH[model_type]]
    writer = gguf.GGUFWriter(str(path), arch)
    fields = {**gguf_metadata(hf_model, model_type, name), **byte_tokenizer_metadata(), **(extra or {})}
    for key, value in fields.items():
        if key not in drop and value != []:                  # GGUF has no empty arrays (no merges)
            sub_type = _value_type(value[0]) if isinstance(value, list) else None
            writer.add_key_value(key, value, _value_type(value), sub_type)
    tensors = list(gguf_tensors(hf_model, model_type)) + list((extra_tensors or {}).items())
    for tensor_name, weight in tensors:
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if qtype != GGMLQuantizationType.F32 and weight.ndim >= 2:
            data = gguf.quants.quantize(weight, qtype)
            writer.add_tensor(tensor_name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _value_type(value) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    return GGUFValueType.ARRAY


# ----------------------------------------------------------------------------- SentencePiece vocabularies

_SP_WORDS = ["the", "hello", "world", "what", "is", "capital", "of", "France", "Paris", "answer", "and",
             "café", "über", "niño", "12", "345", "2026", "def", "return", "you", "are", "a", "helper"]
_SP_PIECES = ["ing", "er", "ll", "lo", "he", "wor", "ld", "an", "is", "12", "34"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def sentencepiece_metadata(style: str) -> dict:
    """`tokenizer.ggml.*` keys of a SentencePiece (`llama`) vocabulary laid out as llama.cpp writes
    Mistral 7B's (`style="mistral"`: <unk> <s> </s>, [INST] [/INST] control, scores that rank the
    merges, a prefix space) or Gemma 3's (`"gemma3"`: <pad> <eos> <bos> <unk> <mask>, turn markers,
    runs of spaces stored as real spaces, scores all 0: the file order ranks the merges, no prefix
    space). Then 256 byte-fallback tokens <0x00>..<0xFF> (type 6), single characters and words with
    every prefix ("▁c", "▁ca", ...), so every piece is two pieces of the vocabulary (type 1)."""
    if style == "mistral":
        specials = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("[INST]", 3), ("[/INST]", 3)]
    else:
        specials = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 4),
                    ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
    tokens, types = [t for t, _ in specials], [k for _, k in specials]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()[]/-+=*#éüñ")
    pieces += ["\u2581\u2581", "\u2581\u2581\u2581\u2581"] + _SP_PIECES
    if style == "gemma3":
        pieces += ["\n", "\n\n", "  ", "    "]                    # llama.cpp stores these as written
    for word in _SP_WORDS:
        pieces += ["\u2581" + word[:i] for i in range(1, len(word) + 1)] + [word]
    for piece in pieces:
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    if style == "mistral":
        scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(tokens) - len(specials) - 256)]
        ids = {"unknown_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        flags = {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
                 "tokenizer.ggml.add_space_prefix": True, "tokenizer.chat_template": MISTRAL_TEMPLATE}
    else:
        scores = [0.0] * len(tokens)
        ids = {"padding_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "unknown_token_id": 3,
               "eot_token_id": tokens.index("<end_of_turn>")}
        flags = {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
                 "tokenizer.ggml.add_space_prefix": False, "tokenizer.chat_template": GEMMA3_TEMPLATE}
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            **{f"tokenizer.ggml.{k}": v for k, v in ids.items()}, **flags}
