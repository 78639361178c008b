"""A learner of two ranks on one host (real processes, gloo over loopback), given its rendezvous
as `postrain up` gives it: a missing rank fails rank 0 with one line naming it within
group_timeout_s; a hung rank fails the step naming it, and the whole group then restarts
together and trains again (marked `faults`: deselected by default). Equality with one
process, checkpoints, and a run across two nodes: tests/cluster/test_learner_ranks.py."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import pytest

from postrain.actors.learner.group import interface_holding, shard_batch
from postrain.actors.learner.batch import LearnerError
from postrain.actors.records import LearnerStats
from postrain.core.config import complete_rendezvous, parse_config
from postrain.core.errors import ActorDiedError
from postrain.core.supervisor import Supervisor
from postrain.core.testing import async_test
from postrain.core.transport import free_tcp_port

sys.path.insert(0, str(Path(__file__).parent))
from test_learner_dp import CONFIG, batch  # noqa: E402  (the tiny model and its batches)

pytestmark = pytest.mark.slow


def learner_ranks(group_timeout_s: float, max_restarts: int = 0) -> list:
    """The specs of a learner entry with ranks = 2, their rendezvous completed on this host."""
    options = {"model": CONFIG["model"], "learner": {k: v for k, v in CONFIG.items() if k != "model"},
               "group_timeout_s": group_timeout_s}
    config = parse_config({"actors": [{"name": "learner", "cls": "postrain.actors.learner:LearnerActor",
                                       "ranks": 2, "cpus": 1, "memory_mb": 64, "max_restarts": max_restarts,
                                       "restart_backoff_s": 0.1, "options": options}]})
    complete_rendezvous(config.actors, lambda name: ("127.0.0.1", free_tcp_port("127.0.0.1")))
    return config.actors


async def exit_event(supervisor, name: str):
    """The first `exited` event of actor `name` (recorded already, or within 60 s)."""
    with anyio.fail_after(60):
        while not (exits := [e for e in supervisor.events if e.name == name and e.event == "exited"]):
            await anyio.sleep(0.1)
    return exits[0]


def test_ranks_expand_to_one_actor_of_several_processes():
    specs = learner_ranks(5)
    assert [s.name for s in specs] == ["learner", "learner-rank1"]
    assert [s.rendezvous.rank for s in specs] == [0, 1]
    assert specs[0].rendezvous.port == specs[1].rendezvous.port and specs[0].rendezvous.address == "127.0.0.1"
    assert interface_holding("127.0.0.1") == "lo"
    with pytest.raises(LearnerError, match="a batch of 1 samples cannot be shared by 2 learner ranks"):
        shard_batch(shard_batch(batch(0), 8)[0], 2)


@async_test
async def test_a_missing_rank_fails_rank_0_naming_it_within_the_group_timeout(tmp_path):
    rank0, _ = learner_ranks(group_timeout_s=2)
    async with Supervisor.open(log_dir=str(tmp_path)) as supervisor:
        await supervisor.start(rank0)                 # READY at once: the group forms after READY
        exited = await exit_event(supervisor, "learner")
    assert "rank 1 (learner-rank1) did not answer rank 0's call to join within group_timeout_s = 2 s" \
        in exited.detail, exited.detail


@pytest.mark.faults   # ~45 s on 2 cores: `pytest -m faults tests/actors/learner/test_group.py`
@async_test
async def test_a_hung_rank_fails_the_step_naming_it_and_every_rank_restarts_together(tmp_path):
    specs = learner_ranks(group_timeout_s=4, max_restarts=3)
    async with Supervisor.open(log_dir=str(tmp_path)) as supervisor:
        for spec in specs:
            await supervisor.start(spec)
        learner = supervisor.ref("learner")
        assert (await learner.ask("train", batch(0).to_wire(), timeout_s=120))["policy_version"] == 1
        follower = supervisor.records["learner-rank1"].pid
        os.kill(follower, signal.SIGSTOP)             # hung: alive, silent
        try:
            with pytest.raises(ActorDiedError):
                await learner.ask("train", batch(1).to_wire(), timeout_s=60)
            assert "rank 1 (learner-rank1) of the learner's group lost or restarted before train" \
                in (await exit_event(supervisor, "learner")).detail
        finally:
            os.kill(follower, signal.SIGCONT)
        # rank 0's new process calls the old rank 1 to its new group: rank 1 restarts to join it
        with anyio.fail_after(120):
            while True:
                try:
                    stats = LearnerStats.from_wire(await learner.ask("stats", timeout_s=10))
                    break
                except Exception:
                    await anyio.sleep(0.2)
        assert stats.policy_version == 0           # both restarted: the keeper restores the checkpoint
        assert supervisor.records["learner-rank1"].pid != follower
        assert (await learner.ask("train", batch(0).to_wire(), timeout_s=120))["policy_version"] == 1


RUN = """
[run]
name = "ranks"
run_dir = "{run_dir}"
driver = "orchestrator"
[shared]
model = "tiny"
task = "arithmetic"
task_options = {{ include_instructions = false, max_digits = 1 }}
[head]
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 120
[[actors]]
name = "sandbox"
cls = "postrain.actors.sandbox:SandboxActor"
cpus = 0.2
memory_mb = 0
options = {{ mode = "warm", num_workers = 1 }}
[[actors]]
name = "generator"
cls = "postrain.actors.generator:GeneratorActor"
cpus = 0.4
memory_mb = 0
options = {{ kv_cache_mb = 16 }}
[[actors]]
name = "learner"
cls = "postrain.actors.learner:LearnerActor"
cpus = 0.5
memory_mb = 0
ranks = 2
options = {{ group_timeout_s = 60, learner = {{ lr = 1e-3 }} }}
[[actors]]
name = "env"
cls = "postrain.actors.env:EnvironmentActor"
cpus = 0.1
memory_mb = 0
[[actors]]
name = "orchestrator"
cls = "postrain.actors.orchestrator:OrchestratorActor"
cpus = 0.1
memory_mb = 0
options = {{ num_steps = 4, checkpoint_every = 2, prompts_per_step = 2, samples_per_prompt = 2, \
max_staleness = 1, sft_steps = 1, sft_batch_size = 4, num_eval_tasks = 2, eval_samples_per_task = 1, \
sampling = {{ max_new_tokens = 16 }} }}
"""


@pytest.mark.faults   # ~1-2 min on 2 cores: `pytest -m faults tests/actors/learner/test_group.py`
def test_a_run_whose_learner_rank_is_killed_restarts_the_ranks_together_and_balances(tmp_path):
    """`postrain up` with the learner on two ranks on this host; rank 1 is SIGKILLed after the
    first RL step: the group restarts together, the keeper restores and replays, and the run
    finishes with every step applied once and a balanced ledger."""
    import json
    import subprocess

    (tmp_path / "run.toml").write_text(RUN.format(run_dir=tmp_path / "runs"))
    folder = tmp_path / "runs" / "ranks"
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                             str(tmp_path / "run.toml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    out = []
    try:
        for line in head.stdout:
            out.append(line)
            if "step 1/4:" in line:
                status = subprocess.run([sys.executable, "-m", "postrain.cli", "status", str(folder), "--json"],
                                        capture_output=True, text=True, check=True)
                status = json.loads(status.stdout)
                rank1 = next(a for a in status["actors"] if a["name"] == "learner-rank1")
                os.kill(rank1["pid"], signal.SIGKILL)
        assert head.wait(timeout=600) == 0, "".join(out)[-4000:]
    finally:
        if head.poll() is None:
            head.kill()
    summary = json.loads((folder / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 4 and summary["learner_recoveries"] >= 1, "".join(out)[-4000:]
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["in_flight"] == 0
    crash = (folder / "logs" / "learner.log").read_text().split("actor learner crashed:\n")[1].splitlines()[0]
    assert "the learner's group" in crash and "rank 1 (learner-rank1)" in crash   # rank 0 names the lost rank
