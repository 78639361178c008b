"""The warm start's demonstrations (actors/orchestrator/warm_start.py): the task's own, or a JSONL
file (`sft_demonstrations`); a warm start without either is refused when the options load."""
import json

import pytest
import trio
from pydantic import ValidationError

from postrain.actors import TaskSpec
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.actors.orchestrator import OrchestratorOptions
from postrain.actors.orchestrator.warm_start import demonstrations, warm_start
from postrain.actors.tasks import TaskMixture, get_task
from postrain.actors.tasks.arithmetic import ArithmeticEnv
from postrain.actors.tasks.demonstrations import DemonstrationError

NO_DEMOS = TaskSpec("no_demos", ArithmeticEnv, train=lambda seed, options: iter([]), eval=lambda options: [])


def demo(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Reverse {word}."},
                         {"role": "assistant", "content": f"<answer>{word[::-1]}</answer>"}]}


def write_demos(path, words):
    path.write_text("".join(json.dumps(demo(w)) + "\n" for w in words))
    return str(path)


def test_a_warm_start_for_a_task_without_demonstrations_is_refused_naming_both_fixes(monkeypatch):
    monkeypatch.setattr("postrain.actors.orchestrator.options.get_task",
                        lambda name: NO_DEMOS if name == "arithmetic" else get_task(name))
    with pytest.raises(ValidationError, match=r"sft_steps = 0 .*sft_demonstrations = \"FILE.jsonl\""):
        OrchestratorOptions(sft_steps=5)
    assert OrchestratorOptions(sft_steps=0).sft_steps == 0


def test_a_missing_or_bad_demonstrations_file_is_named(tmp_path):
    with pytest.raises(ValidationError, match=r"(?s)sft_demonstrations.*cannot read .*nope.jsonl"):
        OrchestratorOptions(sft_steps=2, sft_demonstrations=str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValidationError, match=r"bad.jsonl:1: has no assistant turn"):
        OrchestratorOptions(sft_steps=2, sft_demonstrations=str(bad))


def test_the_file_replaces_the_tasks_demonstrations_seeded_and_cycled(tmp_path):
    path = write_demos(tmp_path / "demos.jsonl", ["abc", "xyz", "post"])
    options = OrchestratorOptions(sft_steps=2, sft_batch_size=4, sft_demonstrations=path)
    demos = demonstrations(TaskMixture.single(get_task("arithmetic")), 8, options)
    assert len(demos) == 8 and demos[:3] == demos[3:6]           # every line once, then again
    assert sorted(d["messages"][1]["content"] for d in demos[:3]) == [
        "<answer>cba</answer>", "<answer>tsop</answer>", "<answer>zyx</answer>"]
    assert demonstrations(TaskMixture.single(get_task("arithmetic")), 8, options) == demos   # seeded


def test_distinct_demonstrations_are_drawn_once_and_passed_over_in_order(tmp_path):
    arithmetic = TaskMixture.single(get_task("arithmetic"))
    options = OrchestratorOptions(sft_steps=5, sft_batch_size=4, sft_distinct_demonstrations=6)
    demos = demonstrations(arithmetic, 20, options)
    fresh = demonstrations(arithmetic, 20, OrchestratorOptions(sft_steps=5, sft_batch_size=4))
    assert demos[:6] == fresh[:6] and len({json.dumps(d) for d in fresh}) > 6    # the first 6 of the same draw
    assert demos == demos[:6] * 3 + demos[:2]
    path = write_demos(tmp_path / "demos.jsonl", ["abc", "xyz", "post", "warm"])
    from_file = demonstrations(arithmetic, 5, OrchestratorOptions(sft_steps=1, sft_batch_size=5,
                                                                    sft_demonstrations=path,
                                                                    sft_distinct_demonstrations=2))
    assert from_file == from_file[:2] * 2 + from_file[:1] and from_file[0] != from_file[1]


def test_a_resume_in_the_warm_start_refuses_another_distinct_count():
    from postrain.actors.orchestrator.run_state import ResumeError, RunState, check_same_sft_shape, sft_shape
    before = OrchestratorOptions(sft_steps=5, sft_batch_size=4)
    state = RunState(phase="sft", next_batch=0, evals={}, ledger={}, ledger_events_offset=0, metrics_offset=0,
                     data_order={}, sft_step=2, sft_shape=sft_shape(before))
    check_same_sft_shape(state, before)
    with pytest.raises(ResumeError, match=r"sft_distinct_demonstrations: None -> 6"):
        check_same_sft_shape(state, OrchestratorOptions(sft_steps=5, sft_batch_size=4, sft_distinct_demonstrations=6))


def test_a_tasks_bad_demonstration_is_named_before_the_first_step():
    bad = [demo("abc"), {"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "no_loss_spans": [[0, 5]]}]}]
    task = TaskSpec("bad_demos", ArithmeticEnv, train=lambda seed, options: iter([]),
                    eval=lambda options: [], demos=lambda num, seed=0, options=None: bad[:num])
    with pytest.raises(DemonstrationError, match=r"the task's demonstration 1: messages\[1\].no_loss_spans"):
        demonstrations(TaskMixture.single(task), 2, OrchestratorOptions(sft_steps=0))


class RecordingKeeper:
    """The learner's side of the warm start: records each SFT batch (a real learner is tested in
    tests/actors/orchestrator/test_orchestrator.py)."""

    def __init__(self):
        self.batches = []

    async def step(self, batch):
        self.batches.append(batch)
        return Figures({"loss": 1.0})


class Figures(dict):
    @property
    def values(self):
        return dict(self)


class NoMetrics:
    def log(self, kind, **figures):
        return figures


def test_the_warm_start_trains_on_the_files_demonstrations_for_a_task_that_has_none(tmp_path):
    path = write_demos(tmp_path / "demos.jsonl", ["abc", "xyz"])
    options = OrchestratorOptions(sft_steps=3, sft_batch_size=2, sft_demonstrations=path)
    keeper, tokenizer, published = RecordingKeeper(), byte_tokenizer(), []

    async def publish():
        published.append(True)

    async def checkpoint(steps):
        pass

    assert trio.run(warm_start, NO_DEMOS, tokenizer, options, keeper, NoMetrics(), lambda line: None,
                    publish, checkpoint)
    assert len(keeper.batches) == 3 and published
    trained = [tokenizer.decode([t for t, m in zip(ids, mask) if m])
               for batch in keeper.batches for ids, mask in zip(batch.token_ids, batch.loss_mask)]
    assert all("<answer>cba</answer>" in text or "<answer>zyx</answer>" in text for text in trained)
