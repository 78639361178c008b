"""Reward models: Hugging Face `*ForSequenceClassification` folders of the registry's architectures.

    check_reward_model_spec("/models/Skywork-Reward-Qwen3")   # config + safetensors headers only
    rm = load_reward_model("/models/Skywork-Reward-Qwen3")
    rm.score([[1, 42, 7, 9], [1, 42]])                         # -> [0.83, -1.2]: one float per sequence

A reward-model folder is what transformers' `AutoModelForSequenceClassification.save_pretrained`
writes: config.json whose `architectures` names `XForSequenceClassification` (X a registered
architecture: Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3 text), `*.safetensors` holding
the decoder (`model.*`, no LM head) and the `score` head (`score.weight`, (num_labels, hidden),
no bias), and optionally tokenizer.json. num_labels must be 1: one scalar per sequence.

The decoder is the registry's own model (the policy's implementation, loaded through the same
checks: `config_from_hf` refuses a field it does not honour, `model_from_state` names any
missing, unexpected or misshapen tensor); its LM head is tied to the embedding, so it costs no
memory, and never runs. The score is the head on the final-norm hidden state of each sequence's
last token, as transformers pools it: the rightmost token that is not config.json's
`pad_token_id` (so a sequence that ends in the pad id is scored at the token before, as
transformers scores it; every other sequence at its last token). Sequences are scored in
batches, right-padded with an attention mask (positions count real tokens, so a padded row's
real tokens see what they would alone); equal to transformers' logits up to float rounding
(tests/actors/models/test_reward_model.py).

Model folders are untrusted input: config.json and the safetensors headers are read and checked
before any weight is (`check_reward_model_spec`, also what `--dry-run` calls), and a folder that
fails raises `CheckpointError` naming the folder, the rule and the fix.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .hf_config import CheckpointError, config_from_hf
from .loading import model_from_state, resolve_model
from .tokenizer import Tokenizer

__all__ = ["RewardModel", "load_reward_model", "check_reward_model_spec", "SCORE_HEAD", "REWARD_MODEL_RULE"]

SCORE_HEAD = "score.weight"          # the head's tensor in a *ForSequenceClassification folder
SUFFIX = "ForSequenceClassification"
REWARD_MODEL_RULE = ("a reward model needs *ForSequenceClassification weights with a `score` head: a Hugging "
                     "Face folder saved by transformers' AutoModelForSequenceClassification (num_labels=1) of "
                     "a registered architecture, config.json + *.safetensors holding `score.weight`")
DEFAULT_MAX_BATCH_TOKENS = 16384     # padded tokens per forward pass


@dataclass(frozen=True)
class RewardFolder:
    """What `inspect_reward_folder` read of a folder without loading its weights."""

    folder: Path
    hf_config: dict            # config.json as read
    config: ModelConfig        # the decoder's config (config_from_hf)
    architecture: str          # the `XForSequenceClassification` name config.json gives
    files: tuple[Path, ...]    # the *.safetensors files, sorted
    pad_token_id: int | None   # config.json's: the token transformers' pooling skips at the end


def inspect_reward_folder(spec: str | Path | dict) -> RewardFolder:
    """The folder's checked description (config.json, architecture, num_labels, the score head's
    name and shape in the safetensors headers); CheckpointError naming the folder and the fix."""
    if isinstance(spec, dict):
        raise CheckpointError(f"a reward model is a folder, not model config fields {spec!r}; {REWARD_MODEL_RULE}")
    folder = Path(resolve_model(spec))
    if not folder.is_dir():
        what = "a file" if folder.is_file() else "no such folder"
        raise CheckpointError(f"reward model {str(spec)!r} is {what} (a built-in name or a .gguf file "
                              f"holds no score head); {REWARD_MODEL_RULE}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"reward model folder {str(folder)!r} has no config.json; {REWARD_MODEL_RULE}")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not a JSON config ({exc}); {REWARD_MODEL_RULE}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path}: not a JSON object; {REWARD_MODEL_RULE}")
    names = hf.get("architectures") or []
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    classifiers = [n for n in names if n.endswith(SUFFIX)]
    if not classifiers:
        raise CheckpointError(f"reward model folder {str(folder)!r}: config.json's architectures {names} name no "
                              f"*{SUFFIX} (a causal LM is no reward model); {REWARD_MODEL_RULE}")
    config = config_from_hf(hf)                      # the registry's rules: model_type, honoured fields
    num_labels = _num_labels(hf)
    if num_labels != 1:
        raise CheckpointError(f"reward model folder {str(folder)!r} has num_labels={num_labels} (config.json "
                              "id2label); a reward model gives one score per sequence: num_labels must be 1 "
                              "(a classifier of several labels is not a reward model)")
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"reward model folder {str(folder)!r} has no *.safetensors weights "
                              "(pytorch_model.bin is not read: convert it with safetensors first)")
    shape = _tensor_shape(files, SCORE_HEAD)
    if shape is None:
        raise CheckpointError(f"reward model folder {str(folder)!r} has no `{SCORE_HEAD}` tensor in its "
                              f"safetensors; {REWARD_MODEL_RULE}")
    if shape != (1, config.hidden_size):
        raise CheckpointError(f"reward model folder {str(folder)!r}: `{SCORE_HEAD}` has shape {shape}, a "
                              f"num_labels=1 head over hidden_size={config.hidden_size} is (1, {config.hidden_size})")
    pad = hf.get("pad_token_id")
    if isinstance(pad, list):          # some configs list several; transformers compares with one
        pad = pad[0] if pad else None
    return RewardFolder(folder=folder, hf_config=hf, config=config, architecture=classifiers[0], files=files,
                        pad_token_id=pad if isinstance(pad, int) else None)


def check_reward_model_spec(spec: str | Path | dict) -> None:
    """Raise CheckpointError where `spec` is no reward model load_reward_model would load: names,
    config.json and safetensors headers only (no weight is read), so `--dry-run` stays fast."""
    inspect_reward_folder(spec)


def _num_labels(hf: dict) -> int:
    """num_labels as transformers reads config.json: id2label's size, else `num_labels`, else 2."""
    id2label = hf.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    value = hf.get("num_labels")
    return value if isinstance(value, int) else 2


def _tensor_shape(files: tuple[Path, ...], name: str) -> tuple[int, ...] | None:
    """The shape of tensor `name` from the safetensors headers of `files` (None: in none of them)."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                if name in handle.keys():
                    return tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:   # a malformed or truncated header, an unreadable file
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc}); re-save the "
                                  "model with safetensors") from None
    return None


class RewardModel(nn.Module):
    """A registry decoder and the `score` head: `score(token_ids)` -> one float per sequence.
    Invariant: `decoder` is a registry CausalLM whose LM head is tied to its embedding (never run);
    `head` is transformers' `score` Linear (hidden -> 1, no bias)."""

    def __init__(self, decoder: nn.Module, head: nn.Linear, pad_token_id: int | None = None,
                 tokenizer: Tokenizer | None = None, source: str = "the reward model",
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS):
        super().__init__()
        self.decoder = decoder
        self.head = head
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer           # None: the folder had no tokenizer.json
        self.source = source
        self.max_batch_tokens = max_batch_tokens

    @property
    def config(self) -> ModelConfig:
        return self.decoder.config  # type: ignore[return-value]  # torch: a module attribute

    def scored_position(self, ids: list[int]) -> int:
        """The index of the token whose hidden state is scored: the last one that is not the pad
        id (transformers' pooling; 0 when every token is the pad id, as there)."""
        if self.pad_token_id is None:
            return len(ids) - 1
        for index in range(len(ids) - 1, -1, -1):
            if ids[index] != self.pad_token_id:
                return index
        return 0

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> list[float]:
        """The head's score of each sequence (list of token ids, BOS included where the model
        wants one), in order. Batched by length, right-padded, at most max_batch_tokens padded
        tokens per pass. ValueError names an empty sequence, an id outside the vocabulary or a
        sequence past the context length."""
        vocab, limit = self.config.vocab_size, self.config.max_position_embeddings
        for i, ids in enumerate(token_ids):
            if len(ids) == 0:
                raise ValueError(f"sequence {i} is empty; a reward model scores at least one token")
            if len(ids) > limit:
                raise ValueError(f"sequence {i} has {len(ids)} tokens, past {self.source}'s context length "
                                 f"max_position_embeddings={limit}; shorten it")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"sequence {i} holds token id {bad}, outside {self.source}'s vocabulary "
                                 f"[0, {vocab}); are the ids from the reward model's tokenizer?")
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        scores: list[float] = [0.0] * len(token_ids)
        device = self.head.weight.device
        start = 0
        while start < len(order):                   # longest last: each chunk pads to its own longest
            end = start + 1
            while end < len(order) and len(token_ids[order[end]]) * (end + 1 - start) <= self.max_batch_tokens:
                end += 1
            chunk = order[start:end]
            width = len(token_ids[chunk[-1]])
            padded = torch.zeros(len(chunk), width, dtype=torch.long)          # right-padded with 0
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                padded[row, :len(token_ids[i])] = torch.tensor(token_ids[i], dtype=torch.long)
                mask[row, :len(token_ids[i])] = 1
            # type ignore: the decoder is a registry model (LlamaModel.hidden_states); torch types it Module
            hidden = self.decoder.hidden_states(padded.to(device), mask.to(device))  # type: ignore[operator]
            at = torch.tensor([self.scored_position(token_ids[i]) for i in chunk], device=device)
            last = hidden[torch.arange(len(chunk), device=device), at]          # (B, hidden)
            values = self.head(last.to(self.head.weight.dtype)).float()[:, 0].tolist()
            for i, value in zip(chunk, values):
                scores[i] = float(value)
            start = end
        return scores


def load_reward_model(spec: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> RewardModel:
    """The RewardModel (eval mode, on `device` in `dtype`) of a `*ForSequenceClassification`
    folder; CheckpointError naming the folder and the fix for anything else (inspect_reward_folder)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    info = inspect_reward_folder(spec)
    state: dict[str, torch.Tensor] = {}
    for file in info.files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:   # a malformed or truncated file, an unreadable one
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc}); re-save the "
                                  "model with safetensors") from None
    head_weight = state.pop(SCORE_HEAD)
    source = str(info.folder)
    if "lm_head.weight" in state:
        raise CheckpointError(f"{source}: holds an LM head (`lm_head.weight`) beside the score head; "
                              f"{REWARD_MODEL_RULE}")
    # The LM head tied to the embedding: a registry model without a second vocab x hidden matrix.
    decoder = model_from_state(dataclasses.replace(info.config, tie_word_embeddings=True), state, source=source)
    head = nn.Linear(info.config.hidden_size, 1, bias=False)
    with torch.no_grad():
        head.weight.copy_(head_weight.to(head.weight.dtype))
    tokenizer = (Tokenizer.from_folder(info.folder, info.hf_config)
                 if (info.folder / "tokenizer.json").is_file() else None)
    model = RewardModel(decoder, head, pad_token_id=info.pad_token_id, tokenizer=tokenizer, source=source)
    return model.to(device=device, dtype=dtype).eval()
