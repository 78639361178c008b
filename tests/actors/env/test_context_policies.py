"""Context policies (actors/env/context.py) on the one episode driver, with the tiny model's real
engine as the generator and the long-context task (actors/tasks/long_context.py): each strategy
starts a new segment exactly when the next turn would pass `max_tokens`, no generate call and no
segment passes it, the episode goes on past the limit, and every trained token was sampled in
the context its segment holds before it (compared with the generator's own record). A bad
option is refused by name."""
from __future__ import annotations

import pytest
import trio

from postrain.actors.env.actor import EnvironmentActor
from postrain.actors.env.api import EnvironmentFailure
from postrain.actors.env.context import (CONTINUE_NOTE, CUT_MARK, SUMMARY_REQUEST, ContextOptions,
                                         drop_oldest_turns, truncate_tool_outputs)
from postrain.actors.env.episode import run_episode
from postrain.actors.env.token_policy import TokenPolicy
from postrain.actors.records import GENERATE, GeneratedSample, GenerateReply, GenerateRequest, SamplingParams
from postrain.core import MessageKind
from postrain.actors.tasks import get_task
from postrain.actors.env.timeline import Timeline
from postrain.core.errors import ConfigError
from postrain.core.options import validate_options

MAX_TOKENS = 480                      # the byte tokenizer: the question alone is ~220 tokens
MAX_NEW = 6
TASK_OPTIONS = {"num_files": 4, "file_lines": 3}   # each file shown is ~120 tokens


class EngineGenerator:
    """The generator in-process: the real engine of the tiny model; keeps each call's record
    (prompt ids, sampled ids, logprobs), as the generator actor's reply carries them."""

    name = "generator"

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def call(self, kind: MessageKind, request: GenerateRequest, timeout_s: float | None = None) -> GenerateReply:
        assert kind is GENERATE, kind
        out = self.engine.generate(list(request.prompt_ids), request.sampling)[0].outputs[0]
        self.calls.append((list(request.prompt_ids), list(out.token_ids), list(out.logprobs)))
        return GenerateReply(prompt_len=len(request.prompt_ids), samples=[GeneratedSample(
            token_ids=out.token_ids, logprobs=out.logprobs, policy_versions=out.policy_versions,
            finish_reason=out.finish_reason, text=out.text)])


class RecordingPolicy(TokenPolicy):
    """The token policy, noting the context's size at each turn and at each change of history."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int, str]] = []   # (act | restart, context size, last message)

    async def act(self, messages):
        self.events.append(("act", self.context_size(), messages[-1]["content"]))
        return await super().act(messages)

    def restart(self, messages):
        self.events.append(("restart", self.context_size(), messages[-1]["content"]))
        super().restart(messages)


@pytest.fixture(scope="module")
def engine():
    import torch
    from postrain.actors.generator.engine import Engine
    from postrain.actors.models.loading import load_model
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny")
    return Engine(model, tokenizer, num_blocks=128, block_size_tokens=16), tokenizer


def play(engine, strategy: str):
    engine_, tokenizer = engine
    spec = get_task("long_context")
    generator = EngineGenerator(engine_)
    policy = RecordingPolicy(generator, tokenizer, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5),
                             max_total_tokens=1024, timeline=Timeline(), max_context_tokens=MAX_TOKENS)
    context = {"max_tokens": MAX_TOKENS, "strategy": strategy, "keep_chars": 40}
    task = spec.eval_tasks(TASK_OPTIONS)[0]
    episode = trio.run(lambda: run_episode(spec.make_env(options=TASK_OPTIONS), task, policy, context=context))
    return episode, policy.rollout(episode, Timeline()), policy, generator


def sampled_runs(segment) -> list[tuple[int, list[int], list[float]]]:
    """(start, ids, logprobs) of each run of sampled ids (loss_mask 1) of a segment."""
    runs, i, n = [], 0, len(segment.token_ids)
    while i < n:
        if not segment.loss_mask[i]:
            i += 1
            continue
        j = i
        while j < n and segment.loss_mask[j]:
            j += 1
        runs.append((i, segment.token_ids[i:j], segment.behavior_logprobs[i:j]))
        i = j
    return runs


@pytest.mark.parametrize("strategy", ["truncate_tool_outputs", "drop_oldest_turns", "summarize"])
def test_each_strategy_starts_a_segment_exactly_at_the_limit_and_trains_only_what_was_sampled_there(
        engine, strategy):
    episode, rollout, policy, generator = play(engine, strategy)
    segments = rollout.segments()
    # the episode went on past the limit, in several segments, none of them over it
    assert episode.num_segments == len(segments) > 1
    assert episode.num_turns == get_task("long_context").make_env(options=TASK_OPTIONS).max_turns
    assert all(len(s.token_ids) <= MAX_TOKENS for s in segments)
    assert all(len(prompt) + MAX_NEW <= MAX_TOKENS for prompt, _, _ in generator.calls)
    # a new segment starts exactly when the next turn would pass the limit, never before (summarize's
    # second change, to the history after its summary, follows its own summary turn)
    at_limit = [size for kind, size, last in policy.events if kind == "restart" and last != CONTINUE_NOTE]
    assert at_limit and all(size + MAX_NEW > MAX_TOKENS for size in at_limit)
    assert all(size + MAX_NEW <= MAX_TOKENS for kind, size, _ in policy.events if kind == "act")
    # every trained token: sampled by the generator in exactly the context before it in its segment
    record = {tuple(prompt): (ids, logprobs) for prompt, ids, logprobs in generator.calls}
    num_trained = 0
    for segment in segments:
        for start, ids, logprobs in sampled_runs(segment):
            sampled, sampled_logprobs = record[tuple(segment.token_ids[:start])]
            assert ids == sampled and logprobs == pytest.approx(sampled_logprobs)
            num_trained += len(ids)
    assert num_trained == sum(len(ids) for _, ids, _ in generator.calls) == rollout.episode_policy_tokens
    if strategy == "summarize":   # the summary was sampled after the request, and replaced the history
        prompts = [engine[1].decode(s.token_ids[:sampled_runs(s)[0][0]]) for s in segments]
        assert any(prompt.rstrip().endswith(SUMMARY_REQUEST + "\n<|im_start|>assistant") or SUMMARY_REQUEST in prompt
                   for prompt in prompts)
        assert episode.messages[2]["content"] == CONTINUE_NOTE and episode.messages[1]["role"] == "assistant"


def measure_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


HISTORY = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "a1"},
           {"role": "user", "content": "o1" * 50}, {"role": "assistant", "content": "a2"},
           {"role": "user", "content": "o2" * 50}]


def test_the_strategies_change_the_history_as_they_say():
    # truncate_tool_outputs: the oldest output is cut first, and only as far as needed
    cut = truncate_tool_outputs(HISTORY, 1, "user", 10, measure_chars, 170)
    assert cut == [*HISTORY[:2], {"role": "user", "content": cut_text("o1" * 50)}, *HISTORY[3:]]
    assert measure_chars(cut) <= 170
    # drop_oldest_turns: (action, observation) pairs go oldest first; the last observation stays
    assert drop_oldest_turns(HISTORY, 1, measure_chars, 110) == [HISTORY[0], *HISTORY[3:]]
    assert drop_oldest_turns(HISTORY, 1, measure_chars, 104) == [HISTORY[0], HISTORY[4]]
    assert drop_oldest_turns(HISTORY, 1, measure_chars, 50) is None
    # when cutting every output is not enough, truncate_tool_outputs drops turns too
    assert truncate_tool_outputs(HISTORY, 1, "user", 10, measure_chars, 80) == [
        HISTORY[0], HISTORY[3], {"role": "user", "content": cut_text("o2" * 50)}]


def cut_text(text: str) -> str:
    return text[:10] + CUT_MARK.format(num=len(text) - 10)


def test_a_bad_context_option_is_refused_by_name(engine):
    with pytest.raises(ConfigError, match=r"context\.strategy.*'truncate_tool_outputs', 'drop_oldest_turns' or "
                                          r"'summarize'"):
        validate_options(EnvironmentActor, {"context": {"max_tokens": 512, "strategy": "squash"}})
    with pytest.raises(ConfigError, match=r"context\.max_token = 512: unknown field"):
        validate_options(EnvironmentActor, {"context": {"max_token": 512, "strategy": "summarize"}})
    with pytest.raises(ConfigError, match=r"context\.max_tokens.*greater than or equal to 16"):
        validate_options(EnvironmentActor, {"context": {"max_tokens": 8, "strategy": "summarize"}})
    assert ContextOptions(max_tokens=64, strategy="summarize").keep_chars == 200
    # first messages that leave no room for a turn: the sample is dropped with the fix named
    engine_, tokenizer = engine
    policy = TokenPolicy(EngineGenerator(engine_), tokenizer, SamplingParams(max_new_tokens=MAX_NEW),
                         max_total_tokens=1024, timeline=Timeline(), max_context_tokens=100)
    spec = get_task("long_context")
    with pytest.raises(EnvironmentFailure, match=r"the first messages are \d+ tokens; with the next turn's 6 new "
                                                 r"tokens they pass context.max_tokens = 100; fix: raise max_tokens"):
        trio.run(lambda: run_episode(spec.make_env(options=TASK_OPTIONS), spec.eval_tasks(TASK_OPTIONS)[0], policy,
                                     context={"max_tokens": 100, "strategy": "drop_oldest_turns"}))
