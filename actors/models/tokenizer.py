"""Tokenizers: a thin wrapper over Hugging Face `tokenizers`, plus the built-in byte tokenizer.

`Tokenizer` holds a `tokenizers.Tokenizer`, the special ids the engine stops on,
and the chat templates (rendered sandboxed: chat_template.py). Three sources:

- `Tokenizer.from_folder(folder)`: a Hugging Face folder (tokenizer.json, tokenizer_config.json
  and the template files transformers reads);
- `Tokenizer.from_gguf_metadata(...)`: the vocabulary a GGUF file stores, byte-level BPE
  (`gpt2`) or SentencePiece BPE (`llama`: Mistral 7B, Gemma 3; built by `sentencepiece_bpe`);
- `byte_tokenizer()`: the built-in one for models trained from scratch: one token per
  byte (byte-level BPE with no merges, so any text round-trips exactly) and 8 specials.
  Built in code, no download; vocab 264 (ids 0..7 specials, 8..263 bytes).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import cast

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from postrain.core.errors import PostrainError

from .chat_template import CHATML_TEMPLATE, DEFAULT, folder_templates, render

BYTE_SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|tool|>",
                 "<|image|>", "<|reserved_1|>"]

class TokenizerError(PostrainError, ValueError):
    """A tokenizer that cannot be built from what was given."""


class Tokenizer:
    """Text <-> token ids, the stop ids, and the chat template."""

    def __init__(self, hf: HFTokenizer, bos_token_id: int | None, eos_token_ids: list[int],
                 pad_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool = False, named_templates: dict[str, str] | None = None,
                 source: str = "the model"):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)   # the engine stops on any of these
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.chat_template = chat_template   # None: the model has none (rendering says so)
        self.named_templates = dict(named_templates or {})   # e.g. "tool_use"; never "default"
        self.add_bos_token = add_bos_token
        self.source = source                 # the folder or file it came from, for errors

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def vocabulary_difference(self, other: "Tokenizer") -> str | None:
        """None when `other` maps every token to the same id as this one (what a teacher and its
        student must share for their logprobs to be compared token by token); else the first
        difference, in words."""
        mine, theirs = self.hf.get_vocab(with_added_tokens=True), other.hf.get_vocab(with_added_tokens=True)
        if len(mine) != len(theirs):
            return f"{len(mine)} tokens in {self.source}, {len(theirs)} in {other.source}"
        for token, token_id in sorted(mine.items(), key=lambda item: item[1]):
            if theirs.get(token) != token_id:
                return (f"token {token!r} is id {token_id} in {self.source} and "
                        f"{theirs.get(token, 'absent')} in {other.source}")
        return None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; the BOS id first when asked (or by default, add_bos_token), unless
        the text already starts with it (a chat template that writes bos_token itself)."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if ((self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None
                and ids[:1] != [self.bos_token_id]):
            ids = [self.bos_token_id] + ids
        return ids

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """The character range of `text` each token of `encode(text, add_bos=False)` covers."""
        return self.hf.encode(text, add_special_tokens=False).offsets

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **context) -> str:
        """Render messages with the model's chat template (or the named one, `template`), in the
        sandbox; `context` goes to the template too (e.g. `tools`). TokenizerError when the
        model has no template."""
        return render(self.template_source(template), self.source, messages=messages,
                      add_generation_prompt=add_generation_prompt, bos_token=self.token(self.bos_token_id),
                      eos_token=self.token(self.eos_token_id), **context)

    def template_source(self, name: str | None = None) -> str:
        """The Jinja source of the default template, or of the named one."""
        if name is not None and name in self.named_templates:
            return self.named_templates[name]
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.source} has no chat template (none in chat_template.jinja, "
                "additional_chat_templates/ or tokenizer_config.json): write the model's template into "
                f"chat_template.jinja beside its tokenizer.json, or set chat_template = \"chatml\" (or a "
                ".jinja file) in the run config's [shared] to render it with another")
        return self.chat_template

    def with_template(self, choice: str | None) -> "Tokenizer":
        """This tokenizer, changed in place to render with `choice` instead of its own template:
        "chatml", or the path of a .jinja file; None keeps its own. Returns self (so a loader can
        chain it); the run config's `chat_template`."""
        if choice is None:
            return self
        if choice == "chatml":
            self.chat_template = CHATML_TEMPLATE
        else:
            path = Path(choice)
            if not path.is_file():
                raise TokenizerError(f"chat_template = {choice!r} is neither \"chatml\" nor a file; "
                                     "name a .jinja file (a path relative to where the run starts)")
            self.chat_template = path.read_text(encoding="utf-8")
        self.named_templates = {}
        return self

    def token(self, token_id: int | None) -> str | None:
        """The text of a token id ("" for None; None for an id the vocabulary lacks)."""
        return self.hf.id_to_token(token_id) if token_id is not None else ""

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
            "chat_template": self._saved_templates(),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "postrain_eos_token_ids": self.eos_token_ids,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    def _saved_templates(self):
        """tokenizer_config.json's `chat_template`: the template, or the named list when there are several."""
        if not self.named_templates:
            return self.chat_template
        default = [] if self.chat_template is None else [{"name": DEFAULT, "template": self.chat_template}]
        return default + [{"name": name, "template": source} for name, source in self.named_templates.items()]

    @classmethod
    def from_folder(cls, folder: str | Path, model_config: dict | None = None) -> "Tokenizer":
        """The tokenizer of a Hugging Face folder: tokenizer.json, tokenizer_config.json (special
        tokens) and the chat templates where transformers finds them (chat_template.py)."""
        folder = Path(folder)
        hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = {}
        if (folder / "tokenizer_config.json").exists():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
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
        templates = folder_templates(folder, cfg)
        default = templates.pop(DEFAULT, None)
        return cls(hf, bos, eos_ids, token_id(cfg.get("pad_token")), default,
                   bool(cfg.get("add_bos_token", False)), templates, source=str(folder))

    @classmethod
    def from_gguf_metadata(cls, tokens: list[str], merges: list[str], model: str | None,
                           bos_token_id: int | None, eos_token_id: int | None,
                           pad_token_id: int | None, chat_template: str | None,
                           add_bos_token: bool | None, token_types: list[int] | None = None,
                           scores: list[float] | None = None, architecture: str = "llama",
                           add_space_prefix: bool | None = None,
                           extra_eos_ids: tuple[int | None, ...] = ()) -> "Tokenizer":
        """A tokenizer from GGUF's `tokenizer.ggml.*` fields: model 'gpt2' (byte-level BPE) or
        'llama' (SentencePiece BPE with byte fallback; add_bos_token defaults to true, as in
        llama.cpp). Tokens GGUF marks control (type 3) are matched whole as special tokens,
        user-defined ones (type 4) whole as plain ones. `extra_eos_ids` (GGUF's eot / eom ids)
        are stop ids too."""
        if model == "gpt2":
            vocab = {token: idx for idx, token in enumerate(tokens)}
            pairs = cast(list[tuple[str, str]], [tuple(m.split(" ", 1)) for m in merges])   # merges are "a b"
            hf = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
            hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            hf.decoder = decoders.ByteLevel()
        elif model == "llama":
            if scores is None and merges == [] and not architecture.startswith("gemma"):
                raise TokenizerError("GGUF tokenizer model 'llama' needs tokenizer.ggml.scores (they rank "
                                     "the merges); the file lacks them: convert the model again")
            tokens, hf = sentencepiece_bpe(tokens, scores or [0.0] * len(tokens), merges, architecture,
                                           add_space_prefix)
            vocab = {token: idx for idx, token in enumerate(tokens)}
            add_bos_token = True if add_bos_token is None else add_bos_token
        else:
            raise TokenizerError(f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                                 "supported: 'gpt2' (byte-level BPE: Llama 3, Qwen2/3, SmolLM) and 'llama' "
                                 "(SentencePiece BPE: Mistral 7B, Gemma 3); load a Hugging Face folder instead")
        types = token_types or []
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                               for i, t in enumerate(types) if t == 3])
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                       for i, t in enumerate(types) if t == 4])
        eos_ids = [eos_token_id] if eos_token_id is not None else []
        for extra in list(extra_eos_ids) + [vocab.get(name) for name in ("<|im_end|>", "<end_of_turn>")
                                           if chat_template and name in chat_template]:
            if extra is not None and extra not in eos_ids:
                eos_ids.append(extra)
        return cls(hf, bos_token_id, eos_ids, pad_token_id, chat_template, bool(add_bos_token))


def sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str], architecture: str,
                      add_space_prefix: bool | None) -> tuple[list[str], HFTokenizer]:
    """(tokens as the tokenizer spells them, tokenizer) of a GGUF SentencePiece BPE vocabulary,
    built as transformers builds it from the same file (the reference in the tests):

    - merges: the file's, else every split of a token into two tokens of the vocabulary, best
      first: by score (Llama, Mistral), by file order for Gemma (its scores do not follow its
      merges); ties by the longer left piece, then the longer right piece;
    - byte fallback: a character with no token becomes its UTF-8 bytes' `<0xXX>` tokens;
    - spaces are "▁". Llama/Mistral: a "▁" is put before the text (unless the file says
      add_space_prefix = false) and taken off on decode. Gemma: no prefix; the file stores its
      runs of spaces as real spaces, read back as runs of "▁".
    """
    gemma = architecture.startswith("gemma")
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {token: idx for idx, token in enumerate(tokens)}
    pairs = (cast(list[tuple[str, str]], [tuple(m.split(" ", 1)) for m in merges]) if merges  # "a b" each
             else _merges_from_scores(vocab, dict(zip(tokens, scores))))
    unk = "<unk>" if gemma and "<unk>" in vocab else None
    hf = HFTokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        hf.normalizer = normalizers.Replace(" ", "\u2581")
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = add_space_prefix is not False
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                    prepend_scheme="first" if prefix else "never")
        steps += [decoders.Strip(" ", 1, 0)] if prefix else []
    hf.decoder = decoders.Sequence(steps)
    return tokens, hf


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary tokens, best score first; ties:
    longer left, then longer right, then file order (transformers' generate_merges, the same order)."""
    found = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


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
