"""Speculative decoding: the options, the draft proposers and the adaptive draft length.

    engine = Engine(model, tokenizer, speculative=SpeculativeOptions(method="ngram", num_draft_tokens=4))

Design note. A proposer guesses the next few tokens of a sequence from text it has already
seen, at almost no cost; the engine scores the guesses with the policy in the same batched
forward that decodes (k + 1 positions for a sequence with k drafted tokens) and keeps the
longest run of guesses that the verify rule accepts, plus one token of the policy's own
(`postrain.actors.generator.sampling.verify_drafts`: exact speculative sampling, so what is emitted is
distributed as plain sampling would be, with the same logprobs). A guess is only a guess:
a bad one costs one wasted position of a forward, never a wrong token. Agentic episodes are
full of copied text (tool output quoted in the answer, code revised after a failed test, an
earlier attempt at the same prompt), which is where guesses land.

Proposers (deterministic: a draft is one token, not a distribution):
- "ngram": the last n tokens of the sequence (prompt included; n from max_ngram down to
  min_ngram) are looked up in the sequence's own earlier text; the tokens that followed
  their latest earlier occurrence are the draft.
- "rollouts": first the same lookup in recent completed samples of the same prompt (a
  bounded store: `max_rollouts_per_prompt` samples for each of the `max_prompts` most
  recent prompts, of any policy version), then in the sequence's own text as "ngram" does.
- "draft_model": a small model with the policy's tokenizer (`draft_model`, any `load_model`
  spec; its vocabulary size must be the policy's) continues the sequence greedily, k tokens,
  in an engine of its own (`draft_kv_cache_mb`), all the step's drafting sequences in one
  batch; its prefix cache keeps each sequence's text between steps, so a step prefills
  only the tokens new since the last. Its weights stay as loaded: the policy's updates do
  not reach it, which only lowers the acceptance.

Adaptive k: each sequence drafts at most its own k, which starts at `num_draft_tokens`;
after a verify step in which every drafted token was accepted it grows by 2, else it
shrinks by 1 (never below 1, never above `num_draft_tokens`).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Literal, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from pydantic import Field, model_validator

from postrain.core import Options

from .sampling import SamplingParams


class SpeculativeOptions(Options):
    """Speculative decoding of one generator (off when the generator has none)."""

    method: Literal["ngram", "rollouts", "draft_model"] = Field(
        description="where drafts come from: 'ngram' (the sequence's own text), 'rollouts' (earlier "
                    "samples of the same prompt, then the sequence's own text) or 'draft_model' (a small "
                    "model with the policy's tokenizer, greedy)")
    num_draft_tokens: int = Field(4, ge=1, le=16, description="k: drafted tokens verified per sequence "
                                  "and step at most")
    adaptive: bool = Field(True, description="each sequence's k follows its recent acceptance "
                           "(+2 after a fully accepted draft, -1 otherwise)")
    min_ngram: int = Field(2, ge=1, le=16, description="shortest suffix (tokens) looked up for a draft")
    max_ngram: int = Field(4, ge=1, le=16, description="longest suffix (tokens) looked up for a draft")
    max_rollouts_per_prompt: int = Field(8, ge=1, description="'rollouts': samples kept per prompt")
    max_prompts: int = Field(256, ge=1, description="'rollouts': prompts whose samples are kept "
                             "(least recently finished forgotten first)")
    draft_model: str | None = Field(None, description="'draft_model': the model that drafts (a built-in "
                                    "name, a Hugging Face folder or a .gguf file) with the policy's "
                                    "tokenizer")
    draft_kv_cache_mb: float = Field(256, gt=0, description="'draft_model': memory of its KV cache, MiB "
                                     "(holds the drafting sequences' text between steps)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram}); "
                             "raise max_ngram or lower min_ngram")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("method 'draft_model' needs draft_model (the model that drafts, e.g. a "
                             "Hugging Face folder of a small model with the policy's tokenizer)")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by method 'draft_model', not {self.method!r}; "
                             "set method = \"draft_model\" or remove draft_model")
        return self


# One sequence's draft request: (token_ids: the prompt, then what was generated; prompt_key:
# the prompt's token ids; k: drafted tokens wanted at most, >= 1).
DraftRequest = tuple[list[int], tuple[int, ...], int]


class Proposer(Protocol):
    """What the engine asks of a draft source (deterministic drafts: token ids, no distribution)."""

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Up to k drafted tokens for each request, in order (all the step's drafting sequences)."""

    def record(self, prompt_key: tuple[int, ...], completion_ids: list[int]) -> None:
        """A finished sample of the prompt whose token ids are prompt_key."""


def next_num_draft_tokens(k: int, num_drafted: int, num_accepted: int, k_max: int) -> int:
    """A sequence's draft length after a verify step that drafted and accepted these many."""
    if num_drafted == 0:
        return k
    if num_accepted == num_drafted:
        return min(k_max, k + 2)
    return max(1, k - 1)


def _continuation(text: np.ndarray, pattern: np.ndarray, k: int) -> list[int]:
    """Up to k tokens that followed the latest occurrence of pattern in text (an occurrence
    counts only if a token follows it inside text)."""
    n = len(pattern)
    if len(text) <= n:
        return []
    windows = sliding_window_view(text[:-1], n)                              # (len - n, n)
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    if not hits.size:
        return []
    start = int(hits[-1]) + n
    return text[start:start + k].tolist()


class NgramProposer:
    """Drafts from the sequence's own text (see the module docstring)."""

    def __init__(self, options: SpeculativeOptions):
        self.min_ngram, self.max_ngram = options.min_ngram, options.max_ngram

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self.propose(*request) for request in requests]

    def propose(self, token_ids: list[int], prompt_key: tuple[int, ...], k: int) -> list[int]:
        """One sequence's draft."""
        return self._lookup([np.asarray(token_ids)], np.asarray(token_ids[-self.max_ngram:]), k)

    def record(self, prompt_key: tuple[int, ...], completion_ids: list[int]) -> None:
        """Ignored: this proposer looks only at the sequence's own text."""

    def _lookup(self, texts: list[np.ndarray], suffix: np.ndarray, k: int) -> list[int]:
        """The first text, in order, holding the longest suffix n-gram; its continuation."""
        for n in range(min(self.max_ngram, len(suffix)), self.min_ngram - 1, -1):
            for text in texts:
                draft = _continuation(text, suffix[-n:], k)
                if draft:
                    return draft
        return []


class RolloutProposer(NgramProposer):
    """Drafts from earlier samples of the same prompt, then from the sequence's own text.

    Invariant: len(self._rollouts) <= max_prompts and every deque holds at most
    max_rollouts_per_prompt samples, each stored as the prompt's last max_ngram tokens plus
    the completion (so a lookup at the first generated position can match the prompt's end).
    """

    def __init__(self, options: SpeculativeOptions):
        super().__init__(options)
        self.max_prompts, self.max_per_prompt = options.max_prompts, options.max_rollouts_per_prompt
        self._rollouts: OrderedDict[tuple[int, ...], deque[np.ndarray]] = OrderedDict()

    def propose(self, token_ids: list[int], prompt_key: tuple[int, ...], k: int) -> list[int]:
        suffix = np.asarray(token_ids[-self.max_ngram:])
        stored = self._rollouts.get(prompt_key)
        texts = list(reversed(stored)) if stored else []                     # newest first
        return self._lookup(texts + [np.asarray(token_ids)], suffix, k)

    def record(self, prompt_key: tuple[int, ...], completion_ids: list[int]) -> None:
        if not completion_ids:
            return
        samples = self._rollouts.pop(prompt_key, None) or deque(maxlen=self.max_per_prompt)
        samples.append(np.asarray(list(prompt_key[-self.max_ngram:]) + list(completion_ids)))
        self._rollouts[prompt_key] = samples                                  # most recent last
        while len(self._rollouts) > self.max_prompts:
            self._rollouts.popitem(last=False)


class DraftModelProposer:
    """Drafts the greedy continuation of a small model (see the module docstring).

    drafter: an `Engine` over the draft model with prefix caching: each call runs all the
    step's drafting sequences as one batch, prefilling only each one's text past its cached
    blocks (what earlier calls for it left there), then decoding k tokens."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.max_positions = drafter.config.max_position_embeddings

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        ks = [min(k, self.max_positions - 1) for _, _, k in requests]
        contexts = [token_ids[-(self.max_positions - k):] for (token_ids, _, _), k in zip(requests, ks)]
        params = [SamplingParams(temperature=0.0, max_new_tokens=k, ignore_eos=True) for k in ks]
        return [out.outputs[0].token_ids for out in self.drafter.generate(contexts, params)]

    def record(self, prompt_key: tuple[int, ...], completion_ids: list[int]) -> None:
        """Ignored: the draft model looks only at the sequence's own text."""


def make_proposer(options: SpeculativeOptions) -> Proposer:
    """The "ngram" or "rollouts" proposer (the engine builds "draft_model"'s: it needs an engine)."""
    return {"ngram": NgramProposer, "rollouts": RolloutProposer}[options.method](options)
