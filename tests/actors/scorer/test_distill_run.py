"""On-policy distillation end to end, with real processes and the tiny model: the shipped
distill config runs a short `postrain up` from a fresh student to the end (the teacher a tiny
policy of another seed, in a folder: the same byte tokenizer); a teacher SIGKILLed while it
scores is restarted and the run finishes with its ledger balanced, no sample trained without
its teacher's rows (marked `faults`: a second real run, ~1 min on 2 loaded cores)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from model_folders import tiny_policy_folder   # tests/actors/
from task_runs import killable_run_specs   # tests/actors/

from postrain.actors.orchestrator.ledger import read_events
from postrain.actors.records import RunRequest, RunUpdate
from postrain.core import ActorSpec, Supervisor
from postrain.core.testing import async_test

CONFIGS = Path(__file__).resolve().parents[3] / "actors" / "configs"
TASK_OPTIONS = {"include_instructions": False, "max_digits": 1}


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    """A tiny policy of another seed, saved as `postrain up` exports one (a Hugging Face folder)."""
    return tiny_policy_folder(tmp_path_factory.mktemp("teacher") / "policy", seed=1)


def assert_every_sample_trained_or_dropped_with_a_reason(summary: dict, folder: Path) -> list[dict]:
    ledger = summary["ledger"]
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["in_flight"] == 0, ledger
    events = read_events(folder / "ledger.jsonl")
    last = {}
    for event in events:
        if event["event"] in ("created", "generated", "rewarded", "trained", "dropped"):
            last[event["sample_id"]] = event
    assert all(e["event"] in ("trained", "dropped") for e in last.values())
    assert all(e.get("reason") for e in last.values() if e["event"] == "dropped")
    return events


def train_rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row.get("kind") == "train"]


@pytest.mark.slow
def test_the_distill_config_distils_a_fresh_student_from_a_teacher_folder(tmp_path, teacher_folder):
    sets = [f"teacher.model={teacher_folder}", f"run.run_dir={tmp_path / 'runs'}", "sandbox.num_workers=1",
            "orchestrator.num_steps=3", "orchestrator.prompts_per_step=2", "orchestrator.samples_per_prompt=2",
            "orchestrator.num_eval_tasks=2", "orchestrator.eval_samples_per_task=0",
            "orchestrator.sampling.max_new_tokens=24"]
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                             str(CONFIGS / "distill.toml"), *[a for s in sets for a in ("--set", s)]],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "runs" / "distill"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] and summary["steps"] == 3 and summary["sft_steps"] == 0
    assert_every_sample_trained_or_dropped_with_a_reason(summary, folder)
    assert summary["samples"] >= 1
    rows = train_rows(folder)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(math.isfinite(row["distill_kl"]) and row["distill_kl"] > 0 for row in rows), rows
    assert "distill_kl" in result.stdout          # the progress line shows it
    # the KL teaches every sample: a step whose rewards are all equal is no "no learning signal"
    warnings = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert not any(row.get("code") == "no_learning_signal" for row in warnings)
    assert (folder / "policy" / "model.safetensors").is_file(), "the student is exported like any policy"


def specs(teacher_model: str, orchestrator: dict, learner: dict) -> list[ActorSpec]:
    teacher = ActorSpec(name="teacher", cls="postrain.actors.scorer:ScorerActor", cpus=0.3,
                        options={"model": teacher_model, "serves": "logprobs", "top_k": 16, "kv_cache_mb": 16})
    return killable_run_specs(orchestrator, learner, TASK_OPTIONS, extra=(teacher,))


async def until(predicate, timeout_s: float = 120.0) -> None:
    """Wait for a condition that heartbeats or progress lines make true."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.01)


@pytest.mark.faults   # a real run with a kill, beside the learner's recoveries: pytest -m faults (CI time)
@pytest.mark.slow
@async_test
async def test_a_teacher_killed_while_it_scores_is_restarted_and_no_sample_trains_without_its_rows(
        tmp_path, teacher_folder):
    """GRPO with distill_coef (the KL beside the task's reward); the teacher is SIGKILLed once a
    step has trained and a score_tokens call is in its hands (its heartbeats' load)."""
    folder, num_steps = tmp_path / "run", 6   # room after step 1 for a call in the teacher's hands
    folder.mkdir()
    orchestrator = {"task": "arithmetic", "seed": 0, "num_steps": num_steps, "prompts_per_step": 2,
                    "samples_per_prompt": 2, "max_staleness": 1, "sft_steps": 0, "num_eval_tasks": 0,
                    "task_options": TASK_OPTIONS, "sampling": {"max_new_tokens": 24}, "teacher": "teacher"}
    learner = {"lr": 1e-3, "distill_coef": 0.5}      # the default PPO loss on GRPO advantages, + 0.5 x KL
    lines: list[str] = []
    summary = None
    async with Supervisor.open(heartbeat_interval_s=0.01, heartbeat_timeout_s=60) as sup:
        for spec in specs(str(teacher_folder), orchestrator, learner):
            await sup.start(spec)

        async def kill_the_teacher_while_it_scores():
            await until(lambda: any(line.startswith("step 1/") for line in lines))
            await until(lambda: (load := sup.records["teacher"].load) is not None and load.in_flight > 0)
            sup.kill("teacher")

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_the_teacher_while_it_scores)
            request = RunRequest(run_folder=str(folder))
            async for item in sup.ref("orchestrator").stream("run", request.to_wire(), timeout_s=600):
                update = RunUpdate.from_wire(item)
                if update.line is not None:
                    lines.append(update.line)
                summary = update.summary or summary
            tg.cancel_scope.cancel()
        restarts = sup.records["teacher"].restarts
    assert summary is not None, lines
    assert restarts >= 1 and summary["teacher_retries"] >= 1, (restarts, summary)
    assert summary["complete"] and summary["steps"] == num_steps
    events = assert_every_sample_trained_or_dropped_with_a_reason(summary, folder)
    dropped = [e for e in events if e["event"] == "dropped"]
    assert all("teacher" in e["reason"] for e in dropped), dropped   # none lost for another reason
    trained = [e["sample_id"] for e in events if e["event"] == "trained"]
    assert len(trained) == len(set(trained)), "no sample trained twice"
    rows = train_rows(folder)
    assert [row["step"] for row in rows] == list(range(1, num_steps + 1))
    # every step distilled: a batch without the teacher's rows is refused by a distilling learner
    assert all(math.isfinite(row["distill_kl"]) and row["distill_kl"] > 0 for row in rows), rows
