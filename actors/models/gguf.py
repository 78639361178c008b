"""GGUF files (llama.cpp's format) into postrain's registry: Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3.

    config, state, tokenizer = read_gguf("/models/Qwen3-0.6B-Q8_0.gguf")   # loading.load_model builds the model
    reader = GGUFFile(path); tokenizer = gguf_tokenizer(reader, path)     # metadata only, no weights

The one idea: a GGUF file is turned into what a Hugging Face folder holds, then loaded the way a
folder is. Its metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...) becomes a
config.json dict (`hf_config_from_gguf`) that `hf_config.config_from_hf` turns into a ModelConfig,
so the architectures' own rules and refusals apply unchanged; its tensors, renamed from
llama.cpp's names (`blk.{i}.attn_q.weight`, ...) to Hugging Face's and dequantized to float32
with the `gguf` package, become the state dict that loading.py puts into the model as it does a
folder's. What llama.cpp's converter (convert_hf_to_gguf.py) changed on the way in is undone:

- Llama (and Mistral, which llama.cpp stores as `llama`): q/k rows permuted for its rotary layout;
- Gemma 3: every RMSNorm weight stored as 1 + weight (its norms scale by the weight itself);
- Qwen3-MoE: experts stacked per layer as `ffn_{gate,up,down}_exps` (E, I, H) / (E, H, I), which
  become postrain's stacked `mlp.experts.gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I).

Fields GGUF does not store take llama.cpp's values for the architecture (Gemma 3: every 6th
layer global when the file names a window, else none local; local rope base 10000; query scale
1/sqrt(head_dim), 1/sqrt(hidden / heads) for the 62-layer 27B; Qwen3-MoE: top-k weights
renormalised, every layer MoE). Invariant: a tensor of the file that has no place in the model,
a missing metadata key, a per-layer array where one value is needed and a rope scaling type
other than linear are refused by name, never skipped. The tokenizer (`gguf_tokenizer`) is
byte-level BPE (`tokenizer.ggml.model` 'gpt2') or SentencePiece BPE ('llama'; tokenizer.py).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ModelConfig
from .hf_config import CheckpointError, config_from_hf
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch   # the weights' functions import it when they run: a spec's metadata and tokenizer need none

# GGUF `general.architecture` -> Hugging Face model_type. Mistral is stored as `llama`; such a
# file loads as `mistral` when it names a sliding window or its general.name says Mistral.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
}

# llama.cpp's per-layer tensor names -> Hugging Face's (under model.layers.{i}.). `ffn_norm` is the
# norm before the MLP: Llama's post_attention_layernorm, Gemma 3's pre_feedforward_layernorm.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate", "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp writes that postrain does not read: Llama 3.1's rope frequency factors
# (transformers' GGUF reader does not apply them either).
_IGNORED = {"rope_freqs.weight"}
_GEMMA3_GLOBAL_EVERY = 6                # llama.cpp: gemma3 layers 6, 12, ... are global
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0      # llama.cpp: gemma3's sliding layers' rope base

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFile:
    """A GGUF v2/v3 file: metadata as Python values, tensors as (name, dims, type, byte view).

    A direct parser (struct over one memory map): `gguf.GGUFReader` builds a numpy view
    per string and takes seconds on a 49k-token vocabulary; this takes milliseconds.
    `dims` are GGUF's (innermost first): the torch shape is reversed(dims).
    """

    def __init__(self, path: Path):
        """Parse `path`; CheckpointError, naming the byte where it broke, for a file that is
        not well formed (a GGUF file is untrusted input: docs/security.md, "Model files")."""
        self._pos = 0
        require_gguf_package()
        try:
            self._parse(path)
        except CheckpointError:
            raise
        except (struct.error, ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                ZeroDivisionError, MemoryError) as exc:
            raise CheckpointError(f"{path} is not a well-formed GGUF file (at byte {self._pos}: "
                                  f"{type(exc).__name__}: {exc}); download or convert it again") from None

    def _parse(self, path: Path) -> None:
        import numpy as np
        from gguf.constants import GGML_QUANT_SIZES

        self.buffer = np.memmap(path, dtype=np.uint8, mode="r")
        data = self.buffer
        raw = memoryview(data)  # type: ignore[arg-type]  # numpy's stub has __buffer__ on 3.12+ only
        if bytes(raw[:4]) != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", raw, 4)
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        self._raw, self._pos = raw, 24
        self.fields = {}
        for _ in range(num_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        base = -(-self._pos // alignment) * alignment
        self.tensors = []
        for name, dims, kind, offset in infos:
            if kind not in GGML_QUANT_SIZES:
                raise CheckpointError(f"{path}: tensor {name} has GGML type {kind}, unknown to the installed "
                                      "gguf package; upgrade it: pip install -U gguf")
            block_size, type_size = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block_size * type_size
            num_rows = int(np.prod(dims[1:], dtype=object)) if len(dims) > 1 else 1
            start = base + offset
            if not dims or start + row_bytes * num_rows > len(data):
                raise CheckpointError(f"{path}: tensor {name} of dims {list(dims)} runs past the end of the "
                                      f"file ({len(data)} bytes); the file is truncated or corrupt")
            view = data[start:start + row_bytes * num_rows].view(np.ndarray).reshape(num_rows, row_bytes)
            self.tensors.append((name, dims, kind, view))

    def _unpack(self, fmt):
        values = struct.unpack_from(fmt, self._raw, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._raw, self._pos)
        start = self._pos + 8
        if start + length > len(self._raw):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        self._pos = start + length
        return bytes(self._raw[start:start + length]).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item_kind, count = self._unpack("<IQ")
            if item_kind in _GGUF_SCALARS:
                return list(self._unpack(f"<{count}{_GGUF_SCALARS[item_kind][1]}"))
            return [self._value(item_kind) for _ in range(count)]
        return self._unpack(_GGUF_SCALARS[kind])[0]


def require_gguf_package() -> None:
    """CheckpointError naming the extra when the `gguf` package (GGML's type sizes and the
    dequantizer) is not installed."""
    try:
        import gguf  # noqa: F401
    except ModuleNotFoundError:
        raise CheckpointError("reading a .gguf file needs the `gguf` package, which the `gguf` extra "
                              "installs; fix: pip install 'postrain[gguf]'") from None


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, float32 state dict with Hugging Face names, tokenizer) of a .gguf file."""
    reader = GGUFFile(Path(path))
    hf = hf_config_from_gguf(reader, path)
    try:
        config = config_from_hf(hf)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: its GGUF metadata, read as a config.json, is refused: {exc}") from None
    state = gguf_state_dict(reader, hf["model_type"], config, path)
    config.tie_word_embeddings = "lm_head.weight" not in state
    return config, state, gguf_tokenizer(reader, path)


# ----------------------------------------------------------------------------- metadata


class _Metadata:
    """The `{arch}.*` keys of one file, with errors that name the file and the key."""

    def __init__(self, reader: GGUFFile, arch: str, path):
        self.fields, self.arch, self.path = reader.fields, arch, path

    def get(self, name: str, default=None):
        """The key's value (a list for arrays), or `default` where the file lacks it."""
        return self.fields.get(f"{self.arch}.{name}", default)

    def one(self, name: str, default=None):
        """The key's single value, or `default`; a per-layer array is refused."""
        value = self.get(name, default)
        if isinstance(value, list):
            raise CheckpointError(f"{self.path}: GGUF key {self.arch}.{name} holds one value per layer, "
                                  "which postrain does not support (it needs one value for every layer)")
        return value

    def required(self, name: str):
        value = self.one(name)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks the key {self.arch}.{name}, which a "
                                  f"{self.arch} model needs; the file is incomplete: convert the model again "
                                  "with llama.cpp's convert_hf_to_gguf.py")
        return value


def gguf_model_type(reader: GGUFFile, path) -> str:
    """The Hugging Face model_type of a GGUF file; CheckpointError naming the supported ones."""
    arch = reader.fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)} (Mistral is stored as llama); "
                              "load a Hugging Face folder of the model instead")
    if arch == "llama" and reader.fields.get("llama.expert_count"):
        raise CheckpointError(f"{path}: a llama GGUF with experts (llama.expert_count; Mixtral) is not "
                              "supported: postrain's MoE architecture is qwen3_moe; load a Hugging Face folder")
    name = str(reader.fields.get("general.name", "")).lower()
    if arch == "llama" and (f"{arch}.attention.sliding_window" in reader.fields or "mistral" in name):
        return "mistral"
    return GGUF_ARCHITECTURES[arch]


def hf_config_from_gguf(reader: GGUFFile, path) -> dict:
    """The config.json dict (transformers 4.x field names) a GGUF file's metadata describes."""
    model_type = gguf_model_type(reader, path)
    arch = reader.fields["general.architecture"]
    meta = _Metadata(reader, arch, path)
    hidden, num_heads = int(meta.required("embedding_length")), int(meta.required("attention.head_count"))
    dims = {name: tensor_dims for name, tensor_dims, *_ in reader.tensors}
    names = set(dims)
    embedding_rows = dims["token_embd.weight"][-1] if "token_embd.weight" in dims else 0
    hf = {
        "model_type": model_type,
        "vocab_size": int(meta.one("vocab_size") or embedding_rows
                          or len(reader.fields.get("tokenizer.ggml.tokens", []))),
        "hidden_size": hidden, "num_hidden_layers": int(meta.required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.one("attention.head_count_kv") or num_heads),
        "head_dim": int(meta.one("attention.key_length") or hidden // num_heads),
        "rms_norm_eps": _float(meta.one("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float(meta.one("rope.freq_base", 10000.0)), "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": int(meta.one("context_length", 4096)),
        "attention_bias": "blk.0.attn_output.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": reader.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.fields.get("tokenizer.ggml.eos_token_id"),
    }
    if model_type == "qwen3_moe":
        hf.update(_qwen3_moe_fields(meta))
    else:
        hf["intermediate_size"] = int(meta.required("feed_forward_length"))
    if model_type == "mistral":
        hf["sliding_window"] = meta.one("attention.sliding_window")
    if model_type == "gemma3_text":
        hf.update(_gemma3_fields(meta, hf))
    return hf


def _rope_scaling(meta: _Metadata) -> dict | None:
    kind = meta.one("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise CheckpointError(f"{meta.path}: GGUF key {meta.arch}.rope.scaling.type = {kind!r} is not supported; "
                              "supported: none, linear")
    return {"rope_type": "linear", "factor": _float(meta.required("rope.scaling.factor"))}


def _optional_float(value) -> float | None:
    return None if value is None else _float(value)


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    import numpy as np

    return float(str(np.float32(value)))


def _qwen3_moe_fields(meta: _Metadata) -> dict:
    """Qwen3-MoE's expert fields. Every layer is MoE (llama.cpp's qwen3moe has no dense layers)."""
    moe_size = int(meta.required("expert_feed_forward_length"))
    return {
        "num_experts": int(meta.required("expert_count")),
        "num_experts_per_tok": int(meta.required("expert_used_count")),
        "moe_intermediate_size": moe_size,
        "intermediate_size": int(meta.one("feed_forward_length") or moe_size),
        "norm_topk_prob": bool(meta.one("expert_weights_norm", True)),   # llama.cpp's qwen3moe renormalises
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


def _gemma3_fields(meta: _Metadata, hf: dict) -> dict:
    """Gemma 3's fields, with llama.cpp's values for those GGUF does not store."""
    num_layers, head_dim = hf["num_hidden_layers"], hf["head_dim"]
    window = int(meta.one("attention.sliding_window") or 0)
    pattern = meta.get("attention.sliding_window_pattern", _GEMMA3_GLOBAL_EVERY)
    if not window:                                                # llama.cpp: no window, no local layers
        sliding = [False] * num_layers
    elif isinstance(pattern, list):                               # per layer: true = sliding
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    full = {"rope_type": "default", **(hf.pop("rope_scaling") or {}), "rope_theta": hf.pop("rope_theta")}
    local = {"rope_type": "default",
             "rope_theta": _float(meta.one("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))}
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers): hidden / heads.
    scalar = hf["hidden_size"] // hf["num_attention_heads"] if num_layers == 62 else head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window or None,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _optional_float(meta.one("final_logit_softcapping")),
        "attn_logit_softcapping": meta.one("attn_logit_softcapping"),
        "tie_word_embeddings": True,
    }


# ----------------------------------------------------------------------------- tensors


def gguf_state_dict(reader: GGUFFile, model_type: str, config: ModelConfig, path) -> dict[str, torch.Tensor]:
    """The file's tensors as a float32 state dict with Hugging Face names (experts stacked)."""
    import torch
    from gguf.constants import GGMLQuantizationType

    permute = reader.fields.get("general.architecture") == "llama"      # llama and mistral
    state, experts = {}, {}
    for tensor_name, dims, kind, data in reader.tensors:
        if tensor_name in _IGNORED:
            continue
        name = _hf_tensor_name(tensor_name, model_type)
        if name is None:
            raise CheckpointError(f"{path}: tensor {tensor_name!r} has no place in a postrain {model_type} "
                                  "model (an architecture variant postrain does not implement)")
        weight = _dequantize(data, GGMLQuantizationType(kind), dims, tensor_name, path)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            weight = _reverse_permute(weight, heads)
        if model_type == "gemma3_text" and tensor_name.endswith("norm.weight"):
            weight = weight - 1.0                                         # stored as 1 + weight
        if name.endswith(("experts.gate_proj", "experts.up_proj")):
            experts[name] = weight
        else:
            state[name] = weight
    for gate_name in [n for n in experts if n.endswith("gate_proj")]:
        prefix = gate_name[:-len(".gate_proj")]
        up = experts.pop(f"{prefix}.up_proj", None)
        if up is None:
            raise CheckpointError(f"{path}: {prefix}: ffn_gate_exps without ffn_up_exps")
        state[f"{prefix}.gate_up_proj"] = torch.cat([experts.pop(gate_name), up], dim=1)   # (E, 2I, H)
    if experts:
        raise CheckpointError(f"{path}: expert tensors without their pair: {sorted(experts)}")
    return state


def _hf_tensor_name(name: str, model_type: str) -> str | None:
    """Hugging Face's name for llama.cpp tensor `name`; None when the model has no such tensor.
    The stacked gate/up experts come back as `...mlp.experts.gate_proj` / `up_proj` (no suffix)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        if parts[2] in ("ffn_gate_exps", "ffn_up_exps") and parts[3] == "weight":
            return f"model.layers.{parts[1]}.mlp.experts.{parts[2][4:-5]}_proj"
        table = _GEMMA3_LAYER_NAMES if model_type == "gemma3_text" else _LAYER_NAMES
        mapped = table.get(parts[2])
        if mapped is None:
            return None
        return f"model.layers.{parts[1]}.{mapped}" + ("" if mapped.startswith("mlp.experts") else f".{parts[3]}")
    base = _TOP_NAMES.get(parts[0])
    return None if base is None or len(parts) != 2 else f"{base}.{parts[1]}"


def _dequantize(data, qtype, dims, name: str, path) -> torch.Tensor:
    import torch
    from gguf.quants import dequantize

    try:
        array = dequantize(data, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {name} is {qtype.name}, which the installed gguf package "
                              "cannot dequantize; upgrade it (pip install -U gguf) or requantize the file") from None
    weight = torch.from_numpy(array.astype("float32", copy=False).copy())
    return weight.reshape([int(n) for n in reversed(dims)])


def _reverse_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> rotate-half layout)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ----------------------------------------------------------------------------- tokenizer


def gguf_tokenizer(reader: GGUFFile, path) -> Tokenizer:
    """The tokenizer GGUF's `tokenizer.ggml.*` metadata describes: byte-level BPE (model 'gpt2')
    or SentencePiece BPE (model 'llama'); another model is refused naming it."""
    from .tokenizer import TokenizerError

    field = reader.fields.get
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise CheckpointError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    try:
        tokenizer = Tokenizer.from_gguf_metadata(
            tokens=reader.fields["tokenizer.ggml.tokens"],   # there (checked above)
            merges=field("tokenizer.ggml.merges", []),
            model=field("tokenizer.ggml.model"),
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=field("tokenizer.ggml.eos_token_id"),
            pad_token_id=field("tokenizer.ggml.padding_token_id"),
            chat_template=field("tokenizer.chat_template"),
            add_bos_token=field("tokenizer.ggml.add_bos_token"),
            token_types=field("tokenizer.ggml.token_type"),
            scores=field("tokenizer.ggml.scores"),
            architecture=str(field("general.architecture", "")),
            add_space_prefix=field("tokenizer.ggml.add_space_prefix"),
            extra_eos_ids=(field("tokenizer.ggml.eot_token_id"), field("tokenizer.ggml.eom_token_id")))
    except TokenizerError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    prefix = "tokenizer.chat_template."     # named templates (llama.cpp writes tool_use there)
    tokenizer.named_templates = {name[len(prefix):]: str(value) for name, value in reader.fields.items()
                                 if name.startswith(prefix)}
    tokenizer.source = str(path)
    return tokenizer
