"""Token-in/token-out: per episode, the exact tokens the gateway rendered and the generator sampled.

Design note. A harness sends the whole conversation on every call. Re-tokenizing it does
not give back the sampled ids (a sampled `" 12"` may encode as `" 1"`, `"2"`; a template may
strip earlier reasoning; a harness may edit turns), so the policy would be trained on text
it never produced. Instead an episode keeps a *tip*: the token ids of the last call's prompt
and what each of its choices sampled. A call whose messages are the tip's messages, then
one of those choices' assistant message as the API returned it, then new turns (tool
results, user turns) *extends* the tip: its prompt is the tip's ids + that choice's sampled
ids + the rendered new turns alone (never the history again). Anything else -- an edited or
dropped turn, other tools, a template whose rendering of the history changed (one that
strips earlier reasoning) -- closes the tip as a finished *segment* and starts a new one
from a fresh rendering. Each segment is trained as its own sample.

Invariants (tests/actors/gateway/test_episodes.py): in every segment, the four per-token
lists have one length; loss_mask is 1 exactly on sampled ids (policy_version >= 0, their
logprob), 0 on rendered ids (version -1, logprob 0.0); and for every call of the segment,
`token_ids[:call.prompt_len]` is exactly the prompt the generator was given, so every
trained token was sampled in the context it is trained in. With n > 1, the choice a later
call continues is kept (choice 0 when none is), the other choices are not trained.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..models.tokenizer import Tokenizer
from ..records import EpisodeCall, EpisodeSegment
from .templates import render


@dataclass
class Segment:
    """One trained sample of an episode (see the module's invariants)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    calls: list[EpisodeCall] = field(default_factory=list)

    def extend(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None):
        """Append rendered ids (no logprobs) or sampled ids (with their logprobs and versions)."""
        sampled = logprobs is not None
        assert sampled == (versions is not None), "sampled ids, and only they, carry their policy versions"
        self.token_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.behavior_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.policy_versions += list(versions) if versions is not None else [-1] * len(ids)

    def copy(self) -> "Segment":
        return Segment(list(self.token_ids), list(self.loss_mask), list(self.behavior_logprobs),
                       list(self.policy_versions), list(self.calls))

    def record(self) -> EpisodeSegment:
        """The segment as it travels (`close_episode`'s reply)."""
        return EpisodeSegment(self.token_ids, self.loss_mask, self.behavior_logprobs, self.policy_versions,
                              list(self.calls))


@dataclass
class Choice:
    """What one choice of a call sampled, and the assistant message the API returned for it."""

    message: dict
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    start: float = 0.0            # the call's start, time.time()
    duration_ms: float = 0.0


@dataclass
class _Tip:
    messages: list[dict]
    tools: list[dict]
    prompt: Segment            # the call's prompt, as a segment so far
    choices: list[Choice]


def _normal(message: dict) -> tuple:
    """A message as compared for "the same turn": role, text, and calls by name and arguments."""
    calls = tuple((c["function"]["name"], _canonical(c["function"].get("arguments")))
                  for c in message.get("tool_calls") or [])
    return (message["role"], message.get("content") or "", calls, message.get("tool_call_id") or "")


def _canonical(arguments) -> str:
    try:
        return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, sort_keys=True)
    except (TypeError, json.JSONDecodeError):
        return str(arguments)


class EpisodeTokens:
    """The token record of one episode: closed segments and the tip. Not thread-safe: the
    gateway serializes the calls of one episode (`prepare` .. `record` under its lock)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.closed: list[Segment] = []
        self._tip: _Tip | None = None
        self.num_calls = 0

    def prepare(self, messages: list[dict], tools: list[dict]) -> Segment:
        """The prompt of a call as a segment so far (its token_ids are the prompt ids): the tip
        extended when `messages` continue it, else a fresh rendering (the tip closed first)."""
        extended = self._extend(messages, tools) if self._tip is not None else None
        if extended is not None:
            return extended
        self._close_tip()
        segment = Segment()
        segment.extend(self.tokenizer.encode(render(self.tokenizer, messages, tools)))
        return segment

    def record(self, messages: list[dict], tools: list[dict], prompt: Segment, choices: list[Choice]) -> None:
        """The call is answered: its prompt and choices become the tip."""
        self.num_calls += 1
        self._tip = _Tip(list(messages), list(tools), prompt, choices)

    def finish(self) -> list[Segment]:
        """Every segment of the episode, the tip closed; the record is empty afterwards."""
        self._close_tip()
        segments, self.closed = self.closed, []
        return segments

    def _close_tip(self, choice_index: int = 0) -> None:
        tip, self._tip = self._tip, None
        if tip is not None:
            self.closed.append(self._with_choice(tip, tip.choices[choice_index]))

    @staticmethod
    def _with_choice(tip: _Tip, choice: Choice) -> Segment:
        segment = tip.prompt.copy()
        segment.calls.append(EpisodeCall(len(segment.token_ids), len(choice.token_ids),
                                         sorted(set(choice.policy_versions)), choice.start, choice.duration_ms))
        segment.extend(choice.token_ids, choice.logprobs, choice.policy_versions)
        return segment

    def _extend(self, messages: list[dict], tools: list[dict]) -> Segment | None:
        """The tip extended by the new turns of `messages`, or None when they do not continue it."""
        tip = self._tip
        assert tip is not None, "prepare extends only a tip it has"
        num = len(tip.messages)
        if tools != tip.tools or len(messages) <= num + 1 or messages[num]["role"] != "assistant":
            return None
        if [_normal(m) for m in messages[:num]] != [_normal(m) for m in tip.messages]:
            return None
        given = _normal(messages[num])
        choice = next((c for c in tip.choices if _normal(c.message) == given), None)
        if choice is None:
            return None
        new_ids = self._new_turn_ids(messages, num, tools, choice)
        if new_ids is None:
            return None
        segment = self._with_choice(tip, choice)
        segment.extend(new_ids)
        return segment

    def _new_turn_ids(self, messages, num: int, tools, choice: Choice) -> list[int] | None:
        """The ids that close the assistant turn and render messages[num + 1:] with the next
        generation prompt; None when the template does not render the history as a prefix
        of the longer conversation (it changed an earlier turn: a new segment)."""
        tok = self.tokenizer
        before = render(tok, messages[:num], tools, add_generation_prompt=True)
        with_assistant = render(tok, messages[:num + 1], tools, add_generation_prompt=False)
        full = render(tok, messages, tools, add_generation_prompt=True)
        if not (with_assistant.startswith(before) and full.startswith(with_assistant)):
            return None
        return tok.encode(self._turn_end(with_assistant[len(before):], choice.token_ids)
                          + full[len(with_assistant):], add_bos=False)

    def _turn_end(self, assistant_text: str, sampled: list[int]) -> str:
        """What the template writes after the assistant's text that the sampled ids did not
        already hold: after the end-of-turn token when one was sampled, from it otherwise."""
        tok = self.tokenizer
        ended = bool(sampled) and sampled[-1] in tok.eos_token_ids
        marks = [tok.decode([sampled[-1]])] if ended else [tok.decode([e]) for e in tok.eos_token_ids]
        found = [(assistant_text.rfind(mark), mark) for mark in marks if mark and mark in assistant_text]
        if not found:
            return ""
        at, mark = max(found)
        return assistant_text[at + len(mark):] if ended else assistant_text[at:]


class EpisodeStore:
    """The open episodes, by key. A key is opened by the run (`open`), used as a client's API key,
    and closed with its segments (`close`). Calls with a key that is not open are served and not
    recorded. At most `max_open` episodes stay open; beyond it the oldest is dropped (a harness
    that never closes its episodes must not grow the gateway without bound)."""

    def __init__(self, tokenizer: Tokenizer, max_open: int = 4096):
        self.tokenizer, self.max_open = tokenizer, max_open
        self._open: dict[str, EpisodeTokens] = {}

    def open(self, key: str) -> None:
        if key in self._open:
            raise KeyError(f"episode {key!r} is already open")
        while len(self._open) >= self.max_open:
            self._open.pop(next(iter(self._open)))
        self._open[key] = EpisodeTokens(self.tokenizer)

    def get(self, key: str | None) -> EpisodeTokens | None:
        return self._open.get(key) if key else None

    def close(self, key: str) -> list[Segment]:
        """The episode's segments; KeyError when it is not open (never opened, or dropped)."""
        return self._open.pop(key).finish()
