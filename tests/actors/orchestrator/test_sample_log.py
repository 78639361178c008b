"""samples.jsonl (actors/orchestrator/sample_log.py): each RL sample's text from its exact tokens,
bounded, with its reward and advantage; a full disk raises like the ledger's."""
import pytest

from postrain.actors.env.api import Reward
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.actors.orchestrator.sample_log import (SampleLog, cut_text, group_advantages, read_samples,
                                                     rollout_texts, split_turns)
from postrain.actors.orchestrator.scored_sample import ScoredSample
from postrain.actors.records import Rollout
from postrain.core.errors import DiskFullError
from postrain.core.jsonl import JsonlAppender


def rollout(tokenizer, parts, reward=1.0, cause=None):
    """A Rollout of (text, sampled) parts: sampled parts have loss mask 1."""
    ids, mask = [], []
    for text, sampled in parts:
        part = tokenizer.encode(text, add_bos=False)
        ids += part
        mask += [int(sampled)] * len(part)
    return Rollout(token_ids=ids, loss_mask=mask, behavior_logprobs=[0.0] * len(ids),
                   policy_versions=[1 if m else -1 for m in mask], reward=Reward({"correct": reward}),
                   num_turns=sum(1 for _, sampled in parts if sampled), num_policy_tokens=sum(mask), cause=cause)


def test_turns_split_at_the_loss_mask():
    assert split_turns([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1]) == ([1, 2], [([3, 4], [5]), ([6, 7], [])])
    assert split_turns([1, 2], [0, 0]) == ([1, 2], [])


def test_a_long_text_keeps_its_head_and_tail_and_marks_the_cut():
    assert cut_text("short", 100) == "short"
    text = "H" * 500 + "x" * 9000 + "T" * 500
    cut = cut_text(text, 1000)
    assert cut.startswith("H" * 500) and cut.endswith("T" * 250) and "[... 9000 characters cut ...]" in cut
    assert len(cut) < 1100


def test_the_texts_are_the_decoded_prompt_completions_and_tool_outputs():
    tokenizer = byte_tokenizer()
    episode = rollout(tokenizer, [("What is 2 + 3?\n", False), ("<python>print(2 + 3)</python>", True),
                                  ("<output>5</output>\n", False), ("<answer>5</answer>", True)])
    assert rollout_texts(tokenizer, episode) == {
        "prompt": "What is 2 + 3?\n",
        "turns": [{"completion": "<python>print(2 + 3)</python>", "tool_output": "<output>5</output>\n"},
                  {"completion": "<answer>5</answer>", "tool_output": ""}]}


def test_a_step_writes_a_line_per_sample_with_reward_advantage_and_outcome(tmp_path):
    tokenizer = byte_tokenizer()
    sample_log = SampleLog(tmp_path, tokenizer, max_chars=64)
    good = ScoredSample("b0-g0-s0", rollout(tokenizer, [("Q?", False), ("<answer>5</answer>", True)], 1.0),
                        task="arithmetic")
    bad = ScoredSample("b0-g0-s1", rollout(tokenizer, [("Q?", False), ("y" * 200, True)], 0.0, "no_answer"))
    orphan = ScoredSample("b0-g1-s0", rollout(tokenizer, [("R?", False), ("z", True)], 0.0))
    written = sample_log.record_step(1, 0, [[good, bad], [orphan, None]], {"b0-g0-s0": 0, "b0-g0-s1": 1},
                                     {"b0-g1-s0": "group incomplete"})
    sample_log.close()
    rows = read_samples(tmp_path)
    assert written == 3 and [row["sample_id"] for row in rows] == ["b0-g0-s0", "b0-g0-s1", "b0-g1-s0"]
    first, second, third = rows
    assert first["step"] == 1 and first["group"] == 0 and first["task"] == "arithmetic"
    assert first["outcome"] == "trained" and first["reward"] == 1.0 and first["components"] == {"correct": 1.0}
    assert first["advantage"] == pytest.approx(0.7071, abs=1e-3) and second["advantage"] < 0
    assert second["staleness"] == 1 and "characters cut" in second["turns"][0]["completion"]
    assert first["cause"] is None and second["cause"] == "no_answer"     # the environment's, when it named one
    assert third["outcome"] == "dropped: group incomplete" and third["advantage"] is None


def test_equal_rewards_have_advantage_zero():
    assert group_advantages([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]


def test_a_full_disk_raises_instead_of_losing_the_sample(tmp_path):
    tokenizer = byte_tokenizer()
    sample_log = SampleLog(tmp_path, tokenizer)
    sample_log._file.close()
    sample_log._file = JsonlAppender("/dev/full")   # every write: ENOSPC
    sample = ScoredSample("b0-g0-s0", rollout(tokenizer, [("Q?", False), ("a", True)]))
    with pytest.raises(DiskFullError):
        sample_log.record_step(1, 0, [[sample]], {"b0-g0-s0": 0}, {})
