"""Scorers as environments see them (actors/env/scorers.py): judges shared by the episodes of an
environment actor, each episode's judge calls as hops of its timeline, failed ones too."""
from __future__ import annotations

import anyio
import pytest

from postrain.actors.env import Environment, Scorers, SharedJudges
from postrain.actors.env.timeline import Timeline
from postrain.actors.env.user_errors import reported_failure
from postrain.actors.records import ChatReply
from postrain.actors.scorer.judge import JudgeFailed
from postrain.actors.scorer.rubric import PassFailVerdict, Rubric
from postrain.core.testing import async_test

RUBRIC = Rubric("PASS when the output is an even number.", PassFailVerdict(), max_new_tokens=8)


class EvenJudge:
    """A judge scorer's handle, scripted: PASS for an even number, a reply out of format for
    'garble'. Counts its calls; replies carry token counts as a scorer's do."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages: list[dict], **sampling) -> ChatReply:
        self.calls += 1
        lines = messages[1]["content"].split("\n")
        output = next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("<output-"))
        await anyio.sleep(0)
        if output == "garble":
            return ChatReply(text="I cannot say.", prompt_tokens=400, completion_tokens=4)
        verdict = "PASS" if output.isdigit() and int(output) % 2 == 0 else "FAIL"
        return ChatReply(text=f"VERDICT: {verdict}", prompt_tokens=400, completion_tokens=3)


@async_test
async def test_the_episodes_of_one_actor_share_one_judge_and_each_records_its_calls():
    handle = EvenJudge()
    shared = SharedJudges({"judge": handle})         # what the environment actor makes once
    group = ["4", "7", "4", "4", "7", "10", "4", "7"]
    timelines = [Timeline() for _ in group]
    verdicts = []

    async def episode(output: str, timeline: Timeline) -> None:
        scorers = Scorers({"judge": handle}, judges=shared, timeline=timeline)   # made per episode
        verdicts.append((output, (await scorers.judge("judge", RUBRIC).judge(output, context="a number")).reward))

    async with anyio.create_task_group() as tg:
        for output, timeline in zip(group, timelines):
            tg.start_soon(episode, output, timeline)
    assert handle.calls == 3 and len(shared) == 1                       # one call per distinct output
    assert sorted(verdicts) == sorted((o, float(int(o) % 2 == 0)) for o in group)
    hops = [hop for timeline in timelines for hop in timeline.to_list()]
    assert [hop["hop"] for hop in hops] == ["judge"] * len(group)
    assert all(hop["actor"] == "judge" and hop["rubric"] == RUBRIC.digest and "duration_ms" in hop for hop in hops)
    calls = [hop["call"] for hop in hops]
    assert sum(not call["cached"] for call in calls) == 3
    assert {call["verdict"] for call in calls} == {"PASS", "FAIL"}
    assert all(call["prompt_tokens"] == 400 and call["messages"][0]["role"] == "system" for call in calls)

    other = Rubric("PASS when the output is odd.", PassFailVerdict(), max_new_tokens=8)
    scorers = Scorers({"judge": handle}, judges=shared)
    assert scorers.judge("judge", other).shared is not scorers.judge("judge", RUBRIC).shared
    assert scorers.judge("judge", RUBRIC).shared is scorers.judge("judge", RUBRIC).shared
    assert scorers.judge("judge", RUBRIC, timeout_s=5).shared is not scorers.judge("judge", RUBRIC).shared
    with pytest.raises(KeyError, match="no scorer 'teacher' was given to this environment .*it has: judge"):
        scorers.judge("teacher", RUBRIC)


@async_test
async def test_a_judge_that_gives_no_verdict_is_a_failed_hop_and_the_episode_fails_with_its_cause():
    timeline = Timeline()
    scorers = Scorers({"judge": EvenJudge()}, timeline=timeline)
    with pytest.raises(JudgeFailed) as caught:
        await scorers.judge("judge", RUBRIC).judge("garble")
    (hop,) = timeline.to_list()
    assert hop["status"] == "failed: JudgeFailed" and hop["error"] == caught.value.reason
    assert hop["call"]["reply"] == "I cannot say." and hop["call"]["error"] == caught.value.reason
    # As the environment actor reports it: the cause on the reason line, the reply after it.
    reason, _, detail = str(reported_failure(caught.value)).partition("\n")
    assert reason == "judge answered out of format: its last line must be 'VERDICT: <PASS or FAIL>'"
    assert "'I cannot say.'" in detail


def test_an_environment_given_plain_handles_gets_scorers_that_judge():
    env = Environment(scorers={"judge": EvenJudge()})
    assert isinstance(env.scorers, Scorers) and list(env.scorers) == ["judge"]
    assert env.scorers.judge("judge", RUBRIC).rubric is RUBRIC
