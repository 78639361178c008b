"""Context policies: how an episode goes on once its history no longer fits the model's context.

    [[actors]]
    name = "env"
    cls = "postrain.actors.env:EnvironmentActor"
    options = { context = { max_tokens = 512, strategy = "truncate_tool_outputs" } }

`ContextOptions` (validated: a misspelt field or an unknown strategy is refused by name). The
one episode driver (episode.py) checks before every assistant turn: when the context the model
would read (the current segment's tokens, exact) plus the room the turn may take (its
`max_new_tokens`) would pass `max_tokens`, it changes the history by the strategy:

- "truncate_tool_outputs": observations (tool outputs, the environment's turns after the first
  messages) are cut to `keep_chars` characters, oldest first, until the history fits; if even
  all of them cut do not fit, the oldest turns are dropped as below.
- "drop_oldest_turns": the oldest (assistant action, observation) pairs after the first
  messages are dropped until the history fits; the latest observation stays.
- "summarize": the policy itself writes a summary: SUMMARY_REQUEST is put to it as a user turn
  after the history (its tool outputs cut, then its oldest turns dropped, as far as needed for
  the request and the summary to fit), in a segment of its own; its answer, sampled and trained
  like any action, replaces the history: the next context is the first messages, the summary as
  the assistant's turn and CONTINUE_NOTE (one more segment).

Training semantics (design note): every change of history starts a new *segment*
(records/rollout.py): a prompt rendered from the new history, then what is sampled in it. Each
segment is trained as its own sample with the episode's reward, and holds only tokens sampled in
its own context, so no sample is trained on a context the model did not see. No segment passes
`max_tokens`: the token policy caps each generate call at the room left in its segment, and
ends each segment at its last sampled id (the observation after it was read by no sampled
token). An episode whose first messages and last turn do not fit ends truncated.
"""
from __future__ import annotations

from typing import Callable, Literal

from pydantic import Field

from postrain.core import Options

STRATEGIES = ("truncate_tool_outputs", "drop_oldest_turns", "summarize")
SUMMARY_REQUEST = "Context full. Summarize the task, what you found and what is left; it replaces the history."
CONTINUE_NOTE = "The earlier history was replaced by your summary above. Continue the task."
CUT_MARK = "\n[... {num} characters cut by the context policy ...]"


class ContextOptions(Options):
    """`context = { max_tokens, strategy }` of the environment actor (module docstring)."""

    max_tokens: int = Field(..., ge=16, description="the context of one segment, tokens: no generate call's "
                            "prompt plus its new tokens passes it")
    strategy: Literal["truncate_tool_outputs", "drop_oldest_turns", "summarize"] = Field(
        ..., description="how the history is changed when the next turn would pass max_tokens")
    keep_chars: int = Field(200, ge=0, description="truncate_tool_outputs: characters kept of a cut tool output")


Measure = Callable[[list[dict]], int]   # tokens of a fresh context rendered from a history


def fits(history: list[dict], measure: Measure, limit: int) -> bool:
    return measure(history) <= limit


def cut(text: str, keep_chars: int) -> str:
    """`text`'s first `keep_chars` characters and the mark of the cut (unchanged when short)."""
    if len(text) <= keep_chars + len(CUT_MARK):
        return text
    return text[:keep_chars] + CUT_MARK.format(num=len(text) - keep_chars)


def truncate_tool_outputs(history: list[dict], num_first: int, observation_role: str, keep_chars: int,
                          measure: Measure, limit: int) -> list[dict] | None:
    """`history` with its observations after the first `num_first` messages cut, oldest first, until
    it fits `limit`; if all cut do not fit, `drop_oldest_turns` of that. None: nothing fits."""
    out = [dict(m) for m in history]
    for i in range(num_first, len(out)):
        if fits(out, measure, limit):
            return out
        if out[i]["role"] == observation_role:
            out[i]["content"] = cut(out[i]["content"], keep_chars)
    return out if fits(out, measure, limit) else drop_oldest_turns(out, num_first, measure, limit)


def drop_oldest_turns(history: list[dict], num_first: int, measure: Measure, limit: int) -> list[dict] | None:
    """`history` without its oldest messages after the first `num_first`, dropped oldest first (an
    action with the observation after it), keeping at least the last message; None: even the first
    messages and the last do not fit."""
    first, turns = list(history[:num_first]), list(history[num_first:])
    while turns:
        if fits(first + turns, measure, limit):
            return first + turns
        if len(turns) == 1:
            return None
        turns = turns[2:] if len(turns) > 2 else turns[1:]
    return first if fits(first, measure, limit) else None


def after_summary(history: list[dict], num_first: int, summary: str, observation_role: str) -> list[dict]:
    """The history that replaces `history` once the policy wrote `summary`."""
    return [*history[:num_first], {"role": "assistant", "content": summary},
            {"role": observation_role, "content": CONTINUE_NOTE}]
