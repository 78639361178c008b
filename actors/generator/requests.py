"""A `generate` message as engine work and back: what every actor that serves `GENERATE` with
an `Engine` shares (the generator actor, a judge scorer: actors/scorer/).

    prompt = engine_prompt(request)                 # token ids, or text the engine tokenizes
    engine.add_request(prompt, request.sampling, request_id=...)
    ... the request finishes ...
    reply = generate_reply(output)                  # GenerateReply: exact ids, logprobs, versions

A `chat` message (a judge scorer's, or an in-process judge: actors/scorer/local.py) is the same
work on the messages rendered with the model's chat template:

    prompt = chat_prompt(tokenizer, messages)       # token ids, the assistant's turn opened
    reply = chat_reply(prompt, output)              # ChatReply: the one sample's text, the tokens

A `score_continuations` message (a judge in choice mode) is one scoring request per continuation
(actors/generator/scoring.py), nothing sampled; they share the rendered prompt, so all but the
first find it in the prefix cache:

    start, sequences = continuation_sequences(tokenizer, request)
    engine.add_score_request(ids, start, top_k=1, ...) for ids in sequences
    reply = continuations_reply(start, sequences, [output.scores, ...])   # ContinuationsReply

An actor that runs the engine in a loop of its own parks each caller on a `Waiter` until its
request finishes (the generator actor, the scorer actor).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ..records import (ChatReply, ContinuationsReply, ContinuationsRequest, GeneratedSample, GenerateReply,
                       GenerateRequest)
from .scoring import Scores
from .sequence import RequestOutput


def engine_prompt(request: GenerateRequest) -> list[int] | str:
    """The prompt the engine takes: the request's token ids, or its text."""
    if request.prompt_ids is not None:
        return [int(t) for t in request.prompt_ids]
    assert request.prompt is not None, "a GenerateRequest holds prompt_ids or prompt (its _check)"
    return request.prompt


def generate_reply(output: RequestOutput) -> GenerateReply:
    """The `generate` reply of a finished request: per sample its exact ids, their logprobs, the
    policy version that sampled each, why it stopped, its text (and its MoE routing)."""
    return GenerateReply(prompt_len=len(output.prompt_token_ids), samples=[
        GeneratedSample(token_ids=s.token_ids, logprobs=s.logprobs, policy_versions=s.policy_versions,
                        finish_reason=s.finish_reason, text=s.text, routed_experts=s.routed_experts)
        for s in output.outputs])


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of chat `messages` rendered with the tokenizer's chat template, the
    assistant's turn opened (TokenizerError where the model has no template)."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def chat_reply(prompt: list[int], output: RequestOutput) -> ChatReply:
    """The `chat` reply of a finished one-sample request of `prompt`: its text, the prompt's and
    the reply's token counts and why it stopped."""
    sample = output.outputs[0]
    return ChatReply(text=sample.text, prompt_tokens=len(prompt), completion_tokens=len(sample.token_ids),
                     finish_reason=sample.finish_reason or "stop")


def continuation_sequences(tokenizer, request: ContinuationsRequest) -> tuple[int, list[list[int]]]:
    """(start, one token sequence per continuation) of a `score_continuations` request: the text
    is the messages rendered with the chat template, the assistant's turn opened, then
    `request.prefix`, then the continuation (then the EOS token where `end_of_turn`), tokenized
    whole, so a continuation's first token may merge with the prefix's end (" PASS" after
    "VERDICT:"). `start` is the first token at which some sequence leaves the tokens of the prompt
    with the prefix alone (at most their count): every continuation is scored from there, under the
    same context, so their logprobs compare (each is the logprob of its text from that point)."""
    prompt = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True) + request.prefix
    base = tokenizer.encode(prompt)
    sequences = [tokenizer.encode(prompt + continuation) for continuation in request.continuations]
    if request.end_of_turn:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("end_of_turn needs the model's end-of-sequence token, and its tokenizer names none")
        sequences = [ids + [int(eos)] for ids in sequences]
    start = len(base)
    for ids in sequences:
        same = 0
        for a, b in zip(base, ids):
            if a != b:
                break
            same += 1
        start = min(start, same)
    return max(1, start), sequences


def continuations_reply(start: int, sequences: list[list[int]], scores: list[Scores]) -> ContinuationsReply:
    """The `score_continuations` reply: each sequence's token logprobs summed from `start` on."""
    return ContinuationsReply(logprobs=[float(rows.token_logprobs[start:].astype("float64").sum()) for rows in scores],
                              num_tokens=[len(ids) - start for ids in sequences], prompt_tokens=start)


@dataclass
class Waiter:
    """A caller waiting for its engine request: `done` is set once `output` or `error` is."""

    done: anyio.Event = field(default_factory=anyio.Event)
    output: RequestOutput | None = None
    error: Exception | None = None
