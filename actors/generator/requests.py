"""A `generate` message as engine work and back: what every actor that serves `GENERATE` with
an `Engine` shares (the generator actor, a judge scorer: actors/scorer/).

    prompt = engine_prompt(request)                 # token ids, or text the engine tokenizes
    engine.add_request(prompt, request.sampling, request_id=...)
    ... the request finishes ...
    reply = generate_reply(output)                  # GenerateReply: exact ids, logprobs, versions
"""
from __future__ import annotations

from ..records import GeneratedSample, GenerateReply, GenerateRequest
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
