"""An FSDP learner group (`strategy = "fsdp"`, two ranks on this host) whose rank 1 is SIGKILLed
mid-run under `postrain up`: the group restarts together, rank 0's keeper restores the sharded
(DCP) checkpoint and replays the batches trained since, and the run finishes with every step
applied once and a balanced ledger. The DDP variant of the same run is
tests/actors/learner/test_group.py; this one takes 1-2 min on 2 cores, so it sits behind
`arch_matrix`: `python -m pytest -m arch_matrix tests/actors/learner/test_fsdp_recovery.py`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from postrain.actors.orchestrator.ledger import read_events

sys.path.insert(0, str(Path(__file__).parent))
from test_group import RUN  # noqa: E402  (the DDP run of test_group.py: two learner ranks, 4 RL steps)

# checkpoints at the start of RL and at its end only: a kill after step 1 has steps to replay
FSDP_RUN = (RUN.replace("learner = {{ lr = 1e-3 }}", 'learner = {{ lr = 1e-3, strategy = "fsdp" }}')
            .replace("checkpoint_every = 2", "checkpoint_every = 4"))
STEPS, SAMPLES_PER_STEP = 4, 4


def learner_rank_pid(folder: Path, name: str) -> int:
    status = subprocess.run([sys.executable, "-m", "postrain.cli", "status", str(folder), "--json"],
                            capture_output=True, text=True, check=True)
    return next(a["pid"] for a in json.loads(status.stdout)["actors"] if a["name"] == name)


def test_a_rank_restarted_before_it_joined_reads_back_so_rank_0_counts_it_lost():
    """A restarted rank answers rank 0's probe with no generation, which travels as no key; the
    reply must read back (rank 0 then counts it lost and restarts the group) rather than fail
    the probe, which left a checkpoint save broken and the group unrestarted."""
    from postrain.actors.records import GroupState

    fresh = GroupState(generation=None, state="joining", rank=1)
    assert "generation" not in fresh.to_wire() and GroupState.from_wire(fresh.to_wire()) == fresh


@pytest.mark.slow
@pytest.mark.arch_matrix
def test_an_fsdp_rank_killed_mid_run_restarts_the_group_from_its_dcp_checkpoint_and_trains_nothing_twice(tmp_path):
    assert FSDP_RUN.count("fsdp") == 1 and "checkpoint_every = 4" in FSDP_RUN, \
        "test_group.RUN no longer reads as this test expects; update FSDP_RUN"
    (tmp_path / "run.toml").write_text(FSDP_RUN.format(run_dir=tmp_path / "runs"))
    folder = tmp_path / "runs" / "ranks"
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config",
                             str(tmp_path / "run.toml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    out, rank1, killed = [], None, None
    try:
        for line in head.stdout:
            out.append(line)
            if "held-out accuracy before" in line:     # looked up early: the kill then lands mid-RL
                rank1 = learner_rank_pid(folder, "learner-rank1")
            if f"step 1/{STEPS}:" in line and killed is None:
                killed = rank1
                os.kill(killed, signal.SIGKILL)
        assert head.wait(timeout=600) == 0, "".join(out)[-4000:]
    finally:
        if head.poll() is None:
            head.kill()
    log = "".join(out)[-4000:]
    summary = json.loads((folder / "summary.json").read_text())
    ledger = summary["ledger"]
    assert killed is not None and summary["steps"] == STEPS and summary["learner_recoveries"] >= 1, log
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["in_flight"] == 0, ledger
    crash = (folder / "logs" / "learner.log").read_text().split("actor learner crashed:\n")[1].splitlines()[0]
    assert "the learner's group" in crash and "rank 1 (learner-rank1)" in crash   # rank 0 names the lost rank
    events = read_events(folder / "ledger.jsonl")
    assert any(e["event"] == "replayed" for e in events), "the restarted group replayed since its checkpoint"
    trained = Counter(e["step"] for e in events if e["event"] == "trained")
    assert set(trained) <= set(range(1, STEPS + 1)) and all(n <= SAMPLES_PER_STEP for n in trained.values()), \
        f"no sample trained twice, no batch trained in two steps: {trained}"
    checkpoint = Path(summary["checkpoint"])
    assert sorted(p.name for p in (checkpoint / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], \
        "the group's checkpoint is sharded: one DCP file a rank"
    state = json.loads((checkpoint / "state.json").read_text())
    # every update applied exactly once: one optimizer step per warm-start batch and per RL batch
    assert state["world_size"] == 2 and state["step"] == summary["sft_steps"] + STEPS, state
