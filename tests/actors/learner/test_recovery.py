"""Surviving crashes, with real processes on a tiny budget (slow: each test is a real short run).

- every kind of actor (generator, sandbox, environment, learner) killed with SIGKILL in turn
  during one run: the run finishes, in-flight rollouts are retried, the learner is restored
  from its checkpoint plus a replay, and no update is lost or applied twice;
- chaos: seeded random kills of random actors; the ledger balances and the final
  checkpoint loads and evaluates;
- the head killed with SIGKILL: no actor outlives it, and `postrain up --resume` trains
  batches 0..N-1 exactly once each, with the same prompts per batch.
"""
import json
import random
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter, defaultdict

import anyio
import psutil
import pytest

from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.learner.recovery import is_actor_death
from postrain.actors.orchestrator.run_state import (PromptSchedule, ResumeError, batch_sample_id, check_same_data_order,
                                       cut_back, data_order, read_run_state)
from postrain.actors.records import RUN_STATE_FORMAT, RunRequest, RunState, RunUpdate
from postrain.actors.tasks import TaskMixture, get_task
from postrain.core import ActorSpec, Supervisor
from postrain.core.errors import ActorDiedError, RemoteError
from postrain.actors.orchestrator.ledger import read_events
from postrain.core.testing import async_test, to_toml
from task_runs import killable_run_specs   # tests/actors/

TASK_OPTIONS = {"include_instructions": False, "max_digits": 1}
LEARNER = {"lr": 1e-3}


def orchestrator_options(**overrides) -> dict:
    options = {"task": "arithmetic", "seed": 0, "num_steps": 5, "prompts_per_step": 2, "samples_per_prompt": 2,
               "max_staleness": 1, "sft_steps": 0, "sft_batch_size": 4, "num_eval_tasks": 2,
               "checkpoint_every": 100, "task_options": TASK_OPTIONS, "sampling": {"max_new_tokens": 24}}
    return {**options, **overrides}


def specs(orchestrator: dict) -> list[ActorSpec]:
    return killable_run_specs(orchestrator, LEARNER, TASK_OPTIONS)


async def run_with_killer(folder, orchestrator: dict, killer, resume: bool = False,
                          heartbeat_interval_s: float = 0.2) -> tuple[dict, list[str], dict[str, int]]:
    """A real run under an in-process supervisor, `killer(supervisor, lines)` running beside it;
    returns the summary, the progress lines and each actor's restarts."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, summary = [], None
    async with Supervisor.open(heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=60) as sup:
        for spec in specs(orchestrator):
            await sup.start(spec)
        async with anyio.create_task_group() as tg:
            tg.start_soon(killer, sup, lines)
            request = RunRequest(run_folder=str(folder), resume=resume)
            async for item in sup.ref("orchestrator").stream("run", request.to_wire(), timeout_s=600):
                update = RunUpdate.from_wire(item)
                if update.line is not None:
                    lines.append(update.line)
                summary = update.summary or summary
            tg.cancel_scope.cancel()
        restarts = {name: record.restarts for name, record in sup.records.items()}
    return summary, lines, restarts


async def until(predicate, timeout_s: float = 120.0) -> None:
    """Wait for a condition that heartbeats or progress lines make true."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.05)


def assert_balanced(summary: dict) -> None:
    ledger = summary["ledger"]
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"], ledger
    assert ledger["in_flight"] == 0


def final_learner(folder) -> Learner:
    learner = Learner(LearnerConfig.from_dict({**LEARNER, "model": "tiny"}))
    learner.load_checkpoint(str(folder / "checkpoint"))
    return learner


def test_actor_death_is_recognised_here_and_behind_another_actor():
    assert is_actor_death(ActorDiedError("gone"))
    assert is_actor_death(RemoteError("ActorDiedError", "actor generator disconnected"))
    assert is_actor_death(RemoteError("EnvironmentFailure", "environment raised ActorDiedError: actor sandbox ..."))
    assert not is_actor_death(RemoteError("EnvironmentFailure", "this environment dislikes sevens"))


def test_batch_prompts_are_a_function_of_seed_and_batch_index():
    task = TaskMixture.single(get_task("arithmetic"), TASK_OPTIONS)
    in_order = PromptSchedule(task, 3, 2)
    first = [in_order.prompts(b) for b in range(4)]
    jumping = PromptSchedule(task, 3, 2)
    assert jumping.prompts(2) == first[2] and jumping.prompts(0) == first[0] and jumping.prompts(3) == first[3]
    assert PromptSchedule(task, 4, 2).prompts(0) != first[0]
    assert batch_sample_id(2, 1, 0) == "b2-g1-s0" and batch_sample_id(2, 1, 0, 1) == "b2-g1-s0.r1"


def test_a_resume_that_would_change_the_data_order_is_refused(tmp_path):
    cfg = orchestrator_options(seed=0)
    state = RunState(phase="rl", next_batch=0, evals={}, ledger={}, ledger_events_offset=0, metrics_offset=0,
                     data_order=data_order(cfg))
    assert RunState.from_wire(state.to_wire()) == state and state.to_wire()["format"] == RUN_STATE_FORMAT
    check_same_data_order(state, cfg)
    with pytest.raises(ResumeError, match="data order changed \\(seed: 0 -> 1\\)"):
        check_same_data_order(state, {**cfg, "seed": 1})
    assert read_run_state(tmp_path / "checkpoint") is None, "no checkpoint yet: start from the beginning"


def test_cut_back_moves_the_tail_aside(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n')
    assert cut_back(path, len('{"a": 1}\n')) == len('{"b": 2}\n')
    assert path.read_text() == '{"a": 1}\n'
    assert (tmp_path / "ledger.rolled-back.jsonl").read_text() == '{"b": 2}\n'
    assert cut_back(path, 100) == 0


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@pytest.mark.slow
@async_test
async def test_killing_each_kind_of_actor_mid_run_loses_and_doubles_nothing(tmp_path):
    folder = tmp_path / "run"
    num_steps = 10    # room after the fourth kill: a short run could end before the env looked busy
    kills = []

    async def kill_each_kind(sup, lines):
        """After step k's line, kill the k-th kind while it has work in flight (heartbeat loads)."""
        def busy(name):
            def check():
                load = sup.records[name].load
                return load is not None and (load.running if name == "generator" else load.in_flight) > 0
            return check
        for step, name, when in [(1, "generator", busy("generator")), (2, "sandbox", busy("env")),
                                 (3, "env", busy("env")), (4, "learner", lambda: True)]:
            await until(lambda: any(line.startswith(f"step {step}/") for line in lines))
            await until(when)
            sup.kill(name)
            kills.append(name)

    # The killer sees an actor busy through its heartbeats' load: a step whose rewards are all
    # equal takes ~0.1 s, so beats every 0.2 s could miss every episode of the run.
    summary, lines, restarts = await run_with_killer(folder, orchestrator_options(num_steps=num_steps), kill_each_kind,
                                                     heartbeat_interval_s=0.01)
    assert kills == ["generator", "sandbox", "env", "learner"], (kills, lines)
    assert all(restarts[name] >= 1 for name in kills), restarts
    assert summary["steps"] == num_steps
    assert_balanced(summary)
    events = read_events(folder / "ledger.jsonl")
    assert any(e["event"] == "retry" for e in events), "the generator died with rollouts in flight"
    assert summary["learner_recoveries"] >= 1 and any(e["event"] == "replayed" for e in events)
    trained_steps = Counter(e["step"] for e in events if e["event"] == "trained")
    assert set(trained_steps) <= set(range(1, num_steps + 1)) and all(n <= 4 for n in trained_steps.values()), \
        f"no sample trained twice, no batch trained in two steps: {trained_steps}"
    # every update applied exactly once: the final checkpoint counts one optimizer step per batch
    assert final_learner(folder).step == num_steps


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@pytest.mark.slow
@async_test
async def test_chaos_random_kills_leave_a_balanced_ledger_and_a_checkpoint_that_evaluates(tmp_path):
    from postrain.cli.eval import evaluate

    folder = tmp_path / "run"
    rng = random.Random(20261130)
    kills = []

    async def chaos(sup, lines):
        # Kill k comes at a random moment soon after progress mark k, without waiting for the
        # previous victim to be back, so all three land while the run goes on however fast or
        # slow the machine is (after the last mark come three RL steps, an eval and checkpoints).
        for mark in ("held-out accuracy before", "held-out accuracy after the warm start", "step 1/"):
            await until(lambda: any(mark in line for line in lines))
            await anyio.sleep(rng.uniform(0.0, 0.5))  # chaos: a random moment, not a wait for a process
            name = rng.choice(["generator", "sandbox", "env", "learner"])
            sup.kill(name)
            kills.append(name)

    summary, lines, restarts = await run_with_killer(
        folder, orchestrator_options(num_steps=4, sft_steps=2, checkpoint_every=2), chaos)
    assert len(kills) == 3 and all(restarts[name] >= 1 for name in kills), (kills, restarts, lines)
    assert_balanced(summary)
    assert summary["steps"] == 4
    learner = final_learner(folder)
    assert learner.step == 2 + 4, "two SFT steps and four RL steps, each applied once"
    scored = await evaluate(str(folder / "policy"), "arithmetic", TASK_OPTIONS, 2, 16)
    assert scored["num_tasks"] == 2 and 0.0 <= scored["accuracy"] <= 1.0


CONFIG = """
[run]
name = "resumable"
run_dir = "{run_dir}"
driver = "orchestrator"
[head]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120
{actors}
"""


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@pytest.mark.slow
def test_head_killed_leaves_no_orphans_and_resume_trains_each_batch_once_in_the_same_order(tmp_path):
    num_steps = 5
    orchestrator = orchestrator_options(num_steps=num_steps, checkpoint_every=2)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "runs", actors=_toml_actors(orchestrator)))
    folder = tmp_path / "runs" / "resumable"
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    output = []
    for line in head.stdout:   # until step 3 is trained: one step past the checkpoint at step 2
        output.append(line)
        if line.startswith("step 3/"):
            break
    else:
        pytest.fail("the run ended before step 3:\n" + "".join(output[-40:]))
    descendants = psutil.Process(head.pid).children(recursive=True)
    actor_pids = {p.pid for p in descendants}
    head.send_signal(signal.SIGKILL)
    head.wait(timeout=30)
    head.stdout.close()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"orphans outlived the head: {[p.pid for p in alive]} of {sorted(actor_pids)}"

    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--resume", str(folder)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed at batch 2" in result.stdout
    summary = json.loads((folder / "summary.json").read_text())
    assert_balanced(summary)
    assert summary["steps"] == num_steps and summary["resumes"] == 1

    events = read_events(folder / "ledger.jsonl")
    trained = defaultdict(set)   # batch -> ids of its trained samples
    for e in events:
        if e["event"] == "trained":
            trained[e["step"] - 1].add(e["sample_id"])
    assert sorted(trained) == list(range(num_steps)), "batches 0..N-1, each trained"
    for b, ids in trained.items():
        suffixes = {sid.partition(".")[2] for sid in ids}
        assert len(suffixes) == 1 and len(ids) == 4, f"batch {b} trained once, whole: {sorted(ids)}"
    assert all(sid.endswith(".r1") for sid in trained[2] | trained[4]), "created again after the resume"
    assert all("." not in sid for sid in trained[0] | trained[1]), "trained before the checkpoint: kept"
    interrupted = [e for e in events if e["event"] == "dropped" and e["reason"] == "interrupted"]
    assert all(not e["sample_id"].endswith(".r1") for e in interrupted)
    # step 3 was trained before the kill, after the checkpoint: rolled back and trained again
    rolled_back = read_events(folder / "ledger.rolled-back.jsonl")
    assert {e["sample_id"] for e in rolled_back if e["event"] == "trained"} == {
        batch_sample_id(2, g, s) for g in range(2) for s in range(2)}
    # samples.jsonl is cut back with the ledger: one text line per trained sample, none twice
    texts = [json.loads(line)["sample_id"] for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert sorted(texts) == sorted(set().union(*trained.values()))
    # the same prompts per batch before and after the restart, as the schedule gives them
    schedule = PromptSchedule(TaskMixture.single(get_task("arithmetic"), TASK_OPTIONS), 0, 2)
    for e in events + rolled_back:
        if e["event"] == "created":
            assert e["prompt"] == schedule.prompts(e["batch"])[e["group"]][1]["question"][:80]
    assert final_learner(folder).step == num_steps, "no step trained twice or skipped"


def _toml_actors(orchestrator: dict) -> str:
    """The actor specs as TOML `[[actors]]` tables."""
    return to_toml({"actors": [spec.model_dump(include={"name", "cls", "cpus", "max_restarts", "restart_backoff_s",
                                                         "options"}) | {"memory_mb": 0}
                               for spec in specs(orchestrator)]})


# -- the warm start and evaluations ----------------------------------------------------------

RECOVERED = re.compile(r"learner recovered at version \d+ \(checkpoint v(\d+) \+ (\d+) replayed steps\)")


def checkpoint_state(folder) -> dict | None:
    """The run state of the checkpoint in place now, read without repairing anything (a learner
    may be writing the next one)."""
    try:
        return json.loads((folder / "checkpoint" / "state.json").read_text())["extra"]
    except (OSError, ValueError, KeyError):
        return None


def in_warm_start_after(folder, num_sft_steps: int):
    def check():
        state = checkpoint_state(folder)
        return state is not None and state["phase"] == "sft" and state["sft_step"] >= num_sft_steps
    return check


def head_holds_sft_checkpoint_after(folder, num_sft_steps: int):
    """The head has the reply of a warm-start checkpoint after `num_sft_steps` or more: the
    checkpoint is on disk and the step after it has its metrics row (the head takes the next step
    only once the checkpoint's reply came; a checkpoint only on disk is not yet the one it
    recovers from)."""
    def check():
        state = checkpoint_state(folder)
        if state is None or state["phase"] != "sft" or state["sft_step"] < num_sft_steps:
            return False
        try:
            rows = (folder / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return False
        return sum('"kind": "sft"' in row for row in rows) > state["sft_step"]
    return check


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@pytest.mark.slow
@async_test
async def test_warm_start_kill_replays_only_since_its_checkpoint_and_resume_continues_inside_it(tmp_path):
    """A learner killed mid-SFT is restored from the SFT checkpoint with only the steps since
    replayed; a head stopped mid-SFT is resumed from the SFT checkpoint; every SFT step is
    trained exactly once in the weights and in metrics.jsonl."""
    folder = tmp_path / "run"
    sft_steps, num_steps = 40, 2
    options = orchestrator_options(num_steps=num_steps, sft_steps=sft_steps, sft_checkpoint_every=5)

    seen: list[list[str]] = []

    async def kill_learner_then_stop(sup, lines):
        """Kill the learner after the first SFT checkpoint; stop the whole run (its supervisor
        and every actor, as a killed head does) after the fourth."""
        seen.append(lines)
        await until(head_holds_sft_checkpoint_after(folder, 5))
        sup.kill("learner")
        await until(lambda: any(RECOVERED.search(line) for line in lines))
        await until(in_warm_start_after(folder, 20))
        stop.cancel()

    with anyio.CancelScope() as stop:
        await run_with_killer(folder, options, kill_learner_then_stop)
    first_lines = seen[0]
    [(checkpoint_version, replayed)] = [tuple(map(int, m.groups())) for line in first_lines
                                        if (m := RECOVERED.search(line))]
    assert 5 <= checkpoint_version < sft_steps and replayed < 5, first_lines
    stopped_at = checkpoint_state(folder)["sft_step"]
    assert 20 <= stopped_at < sft_steps, "stopped inside the warm start"

    summary, lines, _ = await run_with_killer(folder, options, lambda sup, lines: anyio.sleep(0), resume=True)
    assert any(f"resumed in the warm start after SFT step {stopped_at}/{sft_steps}" in line for line in lines), lines
    assert not any("held-out accuracy before" in line for line in lines), "the first evaluation is not redone"
    assert summary["steps"] == num_steps and summary["resumes"] == 1 and "eval_before" in summary
    assert_balanced(summary)
    assert final_learner(folder).step == sft_steps + num_steps, "each SFT and RL step applied once"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["kind"] == "sft"]) == sft_steps, "one sft row per step after the cut-back"


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@async_test
async def test_a_stop_inside_the_warm_start_checkpoints_the_steps_done_and_resume_continues(tmp_path):
    """`postrain down` (the driver's `stop`) during the SFT steps ends the run after the step in
    progress, its checkpoint holding the steps done; a resume trains each step once."""
    folder = tmp_path / "run"
    sft_steps, num_steps = 30, 1
    options = orchestrator_options(num_steps=num_steps, sft_steps=sft_steps, sft_checkpoint_every=100)

    async def stop_after_a_few_steps(sup, lines):
        await until(lambda: any(line.startswith("sft step 11/") for line in lines))
        await sup.ref("orchestrator").tell("stop")

    summary, lines, _ = await run_with_killer(folder, options, stop_after_a_few_steps)
    assert summary is None, "a run stopped in its warm start writes no summary"
    [stopped] = [line for line in lines if line.startswith("stopped during the warm start")]
    done = checkpoint_state(folder)["sft_step"]
    assert checkpoint_state(folder)["phase"] == "sft" and 11 <= done < sft_steps
    assert f"after {done}/{sft_steps} steps" in stopped

    summary, lines, _ = await run_with_killer(folder, options, lambda sup, lines: anyio.sleep(0), resume=True)
    assert summary["steps"] == num_steps
    assert_balanced(summary)
    assert final_learner(folder).step == sft_steps + num_steps, "each SFT step applied once"


@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@async_test
async def test_an_evaluation_that_lost_episodes_to_a_kill_is_redone_not_half_counted(tmp_path):
    folder = tmp_path / "run"
    # 64 tasks: an evaluation long enough (seconds) that a kill triggered by a heartbeat's figures
    # (up to one interval old) still lands inside it, also on a loaded machine
    options = orchestrator_options(num_steps=1, num_eval_tasks=64, max_rollout_retries=0)

    async def kill_generator_mid_evaluation(sup, lines):
        await until(lambda: any("evaluating the initial policy" in line for line in lines))
        await until(lambda: (load := sup.records["generator"].load) is not None and (load.running or 0) > 0)
        assert not any("held-out accuracy before" in line for line in lines), "the kill came too late"
        sup.kill("generator")

    summary, lines, restarts = await run_with_killer(folder, options, kill_generator_mid_evaluation)
    assert restarts["generator"] >= 1
    assert summary["eval_repeats"] >= 1 and any("redoing the evaluation" in line for line in lines), lines
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    repeats = [r for r in rows if r["kind"] == "eval_repeat"]
    assert repeats and repeats[0]["phase"] == "before" and repeats[0]["num_lost"] >= 1
    assert len([r for r in rows if r["kind"] == "eval" and r["phase"] == "before"]) == 1, \
        "one reported accuracy per evaluation, from a complete pass"
    assert_balanced(summary)


# -- a full disk -------------------------------------------------------------------------------

@pytest.mark.faults   # kill and disk matrix: pytest -m faults (CI time)
@pytest.mark.slow
def test_a_full_disk_stops_the_run_cleanly_and_resume_after_freeing_space_finishes(small_disk, tmp_path):
    """A real full disk (a tmpfs run folder): filled so that the warm-start checkpoint fits and
    the first RL checkpoint does not, the run stops with one line naming the folder and what to
    do, the previous checkpoint loads, the JSONL files hold whole lines; freed, `--resume`
    finishes the run."""
    from postrain.actors.learner.state import checkpoint_info

    disk = small_disk(240 * 1024)   # `postrain up` asks for 200 MiB free at start
    num_steps = 6
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run_dir=disk, actors=_toml_actors(
        orchestrator_options(num_steps=num_steps, checkpoint_every=2, max_staleness=0))))
    folder = disk / "resumable"
    # The warm-start checkpoint holds the weights (W bytes); an RL checkpoint also holds AdamW's
    # two moments (3 W) and is written beside the one it replaces. With 2 W free before the first,
    # the warm-start checkpoint fits (W to spare for the JSONL files) and the next (4 W) cannot.
    learner = Learner(LearnerConfig.from_dict({**LEARNER, "model": "tiny"}))
    weights = sum(p.numel() * p.element_size() for p in learner.model.parameters() if p.requires_grad)
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    output = []
    for line in head.stdout:   # the learner is READY; the orchestrator, which asks for checkpoints, is not
        output.append(line)
        if line.startswith("  started learner"):
            break
    else:
        pytest.fail("the run ended before the learner started:\n" + "".join(output[-40:])
                    + head.stderr.read()[-3000:])
    # The learner writes every checkpoint and has been asked for none (the orchestrator starts after
    # it): stopped (SIGSTOP) while the disk fills, it cannot race the filling, however slow that is.
    learner_process = psutil.Process(int(re.search(r"\(pid (\d+)\)", line)[1]))
    ballast = disk / "ballast"
    learner_process.suspend()
    try:
        with open(ballast, "wb") as out:
            while shutil.disk_usage(disk).free > 2 * weights + (1 << 20):
                out.write(b"\0" * (1 << 20))
                out.flush()
    finally:
        learner_process.resume()
    rest, errors = head.communicate(timeout=300)
    output.append(rest)
    assert head.returncode == 1, "".join(output)[-3000:] + errors[-3000:]
    assert "Traceback" not in errors, errors[-3000:]
    [reason] = [line for line in errors.splitlines() if "disk full" in line]
    assert "RunStoppedError: disk full writing" in reason, reason
    assert f"disk full writing {folder}" in reason and "free space" in reason, reason
    assert f"postrain up --resume {folder}" in reason, reason

    state = read_run_state(folder / "checkpoint")
    assert state.phase == "rl" and state.next_batch == 0, "the warm-start checkpoint is in place"
    assert checkpoint_info(folder / "checkpoint")["policy_version"] == state.next_batch
    for name in ("ledger.jsonl", "metrics.jsonl"):
        data = (folder / name).read_bytes()
        assert data.endswith(b"\n") and all(json.loads(line) for line in data.splitlines()), name
    assert not (folder / "summary.json").exists()

    ballast.unlink()
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--resume", str(folder)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((folder / "summary.json").read_text())
    assert_balanced(summary)
    assert summary["steps"] == num_steps and summary["resumes"] == 1
    assert final_learner(folder).step == num_steps, "each batch trained once in the weights"
