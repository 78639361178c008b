"""The judged arithmetic task (actors/tasks/arithmetic_judged.py), in process with a scripted judge:
the judge's verdict is the reward, the check a zero-weight component, a group asks once per
distinct answer, a judge without a verdict drops the sample, and the agreement over the samples."""
from __future__ import annotations

import json
import re

import pytest
import trio

from postrain.actors import TaskOptionsError, get_task, run_episode
from postrain.actors.env import EnvironmentContractError, Scorers, SharedJudges
from postrain.actors.env.timeline import Timeline
from postrain.actors.records import ChatReply
from postrain.actors.scorer.judge import JudgeFailed
from postrain.actors.tasks.arithmetic_judged import DEFAULT_RUBRIC, AgreementError, judge_agreement

TASK = {"id": "t", "question": "What is 37 + 58?", "expression": "37 + 58", "answer": 95}


class LenientJudge:
    """A judge scorer's handle, scripted: PASS when the output's last number is within 1 of the
    value of the question it is shown (so it passes 96: it disagrees with the check there),
    a reply out of format for an output that says 'confuse'."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages: list[dict], **sampling) -> ChatReply:
        self.calls += 1
        user = messages[1]["content"]
        assert messages[0]["content"].count(DEFAULT_RUBRIC.instructions) == 1 and sampling["temperature"] == 0.0
        question = user.split("\n")[1]
        output = user.split("<output-")[1].split("\n")[1]
        if "confuse" in output:
            return ChatReply(text="Hmm.", prompt_tokens=300, completion_tokens=2)
        value = eval(question.removeprefix("What is ").rstrip("?"))   # the test's own questions
        numbers = [int(n) for n in re.findall(r"-?\d+", output.replace("&lt;", "<"))]
        verdict = "PASS" if numbers and abs(numbers[-1] - value) <= 1 else "FAIL"
        return ChatReply(text=f"It says {numbers[-1] if numbers else None}.\nVERDICT: {verdict}",
                         prompt_tokens=300, completion_tokens=9)


def reply(text: str):
    async def policy(messages):
        return text
    return policy


def play(replies: list[str], judge: LenientJudge, options: dict | None = None):
    """One group: an episode per reply, all sharing one environment actor's judges; (episodes, timelines)."""
    spec = get_task("arithmetic_judged")
    shared = SharedJudges({"judge": judge})
    timelines = [Timeline() for _ in replies]
    episodes: list = [None] * len(replies)

    async def one(i: int) -> None:
        scorers = Scorers({"judge": judge}, judges=shared, timeline=timelines[i])
        env = spec.make_env(scorers=scorers, options=options)
        episodes[i] = await run_episode(env, TASK, reply(replies[i]))

    async def group() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(len(replies)):
                nursery.start_soon(one, i)
    trio.run(group)
    return episodes, timelines


def test_the_judges_verdict_is_the_reward_and_the_check_rides_along_at_weight_zero():
    judge = LenientJudge()
    replies = ["95", "37 + 58 = 95", "96", "95", "96", "12", "95", "37 + 58 = 95"]
    episodes, timelines = play(replies, judge)
    assert judge.calls == 4                                  # one call per distinct answer
    got = [(ep.reward.components, ep.reward.total) for ep in episodes]
    expected = {"95": (1.0, 1.0), "37 + 58 = 95": (1.0, 1.0), "96": (1.0, 0.0), "12": (0.0, 0.0)}
    assert got == [({"judge": expected[r][0], "correct": expected[r][1]}, expected[r][0]) for r in replies]
    assert all(ep.reward.weights == {"correct": 0.0} and len(ep.messages) == 2 for ep in episodes)
    assert episodes[2].infos[-1]["judge_verdict"] == "PASS"
    hops = [t.to_list() for t in timelines]
    assert all([h["hop"] for h in hop] == ["judge"] for hop in hops)
    assert sum(not hop[0]["call"]["cached"] for hop in hops) == 4
    rows = [{"sample_id": f"b0-g0-s{i}", "components": ep.reward.components} for i, ep in enumerate(episodes)]
    assert judge_agreement(rows) == 6 / 8                    # the two 96s: the judge passes them, the check not


def test_a_judge_without_a_verdict_or_without_a_scorer_fails_the_sample_not_a_zero():
    env = get_task("arithmetic_judged").make_env(scorers={"judge": LenientJudge()})
    with pytest.raises(JudgeFailed, match="judge answered out of format: its last line must be"):
        trio.run(run_episode, env, TASK, reply("confuse me"))
    env = get_task("arithmetic_judged").make_env(scorers={"grader": LenientJudge()})
    with pytest.raises(EnvironmentContractError, match="asks the judge scorer 'judge', which this environment was "
                                                       "not given \\(it has: grader\\); fix: add a ScorerActor"):
        trio.run(run_episode, env, TASK, reply("95"))


def test_options_name_the_judge_and_a_rubric_and_tagged_answers_keep_the_format_component():
    spec = get_task("arithmetic_judged")
    options = spec.check_options({"judge": "grader", "rubric": {"instructions": "Is it right?",
                                                                "verdict": {"kind": "pass_fail"}}})
    assert options.judge == "grader" and options.rubric.instructions == "Is it right?"
    with pytest.raises(TaskOptionsError, match="rubric"):
        spec.check_options({"rubric": {"instructions": "x", "verdict": {"kind": "pass_fail", "hgih": 1}}})
    judge = LenientJudge()
    (episode,), _ = play(["<answer>96</answer>"], judge, {"answer_format": "tagged"})
    assert episode.reward.components == {"judge": 1.0, "correct": 0.0, "format": 1.0}
    assert episode.reward.weights == {"correct": 0.0, "format": 0.1}


def test_agreement_reads_a_run_folders_samples_and_needs_judged_rows(tmp_path):
    rows = [{"components": {"judge": 1.0, "correct": 1.0}}, {"components": {"judge": 0.0, "correct": 1.0}},
            {"components": {"correct": 1.0}}, {"outcome": "dropped: judge failed"}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert judge_agreement(tmp_path) == judge_agreement(tmp_path / "samples.jsonl") == 0.5
    with pytest.raises(AgreementError, match="no sample has both a 'judge' and a 'correct' component"):
        judge_agreement(rows[2:])


def test_the_shipped_config_validates_and_places_the_judge(capsys):
    from pathlib import Path

    from postrain import cli
    config = Path(__file__).resolve().parents[3] / "actors" / "configs" / "arithmetic_judged.toml"
    assert cli.main(["up", "--config", str(config), "--dry-run"]) == 0
    assert "judge: cores" in capsys.readouterr().out
