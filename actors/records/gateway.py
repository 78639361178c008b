"""The gateway actor's messages, typed (the run's other roles ask it for its address and for episodes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record


@dataclass(frozen=True, slots=True)
class GatewayAddress(Record):
    """`address` reply: the server's root URL and the OpenAI base URL (`url + "/v1"`)."""

    url: str
    base_url: str
    model: str


@dataclass(frozen=True, slots=True)
class OpenEpisode(Record):
    """`open_episode`: start recording the tokens of calls made with API key `key`."""

    key: str

    def _check(self) -> None:
        if not self.key:
            self.fail_field("key", self.key, "a non-empty string (the episode's API key)")


@dataclass(frozen=True, slots=True)
class CloseEpisode(Record):
    """`close_episode`: stop recording `key` and hand back its segments."""

    key: str


@dataclass(frozen=True, slots=True)
class EpisodeSegments(Record):
    """`close_episode` reply: the episode's segments (episodes.Segment.to_wire each: token_ids,
    loss_mask, behavior_logprobs, policy_versions, calls) and how many calls it made."""

    segments: list[dict[str, Any]] = field(default_factory=list)
    num_calls: int = 0


# The gateway's messages (actors/gateway/actor.py): an agent harness opens and closes episodes.
GATEWAY_ADDRESS = MessageKind("address", None, GatewayAddress)
OPEN_EPISODE = MessageKind("open_episode", OpenEpisode, None)
CLOSE_EPISODE = MessageKind("close_episode", CloseEpisode, EpisodeSegments)
