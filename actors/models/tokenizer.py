"""Tokenizers: a thin wrapper over Hugging Face `tokenizers`, plus the built-in byte tokenizer.

`Tokenizer` holds a `tokenizers.Tokenizer`, the special ids the engine stops on,
and the chat template (jinja2, as Hugging Face writes them). Three sources:

- `Tokenizer.from_file(folder/tokenizer.json, tokenizer_config.json)`: a Hugging Face folder;
- `Tokenizer.from_gguf_metadata(...)`: the BPE vocabulary and merges a GGUF file stores;
- `byte_tokenizer()`: the built-in one for models trained from scratch: one token per
  byte (byte-level BPE with no merges, so any text round-trips exactly) and 8 specials.
  Built in code, no download; vocab 264 (ids 0..7 specials, 8..263 bytes).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from postrain.core.errors import PostrainError

BYTE_SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|tool|>",
                 "<|reserved_0|>", "<|reserved_1|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    """A chat template compiled once: compiling takes ~3 ms, rendering ~0.1 ms, and a warm
    start renders each demonstration's prefix once per turn."""
    import jinja2

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(source)


class TokenizerError(PostrainError, ValueError):
    """A tokenizer that cannot be built from what was given."""


class Tokenizer:
    """Text <-> token ids, the stop ids, and the chat template."""

    def __init__(self, hf: HFTokenizer, bos_token_id: int | None, eos_token_ids: list[int],
                 pad_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool = False):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)   # the engine stops on any of these
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template (ChatML when it has none)."""
        template = _compiled_template(self.chat_template or CHATML_TEMPLATE)
        bos = self.hf.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.hf.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos)

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (Hugging Face layout)."""
        folder = Path(folder)
        self.hf.save(str(folder / "tokenizer.json"))
        tok = self.hf.id_to_token
        config = {
            "bos_token": tok(self.bos_token_id) if self.bos_token_id is not None else None,
            "eos_token": tok(self.eos_token_id) if self.eos_token_id is not None else None,
            "pad_token": tok(self.pad_token_id),
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "postrain_eos_token_ids": self.eos_token_ids,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None,
                  model_config: dict | None = None) -> "Tokenizer":
        hf = HFTokenizer.from_file(str(tokenizer_json))
        cfg = {}
        if tokenizer_config is not None and Path(tokenizer_config).exists():
            cfg = json.loads(Path(tokenizer_config).read_text())
        model_config = model_config or {}

        def token_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return hf.token_to_id(value) if isinstance(value, str) else None

        bos = token_id(cfg.get("bos_token"))
        if bos is None and isinstance(model_config.get("bos_token_id"), int):
            bos = model_config["bos_token_id"]
        eos_ids = list(cfg.get("postrain_eos_token_ids") or [])
        if not eos_ids:
            eos = token_id(cfg.get("eos_token"))
            eos_ids = [eos] if eos is not None else []
            model_eos = model_config.get("eos_token_id")
            for extra in (model_eos if isinstance(model_eos, list) else [model_eos]):
                if isinstance(extra, int) and extra not in eos_ids:
                    eos_ids.append(extra)
        template = cfg.get("chat_template")
        if isinstance(template, list):   # several named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(hf, bos, eos_ids, token_id(cfg.get("pad_token")), template,
                   bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_gguf_metadata(cls, tokens: list[str], merges: list[str], model: str,
                           bos_token_id: int | None, eos_token_id: int | None,
                           pad_token_id: int | None, chat_template: str | None,
                           add_bos_token: bool, token_types: list[int] | None = None) -> "Tokenizer":
        """A byte-level BPE tokenizer from GGUF's `tokenizer.ggml.*` fields (model 'gpt2')."""
        if model != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {model!r} is not supported; only 'gpt2' "
                                 "(byte-level BPE: Llama 3, Qwen2, SmolLM) is")
        vocab = {token: idx for idx, token in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        hf = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        from tokenizers import AddedToken
        # token_type 3 = control (special) tokens in GGUF: match them as whole tokens.
        specials = [tokens[i] for i, t in enumerate(token_types or []) if t == 3]
        hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        eos_ids = [eos_token_id] if eos_token_id is not None else []
        if chat_template and "<|im_end|>" in vocab and vocab["<|im_end|>"] not in eos_ids:
            eos_ids.append(vocab["<|im_end|>"])
        return cls(hf, bos_token_id, eos_ids, pad_token_id, chat_template, add_bos_token)


def byte_tokenizer() -> Tokenizer:
    """The built-in tokenizer: 8 specials then the 256 byte-level symbols, no merges."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_order())
    vocab = {token: idx for idx, token in enumerate(BYTE_SPECIALS + byte_symbols)}
    hf = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(BYTE_SPECIALS)
    ids = {name: vocab[name] for name in BYTE_SPECIALS}
    return Tokenizer(hf, ids["<|bos|>"], [ids["<|eos|>"], ids["<|im_end|>"]], ids["<|pad|>"],
                     CHATML_TEMPLATE, add_bos_token=False)


def _byte_order():
    """Sort key putting GPT-2 byte-level symbols in byte order (symbol for byte 0 first)."""
    table = {}
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + \
        list(range(0xAE, 0xFF + 1))
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return lambda symbol: table[symbol]
