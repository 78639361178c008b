"""`postrain samples RUN_DIR`: what the model said, from a synthetic samples.jsonl."""
import argparse
import json

import pytest

from postrain.cli import samples as samples_command
from postrain.cli.samples import SamplesError, format_sample, select_samples


def row(sample_id, step, reward, completion="<answer>5</answer>", tool_output="", **extra):
    return {"sample_id": sample_id, "step": step, "batch": step - 1, "group": 0, "task": "arithmetic",
            "outcome": "trained", "reward": reward, "components": {"correct": reward}, "advantage": 0.5,
            "staleness": 0, "policy_tokens": 12, "num_turns": 1, "prompt": "What is 2 + 3?",
            "turns": [{"completion": completion, "tool_output": tool_output}], **extra}


ROWS = [row("b0-g0-s0", 1, 0.0), row("b0-g0-s1", 1, 1.0), row("b1-g0-s0", 2, 0.5), row("b1-g0-s1", 2, 0.0),
        row("b1-g1-s0", 2, 1.0)]


def args(folder, **overrides):
    values = {"run_folder": str(folder), "step": None, "all": False, "worst": False, "best": False,
              "limit": 8, "json": False, "task": None, "cause": None, **overrides}
    return argparse.Namespace(**values)


def test_the_default_is_the_last_step_in_file_order():
    assert [r["sample_id"] for r in select_samples(ROWS)] == ["b1-g0-s0", "b1-g0-s1", "b1-g1-s0"]


def test_worst_and_best_read_the_whole_run_unless_a_step_is_given():
    assert [r["sample_id"] for r in select_samples(ROWS, worst=True)] == [
        "b0-g0-s0", "b1-g0-s1", "b1-g0-s0", "b0-g0-s1", "b1-g1-s0"]          # ties keep file order
    assert [r["sample_id"] for r in select_samples(ROWS, best=True, limit=1)] == ["b0-g0-s1"]
    assert [r["reward"] for r in select_samples(ROWS, step=1, worst=True)] == [0.0, 1.0]


def test_worst_and_best_sort_by_reward_and_limit_cuts():
    assert [r["reward"] for r in select_samples(ROWS, step=2, worst=True)] == [0.0, 0.5, 1.0]
    assert [r["sample_id"] for r in select_samples(ROWS, all_steps=True, best=True, limit=2)] == [
        "b0-g0-s1", "b1-g1-s0"]
    assert len(select_samples(ROWS, all_steps=True, limit=0)) == 5


def test_a_step_without_samples_is_an_error_naming_the_steps_that_have_some():
    with pytest.raises(SamplesError, match=r"no samples for step 7; steps with samples: 1, 2"):
        select_samples(ROWS, step=7)
    with pytest.raises(SamplesError, match=r"no samples yet: a sample is written when its RL step is trained"):
        select_samples([], worst=True)


def test_a_cause_picks_its_samples_of_every_step_and_an_unnamed_one_lists_those_named():
    rows = [row("a", 1, 0.0, cause="script_error"), row("b", 1, 1.0, cause="ok"), row("c", 2, 0.0, cause="script_error"),
            row("d", 2, 0.0, cause="no_export"), row("e", 2, 0.0)]
    assert [r["sample_id"] for r in select_samples(rows, cause="script_error")] == ["a", "c"]
    assert [r["sample_id"] for r in select_samples(rows, cause="script_error", step=2)] == ["c"]
    with pytest.raises(SamplesError, match=r"no samples with cause 'wrong_shape'; causes named: no_export, ok, "
                                           r"script_error"):
        select_samples(rows, cause="wrong_shape")
    assert format_sample(rows[0]).splitlines()[0] == (
        "sample a  step 1  group 0  trained  reward 0.000 (correct 0.000)  cause script_error  advantage +0.500  "
        "staleness 0  12 policy tokens")


def test_a_sample_prints_its_header_then_each_text_indented():
    text = format_sample(row("b0-g0-s0", 1, 1.1, completion="<python>print(2 + 3)</python>",
                             tool_output="<output>5</output>", components={"correct": 1.0, "format": 0.1}))
    lines = text.splitlines()
    assert lines[0] == ("sample b0-g0-s0  step 1  group 0  trained  reward 1.100 (correct 1.000, format 0.100)  "
                        "advantage +0.500  staleness 0  12 policy tokens")
    assert lines[1:] == ["  prompt:", "    What is 2 + 3?", "  completion:", "    <python>print(2 + 3)</python>",
                         "  tool output:", "    <output>5</output>"]


def test_turns_are_numbered_when_there_are_several_and_an_empty_completion_says_so():
    multi = row("b0-g0-s0", 1, 0.0, turns=[{"completion": "a", "tool_output": "b"},
                                           {"completion": "", "tool_output": ""}])
    text = format_sample(multi)
    assert "  completion 1:\n    a\n  tool output 1:\n    b\n  completion 2:\n    (empty)" in text


def test_the_command_prints_or_emits_json_and_names_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit, match="postrain samples: no samples.jsonl in .*trained at least one RL step"):
        samples_command.main(args(tmp_path))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert samples_command.main(args(tmp_path, step=1, worst=True)) == 0
    out = capsys.readouterr().out
    assert out.index("sample b0-g0-s0") < out.index("sample b0-g0-s1") and "b1-" not in out
    assert samples_command.main(args(tmp_path, worst=True, limit=2)) == 0   # the README's: the whole run
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("sample ")] == [
        "b0-g0-s0", "b1-g0-s1"]
    assert samples_command.main(args(tmp_path, all=True, best=True, limit=1, json=True)) == 0
    (only,) = capsys.readouterr().out.splitlines()
    assert json.loads(only)["sample_id"] == "b0-g0-s1"


def test_control_characters_a_model_wrote_are_escaped_not_sent_to_the_terminal():
    text = format_sample(row("b0-g0-s0", 1, 0.0, completion="ok\x1b[2Jgone\tx\ny"))
    assert "    ok\\x1b[2Jgone\tx\n    y" in text and "\x1b" not in text
