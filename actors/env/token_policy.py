"""The environment actor's token-level policy: exactly the sampled ids, segment by segment.

    policy = TokenPolicy(generator, tokenizer, sampling, max_total_tokens=1024, timeline=timeline)
    episode = await run_episode(env, task, policy, context=...)      # actors/env/episode.py
    rollout = policy.rollout(episode, timeline)                      # a records.Rollout

Design note (tokens in, tokens out). A segment is one growing list of token ids: the rendered
prompt, then for each turn exactly the ids the generator sampled (loss_mask 1, with their
logprobs and policy versions), then the observation's tokens (loss_mask 0). The action text
the environment sees is the decode of the sampled ids; the sampled ids themselves are never
re-encoded. An observation's tokens are the chat template's text between the end of the
assistant's content and the next generation prompt, encoded alone. Each generate call's
prompt is the current segment's ids, whole, so every sampled id was sampled in the context
its segment holds before it.

When the driver changes the history (a context policy, actors/env/context.py) it calls
`restart`: the current segment is closed (cut after its last sampled id: what follows was
never read by a sampled token) and kept, and a new one starts from the new history's render.
A segment with no sampled id is not kept (nothing in it to train).
"""
from __future__ import annotations

import dataclasses

from ..models.tokenizer import Tokenizer
from ..records import GENERATE, GenerateRequest, Rollout, RolloutSegment, SamplingParams
from ..models.images import ImageInputError, ImageLayout, render_prompt
from .timeline import Timeline
from .api import EnvironmentFailure, require_text_messages
from .episode import Episode, EpisodePolicy


def observation_ids(tokenizer: Tokenizer, conversation: list[dict], ended_with_eos: bool) -> list[int]:
    """Token ids that close the last assistant turn, add the observation turn (the last
    message of `conversation`) and open the next assistant turn."""
    before_assistant = tokenizer.apply_chat_template(conversation[:-2], add_generation_prompt=True)
    with_assistant = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=False)
    with_observation = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    content = conversation[-2]["content"]
    if not (with_assistant.startswith(before_assistant + content) and with_observation.startswith(with_assistant)):
        raise EnvironmentFailure("the chat template re-renders earlier turns differently; multi-turn "
                                 "token rollouts need a prefix-stable template")
    turn_end = with_assistant[len(before_assistant) + len(content):]
    if ended_with_eos and tokenizer.eos_token_ids:
        for eos in tokenizer.eos_token_ids:  # the sampled eos already closed the turn
            eos_text = tokenizer.decode([eos])
            if turn_end.startswith(eos_text):
                turn_end = turn_end[len(eos_text):]
                break
    return tokenizer.encode(turn_end + with_observation[len(with_assistant):], add_bos=False)


class TokenPolicy(EpisodePolicy):
    """The environment actor's policy: asks the generator for each action and keeps the
    rollout's token bookkeeping, exactly the sampled ids (see the module's design note).

    Invariant: len(token_ids) == len(loss_mask) == len(behavior_logprobs) == len(policy_versions)
    (the current segment's); loss_mask is 1 exactly on sampled ids, whose policy_versions are >= 0
    (others: -1, logprob 0.0). Every segment holds at most `max_segment_tokens` tokens
    (min(max_total_tokens, max_context_tokens)): `can_act` is False once they are used (the
    driver then truncates the episode), and a generate call asks for no more than the room left.
    """

    def __init__(self, generator, tokenizer: Tokenizer, sampling: SamplingParams, max_total_tokens: int,
                 timeline: Timeline, max_context_tokens: int | None = None,
                 image_layout: ImageLayout | None = None) -> None:
        self.generator, self.tokenizer, self.timeline = generator, tokenizer, timeline
        self.image_layout = image_layout     # a vision-language policy's (models/vision.py); None: text only
        self.sampling, self.max_total_tokens = sampling, max_total_tokens
        self.max_segment_tokens = min(max_total_tokens, max_context_tokens or max_total_tokens)
        self.has_context_policy = max_context_tokens is not None   # segments end at their last sampled id
        self.segments: list[RolloutSegment] = []   # the closed segments, oldest first
        self._open_segment()

    def _open_segment(self) -> None:
        self.images: list[bytes] = []    # the image files of the segment's prompt, in order
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.behavior_logprobs: list[float] = []
        self.policy_versions: list[int] = []
        self._ended_with_eos = False   # the last action ended with a sampled eos
        self.routed_experts: bytes | None = None   # MoE: the last action's routing record, of the
        self._routed_len = 0                         # first _routed_len tokens (all, at that action)

    def _extend(self, ids: list[int], logprobs: list[float] | None = None,
                versions: list[int] | None = None) -> None:
        sampled = logprobs is not None
        assert sampled == (versions is not None), "sampled tokens, and only they, carry their policy versions"
        self.token_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.behavior_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.policy_versions += versions if versions is not None else [-1] * len(ids)

    def _render(self, messages: list[dict]) -> tuple[list[int], list[bytes]]:
        """(ids, image files) of the messages, the assistant's turn opened."""
        if self.image_layout is None:
            require_text_messages(messages, "this policy")
        try:
            return render_prompt(self.tokenizer, self.image_layout, messages)
        except ImageInputError as exc:
            raise EnvironmentFailure(f"an image in the episode's messages: {exc}") from None

    def begin(self, messages: list[dict]) -> None:
        ids, self.images = self._render(messages)
        self._extend(ids)

    def can_act(self) -> bool:
        return len(self.token_ids) < self.max_segment_tokens

    async def act(self, messages: list[dict]) -> str:
        """One generate call (a "generate" hop). Cancellation: the request is abandoned; the
        bookkeeping is unchanged until the reply arrives."""
        budget = self.max_segment_tokens - len(self.token_ids)
        params = dataclasses.replace(self.sampling, n=1,
                                     max_new_tokens=min(self.sampling.max_new_tokens, budget))
        request = GenerateRequest(prompt_ids=list(self.token_ids), sampling=params, images=self.images or None)
        with self.timeline.hop("generate", self.generator.name, segment=len(self.segments)) as hop:
            sample = (await self.generator.call(GENERATE, request, timeout_s=600)).samples[0]
            hop.update(num_tokens=len(sample.token_ids), policy_versions=sorted(set(sample.policy_versions)))
        ids = list(sample.token_ids)
        self._extend(ids, list(sample.logprobs), list(sample.policy_versions))
        self.routed_experts, self._routed_len = sample.routed_experts, len(self.token_ids)
        self._ended_with_eos = bool(ids) and ids[-1] in self.tokenizer.eos_token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def observe(self, messages: list[dict]) -> None:
        self._extend(observation_ids(self.tokenizer, messages, self._ended_with_eos))

    # -- segments (a context policy changed the history) --------------------------------

    def context_size(self) -> int:
        return len(self.token_ids)

    def turn_reserve(self) -> int:
        return self.sampling.max_new_tokens

    def measure(self, messages: list[dict]) -> int:
        return len(self._render(messages)[0])

    def restart(self, messages: list[dict]) -> None:
        """Close the current segment (kept when it holds a sampled id) and open one from `messages`."""
        closed = self._closed_segment()
        if closed is not None:
            self.segments.append(closed)
        self._open_segment()
        ids, self.images = self._render(messages)
        self._extend(ids)

    def _closed_segment(self) -> RolloutSegment | None:
        """The current segment cut after its last sampled id; None when it has none."""
        end = max((i + 1 for i, m in enumerate(self.loss_mask) if m), default=0)
        if not end:
            return None
        record = self._routing_record()
        if record is not None:
            record = record[:len(record) // len(self.token_ids) * end]
        return RolloutSegment(token_ids=self.token_ids[:end], loss_mask=self.loss_mask[:end],
                              behavior_logprobs=self.behavior_logprobs[:end],
                              policy_versions=self.policy_versions[:end],
                              num_policy_tokens=sum(self.loss_mask[:end]), routed_experts=record,
                              images=self.images or None)

    def rollout(self, episode: Episode, timeline: Timeline) -> Rollout:
        """The rollout of a finished episode played by this policy: its current segment as the
        rollout's own lists (with a context policy, cut after its last sampled id as every
        segment is, so none passes max_context_tokens), the closed ones as `earlier_segments`
        (its record checks the invariants above)."""
        statuses = [info["tool_status"] for info in episode.infos if info and info.get("tool_status")]
        last = self._closed_segment() if self.has_context_policy else None
        if last is None:
            last = RolloutSegment(token_ids=self.token_ids, loss_mask=self.loss_mask,
                                  behavior_logprobs=self.behavior_logprobs, policy_versions=self.policy_versions,
                                  num_policy_tokens=sum(self.loss_mask), routed_experts=self._routing_record(),
                                  images=self.images or None)
        return Rollout(token_ids=last.token_ids, loss_mask=last.loss_mask,
                       behavior_logprobs=last.behavior_logprobs, policy_versions=last.policy_versions,
                       reward=episode.reward, num_turns=episode.num_turns,
                       num_policy_tokens=last.num_policy_tokens, tool_statuses=statuses,
                       timeline=timeline.to_list(), routed_experts=last.routed_experts, images=last.images,
                       earlier_segments=list(self.segments) or None, cause=episode.cause)

    def _routing_record(self) -> bytes | None:
        """The last action's routing record, padded with "not recorded" rows (all-ones bytes, the
        sentinel of models.moe.encode_routing) for the observation tokens after it."""
        record = self.routed_experts
        if record is None or not self._routed_len:
            return record
        return record + b"\xff" * (len(record) // self._routed_len * (len(self.token_ids) - self._routed_len))
