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
"""
from __future__ import annotations

from ..records import ChatReply, GeneratedSample, GenerateReply, GenerateRequest
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
