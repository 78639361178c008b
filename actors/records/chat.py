"""`chat`: chat messages in, the reply text out, rendered and tokenized by the model that answers
(a judge or a simulated user served by a scorer actor: actors/scorer/, actors/env/scorers.py).

`score_continuations`: chat messages and a few continuations of the assistant's reply in, each
continuation's total logprob out, nothing sampled (a judge in choice mode: actors/scorer/judge.py).
The messages are rendered with the model's chat template and the assistant's turn opened, then
`prefix` (text the assistant's reply starts with, e.g. "VERDICT: ") is appended; each
continuation's tokens after that are scored by the engine's scoring requests
(actors/generator/requests.py's `continuation_sequences`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record

from .generate import SAMPLING_CODEC, SamplingParams


def _check_messages(record: Record, messages: list[dict[str, Any]]) -> None:
    if not messages:
        record.fail_field("messages", messages, "a non-empty list of {'role', 'content'} messages")
    for message in messages:
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            record.fail_field("messages", message, "messages with a str role and a str content")


@dataclass(frozen=True, slots=True)
class ChatRequest(Record):
    """Messages as OpenAI chat messages ({"role", "content"}), and how to sample the one reply."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=SAMPLING_CODEC)

    def _check(self) -> None:
        _check_messages(self, self.messages)


@dataclass(frozen=True, slots=True)
class ChatReply(Record):
    """The reply's text, and the tokens of the rendered prompt and of the reply (for the trace)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"


CHAT = MessageKind("chat", ChatRequest, ChatReply)


@dataclass(frozen=True, slots=True)
class ContinuationsRequest(Record):
    """Messages as `ChatRequest`'s; `prefix`: the assistant's reply's opening text, written after
    the rendered prompt; `continuations`: what may follow it, each scored (at least one, no two
    equal); `end_of_turn`: each continuation is followed by the model's end-of-sequence token,
    scored too (so that "1" does not win over "10" by being its prefix)."""

    messages: list[dict[str, Any]]
    continuations: list[str]
    prefix: str = ""
    end_of_turn: bool = False

    def _check(self) -> None:
        _check_messages(self, self.messages)
        if not self.continuations or len(set(self.continuations)) != len(self.continuations):
            self.fail_field("continuations", self.continuations, "a non-empty list of distinct strings")
        if any(not c for c in self.continuations):
            self.fail_field("continuations", self.continuations, "non-empty strings")


@dataclass(frozen=True, slots=True)
class ContinuationsReply(Record):
    """Per continuation, in order: its total logprob (the sum over its tokens of log_softmax of the
    logits, temperature 1) and its token count; `prompt_tokens`: the tokens every continuation
    shares (the rendered prompt and the part of `prefix` that tokenizes alike in all)."""

    logprobs: list[float]
    num_tokens: list[int]
    prompt_tokens: int

    def _check(self) -> None:
        if len(self.num_tokens) != len(self.logprobs):
            self.fail_field("num_tokens", self.num_tokens, f"one count per logprob ({len(self.logprobs)})")


SCORE_CONTINUATIONS = MessageKind("score_continuations", ContinuationsRequest, ContinuationsReply)
