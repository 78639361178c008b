"""`chat`: chat messages in, the reply text out, rendered and tokenized by the model that answers
(a judge or a simulated user served by a scorer actor: actors/scorer/, actors/env/scorers.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record

from .generate import SAMPLING_CODEC, SamplingParams


@dataclass(frozen=True, slots=True)
class ChatRequest(Record):
    """Messages as OpenAI chat messages ({"role", "content"}), and how to sample the one reply."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams, metadata=SAMPLING_CODEC)

    def _check(self) -> None:
        if not self.messages:
            self.fail_field("messages", self.messages, "a non-empty list of {'role', 'content'} messages")
        for message in self.messages:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                self.fail_field("messages", message, "messages with a str role and a str content")


@dataclass(frozen=True, slots=True)
class ChatReply(Record):
    """The reply's text, and the tokens of the rendered prompt and of the reply (for the trace)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"


CHAT = MessageKind("chat", ChatRequest, ChatReply)
