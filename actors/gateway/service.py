"""What the gateway does for one call, apart from HTTP: render (or extend an episode's tokens),
generate, parse tool calls, and build the API's response objects.

A chat call of an open episode (its API key) runs under that episode's lock, so the calls of
one episode are answered in order and its token record (episodes.py) sees them one at a time;
calls of different episodes, and calls with no episode, run concurrently.

Images (a policy with an image layout): a call's image content parts are decoded
(protocol.py `check_images`) and rendered into the prompt as their placeholder runs
(templates.py `render_ids`) in a worker thread, so the event loop serves the other requests
meanwhile, and sent beside the ids (`GenerateRequest.images`). A call of an open episode may not show
images: a segment carries token ids only, so its images could not be trained with it.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

import anyio

from ..models.tokenizer import Tokenizer
from ..models.images import ImageInputError, ImageLayout
from ..records import GeneratedSample, GenerateReply, GenerateRequest
from .episodes import Choice, EpisodeStore
from .pool import GeneratorPool
from .protocol import APIError, ChatCall, CompletionCall, bad_request, check_images
from .templates import marker_id, render_ids
from .tool_calls import parse_tool_calls

FINISH = {"stop": "stop", "length": "length", "abort": "stop", None: "stop"}


@dataclass
class Answer:
    """One answered call: its prompt ids, the generator's reply and, for chat, each choice's message."""

    id: str
    created: int
    prompt_ids: list[int]
    reply: GenerateReply
    messages: list[dict]
    finish_reasons: list[str]


class GatewayService:
    def __init__(self, tokenizer: Tokenizer, pool: GeneratorPool, model_names: tuple[str, ...],
                 max_context_tokens: int, tool_format: str, episodes: EpisodeStore, max_n: int = 16,
                 image_layout: ImageLayout | None = None):
        """image_layout: how the policy lays images out (models/loading.py `spec_image_layout`);
        None: it reads text only, and image content parts are refused."""
        self.tokenizer, self.pool, self.model_names = tokenizer, pool, model_names
        self.max_context_tokens, self.tool_format, self.max_n = max_context_tokens, tool_format, max_n
        self.episodes = episodes
        self.image_layout = image_layout
        if image_layout is not None:
            marker_id(tokenizer, image_layout)   # ImageInputError now, at setup, for a tokenizer without it
        self._locks: dict[str, anyio.Lock] = {}

    async def chat(self, call: ChatCall, key: str | None) -> Answer:
        """Answer a chat call; APIError for a prompt over the context. Cancelled: nothing is
        recorded for the episode (its record changes only after the reply)."""
        episode = self.episodes.get(key)
        if episode is None:
            if call.image_parts:   # decoding images: off the event loop, which serves every other request
                ids, images = await anyio.to_thread.run_sync(self._prompt, call)
            else:
                ids, images = self._prompt(call)
            reply = await self._generate(ids, call.sampling, "messages", images)
            return self._chat_answer(call, ids, reply)
        assert key is not None, "episodes.get finds an episode by a key alone"
        if call.image_parts:
            raise bad_request(call.image_parts[0], "is an image in a call of a recorded episode (its API key); "
                                                   "episodes record token ids only, so its images could not be "
                                                   "trained; fix: send images with a key that is not an open "
                                                   "episode's, or send text")
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            start, began = time.time(), time.perf_counter()
            prompt = episode.prepare(call.messages, call.tools)
            reply = await self._generate(prompt.token_ids, call.sampling, "messages")
            answer = self._chat_answer(call, prompt.token_ids, reply)
            duration_ms = round((time.perf_counter() - began) * 1000, 3)
            episode.record(call.messages, call.tools, prompt, [
                Choice(message, list(s.token_ids), list(s.logprobs), list(s.policy_versions), start, duration_ms)
                for message, s in zip(answer.messages, reply.samples)])
        return answer

    def _prompt(self, call: ChatCall) -> tuple[list[int], list[bytes]]:
        """(prompt ids, image files) of a call outside an episode; a 400 for an image that does not
        decode (naming its part) or a prompt whose image markers and images disagree."""
        check_images(call)
        try:
            return render_ids(self.tokenizer, self.image_layout, call.messages, call.tools)
        except ImageInputError as exc:
            raise bad_request("messages", str(exc)) from None

    def close_episode(self, key: str):
        self._locks.pop(key, None)
        return self.episodes.close(key)

    async def complete(self, call: CompletionCall) -> Answer:
        ids = call.prompt if isinstance(call.prompt, list) else self.tokenizer.encode(call.prompt)
        if isinstance(call.prompt, list) and max(ids) >= self.tokenizer.vocab_size:
            raise APIError(400, f"'prompt': token id {max(ids)} is outside the vocabulary "
                                f"(size {self.tokenizer.vocab_size})", param="prompt")
        reply = await self._generate(ids, call.sampling, "prompt")
        return Answer(_id("cmpl"), int(time.time()), ids, reply, [],
                      [FINISH.get(s.finish_reason, "stop") for s in reply.samples])

    async def _generate(self, ids: list[int], sampling, field: str, images: list[bytes] | None = None
                        ) -> GenerateReply:
        """The generator's reply; the new tokens capped to what the context leaves. images: the
        image files of the image placeholder runs in `ids`, in order."""
        room = self.max_context_tokens - len(ids)
        if room < 1:
            raise APIError(400, f"'{field}': the prompt is {len(ids)} tokens, the model's context is "
                                f"{self.max_context_tokens}; shorten the conversation",
                           param=field, code="context_length_exceeded")
        if sampling.max_new_tokens > room:
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        return await self.pool.generate(GenerateRequest(prompt_ids=ids, sampling=sampling, images=images or None))

    def _chat_answer(self, call: ChatCall, ids: list[int], reply: GenerateReply) -> Answer:
        messages, reasons = [], []
        for sample in reply.samples:
            message, reason = self._message(call, sample)
            messages.append(message)
            reasons.append(reason)
        return Answer(_id("chatcmpl"), int(time.time()), ids, reply, messages, reasons)

    def _message(self, call: ChatCall, sample: GeneratedSample) -> tuple[dict, str]:
        reason = FINISH.get(sample.finish_reason, "stop")
        if call.parses_tool_calls:
            parsed = parse_tool_calls(sample.text, self.tool_format)
            if parsed.tool_calls:
                return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}, "tool_calls"
        return {"role": "assistant", "content": sample.text}, reason

    # ------------------------------------------------------------------ response bodies
    def token_logprobs(self, sample: GeneratedSample, top: int) -> list[dict]:
        """The API's per-token logprobs. The generator reports the sampled token's logprob only,
        so `top_logprobs` lists hold that token alone (when any were asked for)."""
        out = []
        for token_id, logprob in zip(sample.token_ids, sample.logprobs):
            text = self.tokenizer.decode([token_id])
            entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            out.append({**entry, "top_logprobs": [dict(entry)] if top > 0 else []})
        return out

    def chat_body(self, call: ChatCall, answer: Answer) -> dict:
        choices = []
        for i, (sample, message, reason) in enumerate(zip(answer.reply.samples, answer.messages,
                                                          answer.finish_reasons)):
            logprobs = {"content": self.token_logprobs(sample, call.top_logprobs)} if call.logprobs else None
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": logprobs,
                            "token_ids": list(sample.token_ids)})
        return {"id": answer.id, "object": "chat.completion", "created": answer.created, "model": call.model,
                "system_fingerprint": _fingerprint(answer.reply), "choices": choices,
                "usage": usage(answer), "prompt_token_ids": answer.prompt_ids}

    def completion_body(self, call: CompletionCall, answer: Answer) -> dict:
        choices = []
        for i, (sample, reason) in enumerate(zip(answer.reply.samples, answer.finish_reasons)):
            logprobs = None
            if call.logprobs is not None:
                tokens = [self.tokenizer.decode([t]) for t in sample.token_ids]
                logprobs = {"tokens": tokens, "token_logprobs": list(sample.logprobs),
                            "top_logprobs": [{t: lp} for t, lp in zip(tokens, sample.logprobs)] if call.logprobs
                            else None, "text_offset": _offsets(tokens)}
            choices.append({"index": i, "text": sample.text, "finish_reason": reason, "logprobs": logprobs,
                            "token_ids": list(sample.token_ids)})
        return {"id": answer.id, "object": "text_completion", "created": answer.created, "model": call.model,
                "system_fingerprint": _fingerprint(answer.reply), "choices": choices,
                "usage": usage(answer), "prompt_token_ids": answer.prompt_ids}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(answer: Answer) -> dict:
    completion = sum(len(s.token_ids) for s in answer.reply.samples)
    return {"prompt_tokens": len(answer.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(answer.prompt_ids) + completion}


def _fingerprint(reply: GenerateReply) -> str:
    """The policy versions that sampled the reply, as `policy-v3` (or `policy-v3-v4` across a swap)."""
    versions = sorted({v for s in reply.samples for v in s.policy_versions})
    return "policy-" + "-".join(f"v{v}" for v in versions) if versions else "policy"


def _offsets(tokens: list[str]) -> list[int]:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets
