"""The gateway actor's messages, typed (the run's other roles ask it for its address and for episodes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from postrain.core.messages import MessageKind
from postrain.core.record import Record, codec


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
class EpisodeCall(Record):
    """One model call of a segment: its prompt's length in tokens, how many tokens it sampled,
    the policy versions that sampled them, when it started (time.time()) and how long it took."""

    prompt_len: int
    num_tokens: int
    policy_versions: list[int]
    start: float = 0.0
    duration_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class EpisodeSegment(Record):
    """One trained sample of an agent episode (actors/gateway/episodes.py, its invariants): the
    four per-token lists, of one length, and the calls whose prompts and samples it holds."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    calls: list[EpisodeCall] = field(default_factory=list, metadata=codec(
        lambda calls: [c.to_wire() for c in calls], lambda items: [EpisodeCall.from_wire(i) for i in items]))

    def _check(self) -> None:
        lengths = {len(self.token_ids), len(self.loss_mask), len(self.behavior_logprobs), len(self.policy_versions)}
        if len(lengths) != 1:
            self.fail_field("token_ids", len(self.token_ids), "as long as loss_mask, behavior_logprobs and "
                            f"policy_versions (lengths {sorted(lengths)})")


@dataclass(frozen=True, slots=True)
class EpisodeSegments(Record):
    """`close_episode` reply: the episode's segments, oldest first, and how many calls it made."""

    segments: list[EpisodeSegment] = field(default_factory=list, metadata=codec(
        lambda segments: [s.to_wire() for s in segments], lambda items: [EpisodeSegment.from_wire(i) for i in items]))
    num_calls: int = 0


# The gateway's messages (actors/gateway/actor.py): an agent harness opens and closes episodes.
GATEWAY_ADDRESS = MessageKind("address", None, GatewayAddress)
OPEN_EPISODE = MessageKind("open_episode", OpenEpisode, None)
CLOSE_EPISODE = MessageKind("close_episode", CloseEpisode, EpisodeSegments)
# The Tinker server's actor (actors/tinker/actor.py) answers where it listens in the same record.
TINKER_ADDRESS = MessageKind("tinker_address", None, GatewayAddress)
